"""The conductor's HTTP API (aiohttp): placement control, membership, the operator's endpoints,
health, readiness and metrics; the OpenAI-compatible API on its own port (or beside it).

Bodies and replies are the models of ``tiercake.messages``; every error, whatever raised it, is one
``ErrorReply`` (OpenAI's error shape): a malformed body is a 400 that names the field, an oversized
one a 413, one that does not arrive in time a 408. Every endpoint but the probes and (unless
``metrics_open`` is off) /metrics needs ``Authorization: Bearer <token>``; a conductor with no token
does not start unless the config says insecure. Writes go to the leader: a follower answers 503 with the leader's URL in the error
(``leader``) and in the ``X-Tiercake-Leader`` header, so clients move on by themselves.
"""

from __future__ import annotations

import json
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel

from tiercake.config import TiercakeConfig, reachable_host
from tiercake.credentials import TENANT_READS, tenant_of_token
from tiercake.errors import ApiError, app_runner, bearer, body_reader, error_middleware, parse_body, require_bearer
from tiercake.heap import collect_less_often, freeze_startup_heap
from tiercake.messages import (
    CONTROL_API,
    READ_ROLE_HEADER,
    BeginReply,
    BeginRequest,
    BlockBatch,
    CommitReply,
    FeedReply,
    FeedRequest,
    FlushAppliedRequest,
    FlushReply,
    HeatReply,
    HeatRequest,
    KeepAliveReply,
    LeaderReply,
    LeaseRequest,
    LeaveReply,
    LookupManyReply,
    LookupManyRequest,
    LookupReply,
    LookupRequest,
    MembersReply,
    NodeBlock,
    NodeBlocksReply,
    NodePin,
    NodePinsReply,
    NodeRelease,
    NodeReleaseReply,
    ObjectMap,
    PinReply,
    PinRequest,
    PlacementChange,
    PlacementRemoveReply,
    PrefixHolding,
    RegisterReply,
    RegisterRequest,
    ReplicationTask,
    ReportReply,
    RevokeReply,
    SlotReports,
    SlotReportsReply,
    UnpinReply,
)
from tiercake.metrics import Collected, store_families

from .block_table import KEY_BYTES, IndexFullError, TooManyNamesError
from .front.openai_api import OPEN_PATHS
from .front.operator import parse, reply
from .liveness import LeaseExpiredError
from .metadata import FencedError, MetadataUnavailableError
from .placement import Change
from .puts import NoRoomError, PlacementError
from .service import Conductor, FlushTimeoutError, IngestBusyError, NotLeaderError

M = TypeVar("M", bound=BaseModel)
PROBE_PATHS = ("/health", "/ready")  # kubelet probes carry no token
MAX_BODY = 8 << 20


FEED_KEYS = 1 << 15  # block keys per answer to a follower (1.5 MiB of JSON, 40 ms to apply; it asks again)


def _keys(hexes: list[str]) -> list[bytes]:
    try:
        return [bytes.fromhex(h) for h in hexes]
    except ValueError as exc:
        raise ApiError(400, f"keys must be hex: {exc}") from None


def _holdings(found: dict, sizes: bool) -> dict[str, PrefixHolding]:
    return {
        n: PrefixHolding(length=p.length, tiers=p.tiers, runs=p.runs(), sizes=p.sizes() if sizes else None)
        for n, p in found.items()
    }


def _read_reply(conductor: Conductor, answer: BaseModel) -> web.Response:
    """A lookup's answer, saying whether clients may send their lookups here (``Conductor.read_role``)."""
    response = reply(answer)
    response.headers[READ_ROLE_HEADER] = conductor.read_role
    return response


def _member_families(conductor: Conductor):
    """Per live member and tier, from the statistics members send with their keep-alives (a member
    that left: its series go with it, not frozen forever)."""
    alive = {m.node_id for m in conductor.members.alive()}
    return store_families({m: s for m, s in list(conductor.member_stats.items()) if m in alive})


class _ElectionCollector:
    """Placement changes applied, terms won and leader changes seen, as the counters they are (they
    only grow), read from the index and the election when scraped."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        election, index = self.conductor.election, self.conductor.index.stats
        yield CounterMetricFamily(
            "tiercake_placement_ops", "placement changes applied to the index (rate: ops per second)", value=index.ops
        )
        yield CounterMetricFamily("tiercake_leader_terms", "terms this conductor has won", value=election.terms)
        yield GaugeMetricFamily(
            "tiercake_loop_lag_seconds",
            "the worst lag of the conductor's event loop in the last 10 s (its lease is lost past 3 s)",
            value=self.conductor.loop_lag.worst,
        )
        yield CounterMetricFamily(
            "tiercake_leader_changes", "leader changes this conductor has seen", value=election.changes_seen
        )


class _Metrics:
    """The control plane's Prometheus series (the front binds its own into the same registry)."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.registry = registry = CollectorRegistry()
        self.index_size = Gauge("tiercake_index_replicas", "replicas in the placement index", registry=registry)
        self.batch_keys = Histogram(
            "tiercake_placement_batch_keys",
            "block keys per placement change batch (a report, a removal, a commit)",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=registry,
        )
        self.leader = Gauge("tiercake_is_leader", "1 when this conductor leads", registry=registry)
        self.members = Gauge("tiercake_members", "live members", ["role"], registry=registry)
        self.pins = Gauge("tiercake_pins", "pinned blocks", registry=registry)
        self.requests = Counter("tiercake_api_requests", "API requests", ["endpoint"], registry=registry)
        self.lookup_seconds = Histogram(
            "tiercake_lookup_seconds",
            "placement lookup time in the conductor",
            buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3),
            registry=registry,
        )
        registry.register(Collected(lambda: _member_families(conductor)))
        registry.register(_ElectionCollector(conductor))

    async def handler(self, _: web.Request) -> web.Response:
        conductor = self.conductor
        self.index_size.set(len(conductor.index))
        self.leader.set(1 if conductor.is_leader else 0)
        self.pins.set(len(conductor.pins))
        for role in ("node", "prefill", "decode", "worker"):
            self.members.labels(role).set(len(conductor.members.alive(role)))
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")


def _auth(tokens: list[str] | None, open_paths: tuple[str, ...], metrics: _Metrics, cluster_secret: bytes | None):
    """Bearer tokens on every path but the probes (and the OpenAI API's, which take API keys), a
    tenant's token on what its key-value store client reads (``tiercake.credentials``; with the
    cluster secret to check it by), and the conductor's own errors in the one format."""

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if (
            tokens
            and path not in PROBE_PATHS
            and path not in open_paths
            and not any(p.endswith("/") and path.startswith(p) for p in open_paths)
            and not (
                cluster_secret is not None
                and (request.method, path) in TENANT_READS
                and tenant_of_token(bearer(request), cluster_secret) is not None
            )
        ):
            require_bearer(request, tokens)
        resource = request.match_info.route.resource
        metrics.requests.labels(resource.canonical if resource else "unmatched").inc()
        try:
            return await handler(request)
        except NotLeaderError as exc:
            raise ApiError(
                503,
                str(exc),
                code="not_leader",
                headers={"X-Tiercake-Leader": exc.leader or ""},
                retryable=True,
                leader=exc.leader,
            ) from None
        except (MetadataUnavailableError, FencedError) as exc:  # fenced: deposed while the write was in flight
            raise ApiError(503, f"{exc}; retry", code="unavailable", retryable=True) from None
        except LeaseExpiredError as exc:
            raise ApiError(404, str(exc), code="lease_expired") from None
        except FlushTimeoutError as exc:
            raise ApiError(504, str(exc), "server_error", "flush_timeout") from None
        except NoRoomError as exc:
            raise ApiError(507, str(exc), code="no_room") from None
        except IngestBusyError as exc:
            raise ApiError(503, str(exc), code="busy", headers={"Retry-After": "1"}, retryable=True) from None
        except (IndexFullError, TooManyNamesError) as exc:
            raise ApiError(507, str(exc), code="index_full") from None
        except PlacementError as exc:
            raise ApiError(409, str(exc), code="placement_conflict") from None

    return auth


async def _leader_only(request: web.Request, conductor: Conductor, model: type[M]) -> M:
    body = await parse(request, model)
    await conductor.require_leader()
    return body


async def _batch(request: web.Request, conductor: Conductor, metrics: _Metrics, sized: bool) -> BlockBatch:
    """A batch of blocks for the leader (``sized``: each with its size, as additions come). Call it
    holding ``conductor.ingest``: it parses the body, and its caller applies it, without a pause."""
    body = parse_body(BlockBatch, await request.read())
    await conductor.require_leader()
    metrics.batch_keys.observe(len(body.keys) // KEY_BYTES)
    if sized != bool(body.sizes):
        raise ApiError(400, "invalid body: sizes: one per key" if sized else "invalid body: sizes: not taken here")
    return body


def _placement_routes(conductor: Conductor, metrics: _Metrics) -> list:
    """The index: lookups (any conductor), reports, removals, pins and heat (the leader)."""

    async def lookup(request: web.Request) -> web.Response:
        body = await parse(request, LookupRequest)
        with metrics.lookup_seconds.time():
            found = conductor.lookup(body.tenant, body.keys)
        return _read_reply(conductor, LookupReply(nodes=_holdings(found, body.sizes)))

    async def lookup_many(request: web.Request) -> web.Response:
        body = await parse(request, LookupManyRequest)
        with metrics.lookup_seconds.time():
            found = [conductor.lookup(body.tenant, chain) for chain in body.chains]
        return _read_reply(conductor, LookupManyReply(found=[_holdings(f, body.sizes) for f in found]))

    async def report(request: web.Request) -> web.Response:
        """A node declares blocks it holds (spilled, promoted, or its SSD tier's after a restart)."""
        async with conductor.ingest:
            body = await _batch(request, conductor, metrics, sized=True)
            new = conductor.report(body.tenant, body.keys, body.node, body.tier, body.sizes)
        return reply(ReportReply(reported=len(body.sizes), new=new))

    async def remove(request: web.Request) -> web.Response:
        async with conductor.ingest:
            body = await _batch(request, conductor, metrics, sized=False)
            removed, unknown = conductor.remove(body.tenant, body.keys, body.node, body.tier)
        return reply(PlacementRemoveReply(removed=removed, unknown=unknown))

    async def pin(request: web.Request) -> web.Response:
        body = await _leader_only(request, conductor, PinRequest)
        await conductor.pin(body.tenant, _keys(body.keys), body.ttl)
        return reply(PinReply(pinned=len(body.keys)))

    async def unpin(request: web.Request) -> web.Response:
        body = await _leader_only(request, conductor, PinRequest)
        await conductor.unpin(body.tenant, _keys(body.keys))
        return reply(UnpinReply(unpinned=len(body.keys)))

    async def heat(request: web.Request) -> web.Response:
        body = await _leader_only(request, conductor, HeatRequest)
        keys = _keys([h.key for h in body.hits])
        counts = [((h.tenant, key), h.count) for h, key in zip(body.hits, keys)]
        for tenant in body.packed:
            raw = tenant.keys
            counts += [
                ((tenant.tenant, raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]), n) for i, n in enumerate(tenant.counts)
            ]
        conductor.add_heat(counts)
        return reply(HeatReply(accepted=len(counts)))

    return [
        web.post("/v1/placements/lookup", lookup),
        web.post("/v1/placements/lookup-many", lookup_many),
        web.post("/v1/placements/report", report),
        web.post("/v1/placements/remove", remove),
        web.post("/v1/placements/pin", pin),
        web.post("/v1/placements/unpin", unpin),
        web.post("/v1/heat", heat),
    ]


def _put_routes(conductor: Conductor, metrics: _Metrics) -> list:
    """Puts through the conductor (``PutBook``): begin, then commit or revoke (the leader)."""

    async def begin(request: web.Request) -> web.Response:
        body = await _leader_only(request, conductor, BeginRequest)
        keys = _keys([b.key for b in body.blocks])
        targets = conductor.puts.begin(
            body.tenant, keys, [b.size for b in body.blocks], body.tier, body.local, body.evict
        )
        return reply(BeginReply(targets={k.hex(): nodes for k, nodes in targets.items()}))

    async def commit(request: web.Request) -> web.Response:
        async with conductor.ingest:
            body = await _batch(request, conductor, metrics, sized=True)
            conductor.puts.commit(body.tenant, body.key_list(), body.node, body.tier, body.sizes)
        return reply(CommitReply(committed=len(body.sizes)))

    async def revoke(request: web.Request) -> web.Response:
        async with conductor.ingest:
            body = await _batch(request, conductor, metrics, sized=False)
            keys = body.key_list()
            conductor.puts.revoke(body.tenant, keys, body.node, body.tier)
        return reply(RevokeReply(revoked=len(keys)))

    return [
        web.post("/v1/placements/begin", begin),
        web.post("/v1/placements/commit", commit),
        web.post("/v1/placements/revoke", revoke),
    ]


def _wire(change: Change) -> PlacementChange:
    return PlacementChange(
        kind=change.kind,
        tenant=change.tenant,
        node=change.node,
        tier=change.tier,
        keys=change.keys.tobytes(),
        sizes=change.sizes.astype("<u4").tobytes(),
    )


def _node_feed_routes(conductor: Conductor) -> list:
    """What followers and node agents follow: the leader's placement changes, a node's blocks and pins."""

    async def feed(request: web.Request) -> web.Response:
        """A follower's feed of the leader's placement changes (the leader alone hears of them), or
        the next page of a snapshot it is reading."""
        body = await parse(request, FeedRequest)
        index, term = conductor.index, conductor.election.won_term
        if conductor.is_leader and body.term == term and body.snapshot_row is None and body.wait_s:
            if index.changes_after(body.after) == []:
                await index.wait_change(body.after, body.wait_s)
        if not conductor.is_leader:  # also when it stepped down while waiting
            await conductor.require_leader()
        window = conductor.term_and_window()[1]
        found = index.changes_after(body.after, FEED_KEYS) if body.term == term else None
        if body.snapshot_row is not None and found is not None:  # a snapshot's next page
            page, next_row = index.snapshot(body.snapshot_row)
            return reply(
                FeedReply(
                    term=term,
                    seq=body.after,
                    reset=False,
                    changes=[_wire(c) for c in page],
                    next_row=next_row,
                    rereport_s=window,
                )
            )
        if found is None:  # another term, or the log no longer reaches back: a snapshot from its first page
            page, next_row = index.snapshot(0)
            return reply(
                FeedReply(
                    term=term,
                    seq=index.seq,
                    reset=True,
                    changes=[_wire(c) for c in page],
                    next_row=next_row,
                    rereport_s=window,
                )
            )
        seq = body.after + len(found)
        answer = FeedReply(
            term=term, seq=seq, reset=False, changes=[_wire(c) for c in found], more=seq < index.seq, rereport_s=window
        )
        return reply(answer)

    async def node_blocks(request: web.Request) -> web.Response:
        pins = conductor.pins
        return reply(
            NodeBlocksReply(
                blocks=[
                    NodeBlock(tenant=t, key=k.hex(), tier=tier, size=size, pinned=(t, k) in pins)
                    for t, k, tier, size in conductor.index.node_blocks(request.match_info["node"])
                ]
            )
        )

    async def node_pins(request: web.Request) -> web.Response:
        version = conductor.pins_version
        return reply(
            NodePinsReply(
                version=version,
                pins=[NodePin(tenant=t, key=k.hex()) for t, k in conductor.node_pins(request.match_info["node"])],
            )
        )

    return [
        web.post("/v1/placements/feed", feed),
        web.get("/v1/nodes/{node}/blocks", node_blocks),
        web.get("/v1/nodes/{node}/pins", node_pins),
    ]


def _member_routes(conductor: Conductor) -> list:
    """Membership (any conductor) and who leads."""

    async def register(request: web.Request) -> web.Response:
        body = await parse(request, RegisterRequest)
        return reply(RegisterReply(lease=await conductor.register(body.member, body.ttl)))

    async def keep_alive(request: web.Request) -> web.Response:
        """A member's keep-alive, noted by the leader (a follower relays it there through the
        backend, or vouches for it while no leader is named); the answer carries the pins version (fetch the node's pins
        when it changes), the cluster settings and, from the leader, the node's replication tasks."""
        body = await parse(request, LeaseRequest)
        await conductor.keep_alive(body.node_id, body.lease)
        if body.stats is not None:
            conductor.note_stats(body.node_id, body.stats)
        tasks = conductor.replication_tasks(body.node_id) if conductor.is_leader else []
        term, window = conductor.term_and_window()
        return reply(
            KeepAliveReply(
                pins_version=conductor.pins_version,
                settings=conductor.settings,
                tasks=[
                    ReplicationTask(tenant=t.tenant, key=t.key.hex(), tier=t.tier, size=t.size, source=t.source)
                    for t in tasks
                ],
                term=term,
                volatile_tiers=sorted(getattr(conductor.members.members.get(body.node_id), "tiers", ())),
                rereport_s=window,
                objects_epoch=await conductor.objects_epoch(),
            )
        )

    async def flush_applied(request: web.Request) -> web.Response:
        """A member applied a flush (the leader answers synchronous flushes)."""
        body = await parse(request, FlushAppliedRequest)
        await conductor.require_leader()
        conductor.flush_applied(body.node_id, body.epoch)
        return reply(FlushReply(flush_epoch=body.epoch, applied=True))

    async def leave(request: web.Request) -> web.Response:
        body = await parse(request, LeaseRequest)
        await conductor.leave(body.node_id, body.lease)
        return reply(LeaveReply(left=body.node_id))

    async def members(_: web.Request) -> web.Response:
        return reply(MembersReply(members=conductor.members.alive()))

    async def leader_info(_: web.Request) -> web.Response:
        return reply(LeaderReply.model_validate({"leader": await conductor.leader(), "self": conductor.conductor_id}))

    return [
        *_object_routes(conductor),
        web.post("/v1/members/register", register),
        web.post("/v1/members/keepalive", keep_alive),
        web.post("/v1/members/leave", leave),
        web.get("/v1/members", members),
        web.get("/v1/leader", leader_info),
        web.post("/v1/flush/applied", flush_applied),
    ]


def _object_routes(conductor: Conductor) -> list[web.RouteDef]:
    """The key-value store's object map: read by any conductor, changed by the leader alone."""

    async def object_map(_: web.Request) -> web.Response:
        """Who owns each slot of the key-value store's objects (any conductor: the one it follows)."""
        return reply(conductor.objects.map)

    async def slot_reports(request: web.Request) -> web.Response:
        """Primaries' word that backups hold their slots whole now (or no more), or took them over."""
        body = await parse(request, SlotReports)
        await conductor.require_leader()
        current, refused = await conductor.objects.mark(body.reports)
        return reply(SlotReportsReply(map=current, refused=refused))

    async def seed_map(request: web.Request) -> web.Response:
        """A node's last map, for a conductor that lost its own (taken only when it has none)."""
        body = await parse(request, ObjectMap)
        await conductor.require_leader()
        taken = await conductor.objects.seed(body)
        return reply(SlotReportsReply(map=conductor.objects.map, refused=[] if taken else ["the conductor has a map"]))

    async def release_node(request: web.Request) -> web.Response:
        """An operator's: a node gone for good; the slots it pinned (objects it alone persisted) move."""
        body = await parse(request, NodeRelease)
        await conductor.require_leader()
        return reply(NodeReleaseReply(released=await conductor.objects.release(body.node)))

    return [
        web.get("/v1/objects/map", object_map),
        web.post("/v1/objects/reports", slot_reports),
        web.post("/v1/objects/seed", seed_map),
        web.post("/v1/objects/release", release_node),
    ]


def build_app(
    conductor: Conductor,
    tokens: list[str] | None = None,
    frontend=None,
    with_public: bool = True,
    metrics_open: bool = True,
    cluster_secret: bytes | None = None,
) -> web.Application:
    """The control API; with ``frontend`` (a ``Frontend``), its operator endpoints and, unless
    ``with_public`` is False (the public API has its own port), the OpenAI-compatible API beside it.
    ``metrics_open``: /metrics without a token (for scrapers); ``cluster_secret``: what tenants'
    tokens are checked by (None: none is taken)."""
    metrics = _Metrics(conductor)
    if frontend is not None:
        frontend.bind_metrics(metrics.registry)
    open_paths = (OPEN_PATHS if frontend is not None and with_public else ()) + (("/metrics",) if metrics_open else ())
    keys = [frontend.openai.key_first] if frontend is not None and with_public else []
    app = web.Application(
        middlewares=[error_middleware, _auth(tokens, open_paths, metrics, cluster_secret), *keys, body_reader()],
        client_max_size=MAX_BODY,
    )
    app.add_routes(
        [
            *_probe_routes(conductor),
            web.get("/metrics", metrics.handler),
            *_member_routes(conductor),
            *_placement_routes(conductor, metrics),
            *_put_routes(conductor, metrics),
            *_node_feed_routes(conductor),
        ]
    )
    if frontend is not None:
        frontend.add_routes(app, public=with_public)
    return app


def _probe_routes(conductor: Conductor, frontend=None) -> list:
    """``/health`` (the process answers) and ``/ready``: on the control port, the backend answers and
    a leader is known; on the public port (given its ``frontend``), also a worker that can take a
    prompt is a member, so a load balancer sends no completion that could only get a 503. No token
    (PROBE_PATHS)."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "conductor": conductor.conductor_id, "api": CONTROL_API})

    async def ready(_: web.Request) -> web.Response:
        ok, why = await conductor.ready()
        if ok and frontend is not None and not frontend.dispatcher.can_serve():
            ok, why = False, f"{why}; no worker that takes prompts has registered yet"
        return web.json_response({"ready": ok, "reason": why}, status=200 if ok else 503)

    return [web.get("/health", health), web.get("/ready", ready)]


def build_public_app(conductor: Conductor, frontend) -> web.Application:
    """The OpenAI-compatible API alone, for its own port: completions and models (API keys, not
    control tokens), with health and readiness for probes (ready: a worker can serve)."""

    app = web.Application(
        middlewares=[error_middleware, frontend.openai.key_first, body_reader()], client_max_size=MAX_BODY
    )
    app.add_routes(_probe_routes(conductor, frontend))
    frontend.add_routes(app, control=False)
    return app


async def serve(full: TiercakeConfig, conductor_id: str | None = None, announce=None) -> None:
    """Run one conductor until SIGINT/SIGTERM: on etcd when endpoints are configured, else embedded.
    The control API needs a token unless the config says insecure; the OpenAI-compatible API has its own
    port (serving.port), or shares the control API's when serving.port is null."""
    import logging
    import sys

    from .embedded import EmbeddedBackend
    from .etcd import EtcdBackend
    from .front.frontend import Frontend

    config = full.conductor
    tokens = config.required_tokens() or None  # none only when the operator said insecure
    if tokens is None:
        logging.getLogger(__name__).warning(
            "INSECURE: the control API runs without a token (conductor.insecure): anyone who reaches port %s can "
            "register workers, read every tenant's cached keys and answer requests",
            config.port,
        )
    sock = _bind(config.host, config.port)  # bound first: the URL the conductor publishes is the one it serves
    bound = sock.getsockname()
    scheme, tls = full.tls.scheme, full.tls.server_context()
    url = config.advertise_url or f"{scheme}://{reachable_host(bound[0])}:{bound[1]}"
    public_sock = _public_socket(full)
    meta = await (EtcdBackend(config.etcd).start() if config.etcd else EmbeddedBackend().start())
    conductor = None
    runners: list[web.AppRunner] = []
    try:
        conductor = await _conductor(full, meta, conductor_id, url, tokens).start()
        frontend = Frontend(conductor, full)
        sites = [
            (
                build_app(
                    conductor,
                    tokens,
                    frontend,
                    with_public=public_sock is None,
                    metrics_open=config.metrics_open,
                    cluster_secret=_cluster_secret(full),
                ),
                sock,
            )
        ]
        if public_sock is not None:
            sites.append((build_public_app(conductor, frontend), public_sock))
        for app, bound_sock in sites:
            runner = app_runner(app)
            runners.append(runner)
            await runner.setup()
            await web.SockSite(runner, bound_sock, ssl_context=tls).start()
        freeze_startup_heap()
        collect_less_often()
        announced = {"conductor": conductor.conductor_id, "url": url}
        if public_sock is not None:
            host, port = public_sock.getsockname()[:2]
            announced["api_url"] = f"{scheme}://{reachable_host(host)}:{port}"
        print(json.dumps(announced), file=announce or sys.stdout, flush=True)
        await _until_stopped()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        if conductor is not None:
            await conductor.close()
        await meta.close()
        sock.close()
        if public_sock is not None:
            public_sock.close()


def _public_socket(full: TiercakeConfig):
    """The OpenAI-compatible API's own socket, or None when it shares the control API's port."""
    config, public_port = full.conductor, full.serving.port
    if public_port is None or (public_port == config.port != 0 and (full.serving.host or config.host) == config.host):
        return None
    return _bind(full.serving.host or config.host, public_port)


def _cluster_secret(full: TiercakeConfig) -> bytes | None:
    """The cluster secret, where this conductor was given it (tenants' tokens are checked by it)."""
    try:
        return full.transfer.secret()
    except (ValueError, OSError):
        return None


def _conductor(full: TiercakeConfig, meta, conductor_id: str | None, url: str, tokens) -> Conductor:
    config = full.conductor
    return Conductor(
        meta,
        conductor_id,
        url=url,
        ttl=config.leader_ttl,
        placement=config.placement,
        replication=config.replication,
        replication_params=config.replication_params,
        put_timeout=config.put_timeout_s,
        peer_token=tokens[0] if tokens else None,
        peer_ssl=full.tls.client_context(),
        objects=full.objects,
        index_max_blocks=config.index_max_blocks,
    )


async def _until_stopped() -> None:
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _bind(host: str, port: int):
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror} (pick another --port)") from None
    return sock
