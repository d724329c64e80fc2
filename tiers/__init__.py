"""Storage tiers (gpu, pool, ssd) and the node-local tiered block store that composes them.

The errors load at once (callers catch them without the store); the tiers load on first use, so a
process that never touches a tier (the conductor, the command line) starts without their imports.
Only the gpu tier (``gpu.py``, ``sequences.py``) needs torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CorruptBlockError,
    DiskFullError,
    InvalidStateError,
    ObjectExistsError,
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPinnedError,
    PayloadError,
    PutInProgressError,
    StoreError,
    TierFullError,
)

if TYPE_CHECKING:  # the names as the type checker sees them
    from .entries import BlockChange, BlockView, Lease, PutHandle, Tier
    from .gpu import GpuBackend, GpuBlockPool, GpuTier
    from .pool import PoolBackend, PoolRegion, PoolTier
    from .sequences import BlockTable, SequenceKV
    from .ssd import SsdFilesBackend, SsdTier
    from .store import TieredStore

_LAZY = {
    "GpuBlockPool": ".gpu",
    "GpuBackend": ".gpu",
    "GpuTier": ".gpu",
    "PoolRegion": ".pool",
    "PoolBackend": ".pool",
    "PoolTier": ".pool",
    "BlockTable": ".sequences",
    "SequenceKV": ".sequences",
    "SsdFilesBackend": ".ssd",
    "SsdTier": ".ssd",
    "BlockChange": ".entries",
    "BlockView": ".entries",
    "Lease": ".entries",
    "PutHandle": ".entries",
    "Tier": ".entries",
    "TieredStore": ".store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CorruptBlockError",
    "DiskFullError",
    "InvalidStateError",
    "ObjectExistsError",
    "ObjectLeasedError",
    "ObjectNotFoundError",
    "ObjectPinnedError",
    "PayloadError",
    "PutInProgressError",
    "StoreError",
    "TierFullError",
    "GpuBlockPool",
    "GpuBackend",
    "GpuTier",
    "PoolRegion",
    "PoolBackend",
    "PoolTier",
    "BlockTable",
    "SequenceKV",
    "SsdFilesBackend",
    "SsdTier",
    "BlockChange",
    "BlockView",
    "Lease",
    "PutHandle",
    "Tier",
    "TieredStore",
]
