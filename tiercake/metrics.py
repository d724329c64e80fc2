"""Prometheus series of a member's store, one definition for both places they are scraped: the
conductor's /metrics (every live member, from their keep-alives) and each member's own /metrics
(node agents and workers: figures that are never older than the scrape)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .messages import RESIDENCY_BUCKETS, MemberStats


def store_families(stats: Mapping[str, MemberStats]) -> Iterator[Metric]:
    """Per member and tier: capacity, bytes and blocks held, hits, evictions, corrupt copies dropped,
    and how long evicted blocks had stayed; per member: misses."""
    labels = ["member", "tier"]
    capacity = GaugeMetricFamily("tiercake_tier_capacity_bytes", "capacity of each member's tiers", labels=labels)
    used = GaugeMetricFamily("tiercake_tier_used_bytes", "bytes held in each member's tiers", labels=labels)
    blocks = GaugeMetricFamily("tiercake_tier_blocks", "blocks held in each member's tiers", labels=labels)
    hits = CounterMetricFamily("tiercake_tier_hits", "reads served by each member's tiers", labels=labels)
    evictions = CounterMetricFamily("tiercake_tier_evictions", "blocks evicted from each member's tiers", labels=labels)
    corrupt = CounterMetricFamily(
        "tiercake_tier_corrupt", "copies that failed their checksum on a read (dropped, never served)", labels=labels
    )
    misses = CounterMetricFamily("tiercake_store_misses", "reads no tier of the member could serve", labels=["member"])
    residency = HistogramMetricFamily(
        "tiercake_block_residency_seconds", "how long blocks stayed in a tier before eviction", labels=labels
    )
    for member, member_stats in stats.items():
        misses.add_metric([member], member_stats.misses)
        for tier, t in member_stats.tiers.items():
            key = [member, tier]
            capacity.add_metric(key, t.capacity_bytes)
            used.add_metric(key, t.used_bytes)
            blocks.add_metric(key, t.blocks)
            hits.add_metric(key, t.hits)
            evictions.add_metric(key, t.evictions)
            corrupt.add_metric(key, t.corrupt)
            if len(t.residency) == len(RESIDENCY_BUCKETS) + 1:
                cumulative, running = [], 0
                for bound, count in zip([*map(str, RESIDENCY_BUCKETS), "+Inf"], t.residency):
                    running += count
                    cumulative.append((bound, running))
                residency.add_metric(key, cumulative, t.residency_sum_s)
    yield from (capacity, used, blocks, hits, evictions, corrupt, misses, residency)


class Collected:
    """A collector made of a function that yields families when scraped (prometheus_client calls
    ``collect``)."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect


def registry_of(*collects: Callable[[], Iterator[Metric]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    for collect in collects:
        registry.register(Collected(collect))
    return registry


def metrics_handler(registry: CollectorRegistry):
    """The aiohttp handler that serves ``registry`` in Prometheus' text format."""

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    return handler
