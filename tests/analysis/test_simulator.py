"""The trace format, the offline cache simulator (the live policy objects) and the optimum, on traces
the tests make (the conversation trace beside a checkout is for `tiercake policy eval`, never a
verdict here); `tiercake policy eval` with a plug-in."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercake.analysis.cache_sim import TierSpec, accesses, optimum, simulate
from tiercake.policies import LRU, available, create_admission, create_eviction
from tiercake.traces import TraceError, TraceRecord, read_trace, write_trace


@pytest.fixture(scope="module")
def any_trace(tmp_path_factory) -> Path:
    """A seeded synthetic trace of the conversation trace's shape (shared system prompts,
    conversations extending their turns)."""
    from tiercake.traces import synthetic_trace

    path = tmp_path_factory.mktemp("trace") / "synthetic.jsonl"
    write_trace(path, synthetic_trace(600, tenants=2, seed=5))
    return path


def rec(ids, t=0, tenant=None):
    return TraceRecord(timestamp=t, input_length=512 * len(ids), output_length=1, hash_ids=tuple(ids), tenant=tenant)


def test_the_optimum_is_never_below_any_policy(any_trace):
    stream = accesses(read_trace(any_trace, limit=2500))
    evictions = [name for name, kind in available().items() if "eviction" in kind]
    assert {"lru", "lfu", "fifo", "s3fifo", "arc", "leaf_lru"} <= set(evictions)
    for capacity in (100, 1000, 5000):
        best = optimum(stream, capacity).hit_ratio
        for name in evictions:
            assert simulate(stream, [TierSpec(capacity, create_eviction(name))]).hit_ratio <= best + 1e-12, name
        gated = TierSpec(capacity, LRU(), create_admission("nth", {"n": 2}))
        assert simulate(stream, [gated]).hit_ratio <= best + 1e-12


def test_optimum_on_a_small_example_and_it_keeps_prefixes_whole():
    # A B C A B with room for two: MIN keeps A and B (C is never used again) -> two hits; LRU none
    stream = accesses([rec([1]), rec([2]), rec([3]), rec([1]), rec([2])])
    assert optimum(stream, 2).hits == [2]
    assert simulate(stream, [TierSpec(2, LRU())]).hits == [0]
    # a chain 1 -> 2 -> 3 then 1 -> 2 again: evicting the leaf 3 keeps the reusable prefix
    chain = accesses([rec([1, 2, 3]), rec([9]), rec([1, 2])])
    assert optimum(chain, 3).hits == [2]


def test_tiers_and_tenants():
    stream = accesses([rec([1, 2], tenant="a"), rec([1, 2], tenant="b"), rec([1, 2], tenant="a")])
    result = simulate(stream, [TierSpec(1, LRU(), name="gpu"), TierSpec(10, LRU(), name="pool")])
    # tenant b's identical ids are other blocks; tenant a's second visit hits, from the pool tier
    assert sum(result.hits) == 2 and result.tier_ratios()["pool"] > 0
    assert result.token_hit_ratio == pytest.approx(2 / 6)


def test_trace_files_round_trip_and_bad_lines_are_named(tmp_path):
    path = tmp_path / "t.jsonl"
    records = [rec([1, 2], 5, tenant="x"), rec([1, 3], 9)]
    assert write_trace(path, records) == 2
    assert read_trace(path) == records
    assert '"tenant"' not in path.read_text().splitlines()[1]  # only where set
    path.write_text(path.read_text() + '{"timestamp": 1, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:3: .*expected 4 blocks"):
        read_trace(path)
    path.write_text("{not json\n")
    with pytest.raises(TraceError, match="t.jsonl:1"):
        read_trace(path)


@pytest.mark.cluster
def test_policy_eval_scores_a_plug_in_against_lru_and_the_optimum(tmp_path):
    trace = tmp_path / "small.jsonl"
    records = [rec([i % 7, 100 + i % 5, 200 + i % 3], t=i) for i in range(300)]
    write_trace(trace, records)
    plugin = tmp_path / "my_policies.py"
    plugin.write_text("from tiercake.policies import FIFO\n\nclass MyFifo(FIFO):\n    name = 'my_fifo'\n")
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "policy",
            "eval",
            "my_policies:MyFifo",
            "--trace",
            str(trace),
            "--capacity",
            "4,8,inf",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "optimum" in done.stdout and "gap to optimum" in done.stdout
    report = json.loads(out.read_text())
    assert report["bench"] == "policy-eval"
    names = {(f["name"], f["params"]["capacity"]) for f in report["figures"]}
    assert names == {(f"hit_ratio.{p}", c) for p in ("my_policies:MyFifo", "lru", "optimum") for c in (4, 8, "inf")}
    for f in report["figures"]:
        assert f["value"] <= f["limit"] + 1e-12 and f["ratio"] <= 1 + 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", "policy", "eval", "lru", "--trace", str(trace), "--capacity", "ten"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "not a number of blocks" in bad.stderr


def test_synthetic_traces_are_seeded_valid_and_reuse_within_tenants(tmp_path):
    from tiercake.traces import synthetic_trace

    first = synthetic_trace(400, tenants=3, seed=5)
    assert first == synthetic_trace(400, tenants=3, seed=5) and first != synthetic_trace(400, tenants=3, seed=6)
    assert [r.timestamp for r in first] == sorted(r.timestamp for r in first)
    write_trace(tmp_path / "s.jsonl", first)
    assert read_trace(tmp_path / "s.jsonl") == first  # valid in the format
    unbounded = simulate(accesses(first), [TierSpec(math.inf, LRU())]).hit_ratio
    assert 0.5 < unbounded < 1  # conversations and system prompts are reused
    # tenants never share: the same ids under one tenant would hit more
    merged = [r.model_copy(update={"tenant": None}) for r in first]
    assert simulate(accesses(merged), [TierSpec(math.inf, LRU())]).hit_ratio >= unbounded
    tenant_ids = {}
    for r in first:
        tenant_ids.setdefault(r.tenant, set()).update(r.hash_ids)
    sets = list(tenant_ids.values())
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    bursty = synthetic_trace(400, bursty=True, seed=5)
    gaps = [b.timestamp - a.timestamp for a, b in zip(bursty, bursty[1:])]
    assert max(gaps) > 20 * (sorted(gaps)[len(gaps) // 2] + 1)  # quiet periods between bursts


def test_stack_distances_predict_lru_exactly_and_prefetchability():
    from tiercake.analysis.trace_stats import residency, trace_stats
    from tiercake.traces import synthetic_trace

    records = synthetic_trace(500, tenants=2, seed=9)
    stats = trace_stats(records)
    stream = accesses(records)
    for capacity in (10, 100, 1000):  # LRU hits exactly the re-accesses closer than its capacity
        assert stats.lru_hit_ratio(capacity) == pytest.approx(simulate(stream, [TierSpec(capacity, LRU())]).hit_ratio)
    # follow-up turns announce their reuse; new conversations on a shared system prompt do not
    assert 0.3 < stats.prefetchable_share < 1
    assert trace_stats(records, lead_s=1e9).prefetchable == 0
    times = [r.timestamp / 1000 for r in records for _ in r.hash_ids]
    stays = residency(stream, 50, LRU(), times)
    assert stays and min(stays) >= 0 and len(residency(stream, 50, LRU())) == len(stays)


def test_a_bounded_reuse_tracker_is_exact_below_its_bound():
    """The live tracker forgets all but the most recent blocks: the distances it reports are the exact
    ones, and it reports a block as new only when its exact distance is at least the bound."""
    from tiercake.analysis.trace_stats import ReuseTracker
    from tiercake.traces import synthetic_trace

    records = synthetic_trace(600, tenants=2, seed=4)
    exact, bounded = ReuseTracker(), ReuseTracker(max_blocks=150)
    compared = forgotten = differs = 0
    for r in records:
        keys = [(r.tenant, h) for h in r.hash_ids]
        for want, got in zip(exact.observe(keys, r.timestamp / 1000), bounded.observe(keys, r.timestamp / 1000)):
            if got is not None:
                assert want is not None and got.distance == want.distance
                assert got.reuse_time_s == want.reuse_time_s
                # a block forgotten and seen again has forgotten the requests that used it before:
                # prefetchability is undercounted then, never overcounted
                assert want.prefetchable or not got.prefetchable
                differs += got.prefetchable != want.prefetchable
                compared += 1
            elif want is not None:
                assert want.distance >= 150
                forgotten += 1
    assert compared > 1000 and forgotten > 0 and differs < 0.05 * compared
    assert len(bounded._marks) < 4096 and len(bounded._last_pos) < len(exact._last_pos) / 2  # bounded memory


@pytest.mark.cluster
def test_trace_stats_on_the_conversation_trace(tmp_path, any_trace):
    out = tmp_path / "stats.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "trace",
            "stats",
            str(any_trace),
            "--capacity",
            "10k",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "stats.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    stack_lru = figures["lru_hit_ratio.from_stack_distance"]
    # the stack-distance LRU agrees with simulating LRU on the same stream
    stream = accesses(read_trace(any_trace))
    assert stack_lru["value"] == pytest.approx(simulate(stream, [TierSpec(10_000, LRU())]).hit_ratio, abs=1e-9)
    assert 0 < figures["prefetchable_share"]["value"] < 1
    assert (tmp_path / "stats.png").read_bytes()[:4] == b"\x89PNG"


def test_policy_eval_reports_progress_run_by_run():
    """A slow policy ran minutes with only a spinner: evaluate says which run is next, and how many."""
    from tiercake.analysis.cache_sim import accesses
    from tiercake.analysis.evaluate import evaluate
    from tiercake.traces import synthetic_trace

    stream = accesses(synthetic_trace(60, seed=2))
    seen = []
    scores = evaluate(
        stream, "s3fifo", [50, 500], progress=lambda done, total, running: seen.append((done, total, running))
    )
    assert len(scores) == 6 and [s[0] for s in seen] == list(range(7)) and {s[1] for s in seen} == {6}
    assert seen[0][2] == "s3fifo @ 50 blocks" and seen[-1][2] == "done"


SHAPES = {  # traces of other shapes than the conversation trace, from the generator
    "default": dict(tenants=2, seed=5),
    "bursty": dict(tenants=4, seed=7, bursty=True),
    "long sessions": dict(tenants=2, seed=9, new_session_p=0.1),
    "short sessions": dict(tenants=3, seed=11, new_session_p=0.8),
    "long turns": dict(tenants=1, seed=13, turn_blocks=(4, 12), system_prompts=8),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_reuse_policy_is_never_worse_than_lru_on_other_shapes(shape):
    """The learning policy is not tuned to one trace: on every generated shape, at a small and a
    large capacity, it keeps at least LRU's hits."""
    from tiercake.traces import synthetic_trace

    stream = accesses(synthetic_trace(1500, **SHAPES[shape]))
    for capacity in (300, 3000):
        lru = simulate(stream, [TierSpec(capacity, LRU())]).hit_ratio
        learned = simulate(stream, [TierSpec(capacity, create_eviction("reuse"))]).hit_ratio
        assert learned >= lru, (shape, capacity, learned, lru)


def test_the_reuse_policy_keeps_blocks_that_come_back_through_a_scan_of_one_off_blocks():
    """A trace built to show what ``reuse`` learns: a shared prefix read once every 15 requests, and
    between its reads 60 blocks that are never read again. With room for 40 blocks LRU has evicted
    the prefix each time it comes back; ``reuse`` learns that blocks read twice come back and one-off
    blocks do not, and keeps the prefix through the scan."""
    hot = [1, 2, 3, 4]
    records, fresh = [], iter(range(1000, 10**6))
    for turn in range(300):
        records.append(rec(hot, t=turn) if turn % 16 == 0 else rec([next(fresh) for _ in range(4)], t=turn))
    stream = accesses(records)
    lru = simulate(stream, [TierSpec(40, LRU())]).hit_ratio
    learned = simulate(stream, [TierSpec(40, create_eviction("reuse"))]).hit_ratio
    every_hot_read = (300 // 16) * len(hot) / (300 * 4)  # the best any policy can hit here
    assert lru == 0
    assert learned >= 0.8 * every_hot_read, (learned, every_hot_read)
