"""The README as printed: every command block runs from the repository's root as a user's terminal
would run it, every Python block runs as a program, the command table names every command the CLI
has, and nothing any of it started is left in /dev/shm."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import README as README_PATH
from paths import ROOT
from up_helpers import left_in_shm

README = README_PATH.read_text()
REPO = ROOT
ANSWER = re.compile(r"cached prompt tokens (\d+)/(\d+)")


def _section(title: str) -> str:
    """The text of the README's section (any level) whose title starts with ``title``, up to the next
    heading (a ``#`` line inside a code block is a shell comment, not a heading)."""
    lines, inside, fenced = [], False, False
    for line in README.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = not fenced and re.match(r"#+ ", line)
        if heading and inside:
            break
        if heading and line.lstrip("#").strip().startswith(title):
            inside = True
            continue
        if inside:
            lines.append(line)
    assert inside, title
    return "\n".join(lines) + "\n"


def _python(title: str) -> str:
    return _section(title).split("```python", 1)[1].split("```", 1)[0]


def _commands(title: str, index: int = 0) -> list[str]:
    """The shell commands of the ``index``-th plain (shell) code block of a section, without comments."""
    blocks = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```$", _section(title), re.M | re.S) if not lang]
    lines = [line.split("  #", 1)[0].strip() for line in blocks[index].splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_every_python_block_is_run_by_a_test_and_the_readme_stays_short():
    """A snippet added without a test of its own fails here; so does a README past 350 lines."""
    tested = {"The two commands", "Key-value store", "The store from Python", "Writing a policy"}
    titled = [_section(t) for t in tested]
    assert README.count("```python") == sum(s.count("```python") for s in titled) == 4
    assert len(README.splitlines()) < 350


class Server:
    """A command of the README that keeps running (``make run``, ``tiercake up``), started as a user's
    terminal would (its own process group: Ctrl-C reaches make and what it runs)."""

    def __init__(self, command: str, ready: str, timeout: float, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            command,
            shell=True,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.wait_for(ready, timeout)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"not {text!r} in {timeout} s:\n" + "".join(self.lines)[-3000:]
            line = self.proc.stdout.readline()
            assert line, "it exited:\n" + "".join(self.lines)[-3000:]
            self.lines.append(line)

    def ctrl_c(self) -> float:
        """Ctrl-C; how long until it and everything it started were gone."""
        sent = time.monotonic()
        with contextlib.suppress(ProcessLookupError):  # it and all it started may have exited already
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.lines += self.proc.stdout.readlines()
        return time.monotonic() - sent


def _run(command: str, env: dict | None = None, cwd: Path = REPO) -> str:
    done = subprocess.run(
        command,
        shell=True,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


async def _until_the_pool_holds_blocks(conductor: str, token: str, timeout: float = 60) -> None:
    """Until the node's pool holds some indexed bytes (vLLM saves in the background)."""
    from tiercake.conductor.client import Client

    async with Client([conductor], token=token) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = await client.cluster()
            if any(m.role == "node" and m.indexed_bytes.get("pool", 0) > 0 for m in view.members):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError("the pool never held the prompt's blocks")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_quick_start_and_the_python_and_key_value_examples_against_make_run():
    """The quick start as printed, from the repository's root: make run, the same question twice (the
    second from the cache); then, against that cluster, the two commands' Python example and the
    key-value store's export and example. Ctrl-C stops it within 5 s and nothing is left in /dev/shm."""
    commands = _commands("Quick start")
    assert [c.split()[:3] for c in commands] == [
        ["make", "run"],
        [".venv/bin/tiercake", "ask", '"Hello,'],
        [".venv/bin/tiercake", "ask", '"Hello,'],
    ], commands
    before = set(os.listdir("/dev/shm"))
    cluster = Server(commands[0], "tiercake is up:", 600)
    cluster.wait_for("Ctrl-C stops everything", 30)
    assert any("note: no API keys are configured" in line for line in cluster.lines)  # the shared cache, said
    try:
        _run(commands[1])
        cached, prompt = map(int, ANSWER.search(_run(commands[2])).groups())
        assert 0 < cached <= prompt
        (REPO / ".tiercake" / "client-example.py").write_text(_python("The two commands"))
        assert "cached_tokens" in _run(".venv/bin/python .tiercake/client-example.py")
        (export,) = _commands("Key-value store")
        (REPO / ".tiercake" / "kv-example.py").write_text(_python("Key-value store"))
        _run(f"{export} && .venv/bin/python .tiercake/kv-example.py")
    finally:
        took = cluster.ctrl_c()
    assert took < 5, took
    assert left_in_shm(before) == set()


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_under_vllm_as_printed():
    """The vLLM quick start as printed: a model made here, tiercake up under vLLM (saying what it waits
    for while vLLM starts) and the question twice, the same answer, the second from a cache. Ctrl-C
    stops it within a few seconds and nothing is left in /dev/shm. (That up restarts a vLLM server that
    dies, and the restarted one loads from the pool, is test_vllm's up test.)"""
    commands = _commands("Under vLLM")
    assert [c.split()[:3] for c in commands] == [
        [".venv/bin/tiercake", "model", "make"],
        [".venv/bin/tiercake", "up", "--engine"],
        [".venv/bin/tiercake", "ask", '"Hello,'],
        [".venv/bin/tiercake", "ask", '"Hello,'],
    ], commands
    before = set(os.listdir("/dev/shm"))
    _run(commands[0])
    vllm = Server(commands[1], "tiercake is up under vLLM", 900)
    assert any("waiting for vLLM at" in line for line in vllm.lines)  # never minutes of silence
    try:
        first = _run(commands[2]).splitlines()[0]
        again = _run(commands[3])
        assert again.splitlines()[0] == first and int(ANSWER.search(again).group(1)) > 0
    finally:
        took = vllm.ctrl_c()
    # "within a few seconds": a vLLM server gets up's 3 s grace before SIGKILL, and under CI's load the
    # whole stop once took 5.3 s
    assert took < 8, took
    assert left_in_shm(before) == set()


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_your_own_vllm_server_over_up_no_engine_as_printed():
    """The storage side alone (up --no-engine), and vLLM started by hand as printed, with the
    environment file and the connector config up wrote: its answer says the connector ran, and the
    node's pool then holds the prompt's blocks, saved by the connector. Both stop on Ctrl-C, and
    nothing is left in /dev/shm."""
    commands = _commands("Your own vLLM server")
    assert [c.split()[:3] for c in commands] == [
        [".venv/bin/tiercake", "up", "--no-engine"],
        ["set", "-a;", "."],
        ["VLLM_CPU_KVCACHE_SPACE=1", ".venv/bin/python", "-m"],
        ["curl", "-s", "http://127.0.0.1:8300/v1/completions"],
    ], commands
    model = commands[2].split("--model", 1)[1].split()[0]
    if not (Path(model) / "config.json").exists():  # the vLLM quick start makes it; this test may run first
        _run(_commands("Under vLLM")[0])
    before = set(os.listdir("/dev/shm"))
    data_dir = Path(commands[0].split("--data-dir", 1)[1].split()[0])
    storage = Server(commands[0], "tiercake is up (no engine)", 300)
    vllm = None
    try:
        vllm = Server(f"{commands[1]}; {commands[2]}", "Application startup complete", 600)
        answer = _run(commands[3])
        assert '"tiercake"' in answer and '"namespace"' in answer, answer  # the connector's own figures
        conductor = re.search(r"conductor (http://\S+?),", "".join(storage.lines)).group(1)
        asyncio.run(_until_the_pool_holds_blocks(conductor, (data_dir / "control-token").read_text().strip()))
    finally:
        took = [server.ctrl_c() for server in (vllm, storage) if server is not None]
    assert max(took) < 8, took
    assert left_in_shm(before) == set()


@pytest.mark.cluster
@pytest.mark.timeout(400)
@pytest.mark.skipif(os.geteuid() != 0, reason="the lab makes network namespaces: it needs root (CI runs as root)")
def test_across_hosts_as_printed():
    """The lab's three commands: up prints the front's URL (the one printed, unless another lab on
    this machine holds that network: then the one it chose, which the user copies), ask answers
    through it, down takes the lab away and up exits."""
    commands = _commands("Across hosts")
    assert [c.split()[:3] for c in commands] == [
        [".venv/bin/tiercake", "lab", "up"],
        [".venv/bin/tiercake", "ask", '"Hello,'],
        [".venv/bin/tiercake", "lab", "down"],
    ], commands
    printed = re.search(r"tiercake lab is up: (\S+)", _section("Across hosts")).group(1)
    assert printed in commands[1], (printed, commands[1])
    lab = Server(commands[0], "tiercake lab is up: ", 300)
    try:
        url = re.search(r"tiercake lab is up: (\S+)", "".join(lab.lines)).group(1)
        assert re.fullmatch(r"http://198\.18\.\d+\.11:8080", url), url
        answer = _run(commands[1].replace(printed, url))
        assert ANSWER.search(answer), answer
        down = _run(commands[2])
        assert "tiercake lab is down" in down, down
        lab.proc.wait(60)
    finally:
        lab.ctrl_c()
    assert "tiercake lab is down" in "".join(lab.lines)


@pytest.mark.cluster
def test_the_store_example_runs_and_leaves_nothing_in_shm(tmp_path):
    """The Python block of "The store from Python", as a program: it runs, with torch importable or
    not, and its pool file is gone after it."""
    (tmp_path / "example.py").write_text(_python("The store from Python"))
    before = set(os.listdir("/dev/shm"))
    for blocked in ("", "import sys; sys.modules['torch'] = None; "):
        done = subprocess.run(
            [sys.executable, "-c", f"{blocked}exec(open('example.py').read())"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "read from pool" in done.stdout, done.stderr[-3000:]
    assert left_in_shm(before, ours="tiercake-example-") == set()


def test_the_policy_example_is_a_whole_policy():
    namespace: dict = {}
    exec(_python("Writing a policy"), namespace)  # noqa: S102 - the README's own code
    policy = namespace["Fifo"]()
    for key in "abc":
        policy.on_insert(key)
    policy.on_access("a")
    assert policy.victims(2, can_evict=lambda k: k != "a") == ["b", "c"]
    assert len(policy) == 1 and "a" in policy and "b" not in policy
    policy.on_remove("a")
    policy.on_remove("a")  # idempotent
    assert len(policy) == 0


@pytest.mark.cluster
def test_the_policy_is_scored_on_a_trace_as_printed(tmp_path):
    """The policy saved as the README says, then its two commands as printed, in a folder of their own
    (``.venv`` there is the checkout's)."""
    (tmp_path / "my_policies.py").write_text(_python("Writing a policy"))
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    for command in _commands("Writing a policy"):
        _run(command, cwd=tmp_path)
    assert (tmp_path / "mine.png").read_bytes()[:4] == b"\x89PNG"
    figures = (tmp_path / "mine.json").read_text()
    assert "hit_ratio.my_policies:Fifo" in figures and "hit_ratio.optimum" in figures


def test_the_command_table_names_every_command():
    """The README's command table and the CLI's commands are the same set."""
    from tiercake.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    table = _section("Command line")
    named = set(re.findall(r"`tiercake ([a-z][a-z-]*)", table))
    assert named == set(sub.choices), set(sub.choices) ^ named


@pytest.mark.cluster
def test_make_check_selects_the_tests_that_start_no_process():
    """``make check`` as the README describes it (collecting only: running it is the loop itself)."""
    done = subprocess.run(
        [
            "make",
            "check",
            "CHECK_WORKERS=0",
            "PYTEST_ARGS=--collect-only -q tests/tiercake/test_blocks.py tests/cluster/test_serving.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    per_file = dict(re.findall(r"^(tests/\S+\.py): (\d+)$", done.stdout, re.M))  # what -q -q prints
    assert int(per_file["tests/tiercake/test_blocks.py"]) > 10 and "tests/cluster/test_serving.py" not in per_file


DOCS = ROOT / "docs"


@pytest.mark.parametrize("doc", ["CONFIG.md", "SESSIONS.md", "VLLM.md"])
def test_the_configs_the_docs_print_are_valid_and_their_policies_build(tmp_path, doc):
    """Every YAML config of these pages loads as the config model and names policies that build."""
    from tiercake.config import load_config
    from tiercake.policies import create_eviction

    blocks = re.findall(r"^```yaml\n(.*?)^```$", (DOCS / doc).read_text(), re.M | re.S)
    assert blocks
    for i, block in enumerate(blocks):
        (tmp_path / f"{i}.yaml").write_text(block)
        config = load_config(tmp_path / f"{i}.yaml")
        for tier in config.store.tiers:
            create_eviction(tier.eviction, tier.eviction_params)


def test_the_sessions_page_config_builds_session_policies(tmp_path):
    from tiercake.config import load_config
    from tiercake.policies import SessionAware, create_eviction

    block = re.findall(r"^```yaml\n(.*?)^```$", (DOCS / "SESSIONS.md").read_text(), re.M | re.S)[0]
    (tmp_path / "sessions.yaml").write_text(block)
    config = load_config(tmp_path / "sessions.yaml")
    assert config.store.session_prefetch_lead_s == 1.0
    policies = [create_eviction(t.eviction, t.eviction_params) for t in config.store.tiers]
    assert all(isinstance(p, SessionAware) for p in policies)
    assert policies[0].tenant_quota == 4 << 30 and policies[0].tenant_floor == 512 << 20
