"""tiercake/gpu_check.py, the GPU checks in one run for when a machine with a GPU is lent: run here as
printed, with ``--device cpu`` (the same steps on the CPU), and with ``--device cuda`` on a machine
without one, where it must say so and fail."""

import contextlib
import json
import subprocess
import sys
import threading

import pytest
from paths import ROOT, shm_file

pytestmark = pytest.mark.cluster  # the script and its steps are processes


def gpu_check(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tiercake/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _tails(out) -> str:
    """Each step's log, its end (they go with the test's temporary folder)."""
    return "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(out.glob("*.log")))


@contextlib.contextmanager
def the_suites_other_tests_making_pools():
    """Files in /dev/shm with this suite's mark, made while the block runs (as the suite's other
    worker makes them meanwhile), removed after it."""
    made, stop = [], threading.Event()

    def make() -> None:
        while not stop.wait(0.25):
            made.append(shm_file(f"beside-the-gpu-check-{len(made)}"))
            made[-1].write_bytes(b"")

    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for path in made:
            path.unlink(missing_ok=True)


def test_the_gpu_checks_run_as_printed_on_the_cpu(tmp_path):
    """Its tests are a run of their own: the files the suite around it makes meanwhile are not theirs
    (they once failed the step: its /dev/shm guard took the suite's mark for its own)."""
    with the_suites_other_tests_making_pools():
        done = gpu_check("--device", "cpu", "--steps", "device,tests", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr + _tails(tmp_path)
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["device"] == "cpu" and sorted(summary["steps"]) == ["device", "tests"]  # tiercake imports here
    assert all(step["exit"] == 0 for step in summary["steps"].values())
    assert json.loads((tmp_path / "device.log").read_text())["cuda"] is False
    assert " passed" in (tmp_path / "tests.log").read_text() and "every step passed" in done.stdout


def test_asked_for_a_gpu_where_there_is_none_it_says_so_and_fails(tmp_path):
    done = gpu_check("--device", "cuda", "--steps", "device", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 1 and "failed: device" in done.stdout
    assert "torch sees no GPU here" in (tmp_path / "device.log").read_text()
    assert gpu_check("--steps", "device,everything").returncode == 2  # argparse's refusal
