"""Every check the project has for a GPU, in one run of under five minutes, for when a machine with one
is lent: ``python3 tiercake/gpu_check.py --out DIR`` from the checkout's root.

Design note. A lent GPU machine comes bare for a few minutes: its Python has torch and most of the
scientific stack but not all of tiercake's requirements, and reaches no registry. So this file runs on
the standard library until it has installed what it needs: the wheels ``make gpu-wheels`` saved into
``.whl/`` (Python 3.12, what the GPU image lacks), then tiercake itself, into a folder of its own that
every later step finds on ``PYTHONPATH``. Where tiercake already imports (a developer's venv) it
installs nothing. Each step runs as a child under its own time limit, its output in ``DIR``; a step
that fails or overruns does not stop the others, and the run's summary (``gpu-check.json``) names
every step's exit, seconds and log. ``--device cpu`` runs the same steps on the CPU (the suite does,
so this file is known to run as printed before a GPU is at hand).

The steps:

- ``device``: what torch sees (name, memory, capability), or that it sees no GPU.
- ``tests``: the tests of code with a GPU path, their KV on the device (``TIERCAKE_TEST_DEVICE``): the
  vLLM connector's layer-by-layer loads (the pinned buffer, the copies on a side stream, the wait of
  the pass's stream), its worker side over a real pool, and the gpu tier.
- ``bench``: ``tiercake bench vllm-kv --device D --quick``: loads into KV on the device against a copy
  from pinned host memory in the same run (``vllm-kv-D.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/workers/test_vllm_loading.py", "tests/workers/test_vllm_worker_side.py", "tests/tiers/test_gpu.py"]
STEPS = ("device", "tests", "bench")
LIMIT_S = {"install": 90, "device": 30, "tests": 120, "bench": 150}  # together under five minutes

DEVICE_REPORT = """
import json, sys, torch
wanted = sys.argv[1]
if not torch.cuda.is_available():
    print(json.dumps({"cuda": False, "torch": torch.__version__}))
    sys.exit(0 if wanted == "cpu" else f"--device {wanted}: torch sees no GPU here")
p = torch.cuda.get_device_properties(0)
print(json.dumps({"cuda": True, "torch": torch.__version__, "name": p.name, "capability": [p.major, p.minor],
                  "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}))
"""


def _run(name: str, argv: list[str], out: Path, env: dict[str, str], limit: float) -> dict[str, object]:
    """One step as a child, its output in ``out/<name>.log``: its exit code (None: it overran)."""
    log = out / f"{name}.log"
    started = time.monotonic()
    with open(log, "wb") as sink:
        try:  # from ``out``: in the checkout's root, its tiercake/ folder would hide the installed package
            code: int | None = subprocess.run(
                argv, cwd=out, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=limit
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    return {"exit": code, "seconds": round(time.monotonic() - started, 1), "log": log.name}


def _install(site: Path, out: Path, env: dict[str, str]) -> dict[str, object] | None:
    """The carried wheels, then tiercake, into ``site`` (None: tiercake already imports here without
    it). Installed again on every run: the checkout may have changed since the last one."""
    probe = subprocess.run([sys.executable, "-c", "import tiercake.workers"], cwd="/", capture_output=True)
    if probe.returncode == 0:
        return None
    wheels = sorted(str(w) for w in (ROOT / ".whl").glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    script = " && ".join(
        shlex.join(argv)
        for argv in (
            [*pip, "--target", str(site), *wheels] if wheels else ["true"],
            [*pip, "--no-build-isolation", "--target", str(site), str(ROOT)],
        )
    )
    return _run("install", ["sh", "-c", script], out, env, LIMIT_S["install"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python3 tiercake/gpu_check.py")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")), help="logs and figures")
    parser.add_argument("--device", default="cuda", help="cuda (the default), or cpu: the same steps on the CPU")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"some of {','.join(STEPS)}")
    parser.add_argument("--site", type=Path, default=Path("/tmp/tiercake-gpu-site"), help="where to install")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    if not steps or any(s not in STEPS for s in steps):
        parser.error(f"--steps: some of {','.join(STEPS)}, comma-separated")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIERCAKE_TEST_DEVICE": args.device}
    # its tests are a run of their own: run from within a test suite, the suite's mark would make
    # their /dev/shm guard count the files the suite's other tests make meanwhile as theirs
    env.pop("TIERCAKE_TEST_SUITE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.site), env.get("PYTHONPATH")]))
    results: dict[str, dict[str, object]] = {}
    installed = _install(args.site, args.out, env)
    if installed is not None:
        results["install"] = installed
    python = [sys.executable, "-m"]
    commands = {
        "device": [sys.executable, "-c", DEVICE_REPORT, args.device],
        "tests": [*python, "pytest", "-q", "-p", "no:cacheprovider", *(str(ROOT / t) for t in TESTS)],
        "bench": [*python, "tiercake.cli", "bench", "vllm-kv", "--device", args.device, "--quick"]
        + ["--json", str((args.out / f"vllm-kv-{args.device}.json").resolve())],
    }
    for step in steps:
        results[step] = _run(step, commands[step], args.out, env, LIMIT_S[step])
        print(f"{step}: {results[step]}", flush=True)
    (args.out / "gpu-check.json").write_text(json.dumps({"device": args.device, "steps": results}, indent=2))
    failed = [name for name, got in results.items() if got["exit"] != 0]
    print(f"failed: {', '.join(failed)}" if failed else "every step passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
