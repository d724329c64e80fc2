"""The names Mooncake Store's Python module exports beside its store, as tiercake gives them:
``ReplicateConfig`` (and what tiercake does with each field), the enums, the descriptors a
``get_replica_desc`` answers, ``BufferHandle``, and the parallelism specs of the tensor calls."""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidParams
from .requests import Durability

DEFAULT_SOFT_PIN_MS = 30 * 60 * 1000  # as Mooncake master's default_kv_soft_pin_ttl


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0  # a put: not pinned; an upsert: the object keeps whatever pin it had
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3  # Mooncake's numbers


_U64 = 1 << 64


class ReplicateConfig:
    """Mooncake's per-put settings, as tiercake obeys them:

    - ``replica_num``: the put returns once that many nodes hold the object (its slot's primary
      and backups); more than the cluster can give is refused (NO_AVAILABLE_HANDLE), never quietly
      fewer;
    - ``nof_replica_num`` / ``dfs_replica_num`` above 0: on disk as well, synced, on each of those
      nodes before the put returns (tiercake's ``persist``);
    - ``with_hard_pin``: never evicted; ``soft_pin_action`` with ``soft_pin_ttl_ms``: evicted only
      when nothing else can be, for that long (ENABLE; PRESERVE keeps an upserted object's pin;
      DISABLE, or PRESERVE on a new object: none). A TTL without ENABLE is INVALID_PARAMS;
    - ``preferred_segment(s)``, ``preferred_nof_segments``, ``prefer_alloc_in_same_node``: accepted,
      not obeyed: an object's owner follows from its name (that is what makes every call one round
      trip and every object linearizable), so a caller cannot place it;
    - ``group_ids`` (None, or one str per key written): checked (a batch's list has one per key, or
      the put is INVALID_PARAMS) and kept. Mooncake treats a group as a best-effort lifecycle hint
      (a read lease or an eviction of one member reaching the others); tiercake places and evicts
      each object on its own, so grouped objects are not evicted together;
    - ``data_type``: kept on the config, for the caller.
    """

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self._group_ids: list[str] | None = None

    @property
    def group_ids(self) -> list[str] | None:
        return self._group_ids

    @group_ids.setter
    def group_ids(self, value) -> None:
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(g, str) for g in value)):
            raise TypeError(f"group_ids is None or a list of str, got {value!r}")
        self._group_ids = None if value is None else list(value)

    def check_groups(self, count: int) -> None:
        """``InvalidParams`` unless ``group_ids`` is unset or names one group per object written."""
        if self._group_ids is not None and len(self._group_ids) != count:
            raise InvalidParams(f"group_ids has {len(self._group_ids)} entries for {count} objects")

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64):
            raise TypeError(f"soft_pin_ttl_ms is None or an unsigned 64-bit number of milliseconds, got {value!r}")
        self._soft_pin_ttl_ms = value

    def __str__(self) -> str:
        ttl = "default" if self._soft_pin_ttl_ms is None else self._soft_pin_ttl_ms
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
            f"dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: {SoftPinAction(self.soft_pin_action).name}, "
            f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(bool(self.with_hard_pin))}, "
            f"preferred_segments: {self.preferred_segments}, preferred_segment: {self.preferred_segment!r}, "
            f"prefer_alloc_in_same_node: {int(bool(self.prefer_alloc_in_same_node))}, "
            f"data_type: {ObjectDataType(self.data_type).name}, group_ids: {self._group_ids} }}"
        )

    __repr__ = __str__

    def durability(self, *, upsert: bool) -> Durability:
        """What a put with this config asks (``preserves_pin`` says whether an upsert keeps the
        object's old pin instead). ``InvalidParams`` for what Mooncake refuses."""
        action = SoftPinAction(self.soft_pin_action)
        if self._soft_pin_ttl_ms is not None and action is not SoftPinAction.ENABLE:
            raise InvalidParams("soft_pin_ttl_ms is set, but soft_pin_action is not ENABLE")
        replicas = self.replica_num
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 255:
            raise InvalidParams(f"replica_num is 1 to 255, got {replicas!r}")
        for name in ("nof_replica_num", "dfs_replica_num"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParams(f"{name} is a non-negative number, got {value!r}")
        soft = None
        if action is SoftPinAction.ENABLE:
            soft = DEFAULT_SOFT_PIN_MS if self._soft_pin_ttl_ms is None else min(self._soft_pin_ttl_ms, 1 << 62)
        return Durability(
            replicas=replicas,
            persist=self.nof_replica_num > 0 or self.dfs_replica_num > 0,
            hard_pin=bool(self.with_hard_pin),
            soft_pin_ms=soft,
        )

    def preserves_pin(self, *, upsert: bool) -> bool:
        return upsert and SoftPinAction(self.soft_pin_action) is SoftPinAction.PRESERVE


@dataclass
class Descriptor:
    """Where a memory replica lies: its size, and the node that serves it (``transport_endpoint``,
    its transfer address). ``buffer_address`` is 0: the node's memory is not the caller's."""

    size: int = 0
    buffer_address: int = 0
    transport_endpoint: str = ""

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


@dataclass
class MemoryDescriptor:
    buffer_descriptor: Descriptor = field(default_factory=Descriptor)


@dataclass
class DiskDescriptor:
    file_path: str = ""
    object_size: int = 0


@dataclass
class ReplicaDescriptor:
    """One replica of an object (``get_replica_desc``): in a node's memory, or on its disk."""

    status: ReplicaStatus = ReplicaStatus.COMPLETE
    memory: MemoryDescriptor | None = None
    disk: DiskDescriptor | None = None
    node: str = ""

    def is_memory_replica(self) -> bool:
        return self.memory is not None

    def is_disk_replica(self) -> bool:
        return self.disk is not None

    def is_local_disk_replica(self) -> bool:
        return False  # tiercake's disk copies are on the node agents', not the caller's, disk

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self.memory is None:
            raise RuntimeError("not a memory replica")
        return self.memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self.disk is None:
            raise RuntimeError("not a disk replica")
        return self.disk


class BufferHandle:
    """An object's bytes in memory this process owns (``get_buffer``): ``ptr()``, ``size()``, the
    buffer protocol. Valid while the handle lives."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)

    def ptr(self) -> int:
        return self._data.ctypes.data if self._data.size else 0

    def size(self) -> int:
        return int(self._data.size)

    def __len__(self) -> int:
        return self.size()

    def __buffer__(self, flags: int) -> memoryview:  # Python 3.12's buffer protocol
        return self._data.data

    def __bytes__(self) -> bytes:
        return self._data.tobytes()

    def memoryview(self) -> memoryview:
        return self._data.data

    def as_ctypes(self):
        return (ctypes.c_ubyte * self.size()).from_address(self.ptr()) if self.size() else None


@dataclass
class QueryTaskResponse:
    id: tuple[int, int] = (0, 0)
    type: TaskType = TaskType.REPLICA_COPY
    status: TaskStatus = TaskStatus.FAILED
    created_at_ms_epoch: int = 0
    last_updated_at_ms_epoch: int = 0
    assigned_client: str = ""
    message: str = ""


class ParallelAxis:
    """One axis a tensor is split along (tensor parallelism, an expert or a pipeline stage): its
    ``kind`` (a name), how many shards (``size``), which one (``rank``), along which dimension
    (``split_dim``; None: replicated along this axis)."""

    def __init__(
        self,
        kind: str = "tp",
        size: int = 1,
        rank: int = 0,
        split_dim: int | None = None,
        expert_id: int | None = None,
        stage_id: int | None = None,
    ) -> None:
        self.kind, self.size, self.rank, self.split_dim = kind, size, rank, split_dim
        self.expert_id, self.stage_id = expert_id, stage_id

    def __repr__(self) -> str:
        return f"ParallelAxis(kind={self.kind!r}, size={self.size}, rank={self.rank}, split_dim={self.split_dim})"


class TensorParallelism:
    """How a tensor is laid out over ranks: its axes, outermost first (none: the whole tensor)."""

    def __init__(self, axes: list[ParallelAxis] | None = None) -> None:
        self.axes = list(axes or [])


class ReadTarget:
    """What to read of a tensor stored in parts: ``mode`` "as_stored" (the part a put made, for its
    rank), "full" (the whole tensor, reassembled), or "shard" (the part ``parallelism`` names, cut
    from the stored parts whatever layout they were written in)."""

    def __init__(self, mode: str = "as_stored", parallelism: TensorParallelism | None = None) -> None:
        self.mode = mode
        self.parallelism = parallelism if parallelism is not None else TensorParallelism()
