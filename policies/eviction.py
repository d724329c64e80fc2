"""Built-in eviction policies: LRU, FIFO, LFU, S3-FIFO, ARC, leaf-first prefix LRU and the online reuse-learning policy."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .base import BlockMeta, CanEvict, EvictionPolicy, Key, _always


class _OrderedPolicy(EvictionPolicy):
    """Evicts in the order of one OrderedDict (oldest first); subclasses decide what moves a key."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        if can_evict is _always:
            while len(chosen) < n and self._order:
                chosen.append(self._order.popitem(last=False)[0])
            return chosen
        for key in self._order:
            if len(chosen) >= n:
                break
            if can_evict(key):
                chosen.append(key)
        for key in chosen:
            del self._order[key]
        return chosen

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LRU(_OrderedPolicy):
    """Least recently used first."""

    name = "lru"

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class FIFO(_OrderedPolicy):
    """First inserted first out; hits do not reorder."""

    name = "fifo"

    def on_access(self, key: Key) -> None:
        pass


class LFU(EvictionPolicy):
    """Least frequently used first; ties go to the least recently used."""

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}

    def _place(self, key: Key, freq: int) -> None:
        self._freq[key] = freq
        self._buckets.setdefault(freq, OrderedDict())[key] = None

    def _unplace(self, key: Key) -> int:
        freq = self._freq.pop(key)
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]
        return freq

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        if key in self._freq:
            self._unplace(key)
        self._place(key, 1)

    def on_access(self, key: Key) -> None:
        if key in self._freq:
            self._place(key, self._unplace(key) + 1)

    def on_remove(self, key: Key) -> None:
        if key in self._freq:
            self._unplace(key)

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        for freq in sorted(self._buckets):
            for key in self._buckets[freq]:
                if len(chosen) >= n:
                    break
                if can_evict(key):
                    chosen.append(key)
            if len(chosen) >= n:
                break
        for key in chosen:
            self._unplace(key)
        return chosen

    def frequency(self, key: Key) -> int:
        return self._freq.get(key, 0)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

    New keys enter the small queue. A key evicted from the small queue that was never hit there is a
    one-hit wonder and leaves (remembered as a ghost); one that was hit moves to the main queue. A
    ghost that comes back goes straight to main. Main is FIFO with reinsertion of hit keys.
    """

    name = "s3fifo"
    _MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0 < small_fraction < 1:
            raise ValueError("small_fraction must be in (0, 1)")
        self.small_fraction = small_fraction
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._small_bytes = 0
        self._total_bytes = 0

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        was_ghost = self._ghost.pop(key, False) is None
        if key in self._freq:
            self._forget(key)
        self._freq[key] = 0
        self._size[key] = meta.size
        self._total_bytes += meta.size
        if was_ghost:
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += meta.size

    def on_access(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self._MAX_FREQ)

    def _forget(self, key: Key) -> None:
        size = self._size.pop(key)
        self._total_bytes -= size
        del self._freq[key]
        if self._small.pop(key, False) is None:
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def on_remove(self, key: Key) -> None:
        if key in self._freq:
            self._forget(key)
        self._ghost.pop(key, None)

    def _remember_ghost(self, key: Key) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(len(self._freq), 16):
            self._ghost.popitem(last=False)

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        # Every step either evicts, promotes, decrements a counter or skips a key; the budget bounds
        # the work when most keys cannot be evicted.
        budget = (self._MAX_FREQ + 2) * (len(self._freq) + 1)
        while len(chosen) < n and self._freq and budget > 0:
            budget -= 1
            use_small = self._small and (self._small_bytes >= self.small_fraction * self._total_bytes or not self._main)
            if use_small:
                key, _ = self._small.popitem(last=False)
                if not can_evict(key):
                    self._small[key] = None  # keep it, behind the others
                elif self._freq[key] > 0:
                    self._small_bytes -= self._size[key]
                    self._freq[key] = 0
                    self._main[key] = None
                else:
                    self._forget_small_victim(key)
                    chosen.append(key)
            else:
                key, _ = self._main.popitem(last=False)
                if not can_evict(key):
                    self._main[key] = None
                elif self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main[key] = None
                else:
                    self._forget_main_victim(key)
                    chosen.append(key)
        return chosen

    def _forget_small_victim(self, key: Key) -> None:
        size = self._size.pop(key)
        self._small_bytes -= size
        self._total_bytes -= size
        del self._freq[key]
        self._remember_ghost(key)

    def _forget_main_victim(self, key: Key) -> None:
        self._total_bytes -= self._size.pop(key)
        del self._freq[key]

    def queue_of(self, key: Key) -> str | None:
        """'small', 'main', 'ghost' or None: for tests and operators."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        return None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "small": len(self._small), "main": len(self._main), "ghost": len(self._ghost)}

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03).

    T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 are their ghosts. A hit
    in B1 means recency would have paid, so the target size ``p`` of T1 grows; a hit in B2 shrinks
    it. ``capacity`` is in keys; when not given it is learned as the largest resident count seen
    (eviction only starts when the tier is full, so that is the tier's capacity in blocks).
    """

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        self._c = capacity or 0
        self._learn_capacity = capacity is None
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._last_ghost_hit_b2 = False

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)
        self._last_ghost_hit_b2 = False
        if key in self._b1:
            self.p = min(float(self._c), self.p + max(len(self._b2) / max(len(self._b1), 1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / max(len(self._b2), 1), 1.0))
            del self._b2[key]
            self._t2[key] = None
            self._last_ghost_hit_b2 = True
        else:
            self._t1[key] = None
        if self._learn_capacity:
            self._c = max(self._c, len(self._t1) + len(self._t2))
        self._trim_ghosts()

    def on_access(self, key: Key) -> None:
        if self._t1.pop(key, False) is None or self._t2.pop(key, False) is None:
            self._t2[key] = None

    def on_remove(self, key: Key) -> None:
        for queue in (self._t1, self._t2, self._b1, self._b2):
            queue.pop(key, None)

    def _pick(self, queue: OrderedDict[Key, None], can_evict: CanEvict) -> Key | None:
        for key in queue:
            if can_evict(key):
                return key
        return None

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        while len(chosen) < n:
            prefer_t1 = self._t1 and (
                len(self._t1) > self.p or (self._last_ghost_hit_b2 and len(self._t1) == int(self.p))
            )
            order = ((self._t1, self._b1), (self._t2, self._b2))
            if not prefer_t1:
                order = order[::-1]
            for queue, ghost in order:
                key = self._pick(queue, can_evict)
                if key is not None:
                    del queue[key]
                    ghost[key] = None
                    chosen.append(key)
                    break
            else:
                break
        self._trim_ghosts()
        return chosen

    def _trim_ghosts(self) -> None:
        c = max(self._c, 1)
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "p": self.p,
            "t1": len(self._t1),
            "t2": len(self._t2),
            "b1": len(self._b1),
            "b2": len(self._b2),
        }

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


class LeafFirstLRU(EvictionPolicy):
    """Prefix-aware LRU: only a block that no resident block extends (a leaf) may be evicted.

    A block is only usable with its whole prefix, so evicting a parent before its children would
    leave the children unreachable. Among leaves, the least recently used goes first. Leaves are kept
    in a heap keyed by last access with lazy invalidation, so each choice is O(log n).
    """

    name = "leaf_lru"

    def __init__(self) -> None:
        self._last: dict[Key, int] = {}
        self._parent: dict[Key, Key | None] = {}
        self._children: dict[Key, int] = {}  # resident children per key, resident or not
        self._heap: list[tuple[int, Key]] = []
        self._clock = itertools.count()

    def _is_leaf(self, key: Key) -> bool:
        return self._children.get(key, 0) == 0

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._last[key], key))

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        if key in self._last:
            self.on_access(key)
            return
        self._last[key] = next(self._clock)
        self._parent[key] = meta.parent
        if meta.parent is not None:
            self._children[meta.parent] = self._children.get(meta.parent, 0) + 1
        self._push(key)

    def on_access(self, key: Key) -> None:
        if key in self._last:
            self._last[key] = next(self._clock)
            self._push(key)

    def _drop(self, key: Key) -> None:
        del self._last[key]
        parent = self._parent.pop(key)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                if parent in self._last:
                    self._push(parent)  # it just became a leaf

    def on_remove(self, key: Key) -> None:
        if key in self._last:
            self._drop(key)

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        skipped: list[tuple[int, Key]] = []
        while len(chosen) < n and self._heap:
            stamp, key = heapq.heappop(self._heap)
            if self._last.get(key) != stamp or not self._is_leaf(key):
                continue  # stale entry: accessed since, removed, or no longer a leaf
            if not can_evict(key):
                skipped.append((stamp, key))
                continue
            self._drop(key)
            chosen.append(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._last) + 64:
            self._heap = [(s, k) for k, s in self._last.items() if self._is_leaf(k)]
            heapq.heapify(self._heap)
        return chosen

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last


class ReuseAware(EvictionPolicy):
    """Learns online how likely a block is to be read again and evicts the one expected to be of
    least use: the lowest ``p(reuse) / (age + capacity)`` among a random sample of residents, unless
    that is not clearly below (``lru_margin``) the least recently used block's, which then goes: it
    departs from LRU only where what it learned says so, and is never far from LRU's choices where
    recency is all there is to know.

    ``p(reuse)`` is counted per kind of block: how often it has been read (1, 2, 3, 4+) and how deep
    in its chain it sits (in steps of four blocks), the signals that separate a shared system prompt
    and a conversation that keeps coming back from a turn that is never extended. Each read closes
    an interval that counts as reused; a block forgotten by the ghost list (twice the tier's resident
    count) closes one that did not. Ages are in accesses; the capacity (learned, as ARC does) keeps a
    block that has just arrived from looking infinitely valuable. Sampling keeps each choice O(sample)
    (about 16 us per eviction in CPython: for tiers that miss less often than they copy). Seeded:
    the same stream gives the same choices.
    """

    name = "reuse"
    MAX_COUNT = 4
    DEPTH_STEP = 4
    MAX_DEPTH_BUCKET = 8
    UNKNOWN_DEPTH = 31  # a block whose parent this tier never saw: treated as deep

    def __init__(self, sample: int = 32, seed: int = 0, ghosts: float = 2.0, lru_margin: float = 0.8) -> None:
        if sample < 1 or ghosts <= 0 or not 0 < lru_margin <= 1:
            raise ValueError("sample must be >= 1, ghosts > 0 and lru_margin in (0, 1]")
        self.sample, self.ghosts, self.lru_margin = sample, ghosts, lru_margin
        self._rng = random.Random(seed)
        self._clock = 0
        self._capacity = 0
        self._resident: dict[Key, list] = {}  # key -> [last access, reads, kind]
        self._keys: list[Key] = []  # the residents, for sampling
        self._slot: dict[Key, int] = {}
        self._recency: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, tuple] = OrderedDict()  # evicted: (reads, kind)
        self._depth: dict[Key, int] = {}
        self._seen: dict[tuple, list[float]] = {}  # kind -> [reused, intervals], with a prior of 1/2

    def _kind(self, reads: int, depth: int) -> tuple[int, int]:
        return min(reads, self.MAX_COUNT), min(depth // self.DEPTH_STEP, self.MAX_DEPTH_BUCKET)

    def _closed(self, kind: tuple, reused: bool) -> None:
        seen = self._seen.setdefault(kind, [1.0, 2.0])
        seen[0] += reused
        seen[1] += 1

    def p_reuse(self, kind: tuple) -> float:
        reused, intervals = self._seen.get(kind, (1.0, 2.0))
        return reused / intervals

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        self._clock += 1
        if key in self._resident:  # back after an eviction that did not happen
            self.on_access(key)
            return
        depth = 0 if meta.parent is None else self._depth.get(meta.parent, self.UNKNOWN_DEPTH) + 1
        self._depth[key] = depth
        reads = 1
        ghost = self._ghost.pop(key, None)
        if ghost is not None:  # read again after it was evicted: that interval was reused
            self._closed(ghost[1], True)
            reads = ghost[0] + 1
        self._resident[key] = [self._clock, reads, self._kind(reads, depth)]
        self._slot[key] = len(self._keys)
        self._keys.append(key)
        self._recency[key] = None
        self._capacity = max(self._capacity, len(self._resident))
        while len(self._ghost) > self.ghosts * self._capacity:
            forgotten, (_, kind) = self._ghost.popitem(last=False)
            self._closed(kind, False)
            self._depth.pop(forgotten, None)

    def on_access(self, key: Key) -> None:
        self._clock += 1
        entry = self._resident.get(key)
        if entry is None:
            return
        self._closed(entry[2], True)
        entry[0], entry[1] = self._clock, entry[1] + 1
        entry[2] = self._kind(entry[1], self._depth.get(key, self.UNKNOWN_DEPTH))
        self._recency.move_to_end(key)

    def _forget_resident(self, key: Key) -> list:
        entry = self._resident.pop(key)
        slot, last = self._slot.pop(key), self._keys.pop()
        if last != key:
            self._keys[slot], self._slot[last] = last, slot
        del self._recency[key]
        return entry

    def on_remove(self, key: Key) -> None:
        if key in self._resident:
            self._forget_resident(key)
        self._ghost.pop(key, None)
        self._depth.pop(key, None)

    def _valuer(self) -> Callable[[Key], float]:
        """A resident's expected use now: ``p(reuse) / (age + capacity)`` (one closure per choice:
        it runs ``sample`` times for each victim, the policy's hot spot)."""
        resident, seen, now = self._resident, self._seen, self._clock + 1 + self._capacity

        def value(key: Key) -> float:
            last, _, kind = resident[key]
            reused, intervals = seen.get(kind, (1.0, 2.0))
            return reused / intervals / (now - last)

        return value

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        chosen: list[Key] = []
        value = self._valuer()  # the clock does not move while victims are chosen
        while len(chosen) < n and self._keys:
            keys = self._keys
            oldest = next(iter(self._recency))
            candidates = self._rng.choices(keys, k=self.sample)
            candidates.append(oldest)
            if can_evict is not _always:
                candidates = [k for k in candidates if can_evict(k)]
                if not candidates:  # the sample was all held: look at every resident once
                    candidates = [k for k in keys if can_evict(k)]
                    if not candidates:
                        break
            victim = min(candidates, key=value)
            if victim != oldest and oldest in candidates and value(victim) > self.lru_margin * value(oldest):
                victim = oldest  # not clearly better than LRU's choice: LRU's choice
            _, reads, kind = self._forget_resident(victim)
            self._ghost[victim] = (reads, kind)
            chosen.append(victim)
        return chosen

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def describe(self) -> dict[str, Any]:
        learned = {f"reads{r}_depth{4 * d}+": round(self.p_reuse((r, d)), 3) for (r, d) in sorted(self._seen)}
        return {**super().describe(), "ghosts": len(self._ghost), "sample": self.sample, "p_reuse": learned}
