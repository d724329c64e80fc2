"""How fast each worker computes now, against the timings it measured when it started.

A worker fits its prefill timings once, on a quiet start (``WorkerPerf``), while the front measures
its pulls live (``LinkBook``). On a busy machine both slow down, but only the pull's price followed:
the router compared a pull measured under load with a computation priced as if the machine were
idle and recomputed prompts whose prefix a node held. Each prefill a worker reports (its computed
and cached tokens, the seconds it computed) is a sample of its pace: the ratio of what it took to
what its fit predicts. The router scales the fit by the median of the fresh samples."""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable

from tiercake.messages import PrefillStats
from tiercake.policies import PrefillModel

SAMPLES = 8  # per worker: the latest prefills
STALE_S = 60.0  # as a link's measurements (links.py)
BOUNDS = (0.1, 10.0)  # a sample beyond these is a timer's accident, not a pace
MIN_PREDICTED_S = 1e-3  # a prefill predicted shorter than this is mostly overhead: no sample


class PaceBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples: dict[str, deque[tuple[float, float]]] = defaultdict(lambda: deque(maxlen=SAMPLES))
        self._clock = clock

    def observe(self, worker: str, model: PrefillModel, stats: PrefillStats) -> None:
        """A prefill ``worker`` reported, against the fit it registered with."""
        computed = stats.prompt_tokens - stats.cached_tokens
        predicted = model.seconds(computed, stats.cached_tokens) if computed > 0 else 0.0
        if predicted < MIN_PREDICTED_S or not (math.isfinite(stats.compute_s) and stats.compute_s > 0):
            return
        pace = stats.compute_s / predicted
        if BOUNDS[0] <= pace <= BOUNDS[1]:
            self._samples[worker].append((self._clock(), pace))

    def pace(self, worker: str) -> float:
        """How many times its fit the worker takes now (1.0: as fitted, or nothing fresh measured)."""
        since = self._clock() - STALE_S
        fresh = [p for at, p in self._samples.get(worker, ()) if at >= since]
        return statistics.median(fresh) if fresh else 1.0

    def model(self, worker: str, fitted: PrefillModel) -> PrefillModel:
        """``fitted`` at the worker's pace now."""
        k = self.pace(worker)
        return PrefillModel(fitted.a * k, fitted.b * k, fitted.q * k)
