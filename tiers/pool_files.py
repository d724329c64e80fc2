"""The files of a pool region, without the region: where they lie and how they go (no torch, so
the launcher that retires a pool starts and stops fast)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# What a node keeps beside its pool file: the same-host readers' object directory, and (with no SSD)
# the last object map it knew. They go with the pool (``remove_pool``).
DIRECTORY_SUFFIX = ".objects"
OBJECT_MAP_SUFFIX = ".object-map.json"


def beside(path: str | Path, suffix: str) -> Path:
    return Path(f"{path}{suffix}")


def remove_pool(path: str | Path) -> None:
    """Remove a pool file and what lies beside it (an adopted pool outlives its node agent: whoever
    retires it for good calls this)."""
    for target in (Path(path), beside(path, DIRECTORY_SUFFIX), beside(path, OBJECT_MAP_SUFFIX)):
        target.unlink(missing_ok=True)


def lock_holder(fd: int) -> str:
    """Who holds the ``flock`` on the file open at ``fd``, for a refusal to name: "pid N: its command
    line", from /proc/locks (the kernel's list of locks, by device and inode)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:
                pid = fields[4]
                with contextlib.suppress(OSError):
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    return f"pid {pid}: {command.strip()[:120]}"
                return f"pid {pid}"
    return "pid unknown"
