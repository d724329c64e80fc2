"""The files of a pool region, without the region: where they lie and how they go (no torch, so
the launcher that retires a pool starts and stops fast)."""

from __future__ import annotations

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
