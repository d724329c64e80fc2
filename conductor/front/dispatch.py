"""The dispatcher: one completion request through the cluster, as a small state machine.

    ROUTE    pick the prefill worker with the routing policy (Mooncake's Algorithm 1 by default), from
             the index's view of who holds how much of the prompt, the workers' queues and fitted
             timings; refuse with 429 when the predicted TTFT or TBT misses the SLO
    PREFILL  the worker loads the cached prefix (pulling it when told to), computes the rest and
             streams the first token (a worker doing both goes on streaming: no handoff)
    HANDOFF  with separate decode workers, the prefill's last event says where the prompt's blocks
             are (``KVHandoff``); the routing policy picks the decode worker (``choose_decode``)
    DECODE   the decode worker pulls the blocks from there and streams the rest

One retry rule for both worker phases: a worker that cannot be reached or fails before its first
token (``WorkerUnavailable``) is skipped for ``FAIL_BACKOFF_S`` and the phase planned again, up to
``ATTEMPTS`` times; a worker that is alive but full (``WorkerBusy``: its gpu tier is held by running
sequences) is skipped only for ``BUSY_BACKOFF_S``, and when every worker is full the answer is a 429
with Retry-After, not a 503; a refusal of the request itself (``WorkerRefused``) is the client's 4xx;
a worker that answers with a server error of its own (``RequestFailed``) is up, and not skipped:
the request goes to one more worker, and fails alone (a 500) when that one fails it too, so a
request that breaks workers cannot sideline them for everyone else; a failure after a token reached
the client (``StreamBroken``) ends the stream with an error.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from tiercake.blocks import BlockKey, Namespace, block_keys
from tiercake.config import TiercakeConfig
from tiercake.errors import ApiError
from tiercake.messages import (
    GenerateRequest,
    KVHandoff,
    KVSpace,
    MemberInfo,
    PrefillStats,
    RouterSpec,
    SessionDirective,
    TokenEvent,
)
from tiercake.policies import PrefillModel, RouteDecision, Router, RouteRequest, WorkerState, create_router

from ..service import Conductor
from .departures import Departures
from .links import LinkBook
from .pace import PaceBook
from .serving_stats import ServingStats, Timing
from .session_book import SessionBook
from .worker_client import RequestFailed, StreamBroken, WorkerBusy, WorkerClient, WorkerRefused, WorkerUnavailable

log = logging.getLogger(__name__)


def own_cache_only(router: str) -> str:
    """The warning for a router that never loads what the nodes hold."""
    return (
        f"router {router!r} with pull: false reuses only each worker's own gpu cache: blocks in the nodes' "
        "pool and SSD are never loaded (drop pull: false, or use ttft)"
    )


ANY_WORKER = ("worker", "prefill", "decode")


@dataclass
class Job:
    """One completion request as the dispatcher runs it; its block keys are hashed once, at the front."""

    tokens: list[int]
    keys: list[BlockKey]
    tenant: str  # the index tenant
    salt: str  # the hashing salt
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    logprobs: int | None = None
    session: SessionDirective | None = None  # the conversation it belongs to (tenant-scoped hash)
    affinity: tuple[str, ...] = ()  # workers its session prefers (SessionBook.began), most first
    worker: str | None = None  # the worker it was last sent to
    prefilled_on: str | None = None  # the worker that computed its prompt
    timing: Timing = field(default_factory=Timing)
    failed_on: set[str] = field(default_factory=set)  # workers that answered this request with a server error
    # namespace -> the prompt's keys in it
    _keys_in: dict[Namespace, list[BlockKey]] = field(default_factory=dict, init=False, repr=False)

    def keys_in(self, space: KVSpace | None) -> list[BlockKey]:
        """The prompt's block keys as workers of ``space`` key them (None: the serving config's,
        hashed at the front)."""
        if space is None:
            return self.keys
        keys = self._keys_in.get(space.namespace)
        if keys is None:
            namespace = space.namespace.model_copy(update={"tenant_salt": self.salt})
            keys = self._keys_in[space.namespace] = block_keys(namespace, self.tokens)
        return keys

    def request(self, **fields: Any) -> GenerateRequest:
        base: dict[str, Any] = {
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "tenant": self.tenant,
            "salt": self.salt,
            "seed": self.seed,
            "top_p": self.top_p,
            "logprobs": self.logprobs,
            "session": self.session,
        }
        return GenerateRequest(**(base | fields))


@dataclass
class WorkerLoad:
    """What the front counts of a worker: prompt tokens routed and not yet prefilled, sequences it
    serves, and until when it is skipped after a failure."""

    queued_tokens: int = 0
    running: int = 0
    failed_until: float = 0.0
    busy_until: float = 0.0  # full a moment ago: alive, skipped briefly


@dataclass(frozen=True, slots=True)
class Route:
    member: MemberInfo
    decision: RouteDecision
    source: KVHandoff | None  # where to pull the prefix from, when the router says pull


class Dispatcher:
    ATTEMPTS = 3
    FAIL_BACKOFF_S = 2.0
    BUSY_BACKOFF_S = 0.25
    REQUEST_FAILURES = 2  # workers that answered a request with a server error before the request fails

    def __init__(
        self,
        conductor: Conductor,
        config: TiercakeConfig,
        stats: ServingStats,
        sessions: SessionBook,
        workers: WorkerClient | None = None,
    ) -> None:
        self.conductor = conductor
        self.sessions = sessions  # the front's one book: which worker each session last ran on
        self.config = config
        self.serving = config.serving
        self.layout = self.serving.layout()
        self.stats = stats
        self.workers = workers or WorkerClient(conductor.peer_token, config.tls.client_context())
        self.loads: dict[str, WorkerLoad] = defaultdict(WorkerLoad)
        self.links = LinkBook()  # per worker and node: the link its pulls measured
        self.paces = PaceBook()  # per worker: how fast it computes now against its fit
        self.departures = Departures(conductor.members)
        self._router_spec = RouterSpec(name=self.serving.router, params=self.serving.router_params)
        self._router = create_router(self._router_spec.name, self._router_spec.params)
        if not self._router.loads_from_nodes:
            log.warning("%s", own_cache_only(self._router_spec.name))

    # The policy in force ------------------------------------------------------------------------

    @property
    def router_spec(self) -> RouterSpec:
        """The router the cluster settings name (switched at run time through ``/v1/policy``)."""
        return self.conductor.settings.router or self._router_spec

    def router(self) -> Router:
        spec = self.router_spec
        if spec != self._router_spec:
            self._router = create_router(spec.name, spec.params)
            self._router_spec = spec
        return self._router

    # The state machine --------------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncGenerator[TokenEvent, None]:
        """The request's tokens, across prefill and decode workers; the last has its finish reason."""
        split = self._split()
        roles = ("prefill",) if split else ANY_WORKER
        finished, handoff, first = False, None, 0
        prefill = self._attempts(
            "prefill",
            lambda: self._plan_prefill(job, roles, split),
            len(job.tokens),
            lambda event, load, first: self._prefilled(job, event, load, first),
            job.failed_on,
        )
        async for event in prefill:
            if event.finish_reason is None:
                yield event
                continue
            finished, handoff, first = True, event.handoff, event.token
            if not split or job.max_tokens == 1:
                yield event
                return
            yield event.model_copy(update={"finish_reason": None, "handoff": None})  # decode goes on
        if not finished:
            raise StreamBroken("prefill", "the worker ended the stream before its last token")
        decode = self._attempts(
            "decode",
            lambda: self._plan_decode(job, first, handoff),
            0,
            lambda event, _, first: self._decoding(job, event),
            job.failed_on,
        )
        async for event in decode:
            yield event
            if event.finish_reason is not None:
                return
        raise StreamBroken("decode", "the worker ended the stream before its last token")

    def _split(self) -> bool:
        return bool(self.serving.disaggregated and self._candidates(("prefill",)) and self._candidates(("decode",)))

    async def _attempts(
        self,
        phase: str,
        plan: Callable[[], tuple[MemberInfo, GenerateRequest]],
        queued: int,
        on_stats: Callable[[TokenEvent, WorkerLoad, bool], None],
        tried: set[str],
    ) -> AsyncGenerator[TokenEvent, None]:
        """The one retry rule (module docstring). ``on_stats`` sees the first event, and any later one
        with figures (an engine that learns its reuse only at the end sends them with the last)."""
        errors, busy, failed = [], 0, 0
        for _ in range(self.ATTEMPTS):
            member, request = plan()
            load = self.loads[member.node_id]
            load.queued_tokens += queued
            load.running += 1
            pending, first = queued, True
            try:
                async for event in self.departures.watch(member.node_id, self.workers.generate(member, request)):
                    if first:  # the prompt is prefilled: no longer queued
                        load.queued_tokens -= pending
                        pending = 0
                        on_stats(event, load, True)
                        first = False
                    elif event.stats is not None:
                        on_stats(event, load, False)
                    yield event
                return
            except WorkerBusy as exc:
                load.busy_until = time.monotonic() + self.BUSY_BACKOFF_S
                errors.append(str(exc))
                busy += 1
                log.info("front: %s; trying another %s worker", exc, phase)
            except RequestFailed as exc:  # the worker is up: not sidelined; two such answers fail the request only
                errors.append(str(exc))
                failed += 1
                tried.add(member.node_id)
                log.warning("front: %s", exc)
                if failed >= self.REQUEST_FAILURES:
                    raise ApiError(
                        500,
                        f"the request failed on {failed} {phase} workers: " + "; ".join(errors),
                        "server_error",
                        "request_failed",
                    ) from None
            except WorkerUnavailable as exc:
                load.failed_until = time.monotonic() + self.FAIL_BACKOFF_S
                errors.append(str(exc))
                log.warning("front: %s; trying another %s worker", exc, phase)
            except StreamBroken:
                load.failed_until = time.monotonic() + self.FAIL_BACKOFF_S
                raise
            except WorkerRefused as exc:
                raise ApiError(exc.status, exc.reason) from None
            finally:
                load.queued_tokens -= pending
                load.running -= 1
        if busy == len(errors):
            raise self._full(phase)
        raise ApiError(
            503,
            f"every {phase} worker tried failed: " + "; ".join(errors),
            "server_error",
            "worker_failed",
            retryable=True,
        )

    def _full(self, phase: str) -> ApiError:
        self.stats.rejected += 1
        return ApiError(
            429,
            f"every {phase} worker's gpu tier is full (its blocks are held by running requests); retry later",
            "rate_limit_error",
            "gpu_full",
            headers={"Retry-After": "1"},
        )

    def _no_worker(self, roles: tuple[str, ...]) -> ApiError:
        """No candidate: 429 when the workers are alive but full, 503 when there are none."""
        now = time.monotonic()
        alive = [m for m in self._workers(roles) if self.loads[m.node_id].failed_until <= now]
        if alive:  # all of them full a moment ago
            return self._full("decode" if roles == ("decode",) else "prefill")
        return ApiError(503, f"no live {'/'.join(roles)} worker", "server_error", "no_worker", retryable=True)

    # ROUTE and PREFILL --------------------------------------------------------------------------

    def _plan_prefill(self, job: Job, roles: tuple[str, ...], split: bool) -> tuple[MemberInfo, GenerateRequest]:
        started = time.perf_counter()
        route = self.route(job, roles, split)
        job.timing.route_s += time.perf_counter() - started
        request = job.request(
            max_tokens=1 if split else job.max_tokens, pull=route.decision.pull, source=route.source, handoff=split
        )
        job.worker = job.prefilled_on = route.member.node_id
        return route.member, request

    def route(self, job: Job, roles: tuple[str, ...], split: bool = False) -> Route:
        """The worker for the prompt, the router's decision, and where to pull the prefix from when
        it says pull (the node holding the longest prefix, so the worker need not ask the index)."""
        members = self._candidates(roles, job.failed_on)
        if not members:
            raise self._no_worker(roles)
        space = self._space(members)
        started = time.perf_counter()
        found = self.conductor.lookup(job.tenant, job.keys_in(space))
        job.timing.lookup_s += time.perf_counter() - started
        nodes = {m.node_id for m in self.conductor.members.alive("node")}
        best, best_node = max(((p.length, n) for n, p in found.items() if n in nodes), default=(0, None))
        request = self._route_request(space, len(job.tokens), best, job.affinity)
        router = self.router()
        held = self.sessions.held_per_worker()
        decision = router.choose(
            [
                self._state(
                    m,
                    found[m.node_id].length if m.node_id in found and m.kv_space == space else 0,
                    max(0, held[m.node_id]),  # a turn that began before the count was first taken
                    best_node,
                )
                for m in members
            ],
            request,
        )
        tbt = decision.tbt_s
        decoders = self._candidates(("decode",)) if split else []
        if decoders:  # the time between tokens is the decode worker's
            tbt = router.choose_decode([self._state(m, 0) for m in decoders], request).tbt_s
        self._check_slo(decision.ttft_s, tbt)
        member = next(m for m in members if m.node_id == decision.worker)
        source = None
        if decision.pull and best_node is not None:
            held = found[best_node]
            source = KVHandoff(
                node=best_node,
                blocks=best,
                runs=held.runs(),
                tier=max(held.tiers, key=held.tiers.get) if held.tiers else "?",
            )
        return Route(member, decision, source)

    @staticmethod
    def _space(members: list[MemberInfo]) -> KVSpace | None:
        """The KV space most of ``members`` key their blocks in (None: the serving config's). A worker
        keyed otherwise is routed to as if it held none of the prompt."""
        spaces = [m.kv_space for m in members]
        return max(spaces, key=spaces.count)

    def _route_request(
        self, space: KVSpace | None, tokens: int, cached_blocks: int, affinity: tuple[str, ...] = ()
    ) -> RouteRequest:
        if space is None:
            return RouteRequest(tokens, self.layout.block_size, self.layout.nbytes, cached_blocks, affinity)
        return RouteRequest(tokens, space.namespace.block_size, space.block_bytes, cached_blocks, affinity)

    def _check_slo(self, ttft_s: float, tbt_s: float) -> None:
        slo_ttft, slo_tbt = self.serving.slo_ttft_s, self.serving.slo_tbt_s
        if slo_ttft is not None and ttft_s > slo_ttft:
            self.stats.rejected += 1
            raise ApiError(
                429,
                f"predicted time to first token {ttft_s:.3f} s exceeds the SLO of {slo_ttft} s; retry later",
                "rate_limit_error",
                "slo_ttft",
                headers={"Retry-After": "1"},
            )
        if slo_tbt is not None and tbt_s > slo_tbt:
            self.stats.rejected += 1
            raise ApiError(
                429,
                f"predicted time between tokens {tbt_s:.4f} s exceeds the SLO of {slo_tbt} s; retry later",
                "rate_limit_error",
                "slo_tbt",
                headers={"Retry-After": "1"},
            )

    def _prefilled(self, job: Job, event: TokenEvent, load: WorkerLoad, first: bool) -> None:
        """The first token's figures; or, from an engine that sends them at the end, the final ones."""
        stats = job.timing.stats = event.stats or PrefillStats(prompt_tokens=len(job.tokens))
        if first:
            self.stats.prefilled(job.timing)
        else:
            self.stats.reused(stats)
        worker = job.worker
        assert worker is not None  # named when it was sent
        self.links.observe(worker, stats)
        member = self.conductor.members.members.get(worker)
        if member is not None:
            self.paces.observe(worker, _fitted(member), stats)

    # HANDOFF and DECODE -------------------------------------------------------------------------

    def _plan_decode(self, job: Job, first: int, handoff: KVHandoff | None) -> tuple[MemberInfo, GenerateRequest]:
        members = self._candidates(("decode",), job.failed_on)
        if not members:
            raise self._no_worker(("decode",))
        tokens = [*job.tokens, first]
        request = self._route_request(self._space(members), len(tokens), handoff.blocks if handoff else 0)
        source = handoff.node if handoff else None
        decision = self.router().choose_decode([self._state(m, 0, source=source) for m in members], request)
        member = next(m for m in members if m.node_id == decision.worker)
        job.worker = member.node_id
        return member, job.request(tokens=tokens, max_tokens=job.max_tokens - 1, pull=True, source=handoff)

    @staticmethod
    def _decoding(job: Job, event: TokenEvent) -> None:
        if event.stats is not None:
            job.timing.decode_cached_tokens = event.stats.cached_tokens

    # Workers as the router sees them ------------------------------------------------------------

    def can_serve(self) -> bool:
        """Whether any worker that can take a prompt is a member (the model is being served)."""
        return bool(self._workers(("prefill", "worker")))

    def _workers(self, roles: tuple[str, ...]) -> list[MemberInfo]:
        """The live workers of these roles that serve an API (what the front may send work to)."""
        return [m for m in self.conductor.members.alive() if m.role in roles and m.url]

    def _candidates(self, roles: tuple[str, ...], skip: AbstractSet[str] = frozenset()) -> list[MemberInfo]:
        """Workers of ``roles`` not failed or full a moment ago, and not in ``skip``."""
        now = time.monotonic()
        return [
            m
            for m in self._workers(roles)
            if m.node_id not in skip
            and self.loads[m.node_id].failed_until <= now
            and self.loads[m.node_id].busy_until <= now
        ]

    def _state(self, member: MemberInfo, cached: int, sessions: int = 0, source: str | None = None) -> WorkerState:
        """``member`` as the router sees it; ``source``: the node it would pull the prefix from."""
        load, perf = self.loads[member.node_id], member.perf
        link = self.links.model(member.node_id, source)
        return WorkerState(
            member.node_id,
            cached,
            load.queued_tokens,
            load.running,
            self.paces.model(member.node_id, _fitted(member)),
            perf.decode_step_s,
            load_bytes_per_s=link.bytes_per_s,
            pull_latency_s=link.latency_s,
            sessions=sessions,
        )


def _fitted(member: MemberInfo) -> PrefillModel:
    """The prefill timings ``member`` measured when it started."""
    return PrefillModel(member.perf.prefill_a, member.perf.prefill_b, member.perf.prefill_q)
