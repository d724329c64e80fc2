"""What ``tiercake up`` holds in its data directory and in /dev/shm, and gives back when it stops.

- **The data directory is one cluster's.** ``DataDirLock`` takes ``<data dir>/up.lock`` (an exclusive
  ``flock``, released by the kernel when ``up`` dies however it dies) before ``up`` writes anything
  there, and records who holds it; a second ``up`` on the same directory is refused with the first
  one's pid and address, before it can overwrite the running cluster's token or logs.
- **Credentials for the operator.** The control token and the cluster's transfer secret that ``up``
  makes up are written beside each other (mode 0600): ``control-token`` and ``cluster-secret``, for
  the control API and for clients of the key-value store.
- **Nothing left in /dev/shm.** A killed vLLM server leaves its shared memory behind (hundreds of MB:
  Python's ``SharedMemory`` segments and semaphores, whose tracker dies with it). ``ShmLeftovers``
  notes what /dev/shm held when ``up`` started and removes what appeared since and no live process
  has open or mapped: after a child is restarted, and when ``up`` stops.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Set as AbstractSet
from pathlib import Path

SHM = Path("/dev/shm")


class DataDirBusy(RuntimeError):
    """Another ``tiercake up`` runs in this data directory."""


class DataDirLock:
    """One command per data directory (``up``, ``demo``): ``acquire`` refuses a second one."""

    def __init__(self, data_dir: Path, command: str = "up") -> None:
        self.path = data_dir / "up.lock"
        self.command = command
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            command, holder = _read_holder(fd)
            os.close(fd)
            raise DataDirBusy(
                f"another tiercake {command} runs in {self.path.parent} ({holder}); stop it first, or give this "
                "one its own --data-dir"
            ) from None
        self._fd = fd
        self.record(pid=os.getpid())
        return self

    def record(self, **about) -> None:
        """Say who holds the directory (its command and pid, then where it listens), for a second one to name."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps({"command": self.command, **about}).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None


def _read_holder(fd: int) -> tuple[str, str]:
    """The holder's command and what else it recorded."""
    try:
        about = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return "up", "pid unknown"
    command = str(about.pop("command", "up"))
    return command, ", ".join(f"{k} {v}" for k, v in about.items()) or "pid unknown"


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (a token, a secret)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


class ShmLeftovers:
    """What appeared in /dev/shm under the names multiprocessing and torch give shared memory
    (``LEFTOVER_PREFIXES``: vLLM's segments and semaphores), since this was made."""

    LEFTOVER_PREFIXES = ("psm_", "sem.mp-", "torch_")

    def __init__(self, shm: Path = SHM) -> None:
        self.shm = shm
        self.before = self._names()

    def _names(self) -> set[str]:
        try:
            return {p.name for p in self.shm.iterdir() if p.name.startswith(self.LEFTOVER_PREFIXES)}
        except OSError:
            return set()

    def clean(self, keep: AbstractSet[str] = frozenset()) -> list[str]:
        """Remove what appeared since this was made, is not in ``keep`` and no live process has open
        or mapped; the names removed."""
        new = self._names() - self.before - set(keep)
        if not new:
            return []
        used = inodes_in_use(self.shm)
        removed = []
        for name in sorted(new):
            path = self.shm / name
            with contextlib.suppress(OSError):
                if path.stat().st_ino not in used:
                    path.unlink()
                    removed.append(name)
        return removed


def inodes_in_use(shm: Path) -> set[int]:
    """The inodes of files under ``shm`` that some process has open or mapped, by inode, not name: a
    POSIX semaphore is mapped under the temporary name it was made as, then linked to its own."""
    device = shm.stat().st_dev
    used: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(str(shm)):
                    used.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    st = fd.stat()  # follows the link to the open file
                    if st.st_dev == device:
                        used.add(st.st_ino)
    return used
