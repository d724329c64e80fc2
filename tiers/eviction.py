"""Eviction and spill, a part of ``TieredStore`` (``store.py``): which copies may go, a tenant's
quota in a tier, the high-watermark rounds, and a copy moved down a tier (spilled) or dropped from
the last. It works on the store's entries and tiers, under the store's rules (module docstring of
``store.py``)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

from .backend import DiskTierBackend, MemoryTierBackend
from .buffers import copy_async
from .entries import Copy, Entry, State, Tier, short_key
from .errors import (
    StoreError,
    TierFullError,
)
from .store_part import StorePart

log = logging.getLogger(__name__)


class Throttled:
    """One log line per ``every`` seconds for a recurring failure (a full disk fails every spill:
    thousands of identical lines a minute), counting the ones held back."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last = -math.inf
        self._held = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        log.warning(message + (f" (and {held} more like it in the last {self.every:g} s)" if held else ""), *args)


class StoreEviction(StorePart):
    """``TieredStore``'s eviction and spill (its entries, its tiers)."""

    def _evictable(self, tier: Tier, *, soft_ok: bool, tenant: str | None = None, lossless: bool = False):
        """Which keys of ``tier`` may go now. ``lossless``: only those that lose nothing by it, with
        a copy below or room below to spill into as it is (what a promotion may evict: bringing a
        block up must never drop another's last copy, as a read of a persisted object once dropped
        memory-level objects off a full SSD)."""
        now = time.monotonic()
        index, last = tier.index, len(self.tiers) - 1

        def can_evict(key: Any) -> bool:
            entry = self._entries.get(key)
            if entry is None or entry.hard_pin or (tenant is not None and entry.meta.tenant != tenant):
                return False
            copy = entry.copies.get(index)
            if copy is None or copy.state is not State.COMMITTED or copy.evicting:
                return False
            if copy.leased(now) or tier.backend.in_use(copy.slot) or entry.hold_until > now:
                return False
            below = any(i > index for i in entry.committed())
            if entry.keep and index == last and not below:
                return False  # a kept block's last copy, at the bottom: nowhere to spill it
            if lossless and not below and not self._room_below(index, entry.nbytes):
                return False
            return soft_ok or entry.soft_pin_until <= now

        return can_evict

    def _room_below(self, index: int, nbytes: int) -> bool:
        """Whether a tier below ``index`` has room for ``nbytes`` without evicting anything."""
        return any(
            t.backend.accepts(nbytes) and t.backend.capacity_bytes - t.backend.used_bytes >= nbytes
            for t in self.tiers[index + 1 :]
        )

    async def _within_quota(self, tier: Tier, entry: Entry) -> bool:
        """Room for ``entry`` in its tenant's share of ``tier``, evicting the tenant's own blocks
        (by the tier's policy) to make it; False when the share is held by blocks that may not go."""
        quota, tenant = tier.tenant_quota_bytes, entry.meta.tenant
        if quota is None:
            return True
        async with tier.evict_lock:
            while tier.tenant_bytes[tenant] + entry.nbytes > quota:
                over = tier.tenant_bytes[tenant] + entry.nbytes - quota
                if not await self._evict_some(tier, over, tenant=tenant):
                    tier.stats.quota_refusals += 1
                    return False
        return True

    async def _evict_some(self, tier: Tier, nbytes: int, tenant: str | None = None, lossless: bool = False) -> bool:
        """Evict blocks worth about ``nbytes`` from ``tier`` (only ``tenant``'s, when given; only
        what loses nothing by it, ``lossless``); False when nothing may be evicted."""
        if self._holds:
            self._end_holds()
        avg = max(1, tier.backend.used_bytes // max(1, len(tier.eviction)))
        want = max(1, min(64, -(-nbytes // avg)))
        victims = tier.eviction.victims(want, self._evictable(tier, soft_ok=False, tenant=tenant, lossless=lossless))
        if not victims:
            victims = tier.eviction.victims(want, self._evictable(tier, soft_ok=True, tenant=tenant, lossless=lossless))
        for key in victims:
            await self._demote(tier, cast(bytes, key))  # the store's policies hold its keys
        return bool(victims)

    async def _watermark_round(self, tier: Tier) -> None:
        """Bring the tier down to ``high_watermark - evict_fraction`` of its capacity."""
        target = (tier.high_watermark - tier.evict_fraction) * tier.backend.capacity_bytes
        try:
            async with tier.evict_lock:
                while tier.backend.used_bytes > target:
                    need = int(tier.backend.used_bytes - target)
                    if not await self._evict_some(tier, need):
                        break
        except Exception:  # a background round must never die silently
            log.exception("store: watermark eviction of tier %s failed", tier.name)

    async def _demote(self, tier: Tier, key: bytes) -> None:
        """Move ``key``'s copy out of ``tier``: spill it down unless a lower tier has it already."""
        entry = self._entries.get(key)
        copy = entry.copies.get(tier.index) if entry is not None else None
        if entry is None or copy is None:
            return
        tier.stats.evictions += 1
        tier.stats.note_residency(time.monotonic() - copy.committed_at)
        copy.evicting = True
        try:
            has_lower = any(i > tier.index for i in entry.committed())
            if not has_lower:
                spilled = await self._spill(entry, tier, copy)
                if not spilled:
                    if entry.keep and self._entries.get(key) is entry:
                        return  # kept: where no lower tier takes it, it stays
                    tier.stats.drops += 1
        finally:
            copy.evicting = False
        if self._entries.get(key) is not entry:
            await tier.backend.release(copy.slot)  # removed during the spill; remove() left it to us
            return
        del entry.copies[tier.index]
        self._notify(entry, tier, False)
        if not entry.copies:
            del self._entries[key]
        if copy.leased(time.monotonic()):
            copy.free_on_release = True  # a reader arrived during the spill; free when it is done
        else:
            await tier.backend.release(copy.slot)

    async def _spill(self, entry: Entry, tier: Tier, copy: Copy) -> bool:
        if tier.index + 1 >= len(self.tiers) or not isinstance(tier.backend, MemoryTierBackend):
            return False  # the last tier, or a disk tier (its blocks go nowhere further)
        src = tier.backend.view(copy.slot, entry.nbytes)
        try:
            lower = await self._place(entry, tier.index + 1, offer=True)
        except TierFullError as exc:
            log.info("store: dropping %s from %s: %s", short_key(entry.key), tier.name, exc)
            return False
        if lower is None:
            return False
        backend = lower.tier.backend
        try:
            if isinstance(backend, MemoryTierBackend):
                await self._copy(backend.view(lower.slot, entry.nbytes), src)
            else:
                assert isinstance(backend, DiskTierBackend)  # a tier is one or the other
                await backend.persist(
                    lower.slot, entry.key, entry.parent, src, tenant=entry.meta.tenant, seal=entry.seal
                )
        except StoreError as exc:
            entry.copies.pop(lower.tier.index, None)
            await lower.tier.backend.release(lower.slot)
            self._spill_failures.warning(
                "store: spill of %s to %s failed: %s", short_key(entry.key), lower.tier.name, exc
            )
            return False
        if self._entries.get(entry.key) is not entry:  # removed while we wrote
            entry.copies.pop(lower.tier.index, None)
            await lower.tier.backend.release(lower.slot)
            return False
        self._commit_copy(entry, lower)
        lower.tier.stats.spills_in += 1
        return True

    async def _drop_copy(self, entry: Entry, index: int) -> None:
        copy = entry.copies.pop(index)
        copy.tier.eviction.on_remove(entry.key)
        self._notify(entry, copy.tier, False)
        if not entry.copies:
            self._entries.pop(entry.key, None)
        await copy.tier.backend.release(copy.slot)

    async def _copy(self, dst: Any, src: Any) -> None:
        await copy_async(dst, src, self.inline_copy_max)
