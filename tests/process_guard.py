"""The ``cluster`` marker, enforced: a test that starts a process (etcd, a node agent, the CLI, vLLM,
kubectl) must carry it, so ``make check`` (``-m "not cluster"``) stays a loop of in-process tests.

Every way the suite starts a process goes through ``subprocess.Popen`` (``subprocess.run``, asyncio's
subprocesses) or ``multiprocessing``; both are wrapped once per session and refuse while an unmarked
test runs, its fixtures' setup and teardown included."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

_running: list[pytest.Item] = []  # the test whose setup, call or teardown runs now


class UnmarkedProcessError(AssertionError):
    """An unmarked test started a process."""


def _check() -> None:
    if _running and _running[-1].get_closest_marker("cluster") is None:
        raise UnmarkedProcessError(
            f"{_running[-1].nodeid} starts a process: mark it @pytest.mark.cluster (or its module's pytestmark)"
        )


def install() -> None:
    execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    start = multiprocessing.process.BaseProcess.start

    def guarded_execute(self, *args, **kwargs):
        _check()
        return execute(self, *args, **kwargs)

    def guarded_start(self):
        _check()
        return start(self)

    subprocess.Popen._execute_child = guarded_execute  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()
