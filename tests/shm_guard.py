"""Nothing the suite starts may leave a file in /dev/shm: what /dev/shm holds at the session's end
that it did not hold at its start, and that no live process has open or mapped, fails the run (once
every test, on every xdist worker, is done), and is named and removed so that the next run starts
clean. Only this run's files count: tiercake's pools the tests name carry the run's mark
(``paths.SUITE``), and a tiercake pool without it is another run's, kept for a node it will restart
(two suites on one machine must not remove each other's pools); others (torch's, vLLM's) count
unless a live process still uses them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from paths import SUITE

SHM = Path("/dev/shm")
_before: set[str] = set()


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # an xdist worker has it; the controller and a plain run do not


def pytest_sessionstart(session: pytest.Session) -> None:
    if _controller(session.config):
        _before.update(os.listdir(SHM))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _controller(session.config) or session.config.option.collectonly:
        return
    from tiercake.up_state import inodes_in_use

    new = {n for n in set(os.listdir(SHM)) - _before if this_runs(n)}
    used = inodes_in_use(SHM) if new else set()
    left = sorted(n for n in new if _inode(SHM / n) not in used)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"/dev/shm: the suite left {len(left)} files (removed now): {', '.join(left)}", red=True)
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def this_runs(name: str) -> bool:
    """Whether a new /dev/shm file may be this run's: tiercake's only with the run's mark."""
    return SUITE in name or not name.startswith("tiercake-")


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None
