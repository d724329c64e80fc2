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
from collections.abc import Hashable
from dataclasses import dataclass, field

from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord

from .base import BlockMeta, EvictionPolicy


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.tree = [0] * (n + 1)

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


@dataclass
class TraceStats:
    accesses: int = 0
    reaccesses: int = 0
    reuse_distances: list[int] = field(default_factory=list)
    reuse_times_s: list[float] = field(default_factory=list)
    prefetchable: int = 0

    @property
    def prefetchable_share(self) -> float:
        return self.prefetchable / self.reaccesses if self.reaccesses else 0.0

    def lru_hit_ratio(self, capacity: float) -> float:
        """The hit ratio of block LRU at ``capacity``, from the stack distances alone."""
        return sum(d < capacity for d in self.reuse_distances) / self.accesses if self.accesses else 0.0


def trace_stats(records: list[TraceRecord], lead_s: float = 0.0) -> TraceStats:
    keyed = [[h if r.tenant is None else (r.tenant, h) for h in r.hash_ids] for r in records]
    n = sum(len(k) for k in keyed)
    marks = _Fenwick(n)  # 1 at the latest position of every block seen so far
    last_pos: dict[Hashable, int] = {}
    last_time: dict[Hashable, float] = {}
    # announced[key]: the latest arrival of a request whose chain a follow-up could extend through key
    chain_end: dict[Hashable, float] = {}  # a request's last block -> its arrival (follow-ups extend it)
    users: dict[Hashable, list[Hashable]] = {}  # block -> last blocks of the requests that used it
    stats = TraceStats()
    pos = 0
    for record, keys in zip(records, keyed):
        now = record.timestamp / 1000
        # the earlier requests this one extends: those whose last block is in this chain
        extended = {k: chain_end[k] for k in keys if k in chain_end}
        for key in keys:
            stats.accesses += 1
            previous = last_pos.get(key)
            if previous is not None:
                stats.reaccesses += 1
                stats.reuse_distances.append(marks.prefix(pos) - marks.prefix(previous + 1))
                stats.reuse_times_s.append(now - last_time[key])
                marks.add(previous, -1)
                if any(end in extended and now - extended[end] >= lead_s for end in users.get(key, ())):
                    stats.prefetchable += 1
            else:
                stats.reuse_distances.append(math.inf)
            marks.add(pos, 1)
            last_pos[key] = pos
            last_time[key] = now
            pos += 1
        # a follow-up turn repeats this prompt's full blocks; its last, partial block comes back
        # completed, under another id, so the chain a follow-up extends ends at the last full block
        full = len(keys) - (1 if record.input_length % TRACE_BLOCK_TOKENS else 0)
        end = keys[max(full, 1) - 1]
        chain_end[end] = now
        for key in keys:
            users.setdefault(key, []).append(end)
            if len(users[key]) > 8:  # the recent users are the ones a follow-up extends
                del users[key][0]
    return stats


def residency(stream, capacity: int, policy: EvictionPolicy, times: list[float] | None = None) -> list[float]:
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
            (victim,) = policy.victims(1)
            start = inserted.pop(victim)
            out.append(times[i] - times[start] if times else i - start)
        inserted[key] = i
        policy.on_insert(key, BlockMeta(parent=access.parent))
    return out
