"""The session-aware eviction policy, one behaviour per test, driven the way the simulator and the
conductor drive it: session events with their keys, then block inserts, accesses and victims."""

import pytest

from tiercake.policies import LRU, create_eviction
from tiercake.policies.base import SessionEvent, SessionState
from tiercake.policies.sessions import SessionAware

ACTIVE, PAUSED, CLOSED = SessionState.ACTIVE, SessionState.PAUSED, SessionState.CLOSED


def turn(policy, sid, keys, at, pause=None, retain=None, priority=0, insert=True):
    """One turn of session ``sid``: active, its blocks read (inserted when new), then paused."""
    policy.on_session(SessionEvent(sid, ACTIVE, at, tuple(keys), priority=priority))
    for key in keys:
        if insert and key not in policy:
            policy.on_insert(key)
        else:
            policy.on_access(key)
    policy.on_session(SessionEvent(sid, PAUSED, at, tuple(keys), pause, retain, priority))


def drain(policy):
    return policy.victims(len(policy))


def test_blocks_of_no_open_session_leave_before_any_held_block():
    policy = SessionAware(LRU())
    turn(policy, "a", ["a1", "a2"], 0)
    policy.on_insert("stray")  # read outside any session
    turn(policy, "b", ["b1"], 1)
    assert policy.victims(1) == ["stray"]


def test_the_session_expected_back_last_goes_first_deepest_block_first():
    policy = SessionAware()
    turn(policy, "soon", ["s1", "s2"], 0, pause=5)
    turn(policy, "late", ["l1", "l2", "l3"], 0, pause=500)
    turn(policy, "mid", ["m1"], 0, pause=50)
    assert drain(policy) == ["l3", "l2", "l1", "m1", "s2", "s1"]


def test_without_an_announced_pause_the_longest_quiet_session_goes_first():
    policy = SessionAware(initial_pause_s=1)
    turn(policy, "old", ["o1"], 0)
    turn(policy, "new", ["n1"], 100)
    turn(policy, "announced", ["x1"], 100, pause=50)
    # at t=100: "old" has been quiet 100 s (expected 100 s more), "announced" is due in 50, "new" in 1
    assert drain(policy) == ["o1", "x1", "n1"]


def test_a_closed_sessions_blocks_are_freed_and_go_first():
    policy = SessionAware(LRU())
    turn(policy, "a", ["a1", "a2"], 0, pause=1)
    turn(policy, "b", ["b1"], 0, pause=1000)
    policy.on_session(SessionEvent("a", CLOSED, 2))
    assert policy.victims(2) == ["a2", "a1"]  # freed deepest first: a chain's root outlives its leaves


def test_a_shared_prefix_stays_while_a_session_expected_sooner_lists_it():
    policy = SessionAware()
    turn(policy, "parent", ["p1", "p2"], 0, pause=1000)
    turn(policy, "fork", ["p1", "p2", "f1"], 0, pause=10)
    # the parent comes back last, but its blocks are the fork's prefix: the fork's own block goes
    # first, then the shared ones, once no session expected sooner lists them
    assert policy.victims(1) == ["f1"]
    assert policy.victims(2) == ["p2", "p1"]


def test_blocks_of_active_sessions_go_only_when_nothing_else_is_left():
    policy = SessionAware()
    turn(policy, "paused", ["q1"], 0, pause=10)
    policy.on_session(SessionEvent("busy", ACTIVE, 1, ("b1",)))
    policy.on_insert("b1")
    assert policy.victims(1) == ["q1"]
    assert policy.victims(1) == ["b1"]
    assert len(policy) == 0 and policy.victims(1) == []


def test_a_paused_session_expires_after_its_retention_and_its_blocks_are_freed():
    policy = SessionAware(LRU(), retain_s=100)
    turn(policy, "kept", ["k1"], 0, pause=1, retain=1000)
    turn(policy, "short", ["s1"], 0, pause=1)  # the policy's 100 s
    turn(policy, "other", ["o1"], 150, pause=10_000)
    assert policy.describe()["sessions"] == {"paused": 2}  # "short" expired at 100
    assert policy.victims(1) == ["s1"]


def test_a_lower_priority_session_goes_before_a_higher_one_expected_back_later():
    policy = SessionAware()
    turn(policy, "vip", ["v1"], 0, pause=1000, priority=5)
    turn(policy, "batch", ["b1"], 0, pause=1, priority=0)
    assert drain(policy) == ["b1", "v1"]


def test_a_resumed_session_is_kept_and_learns_the_pause_it_did_not_announce():
    policy = SessionAware(initial_pause_s=1)
    turn(policy, "a", ["a1"], 0)
    turn(policy, "a", ["a1", "a2"], 30)  # resumed after 30 s: the mean pause learns it
    assert policy.describe()["mean_pause_s"] == pytest.approx(30)
    turn(policy, "b", ["b1"], 30, pause=100)
    assert policy.victims(1) == ["b1"]  # "a" is expected back in 30 s, "b" in 100


def test_can_evict_is_honoured_and_a_refused_block_stays():
    policy = SessionAware()
    turn(policy, "a", ["a1", "a2"], 0, pause=100)
    assert policy.victims(1, lambda key: key != "a2") == ["a1"]
    assert "a2" in policy and policy.victims(1, lambda key: key != "a2") == []
    assert policy.victims(1) == ["a2"]


def test_removed_and_reinserted_blocks_are_tracked_once():
    policy = SessionAware()
    turn(policy, "a", ["a1", "a2"], 0, pause=100)
    policy.on_remove("a2")
    policy.on_remove("never-seen")
    assert len(policy) == 1 and "a2" not in policy
    policy.on_insert("a2")
    policy.on_insert("a2")
    assert len(policy) == 2 and sorted(drain(policy)) == ["a1", "a2"]


def test_a_session_blind_caller_gets_the_fallbacks_order():
    blind, lru = SessionAware(LRU()), create_eviction("lru")
    for policy in (blind, lru):
        for key in "abcd":
            policy.on_insert(key)
        policy.on_access("a")
    assert drain(blind) == drain(lru) == ["b", "c", "d", "a"]


def test_the_registry_builds_it_and_bad_parameters_are_refused():
    assert isinstance(create_eviction("session", {"fallback": "s3fifo", "retain_s": 60}), SessionAware)
    for params in (
        {"retain_s": 0},
        {"retain_s": float("nan")},
        {"initial_pause_s": float("inf")},
        {"fallback": "session"},
    ):
        with pytest.raises(ValueError):
            create_eviction("session", params)
    with pytest.raises(ValueError):
        SessionAware(SessionAware())


def tenant_turn(policy, tenant, sid, keys, at, pause):
    policy.on_session(SessionEvent((tenant, sid), ACTIVE, at, tuple(keys), tenant=tenant))
    for key in keys:
        policy.on_insert(key)
    policy.on_session(SessionEvent((tenant, sid), PAUSED, at, tuple(keys), pause, tenant=tenant))


def test_a_tenant_past_its_quota_lets_go_of_its_sessions_expected_back_last():
    policy = SessionAware(LRU(), tenant_quota=4)
    tenant_turn(policy, "a", "late", ["a1", "a2"], 0, pause=900)
    tenant_turn(policy, "a", "soon", ["a3", "a4"], 0, pause=5)
    assert policy.describe()["held_by_tenant"] == {"a": 4}
    tenant_turn(policy, "a", "new", ["a5"], 1, pause=10)  # 5 > 4: "late" is let go, its blocks freed
    assert policy.describe()["held_by_tenant"] == {"a": 3}
    tenant_turn(policy, "b", "other", ["b1", "b2"], 1, pause=10_000)
    # the freed blocks go first, before any session's, even the other tenant's expected back last
    assert policy.victims(2) == ["a2", "a1"]


def test_a_tenant_at_its_floor_is_not_pushed_below_it_by_another():
    policy = SessionAware(LRU(), tenant_floor=2)
    tenant_turn(policy, "quiet", "q", ["q1", "q2"], 0, pause=10_000)  # expected back last of all
    for i in range(3):
        tenant_turn(policy, "loud", f"l{i}", [f"l{i}a", f"l{i}b"], 1, pause=10 + i)
    # without the floor "q" would go first; with it, the loud tenant's sessions go, latest back first,
    # down to its own floor
    assert policy.victims(4) == ["l2b", "l2a", "l1b", "l1a"]
    assert policy.describe()["held_by_tenant"] == {"quiet": 2, "loud": 2}
    assert policy.victims(2) == ["q2", "q1"]  # both at their floor: expected back last goes first


def test_quota_and_floor_parameters_are_checked():
    for params in (
        {"tenant_quota": 0},
        {"tenant_quota": float("inf")},
        {"tenant_floor": -1},
        {"tenant_floor": float("nan")},
    ):
        with pytest.raises(ValueError):
            create_eviction("session", params)


def test_a_block_arriving_after_its_session_was_passed_still_goes_before_a_sooner_sessions():
    """A lower tier sees a session's blocks only when they spill into it: one that arrives after the
    session was looked at to its root (nothing of it was here then) still goes in the session's
    order, not after every other held block (it once waited for the last resort, the oldest held)."""
    policy = SessionAware(LRU())
    turn(policy, "soon", ["s1"], 0, pause=10)
    policy.on_session(SessionEvent("late", ACTIVE, 0, ("l1",)))
    policy.on_session(SessionEvent("late", PAUSED, 0, ("l1",), 900))  # none of its blocks here yet
    policy.on_insert("x")  # a stray block: goes first ...
    assert policy.victims(1) == ["x"]
    assert policy.victims(1) == ["s1"]  # ... then "late" is passed (nothing here) and "soon" goes
    turn(policy, "soon", ["s1"], 1, pause=10)
    policy.on_insert("l1")  # "late"'s block arrives (spilled from above)
    assert policy.victims(1) == ["l1"]


def test_sessions_tracked_are_bounded_and_the_ones_retained_shortest_go_first():
    policy = SessionAware(LRU(), max_sessions=3)
    turn(policy, "a", ["a1"], 0, pause=5, retain=100)
    turn(policy, "b", ["b1"], 0, pause=5, retain=50)  # its retention ends first
    turn(policy, "c", ["c1"], 0, pause=5, retain=200)
    turn(policy, "d", ["d1"], 1, pause=5, retain=300)  # a fourth: "b" is let go early
    assert policy.describe()["sessions"] == {"paused": 3}
    assert policy.victims(1) == ["b1"]  # its block is free now: it goes first
    with pytest.raises(ValueError):
        SessionAware(max_sessions=0)


def test_announcements_are_read_as_the_past_ones_turned_out():
    """Clients that always announce half the real pause: after enough resumes the policy reads an
    announced 10 s as 20, and a session so announced goes before an unannounced one expected back in
    about 16 s (taken at its word, 10 s, it would have stayed)."""

    def run(learn: bool):
        policy = SessionAware(LRU(), initial_pause_s=15, blind=())
        for n in range(12):
            turn(policy, f"s{n}", [f"k{n}"], 100 * n, pause=10)
            told = 20 if learn else 10
            turn(policy, f"s{n}", [f"k{n}"], 100 * n + told, pause=None)
            policy.on_session(SessionEvent(f"s{n}", CLOSED, 100 * n + told))
        drain(policy)
        turn(policy, "quiet", ["q"], 2000)  # unannounced: ~15 s / how often one-turn sessions return
        turn(policy, "told", ["t"], 2000, pause=10)
        return policy

    learned, believed = run(learn=True), run(learn=False)
    assert learned.describe()["announced_read_as"] == pytest.approx(2.0)
    assert believed.describe()["announced_read_as"] == pytest.approx(1.0)
    assert learned.victims(1) == ["t"] and believed.victims(1) == ["q"]
