"""The conductor's HTTP API (aiohttp): placement control, membership, health, readiness, metrics.

Bodies are pydantic models; a malformed body is a 400 with the validation message, an oversized
one a 413. Every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` when tokens are
configured. Writes go to the leader: a follower answers 503 with the leader's URL in the body and in
the ``X-Tiercake-Leader`` header, so clients move on by themselves.
"""

from __future__ import annotations

import hmac
import json

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tiercake.config import TiercakeConfig, reachable_host

from .frontend import OPEN_PATHS

PROBE_PATHS = ("/health", "/ready")  # kubelet probes carry no token
from .membership import MemberInfo
from .metadata import FencedError, MetadataUnavailableError
from .service import Conductor, LeaseExpiredError, NoRoomError, NotLeaderError, PlacementError

MAX_BODY = 8 << 20
MAX_KEYS = 65536


NAME = Field(min_length=1, pattern=r"^[^/]+$")  # tenants, nodes, tiers: no '/' (they are key parts)


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = NAME
    keys: list[str] = Field(max_length=MAX_KEYS, description="block keys of one chain, hex, in order")


class ReplicaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = NAME
    node: str = NAME
    tier: str = NAME


class BlockSize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = Field(pattern=r"^([0-9a-f]{2}){1,64}$")
    size: int = Field(ge=0)


class CommitRequest(ReplicaRequest):
    """Replicas of ``node``; they are attached to the node's member lease (they go when it dies)."""

    blocks: list[BlockSize] = Field(min_length=1, max_length=MAX_KEYS)


class BeginRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = NAME
    tier: str = NAME
    blocks: list[BlockSize] = Field(min_length=1, max_length=MAX_KEYS)
    local: str | None = Field(default=None, description="the writer's node, for the local_first strategy")


class RemoveRequest(ReplicaRequest):
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = NAME
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)
    ttl: int | None = Field(default=None, ge=1, description="seconds; default: until unpinned")


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    member: MemberInfo
    ttl: int = Field(default=5, ge=1, le=3600, description="seconds without a keep-alive before it is dead")


class HeatHit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = NAME
    key: str
    count: int = Field(ge=1, le=1_000_000)


class HeatRequest(BaseModel):
    """Accesses a follower conductor counted in its lookups (the leader decides replication)."""

    model_config = ConfigDict(extra="forbid")

    hits: list[HeatHit] = Field(min_length=1, max_length=MAX_KEYS)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str = NAME
    lease: int = Field(gt=0)
    stats: dict | None = Field(default=None, description="the member's store statistics (cluster view)")


def _keys(hexes: list[str]) -> list[bytes]:
    try:
        return [bytes.fromhex(h) for h in hexes]
    except ValueError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"keys must be hex: {exc}"}),
                                 content_type="application/json") from None


def _error(status: type[web.HTTPException], message: str, **extra) -> web.HTTPException:
    return status(text=json.dumps({"error": message, **extra}), content_type="application/json")


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_BODY, actual_size=request.content_length or 0,
            text=json.dumps({"error": f"body over {MAX_BODY} bytes"}), content_type="application/json",
        ) from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _error(web.HTTPBadRequest, "invalid body", details=json.loads(exc.json(include_url=False))) from None


class _MemberTierCollector:
    """Per member and tier, from the statistics members send with their keep-alives: blocks, bytes
    used, hits, evictions, and how long evicted blocks had stayed (a histogram)."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        from tiercake.tiers.store import RESIDENCY_BUCKETS

        labels = ["member", "tier"]
        used = GaugeMetricFamily("tiercake_tier_used_bytes", "bytes held in each member's tiers", labels=labels)
        blocks = GaugeMetricFamily("tiercake_tier_blocks", "blocks held in each member's tiers", labels=labels)
        hits = CounterMetricFamily("tiercake_tier_hits", "reads served by each member's tiers", labels=labels)
        residency = HistogramMetricFamily("tiercake_block_residency_seconds",
                                          "how long blocks stayed in a tier before eviction", labels=labels)
        for member, stats in list(self.conductor.member_stats.items()):
            for tier, t in stats.get("tiers", {}).items():
                key = [member, tier]
                used.add_metric(key, t.get("used_bytes", 0))
                blocks.add_metric(key, t.get("blocks", 0))
                hits.add_metric(key, t.get("hits", 0))
                counts = t.get("residency")
                if counts and len(counts) == len(RESIDENCY_BUCKETS) + 1:
                    cumulative, running = [], 0
                    for bound, count in zip([*map(str, RESIDENCY_BUCKETS), "+Inf"], counts):
                        running += count
                        cumulative.append((bound, running))
                    residency.add_metric(key, cumulative, t.get("residency_sum_s", 0.0))
        yield from (used, blocks, hits, residency)


def build_app(conductor: Conductor, tokens: list[str] | None = None, frontend=None,
              with_public: bool = True) -> web.Application:
    """The control API; with ``frontend`` (a ``Frontend``), its control endpoints and, unless
    ``with_public`` is False (the public API has its own port), the OpenAI-compatible API beside it."""
    registry = CollectorRegistry()
    index_size = Gauge("tiercake_index_replicas", "replicas in the placement index", registry=registry)
    ops = Counter("tiercake_placement_ops", "placement changes made durable (rate: ops per second)",
                  registry=registry)
    batch_ops = Histogram("tiercake_group_commit_batch_ops", "placement changes per group-commit batch",
                          buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048), registry=registry)
    commit_seconds = Histogram("tiercake_metadata_commit_seconds", "time to make one batch durable in the backend",
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5),
                               registry=registry)
    leader = Gauge("tiercake_is_leader", "1 when this conductor leads", registry=registry)
    terms = Gauge("tiercake_leader_terms", "terms this conductor has won", registry=registry)
    changes = Gauge("tiercake_leader_changes", "leader changes this conductor has seen", registry=registry)
    members_gauge = Gauge("tiercake_members", "live members", ["role"], registry=registry)
    pins_gauge = Gauge("tiercake_pins", "pinned blocks", registry=registry)
    requests = Counter("tiercake_api_requests", "API requests", ["endpoint"], registry=registry)
    lookup_seconds = Histogram("tiercake_lookup_seconds", "placement lookup time in the conductor",
                               buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3), registry=registry)

    def on_batch(n: int, seconds: float) -> None:
        ops.inc(n)
        batch_ops.observe(n)
        commit_seconds.observe(seconds)

    conductor.index.stats.on_batch = on_batch
    registry.register(_MemberTierCollector(conductor))
    if frontend is not None:
        frontend.bind_metrics(registry)

    @web.middleware
    async def auth(request: web.Request, handler):
        if tokens and request.path not in PROBE_PATHS and not (frontend and with_public and request.path in OPEN_PATHS):
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else ""
            if not any(hmac.compare_digest(given.encode(), t.encode()) for t in tokens):
                raise _error(web.HTTPUnauthorized, "a valid bearer token is required")
        requests.labels(request.match_info.route.resource.canonical if request.match_info.route.resource
                        else "unmatched").inc()
        try:
            return await handler(request)
        except NotLeaderError as exc:
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": str(exc), "leader": exc.leader}), content_type="application/json",
                headers={"X-Tiercake-Leader": exc.leader or ""},
            ) from None
        except MetadataUnavailableError as exc:
            raise _error(web.HTTPServiceUnavailable, f"{exc}; retry", retryable=True) from None
        except FencedError as exc:  # deposed while the write was in flight: the new leader takes it
            raise _error(web.HTTPServiceUnavailable, f"{exc}; retry at the leader", retryable=True) from None
        except LeaseExpiredError as exc:
            raise _error(web.HTTPNotFound, str(exc)) from None
        except NoRoomError as exc:
            raise _error(web.HTTPInsufficientStorage, str(exc)) from None
        except PlacementError as exc:
            raise _error(web.HTTPConflict, str(exc)) from None

    async def lookup(request: web.Request) -> web.Response:
        body = await _body(request, LookupRequest)
        keys = _keys(body.keys)
        with lookup_seconds.time():
            found = conductor.lookup(body.tenant, keys)
        return web.json_response({"nodes": {n: {"length": p.length, "tiers": p.tiers} for n, p in found.items()}})

    async def begin(request: web.Request) -> web.Response:
        body = await _body(request, BeginRequest)
        conductor.require_leader(await conductor.leader())
        keys = _keys([b.key for b in body.blocks])
        targets = conductor.begin_put(body.tenant, keys, [b.size for b in body.blocks], body.tier, body.local)
        return web.json_response({"targets": {k.hex(): nodes for k, nodes in targets.items()}})

    async def commit(request: web.Request) -> web.Response:
        body = await _body(request, CommitRequest)
        conductor.require_leader(await conductor.leader())
        keys = _keys([b.key for b in body.blocks])
        await conductor.commit_put(body.tenant, keys, body.node, body.tier, [b.size for b in body.blocks])
        return web.json_response({"committed": len(keys)})

    async def revoke(request: web.Request) -> web.Response:
        body = await _body(request, RemoveRequest)
        conductor.require_leader(await conductor.leader())
        conductor.revoke_put(body.tenant, _keys(body.keys), body.node, body.tier)
        return web.json_response({"revoked": len(body.keys)})

    async def report(request: web.Request) -> web.Response:
        """A node declares blocks it holds (spilled, promoted, or its SSD tier's after a restart)."""
        body = await _body(request, CommitRequest)
        conductor.require_leader(await conductor.leader())
        keys = _keys([b.key for b in body.blocks])
        new = await conductor.report(body.tenant, keys, body.node, body.tier, [b.size for b in body.blocks])
        return web.json_response({"reported": len(keys), "new": new})

    async def remove(request: web.Request) -> web.Response:
        body = await _body(request, RemoveRequest)
        conductor.require_leader(await conductor.leader())
        removed, unknown = await conductor.remove(body.tenant, _keys(body.keys), body.node, body.tier)
        return web.json_response({"removed": removed, "unknown": unknown})

    async def pin(request: web.Request) -> web.Response:
        body = await _body(request, PinRequest)
        conductor.require_leader(await conductor.leader())
        await conductor.pin(body.tenant, _keys(body.keys), body.ttl)
        return web.json_response({"pinned": len(body.keys)})

    async def unpin(request: web.Request) -> web.Response:
        body = await _body(request, PinRequest)
        conductor.require_leader(await conductor.leader())
        await conductor.unpin(body.tenant, _keys(body.keys))
        return web.json_response({"unpinned": len(body.keys)})

    async def heat(request: web.Request) -> web.Response:
        body = await _body(request, HeatRequest)
        conductor.require_leader(await conductor.leader())
        keys = _keys([h.key for h in body.hits])
        conductor.add_heat([((h.tenant, key), h.count) for h, key in zip(body.hits, keys)])
        return web.json_response({"accepted": len(keys)})

    async def register(request: web.Request) -> web.Response:
        body = await _body(request, RegisterRequest)
        return web.json_response({"lease": await conductor.register(body.member, body.ttl)})

    async def keep_alive(request: web.Request) -> web.Response:
        """Renew a member's lease; the answer carries the pins version (fetch the node's pins when
        it changes) and, from the leader, the node's replication tasks."""
        body = await _body(request, LeaseRequest)
        await conductor.keep_alive(body.lease)
        if body.stats is not None:
            conductor.member_stats[body.node_id] = body.stats
        tasks = conductor.replication_tasks(body.node_id) if conductor.is_leader else []
        return web.json_response({
            "pins_version": conductor.pins_version,
            "settings": conductor.settings,
            "tasks": [{"tenant": t.tenant, "key": t.key.hex(), "tier": t.tier, "size": t.size, "source": t.source}
                      for t in tasks],
        })

    async def leave(request: web.Request) -> web.Response:
        body = await _body(request, LeaseRequest)
        await conductor.leave(body.lease)
        return web.json_response({"left": body.node_id})

    async def node_blocks(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        pins = conductor.pins
        return web.json_response({"blocks": [
            {"tenant": t, "key": k.hex(), "tier": tier, "size": size, "pinned": (t, k) in pins}
            for t, k, tier, size in conductor.index.node_blocks(node)
        ]})

    async def node_pins(request: web.Request) -> web.Response:
        node = request.match_info["node"]
        version = conductor.pins_version
        return web.json_response({"version": version, "pins": [
            {"tenant": t, "key": k.hex()} for t, k in conductor.node_pins(node)
        ]})

    async def members(_: web.Request) -> web.Response:
        return web.json_response({"members": [m.model_dump() for m in conductor.members.alive()]})

    async def leader_info(_: web.Request) -> web.Response:
        info = await conductor.leader()
        return web.json_response({"leader": info.model_dump() if info else None, "self": conductor.conductor_id})

    async def metrics(_: web.Request) -> web.Response:
        index_size.set(len(conductor.index))
        leader.set(1 if conductor.is_leader else 0)
        terms.set(conductor.election.terms)
        changes.set(conductor.election.changes_seen)
        pins_gauge.set(len(conductor.pins))
        for role in ("node", "prefill", "decode", "worker"):
            members_gauge.labels(role).set(len(conductor.members.alive(role)))
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY)
    app.add_routes([
        *_probe_routes(conductor),
        web.get("/metrics", metrics),
        web.get("/v1/leader", leader_info),
        web.get("/v1/members", members),
        web.post("/v1/placements/lookup", lookup),
        web.post("/v1/placements/begin", begin),
        web.post("/v1/placements/commit", commit),
        web.post("/v1/placements/revoke", revoke),
        web.post("/v1/placements/report", report),
        web.post("/v1/placements/remove", remove),
        web.post("/v1/placements/pin", pin),
        web.post("/v1/placements/unpin", unpin),
        web.post("/v1/heat", heat),
        web.post("/v1/members/register", register),
        web.post("/v1/members/keepalive", keep_alive),
        web.post("/v1/members/leave", leave),
        web.get("/v1/nodes/{node}/blocks", node_blocks),
        web.get("/v1/nodes/{node}/pins", node_pins),
    ])
    if frontend is not None:
        frontend.add_routes(app, public=with_public)
    return app


def _probe_routes(conductor: Conductor) -> list:
    """``/health`` (the process answers) and ``/ready`` (the backend answers and a leader is known),
    on both the control and the public port; no token (PROBE_PATHS)."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "conductor": conductor.conductor_id})

    async def ready(_: web.Request) -> web.Response:
        ok, why = await conductor.ready()
        return web.json_response({"ready": ok, "reason": why}, status=200 if ok else 503)

    return [web.get("/health", health), web.get("/ready", ready)]


def build_public_app(conductor: Conductor, frontend) -> web.Application:
    """The OpenAI-compatible API alone, for its own port: completions and models (API keys, not
    control tokens), with health and readiness for probes."""

    app = web.Application(client_max_size=MAX_BODY)
    app.add_routes(_probe_routes(conductor))
    frontend.add_routes(app, control=False)
    return app


async def serve(full: TiercakeConfig, conductor_id: str | None = None, announce=None) -> None:
    """Run one conductor until SIGINT/SIGTERM: on etcd when endpoints are configured, else embedded;
    it serves the OpenAI-compatible API beside the control API, or on its own port (serving.port)."""
    import asyncio
    import signal
    import sys

    from .embedded import EmbeddedBackend
    from .etcd import EtcdBackend
    from .frontend import Frontend

    config = full.conductor
    tokens = config.tokens() or None
    sock = _bind(config.host, config.port)  # bound first: the URL the conductor publishes is the one it serves
    bound = sock.getsockname()
    url = config.advertise_url or f"http://{reachable_host(bound[0])}:{bound[1]}"
    public_port = full.serving.port
    public_sock = _bind(full.serving.host or config.host, public_port) if public_port is not None else None
    meta = await (EtcdBackend(config.etcd).start() if config.etcd else EmbeddedBackend().start())
    conductor = None
    runners: list[web.AppRunner] = []
    try:
        conductor = await Conductor(
            meta, conductor_id, url=url, ttl=config.leader_ttl, placement=config.placement,
            replication=config.replication, replication_params=config.replication_params,
            put_timeout=config.put_timeout_s, peer_token=tokens[0] if tokens else None,
        ).start()
        frontend = Frontend(conductor, full)
        sites = [(build_app(conductor, tokens, frontend, with_public=public_sock is None), sock)]
        if public_sock is not None:
            sites.append((build_public_app(conductor, frontend), public_sock))
        for app, bound_sock in sites:
            runner = web.AppRunner(app)
            runners.append(runner)
            await runner.setup()
            await web.SockSite(runner, bound_sock).start()
        announced = {"conductor": conductor.conductor_id, "url": url}
        if public_sock is not None:
            host, port = public_sock.getsockname()[:2]
            announced["api_url"] = f"http://{reachable_host(host)}:{port}"
        print(json.dumps(announced), file=announce or sys.stdout, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        if conductor is not None:
            await conductor.close()
        await meta.close()
        sock.close()
        if public_sock is not None:
            public_sock.close()


def _bind(host: str, port: int):
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
