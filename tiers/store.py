"""The tiered block store of one node: gpu, pool and ssd tiers composed under policies.

Object semantics follow Mooncake Store:
- two-phase put: ``put_start`` reserves space (evicting if it must), the caller writes, then
  ``commit`` makes the object visible or ``revoke`` gives the space back; nothing half-written is
  ever visible;
- committed objects are immutable; a second put of a committed key is refused;
- read leases: a copy that a reader holds is never evicted, freed or removed under it;
- soft pins (with a TTL) are evicted last; hard pins are never evicted;
- high-watermark eviction: once a tier passes ``high_watermark`` of its capacity, a background round
  frees ``evict_fraction`` of it, so puts rarely wait on eviction.

A get is served by the fastest tier that holds the key and may promote the block one tier up if that
tier's admission policy says so. An evicted block spills to the next tier down that admits it and
has room; only a block leaving the last tier is dropped. When a tier is full and nothing in it may be
evicted, the put fails at once with ``TierFullError``.

All metadata changes happen on the event loop without an await in between, so there are no torn
states; copies that run in threads hold a lease for their duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tiercake.policies import BlockMeta, SessionEvent

from .backend import DiskTierBackend, MemoryTierBackend
from .buffers import INLINE_COPY_MAX, Payload, as_bytes, copy_into, empty, host_bytes, is_tensor, size_of
from .entries import BlockChange, BlockView, Copy, Entry, Lease, PutHandle, State, Tier, short_key
from .errors import (
    CorruptBlockError,
    InvalidStateError,
    ObjectExistsError,
    ObjectNotFoundError,
    PayloadError,
    PutInProgressError,
    StoreError,
    TierFullError,
)
from .eviction import StoreEviction, Throttled
from .removal import StoreRemoval
from .session_prefetch import SessionPrefetch

log = logging.getLogger(__name__)


MAX_KEY_BYTES = 64
MANY_IN_FLIGHT = 64  # the most operations of one put_many/get_many in flight at once
MANY_IN_FLIGHT_BYTES = 256 << 20  # ... and bytes: small blocks go together, large ones a few at a time


def in_flight(payloads: Iterable[Payload]) -> int:
    """How many of a batch's operations may be in flight at once: up to ``MANY_IN_FLIGHT``, as long as
    that many of its largest item stay within ``MANY_IN_FLIGHT_BYTES`` (at least one)."""
    largest = max((len(p) if isinstance(p, (bytes, bytearray)) else size_of(as_bytes(p)) for p in payloads), default=1)
    return max(1, min(MANY_IN_FLIGHT, MANY_IN_FLIGHT_BYTES // max(1, largest)))


class TieredStore(StoreRemoval, StoreEviction):
    """Tiers ordered fastest first. See the module docstring for the semantics. The class is written
    in three files: this one (life cycle, lookup, put, get), ``removal.py`` (remove, pins, holds) and
    ``eviction.py`` (eviction and spill); its entries have this one owner."""

    def __init__(
        self,
        tiers: list[Tier],
        *,
        payload_nbytes: int | None = None,
        payload_dtype: Any = None,
        promote_on_hit: bool = True,
        inline_copy_max: int = INLINE_COPY_MAX,
        lease_ttl: float = 5.0,
        session_prefetch_lead_s: float = 1.0,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = tiers
        for i, tier in enumerate(tiers):
            tier.index = i
        self.payload_nbytes = payload_nbytes
        # the KV dtype by name ("bfloat16"; a torch dtype is taken too): a typed payload must be of it
        self.payload_dtype = None if payload_dtype is None else str(payload_dtype).removeprefix("torch.")
        self.promote_on_hit = promote_on_hit
        self.inline_copy_max = inline_copy_max
        self.lease_ttl = lease_ttl
        self._entries: dict[bytes, Entry] = {}
        self._lease_ids = itertools.count(1)
        self._leases: dict[int, Copy] = {}  # every lease handed out, by id (a copy may leave its entry)
        self._holds: list[tuple[float, bytes]] = []  # (until, key) of held blocks, out of their tiers' policies
        self.misses = 0
        self._closed = False
        self._spill_failures = Throttled()
        # called with every committed copy that appears in or leaves a tier (a node agent reports
        # them to the conductor); called synchronously, so a listener must only queue
        self.listeners: list[Callable[[BlockChange], None]] = []
        self.session_prefetch = SessionPrefetch(self, session_prefetch_lead_s)

    # Lifecycle ------------------------------------------------------------------------------------

    async def open(self) -> TieredStore:
        """Rebuild the index from tiers that persist (ssd) and return the store."""
        for tier in self.tiers:
            for block in await tier.backend.recover():
                entry = self._entries.get(block.key)
                if entry is None:
                    meta = BlockMeta(parent=block.parent, size=block.nbytes, tenant=block.tenant)
                    entry = Entry(block.key, block.nbytes, meta, seal=block.seal)
                    self._entries[block.key] = entry
                entry.copies[tier.index] = Copy(tier, block.slot, State.COMMITTED, committed_at=time.monotonic())
                tier.eviction.on_insert(block.key, entry.meta)
                tier.tenant_bytes[entry.meta.tenant] += entry.nbytes
        return self

    async def drain(self) -> None:
        """Wait for background eviction rounds to finish."""
        for tier in self.tiers:
            while tier.background is not None and not tier.background.done():
                await asyncio.shield(tier.background)

    async def close(self) -> None:
        if self._closed:
            return
        await self.session_prefetch.close()
        await self.drain()
        self._closed = True
        for tier in self.tiers:
            tier.backend.close()

    async def __aenter__(self) -> TieredStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # Lookup ---------------------------------------------------------------------------------------

    def tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    def _committed_entry(self, key: bytes) -> Entry:
        entry = self._entries.get(key)
        if entry is None or not entry.committed():
            raise ObjectNotFoundError(f"no committed block {short_key(key)}")
        return entry

    def contains(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and bool(entry.committed())

    def seal_of(self, key: bytes) -> bytes:
        """The seal stored with ``key``'s block (empty: none was, or no such block)."""
        entry = self._entries.get(key)
        return b"" if entry is None else entry.seal

    def stored_as(self, key: bytes) -> tuple[str, int] | None:
        """The tenant ``key``'s block was stored for and its size (None: no such block)."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.meta.tenant, entry.nbytes)

    def where(self, key: bytes) -> list[str]:
        """Names of the tiers holding a committed copy, fastest first; [] when absent."""
        entry = self._entries.get(key)
        return [self.tiers[i].name for i in entry.committed()] if entry else []

    def keys(self, tier: str | None = None) -> list[bytes]:
        index = None if tier is None else self.tier(tier).index
        return [
            k
            for k, e in self._entries.items()
            if any(c.state is State.COMMITTED and (index is None or i == index) for i, c in e.copies.items())
        ]

    def slot_of(self, key: bytes, tier: str) -> Any | None:
        """The slot of ``key``'s committed copy in ``tier`` (for a gpu tier: the pool block), or None."""
        entry = self._entries.get(key)
        copy = entry.copies.get(self.tier(tier).index) if entry is not None else None
        return copy.slot if copy is not None and copy.state is State.COMMITTED else None

    def adopt(
        self, key: bytes, tier: str, slot: Any, nbytes: int, *, parent: bytes | None = None, tenant: str = ""
    ) -> bool:
        """Make ``slot`` of ``tier``, already filled (a gpu block a sequence computed), the committed
        copy of ``key`` without copying it; the tier takes its own reference to the slot. False when
        the key is already present (the caller keeps its slot to itself)."""
        backend = self.tier(tier).backend
        if not isinstance(backend, MemoryTierBackend):
            raise TypeError(f"{tier} is not a memory tier: only a slot in memory is adopted")
        if key in self._entries:
            return False
        self._check_key(key)
        self._check_size(nbytes)
        backend.adopt(slot)
        entry = Entry(key, nbytes, BlockMeta(parent=parent, size=nbytes, tenant=tenant))
        copy = Copy(self.tier(tier), slot)
        entry.copies[copy.tier.index] = copy
        self._entries[key] = entry
        self._commit_copy(entry, copy)
        return True

    async def reclaim(self, tier: str, nbytes: int) -> bool:
        """Evict from ``tier`` until ``nbytes`` more would fit (for space used outside the store, such
        as a gpu pool's sequence blocks); False when nothing more may be evicted."""
        t = self.tier(tier)
        async with t.evict_lock:
            while t.backend.capacity_bytes - t.backend.used_bytes < nbytes:
                if not await self._evict_some(t, nbytes):
                    return False
        return True

    def holdings(self) -> list[BlockChange]:
        """Every committed copy, as the change that made it appear (what a restarted node reports)."""
        return [
            BlockChange(e.key, c.tier.name, e.nbytes, e.meta.tenant, True)
            for e in self._entries.values()
            for c in e.copies.values()
            if c.state is State.COMMITTED
        ]

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain are held (the walk stops at the first miss)."""
        for n, key in enumerate(keys):
            if not self.contains(key):
                return n
        return len(keys)

    # Put ------------------------------------------------------------------------------------------

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"block keys are bytes, got {type(key).__name__}")
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"block keys are 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")

    def _check_payload(self, data: Payload) -> Any:
        if self.payload_dtype is not None:
            typed = (
                str(data.dtype).removeprefix("torch.")
                if is_tensor(data)
                else data.dtype.name
                if isinstance(data, np.ndarray) and data.dtype != np.uint8
                else None  # raw bytes: only their size is checked
            )
            if typed is not None and typed != self.payload_dtype:
                raise PayloadError(f"payload dtype is {typed}, this store holds {self.payload_dtype}")
        src = as_bytes(data)
        self._check_size(size_of(src))
        return src

    def _check_size(self, nbytes: int, exact: bool = True) -> None:
        if nbytes <= 0:
            raise PayloadError("payload is empty")
        if exact and self.payload_nbytes is not None and nbytes != self.payload_nbytes:
            raise PayloadError(f"payload is {nbytes} bytes, this store's blocks are {self.payload_nbytes} bytes")

    async def put_start(
        self,
        key: bytes,
        nbytes: int,
        *,
        tier: str | None = None,
        parent: bytes | None = None,
        cost: float = 1.0,
        tenant: str = "",
        seal: bytes = b"",
        exact_size: bool = True,
        keep: bool = False,
    ) -> PutHandle:
        """Reserve space for ``key`` in ``tier`` (default: the fastest tier that admits it). ``seal``
        is kept with the block and handed to its readers (``seal_of``). ``exact_size=False``: a block
        of any size, whatever the store's KV block size (a key-value store object); ``keep``: its
        last copy is never evicted (``set_keep``)."""
        self._check_key(key)
        self._check_size(nbytes, exact_size)
        if tier is not None and not self.tier(tier).backend.accepts(nbytes):
            raise PayloadError(f"tier {tier!r} cannot hold a block of {nbytes} bytes")
        existing = self._entries.get(key)
        if existing is not None:
            if existing.committed():
                raise ObjectExistsError(f"block {short_key(key)} is already committed (objects are immutable)")
            raise PutInProgressError(f"a put of block {short_key(key)} is already in progress")
        meta = BlockMeta(parent=parent, size=nbytes, cost=cost, tenant=tenant)
        entry = Entry(key, nbytes, meta, seal=seal, keep=keep)
        self._entries[key] = entry  # claims the key while we wait for room
        try:
            start = 0 if tier is None else self.tier(tier).index
            copy = await self._place(entry, start, offer=True)
            if copy is None:
                raise TierFullError(f"no tier from {self.tiers[start].name!r} down admitted block {short_key(key)}")
        except BaseException:
            if not entry.copies:
                self._entries.pop(key, None)
            raise
        return PutHandle(self, entry, copy)

    def put_start_now(
        self, key: bytes, nbytes: int, *, tenant: str = "", exact_size: bool = True, keep: bool = False
    ) -> PutHandle | None:
        """``put_start`` into the fastest tier, when that needs no wait: the tier is in memory, admits
        the block and has room without evicting anything (or the tenant's quota would make it evict).
        None otherwise: the caller takes ``put_start``, which may evict or go down a tier."""
        self._check_key(key)
        self._check_size(nbytes, exact_size)
        if key in self._entries or not self.tiers:
            return None
        tier = self.tiers[0]
        if not isinstance(tier.backend, MemoryTierBackend) or not tier.backend.accepts(nbytes):
            return None
        meta = BlockMeta(size=nbytes, tenant=tenant)
        quota = tier.tenant_quota_bytes
        if quota is not None and tier.tenant_bytes[tenant] + nbytes > quota:
            return None
        if not tier.admission.admit(key, meta):
            return None
        slot = tier.backend.allocate(nbytes)
        if slot is None:
            return None
        entry = Entry(key, nbytes, meta, keep=keep)
        copy = Copy(tier, slot)
        entry.copies[tier.index] = copy
        self._entries[key] = entry
        return PutHandle(self, entry, copy)

    def commit_now(self, handle: PutHandle) -> None:
        """``commit`` of a copy in memory (no file to write): nothing to wait for."""
        if handle.done or handle.written < handle.entry.nbytes or not handle.in_memory:
            raise InvalidStateError(f"put of {short_key(handle.key)} cannot be committed now")
        handle.done = True
        self._commit_copy(handle.entry, handle.copy)
        handle.copy.tier.stats.puts += 1

    async def _place(self, entry: Entry, start: int, *, offer: bool, src: Any = None) -> Copy | None:
        """A pending copy in the first tier from ``start`` down that admits the block and has room.

        With ``src`` the copy is also filled (a spill). Admission refusals and full tiers pass the
        block on down; the last such error is raised if no tier takes it and one was full.
        """
        full: TierFullError | None = None
        for tier in self.tiers[start:]:
            if tier.index in entry.copies:
                continue
            if not tier.backend.accepts(entry.nbytes):
                continue
            if offer and not tier.admission.admit(entry.key, entry.meta):
                tier.stats.admission_refusals += 1
                continue
            if not await self._within_quota(tier, entry):
                continue  # the tenant holds its share here and none of it may leave: the block goes down
            try:
                slot = await self._allocate(tier, entry.nbytes)
            except TierFullError as exc:
                full = exc
                continue
            copy = Copy(tier, slot)
            entry.copies[tier.index] = copy
            return copy
        if full is not None:
            raise full
        return None

    async def _allocate(self, tier: Tier, nbytes: int, lossless: bool = False) -> Any:
        """A slot of ``nbytes`` in ``tier``, evicting (only what loses nothing by it, ``lossless``)
        as needed; ``TierFullError`` when nothing may go."""
        slot = tier.backend.allocate(nbytes)
        if slot is not None:
            return slot
        async with tier.evict_lock:
            for _ in range(64):  # each round frees at least one block or gives up
                slot = tier.backend.allocate(nbytes)
                if slot is not None:
                    return slot
                if not await self._evict_some(tier, nbytes, lossless=lossless):
                    break
            slot = tier.backend.allocate(nbytes)
            if slot is not None:
                return slot
        tier.stats.full_refusals += 1
        raise TierFullError(
            f"tier {tier.name!r} is full ({tier.backend.used_bytes}/{tier.backend.capacity_bytes} bytes) and "
            f"nothing in it may be evicted (leased, pinned or in use); cannot place {nbytes} bytes"
        )

    async def commit(self, handle: PutHandle) -> None:
        """Make the object visible. Fails if the handle was committed, revoked or not fully written."""
        await self._commit(handle)

    async def _commit(self, handle: PutHandle, src: Any = None) -> None:
        """Commit; a disk tier writes its file from ``src`` when given (no staging copy)."""
        if handle.done:
            raise InvalidStateError(f"put of {short_key(handle.key)} is already committed or revoked")
        if handle.written < handle.entry.nbytes:
            raise PayloadError(
                f"put of {short_key(handle.key)}: {handle.written} of {handle.entry.nbytes} bytes written"
            )
        copy, entry = handle.copy, handle.entry
        if isinstance(copy.tier.backend, DiskTierBackend):
            try:
                await copy.tier.backend.persist(
                    copy.slot, entry.key, entry.parent, src, tenant=entry.meta.tenant, seal=entry.seal
                )
            except BaseException:
                await self.revoke(handle)
                raise
        handle.done = True
        self._commit_copy(entry, copy)
        copy.tier.stats.puts += 1

    async def revoke(self, handle: PutHandle) -> None:
        """Abandon a started put and give its space back. Revoking twice is a no-op."""
        if handle.done:
            if handle.copy.state is State.COMMITTED:
                raise InvalidStateError(f"put of {short_key(handle.key)} is committed; remove it instead")
            return
        handle.done = True
        entry = handle.entry
        entry.copies.pop(handle.copy.tier.index, None)
        if not entry.copies and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        await handle.copy.tier.backend.release(handle.copy.slot)

    def _notify(self, entry: Entry, tier: Tier, added: bool) -> None:
        tier.tenant_bytes[entry.meta.tenant] += entry.nbytes if added else -entry.nbytes
        if self.listeners:
            change = BlockChange(entry.key, tier.name, entry.nbytes, entry.meta.tenant, added)
            for listener in self.listeners:
                listener(change)

    def _commit_copy(self, entry: Entry, copy: Copy) -> None:
        tier = copy.tier
        if isinstance(tier.backend, MemoryTierBackend):  # before it is visible: the pool describes it in its index
            tier.backend.on_commit(copy.slot, entry.key, entry.parent, entry.meta.tenant, entry.seal)
        copy.state = State.COMMITTED
        copy.committed_at = time.monotonic()
        if entry.hold_until <= copy.committed_at:  # a held block joins its policy when the hold ends
            tier.eviction.on_insert(entry.key, entry.meta)
        self._notify(entry, tier, True)
        if tier.usage > tier.high_watermark and (tier.background is None or tier.background.done()):
            tier.background = asyncio.get_running_loop().create_task(self._watermark_round(tier))

    async def put(
        self,
        key: bytes,
        data: Payload,
        *,
        tier: str | None = None,
        parent: bytes | None = None,
        cost: float = 1.0,
        tenant: str = "",
        seal: bytes = b"",
    ) -> str:
        """Start, write and commit in one call; returns the tier that took the block."""
        src = self._check_payload(data)
        n = size_of(src)
        handle = await self.put_start(key, n, tier=tier, parent=parent, cost=cost, tenant=tenant, seal=seal)
        if not handle.in_memory:
            handle.written = n
            await self._commit(handle, src)  # the file is written straight from src
            return handle.tier
        try:
            await self._copy(handle.buffer, src)
            handle.written = n
        except BaseException:
            await self.revoke(handle)
            raise
        await self.commit(handle)
        return handle.tier

    async def put_many(
        self,
        items: list[tuple[bytes, Payload]],
        *,
        tier: str | None = None,
        chain: bool = False,
        concurrency: int | None = None,
        tenant: str = "",
    ) -> list[str | BaseException]:
        """Put a batch with up to ``concurrency`` puts in flight (default: ``in_flight``'s rule; disk
        tiers overlap their I/O, the log layout writes what is in flight together). With ``chain``,
        each item's parent is the item before it. Returns, per item, the tier that took it or the
        error that refused it: one refused block does not fail the batch."""
        gate = asyncio.Semaphore(concurrency or in_flight(d for _, d in items))

        async def one(i: int, key: bytes, data: Payload) -> str:
            async with gate:
                return await self.put(
                    key, data, tier=tier, parent=items[i - 1][0] if chain and i else None, tenant=tenant
                )

        return await asyncio.gather(*(one(i, k, d) for i, (k, d) in enumerate(items)), return_exceptions=True)

    async def get_many(
        self, items: list[tuple[bytes, Payload]], *, concurrency: int | None = None
    ) -> list[str | BaseException]:
        """``get_into`` for a batch of (key, destination), up to ``concurrency`` in flight (default:
        ``in_flight``'s rule; the log layout reads adjacent records in flight together). Returns, per
        item, the tier that served it or the error (a miss is an ``ObjectNotFoundError``)."""
        gate = asyncio.Semaphore(concurrency or in_flight(d for _, d in items))

        async def one(key: bytes, dst: Payload) -> str:
            async with gate:
                return await self.get_into(key, dst)

        return await asyncio.gather(*(one(k, d) for k, d in items), return_exceptions=True)

    # Get ------------------------------------------------------------------------------------------

    async def get(self, key: bytes) -> np.ndarray:
        """A private copy of the block's bytes, flat uint8 in host memory (``.view(dtype)`` to
        reinterpret; ``torch.from_numpy`` for a tensor over the same memory)."""
        entry = self._committed_entry(key)
        out = empty(entry.nbytes)
        await self.get_into(key, out)
        return out

    async def get_into(self, key: bytes, dst: Payload) -> str:
        """Copy the block into ``dst`` (exactly the block's size); returns the tier that served it."""
        out = as_bytes(dst)
        while True:
            entry = self._entries.get(key)
            if entry is None or not entry.committed():
                self.misses += 1
                raise ObjectNotFoundError(f"no committed block {short_key(key)}")
            if size_of(out) != entry.nbytes:
                raise PayloadError(f"destination is {size_of(out)} bytes, block {short_key(key)} is {entry.nbytes}")
            index = entry.committed()[0]
            copy = entry.copies[index]
            tier = copy.tier
            try:
                await self._read_copy(entry, copy, out)
            except CorruptBlockError as exc:
                log.warning("store: %s", exc)
                tier.stats.corrupt += 1
                await self._drop_copy(entry, index)
                continue  # another tier may still hold it; otherwise the loop reports a miss
            tier.stats.hits += 1
            tier.eviction.on_access(key)
            if self.promote_on_hit and index > 0:
                await self._promote(entry, index, out)
            return tier.name

    async def read_head(self, key: bytes, want: int) -> bytes:
        """The block's first ``want`` bytes from its fastest copy, never promoted (a recovery reads
        every object's header: promoting each into a full pool would evict what it has just found).
        A copy that fails its check is dropped and the next one tried; ``ObjectNotFoundError`` when
        none is left."""
        while True:
            entry = self._committed_entry(key)
            index = entry.committed()[0]
            copy = entry.copies[index]
            backend = copy.tier.backend
            if isinstance(backend, MemoryTierBackend):
                return bytes(host_bytes(backend.view(copy.slot, entry.nbytes)[:want]))
            assert isinstance(backend, DiskTierBackend)  # a tier is one or the other
            lease = self._lease(copy, math.inf)
            try:
                return await backend.read_head(copy.slot, key, entry.nbytes, want)
            except CorruptBlockError as exc:
                log.warning("store: %s", exc)
                copy.tier.stats.corrupt += 1
                await self._drop_copy(entry, index)
            finally:
                await self.release_lease(key, lease)

    async def _read_copy(self, entry: Entry, copy: Copy, out: Any) -> None:
        backend = copy.tier.backend
        if isinstance(backend, MemoryTierBackend) and entry.nbytes <= self.inline_copy_max:
            copy_into(out, backend.view(copy.slot, entry.nbytes))  # no await: nothing can free it meanwhile
            return
        lease = self._lease(copy, math.inf)
        try:
            if isinstance(backend, MemoryTierBackend):
                await asyncio.to_thread(copy_into, out, backend.view(copy.slot, entry.nbytes))
            else:
                assert isinstance(backend, DiskTierBackend)  # a tier is one or the other
                await backend.read_into(copy.slot, entry.key, out)
        finally:
            await self.release_lease(entry.key, lease)

    async def _promote(self, entry: Entry, index: int, data: Any) -> None:
        """Best effort: copy a block that was hit in tier ``index`` one tier up, if admitted."""
        up = self.tiers[index - 1]
        backend = up.backend
        if up.index in entry.copies or not isinstance(backend, MemoryTierBackend) or not backend.accepts(entry.nbytes):
            return
        if not up.admission.admit(entry.key, entry.meta):
            up.stats.admission_refusals += 1
            return
        try:
            slot = await self._allocate(up, entry.nbytes, lossless=True)  # best effort: at no block's cost
        except TierFullError:
            return
        if self._entries.get(entry.key) is not entry or up.index in entry.copies:
            await up.backend.release(slot)  # removed or promoted by someone else while we waited
            return
        copy = Copy(up, slot)
        entry.copies[up.index] = copy
        await self._copy(backend.view(slot, entry.nbytes), data)
        if self._entries.get(entry.key) is not entry:  # removed while we copied
            entry.copies.pop(up.index, None)
            await up.backend.release(slot)
            return
        self._commit_copy(entry, copy)
        up.stats.promotions_in += 1

    async def stage(self, keys: list[bytes], max_bytes: int | None = None) -> list[StoreError | None]:
        """Bring blocks held only on a disk tier into the memory tier above it, ahead of a read that
        is coming (a queued request's prefix): per key None once a memory tier holds it,
        ``ObjectNotFoundError``, or ``TierFullError`` when it stayed on disk (not admitted, no room,
        or past ``max_bytes`` staged by this call, which bounds what one call can evict; default a
        quarter of the memory tiers, so a prefetch cannot flush what is served now). The memory
        tier's eviction policy picks what makes room, as for any promotion."""
        if max_bytes is None:
            max_bytes = (
                sum(t.backend.capacity_bytes for t in self.tiers if isinstance(t.backend, MemoryTierBackend)) // 4
            )
        results: list[StoreError | None] = []
        staged = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.committed():
                results.append(ObjectNotFoundError(f"no committed block {short_key(key)}"))
                continue
            index = entry.committed()[0]
            copy = entry.copies[index]
            if isinstance(copy.tier.backend, MemoryTierBackend):
                results.append(None)
                continue
            if index == 0 or staged + entry.nbytes > max_bytes:
                results.append(
                    TierFullError(
                        f"block {short_key(key)} stays on {copy.tier.name}: "
                        + ("no memory tier above it" if index == 0 else "over this call's bound")
                    )
                )
                continue
            data = empty(entry.nbytes)
            try:
                await self._read_copy(entry, copy, data)
            except CorruptBlockError as exc:
                log.warning("store: %s", exc)
                copy.tier.stats.corrupt += 1
                await self._drop_copy(entry, index)
                results.append(ObjectNotFoundError(str(exc)))
                continue
            await self._promote(entry, index, data)
            up = entry.copies.get(index - 1)
            if up is not None and up.state is State.COMMITTED:
                staged += entry.nbytes
                results.append(None)
            else:
                results.append(
                    TierFullError(
                        f"block {short_key(key)} stays on {copy.tier.name}: {self.tiers[index - 1].name} did not take it"
                    )
                )
        return results

    @contextlib.asynccontextmanager
    async def read(self, key: bytes) -> AsyncIterator[BlockView]:
        """Lease the block for in-place reading. Blocks only on disk are read into a private buffer
        (promoting them first when admitted, so later reads are in place)."""
        entry = self._committed_entry(key)
        index = entry.committed()[0]
        copy = entry.copies[index]
        backend = copy.tier.backend
        if not isinstance(backend, MemoryTierBackend):
            data = await self.get(key)
            yield BlockView(key, copy.tier.name, data)
            return
        lease = self._lease(copy, math.inf)
        copy.tier.stats.hits += 1
        copy.tier.eviction.on_access(key)
        try:
            yield BlockView(key, copy.tier.name, backend.view(copy.slot, entry.nbytes))
        finally:
            await self.release_lease(key, lease)

    def acquire_lease(self, key: bytes, ttl: float | None = None, *, tier: str | None = None) -> Lease:
        """A lease for a reader outside this call (the transfer server, a process mapping the pool):
        the block's copy in ``tier`` (default: the fastest memory tier holding it) cannot be evicted,
        freed or removed until ``release_lease``, or until ``ttl`` seconds pass (``math.inf`` for a
        reader in this process that always releases), so a reader that dies cannot pin it forever."""
        entry = self._committed_entry(key)
        wanted = None if tier is None else self.tier(tier).index
        for index in entry.committed():
            copy = entry.copies[index]
            if isinstance(copy.tier.backend, MemoryTierBackend) and wanted in (None, index):
                ttl = self.lease_ttl if ttl is None else ttl
                lease = self._lease(copy, math.inf if ttl == math.inf else time.monotonic() + ttl)
                copy.tier.stats.hits += 1
                copy.tier.eviction.on_access(key)
                return Lease(lease, key, copy.tier.name, copy.slot, copy.tier.backend, entry.nbytes)
        where = "a memory tier" if tier is None else f"tier {tier!r}"
        raise ObjectNotFoundError(f"block {short_key(key)} is not in {where}")

    async def release_lease(self, key: bytes, lease: int) -> None:
        """End a lease (unknown or already ended leases are ignored). A copy that was evicted while
        leased is freed when its last lease ends."""
        copy = self.end_lease(lease)
        if copy is not None:
            await copy.tier.backend.release(copy.slot)

    async def release_leases(self, leases: list[int]) -> None:
        """``release_lease`` for a batch, awaiting only where a slot must be freed."""
        for lease in leases:
            copy = self.end_lease(lease)
            if copy is not None:
                await copy.tier.backend.release(copy.slot)

    def end_lease(self, lease: int) -> Copy | None:
        """``release_lease`` without the await: returns a copy whose slot the caller must release
        (rare: only a copy evicted while leased), else None."""
        copy = self._leases.pop(lease, None)
        if copy is None:
            return None
        copy.leases.pop(lease, None)
        if copy.free_on_release and not copy.leased(time.monotonic()):
            copy.free_on_release = False
            return copy
        return None

    def _lease(self, copy: Copy, until: float) -> int:
        lease = next(self._lease_ids)
        copy.leases[lease] = until
        self._leases[lease] = copy
        if lease % 1024 == 0:
            self._sweep_leases()
        return lease

    def _sweep_leases(self, now: float | None = None) -> None:
        """Forget leases that expired unreleased (a reader that died) by ``now`` (the monotonic clock's
        now by default), and free copies they held."""
        now = time.monotonic() if now is None else now
        stale = [lease for lease, copy in self._leases.items() if copy.leases.get(lease, 0.0) <= now]
        orphans = []
        for lease in stale:
            copy = self.end_lease(lease)
            if copy is not None:
                orphans.append(copy)
        if orphans:
            asyncio.get_running_loop().create_task(self._release_slots(orphans))

    async def _release_slots(self, copies: list[Copy]) -> None:
        for copy in copies:
            await copy.tier.backend.release(copy.slot)

    # Sessions -------------------------------------------------------------------------------------

    def on_session(self, event: SessionEvent) -> None:
        """A conversation's state changed: every tier's eviction policy is told (a session-blind one
        ignores it; a policy that raises is a plug-in's bug: logged, the others still told), and a
        pause with an announced end plans its blocks' staging from disk just before it."""
        for tier in self.tiers:
            try:
                tier.eviction.on_session(event)
            except Exception:
                log.exception("tier %s: eviction policy %s failed on a session event", tier.name, tier.eviction.name)
        self.session_prefetch.plan(event)

    # Reporting ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "objects": sum(1 for e in self._entries.values() if e.committed()),
            "misses": self.misses,
            "tiers": {
                t.name: {
                    "kind": t.backend.kind,
                    "capacity_bytes": t.backend.capacity_bytes,
                    "used_bytes": t.backend.used_bytes,
                    "blocks": len(t.eviction),
                    **t.stats.as_dict(),
                    "eviction": t.eviction.describe(),
                    "admission": t.admission.describe(),
                }
                for t in self.tiers
            },
        }
