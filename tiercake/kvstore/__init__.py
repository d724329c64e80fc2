"""A key-value store API over a running tiercake cluster, with Mooncake Store's calls and semantics:
``DistributedStore`` (synchronous, Mooncake's method names and return codes) and ``AsyncStore``
(asyncio, typed exceptions). See the README's "Key-value store API"."""

from .aio import AsyncStore
from .errors import (
    ErrorCode,
    InvalidParams,
    NoSpace,
    ObjectHasLease,
    ObjectNotFound,
    RpcFailed,
    StoreApiError,
    TransferFailed,
)
from .sync import DistributedStore, ReplicateConfig

MooncakeDistributedStore = DistributedStore  # the name code written for Mooncake imports

__all__ = [
    "AsyncStore", "DistributedStore", "ErrorCode", "InvalidParams", "MooncakeDistributedStore", "NoSpace",
    "ObjectHasLease", "ObjectNotFound", "ReplicateConfig", "RpcFailed", "StoreApiError", "TransferFailed",
]
