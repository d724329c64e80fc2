"""A key-value store API over a running tiercake cluster, with Mooncake Store's calls and semantics:
``DistributedStore`` (synchronous, Mooncake's method names and return codes, also as
``MooncakeDistributedStore``), ``MooncakeDistributedStoreAsync`` (its ``async_*`` flavour) and
``AsyncStore`` (asyncio, typed exceptions). See the README's "Key-value store API" and
docs/ARCHITECTURE.md's "The key-value store" (the contract)."""

from .aio import AsyncStore
from .errors import (
    ErrorCode,
    IllegalClient,
    InvalidParams,
    NoSpace,
    NotReady,
    NotSupported,
    ObjectHasLease,
    ObjectNotFound,
    RpcFailed,
    StoreApiError,
    TransferFailed,
)
from .requests import Described, Durability
from .sync import DistributedStore, MooncakeDistributedStore, MooncakeDistributedStoreAsync
from .types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    TensorParallelism,
)

__all__ = [
    "AsyncStore",
    "BufferHandle",
    "Described",
    "Descriptor",
    "DiskDescriptor",
    "DistributedStore",
    "Durability",
    "ErrorCode",
    "IllegalClient",
    "InvalidParams",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "MooncakeDistributedStoreAsync",
    "NoSpace",
    "NotReady",
    "NotSupported",
    "ObjectDataType",
    "ObjectHasLease",
    "ObjectNotFound",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "RpcFailed",
    "SoftPinAction",
    "StoreApiError",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "TransferFailed",
]
