"""Storage tiers (gpu, pool, ssd) and the node-local tiered block store that composes them."""

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
from .gpu import GpuBlockPool, GpuTier
from .pool import PoolRegion, PoolTier
from .sequences import BlockTable, SequenceKV
from .ssd import SsdTier
from .store import BlockChange, BlockView, Lease, PutHandle, Tier, TieredStore

__all__ = [
    "BlockChange", "BlockTable", "BlockView", "SequenceKV", "Lease", "CorruptBlockError", "DiskFullError", "GpuBlockPool", "GpuTier", "InvalidStateError",
    "ObjectExistsError", "ObjectLeasedError", "ObjectNotFoundError", "ObjectPinnedError", "PayloadError",
    "PoolRegion", "PoolTier", "PutHandle", "PutInProgressError", "SsdTier", "StoreError", "Tier",
    "TierFullError", "TieredStore",
]
