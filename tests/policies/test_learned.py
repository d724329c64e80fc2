"""Learning which ordering to follow (policies/learned.py): shadows scored on the same reads, the
leader the one that hit most lately, big tiers sampled; and the session policy, told little,
never far below the best blind ordering on a real generated trace."""

import pytest

from tiercake.analysis.cache_sim import TierSpec, session_stream, simulate
from tiercake.policies import ARC, FIFO, LRU, S3FIFO, BlockMeta, ReuseAware
from tiercake.policies.learned import Shadows
from tiercake.policies.sessions import SessionAware
from tiercake.traces import infer_sessions, synthetic_trace


def feed(shadows, resident, keys, capacity):
    """Reads ``keys`` through a FIFO tier of ``capacity`` keys (``resident``) and its ``shadows``."""
    for key in keys:
        shadows.read(key, BlockMeta())
        resident[key] = None
        if len(resident) >= capacity:
            shadows.full(len(resident), len(resident))
            shadows.evicted(resident.pop(next(iter(resident))))


def test_the_shadow_that_would_have_hit_more_leads():
    # a hot key read between cold ones: LRU keeps it, FIFO lets it go every tier-ful
    resident: dict = {}
    shadows = Shadows([FIFO(), LRU()], resident, margin=0.0)
    keys = [k for i in range(2000) for k in ("hot", f"cold{i}")]
    feed(shadows, resident, keys, capacity=8)
    assert shadows.leader == 1
    scores = shadows.describe()["scores"]
    assert scores["lru"] > scores["fifo"]


def test_the_first_ordering_leads_until_another_is_better_by_the_margin():
    resident: dict = {}
    shadows = Shadows([LRU(), FIFO()], resident, margin=0.05)
    feed(shadows, resident, [f"k{i % 50}" for i in range(5000)], capacity=100)  # everything fits: a tie
    assert shadows.leader == 0


def test_a_big_tier_is_sampled_so_each_shadow_stays_bounded():
    resident: dict = {}
    shadows = Shadows([LRU(), FIFO()], resident, shadow_keys=64)
    feed(shadows, resident, range(20_000), capacity=4096)
    described = shadows.describe()
    assert 64 / 4096 * 0.5 < described["sampled"] <= 64 / 4096 * 1.01
    assert all(len(s.sizes) <= 2 * 64 for s in shadows._shadows)


def test_the_tier_is_pointed_at_what_the_leaders_shadow_let_go_first():
    """The real tier (FIFO here) holds the hot key and cold ones; the leader's shadow (LRU) let the
    oldest cold keys go: those are what the tier should evict, in the order they were let go, and a
    key the tier evicted or that was removed is no longer suggested."""
    resident: dict = {}
    shadows = Shadows([LRU()], resident)
    for key in ["a", "b", "c", "d"]:
        resident[key] = None
        shadows.read(key, BlockMeta())
    shadows.full(4, 4)
    shadows.read("a", BlockMeta())  # a hit: "a" is the most recent
    resident["e"] = None
    shadows.read("e", BlockMeta())  # the shadow makes room: "b" goes, though the tier holds it
    resident["f"] = None
    shadows.read("f", BlockMeta())  # and "c"
    assert shadows.not_kept(5, lambda key: True) == ["b", "c"]
    assert shadows.not_kept(5, lambda key: key != "b") == ["c"]
    shadows.evicted("b")
    shadows.remove("c")
    assert shadows.not_kept(5, lambda key: True) == []


def test_bad_parameters_are_refused():
    for kwargs in ({"half_life": 0}, {"half_life": float("nan")}, {"margin": -1}, {"shadow_keys": 1}):
        with pytest.raises(ValueError):
            Shadows([LRU()], {}, **kwargs)
    with pytest.raises(ValueError):
        Shadows([], {})


def test_told_only_that_sessions_exist_the_session_policy_keeps_up_with_the_best_blind_one():
    """A multi-tenant generated trace at a small capacity: the session ordering alone, told only that
    sessions are open, falls well below S3-FIFO there; learning against the blind orderings brings it
    to the best of them (issue 48: never below the best blind policy)."""
    records = infer_sessions(synthetic_trace(3000, tenants=4, seed=2))
    stream = session_stream(records, "open")
    blind = {p.name: simulate(stream, [TierSpec(300, p)]).hit_ratio for p in (LRU(), ARC(), S3FIFO(), ReuseAware())}
    best = max(blind.values())
    alone = simulate(stream, [TierSpec(300, SessionAware(blind=()))]).hit_ratio
    learned = simulate(stream, [TierSpec(300, SessionAware())]).hit_ratio
    assert alone < 0.95 * best
    assert learned >= 0.99 * best, (learned, blind)


def test_a_session_policy_learning_against_nothing_follows_its_own_order_and_the_registry_takes_names():
    from tiercake.policies import create_eviction

    assert "learned" not in SessionAware(blind=()).describe()
    policy = create_eviction("session", {"blind": ["lru", "s3fifo"]})
    assert set(policy.describe()["learned"]["scores"]) == {"session", "lru", "s3fifo"}
    for blind in (["session"], "lru", [3]):
        with pytest.raises(ValueError):
            create_eviction("session", {"blind": blind})
