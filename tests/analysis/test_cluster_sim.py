"""The cluster simulator: Mooncake's scheduling ablation on a generated trace of conversations on
shared system prompts, SLO rejection, and the live router objects doing the routing."""

import json
import subprocess
import sys

import pytest

from tiercake.analysis.cluster_sim import ClusterSpec, ablation, simulate_cluster
from tiercake.policies import TtftRouter
from tiercake.traces import synthetic_trace, write_trace


@pytest.mark.parametrize("seed", [1, 2])
def test_mooncake_ablation_ordering_and_the_global_cache_effect(seed):
    """A trace built for it: conversations whose turns extend their prompts on a few shared system
    prompts, at a rate that loads four prefill workers with 200 blocks of local cache each. Mooncake's
    ordering (random, load balancing, local cache-aware, global cache-aware) and a global cache
    hitting more than local ones; on the conversation trace itself it is `tiercake simulate --ablation`
    (docs/BENCHMARKS.md)."""
    records = synthetic_trace(1500, tenants=2, seed=seed, rate_per_s=4.0, new_session_p=0.2)
    results = ablation(records, ClusterSpec(prefill_workers=4, decode_workers=4, local_blocks=200))
    ttft = {name: r["ttft_mean_s"] for name, r in results.items()}
    assert ttft["random"] > ttft["load_balancing"] > ttft["local_cache_aware"] > ttft["global_cache_aware"]
    assert results["global_cache_aware"]["hit_ratio"] > 1.3 * results["local_cache_aware"]["hit_ratio"]
    assert results["global_cache_aware"]["bytes_moved"] > 0 and results["local_cache_aware"]["bytes_moved"] == 0
    assert results["global_cache_aware"]["metadata_ops_per_request"] > 1
    assert 0 < results["global_cache_aware"]["metadata_bytes_per_kv_byte"] < 1e-3  # metadata is tiny beside KV
    glob = results["global_cache_aware"]  # the TTFT breakdown: queue, lookup, load from the pool, compute
    assert glob["lookup_p50_s"] > 0 and glob["load_pool_p99_s"] > 0 and glob["compute_p50_s"] > 0
    assert results["random"]["queue_p99_s"] > glob["queue_p99_s"]


def test_slo_rejections_and_the_live_router_object():
    records = synthetic_trace(300, rate_per_s=40, seed=2)
    router = TtftRouter(pull_ratio=1.0)
    loose = simulate_cluster(records, ClusterSpec(prefill_workers=2, decode_workers=2), router)
    assert loose.rejected == 0 and loose.served == 300 and loose.slo_met == 300
    tight = simulate_cluster(records, ClusterSpec(prefill_workers=2, decode_workers=2, slo_ttft_s=1.0), router)
    summary = tight.summary()
    assert tight.rejected > 0 and summary["requests"] == 300
    assert 0 < tight.served and max(tight.ttft) <= 1.0 + 1e-9  # what was admitted met its predicted TTFT
    assert summary["slo_attainment"] == tight.slo_met / 300 < 1


@pytest.mark.cluster
def test_simulate_cli_writes_the_ablation(tmp_path):
    trace = tmp_path / "syn.jsonl"
    write_trace(trace, synthetic_trace(200, rate_per_s=20, seed=1))
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "simulate",
            str(trace),
            "--ablation",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert set(figures) == {
        f"ttft_mean.{n}" for n in ("random", "load_balancing", "local_cache_aware", "global_cache_aware")
    }
    assert len({f["limit"] for f in figures.values()}) == 1  # one compute-only reference for all four
    assert all(f["value"] > 0 and 0 <= f["params"]["hit_ratio"] <= 1 for f in figures.values())


def test_the_session_router_keeps_conversations_on_their_worker_in_the_simulator():
    """An agentic trace (tool pauses, chats, subagent fans), four workers with small caches and a
    shared pool: the simulator feeds each session's last worker (and a fork's parent's) to the router,
    as the live front's session book does. Keeping conversations in place pulls fewer blocks from the
    pool (one copy per conversation in the gpu tiers, not two) at about the same mean TTFT; without
    sessions the router is ``ttft`` itself."""
    from tiercake.agent_traces import agentic_trace

    records = agentic_trace(sessions=100)
    spec = ClusterSpec(prefill_workers=4, decode_workers=4, local_blocks=300, global_blocks=1e9)
    blind, aware = (simulate_cluster(records, spec, r).summary() for r in ("ttft", "session"))
    assert aware["local_hit_ratio"] > blind["local_hit_ratio"] + 0.01
    assert aware["bytes_moved"] < 0.95 * blind["bytes_moved"]
    assert aware["hit_ratio"] >= blind["hit_ratio"] - 0.005 and aware["ttft_mean_s"] <= 1.05 * blind["ttft_mean_s"]
    anonymous = [r.model_copy(update={"session": None, "fork_of": None}) for r in records]
    assert simulate_cluster(anonymous, spec, "session").summary() == simulate_cluster(anonymous, spec, "ttft").summary()
