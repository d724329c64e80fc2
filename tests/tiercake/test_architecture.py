"""The package map of docs/ARCHITECTURE.md, enforced: every import between tiercake's parts points
down the layers (an upward import, even one inside a function, fails here)."""

import ast

from paths import ROOT

# the shared types every part may use; the rest of ``tiercake/`` (CLI, bench, replay, up) is the top
BASE = {
    "tiercake",
    "tiercake.blocks",
    "tiercake.config",
    "tiercake.credentials",
    "tiercake.dead_peer",
    "tiercake.errors",
    "tiercake.heap",
    "tiercake.messages",
    "tiercake.metrics",
    "tiercake.loop_lag",
    "tiercake.loop_thread",
    "tiercake.plugins",
    "tiercake.started",
    "tiercake.tokenizer",
    "tiercake.traces",
}
# lowest first: a part imports only from its own layer and the ones before it
LAYERS = ["base", "policies", "analysis", "tiers", "transfer", "conductor", "workers", "top"]
PARTS = {"policies", "analysis", "tiers", "transfer", "conductor", "workers"}
# imports across a layer that are allowed only into these modules (the conductor's public client)
NARROW = {("workers", "conductor"): {"tiercake.conductor.client"}}


def part_of(module: str) -> str:
    pieces = module.split(".")
    if len(pieces) > 1 and pieces[1] in PARTS:
        return pieces[1]
    return "base" if ".".join(pieces[:2]) in BASE else "top"


def imports() -> list[tuple[str, str, str]]:
    """(importing module, file:line, imported module) for every import of tiercake in the package."""
    found = []
    folders = {"tiercake": "tiercake", **{p: f"tiercake.{p}" for p in PARTS}}
    for folder, package in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            module = ".".join([package, *parts])
            here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = here[: len(here) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                    names = [target] if node.module or not node.level else [f"{target}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if name and name.startswith("tiercake"):
                        found.append((module, f"{path.relative_to(ROOT)}:{node.lineno}", name))
    return found


def violations(edges: list[tuple[str, str, str]]) -> list[str]:
    bad = []
    for module, where, target in edges:
        src, dst = part_of(module), part_of(target)
        if LAYERS.index(dst) > LAYERS.index(src):
            bad.append(f"{where}: {src} imports {target} ({dst} is above it)")
        elif (src, dst) in NARROW and not any(target == m or target.startswith(m + ".") for m in NARROW[(src, dst)]):
            bad.append(f"{where}: {src} may use only {sorted(NARROW[(src, dst)])} of {dst}, not {target}")
    return bad


def test_every_import_points_down_the_layers():
    edges = imports()
    assert len(edges) > 100  # the walk found the package
    assert violations(edges) == []


def test_the_check_catches_an_upward_import():
    assert violations([("tiercake.tiers.store", "tiers/store.py:1", "tiercake.conductor.client")])
    assert violations([("tiercake.policies.lru", "policies/x.py:1", "tiercake.bench.report")])
    assert violations([("tiercake.policies.routing", "policies/routing.py:1", "tiercake.analysis.cluster_sim")])
    assert violations([("tiercake.workers.worker", "workers/worker.py:1", "tiercake.conductor.service")])
    assert not violations([("tiercake.workers.worker", "workers/worker.py:1", "tiercake.conductor.client")])
    assert not violations([("tiercake.cli", "tiercake/cli.py:1", "tiercake.workers.worker")])


def import_graph() -> dict[str, set[str]]:
    """Module -> the tiercake modules it imports, at its top or inside a function (``TYPE_CHECKING``
    blocks aside: they never run). ``from P import name`` is an edge to the module ``P.name`` where
    that is a module, else to ``P``."""
    files = {}
    folders = {"tiercake": "tiercake", **{p: f"tiercake.{p}" for p in PARTS}}
    for folder, package in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            files[".".join([package, *parts])] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for n in ast.walk(block)
        }
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                for alias in node.names:
                    targets.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_two_modules_import_each_other_even_inside_a_function():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_tests_mirror_the_packages():
    """Every test module sits in the folder of the part it tests (``tests/cluster/``: the whole
    system), so a part's tests are found where the part is; none lies loose in ``tests/``."""
    folders = {"tiercake", "kvstore", "deploy", "cluster", *PARTS}
    tests = ROOT / "tests"
    assert not list(tests.glob("test_*.py")), "a test module directly in tests/"
    placed = {p.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")}
    assert placed == folders, placed ^ folders  # each part has its tests, in no other folder


MAX_FUNCTION_LINES = 80  # the argument parsers included
MAX_CLASS_LINES = 350  # in the services: conductor/ and workers/
MAX_MODULE_LINES = 800


def module_of(root, folder: str, path) -> str:
    """The dotted name a file of ``folder`` is imported as (the parts are installed as tiercake.*)."""
    rel = path.relative_to(root / folder).with_suffix("")
    package = "tiercake" if folder == "tiercake" else f"tiercake.{folder}"
    return ".".join([package, *(p for p in rel.parts if p != "__init__")])


def class_lines(root=ROOT) -> dict[str, tuple[int, int]]:
    """Every class of the package, by ``module.Class``: (its own lines, with its mixins'), a mixin
    being any base class of the package that is not a contract (an ``ABC`` or ``Protocol``): a class
    split over files is one class, however its parts are spread."""
    names: dict[str, dict[str, str]] = {}  # module -> a name it binds -> what it names
    defined: dict[str, tuple[int, list[str], bool]] = {}  # module.Class -> (lines, bases, a contract)
    for folder in ("tiercake", *sorted(PARTS)):
        for path in (root / folder).rglob("*.py"):
            module = module_of(root, folder, path)
            here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            bound = names.setdefault(module, {})
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    target = base if node.level else (node.module or "")
                    bound.update({a.asname or a.name: f"{target}.{a.name}" for a in node.names})
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b) for b in node.bases]
                    contract = any(b.split(".")[-1] in ("ABC", "Protocol") for b in bases)
                    bound[node.name] = f"{module}.{node.name}"
                    defined[f"{module}.{node.name}"] = (node.end_lineno - node.lineno + 1, bases, contract)

    def resolve(module: str, name: str, hops: int = 0) -> str | None:
        """The class a name bound in ``module`` is, following re-exports."""
        target = names.get(module, {}).get(name)
        if target is None or target in defined or hops > 5:
            return target
        owner, _, short = target.rpartition(".")
        return resolve(owner, short, hops + 1)

    def total(qualified: str, seen: frozenset = frozenset()) -> int:
        lines, bases, _ = defined[qualified]
        module = qualified.rpartition(".")[0]
        for base in bases:
            mixin = resolve(module, base)
            if mixin in defined and mixin not in seen and not defined[mixin][2]:
                lines += total(mixin, seen | {qualified})
        return lines

    return {q: (defined[q][0], total(q)) for q in defined}


def sizes(root=ROOT) -> list[str]:
    """What is over the limits: a function that needs a scroll, a service class with several jobs
    (its mixins counted with it), a module too long to hold in mind."""
    over = []
    for part in ("tiercake", *sorted(PARTS)):
        for path in sorted((root / part).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(root)
            if text.count("\n") > MAX_MODULE_LINES:
                over.append(f"{name}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                    over.append(f"{name}: {node.name} is {lines} lines")
    for qualified, (own, whole) in class_lines(root).items():
        if qualified.split(".")[1] in ("conductor", "workers") and whole > MAX_CLASS_LINES:
            mixins = "" if whole == own else f" with its mixins ({own} of its own)"
            over.append(f"class {qualified} is {whole} lines{mixins}")
    return over


def test_no_function_class_or_module_past_its_size():
    assert sizes() == []


def test_the_size_check_finds_a_long_function(tmp_path):
    (tmp_path / "workers").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "workers" / "long.py").write_text(f"def long():\n{body}")
    for part in ("tiercake", *PARTS):
        (tmp_path / part).mkdir(exist_ok=True)
    assert sizes(tmp_path) == [f"workers/long.py: long is {MAX_FUNCTION_LINES + 1} lines"]


def test_the_size_check_counts_a_class_with_its_mixins(tmp_path):
    """Split over two files, neither part past the limit, the class is still one class; a contract
    (an ABC) it implements is not counted with it."""
    for part in ("tiercake", *PARTS):
        (tmp_path / part).mkdir(exist_ok=True)
    half = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 3))
    (tmp_path / "workers" / "mixin.py").write_text(f"class Half:\n{half}")
    (tmp_path / "workers" / "contract.py").write_text(f"from abc import ABC\n\n\nclass Engine(ABC):\n{half}")
    (tmp_path / "workers" / "server.py").write_text(
        f"from .mixin import Half\nfrom .contract import Engine\n\n\nclass Server(Half, Engine):\n{half}"
    )
    own = 1 + 2 * (MAX_CLASS_LINES // 3)
    assert sizes(tmp_path) == [
        f"class tiercake.workers.server.Server is {2 * own} lines with its mixins ({own} of its own)"
    ]


def message_classes(root=ROOT) -> dict[str, list[str]]:
    """Every class of a module that defines what crosses a process (it uses msgspec or pydantic),
    by name: where each is defined."""
    found: dict[str, list[str]] = {}
    for folder in ("tiercake", *sorted(PARTS)):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            if "msgspec" not in text and "pydantic" not in text:
                continue
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef) and node.bases:
                    found.setdefault(node.name, []).append(str(path.relative_to(root)))
    return found


def test_no_two_message_classes_share_a_name():
    """A reader of a trace or a log, or an import, never mistakes one message for another."""
    assert {name: where for name, where in message_classes().items() if len(where) > 1} == {}


def test_the_type_check_leaves_no_module_out():
    """mypy (``make lint``) checks every module, the bodies of untyped functions too: no module may be
    put back under ``ignore_errors``, nor the untyped bodies left unchecked."""
    import tomllib

    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy.get("check_untyped_defs") is True
    assert [o["module"] for o in mypy.get("overrides", []) if o.get("ignore_errors")] == []
