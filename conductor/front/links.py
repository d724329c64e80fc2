"""What the front knows of the links between workers and nodes: each pull a worker reports (its
``PrefillStats``: bytes loaded, seconds, the nodes they came from) is a sample of the link from that
node to that worker, and the router prices a pull with the line fitted through the pair's samples
(``fit_link``: latency + bytes / rate). Across hosts the pairs differ by orders of magnitude (a
worker's own host's pool at memory speed, a far host behind a slow link), so one rate per worker,
or a loopback constant, would pull where computing is faster. A pair not yet measured is priced by
the worker's pulls from anywhere."""

from __future__ import annotations

import math
from collections import defaultdict, deque

from tiercake.messages import PrefillStats
from tiercake.policies import LinkModel, fit_link

SAMPLES = 8  # per pair: the latest pulls (a link changes: the fit weighs the newest most)


class LinkBook:
    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], deque[tuple[int, float]]] = defaultdict(lambda: deque(maxlen=SAMPLES))
        self._workers: dict[str, deque[tuple[int, float]]] = defaultdict(lambda: deque(maxlen=SAMPLES))
        self._fits: dict[tuple[str, str | None], LinkModel] = {}

    def observe(self, worker: str, stats: PrefillStats) -> None:
        """A pull ``worker`` reported; attributed to the node most of its blocks came from."""
        if stats.load_bytes <= 0 or not (math.isfinite(stats.load_s) and stats.load_s > 0):
            return
        sample = (stats.load_bytes, stats.load_s)
        self._workers[worker].append(sample)
        self._fits.pop((worker, None), None)
        node = source_node(stats)
        if node is not None:
            self._pairs[worker, node].append(sample)
            self._fits.pop((worker, node), None)

    def model(self, worker: str, node: str | None) -> LinkModel:
        """The link from ``node`` into ``worker`` (None: wherever it pulls from)."""
        key = (worker, node)
        if key not in self._fits:
            prior = fit_link(list(self._workers.get(worker, ())))
            pair = self._pairs.get((worker, node)) if node is not None else None
            self._fits[key] = fit_link(list(pair), prior) if pair else prior
        return self._fits[key]


def source_node(stats: PrefillStats) -> str | None:
    """The node that sent most of a prefill's pulled blocks (``sources``: "<node>:<tier>" -> blocks)."""
    nodes: dict[str, int] = {}
    for source, blocks in stats.sources.items():
        node, sep, _ = source.rpartition(":")
        if sep and node:
            nodes[node] = nodes.get(node, 0) + blocks
    return max(nodes, key=lambda n: (nodes[n], n)) if nodes else None
