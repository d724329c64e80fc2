"""The store's data model and the handles it gives out: a block's ``Entry`` and its per-tier
``Copy``, a ``Tier`` (a backend with its policies and counters), the ``PutHandle`` of a started put,
a held ``Lease``, a ``BlockView`` and the ``BlockChange`` listeners hear. ``TieredStore``
(``store.py``) is the only owner of entries: nothing here changes one on its own, except a put
handle writing the bytes of its own pending copy."""

from __future__ import annotations

import asyncio
import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

from tiercake.messages import RESIDENCY_BUCKETS
from tiercake.policies import LRU, AdmissionPolicy, AlwaysAdmit, BlockMeta, EvictionPolicy

from .backend import DiskTierBackend, MemoryTierBackend, TierBackend
from .buffers import Payload, as_bytes, copy_into, size_of
from .errors import InvalidStateError, PayloadError

if TYPE_CHECKING:
    from .store import TieredStore


@dataclass(frozen=True, slots=True)
class BlockChange:
    """A committed copy of ``key`` appeared in (``added``) or left ``tier``."""

    key: bytes
    tier: str
    nbytes: int
    tenant: str
    added: bool


class State(Enum):
    PENDING = "pending"
    COMMITTED = "committed"


@dataclass(slots=True)
class Copy:
    """One tier's copy of an object."""

    tier: Tier
    slot: Any
    state: State = State.PENDING
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> monotonic expiry
    evicting: bool = False
    free_on_release: bool = False
    committed_at: float = 0.0  # monotonic; residency is measured from here to its eviction

    def leased(self, now: float) -> bool:
        if not self.leases:
            return False
        expired = [lease for lease, until in self.leases.items() if until <= now]
        for lease in expired:
            del self.leases[lease]
        return bool(self.leases)


@dataclass(slots=True)
class Entry:
    key: bytes
    nbytes: int
    meta: BlockMeta
    copies: dict[int, Copy] = field(default_factory=dict)  # tier index -> copy
    hard_pin: bool = False
    soft_pin_until: float = 0.0
    keep: bool = False  # its last copy is never evicted: it spills down, and stays where it is at the bottom
    hold_until: float = 0.0  # monotonic: not evicted before (a reader was promised it, as Mooncake's lease)
    seal: bytes = b""  # what the writer stored with the block (``tiercake.blocks.Sealer``): kept, never checked

    def committed(self) -> list[int]:
        """Indexes of the tiers holding a committed copy, fastest first."""
        if len(self.copies) == 1:  # the common case, on every read path
            for index, copy in self.copies.items():
                return [index] if copy.state is State.COMMITTED else []
        return sorted(i for i, c in self.copies.items() if c.state is State.COMMITTED)

    @property
    def parent(self) -> bytes | None:
        """The chain's previous block (the policies' ``BlockMeta`` holds it as any hashable key)."""
        return cast("bytes | None", self.meta.parent)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    puts: int = 0
    evictions: int = 0
    spills_in: int = 0
    promotions_in: int = 0
    drops: int = 0
    corrupt: int = 0
    full_refusals: int = 0
    admission_refusals: int = 0
    quota_refusals: int = 0  # blocks passed down: their tenant's share was full of blocks that may not go
    # how long evicted copies had stayed, counted per bucket of RESIDENCY_BUCKETS (upper bounds, s)
    residency: list[int] = field(default_factory=lambda: [0] * (len(RESIDENCY_BUCKETS) + 1))
    residency_sum_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def note_residency(self, seconds: float) -> None:
        self.residency[bisect.bisect_left(RESIDENCY_BUCKETS, seconds)] += 1
        self.residency_sum_s += seconds


class Tier:
    """A backend with its policies, thresholds and counters, at one level of the store."""

    def __init__(
        self,
        backend: TierBackend,
        eviction: EvictionPolicy | None = None,
        admission: AdmissionPolicy | None = None,
        high_watermark: float = 0.9,
        evict_fraction: float = 0.05,
        tenant_quota_bytes: int | None = None,
    ) -> None:
        if not 0 < high_watermark <= 1:
            raise ValueError("high_watermark must be in (0, 1]")
        if not 0 < evict_fraction < 1:
            raise ValueError("evict_fraction must be in (0, 1)")
        self.backend = backend
        self.name = backend.name
        self.eviction = eviction if eviction is not None else LRU()  # an empty policy is falsy
        self.admission = admission if admission is not None else AlwaysAdmit()
        self.high_watermark = high_watermark
        self.evict_fraction = evict_fraction
        self.stats = TierCounters()
        self.index = 0
        self.evict_lock = asyncio.Lock()
        self.background: asyncio.Task | None = None
        # the most one tenant may hold here: beyond it, its own blocks leave first, not another's
        self.tenant_quota_bytes = tenant_quota_bytes
        self.tenant_bytes: dict[str, int] = defaultdict(int)  # committed bytes per tenant

    @property
    def usage(self) -> float:
        cap = self.backend.capacity_bytes
        return self.backend.used_bytes / cap if cap else 1.0


@dataclass(slots=True)
class PutHandle:
    """A started put. Write through ``write`` (or into ``buffer`` and call ``note_written``)."""

    store: TieredStore
    entry: Entry
    copy: Copy
    written: int = 0
    done: bool = False
    _buffer: Any = None

    def host_target(self):
        """Where a socket may write the bytes in place: a numpy view of the slot (memory tier in host
        memory) or of the staging buffer (disk tier); None for device memory (stage and copy)."""
        backend = self.copy.tier.backend
        if isinstance(backend, MemoryTierBackend):
            return backend.host_array(self.copy.slot, self.entry.nbytes)
        return self.buffer

    @property
    def buffer(self) -> Any:
        """Where the object's bytes go: the slot itself in a memory tier, a staging buffer on disk."""
        if self._buffer is None:
            backend = self.copy.tier.backend
            nbytes = self.entry.nbytes
            if isinstance(backend, MemoryTierBackend):
                self._buffer = backend.view(self.copy.slot, nbytes)
            else:
                assert isinstance(backend, DiskTierBackend)
                self._buffer = backend.staging(self.copy.slot)
        return self._buffer

    @property
    def key(self) -> bytes:
        return self.entry.key

    @property
    def in_memory(self) -> bool:
        """Its copy is in a memory tier: committed with no file to write (``TieredStore.commit_now``)."""
        return isinstance(self.copy.tier.backend, MemoryTierBackend)

    @property
    def tier(self) -> str:
        return self.copy.tier.name

    def write(self, data: Payload, offset: int = 0) -> None:
        if self.done:
            raise InvalidStateError(f"put of {self.key.hex()[:16]}… is already committed or revoked")
        src = as_bytes(data)
        n = size_of(src)
        if offset < 0 or offset + n > self.entry.nbytes:
            raise PayloadError(
                f"write of {n} bytes at offset {offset} overflows the object's {self.entry.nbytes} bytes"
            )
        copy_into(self.buffer[offset : offset + n], src)
        self.written += n

    def note_written(self, nbytes: int) -> None:
        """Record bytes written straight into ``buffer`` (a zero-copy receive)."""
        self.written += nbytes

    def set_seal(self, seal: bytes) -> None:
        """The block's seal, when it is known only once the bytes arrived (a pull); before the commit."""
        if self.done:
            raise InvalidStateError(f"put of {self.key.hex()[:16]}… is already committed or revoked")
        self.entry.seal = seal


@dataclass(slots=True)
class Lease:
    """A held lease on the block's copy in ``tier``, at ``slot`` of that tier's backend."""

    id: int
    key: bytes
    tier: str
    slot: Any
    backend: Any
    nbytes: int

    @property
    def data(self) -> Any:
        """The block in place, flat uint8 (a numpy array in host memory, a tensor on a device)."""
        return self.backend.view(self.slot, self.nbytes)

    def host_array(self):
        """The block in place as a numpy array (for sockets), or None if it is in device memory."""
        return self.backend.host_array(self.slot, self.nbytes)


@dataclass(slots=True)
class BlockView:
    """A leased block: ``data`` is valid until the ``read`` context exits."""

    key: bytes
    tier: str
    data: Any  # flat uint8: a numpy array in host memory, a tensor on a device


def short_key(key: bytes) -> str:
    return key.hex()[:16] + "…"
