"""What the front measures about the requests it serves: counters for the cluster view, Prometheus
series, TTFT by phase, live reuse statistics, and its own traffic recorded in the Mooncake trace
format. One owner of every serving figure; the dispatcher tells it what happened."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from tiercake.config import ServingConfig
from tiercake.messages import MetadataCosts, PrefillStats, ServingFigures

from .access_stats import LiveAccessStats


@dataclass
class Timing:
    """Where a request's time went, as the front saw it."""

    started: float = field(default_factory=time.perf_counter)
    route_s: float = 0.0  # routing, the index lookup included
    lookup_s: float = 0.0  # the index lookup the front made while routing
    ttft_s: float = 0.0
    stats: PrefillStats = field(default_factory=PrefillStats)  # the prefill worker's
    decode_cached_tokens: int | None = None  # what the decode worker took over without computing


class TraceRecorder:
    """The front's own traffic in the Mooncake trace format: block keys become small integers (first
    seen, first numbered, like the published traces' remapped ids), so every deployment yields a
    public-format trace. Blocks are the cluster's, so ``input_length`` is scaled to 512-token blocks."""

    def __init__(self, path: str, block_size: int) -> None:
        self.path = path
        self.block_size = block_size
        self.ids: dict[bytes, int] = {}
        self.started = time.monotonic()
        self._lock = asyncio.Lock()

    async def record(
        self, keys: Sequence[bytes], tokens: list[int], max_tokens: int, tenant: str, session: str | None = None
    ) -> None:
        """One request as a trace line; ``session``: its session's hashed id (``tiercake trace
        sessions`` adds turns, pauses and closes from the recorded trace)."""
        from tiercake.blocks import chain_key
        from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord

        partial = len(tokens) - len(keys) * self.block_size
        if partial:  # the trailing partial block: keyed here by its tokens, so equal prompts get equal ids
            keys = [*keys, bytes(chain_key(keys[-1] if keys else b"partial", tokens[-partial:]))]
        ids = [self.ids.setdefault(k, len(self.ids) + 1) for k in keys]
        scale = TRACE_BLOCK_TOKENS / self.block_size
        record = TraceRecord(
            timestamp=int((time.monotonic() - self.started) * 1000),
            input_length=TRACE_BLOCK_TOKENS * (len(ids) - 1) + max(1, round((partial or self.block_size) * scale)),
            output_length=max_tokens,
            hash_ids=tuple(ids),
            tenant=tenant,
            session=session,
        )
        line = record.model_dump_json(exclude_none=True) + "\n"
        async with self._lock:  # in arrival order, off the event loop
            await asyncio.to_thread(self._append, line)

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)


class ServingStats:
    def __init__(self, serving: ServingConfig) -> None:
        layout = serving.layout()
        self.block_size, self.block_nbytes = layout.block_size, layout.nbytes
        self.served = 0
        self.rejected = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_by_source: dict[str, int] = defaultdict(int)  # tokens, by where their blocks came from
        self.kv_bytes_moved = 0  # pulled into workers' gpu tiers and written through to nodes
        self.load_overhead_s = 0.0  # loading time beyond copying the bytes at the worker's memcpy rate
        window = serving.reuse_window_blocks
        self.access = LiveAccessStats(window) if window else None
        self.recorder = TraceRecorder(serving.record_trace, self.block_size) if serving.record_trace else None
        self.bind_metrics(CollectorRegistry())  # the app binds its own registry (build_app)

    def bind_metrics(self, registry) -> None:
        """Serving metrics on the conductor's /metrics."""
        self.m_requests = Counter(
            "tiercake_completions", "completion requests by outcome", ["outcome"], registry=registry
        )
        self.m_ttft = Histogram(
            "tiercake_ttft_seconds",
            "time to first token at the front",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.m_phase = Histogram(
            "tiercake_ttft_phase_seconds",
            "where the time to first token went",
            ["phase"],
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=registry,
        )
        self.m_overhead = Histogram(
            "tiercake_load_overhead_seconds",
            "time loading a prefix beyond copying its bytes at the worker's measured memcpy rate (completion overhead)",
            buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 1),
            registry=registry,
        )
        self.m_prompt = Counter("tiercake_prompt_tokens", "prompt tokens served", registry=registry)
        self.m_cached = Counter(
            "tiercake_cached_prompt_tokens",
            "prompt tokens whose KV was reused, by source tier",
            ["source"],
            registry=registry,
        )
        self.m_load = Histogram(
            "tiercake_prefix_load_seconds",
            "time pulling a prefix into a worker, by the source tier that held most of it",
            ["tier"],
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=registry,
        )
        self.m_load_bytes = Counter(
            "tiercake_prefix_load_bytes", "KV bytes pulled into workers, by source tier", ["tier"], registry=registry
        )
        if self.access is not None:
            self.access.bind_metrics(registry)

    async def arrived(
        self, keys: Sequence[bytes], tokens: list[int], max_tokens: int, tenant: str, session: str | None = None
    ) -> None:
        """A request the front accepted: its blocks count for reuse, and it joins the recorded trace."""
        if self.access is not None:
            self.access.observe(keys, time.monotonic())
        if self.recorder is not None:
            await self.recorder.record(keys, tokens, max_tokens, tenant, session)

    def outcome(self, outcome: str) -> None:
        self.m_requests.labels(outcome).inc()

    def prefilled(self, timing: Timing) -> None:
        """The prefill worker's first token arrived, with its statistics."""
        stats = timing.stats
        timing.ttft_s = time.perf_counter() - timing.started
        self.m_ttft.observe(timing.ttft_s)
        self._observe_phases(timing)
        if stats.final:
            self.reused(stats)

    def reused(self, stats: PrefillStats) -> None:
        """A prefill's final figures: what it reused and moved (with the first token, or at the end
        from an engine that learns them only then)."""
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.kv_bytes_moved += stats.load_bytes + stats.written_blocks * self.block_nbytes
        if stats.load_bytes and stats.load_tier:
            self.m_load.labels(stats.load_tier).observe(stats.load_s)
            self.m_load_bytes.labels(stats.load_tier).inc(stats.load_bytes)
        if stats.load_bytes and stats.copy_bytes_per_s:
            overhead = max(0.0, stats.load_s - stats.load_bytes / stats.copy_bytes_per_s)
            self.load_overhead_s += overhead
            self.m_overhead.observe(overhead)
        self.m_prompt.inc(stats.prompt_tokens)
        block_size = stats.block_size or self.block_size
        for source, blocks in stats.sources.items():
            tier = source.rsplit(":", 1)[-1]
            self.cached_by_source[tier] += blocks * block_size
            self.m_cached.labels(tier).inc(blocks * block_size)

    def _observe_phases(self, timing: Timing) -> None:
        """TTFT = routing + lookup (the front's and the worker's, if it asked again) + load + compute +
        the rest (queue in the worker, HTTP hops)."""
        stats = timing.stats
        route = timing.route_s - timing.lookup_s
        lookup = timing.lookup_s + stats.lookup_s
        known = route + lookup + stats.load_s + stats.compute_s
        for phase, seconds in (
            ("route", route),
            ("lookup", lookup),
            ("load", stats.load_s),
            ("compute", stats.compute_s),
            ("queue_and_transport", max(0.0, timing.ttft_s - known)),
        ):
            self.m_phase.labels(phase).observe(seconds)

    def figures(self) -> ServingFigures:
        return ServingFigures(
            requests=self.served,
            rejected=self.rejected,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            hit_ratio=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            cached_tokens_by_source=dict(self.cached_by_source),
        )

    def metadata_costs(self, index_stats, backend_writes: int) -> MetadataCosts:
        """Metadata work per request and per KV byte moved: index lookups and placement changes (with
        the bytes of their keys and sizes), against the requests served and the KV moved."""
        requests = max(1, self.served + self.rejected)
        ops = index_stats.ops + index_stats.lookups
        return MetadataCosts(
            lookups=index_stats.lookups,
            placement_changes=index_stats.ops,
            change_batches=index_stats.batches,
            changes=dict(index_stats.changes),
            change_bytes=index_stats.bytes,
            backend_writes=backend_writes,
            ops_per_request=ops / requests,
            bytes_per_request=index_stats.bytes / requests,
            kv_bytes_moved=self.kv_bytes_moved,
            block_bytes=self.block_nbytes,
            metadata_bytes_per_kv_byte=index_stats.bytes / self.kv_bytes_moved if self.kv_bytes_moved else 0.0,
            load_overhead_s=self.load_overhead_s,
        )

    async def reuse(self) -> dict | None:
        return await asyncio.to_thread(self.access.summary) if self.access is not None else None

    def close(self) -> None:
        if self.access is not None:
            self.access.close()
