"""What a trace says about caching, independent of any policy, and what a policy does with it:

- reuse distance: for each re-access of a block, how many *distinct* blocks were accessed since its
  previous access (the LRU stack distance: an LRU cache of C blocks hits exactly the re-accesses
  with distance < C);
- reuse time: seconds between a block's accesses;
- residency: how long a block stays in a tier under a policy, from insertion to eviction (in
  accesses and in seconds), from the simulator;
- prefetchability: the share of re-accesses whose reuse could have been fetched ahead of the request.
  Definition: a re-access is prefetchable when the request extends the chain of an earlier request
  that used the block (a follow-up turn: that request's full blocks are a prefix of this one's) and that
  earlier request arrived at least ``lead_s`` before (time enough to bring the block up a tier).
  Re-accesses through a shared prefix by a request that extends none of its users' chains (another
  conversation on the same system prompt) are not: nothing announces them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tiercake.policies.base import BlockMeta, EvictionPolicy, one_victim
from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.tree = [0] * (n + 1)

    def __len__(self) -> int:
        return len(self.tree) - 1

    @classmethod
    def ones(cls, n: int, k: int) -> _Fenwick:
        """Size ``n`` with a 1 at each of the positions [0, k): node i covers (i - lowbit(i), i], so it
        holds how many of those are at most k."""
        import numpy as np

        tree = cls(0)
        i = np.arange(n + 1, dtype=np.int64)
        tree.tree = np.clip(np.minimum(i, k) - (i - (i & -i)), 0, None).tolist()
        tree.tree[0] = 0
        return tree

    def add(self, i: int, delta: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions [0, i)."""
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


def histogram(values: list[float], edges: list[float]) -> dict[str, int]:
    """Counts per bucket ``[edges[k], edges[k+1])``, the last bucket open-ended."""
    counts = [0] * len(edges)
    for v in values:
        k = 0
        while k + 1 < len(edges) and v >= edges[k + 1]:
            k += 1
        counts[k] += 1
    labels = [f"{edges[k]:g}-{edges[k + 1]:g}" for k in range(len(edges) - 1)] + [f"{edges[-1]:g}+"]
    return dict(zip(labels, counts))


@dataclass(slots=True)
class Reaccess:
    """One access to a block seen before."""

    distance: float  # distinct blocks accessed since its previous access (LRU stack distance)
    reuse_time_s: float
    lead_s: float | None  # how long ago the earliest request this one extends used it; None: no such request
    prefetchable: bool  # lead_s is at least the tracker's lead


class ReuseTracker:
    """Reuse distance, reuse time and prefetchability of a stream of requests, fed one request at a
    time: offline over a trace, or live at the front. The same code measures both.

    ``max_blocks`` bounds the memory: the tracker forgets all but the most recent ``max_blocks``
    distinct blocks, so a block it forgot counts as new (its true distance was at least that), and a
    block seen again after that has forgotten the requests that used it before (prefetchability is
    then undercounted, never overcounted)."""

    USERS_KEPT = 8  # the recent requests that used a block are the ones a follow-up extends

    def __init__(self, lead_s: float = 0.0, max_blocks: int | None = None, expected_accesses: int = 0) -> None:
        self.lead_s = lead_s
        self.max_blocks = max_blocks
        self._marks = _Fenwick(max(expected_accesses, 2 * (max_blocks or 0), 1024))  # 1 at each block's latest position
        self._pos = 0
        self._last_pos: dict[Hashable, int] = {}  # in order of last access (re-inserted on each)
        self._last_time: dict[Hashable, float] = {}
        self._chain_end: dict[Hashable, float] = {}  # a request's last full block -> its arrival
        self._users: dict[Hashable, list[Hashable]] = {}  # block -> chain ends of the requests that used it

    def observe(self, keys: Sequence[Hashable], now: float, full_blocks: int | None = None) -> list[Reaccess | None]:
        """One request's block keys (in chain order) arriving at ``now`` seconds; ``full_blocks``: how
        many of them are full (a follow-up turn repeats only those). Per key: a ``Reaccess``, or None
        for a block not seen before."""
        if self._pos + len(keys) > len(self._marks):
            self._compact(len(keys))
        # the earlier requests this one extends: those whose last full block is in this chain
        extended = {k: self._chain_end[k] for k in keys if k in self._chain_end}
        out: list[Reaccess | None] = []
        for key in keys:
            previous = self._last_pos.pop(key, None)
            if previous is None:
                out.append(None)
            else:
                distance = self._marks.prefix(self._pos) - self._marks.prefix(previous + 1)
                leads = [now - extended[end] for end in self._users.get(key, ()) if end in extended]
                lead = max(leads, default=None)
                out.append(
                    Reaccess(distance, now - self._last_time[key], lead, lead is not None and lead >= self.lead_s)
                )
                self._marks.add(previous, -1)
            self._marks.add(self._pos, 1)
            self._last_pos[key] = self._pos
            self._last_time[key] = now
            self._pos += 1
        if keys:
            # a follow-up turn repeats this prompt's full blocks; its last, partial block comes back
            # completed, under another id, so the chain a follow-up extends ends at the last full block
            full = len(keys) if full_blocks is None else full_blocks
            end = keys[max(full, 1) - 1]
            self._chain_end[end] = now
            for key in keys:
                users = self._users.setdefault(key, [])
                users.append(end)
                if len(users) > self.USERS_KEPT:
                    del users[0]
        return out

    def _compact(self, incoming: int) -> None:
        """Renumber the blocks remembered (the most recent ``max_blocks``) from 0, in order."""
        alive = list(self._last_pos)  # least recently accessed first
        if self.max_blocks is not None and len(alive) > self.max_blocks:
            alive = alive[len(alive) - self.max_blocks :]
            self._last_time = {key: self._last_time[key] for key in alive}
            self._users = {key: users for key in alive if (users := self._users.get(key)) is not None}
            # the chain ends still named by a remembered block's users are all a check can ask for
            named = {end for users in self._users.values() for end in users}
            self._chain_end = {end: t for end, t in self._chain_end.items() if end in named}
        self._marks = _Fenwick.ones(max(2 * (len(alive) + incoming), len(self._marks)), len(alive))
        self._last_pos = {key: i for i, key in enumerate(alive)}
        self._pos = len(alive)


@dataclass
class TraceStats:
    accesses: int = 0
    reaccesses: int = 0
    reuse_distances: list[float] = field(default_factory=list)  # math.inf: never seen before
    reuse_times_s: list[float] = field(default_factory=list)
    prefetchable: int = 0

    @property
    def prefetchable_share(self) -> float:
        return self.prefetchable / self.reaccesses if self.reaccesses else 0.0

    def lru_hit_ratio(self, capacity: float) -> float:
        """The hit ratio of block LRU at ``capacity``, from the stack distances alone."""
        return sum(d < capacity for d in self.reuse_distances) / self.accesses if self.accesses else 0.0


def trace_stats(records: list[TraceRecord], lead_s: float = 0.0) -> TraceStats:
    tracker = ReuseTracker(lead_s, expected_accesses=sum(len(r.hash_ids) for r in records))
    stats = TraceStats()
    for record in records:
        keys = [h if record.tenant is None else (record.tenant, h) for h in record.hash_ids]
        full = len(keys) - (1 if record.input_length % TRACE_BLOCK_TOKENS else 0)
        for seen in tracker.observe(keys, record.timestamp / 1000, full):
            stats.accesses += 1
            if seen is None:
                stats.reuse_distances.append(math.inf)
                continue
            stats.reaccesses += 1
            stats.reuse_distances.append(seen.distance)
            stats.reuse_times_s.append(seen.reuse_time_s)
            stats.prefetchable += seen.prefetchable
    return stats


def residency(stream, capacity: float, policy: EvictionPolicy, times: list[float] | None = None) -> list[float]:
    """Residency of every evicted block in one tier of ``capacity`` under ``policy``: accesses (or,
    with ``times`` per access, seconds) from insertion to eviction."""
    inserted: dict[Hashable, int] = {}
    out: list[float] = []
    for i, access in enumerate(stream):
        key = access.key
        if key in inserted:
            policy.on_access(key)
            continue
        if len(inserted) >= capacity:
            victim = one_victim(policy, inserted)
            start = inserted.pop(victim)
            out.append(times[i] - times[start] if times else i - start)
        inserted[key] = i
        policy.on_insert(key, BlockMeta(parent=access.parent))
    return out
