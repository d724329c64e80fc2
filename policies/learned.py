"""Which ordering to follow, learned online: a shadow of the tier for each candidate ordering, scored
on the same reads, and the tier evicts in the order of whichever shadow has hit most lately.

Design note. A session-aware ordering is only as good as what clients tell it: told little, a blind
ordering (LRU, ARC, S3-FIFO, ``reuse``) may keep more of what is read again. ARC and LeCaR learn
between orderings from ghosts of what each evicted; here each candidate keeps a whole shadow of the
tier (keys and sizes, no bytes), fed every read, insert, removal and session event the tier sees,
evicting within the tier's capacity by its own ordering. Its hits are then what that ordering alone
would have hit, not an estimate from the decisions the tier happened to take. Hits are discounted
by age (``half_life`` tier-fuls of reads), and the leader changes only when another shadow leads it
by ``margin``, so the tier does not flap between orderings of equal worth.

Following a leader, the tier first evicts what the leader's shadow has let go and it still holds
(``not_kept``), oldest first, and only then asks the leader's ordering: after a change of leader it
comes to hold what the new leader would, instead of a mixture of both orderings' choices (measured:
on the conversation trace at 3k blocks, 1.04 of the best blind policy without this, 1.09 with it).

A shadow holds at most ``shadow_keys`` keys: a larger tier is sampled by key hash (SHARDS,
Waldspurger et al., FAST'15), every shadow over the same keys of a tier scaled down alike, so the
cost is bounded per read and per tier, whatever the tier's size. The capacity is the tier's resident
size when it first evicts (the most it held at any eviction later): until then every shadow holds
everything and none has an edge.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import replace

from .base import BlockMeta, CanEvict, EvictionPolicy, Key, SessionEvent, one_victim

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: sequential ids (a trace's) sample evenly
_SAMPLE_BITS = 24
_FULL = 1 << _SAMPLE_BITS  # the threshold that samples every key


class _Shadow:
    """One ordering's imagined tier: its policy, what it holds, its discounted hits, and the real
    tier's residents it would not hold (``outside``, in the order it let them go)."""

    __slots__ = ("policy", "sizes", "size", "score", "outside", "resident")

    def __init__(self, policy: EvictionPolicy, resident: Container[Key]) -> None:
        self.policy = policy
        self.sizes: dict[Key, int] = {}
        self.size = 0
        self.score = 0.0
        self.outside: dict[Key, None] = {}
        self.resident = resident

    def read(self, key: Key, meta: BlockMeta, capacity: float, gain: float) -> bool:
        """Whether it was a hit."""
        if key in self.sizes:
            self.score += gain
            self.policy.on_access(key)
            return True
        while self.sizes and self.size + meta.size > capacity:
            victim = one_victim(self.policy, self.sizes)
            self.forget(victim)
            if victim in self.resident:
                self.outside[victim] = None
        self.outside.pop(key, None)
        self.sizes[key] = meta.size
        self.size += meta.size
        self.policy.on_insert(key, meta)
        return False

    def forget(self, key: Key) -> None:
        self.size -= self.sizes.pop(key)


class Shadows:
    """Shadows of the tier under each of ``policies`` (fresh, empty instances); ``leader`` is the
    index of the one that has hit most lately (0 until another leads it by ``margin``)."""

    def __init__(
        self,
        policies: Sequence[EvictionPolicy],
        resident: Container[Key],
        half_life: float = 8.0,
        margin: float = 0.05,
        shadow_keys: int = 16_384,
    ) -> None:
        if not policies:
            raise ValueError("at least one ordering to shadow")
        if not (0 < half_life < math.inf and 0 <= margin < math.inf and shadow_keys >= 16):
            raise ValueError("half_life must be positive and finite, margin finite and >= 0, shadow_keys >= 16")
        self.half_life, self.margin, self.shadow_keys = half_life, margin, shadow_keys
        self._shadows = [_Shadow(p, resident) for p in policies]
        self.leader = 0
        self._capacity = math.inf  # in the unit of BlockMeta.size, scaled by the sample
        self._threshold = _FULL  # a key is shadowed when its mixed hash is below this
        self._gain = 1.0  # the weight of a hit now; it grows instead of every score decaying
        self._growth = 1.0

    def _sampled(self, key: Key) -> bool:
        return (hash(key) * _MIX) & (_FULL - 1) < self._threshold

    @property
    def _rate(self) -> float:
        """The share of keys the shadows follow."""
        return self._threshold / _FULL

    def read(self, key: Key, meta: BlockMeta) -> None:
        """``key`` was read from the tier or inserted into it (a hit or a miss of the real tier)."""
        if self._threshold < _FULL and not self._sampled(key):
            return
        capacity, gain = self._capacity, self._gain
        hit = [shadow.read(key, meta, capacity, gain) for shadow in self._shadows]
        self._gain *= self._growth
        if self._gain > 1e200:
            for shadow in self._shadows:
                shadow.score /= self._gain
            self._gain = 1.0
        if any(hit):  # only a shadow that just hit can have overtaken the leader
            self._follow()

    def _follow(self) -> None:
        best = max(range(len(self._shadows)), key=lambda i: self._shadows[i].score)
        if self._shadows[best].score > self._shadows[self.leader].score * (1 + self.margin):
            self.leader = best

    def remove(self, key: Key) -> None:
        """``key`` left the tier for a reason other than eviction: it leaves every shadow."""
        for shadow in self._shadows:
            shadow.outside.pop(key, None)
            if key in shadow.sizes:
                shadow.forget(key)
                shadow.policy.on_remove(key)

    def evicted(self, key: Key) -> None:
        """The tier evicted ``key``: the shadows that still hold it keep it."""
        for shadow in self._shadows:
            shadow.outside.pop(key, None)

    def not_kept(self, n: int, can_evict: CanEvict) -> list[Key]:
        """Up to ``n`` of the tier's residents that the leader's shadow let go, those it let go
        first first: evicting them brings the tier to what the leader would hold."""
        chosen: list[Key] = []
        for key in self._shadows[self.leader].outside:
            if len(chosen) == n:
                break
            if can_evict(key):
                chosen.append(key)
        return chosen

    def on_session(self, event: SessionEvent) -> None:
        if self._threshold < _FULL:
            event = replace(event, keys=tuple(k for k in event.keys if self._sampled(k)))
        for shadow in self._shadows:
            shadow.policy.on_session(event)

    def full(self, resident_size: float, resident_keys: int) -> None:
        """The tier evicts, holding ``resident_size`` in ``resident_keys`` keys: its capacity is the
        most it held when it evicted (as ARC learns it; a caller may evict before the tier is full).
        The first time, a tier of more than ``shadow_keys`` keys is sampled from here on."""
        if resident_keys <= 0 or not math.isfinite(resident_size):
            return
        if math.isinf(self._capacity):
            rate = min(1.0, self.shadow_keys / resident_keys)
            self._threshold = max(1, int(rate * _FULL))
            for shadow in self._shadows:
                for key in [k for k in shadow.sizes if not self._sampled(k)]:
                    shadow.forget(key)
                    shadow.policy.on_remove(key)
                shadow.outside = {k: None for k in shadow.outside if self._sampled(k)}
        rate = self._rate
        if math.isinf(self._capacity) or resident_size * rate > self._capacity:
            self._capacity = resident_size * rate
            self._growth = 2.0 ** (1.0 / (self.half_life * max(resident_keys * rate, 1.0)))

    def describe(self) -> dict[str, object]:
        return {
            "leader": self._shadows[self.leader].policy.name,
            "scores": {s.policy.name: round(s.score / self._gain, 2) for s in self._shadows},
            "sampled": self._rate,
        }
