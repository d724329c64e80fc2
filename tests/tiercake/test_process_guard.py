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
