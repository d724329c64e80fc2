"""Remove, pins and the rest of what changes a block's standing, a part of ``TieredStore``
(``store.py``): a remove of every copy (refused while a reader holds a lease or the object is
hard-pinned), pins soft and hard, holds, keep, a copy persisted on demand, a tier's eviction policy
switched at run time, a flush. It works on the store's entries and tiers, under the store's rules
(module docstring of ``store.py``)."""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import time
from typing import cast

from tiercake.policies import BlockMeta, EvictionPolicy

from .backend import DiskTierBackend, MemoryTierBackend
from .entries import Copy, State, short_key
from .errors import (
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPinnedError,
    PutInProgressError,
    StoreError,
)
from .store_part import StorePart

log = logging.getLogger(__name__)


class StoreRemoval(StorePart):
    """``TieredStore``'s removes, pins, holds and flushes (its entries, its tiers)."""

    async def remove(self, key: bytes) -> None:
        """Remove every copy. Refused while a reader holds a lease or the object is hard-pinned."""
        entry = self._entries.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"no block {short_key(key)}")
        if not entry.committed():
            raise PutInProgressError(f"block {short_key(key)} has a put in progress; revoke it instead")
        now = time.monotonic()
        if any(c.leased(now) for c in entry.copies.values()):
            raise ObjectLeasedError(f"block {short_key(key)} is being read (leased); retry after the lease ends")
        if entry.hard_pin:
            raise ObjectPinnedError(f"block {short_key(key)} is hard-pinned; unpin it first")
        del self._entries[key]
        for copy in list(entry.copies.values()):
            copy.tier.eviction.on_remove(key)
            if copy.state is State.COMMITTED:
                self._notify(entry, copy.tier, False)
            # A copy being evicted, or a pending copy a spill or promotion is filling, is freed by
            # that operation when it sees the entry gone.
            if copy.state is State.COMMITTED and not copy.evicting:
                await copy.tier.backend.release(copy.slot)

    def pin(self, key: bytes, *, hard: bool = False, ttl: float | None = None) -> None:
        """Hard pin: never evicted. Soft pin: evicted only when nothing else can be, for ``ttl`` s."""
        entry = self._committed_entry(key)
        if hard:
            entry.hard_pin = True
        else:
            entry.soft_pin_until = max(entry.soft_pin_until, time.monotonic() + (ttl if ttl is not None else 60.0))

    def hold(self, key: bytes, until: float) -> None:
        """Keep ``key`` from eviction until ``until`` (monotonic; a later hold extends it). Unlike a
        lease it does not keep a remove from taking it: whoever decided the block's fate may still."""
        entry = self._committed_entry(key)
        if entry.hold_until <= time.monotonic():
            # out of the eviction policies while held, so that a scan for victims never walks over held
            # blocks (a burst of reads would hold thousands); back in, as just used, once it ends
            for index in entry.committed():
                self.tiers[index].eviction.on_remove(key)
            heapq.heappush(self._holds, (until, key))
        entry.hold_until = max(entry.hold_until, until)

    def _end_holds(self) -> None:
        """Holds that ended: their blocks go back into their tiers' eviction policies."""
        now = time.monotonic()
        while self._holds and self._holds[0][0] <= now:
            _, key = heapq.heappop(self._holds)
            entry = self._entries.get(key)
            if entry is None:
                continue  # removed while held
            if entry.hold_until > now:  # extended meanwhile
                heapq.heappush(self._holds, (entry.hold_until, key))
                continue
            for index in entry.committed():
                if not entry.copies[index].evicting:
                    self.tiers[index].eviction.on_insert(key, entry.meta)

    def set_keep(self, key: bytes, keep: bool) -> None:
        """Whether ``key``'s last copy may be evicted (``put_start(keep=...)``)."""
        self._committed_entry(key).keep = keep

    async def persist_copy(self, key: bytes, tier: str, *, sync: bool = True) -> None:
        """Write ``key``'s committed copy down into the disk tier ``tier`` too (if it has none there),
        on the device before this returns with ``sync``. The copies stay inclusive: the memory copy
        keeps serving reads, and may be evicted later without a spill."""
        target = self.tier(tier)
        disk = target.backend
        if not isinstance(disk, DiskTierBackend):
            raise ValueError(f"tier {tier!r} is not a disk tier")
        entry = self._committed_entry(key)
        present = entry.copies.get(target.index)
        if present is not None:
            if present.state is State.COMMITTED:
                return  # already there (written synced, or recovered from the disk)
            raise PutInProgressError(f"block {short_key(key)} is being written to {tier!r} already")
        for i in entry.committed():  # the copy to write down from: one in memory
            source, memory = entry.copies[i], entry.copies[i].tier.backend
            if isinstance(memory, MemoryTierBackend):
                break
        else:
            raise ObjectNotFoundError(f"block {short_key(key)} has no copy in memory to write down")
        lease = self._lease(source, math.inf)
        try:
            slot = await self._allocate(target, entry.nbytes)
            copy = Copy(target, slot)
            entry.copies[target.index] = copy
            try:
                await disk.persist(
                    slot,
                    key,
                    entry.parent,
                    memory.view(source.slot, entry.nbytes),
                    tenant=entry.meta.tenant,
                    seal=entry.seal,
                    sync=sync,
                )
            except BaseException:
                entry.copies.pop(target.index, None)
                await target.backend.release(slot)
                raise
        finally:
            await self.release_lease(key, lease)
        if self._entries.get(key) is not entry:  # removed while it was written
            entry.copies.pop(target.index, None)
            await target.backend.release(slot)
            raise ObjectNotFoundError(f"block {short_key(key)} was removed while it was written to {tier!r}")
        self._commit_copy(entry, copy)

    def set_eviction(self, tier: str, policy: EvictionPolicy) -> None:
        """Switch ``tier`` to another eviction policy at run time; the resident blocks move over in
        the old policy's eviction order (the next victim first), so recency carries over."""
        t = self.tier(tier)
        order = t.eviction.victims(len(t.eviction))
        for key in order:
            entry = self._entries.get(cast(bytes, key))  # the store's policies hold its keys
            policy.on_insert(key, entry.meta if entry is not None else BlockMeta())
        t.eviction = policy

    async def flush(self, tiers: list[str] | None = None) -> int:
        """Drop every block that may go now (not pinned, leased or in use); returns how many went.
        With ``tiers``, only their copies go, each pushed down to the next tier as an eviction would
        (so flushing a node's pool leaves its blocks on SSD)."""
        now = time.monotonic()
        indexes = None if tiers is None else {self.tier(name).index for name in tiers}
        victims = [
            (e.key, [i for i in e.committed() if indexes is None or i in indexes])
            for e in self._entries.values()
            if e.committed()
            and not e.hard_pin
            and e.soft_pin_until <= now
            and not any(c.leased(now) or c.tier.backend.in_use(c.slot) for c in e.copies.values())
        ]
        gone = 0
        for key, where in victims:
            if not where:
                continue
            with contextlib.suppress(StoreError):  # leased or removed meanwhile: it stays or is gone
                if indexes is None:
                    await self.remove(key)
                else:
                    for index in where:
                        tier = self.tiers[index]
                        tier.eviction.on_remove(key)
                        async with tier.evict_lock:
                            await self._demote(tier, key)
                gone += 1
        return gone

    def is_pinned(self, key: bytes) -> bool:
        """Hard-pinned (soft pins expire on their own and are not reported)."""
        return self._committed_entry(key).hard_pin

    def unpin(self, key: bytes) -> None:
        entry = self._committed_entry(key)
        entry.hard_pin = False
        entry.soft_pin_until = 0.0
