"""Routing policies: which worker serves a request (the conductor and the cluster simulator run the
same objects).

The default, ``ttft``, is Mooncake's Algorithm 1: for each worker, predict the time to first token as
queue time + transfer time of the prefix it would pull + prefill time of what it must compute, and
take the smallest. A worker pulls the best prefix held anywhere when that prefix is longer than its
own by the ``pull_ratio``; otherwise it computes from its own. The simpler routers are baselines.
"""

from __future__ import annotations

import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill seconds for ``t`` computed tokens after a cached prefix of ``c``: ``a + b*t + q*t*(t + 2c)``
    (the last term is attention, quadratic in context). Fitted per deployment from measured timings."""

    a: float = 0.005
    b: float = 1e-4
    q: float = 0.0

    @classmethod
    def from_perf(cls, perf: dict[str, float]) -> PrefillModel:
        """From the timings a worker publishes (``prefill_a``, ``prefill_b``, ``prefill_q``)."""
        default = cls()
        return cls(perf.get("prefill_a", default.a), perf.get("prefill_b", default.b), perf.get("prefill_q", default.q))

    def seconds(self, computed: int, cached: int = 0) -> float:
        return self.a + self.b * computed + self.q * computed * (computed + 2 * cached)


# A pull predicted within this fraction of recomputing is still taken: a TTFT comparison does not
# count that a recompute holds the worker's compute, which the requests behind it wait for, while a
# pull mostly waits on a copy or the network; and two predictions this close are within the noise of
# the fits they come from (a small model's prefix on the same host: 6 against 9 ms, either way).
# Each router takes its own as ``reuse_margin`` (an operator whose compute is the scarce resource
# raises it: a large one loads whatever a node holds, whatever the links measure).
REUSE_MARGIN = 0.25
MAX_REUSE_MARGIN = 1e6


def check_reuse_margin(reuse_margin: float) -> float:
    if not 0 <= reuse_margin <= MAX_REUSE_MARGIN:  # also NaN
        raise ValueError(f"reuse_margin is a fraction of the recompute's time, in [0, {MAX_REUSE_MARGIN:g}]")
    return float(reuse_margin)


@dataclass(frozen=True, slots=True)
class WorkerState:
    worker: str
    cached_blocks: int = 0  # blocks of the prompt's prefix in the worker's own gpu tier
    queued_tokens: int = 0  # prompt tokens routed to it and not yet prefilled
    running: int = 0  # sequences it is decoding
    prefill: PrefillModel = PrefillModel()
    decode_step_s: float = 0.005  # one decode step at a small batch
    # the link from the node holding the request's prefix into its gpu tier, as measured by its
    # pulls from there (``LinkModel``): a pull costs pull_latency_s + bytes / load_bytes_per_s
    load_bytes_per_s: float = 2e9
    pull_latency_s: float = 0.0
    queue_s: float = 0.0  # known backlog in seconds (the simulator knows it; the live front counts tokens)
    sessions: int = 0  # paused sessions whose last turn ran here (their KV is retained on its node)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    block_nbytes: int
    best_blocks: int = 0  # the longest prefix any node holds (pool or SSD)
    # the request's session: the workers that ran its last turn, then its parent's (a subagent's
    # first turn), most preferred first; empty for a request without a session
    affinity: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: str
    ttft_s: float  # predicted
    tbt_s: float  # predicted time between tokens
    pull: bool  # pull the best prefix from the node that holds it
    reused_blocks: int


class Router(ABC):
    name: ClassVar[str] = ""

    @abstractmethod
    def choose(self, workers: list[WorkerState], request: RouteRequest) -> RouteDecision:
        """The worker that computes the prompt (a prefill worker, or a worker doing both)."""

    def choose_decode(self, workers: list[WorkerState], request: RouteRequest) -> RouteDecision:
        """The decode worker that takes over a prefilled request (its blocks are on a node already, so
        its own cache does not matter): by default the smallest predicted time between tokens."""
        return min((self.predict(w, request, pull_ratio=None) for w in workers), key=lambda d: (d.tbt_s, d.worker))

    def describe(self) -> str:
        return self.name

    @property
    def loads_from_nodes(self) -> bool:
        """Whether the worker it picks loads a longer prefix a node holds (pool or SSD). A router
        without a ``pull_ratio`` is trusted to decide that in ``choose``."""
        return getattr(self, "pull_ratio", 1.0) is not None

    @staticmethod
    def predict(
        worker: WorkerState, request: RouteRequest, pull_ratio: float | None = 1.0, reuse_margin: float = REUSE_MARGIN
    ) -> RouteDecision:
        """Algorithm 1's estimate for one worker (``pull_ratio`` None: never pull). A pull is taken
        when the prefix held elsewhere is longer than the worker's own by ``pull_ratio`` and loading
        it over the worker's measured link beats computing it, or is within ``reuse_margin`` of it:
        across a slow link, recompute wins."""
        usable = (request.prompt_tokens - 1) // request.block_size
        own = min(worker.cached_blocks, usable)
        best = min(request.best_blocks, usable)
        compute = worker.prefill.seconds(request.prompt_tokens - own * request.block_size, own * request.block_size)
        pull = pull_ratio is not None and best > own and best >= pull_ratio * max(own, 1)
        if pull:
            transfer = worker.pull_latency_s + (best - own) * request.block_nbytes / worker.load_bytes_per_s
            cached = best * request.block_size
            pulled = transfer + worker.prefill.seconds(request.prompt_tokens - cached, cached)
            pull = pulled <= compute * (1 + reuse_margin)
        reused = best if pull else own
        queue = worker.queue_s + (worker.prefill.seconds(worker.queued_tokens) if worker.queued_tokens else 0.0)
        ttft = queue + (pulled if pull else compute)
        tbt = worker.decode_step_s * (1 + worker.running / 32)
        return RouteDecision(worker.worker, ttft, tbt, pull, reused)


class TtftRouter(Router):
    """Mooncake's Algorithm 1: the smallest predicted TTFT, pulling hot prefixes as a side effect.

    ``margin``: predictions within this fraction of the smallest, plus the spread of the workers' fitted
    fixed costs (``PrefillModel.a``), count as equal, and among them the worker whose own cache holds
    the most of the prompt wins (then the smallest prediction). Each worker's timings are fitted from
    its own measurements, so two equal workers' predictions differ by the fits' noise; when a pull from
    the pool is cheap, that noise alone would send a conversation's next turn away from the worker that
    holds it, and its blocks would then be loaded instead of used in place (``tiercake simulate
    --fit-noise`` shows the cost). The fixed cost is where the noise is largest: a few probes of a
    small model time mostly HTTP and scheduling (two equal vLLM servers fitted 0.020 and 0.029 s), and
    a prompt mostly cached costs little beyond it, so a relative margin alone does not cover it."""

    name = "ttft"

    def __init__(self, pull_ratio: float = 1.25, margin: float = 0.1, reuse_margin: float = REUSE_MARGIN) -> None:
        if not pull_ratio >= 1:  # also NaN
            raise ValueError("pull_ratio must be at least 1")
        if not 0 <= margin < 1:
            raise ValueError("margin is a fraction in [0, 1)")
        self.pull_ratio = pull_ratio
        self.margin = margin
        self.reuse_margin = check_reuse_margin(reuse_margin)

    def choose(self, workers, request):
        decisions = [self.predict(w, request, self.pull_ratio, self.reuse_margin) for w in workers]
        fastest = min(d.ttft_s for d in decisions)
        spread = max(w.prefill.a for w in workers) - min(w.prefill.a for w in workers) if self.margin else 0.0
        near = [d for d in decisions if d.ttft_s <= fastest * (1 + self._margin_for(d.worker, request)) + spread]
        return min(near, key=self._preference(workers, request))

    def _margin_for(self, worker: str, request: RouteRequest) -> float:
        """How far above the fastest prediction ``worker``'s may be and still count as near."""
        return self.margin

    def _preference(self, workers: list[WorkerState], request: RouteRequest) -> Callable[[RouteDecision], tuple]:
        """The order among near workers: the most of the prompt in its own cache, then the fastest."""
        own = self._own(workers, request)
        return lambda d: (-own[d.worker], d.ttft_s)

    @staticmethod
    def _own(workers: list[WorkerState], request: RouteRequest) -> dict[str, int]:
        usable = max(0, (request.prompt_tokens - 1) // request.block_size)
        return {w.worker: min(w.cached_blocks, usable) for w in workers}


class SessionRouter(TtftRouter):
    """Algorithm 1 that keeps a conversation where it was: a session's next turn goes back to the
    worker that ran its last turn, and a subagent's first turn to its parent's, while that worker's
    predicted TTFT is within ``affinity`` of the fastest; a new session goes, among equals, to the
    worker retaining the fewest paused sessions.

    Why, when Algorithm 1 already prefers the worker whose cache holds the prompt: a paused
    session's blocks leave the gpu tier (demoted to its node's pool, staged back before an announced
    resume), and then every worker looks alike to the cache rule. A turn sent elsewhere loads the
    whole conversation again, across nodes when the pool is another node's, and leaves a second copy
    of the conversation in a second gpu tier (two workers' caches each hold what one would). Keeping
    it on one worker keeps one copy, next to the node that staged it. Siblings of a fan start where
    their parent ran, where the shared prefix is hot. The bound keeps a busy worker from being
    loaded further: past ``affinity``, the fastest wins as in ``ttft``. Without session information
    it routes exactly as ``ttft``."""

    name = "session"

    def __init__(
        self, pull_ratio: float = 1.25, margin: float = 0.1, affinity: float = 0.25, reuse_margin: float = REUSE_MARGIN
    ) -> None:
        super().__init__(pull_ratio, margin, reuse_margin)
        if not 0 <= affinity < 10:
            raise ValueError("affinity is a fraction of the fastest prediction, in [0, 10)")
        self.affinity = affinity

    def _margin_for(self, worker: str, request: RouteRequest) -> float:
        return max(self.margin, self.affinity) if worker in request.affinity else self.margin

    def _preference(self, workers: list[WorkerState], request: RouteRequest) -> Callable[[RouteDecision], tuple]:
        own, held = self._own(workers, request), {w.worker: w.sessions for w in workers}
        rank = {worker: i for i, worker in enumerate(request.affinity)}
        return lambda d: (-own[d.worker], rank.get(d.worker, len(rank)), held[d.worker], d.ttft_s)


class _PullingBaseline(Router):
    """A baseline picks the worker by its own rule; the worker it picks still loads a longer prefix a
    node holds (pool or SSD: far cheaper than recomputing it), unless ``pull=False`` (own cache only,
    as in Mooncake's ablation baselines). Choosing a baseline never silently turns the tiers off."""

    def __init__(self, pull: bool = True, reuse_margin: float = REUSE_MARGIN) -> None:
        self.pull_ratio = 1.0 if pull else None
        self.reuse_margin = check_reuse_margin(reuse_margin)

    def decide(self, worker: WorkerState, request: RouteRequest) -> RouteDecision:
        return self.predict(worker, request, self.pull_ratio, self.reuse_margin)


class CacheAwareRouter(_PullingBaseline):
    """The longest prefix in a worker's own gpu tier; ties go to the less loaded."""

    name = "cache_aware"

    def choose(self, workers, request):
        best = max(workers, key=lambda w: (w.cached_blocks, -w.queue_s, -w.queued_tokens, -w.running))
        return self.decide(best, request)


class LeastLoadedRouter(_PullingBaseline):
    name = "least_loaded"

    def choose(self, workers, request):
        best = min(workers, key=lambda w: (w.queue_s, w.queued_tokens, w.running))
        return self.decide(best, request)


class RoundRobinRouter(_PullingBaseline):
    name = "round_robin"

    def __init__(self, pull: bool = True, reuse_margin: float = REUSE_MARGIN) -> None:
        super().__init__(pull, reuse_margin)
        self._turn = itertools.count()

    def choose(self, workers, request):
        ordered = sorted(workers, key=lambda w: w.worker)
        return self.decide(ordered[next(self._turn) % len(ordered)], request)


class RandomRouter(_PullingBaseline):
    name = "random"

    def __init__(self, seed: int | None = None, pull: bool = True, reuse_margin: float = REUSE_MARGIN) -> None:
        super().__init__(pull, reuse_margin)
        self._random = random.Random(seed)

    def choose(self, workers, request):
        return self.decide(self._random.choice(workers), request)


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Seconds to load ``n`` bytes from a node into a worker: ``latency_s + n / bytes_per_s``, fitted
    from the pulls between that pair (``fit_link``); before any, the worker's own rate, no latency."""

    latency_s: float = 0.0
    bytes_per_s: float = 2e9

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def fit_link(samples: list[tuple[int, float]], prior: LinkModel = LinkModel(), decay: float = 0.5) -> LinkModel:
    """The line through ``(bytes, seconds)`` of pulls, oldest first, each weighted ``decay`` times
    the one after it (a link that turns slow is priced slow after a pull or two), its latency at least
    0 and its rate positive: weighted least squares when the sizes differ. Pulls of one size cannot
    tell a fixed cost from a rate: the prior's rate is kept and what it does not explain is latency
    (a pull's round trips and lookups are a fixed cost; pricing them as a rate made a pull of twice
    the blocks cost twice, so a small first pull turned every later one into a recompute), unless
    they ran faster than that rate, which is then theirs. Non-finite or non-positive samples are
    ignored."""
    good = [(float(n), s) for n, s in samples if n > 0 and s > 0 and math.isfinite(s)]
    if not good:
        return prior
    weights = [decay ** (len(good) - 1 - i) for i in range(len(good))]
    total = sum(weights)
    mx = sum(w * n for w, (n, _) in zip(weights, good, strict=True)) / total
    my = sum(w * s for w, (_, s) in zip(weights, good, strict=True)) / total
    var = sum(w * (n - mx) ** 2 for w, (n, _) in zip(weights, good, strict=True))
    if var > 1e-12 * mx * mx:
        slope = sum(w * (n - mx) * (s - my) for w, (n, s) in zip(weights, good, strict=True)) / var
        latency = my - slope * mx
        if slope > 0 and latency >= 0:
            return LinkModel(latency, 1.0 / slope)
        if slope > 0:  # a negative intercept is noise: the rate through the origin
            return LinkModel(0.0, mx / my)
    latency = my - mx / prior.bytes_per_s
    if latency > 0:
        return LinkModel(latency, prior.bytes_per_s)
    return LinkModel(0.0, mx / my)


def fit_prefill(samples: list[tuple[int, int, float]]) -> PrefillModel:
    """Least-squares fit of ``PrefillModel`` to (computed tokens, cached tokens, seconds) samples;
    coefficients are kept non-negative."""
    import numpy as np

    if len(samples) < 3:
        raise ValueError("at least three timings are needed to fit the prefill model")
    t = np.array([s[0] for s in samples], dtype=float)
    c = np.array([s[1] for s in samples], dtype=float)
    y = np.array([s[2] for s in samples], dtype=float)
    design = np.stack([np.ones_like(t), t, t * (t + 2 * c)], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    a, b, q = (max(float(x), 0.0) for x in coef)
    return PrefillModel(a, b, q)
