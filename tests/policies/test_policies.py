import random

import pytest

from tiercake.policies import (
    ARC,
    FIFO,
    LFU,
    LRU,
    S3FIFO,
    AdmitOnNth,
    AlwaysAdmit,
    BlockMeta,
    LeafFirstLRU,
    ReuseAware,
)

ALL = [LRU, FIFO, LFU, S3FIFO, ARC, LeafFirstLRU, ReuseAware]


@pytest.mark.parametrize("cls", ALL)
def test_contract(cls):
    p = cls()
    for k in range(10):
        p.on_insert(k, BlockMeta(size=1))
    assert len(p) == 10 and 3 in p
    out = p.victims(3, can_evict=lambda k: k % 2 == 1)
    assert len(out) == 3 and all(k % 2 == 1 for k in out)
    assert all(k not in p for k in out) and len(p) == 7
    p.on_remove(0)
    p.on_remove(0)  # idempotent
    p.on_remove("never-seen")
    assert 0 not in p and len(p) == 6
    assert p.victims(5, can_evict=lambda k: False) == []
    rest = p.victims(100)
    assert len(rest) == 6 and len(p) == 0
    assert p.victims(1) == []


@pytest.mark.parametrize("cls", ALL)
def test_survives_random_operations(cls):
    rng = random.Random(7)
    p = cls()
    resident = set()
    for _ in range(5000):
        op = rng.random()
        k = rng.randrange(200)
        if op < 0.4:
            if k not in resident:
                p.on_insert(k, BlockMeta())
                resident.add(k)
        elif op < 0.7:
            p.on_access(k)
        elif op < 0.8:
            p.on_remove(k)
            resident.discard(k)
        else:
            for v in p.victims(rng.randrange(1, 4), can_evict=lambda x: x % 7 != 0):
                assert v in resident and v % 7 != 0
                resident.discard(v)
        assert len(p) == len(resident)
    assert all(k in p for k in resident)


def test_lru_order():
    p = LRU()
    for k in "abc":
        p.on_insert(k)
    p.on_access("a")
    assert p.victims(2) == ["b", "c"]


def test_fifo_ignores_hits():
    p = FIFO()
    for k in "abc":
        p.on_insert(k)
    p.on_access("a")
    assert p.victims(1) == ["a"]


def test_lfu_prefers_rare_then_old():
    p = LFU()
    for k in "abcd":
        p.on_insert(k)
    for _ in range(3):
        p.on_access("a")
    p.on_access("b")
    assert p.victims(3) == ["c", "d", "b"]


def test_s3fifo_one_hit_wonders_leave_through_small_queue():
    p = S3FIFO(small_fraction=0.1)
    for k in range(100):
        p.on_insert(k)
    for k in range(0, 100, 2):  # even keys are hit again while in the small queue
        p.on_access(k)
    assert all(p.queue_of(k) == "small" for k in range(100))
    evicted = p.victims(40)
    # only one-hit wonders left, through the small queue into the ghost list; the hit keys stay
    assert all(k % 2 == 1 for k in evicted) and len(evicted) == 40
    assert all(p.queue_of(k) == "ghost" for k in evicted)
    assert all(k in p for k in range(0, 100, 2))
    assert sum(p.queue_of(k) == "main" for k in range(0, 100, 2)) >= 40
    # a ghost that comes back skips probation
    p.on_insert(1)
    assert p.queue_of(1) == "main"
    p.on_insert(1000)
    assert p.queue_of(1000) == "small"


class Cache:
    """A block-count cache of ``capacity`` driven by one policy: the simulator's loop in miniature."""

    def __init__(self, policy, capacity):
        self.policy, self.capacity = policy, capacity
        self.resident: set = set()
        self.hits = self.refs = 0

    def ref(self, k):
        self.refs += 1
        if k in self.resident:
            self.hits += 1
            self.policy.on_access(k)
            return
        if len(self.resident) >= self.capacity:
            for v in self.policy.victims(1):
                self.resident.discard(v)
        self.policy.on_insert(k)
        self.resident.add(k)


def hot_set_with_scan(seed, hot, hot_share, refs):
    """A hot set reused throughout, the rest a one-pass scan of never-repeated keys."""
    rng = random.Random(seed)
    scan = 10**6
    for _ in range(refs):
        if rng.random() < hot_share:
            yield rng.randrange(hot)
        else:
            scan += 1
            yield scan


def hits(policy, capacity, workload) -> int:
    cache = Cache(policy, capacity)
    for k in workload:
        cache.ref(k)
    return cache.hits


def test_s3fifo_resists_scans_better_than_lru():
    s3 = hits(S3FIFO(), 100, hot_set_with_scan(1, 60, 0.5, 20_000))
    lru = hits(LRU(), 100, hot_set_with_scan(1, 60, 0.5, 20_000))
    assert s3 > lru + 0.05 * 20_000


def test_arc_adapts_between_recency_and_frequency():
    p = ARC(capacity=10)
    cache = Cache(p, 10)
    # Recency phase: keys come back shortly after being evicted from T1 -> B1 hits raise p.
    for k in range(100, 105):  # a few keys seen twice fill part of the cache (T2)
        cache.ref(k)
        cache.ref(k)
    for _ in range(3):  # then a loop larger than what is left: misses come back from B1
        for k in range(10):
            cache.ref(k)
    p_recency = p.p
    assert p_recency > 0
    # Frequency phase: a small hot set reused again and again, interleaved with one-off keys that
    # push the hot set out of T2 into B2; B2 hits shrink p again.
    for rnd in range(30):
        for k in range(100, 106):
            cache.ref(k)
            cache.ref(k)
        for k in range(1000 + rnd * 12, 1000 + rnd * 12 + 12):
            cache.ref(k)
    assert p.p < p_recency


def test_arc_beats_lru_on_mixed_workload():
    assert hits(ARC(), 50, hot_set_with_scan(3, 40, 0.6, 30_000)) > hits(
        LRU(), 50, hot_set_with_scan(3, 40, 0.6, 30_000)
    )


def _chains(rng, n_chains=60, depth=8, branch=0.3):
    """Random prefix trees: each request is a chain that shares a random prefix with another."""
    chains = []
    nid = 0
    for _ in range(n_chains):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            cut = rng.randrange(1, len(base) + 1)
            chain = base[:cut]
        else:
            chain = []
        while len(chain) < depth:
            chain.append(nid)
            nid += 1
        chains.append(chain)
    return chains


def test_leaf_first_never_orphans_a_descendant():
    rng = random.Random(11)
    p = LeafFirstLRU()
    parent_of = {}
    resident = set()
    capacity = 40
    for chain in _chains(rng) * 3:
        for i, k in enumerate(chain):
            parent_of[k] = chain[i - 1] if i else None
            if k in resident:
                p.on_access(k)
                continue
            while len(resident) >= capacity:
                (v,) = p.victims(1)
                resident.discard(v)
                # no resident block extends the victim
                assert all(parent_of[r] != v for r in resident), f"evicted {v} under a resident child"
            p.on_insert(k, BlockMeta(parent=parent_of[k]))
            resident.add(k)
        # and no resident block is missing its parent
        assert all(parent_of[r] is None or parent_of[r] in resident for r in resident)


def test_plain_lru_would_orphan():
    """The property above is not vacuous: plain LRU evicts the chain's head first."""
    p = LRU()
    for k in range(4):
        p.on_insert(k)  # a request touches its blocks root first
    assert p.victims(1) == [0]
    q = LeafFirstLRU()
    for k in range(4):
        q.on_insert(k, BlockMeta(parent=k - 1 if k else None))
    assert q.victims(1) == [3]
    assert q.victims(3) == [2, 1, 0]


def test_leaf_first_respects_can_evict():
    q = LeafFirstLRU()
    q.on_insert("a")
    q.on_insert("b", BlockMeta(parent="a"))
    q.on_insert("c")
    assert q.victims(2, can_evict=lambda k: k != "b") == ["c"]  # b pinned, so a is not a leaf
    assert "a" in q and "b" in q


def test_admit_on_nth():
    p = AdmitOnNth(n=3)
    assert [p.admit("x") for _ in range(4)] == [False, False, True, True]
    assert AlwaysAdmit().admit("y")
    small = AdmitOnNth(n=2, memory=2)
    small.admit("a")
    small.admit("b")
    small.admit("c")  # forgets "a"
    assert small.admit("a") is False
    with pytest.raises(ValueError):
        AdmitOnNth(n=0)


def test_reuse_learns_which_kinds_of_block_are_read_again():
    """A block read again and again near the root (a shared system prompt) gets a far higher learned
    reuse probability than deep blocks read once (turns never extended), and stays resident while
    the one-shot blocks flow through."""
    policy = ReuseAware(sample=8)
    policy.on_insert("system", BlockMeta())
    for i in range(2000):
        policy.on_access("system")
        parent = "system"
        for depth in range(12):  # a chain of one-shot blocks under it
            key = f"turn-{i}-{depth}"
            policy.on_insert(key, BlockMeta(parent=parent))
            parent = key
        while len(policy) > 50:
            policy.victims(1)
    assert "system" in policy  # never evicted, though the least recently inserted
    assert policy.p_reuse((4, 0)) > 0.9 > 0.1 > policy.p_reuse((1, 2))
    assert policy.describe()["p_reuse"]


def test_reuse_is_reproducible_for_a_seed():
    def run(seed: int) -> list:
        policy, out = ReuseAware(sample=4, seed=seed), []
        for k in range(200):
            policy.on_insert(k, BlockMeta())
            if k % 3 == 0:
                policy.on_access(k // 2)
            if len(policy) > 20:
                out += policy.victims(1)
        return out

    assert run(1) == run(1)
