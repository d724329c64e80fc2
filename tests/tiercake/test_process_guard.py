"""The ``cluster`` marker is enforced (``process_guard.py``): ``make check`` runs only tests that start
no process, and a test that starts one without the marker fails instead of slowing the loop."""

import subprocess
import sys

import process_guard
import pytest


def test_an_unmarked_test_that_starts_a_process_fails():
    with pytest.raises(process_guard.UnmarkedProcessError, match="mark it @pytest.mark.cluster"):
        subprocess.run(["true"], check=True)
    with pytest.raises(process_guard.UnmarkedProcessError):
        import multiprocessing

        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.cluster
def test_a_marked_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"


def test_the_shm_guard_counts_only_this_runs_pools():
    """Two suites on one machine: a pool another run keeps for a node it will restart (no process has
    it open meanwhile) is not this run's leftover, so this run's guard leaves it alone."""
    import shm_guard
    from paths import SUITE, shm_file

    assert shm_guard.this_runs(shm_file("kv-0123").name)
    assert not shm_guard.this_runs(f"tiercake-{'0' * len(SUITE)}-proc-test-kv-a-4242")  # another run's
    assert shm_guard.this_runs("torch_12345_67")  # not tiercake's: counted unless a live process uses it
