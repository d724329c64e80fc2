"""The operator's endpoints on the control API: the cluster view, a prompt's cached prefix, pins by
prompt, flushes and run-time policy switches. Settings are durable (etcd) and reach every conductor
and member; writes go to the leader."""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import BaseModel

from tiercake.blocks import BlockKey, block_keys
from tiercake.config import TiercakeConfig
from tiercake.errors import ApiError, parse_body
from tiercake.messages import (
    ClusterMember,
    ClusterView,
    CountedLoad,
    FlushReply,
    FlushRequest,
    IndexFigures,
    PinPrefixReply,
    PolicyReply,
    PolicyRequest,
    PrefixHolder,
    PrefixReply,
    PromptRequest,
    RouterSpec,
    SessionChange,
    SessionCommand,
    SessionDirective,
    SessionsReply,
    TierStats,
)
from tiercake.policies import create_eviction, create_router

from ..service import Conductor
from .dispatch import Dispatcher, own_cache_only
from .serving_stats import ServingStats
from .session_book import SessionRecord
from .tenants import Tenants
from .worker_client import WorkerRefused, WorkerUnavailable

log = logging.getLogger(__name__)


def reply(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(by_alias=True), status=status)


async def parse(request: web.Request, model: type[BaseModel], empty: bytes | None = None):
    """The body as ``model`` (``parse_body``'s rules: one JSON, the model's checks); a malformed one is
    a 400 that names the field."""
    return parse_body(model, await request.read() or empty or b"")


class OperatorApi:
    def __init__(
        self,
        conductor: Conductor,
        config: TiercakeConfig,
        tenants: Tenants,
        dispatcher: Dispatcher,
        stats: ServingStats,
    ) -> None:
        self.conductor = conductor
        self.sessions = dispatcher.sessions  # the front's one book, which the OpenAI API fills
        self.config = config
        self.tenants = tenants
        self.dispatcher = dispatcher
        self.stats = stats
        self.block_size = config.serving.layout().block_size

    def routes(self) -> list:
        return [
            web.get("/v1/cluster", self.cluster),
            web.post("/v1/prefix", self.prefix),
            web.post("/v1/prefix/pin", self.pin),
            web.post("/v1/prefix/unpin", self.unpin),
            web.post("/v1/flush", self.flush),
            web.post("/v1/policy", self.policy),
            web.get("/v1/sessions", self.list_sessions),
            web.post("/v1/sessions/{session}", self.change_session),
            web.delete("/v1/sessions/{session}", self.drop_session),
        ]

    async def list_sessions(self, request: web.Request) -> web.Response:
        """The sessions this front served (``?tenant=``: one tenant's), least recently used first, a
        page at a time: ``?offset=`` (default 0) and ``?limit=`` (default and most ``PAGE``); the reply's
        ``next_offset`` is where the next page starts."""
        tenant = request.query.get("tenant")
        offset, limit = _count(request, "offset", 0, 10**9), _count(request, "limit", PAGE, PAGE)
        page = self.sessions.list(tenant, offset, limit + 1)  # one more: whether there is a next page
        more = len(page) > limit
        return reply(SessionsReply(sessions=page[:limit], next_offset=offset + limit if more else None))

    async def change_session(self, request: web.Request) -> web.Response:
        """Close a session now, or keep it longer or at another priority: told to the tiers through the
        worker that ran its last turn."""
        change = await parse(request, SessionChange)
        record = self._session(request.match_info["session"], change.tenant)
        update: dict = {"close": change.close}
        if change.retain_s is not None:
            update["retain_s"] = change.retain_s
        if change.priority is not None:
            update["priority"] = change.priority
        await self._tell(record, record.directive.model_copy(update=update))
        return reply(SessionsReply(sessions=[self.sessions.info(record)]))

    async def drop_session(self, request: web.Request) -> web.Response:
        """``DELETE``: close it (its KV goes first in every tier that holds it)."""
        tenant = request.query.get("tenant", "default")
        record = self._session(request.match_info["session"], tenant)
        await self._tell(record, record.directive.model_copy(update={"close": True}))
        return reply(SessionsReply(sessions=[self.sessions.info(record)]))

    def _session(self, session: str, tenant: str) -> SessionRecord:
        record = self.sessions.get(tenant, session)
        if record is None:
            raise ApiError(404, f"no session {session!r} of tenant {tenant!r} here", code="session_not_found")
        if record.state == "active":
            raise ApiError(409, "the session has a turn running: change it once the turn is over", code="session_busy")
        return record

    async def _tell(self, record: SessionRecord, directive: SessionDirective) -> None:
        member = next((m for m in self.conductor.members.alive() if m.node_id == record.worker and m.url), None)
        if member is None:
            raise ApiError(503, f"the worker that ran the session, {record.worker}, is gone", code="worker_gone")
        try:
            await self.dispatcher.workers.change_session(
                member, SessionCommand(session=directive, tenant=record.tenant)
            )
        except WorkerRefused as exc:
            raise ApiError(exc.status, exc.reason) from None
        except WorkerUnavailable as exc:
            raise ApiError(503, str(exc), code="worker_gone", retryable=True) from None
        self.sessions.changed(record, directive)

    async def cluster(self, _: web.Request) -> web.Response:
        """Nodes and workers with their tiers (capacity, use, blocks, hits), loads, and the serving
        hit ratio (prompt tokens whose KV was reused), by source."""
        conductor = self.conductor
        members = []
        for m in conductor.members.alive():
            stats = conductor.member_stats.get(m.node_id)
            tiers = stats.tiers if stats is not None else {t: TierStats(capacity_bytes=c) for t, c in m.tiers.items()}
            load = None
            if m.role != "node":
                counted = self.dispatcher.loads[m.node_id]
                load = CountedLoad(queued_tokens=counted.queued_tokens, running=counted.running)
            members.append(
                ClusterMember(
                    id=m.node_id,
                    role=m.role,
                    address=f"{m.host}:{m.port}",
                    url=m.url,
                    tiers=tiers,
                    load=load,
                    indexed_bytes={t: conductor.index.used_bytes(m.node_id, t) for t in m.tiers},
                )
            )
        return reply(
            ClusterView(
                members=members,
                router=self.dispatcher.router_spec,
                settings=conductor.settings,
                serving=self.stats.figures(),
                index=IndexFigures(replicas=len(conductor.index), pins=len(conductor.pins)),
                metadata=self.stats.metadata_costs(conductor.index.stats, conductor.meta.writes),
                reuse=await self.stats.reuse(),
            )
        )

    async def _prompt_keys(self, request: web.Request) -> tuple[PromptRequest, str, list[BlockKey]]:
        body = await parse(request, PromptRequest)
        tokens = list(body.prompt.encode()) if isinstance(body.prompt, str) else body.prompt
        index_tenant, salt = self.tenants.namespace(body.tenant)
        return body, index_tenant, block_keys(self.config.serving_namespace(salt), tokens)

    async def prefix(self, request: web.Request) -> web.Response:
        _, tenant, keys = await self._prompt_keys(request)
        found = self.conductor.index.lookup(tenant, keys)  # an operator's look: no access counted
        bs = self.block_size
        return reply(
            PrefixReply(
                blocks=len(keys),
                block_size=bs,
                holders={
                    n: PrefixHolder(tokens=p.length * bs, blocks=p.length, tiers=p.tiers) for n, p in found.items()
                },
            )
        )

    async def pin(self, request: web.Request) -> web.Response:
        body, tenant, keys = await self._prompt_keys(request)
        if not keys:
            raise ApiError(400, "the prompt has no full block to pin")
        await self.conductor.require_leader()
        await self.conductor.pin(tenant, keys, body.ttl)
        return reply(PinPrefixReply(pinned_blocks=len(keys)))

    async def unpin(self, request: web.Request) -> web.Response:
        _, tenant, keys = await self._prompt_keys(request)
        await self.conductor.require_leader()
        if keys:
            await self.conductor.unpin(tenant, keys)
        return reply(PinPrefixReply(unpinned_blocks=len(keys)))

    async def flush(self, request: web.Request) -> web.Response:
        body = await parse(request, FlushRequest, empty=b"{}")
        await self.conductor.require_leader()
        epoch = await self.conductor.flush(body.tiers, wait_s=body.timeout_s if body.wait else None)
        return reply(FlushReply(flush_epoch=epoch, applied=body.wait))

    async def policy(self, request: web.Request) -> web.Response:
        body = await parse(request, PolicyRequest)
        warnings = []
        for spec in [body.router, *(e.policy for e in (body.eviction or {}).values())]:
            if spec is not None and ":" in spec:  # checked before anything resolves it: no import on a request
                raise ApiError(
                    400,
                    f"policy {spec!r}: a run-time switch takes a policy by name (a built-in or an "
                    "entry point, `tiercake policy list`); a module:Class path only from the config",
                    param="router" if spec == body.router else "eviction",
                )
        known = {t.tier_name for t in self.config.store.tiers} | {
            tier for member in self.conductor.members.alive() for tier in member.tiers
        }
        unknown = sorted(set(body.eviction or {}) - known)
        if unknown:
            raise ApiError(
                400, f"no tier {unknown[0]!r} in this cluster: its tiers are {sorted(known)}", param="eviction"
            )
        try:
            if body.router is not None:
                router = create_router(body.router, body.router_params)  # refuse what would not build
                if not router.loads_from_nodes:
                    warnings.append(own_cache_only(body.router))
            for spec in (body.eviction or {}).values():
                create_eviction(spec.policy, spec.params)
        except (LookupError, TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        conductor = self.conductor
        await conductor.require_leader()
        if body.router is not None:
            await conductor.put_setting("router", RouterSpec(name=body.router, params=body.router_params))
        if body.eviction is not None:
            await conductor.put_setting("eviction", {**conductor.settings.eviction, **body.eviction})
        for warning in warnings:
            log.warning("%s", warning)
        return reply(
            PolicyReply(router=self.dispatcher.router_spec, eviction=conductor.settings.eviction, warnings=warnings)
        )


PAGE = 1000  # sessions in a page of GET /v1/sessions (one tenant's 100k once answered 19 MB at once)


def _count(request: web.Request, name: str, default: int, most: int) -> int:
    """A whole-number query parameter, 0 to ``most``: a 400 naming it otherwise."""
    text = request.query.get(name)
    if text is None:
        return default
    if not text.isdigit() or int(text) > most:
        raise ApiError(400, f"{name} is a whole number from 0 to {most}, got {text[:40]!r}", param=name)
    return int(text)
