"""The front door: OpenAI-compatible ``/v1/completions`` and ``/v1/models`` on the conductor.

A request is tokenized, its block chain looked up in the placement index, and routed by the routing
policy (Mooncake's Algorithm 1 by default) over the live workers, with early rejection (429) when
the predicted TTFT or TBT misses the SLO. With separate prefill and decode workers, the prefill worker
computes the prompt and writes its blocks through to its node; the decode worker, told where they
are, pulls them over the transfer engine and streams the rest. A worker that fails before its first
token is skipped and the request tried on another; one that fails mid-stream ends the stream with an
error (never a hang).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tiercake.blocks import block_keys
from tiercake.config import TiercakeConfig
from tiercake.policies import PrefillModel, RouteDecision, RouteRequest, WorkerState, create_router

from .access_stats import LiveAccessStats
from .service import Conductor

log = logging.getLogger(__name__)

TENANT_HEADER = "X-Tiercake-Tenant"
OPEN_PATHS = ("/v1/completions", "/v1/models")  # API keys, not control tokens


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's completion request; fields we do not use (``n``, ``logprobs``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    prompt: str | list[int] = Field(description="text, or token ids (bytes for the reference model)")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None


class PromptRequest(BaseModel):
    """A prompt whose cached prefix to look up, pin or unpin."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int]
    tenant: str = Field(default="default", min_length=1, pattern=r"^[^/]+$")
    ttl: int | None = Field(default=None, ge=1, description="pin: seconds; default until unpinned")


class FlushRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: list[str] | None = Field(default=None, description="only these tiers, pushed down; default: all")


class EvictionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str
    params: dict = Field(default_factory=dict)


class PolicyRequest(BaseModel):
    """Switch policies at run time, cluster-wide (durable: a new leader keeps them)."""

    model_config = ConfigDict(extra="forbid")

    router: str | None = None
    router_params: dict = Field(default_factory=dict)
    eviction: dict[str, EvictionSpec] | None = Field(default=None, description="tier name -> policy")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


@dataclass
class _WorkerLoad:
    queued_tokens: int = 0
    running: int = 0
    load_bytes_per_s: float = 2e9
    failed_until: float = 0.0


@dataclass
class Timing:
    """Where a request's time went, as the front saw it."""

    started: float = field(default_factory=time.perf_counter)
    route_s: float = 0.0  # routing, the index lookup included
    lookup_s: float = 0.0  # the index lookup the front made while routing
    ttft_s: float = 0.0
    stats: dict = field(default_factory=dict)


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

    async def record(self, keys: list[bytes], tokens: list[int], max_tokens: int, tenant: str) -> None:
        from tiercake.blocks import chain_key
        from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord

        partial = len(tokens) - len(keys) * self.block_size
        if partial:  # the trailing partial block: keyed here by its tokens, so equal prompts get equal ids
            keys = keys + [bytes(chain_key(keys[-1] if keys else b"partial", tokens[-partial:]))]
        ids = [self.ids.setdefault(k, len(self.ids) + 1) for k in keys]
        scale = TRACE_BLOCK_TOKENS / self.block_size
        record = TraceRecord(timestamp=int((time.monotonic() - self.started) * 1000),
                             input_length=TRACE_BLOCK_TOKENS * (len(ids) - 1) + max(1, round(
                                 (partial or self.block_size) * scale)),
                             output_length=max_tokens, hash_ids=tuple(ids), tenant=tenant)
        line = record.model_dump_json(exclude_none=True) + "\n"
        async with self._lock:  # in arrival order, off the event loop
            await asyncio.to_thread(self._append, line)

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)


class Frontend:
    def __init__(self, conductor: Conductor, config: TiercakeConfig) -> None:
        self.conductor = conductor
        self.config = config
        self.serving = config.serving
        self.router = create_router(self.serving.router, self.serving.router_params)
        self.loads: dict[str, _WorkerLoad] = defaultdict(_WorkerLoad)
        self.layout = self.serving.layout()
        self.api_keys = self.serving.all_api_keys()
        self._http: aiohttp.ClientSession | None = None
        self.rejected = 0
        self.served = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_by_source: dict[str, int] = defaultdict(int)  # tokens, by where their blocks came from
        self.kv_bytes_moved = 0  # pulled into workers' gpu tiers and written through to nodes
        self.load_overhead_s = 0.0  # loading time beyond copying the bytes at the worker's memcpy rate
        self._router_spec = {"name": self.serving.router, "params": self.serving.router_params}
        window = self.serving.reuse_window_blocks
        self.access = LiveAccessStats(window) if window else None
        self.bind_metrics(CollectorRegistry())  # the app binds its own registry (build_app)
        self.recorder = TraceRecorder(self.serving.record_trace, self.layout.block_size) \
            if self.serving.record_trace else None

    def bind_metrics(self, registry) -> None:
        """Serving metrics on the conductor's /metrics."""
        self.m_requests = Counter("tiercake_completions", "completion requests by outcome", ["outcome"],
                                  registry=registry)
        self.m_ttft = Histogram("tiercake_ttft_seconds", "time to first token at the front",
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)
        self.m_phase = Histogram("tiercake_ttft_phase_seconds", "where the time to first token went",
                                 ["phase"], buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
                                 registry=registry)
        self.m_overhead = Histogram("tiercake_load_overhead_seconds", "time loading a prefix beyond copying its "
                                    "bytes at the worker's measured memcpy rate (completion overhead)",
                                    buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 1), registry=registry)
        self.m_prompt = Counter("tiercake_prompt_tokens", "prompt tokens served", registry=registry)
        self.m_cached = Counter("tiercake_cached_prompt_tokens", "prompt tokens whose KV was reused, by source tier",
                                ["source"], registry=registry)
        self.m_load = Histogram("tiercake_prefix_load_seconds", "time pulling a prefix into a worker, by the source "
                                "tier that held most of it", ["tier"],
                                buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=registry)
        self.m_load_bytes = Counter("tiercake_prefix_load_bytes", "KV bytes pulled into workers, by source tier",
                                    ["tier"], registry=registry)
        if self.access is not None:
            self.access.bind_metrics(registry)

    def _current_router(self):
        """The router the cluster settings name (switched at run time through ``/v1/policy``)."""
        spec = self.conductor.settings.get("router")
        if spec is not None and spec != self._router_spec:
            self.router = create_router(spec["name"], spec.get("params"))
            self._router_spec = spec
        return self.router

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self.access is not None:
            self.access.close()

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60))
        return self._http

    # Who is asking ------------------------------------------------------------------------------

    def tenant_of(self, request: web.Request) -> str:
        keys = self.api_keys
        if keys:
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else ""
            tenant = keys.get(given)
            if tenant is None:
                raise ApiError(401, "unknown API key: send Authorization: Bearer <key>", "authentication_error",
                               "invalid_api_key")
            return tenant
        tenant = request.headers.get(TENANT_HEADER, "default")
        if not tenant or "/" in tenant or len(tenant) > 128:
            raise ApiError(400, f"{TENANT_HEADER} must be 1-128 characters without '/'")
        return tenant

    def namespace_of(self, tenant: str) -> tuple[str, str]:
        """(index tenant, hashing salt): tenants share nothing unless the namespace is shared."""
        return ("shared", "") if self.serving.shared_namespace else (tenant, tenant)

    # Routing ------------------------------------------------------------------------------------

    def _candidates(self, roles: tuple[str, ...]) -> list:
        now = time.monotonic()
        return [m for m in self.conductor.members.alive() if m.role in roles and m.url
                and self.loads[m.node_id].failed_until <= now]

    def _state(self, member, cached: int) -> WorkerState:
        load = self.loads[member.node_id]
        perf = member.perf
        return WorkerState(member.node_id, cached, load.queued_tokens, load.running, PrefillModel.from_perf(perf),
                           perf.get("decode_step_s", 0.005), load.load_bytes_per_s)

    def route(self, tokens: list[int], tenant: str, roles: tuple[str, ...],
              timing: Timing | None = None) -> tuple[object, RouteDecision, dict | None]:
        """(the worker, the router's decision, where to pull the prefix from when it says pull: the
        node holding the longest prefix, so the worker need not ask the index again)."""
        index_tenant, salt = self.namespace_of(tenant)
        members = self._candidates(roles)
        if not members:
            raise ApiError(503, f"no live {'/'.join(roles)} worker", "server_error", "no_worker")
        keys = block_keys(self.config.serving_namespace(salt), tokens)
        started = time.perf_counter()
        found = self.conductor.lookup(index_tenant, keys)
        if timing is not None:
            timing.lookup_s += time.perf_counter() - started
        nodes = {m.node_id for m in self.conductor.members.alive("node")}
        holders = [(p.length, n) for n, p in found.items() if n in nodes]
        best, best_node = max(holders, default=(0, None))
        states = [self._state(m, found[m.node_id].length if m.node_id in found else 0) for m in members]
        decision = self._current_router().choose(states, RouteRequest(len(tokens), self.layout.block_size,
                                                           self.layout.nbytes, best))
        slo_ttft, slo_tbt = self.serving.slo_ttft_s, self.serving.slo_tbt_s
        if slo_ttft is not None and decision.ttft_s > slo_ttft:
            self.rejected += 1
            raise ApiError(429, f"predicted time to first token {decision.ttft_s:.3f} s exceeds the SLO of "
                           f"{slo_ttft} s; retry later", "rate_limit_error", "slo_ttft",
                           headers={"Retry-After": "1"})
        if slo_tbt is not None and decision.tbt_s > slo_tbt:
            self.rejected += 1
            raise ApiError(429, f"predicted time between tokens {decision.tbt_s:.4f} s exceeds the SLO of "
                           f"{slo_tbt} s; retry later", "rate_limit_error", "slo_tbt", headers={"Retry-After": "1"})
        member = next(m for m in members if m.node_id == decision.worker)
        source = None
        if decision.pull and best_node is not None:
            tiers = found[best_node].tiers
            source = {"node": best_node, "blocks": best, "tier": max(tiers, key=tiers.get) if tiers else "?"}
        return member, decision, source

    # Talking to workers -------------------------------------------------------------------------

    async def _stream(self, member, body: dict):
        """Events from a worker's /generate; raises ``ConnectionError`` before its first event when
        the worker cannot be reached or refuses (so the caller may try another)."""
        load = self.loads[member.node_id]
        try:
            resp = await self.http().post(member.url + "/generate", json=body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            load.failed_until = time.monotonic() + 2.0
            raise ConnectionError(f"worker {member.node_id}: {exc}") from exc
        async with resp:
            if resp.status >= 400:
                data = await resp.json(content_type=None)
                if resp.status < 500:
                    raise ApiError(resp.status, data.get("error", "refused"))
                load.failed_until = time.monotonic() + 2.0
                raise ConnectionError(f"worker {member.node_id}: {data.get('error')}")
            try:
                async for line in resp.content:
                    if line.strip():
                        yield json.loads(line)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                load.failed_until = time.monotonic() + 2.0
                raise RuntimeError(f"worker {member.node_id} failed mid-stream: {exc}") from exc

    async def generate(self, tokens: list[int], req: CompletionRequest, tenant: str, timing: Timing):
        """Token events for one request, across prefill and decode workers, with retries."""
        index_tenant, salt = self.namespace_of(tenant)
        body = {"tokens": tokens, "max_tokens": req.max_tokens, "temperature": req.temperature,
                "tenant": index_tenant, "salt": salt, "seed": req.seed}
        roles_split = (self.serving.disaggregated and self._candidates(("prefill",))
                       and self._candidates(("decode",)))
        first_roles = ("prefill",) if roles_split else ("worker", "prefill", "decode")
        errors = []
        for _ in range(3):
            started = time.perf_counter()
            member, decision, source = self.route(tokens, tenant, first_roles, timing)
            timing.route_s += time.perf_counter() - started
            load = self.loads[member.node_id]
            load.queued_tokens += len(tokens)
            load.running += 1
            emitted = 0
            try:
                prefill_body = {**body, "pull": decision.pull, "source": source}
                if roles_split:
                    prefill_body["max_tokens"] = 1
                async for event in self._stream(member, prefill_body):
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    if event.get("stats"):
                        load.queued_tokens -= len(tokens)
                        timing.stats = event["stats"]
                        self._count(len(tokens), event["stats"])
                        timing.ttft_s = time.perf_counter() - timing.started
                        self.m_ttft.observe(timing.ttft_s)
                        self._observe_phases(timing)
                        self._note_bandwidth(load, event["stats"])
                    emitted += 1
                    done = event["finish_reason"] is not None and not (roles_split and req.max_tokens > 1)
                    yield event["token"], "length" if done else None
                    if done:
                        return
                if not emitted:
                    raise ConnectionError(f"worker {member.node_id} answered with no token")
                break
            except ConnectionError as exc:
                if emitted:
                    raise RuntimeError(str(exc)) from exc
                errors.append(str(exc))
                log.warning("front: %s; trying another worker", exc)
            finally:
                if not timing.stats:
                    load.queued_tokens -= len(tokens)
                load.running -= 1
        else:
            raise ApiError(503, "every worker tried failed: " + "; ".join(errors), "server_error", "worker_failed")
        if not roles_split:
            raise RuntimeError("the worker ended the stream before its last token")
        # disaggregated: the decode worker takes over, pulling the prompt's blocks from the node the
        # prefill worker wrote them to
        first = tokens + [event["token"]]
        written = timing.stats.get("written_to")
        decode = {**body, "tokens": first, "max_tokens": req.max_tokens - 1, "pull": True,
                  "source": written}
        for attempt in range(3):
            members = self._candidates(("decode",))
            if not members:
                raise ApiError(503, "no live decode worker", "server_error", "no_worker")
            member = min(members, key=lambda m: (self.loads[m.node_id].running, m.node_id))
            load = self.loads[member.node_id]
            load.running += 1
            emitted = 0
            try:
                async for event in self._stream(member, decode):
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    if event.get("stats"):
                        timing.stats["decode_cached_tokens"] = event["stats"]["cached_tokens"]
                    emitted += 1
                    yield event["token"], event["finish_reason"]
                    if event["finish_reason"] is not None:
                        return
                raise ConnectionError(f"decode worker {member.node_id} ended the stream early")
            except ConnectionError as exc:
                if emitted or attempt == 2:
                    raise RuntimeError(str(exc)) from exc
                log.warning("front: %s; trying another decode worker", exc)
            finally:
                load.running -= 1

    def _observe_phases(self, timing: Timing) -> None:
        """TTFT = routing + lookup (the front's and the worker's, if it asked again) + load + compute +
        the rest (queue in the worker, HTTP hops)."""
        stats = timing.stats
        route = timing.route_s - timing.lookup_s
        lookup = timing.lookup_s + stats.get("lookup_s", 0.0)
        known = route + lookup + stats.get("load_s", 0.0) + stats.get("compute_s", 0.0)
        for phase, seconds in (("route", route), ("lookup", lookup),
                               ("load", stats.get("load_s", 0.0)), ("compute", stats.get("compute_s", 0.0)),
                               ("queue_and_transport", max(0.0, timing.ttft_s - known))):
            self.m_phase.labels(phase).observe(seconds)

    def _count(self, prompt_tokens: int, stats: dict) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += stats.get("cached_tokens", 0)
        written = (stats.get("written_to") or {}).get("blocks", 0) - stats.get("cached_tokens", 0) // self.layout.block_size
        moved = stats.get("load_bytes", 0) + max(0, written) * self.layout.nbytes
        self.kv_bytes_moved += moved
        if stats.get("load_bytes") and stats.get("load_tier"):
            self.m_load.labels(stats["load_tier"]).observe(stats.get("load_s", 0.0))
            self.m_load_bytes.labels(stats["load_tier"]).inc(stats["load_bytes"])
        copy_rate = stats.get("copy_bytes_per_s")
        if stats.get("load_bytes") and copy_rate:
            overhead = max(0.0, stats.get("load_s", 0.0) - stats["load_bytes"] / copy_rate)
            self.load_overhead_s += overhead
            self.m_overhead.observe(overhead)
        self.m_prompt.inc(prompt_tokens)
        for source, blocks in stats.get("sources", {}).items():
            tier = source.rsplit(":", 1)[-1]
            self.cached_by_source[tier] += blocks * self.layout.block_size
            self.m_cached.labels(tier).inc(blocks * self.layout.block_size)

    @staticmethod
    def _note_bandwidth(load: _WorkerLoad, stats: dict) -> None:
        if stats.get("load_bytes") and stats.get("load_s"):
            load.load_bytes_per_s = 0.8 * load.load_bytes_per_s + 0.2 * stats["load_bytes"] / stats["load_s"]

    # HTTP ---------------------------------------------------------------------------------------

    def add_routes(self, app: web.Application, public: bool = True, control: bool = True) -> None:
        """``public``: the OpenAI-compatible API; ``control``: the operator's endpoints (cluster view,
        prefix lookup, pins, flush, policy), which belong with the control API when the two are apart."""
        if public:
            app.add_routes([web.post("/v1/completions", self.completions), web.get("/v1/models", self.models)])
        if control:
            app.add_routes([
                web.get("/v1/cluster", self.cluster), web.post("/v1/prefix", self.prefix),
                web.post("/v1/prefix/pin", self.pin), web.post("/v1/prefix/unpin", self.unpin),
                web.post("/v1/flush", self.flush), web.post("/v1/policy", self.policy),
            ])
            app.on_cleanup.append(lambda _: self.close())

    # Control ------------------------------------------------------------------------------------

    async def cluster(self, _: web.Request) -> web.Response:
        """Nodes and workers with their tiers (capacity, use, blocks, hits), loads, and the serving
        hit ratio (prompt tokens whose KV was reused), by source."""
        members = []
        for m in self.conductor.members.alive():
            stats = self.conductor.member_stats.get(m.node_id, {})
            entry = {"id": m.node_id, "role": m.role, "address": f"{m.host}:{m.port}", "url": m.url,
                     "tiers": stats.get("tiers", {t: {"capacity_bytes": c} for t, c in m.tiers.items()}),
                     "indexed_bytes": {t: self.conductor.index.used.get((m.node_id, t), 0) for t in m.tiers}}
            if m.role != "node":
                load = self.loads[m.node_id]
                entry["load"] = {"queued_tokens": load.queued_tokens, "running": load.running}
            members.append(entry)
        return web.json_response({
            "members": members, "router": self._router_spec, "settings": self.conductor.settings,
            "serving": {"requests": self.served, "rejected": self.rejected, "prompt_tokens": self.prompt_tokens,
                        "cached_tokens": self.cached_tokens,
                        "hit_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                        "cached_tokens_by_source": dict(self.cached_by_source)},
            "index": {"replicas": len(self.conductor.index), "pins": len(self.conductor.pins)},
            "metadata": self._metadata_costs(),
            "reuse": await asyncio.to_thread(self.access.summary) if self.access is not None else None,
        })

    def _metadata_costs(self) -> dict:
        """Metadata work per request and per KV byte moved: index lookups and durable placement
        changes (with their key and value bytes), against the requests served and the KV moved."""
        stats = self.conductor.index.stats
        requests = max(1, self.served + self.rejected)
        ops = stats.ops + stats.lookups
        return {"lookups": stats.lookups, "durable_ops": stats.ops, "durable_bytes": stats.bytes,
                "ops_per_request": ops / requests, "bytes_per_request": stats.bytes / requests,
                "kv_bytes_moved": self.kv_bytes_moved, "block_bytes": self.layout.nbytes,
                "metadata_bytes_per_kv_byte": stats.bytes / self.kv_bytes_moved if self.kv_bytes_moved else 0.0,
                "load_overhead_s": self.load_overhead_s}

    async def _prompt_keys(self, request: web.Request) -> tuple[PromptRequest, str, list[bytes]]:
        try:
            body = PromptRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            raise ApiError(400, f"invalid body: {exc.errors()[0]['msg']}") from None
        tokens = list(body.prompt.encode()) if isinstance(body.prompt, str) else body.prompt
        index_tenant, salt = self.namespace_of(body.tenant)
        return body, index_tenant, block_keys(self.config.serving_namespace(salt), tokens)

    async def prefix(self, request: web.Request) -> web.Response:
        try:
            _, tenant, keys = await self._prompt_keys(request)
        except ApiError as exc:
            return exc.response()
        found = self.conductor.index.lookup(tenant, keys)  # an operator's look: no access counted
        bs = self.layout.block_size
        return web.json_response({"blocks": len(keys), "block_size": bs, "holders": {
            n: {"tokens": p.length * bs, "blocks": p.length, "tiers": p.tiers} for n, p in found.items()}})

    async def pin(self, request: web.Request) -> web.Response:
        try:
            body, tenant, keys = await self._prompt_keys(request)
            if not keys:
                raise ApiError(400, "the prompt has no full block to pin")
        except ApiError as exc:
            return exc.response()
        self.conductor.require_leader(await self.conductor.leader())
        await self.conductor.pin(tenant, keys, body.ttl)
        return web.json_response({"pinned_blocks": len(keys)})

    async def unpin(self, request: web.Request) -> web.Response:
        try:
            _, tenant, keys = await self._prompt_keys(request)
        except ApiError as exc:
            return exc.response()
        self.conductor.require_leader(await self.conductor.leader())
        if keys:
            await self.conductor.unpin(tenant, keys)
        return web.json_response({"unpinned_blocks": len(keys)})

    async def flush(self, request: web.Request) -> web.Response:
        try:
            body = FlushRequest.model_validate_json(await request.read() or b"{}")
        except ValidationError as exc:
            return ApiError(400, f"invalid body: {exc.errors()[0]['msg']}").response()
        self.conductor.require_leader(await self.conductor.leader())
        return web.json_response({"flush_epoch": await self.conductor.flush(body.tiers)})

    async def policy(self, request: web.Request) -> web.Response:
        from tiercake.policies import create_eviction

        try:
            body = PolicyRequest.model_validate_json(await request.read())
            if body.router is not None:
                create_router(body.router, body.router_params)  # refuse what would not build
            for tier, spec in (body.eviction or {}).items():
                create_eviction(spec.policy, spec.params)
        except ValidationError as exc:
            return ApiError(400, f"invalid body: {exc.errors()[0]['msg']}").response()
        except (LookupError, TypeError, ValueError) as exc:
            return ApiError(400, str(exc)).response()
        self.conductor.require_leader(await self.conductor.leader())
        if body.router is not None:
            await self.conductor.put_setting("router", {"name": body.router, "params": body.router_params})
        if body.eviction is not None:
            current = dict(self.conductor.settings.get("eviction", {}))
            current.update({tier: spec.model_dump() for tier, spec in body.eviction.items()})
            await self.conductor.put_setting("eviction", current)
        return web.json_response({"router": self.conductor.settings.get("router", self._router_spec),
                                  "eviction": self.conductor.settings.get("eviction", {})})

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.tenant_of(request)
        except ApiError as exc:
            return exc.response()
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model_id, "object": "model", "created": 0, "owned_by": "tiercake",
             "max_model_len": self.serving.max_context}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            tenant = self.tenant_of(request)
            try:
                req = CompletionRequest.model_validate_json(await request.read())
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise ApiError(400, f"invalid request: {where}: {first['msg']}") from None
            if req.model != self.config.model_id:
                raise ApiError(404, f"model {req.model!r} does not exist; this cluster serves "
                               f"{self.config.model_id!r}", code="model_not_found")
            tokens = list(req.prompt.encode("utf-8")) if isinstance(req.prompt, str) else req.prompt
            if not tokens:
                raise ApiError(400, "the prompt is empty")
            vocab = self.serving.model.vocab
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"token ids must lie in [0, {vocab})")
            if len(tokens) + req.max_tokens > self.serving.max_context:
                raise ApiError(400, f"{len(tokens)} prompt tokens + max_tokens {req.max_tokens} exceed the "
                               f"context length of {self.serving.max_context}", code="context_length_exceeded")
            timing = Timing()
            if self.recorder is not None or self.access is not None:
                index_tenant, salt = self.namespace_of(tenant)
                keys = block_keys(self.config.serving_namespace(salt), tokens)
                if self.access is not None:
                    self.access.observe(keys, time.monotonic())
                if self.recorder is not None:
                    await self.recorder.record(keys, tokens, req.max_tokens, index_tenant)
            events = self.generate(tokens, req, tenant, timing)
            # the first token decides the status: errors before it are plain HTTP errors
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise ApiError(500, "the worker produced nothing", "server_error") from None
            except RuntimeError as exc:
                raise ApiError(502, str(exc), "server_error") from None
        except ApiError as exc:
            self.m_requests.labels(str(exc.status)).inc()
            return exc.response()
        self.m_requests.labels("ok").inc()
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return await self._sse(request, rid, req, tokens, first, events, timing)
        return await self._whole(rid, req, tokens, first, events, timing)

    def _usage(self, prompt: list[int], generated: int, timing: Timing) -> dict:
        return {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated,
                "prompt_tokens_details": {"cached_tokens": timing.stats.get("cached_tokens", 0)},
                "tiercake": {"ttft_s": round(timing.ttft_s, 6), "route_s": round(timing.route_s - timing.lookup_s, 6),
                             "sources": timing.stats.get("sources", {}),
                             "lookup_s": round(timing.lookup_s + timing.stats.get("lookup_s", 0.0), 6),
                             "load_s": timing.stats.get("load_s", 0.0),
                             "load_tier": timing.stats.get("load_tier"),
                             "compute_s": timing.stats.get("compute_s", 0.0),
                             "decode_cached_tokens": timing.stats.get("decode_cached_tokens")}}

    def _choice(self, text: str, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    async def _whole(self, rid, req, prompt, first, events, timing) -> web.Response:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, generated, finish = decoder.decode(bytes([first[0] % 256])), 1, first[1]
        try:
            async for token, finish in events:
                text += decoder.decode(bytes([token % 256]))
                generated += 1
        except RuntimeError as exc:
            return ApiError(502, f"{exc} (after {generated} tokens)", "server_error").response()
        finally:
            await events.aclose()  # a client gone mid-request: the worker's stream closes too
        text += decoder.decode(b"", final=True)
        self.served += 1
        return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                  "model": req.model, "choices": [self._choice(text, finish or "length")],
                                  "usage": self._usage(prompt, generated, timing)})

    async def _sse(self, request, rid, req, prompt, first, events, timing) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        created = int(time.time())

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [self._choice(text, finish)]}

        generated = 1
        try:
            await send(chunk(decoder.decode(bytes([first[0] % 256])), first[1]))
            async for token, finish in events:
                generated += 1
                await send(chunk(decoder.decode(bytes([token % 256])), finish))
            if req.stream_options and req.stream_options.include_usage:
                await send({**chunk("", None), "choices": [], "usage": self._usage(prompt, generated, timing)})
            await send("[DONE]")
            self.served += 1
        except RuntimeError as exc:  # a worker died mid-stream: say so, end the stream
            await send({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            await send("[DONE]")
        except (ConnectionError, asyncio.CancelledError):
            # the client went away: closing the generator closes the worker stream, which frees the
            # sequence on the worker
            await events.aclose()
            raise
        await response.write_eof()
        return response
