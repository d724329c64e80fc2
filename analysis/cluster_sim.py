"""The cluster simulator: a trace's requests, by timestamp, through N prefill workers (each with its own
cache of blocks and a FIFO queue), M decode workers and, optionally, a shared global pool, routed by
the same router objects the live front uses (``policies/routing.py``).

Each prefill worker computes one request at a time: it starts when the worker is free, pulls the
prefix it was told to pull (at the transfer bandwidth), then computes the rest (the prefill-time
model). The prompt's blocks then enter its cache and the global pool (both under eviction policies
from the registry). Decode runs on the decode worker the router's ``choose_decode`` picks (the least loaded by default); a token takes a decode step,
longer as the batch grows. Early rejection happens when the router's predicted TTFT or TBT exceeds
the SLO. Reported: TTFT and TBT percentiles, SLO attainment, rejections, hit ratios, bytes moved.
"""

from __future__ import annotations

import heapq
import math
import random
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiercake.policies import (
    PrefillModel,
    Router,
    RouteRequest,
    WorkerState,
    create_eviction,
    create_router,
)
from tiercake.policies.base import one_victim
from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord


@dataclass
class ClusterSpec:
    prefill_workers: int = 8
    decode_workers: int = 8
    local_blocks: float = 2_000  # each prefill worker's own cache
    global_blocks: float = 0  # the shared pool; 0: none (only local caches)
    eviction: str = "lru"
    prefill: PrefillModel = field(default_factory=lambda: PrefillModel(a=0.02, b=8e-5, q=1e-10))
    decode_step_s: float = 0.03
    block_nbytes: int = 512 * 160 * 1024  # KV of one 512-token block (a 7B-class model, fp16: ~80 MB/block)
    bandwidth_bytes_per_s: float = 25e9  # pulls from the global pool (RDMA class)
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    time_scale: float = 1.0  # arrivals at timestamp * time_scale
    metadata_bytes_per_op: int = 118  # one replica in etcd (measured by tiercake bench metadata)
    lookup_s: float = 55e-6  # one chain lookup in the placement index (measured by tiercake bench metadata)
    # tiers whose placement changes stay in the leader's memory (ConductorConfig.volatile_tiers): "gpu"
    # is the prefill workers' own caches, "pool" the global one; the others' changes are durable writes
    volatile_tiers: tuple[str, ...] = ("gpu",)
    # each prefill worker's timings as the router sees them: the true model times (1 + e), e drawn once
    # per worker from [-fit_noise, fit_noise] (live workers fit their own timings; the fits differ)
    fit_noise: float = 0.0
    seed: int = 0


@dataclass
class ClusterResult:
    router: str
    ttft: list[float] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)
    # the TTFT breakdown, as on the live front: waiting for the worker, the index lookup, pulling the
    # prefix from the global pool (the one remote tier simulated), computing the rest
    phases: dict[str, list[float]] = field(
        default_factory=lambda: {"queue": [], "lookup": [], "load_pool": [], "compute": []}
    )
    rejected: int = 0
    slo_met: int = 0
    blocks: int = 0
    reused_blocks: int = 0
    local_hits: int = 0
    global_hits: int = 0
    bytes_moved: float = 0.0  # pulled from the global pool
    kv_bytes_written: float = 0.0  # new blocks written to the global pool
    metadata_ops: int = 0  # lookups and durable placement changes
    metadata_bytes: float = 0.0

    @property
    def served(self) -> int:
        return len(self.ttft)

    def percentile(self, values: list[float], p: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    def summary(self) -> dict[str, float]:
        total = self.served + self.rejected
        return {
            "requests": total,
            "rejected": self.rejected,
            "ttft_mean_s": sum(self.ttft) / len(self.ttft) if self.ttft else 0.0,
            "ttft_p50_s": self.percentile(self.ttft, 50),
            "ttft_p99_s": self.percentile(self.ttft, 99),
            "tbt_p50_s": self.percentile(self.tbt, 50),
            "tbt_p99_s": self.percentile(self.tbt, 99),
            "slo_attainment": self.slo_met / total if total else 0.0,
            "hit_ratio": self.reused_blocks / self.blocks if self.blocks else 0.0,
            "local_hit_ratio": self.local_hits / self.blocks if self.blocks else 0.0,
            "global_hit_ratio": self.global_hits / self.blocks if self.blocks else 0.0,
            "bytes_moved": self.bytes_moved,
            "metadata_ops_per_request": self.metadata_ops / self.served if self.served else 0.0,
            "metadata_bytes_per_kv_byte": self.metadata_bytes / (self.bytes_moved + self.kv_bytes_written)
            if self.bytes_moved + self.kv_bytes_written
            else 0.0,
            **{f"{phase}_p50_s": self.percentile(v, 50) for phase, v in self.phases.items()},
            **{f"{phase}_p99_s": self.percentile(v, 99) for phase, v in self.phases.items()},
        }


class _Cache:
    """A block cache under a registry eviction policy."""

    def __init__(self, capacity: float, policy: str) -> None:
        self.capacity = capacity
        self.policy = create_eviction(policy)
        self.keys: set = set()

    def prefix(self, keys: list) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def touch(self, keys: list) -> int:
        """Access or insert every key; returns the placement changes made (inserts and evictions),
        each one a metadata operation in the live system."""
        if self.capacity <= 0:
            return 0
        changes = 0
        for key in keys:
            if key in self.keys:
                self.policy.on_access(key)
                continue
            if len(self.keys) >= self.capacity:
                victim = one_victim(self.policy, self.keys)
                self.keys.discard(victim)
                changes += 1
            self.keys.add(key)
            self.policy.on_insert(key)
            changes += 1
        return changes


def _scaled(model: PrefillModel, factor: float) -> PrefillModel:
    return PrefillModel(model.a * factor, model.b * factor, model.q * factor)


class _Sessions:
    """Where each session of the trace last ran (its records' ``session`` and ``fork_of``), as the
    live front's session book knows it: what a session-aware router reads."""

    def __init__(self) -> None:
        self.last: dict[tuple[str | None, str], str] = {}
        self.paused: Counter[str] = Counter()  # open sessions whose last turn ran on each worker

    def affinity(self, record: TraceRecord) -> tuple[str, ...]:
        if record.session is None:
            return ()
        mine = self.last.get((record.tenant, record.session))
        parent = self.last.get((record.tenant, record.fork_of)) if record.fork_of is not None else None
        return tuple(w for w in (mine, parent) if w is not None)

    def ran(self, record: TraceRecord, worker: str) -> None:
        if record.session is None:
            return
        key = (record.tenant, record.session)
        before = self.last.pop(key, None)
        if before is not None:
            self.paused[before] -= 1
        if not record.closes:
            self.last[key] = worker
            self.paused[worker] += 1


class _Cluster:
    """One run's state: each prefill worker's cache and when it is next free, the node pool, and the
    end times of what each decode worker runs."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.caches = [_Cache(spec.local_blocks, spec.eviction) for _ in range(spec.prefill_workers)]
        self.pool = _Cache(spec.global_blocks, spec.eviction) if spec.global_blocks else None
        self.free_at = [0.0] * spec.prefill_workers
        rng = random.Random(spec.seed)
        noise = spec.fit_noise
        self.believed = [_scaled(spec.prefill, 1 + rng.uniform(-noise, noise)) for _ in range(spec.prefill_workers)]
        self.decoding: list[list[float]] = [[] for _ in range(spec.decode_workers)]  # heaps of end times

    def prefill_states(self, own: list[int], now: float, paused: Counter[str]) -> list[WorkerState]:
        spec = self.spec
        return [
            WorkerState(
                f"p{i}",
                own[i],
                0,
                0,
                self.believed[i],
                spec.decode_step_s,
                spec.bandwidth_bytes_per_s,
                queue_s=max(0.0, self.free_at[i] - now),
                sessions=paused[f"p{i}"],
            )
            for i in range(spec.prefill_workers)
        ]

    def decode_states(self, now: float) -> list[WorkerState]:
        spec = self.spec
        for ends in self.decoding:
            while ends and ends[0] <= now:
                heapq.heappop(ends)
        return [
            WorkerState(f"d{j}", running=len(ends), prefill=spec.prefill, decode_step_s=spec.decode_step_s)
            for j, ends in enumerate(self.decoding)
        ]

    def cache(self, w: int, keys: list, result: ClusterResult) -> None:
        """The prefill's blocks kept where it ran (and in the pool), and the metadata that costs."""
        spec = self.spec
        changes = self.caches[w].touch(keys)
        durable = 0 if "gpu" in spec.volatile_tiers else changes
        if self.pool is not None:
            new_in_pool = sum(key not in self.pool.keys for key in keys)
            changes = self.pool.touch(keys)
            durable += 0 if "pool" in spec.volatile_tiers else changes
            result.kv_bytes_written += new_in_pool * spec.block_nbytes
        result.metadata_ops += 1 + durable  # the route's lookup, then the placements made durable
        result.metadata_bytes += durable * spec.metadata_bytes_per_op


def _rejected(spec: ClusterSpec, ttft: float, tbt: float) -> bool:
    return (spec.slo_ttft_s is not None and ttft > spec.slo_ttft_s) or (
        spec.slo_tbt_s is not None and tbt > spec.slo_tbt_s
    )


def simulate_cluster(
    records: list[TraceRecord],
    spec: ClusterSpec,
    router: Router | str,
    router_params: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> ClusterResult:
    """``progress(requests done)``, every 1,000 requests and at the end."""
    router = create_router(router, router_params) if isinstance(router, str) else router
    cluster = _Cluster(spec)
    sessions = _Sessions()
    result = ClusterResult(router.describe())
    for done, record in enumerate(sorted(records, key=lambda r: r.timestamp)):
        if progress is not None and done % 1000 == 0:
            progress(done)
        now = record.timestamp / 1000 * spec.time_scale
        keys = list(record.hash_ids) if record.tenant is None else [(record.tenant, h) for h in record.hash_ids]
        own = [cache.prefix(keys) for cache in cluster.caches]
        best = cluster.pool.prefix(keys) if cluster.pool is not None else 0
        request = RouteRequest(
            record.input_length, TRACE_BLOCK_TOKENS, spec.block_nbytes, best, sessions.affinity(record)
        )
        decision = router.choose(cluster.prefill_states(own, now, sessions.paused), request)
        decode = router.choose_decode(cluster.decode_states(now), request)  # the live front's rule
        d, tbt = int(decode.worker[1:]), decode.tbt_s
        if _rejected(spec, decision.ttft_s, tbt):
            result.rejected += 1
            continue
        w = int(decision.worker[1:])
        usable = (record.input_length - 1) // TRACE_BLOCK_TOKENS
        mine = min(own[w], usable)
        reused = max(mine, min(best, usable)) if decision.pull else mine
        transfer = (reused - mine) * spec.block_nbytes / spec.bandwidth_bytes_per_s
        start = max(now, cluster.free_at[w])
        compute = spec.prefill.seconds(record.input_length - reused * TRACE_BLOCK_TOKENS, reused * TRACE_BLOCK_TOKENS)
        finish = start + spec.lookup_s + transfer + compute
        for phase, seconds in (("queue", start - now), ("lookup", spec.lookup_s), ("load_pool", transfer)):
            result.phases[phase].append(seconds)
        result.phases["compute"].append(compute)
        cluster.free_at[w] = finish
        result.ttft.append(finish - now)
        result.tbt.append(tbt)
        heapq.heappush(cluster.decoding[d], finish + record.output_length * tbt)
        result.blocks += len(keys)
        result.reused_blocks += reused
        result.local_hits += mine
        result.global_hits += reused - mine
        result.bytes_moved += (reused - mine) * spec.block_nbytes
        result.slo_met += not _rejected(spec, finish - now, tbt)
        cluster.cache(w, keys, result)
        sessions.ran(record, decision.worker)
    if progress is not None:
        progress(len(records))
    return result


ABLATION = {
    # Mooncake's scheduling ablation, as router and cache choices
    "random": ("random", {"seed": 0}, False),
    "load_balancing": ("least_loaded", {}, False),
    "local_cache_aware": ("ttft", {}, False),  # Algorithm 1 over each worker's own cache only
    "global_cache_aware": ("ttft", {}, True),  # Algorithm 1 with the global pool: pulls hot prefixes
}


def ablation(records: list[TraceRecord], spec: ClusterSpec, global_blocks: float = math.inf) -> dict[str, dict]:
    """The four schedulers of Mooncake's ablation on the same trace and cluster."""
    out = {}
    for name, (router, params, with_pool) in ABLATION.items():
        run = ClusterSpec(**{**spec.__dict__, "global_blocks": global_blocks if with_pool else 0})
        out[name] = simulate_cluster(records, run, router, params).summary()
    return out


def plot(results: dict[str, ClusterResult], path: str | Path, title: str) -> None:
    """Each scheduler's TTFT distribution (a CDF, log time) beside its SLO attainment and hit ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for name, result in results.items():
        ordered = sorted(result.ttft)
        if ordered:
            cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    cdf.set_xscale("symlog", linthresh=0.01)  # many TTFTs are near zero on a warm cache
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("fraction of served requests")
    cdf.grid(True, alpha=0.3)
    cdf.legend(fontsize=8)
    names = list(results)
    summaries = [results[n].summary() for n in names]
    width = 0.4
    xs = range(len(names))
    bars.bar([x - width / 2 for x in xs], [s["slo_attainment"] for s in summaries], width, label="SLO met")
    bars.bar([x + width / 2 for x in xs], [s["hit_ratio"] for s in summaries], width, label="hit ratio")
    bars.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    bars.set_ylim(0, 1.15)  # room for the legend above full bars
    bars.grid(True, axis="y", alpha=0.3)
    bars.legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle(textwrap.fill(title, 100), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
