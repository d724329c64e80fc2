"""Routing policies (pure functions of worker states: the live front and the simulator share them)."""

import pytest

from tiercake.policies import (
    LinkModel,
    PrefillModel,
    RouteRequest,
    SessionRouter,
    TtftRouter,
    WorkerState,
    create_router,
    fit_link,
    fit_prefill,
)

SLOW = PrefillModel(a=0.01, b=0.001, q=0.0)  # 1 ms per computed token
REQ = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=0)


def test_ttft_router_weighs_cache_against_queue():
    cached = WorkerState("a", cached_blocks=100, queued_tokens=0, prefill=SLOW)
    cold = WorkerState("b", cached_blocks=0, queued_tokens=0, prefill=SLOW)
    decision = TtftRouter().choose([cold, cached], REQ)
    assert decision.worker == "a" and decision.reused_blocks == 100
    assert decision.ttft_s == pytest.approx(0.01 + 0.001 * 1)
    # the cached worker is busy for longer than computing the whole prompt elsewhere would take
    busy = WorkerState("a", cached_blocks=100, queued_tokens=5000, prefill=SLOW)
    assert TtftRouter().choose([cold, busy], REQ).worker == "b"


def test_ttft_router_pulls_a_longer_prefix_held_elsewhere():
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=100)
    own = WorkerState("a", cached_blocks=10, prefill=SLOW, load_bytes_per_s=10e9)
    decision = TtftRouter(pull_ratio=2).choose([own], request)
    assert decision.pull and decision.reused_blocks == 100
    assert decision.ttft_s == pytest.approx(90 * (1 << 20) / 10e9 + 0.01 + 0.001 * 1)
    # below the ratio it computes from its own prefix
    near = WorkerState("a", cached_blocks=60, prefill=SLOW)
    assert not TtftRouter(pull_ratio=2).choose([near], request).pull
    with pytest.raises(ValueError):
        TtftRouter(pull_ratio=0.5)


def test_a_pull_is_priced_on_the_workers_measured_link_and_recompute_wins_across_a_slow_one():
    """90 blocks of 1 MiB held on another host, 1.44 s to compute: over a 10 GB/s link the pull costs
    0.01 s and wins; over a 50 MB/s link (1.9 s) or one with a 2 s round trip, recomputing is faster,
    whatever the pull ratio says."""
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=100)
    fast = TtftRouter().choose([WorkerState("b", cached_blocks=10, prefill=SLOW, load_bytes_per_s=10e9)], request)
    assert fast.pull and fast.reused_blocks == 100
    slow = WorkerState("b", cached_blocks=10, prefill=SLOW, load_bytes_per_s=50e6)
    recompute = TtftRouter().choose([slow], request)
    assert not recompute.pull and recompute.reused_blocks == 10
    assert recompute.ttft_s == pytest.approx(SLOW.seconds(1601 - 160, 160))
    far = WorkerState("b", cached_blocks=10, prefill=SLOW, load_bytes_per_s=10e9, pull_latency_s=2.0)
    assert not TtftRouter().choose([far], request).pull
    # the worker whose link is fast gets the request, pulling; the one across the slow link would compute
    picked = TtftRouter().choose(
        [slow, WorkerState("c", cached_blocks=10, prefill=SLOW, load_bytes_per_s=10e9)], request
    )
    assert picked.worker == "c" and picked.pull


def test_a_pull_about_as_fast_as_recomputing_is_taken():
    """Recomputing holds the worker's compute, a pull mostly waits on a copy: a pull up to
    REUSE_MARGIN slower than recomputing still reuses the prefix; one clearly slower does not."""
    from tiercake.policies.routing import REUSE_MARGIN

    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=100)
    compute = SLOW.seconds(1601)
    rest = SLOW.seconds(1601 - 1600, 1600)

    def pulls(latency: float) -> bool:
        return TtftRouter().choose([WorkerState("b", prefill=SLOW, pull_latency_s=latency)], request).pull

    bytes_s = 100 * (1 << 20) / 2e9
    assert pulls(compute * 1.1 - rest - bytes_s)  # 10% slower than computing: reused
    assert pulls(compute * (1 + REUSE_MARGIN) * 0.999 - rest - bytes_s)
    assert not pulls(compute * (1 + REUSE_MARGIN) * 1.01 - rest - bytes_s)
    assert not pulls(compute * 2)


@pytest.mark.parametrize("name", ["ttft", "session", "least_loaded", "cache_aware", "round_robin", "random"])
def test_each_router_takes_its_reuse_margin_and_refuses_a_bad_one(name):
    """``reuse_margin`` (a router parameter): how much slower than recomputing a predicted pull may
    be and still be taken; a large one loads whatever a node holds, whatever the links measure."""
    from tiercake.policies import create_router

    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=100)
    slow_link = [WorkerState("b", prefill=SLOW, pull_latency_s=SLOW.seconds(1601) * 3)]
    assert not create_router(name).choose(slow_link, request).pull  # three times the recompute: not taken
    assert create_router(name, {"reuse_margin": 1e3}).choose(slow_link, request).pull
    a_bit_slower = [WorkerState("b", prefill=SLOW, pull_latency_s=SLOW.seconds(1601) * 1.1)]
    assert not create_router(name, {"reuse_margin": 0}).choose(a_bit_slower, request).pull
    for bad in (-0.1, float("nan"), float("inf"), 1e7):
        with pytest.raises(ValueError, match="reuse_margin"):
            create_router(name, {"reuse_margin": bad})


def test_a_link_is_fitted_from_its_pulls_as_latency_plus_bytes_over_rate():
    exact = [(n, 0.002 + n / 1e9) for n in (1 << 20, 4 << 20, 16 << 20)]
    link = fit_link(exact)
    assert link.latency_s == pytest.approx(0.002) and link.bytes_per_s == pytest.approx(1e9)
    assert link.seconds(8 << 20) == pytest.approx(0.002 + (8 << 20) / 1e9)
    assert fit_link([]) == LinkModel()  # nothing measured: the prior
    # pulls of one size: the prior's rate stands and the rest is a fixed cost, so a pull twice as
    # big costs one more prior-rate transfer, not twice as much (a small first pull, mostly round
    # trips, priced every later pull as a recompute)
    one_size = fit_link([(1 << 20, 0.01), (1 << 20, 0.01)])
    assert one_size.seconds(1 << 20) == pytest.approx(0.01)
    assert one_size.bytes_per_s == LinkModel().bytes_per_s
    assert one_size.seconds(2 << 20) == pytest.approx(0.01 + (1 << 20) / LinkModel().bytes_per_s)
    faster = fit_link([(1 << 20, 1e-4)])  # faster than the prior's rate: the rate is the link's own
    assert faster.latency_s == 0 and faster.bytes_per_s == pytest.approx((1 << 20) / 1e-4)
    hostile = [(1 << 20, float("nan")), (1 << 20, float("inf")), (0, 1.0), (1 << 20, -1.0)]
    assert fit_link(hostile) == LinkModel()  # a report that is not a measurement changes nothing


def test_ttft_router_keeps_a_prompt_where_its_prefix_is_unless_another_is_clearly_faster():
    # b's fitted timings are 3% faster than a's (fits differ by noise); the pool holds the prefix a has
    # in its own cache, and pulling it costs b little: by prediction alone b wins by a hair
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=64 << 10, best_blocks=80)
    a = WorkerState("a", cached_blocks=80, prefill=SLOW, load_bytes_per_s=20e9)
    b = WorkerState("b", cached_blocks=0, prefill=PrefillModel(a=0.0097, b=0.00097), load_bytes_per_s=20e9)
    assert TtftRouter(margin=0.0).choose([a, b], request).worker == "b"
    kept = TtftRouter(margin=0.1).choose([a, b], request)
    assert kept.worker == "a" and not kept.pull and kept.reused_blocks == 80
    # a queue that makes a clearly slower still sends the prompt to b
    busy = WorkerState("a", cached_blocks=80, queued_tokens=400, prefill=SLOW, load_bytes_per_s=20e9)
    assert TtftRouter(margin=0.1).choose([busy, b], request).worker == "b"
    with pytest.raises(ValueError):
        TtftRouter(margin=1.5)


def test_ttft_router_counts_the_spread_of_fitted_fixed_costs_as_noise():
    """Two equal vLLM servers fitted prefill = 0.029 + 0.00052 t and 0.020 + 0.00071 t from four probes
    each (measured). A conversation's next turn is mostly cached on the first: its prediction (a few
    tokens to compute) is 38% above the second's (which would pull the prefix from the pool), far past a
    10% margin, yet the difference is the fits' fixed costs, not the work. It stays where it is."""
    request = RouteRequest(prompt_tokens=515, block_size=16, block_nbytes=64 << 10, best_blocks=32)
    a = WorkerState("a", cached_blocks=32, prefill=PrefillModel(a=0.029, b=0.00052), load_bytes_per_s=2e9)
    b = WorkerState("b", cached_blocks=0, prefill=PrefillModel(a=0.020, b=0.00071), load_bytes_per_s=2e9)
    assert TtftRouter.predict(a, request).ttft_s > 1.3 * TtftRouter.predict(b, request).ttft_s
    assert TtftRouter(margin=0.1).choose([a, b], request).worker == "a"
    assert TtftRouter(margin=0.0).choose([a, b], request).worker == "b"  # no margin: the prediction alone
    # a queue is work, not noise: a holder with 400 prompt tokens ahead (0.24 s) loses to b (0.02 s)
    busy = WorkerState(
        "a", cached_blocks=32, queued_tokens=400, prefill=PrefillModel(a=0.029, b=0.00052), load_bytes_per_s=2e9
    )
    assert TtftRouter(margin=0.1).choose([busy, b], request).worker == "b"


def test_baseline_routers():
    workers = [WorkerState("a", cached_blocks=3, queued_tokens=50), WorkerState("b", cached_blocks=1, queued_tokens=0)]
    assert create_router("cache_aware").choose(workers, REQ).worker == "a"
    assert create_router("least_loaded").choose(workers, REQ).worker == "b"
    rr = create_router("round_robin")
    assert [rr.choose(workers, REQ).worker for _ in range(4)] == ["a", "b", "a", "b"]
    assert {create_router("random", {"seed": s}).choose(workers, REQ).worker for s in range(20)} == {"a", "b"}


def test_prefill_model_fit_recovers_its_coefficients():
    truth = PrefillModel(a=0.003, b=2e-5, q=1e-8)
    samples = [(t, c, truth.seconds(t, c)) for t in (16, 64, 256, 1024) for c in (0, 512)]
    fitted = fit_prefill(samples)
    for t, c, s in samples:
        assert fitted.seconds(t, c) == pytest.approx(s, rel=1e-6)
    with pytest.raises(ValueError):
        fit_prefill(samples[:2])


def test_baseline_routers_load_what_a_node_holds_unless_told_not_to():
    """Picking a baseline router picks how a worker is chosen, not whether the tiers are used: the
    chosen worker pulls a longer prefix a node holds; ``pull=False`` keeps to its own cache."""
    from tiercake.policies import create_router

    worker = WorkerState("w", cached_blocks=2, prefill=SLOW)
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=1 << 20, best_blocks=40)
    for name in ("cache_aware", "least_loaded", "round_robin", "random"):
        decision = create_router(name, {}).choose([worker], request)
        assert decision.pull and decision.reused_blocks == 40, name
        local = create_router(name, {"pull": False}).choose([worker], request)
        assert not local.pull and local.reused_blocks == 2, name


def test_session_router_brings_a_turn_back_to_its_sessions_worker_within_its_bound():
    """The session's blocks left both gpu tiers (every worker pulls the same prefix from the pool):
    by prediction b is 10% faster and ``ttft`` (10% margin) would send the turn there; the session
    router keeps it on a, where its last turn ran, until a is more than ``affinity`` slower."""
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=64 << 10, best_blocks=80, affinity=("a",))
    a = WorkerState("a", prefill=SLOW, queued_tokens=2)
    b = WorkerState("b", prefill=PrefillModel(a=0.009, b=0.0009))
    assert TtftRouter(margin=0.05).choose([a, b], request).worker == "b"
    kept = SessionRouter(margin=0.05, affinity=0.25).choose([a, b], request)
    assert kept.worker == "a" and kept.pull and kept.reused_blocks == 80
    busy = WorkerState("a", prefill=SLOW, queued_tokens=200)  # 0.2 s of queue: far past 25%
    assert SessionRouter(margin=0.05, affinity=0.25).choose([busy, b], request).worker == "b"
    # a worker holding more of the prompt in its own cache still comes first (it computes less)
    holder = WorkerState("c", cached_blocks=80, prefill=PrefillModel(a=0.009, b=0.0009))
    assert SessionRouter(margin=0.05, affinity=0.25).choose([a, b, holder], request).worker == "c"
    with pytest.raises(ValueError):
        SessionRouter(affinity=-1)


def test_session_router_starts_a_subagent_where_its_parent_ran_and_new_sessions_where_fewest_wait():
    request = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=64 << 10, best_blocks=80)
    workers = [WorkerState(w, prefill=SLOW, sessions=n) for w, n in (("a", 5), ("b", 1), ("c", 3))]
    assert SessionRouter().choose(workers, request).worker == "b"  # equals: the fewest paused sessions
    fork = RouteRequest(prompt_tokens=1601, block_size=16, block_nbytes=64 << 10, best_blocks=80, affinity=("c",))
    assert SessionRouter().choose(workers, fork).worker == "c"
    # its own last worker before its parent's
    both = RouteRequest(1601, 16, 64 << 10, 80, affinity=("a", "c"))
    assert SessionRouter().choose(workers, both).worker == "a"


def test_session_router_without_sessions_routes_as_ttft():
    import random

    rng = random.Random(3)
    for _ in range(300):
        workers = [
            WorkerState(
                f"w{i}",
                cached_blocks=rng.choice((0, 0, 20, 60, 100)),
                queued_tokens=rng.choice((0, 0, 100, 800)),
                prefill=PrefillModel(a=rng.uniform(0.005, 0.03), b=rng.uniform(5e-4, 1.5e-3)),
                load_bytes_per_s=rng.choice((1e9, 2e10)),
            )
            for i in range(4)
        ]
        request = RouteRequest(1601, 16, 1 << 20, rng.choice((0, 50, 100)))
        assert SessionRouter().choose(workers, request) == TtftRouter().choose(workers, request)


def test_a_link_that_turns_slow_is_priced_slow_after_a_pull_or_two():
    """Three pulls of 1 MiB in 1 ms, then the link drops to 2.5 MB/s (0.4 s each): the newest weigh
    most, so after two slow pulls the link is priced near its new rate, not the average of its past."""
    mib = 1 << 20
    fast = [(mib, 0.001)] * 3
    assert fit_link(fast).seconds(mib) == pytest.approx(0.001)
    after_two = fit_link([*fast, (mib, 0.4), (mib, 0.4)])
    assert after_two.seconds(mib) > 0.3, after_two
    back = fit_link([*fast, (mib, 0.4), (mib, 0.4), *fast * 2])
    assert back.seconds(mib) < 0.05, back  # and fast again once it is
