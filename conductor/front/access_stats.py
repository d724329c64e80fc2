"""What the front's own traffic says about caching, measured live with the same tracker that measures
a trace offline (``analysis/trace_stats.py``): reuse distance (the LRU stack distance, in blocks),
reuse time, and prefetchability (a re-access announced by an earlier request this one extends, and
how long before: the lead a prefetcher would have had). Exported on /metrics and in /v1/cluster.

The tracking runs on one thread of its own, in arrival order: now and then the tracker compacts its
window (a tenth of a second for 100k blocks), which must not stall the event loop."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Histogram

from tiercake.analysis.trace_stats import ReuseTracker

DISTANCE_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
TIME_BUCKETS = (0.1, 1, 10, 60, 600, 1800, 3600)

log = logging.getLogger(__name__)


class LiveAccessStats:
    def __init__(self, window_blocks: int) -> None:
        self.window_blocks = window_blocks
        self.tracker = ReuseTracker(max_blocks=window_blocks)
        self.accesses = 0
        self.reaccesses = 0
        self.prefetchable = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercake-reuse")
        self.bind_metrics(CollectorRegistry())

    def bind_metrics(self, registry) -> None:
        self.m_accesses = Counter("tiercake_block_accesses", "full prompt blocks requested", registry=registry)
        self.m_reaccesses = Counter(
            "tiercake_block_reaccesses",
            "requested blocks seen before (within the window of recent blocks)",
            registry=registry,
        )
        self.m_prefetchable = Counter(
            "tiercake_prefetchable_reaccesses",
            "re-accesses announced by an earlier request this one extends (a follow-up turn)",
            registry=registry,
        )
        self.m_distance = Histogram(
            "tiercake_reuse_distance_blocks",
            "distinct blocks requested between two accesses to a block (an LRU cache of C blocks hits those under C)",
            buckets=DISTANCE_BUCKETS,
            registry=registry,
        )
        self.m_reuse_time = Histogram(
            "tiercake_reuse_time_seconds",
            "time between two accesses to a block",
            buckets=TIME_BUCKETS,
            registry=registry,
        )
        self.m_lead = Histogram(
            "tiercake_prefetch_lead_seconds",
            "for prefetchable re-accesses: how long before an earlier request announced them",
            buckets=TIME_BUCKETS,
            registry=registry,
        )

    def observe(self, keys: Sequence[bytes], now: float) -> None:
        """One request's full blocks, in chain order, at ``now`` (seconds, monotonic); counted on the
        tracking thread."""
        self._thread.submit(self._observe, keys, now).add_done_callback(_log_failure)

    def _observe(self, keys: Sequence[bytes], now: float) -> None:
        self.accesses += len(keys)
        self.m_accesses.inc(len(keys))
        for seen in self.tracker.observe(keys, now):
            if seen is None:
                continue
            self.reaccesses += 1
            self.m_reaccesses.inc()
            self.m_distance.observe(seen.distance)
            self.m_reuse_time.observe(seen.reuse_time_s)
            if seen.prefetchable:
                self.prefetchable += 1
                self.m_prefetchable.inc()
                self.m_lead.observe(seen.lead_s or 0.0)  # prefetchable: a lead was measured

    def summary(self) -> dict:
        """The counts, once every request observed so far is counted."""
        return self._thread.submit(self._summary).result()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _summary(self) -> dict:
        return {
            "block_accesses": self.accesses,
            "reaccesses": self.reaccesses,
            "reaccess_share": self.reaccesses / self.accesses if self.accesses else 0.0,
            "prefetchable_share": self.prefetchable / self.reaccesses if self.reaccesses else 0.0,
            "window_blocks": self.window_blocks,
        }


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.error("reuse tracking failed: %r", future.exception())
