"""What the front knows of the links between workers and nodes: each pull a worker reports (its
``PrefillStats``: bytes loaded, seconds, the nodes they came from) is a sample of the link from that
node to that worker, and the router prices a pull with the line fitted through the pair's samples
(``fit_link``: latency + bytes / rate). Across hosts the pairs differ by orders of magnitude (a
worker's own host's pool at memory speed, a far host behind a slow link), so one rate per worker,
or a loopback constant, would pull where computing is faster. A pair not yet measured is priced by
the worker's pulls from anywhere. A measurement goes stale after ``STALE_S``: a pair priced slow is
no longer pulled from, so nothing would ever measure it again (one pull that waited behind
something else would keep a fast link unused for good)."""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable

from tiercake.messages import PrefillStats
from tiercake.policies import LinkModel, fit_link

SAMPLES = 8  # per pair: the latest pulls (a link changes: the fit weighs the newest most)
STALE_S = 60.0  # a pull older than this prices nothing


Sample = tuple[float, int, float]  # (when, bytes, seconds)


class LinkBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._pairs: dict[tuple[str, str], deque[Sample]] = defaultdict(lambda: deque(maxlen=SAMPLES))
        self._workers: dict[str, deque[Sample]] = defaultdict(lambda: deque(maxlen=SAMPLES))
        self._clock = clock

    def observe(self, worker: str, stats: PrefillStats) -> None:
        """A pull ``worker`` reported; attributed to the node most of its blocks came from."""
        if stats.load_bytes <= 0 or not (math.isfinite(stats.load_s) and stats.load_s > 0):
            return
        sample = (self._clock(), stats.load_bytes, stats.load_s)
        self._workers[worker].append(sample)
        node = source_node(stats)
        if node is not None:
            self._pairs[worker, node].append(sample)

    def model(self, worker: str, node: str | None) -> LinkModel:
        """The link from ``node`` into ``worker`` (None: wherever it pulls from), by its fresh pulls."""
        prior = fit_link(self._fresh(self._workers.get(worker)))
        pair = self._fresh(self._pairs.get((worker, node))) if node is not None else []
        return fit_link(pair, prior) if pair else prior

    def _fresh(self, samples: deque[Sample] | None) -> list[tuple[int, float]]:
        since = self._clock() - STALE_S
        return [(n, s) for at, n, s in samples or () if at >= since]


def source_node(stats: PrefillStats) -> str | None:
    """The node that sent most of a prefill's pulled blocks (``sources``: "<node>:<tier>" -> blocks)."""
    nodes: dict[str, int] = {}
    for source, blocks in stats.sources.items():
        node, sep, _ = source.rpartition(":")
        if sep and node:
            nodes[node] = nodes.get(node, 0) + blocks
    return max(nodes, key=lambda n: (nodes[n], n)) if nodes else None
