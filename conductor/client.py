"""The async Python client of the conductor's HTTP API. It finds the leader by itself: a follower
that refuses a write names the leader, and a conductor that does not answer is skipped.

Lookups go to a follower in step with the leader where there is one: its answers are as fresh (it
applies the leader's changes within milliseconds of each; a lookup that misses a block costs a
recompute, never a wrong answer), and it takes none of the members' keep-alives and reports, so its
lookups wait less (``bench fleet``: p99 2.2-3.2 ms at a follower, 3.5-4.4 ms at the leader, at 1,000
nodes). Each lookup's answer says what lookups there are worth (``READ_ROLE_HEADER``); a client that
knows of no follower tries the next conductor with one lookup every ``FOLLOWER_PROBE_S``."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel

from tiercake import dead_peer
from tiercake.errors import parse_error
from tiercake.messages import (
    READ_ROLE_HEADER,
    BeginReply,
    ClusterView,
    CommitReply,
    ConductorInfo,
    FeedReply,
    FlushReply,
    HeatReply,
    HeatRequest,
    KeepAliveReply,
    LeaderReply,
    LookupManyReply,
    LookupReply,
    MemberInfo,
    MembersReply,
    MemberStats,
    NodeBlock,
    NodeBlocksReply,
    NodePinsReply,
    NodeReleaseReply,
    ObjectMap,
    PinPrefixReply,
    PinReply,
    PlacementRemoveReply,
    PolicyReply,
    PrefixHolding,
    PrefixReply,
    RegisterReply,
    ReportReply,
    RevokeReply,
    SessionInfo,
    SessionsReply,
    SlotReady,
    SlotReportsReply,
    UnpinReply,
)

log = logging.getLogger(__name__)

FOLLOWER_PROBE_S = 10.0  # how often a client that knows no follower in step sends a lookup to look for one
FOLLOWER_READ_TIMEOUT_S = 1.0  # a lookup at a follower that takes longer is asked of the others

if TYPE_CHECKING:
    from tiercake.transfer import TransferResult

R = TypeVar("R", bound=BaseModel)
Prefix = PrefixHolding  # the name callers used before the messages module


class ConductorError(Exception):
    """The conductor refused the request (4xx) or none could serve it in time."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation's id and directives, sent as the front's session headers
    (``conductor/front/sessions.py``): keep its KV ``retain_s`` while paused, at ``priority``, expect
    the next turn in ``pause_s``; ``final``: it ends with this request."""

    id: str
    parent: str | None = None
    retain_s: float | None = None
    priority: int | None = None
    pause_s: float | None = None
    final: bool = False

    def headers(self) -> dict[str, str]:
        named = {
            "X-Tiercake-Session": self.id,
            "X-Tiercake-Parent-Session": self.parent,
            "X-Tiercake-Session-Retain": self.retain_s,
            "X-Tiercake-Session-Priority": self.priority,
            "X-Tiercake-Session-Pause": self.pause_s,
            "X-Tiercake-Session-Final": "true" if self.final else None,
        }
        return {name: str(value) for name, value in named.items() if value is not None}


class Conductors:
    """Which conductor a client asks: the one that answered it last (the leader, for writes), a
    follower in step for lookups when one is known, and those that failed lately (not worth a
    redirect for a second). Each call walks them from ``start`` on its own: concurrent calls must
    not steer each other."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one conductor URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.current = 0  # the index of the one that answered a call other than a lookup last
        self._down: dict[str, float] = {}  # url -> until when it is not worth a redirect
        self._reader: str | None = None  # a follower in step that answered a lookup last
        self._probed_at = -math.inf  # when a lookup last looked for one (monotonic)

    def url(self, index: int) -> str:
        return self.urls[index % len(self.urls)]

    def start(self, read: bool) -> int:
        """Where a call starts; for a lookup (``read``), the follower in step that answered one last;
        while none is known, once every ``FOLLOWER_PROBE_S``, the conductor after the one that
        answered last (is it one?); else that one."""
        now = time.monotonic()
        if not read:
            return self.current
        if self._reader in self.urls and self._down.get(self._reader, 0.0) <= now:
            return self.urls.index(self._reader)
        probe = self.url(self.current + 1)
        if len(self.urls) > 1 and now - self._probed_at >= FOLLOWER_PROBE_S and self._down.get(probe, 0.0) <= now:
            self._probed_at = now
            return self.current + 1
        return self.current

    def limit(self, index: int, read: bool, limit: aiohttp.ClientTimeout) -> aiohttp.ClientTimeout:
        """A lookup away from the usual conductor waits ``FOLLOWER_READ_TIMEOUT_S`` at most, then asks
        the others."""
        if read and index % len(self.urls) != self.current % len(self.urls):
            return aiohttp.ClientTimeout(total=min(limit.total or math.inf, FOLLOWER_READ_TIMEOUT_S))
        return limit

    def answered(self, index: int, read: bool, role: str | None) -> None:
        """The conductor at ``index`` answered; a lookup's answer says what its lookups are worth."""
        url = self.url(index)
        if not read:
            self.current = index % len(self.urls)
        elif role == "follower":
            self._reader = url
        elif self._reader == url:  # it leads now, or fell behind
            self._reader = None

    def failed(self, url: str) -> None:
        self._down[url] = time.monotonic() + 1.0
        if url == self._reader:
            self._reader, self._probed_at = None, time.monotonic()  # not looked for again at once

    def redirect(self, leader: str, url: str) -> int | None:
        """The index of the leader a refusal named, unless it names a conductor that just failed us
        (a dead leader is still named until its lease runs out) or the one that answered (it leads
        but cannot be sure of its lease yet): then None, wait and ask again."""
        if not leader or leader == url or self._down.get(leader, 0.0) > time.monotonic():
            return None
        if leader not in self.urls:
            self.urls.append(leader)
        return self.urls.index(leader)


class Client:
    def __init__(
        self, urls: list[str], token: str | None = None, timeout: float = 5.0, retries: int = 20, ssl=None
    ) -> None:
        """``ssl``: an ``ssl.SSLContext`` to verify https servers with (None: the system's CAs)."""
        self.conductors = Conductors(urls)
        self.token = token
        self.ssl = ssl
        self.timeout = timeout
        self.retries = retries
        self._session: aiohttp.ClientSession | None = None
        self.hex_keys = False  # the conductor is of the release before, which takes block keys as hex lists

    @property
    def urls(self) -> list[str]:
        return self.conductors.urls

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=dead_peer.connector(self.ssl),  # a conductor cut off is left in seconds
            )
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
        raw: bool = False,
        read: bool = False,
    ) -> Any:
        """The JSON answer, parsed (``raw``: its bytes, for a model that parses JSON itself). A
        ``read`` (a lookup) starts at a follower in step when one is known (``Conductors``)."""
        last = "no conductor answered"
        trail: list[str] = []  # what each attempt met, for the error
        conductors = self.conductors
        index = conductors.start(read)
        for attempt in range(self.retries):
            url = conductors.url(index)
            try:
                http = self._http()
                limit = http.timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
                limit = conductors.limit(index, read, limit)
                async with http.request(method, url + path, json=body, headers=headers, timeout=limit) as resp:
                    if raw and resp.status < 400:
                        data = await resp.read()
                        conductors.answered(index, read, None)
                        return data
                    data = await resp.json(content_type=None)
                    if resp.status < 400:
                        conductors.answered(index, read, resp.headers.get(READ_ROLE_HEADER))
                        return data
                    trail.append(f"{url} {resp.status}")
                    error = parse_error(data, resp.status)
                    if resp.status == 503:  # a follower, or no leader / backend yet: move on
                        last = error.message
                        leader = conductors.redirect(
                            (resp.headers.get("X-Tiercake-Leader") or error.leader or "").rstrip("/"), url
                        )
                        if leader is not None:
                            index = leader
                            continue
                    else:
                        raise ConductorError(resp.status, error.message, error.code)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # unreachable, cut short, not JSON
                last = f"{url}: {exc!r}"
                trail.append(f"{url} {type(exc).__name__}")
                conductors.failed(url)
            index += 1
            await asyncio.sleep(min(0.05 * 2 ** (attempt // len(conductors.urls)), 1.0))
        raise ConductorError(503, f"{last} (after {len(trail)} attempts: {', '.join(trail[-6:])})")

    async def _typed(self, model: type[R], method: str, path: str, body: dict | None = None, read: bool = False) -> R:
        return model.model_validate(await self._call(method, path, body, read=read))

    async def lookup(self, tenant: str, keys: Sequence[bytes], sizes: bool = False) -> dict[str, PrefixHolding]:
        """Node -> how much of the chain it holds (``length`` blocks from the start, by tier; with
        ``sizes``, each held block's size)."""
        body = {"tenant": tenant, "keys": _packed(keys), **({"sizes": True} if sizes else {})}
        return (await _keyed(self, LookupReply, "/v1/placements/lookup", body, read=True)).nodes

    async def lookup_many(
        self, tenant: str, chains: list[list[bytes]], sizes: bool = False
    ) -> list[dict[str, PrefixHolding]]:
        """``lookup`` of each chain, in one request."""
        body = {"tenant": tenant, "chains": [_packed(chain) for chain in chains], "sizes": sizes}
        return (await _keyed(self, LookupManyReply, "/v1/placements/lookup-many", body, read=True)).found

    async def begin_put(
        self,
        tenant: str,
        keys: list[bytes],
        sizes: list[int],
        tier: str = "pool",
        local: str | None = None,
        evict: bool = False,
    ) -> dict[bytes, list[str]]:
        """Where each new block goes (as many nodes as the replication policy wants; with ``evict``,
        also onto nodes that must evict to make room)."""
        blocks = [{"key": k.hex(), "size": s} for k, s in zip(keys, sizes, strict=True)]
        body = {"tenant": tenant, "tier": tier, "blocks": blocks, "local": local, "evict": evict}
        targets = (await self._typed(BeginReply, "POST", "/v1/placements/begin", body)).targets
        return {bytes.fromhex(k): nodes for k, nodes in targets.items()}

    async def commit(self, tenant: str, node: str, tier: str, keys: list[bytes], sizes: list[int]) -> int:
        """The node stored blocks begun for it; returns once the index has them."""
        body = _batch(tenant, node, tier, keys, sizes)
        return (await _keyed(self, CommitReply, "/v1/placements/commit", body)).committed

    async def report(self, tenant: str, node: str, tier: str, keys: list[bytes], sizes: list[int]) -> int:
        """The node holds these blocks (spilled, promoted, or its SSD tier's after a restart); no put
        needed. Returns how many the index did not have yet. Sent ``BATCH_KEYS`` at a time."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys for {len(sizes)} sizes")
        new = 0
        for i in range(0, len(keys), BATCH_KEYS):
            body = _batch(tenant, node, tier, keys[i : i + BATCH_KEYS], sizes[i : i + BATCH_KEYS])
            new += (await _keyed(self, ReportReply, "/v1/placements/report", body)).new
        return new

    async def revoke(self, tenant: str, node: str, tier: str, keys: list[bytes]) -> int:
        body = _batch(tenant, node, tier, keys)
        return (await _keyed(self, RevokeReply, "/v1/placements/revoke", body)).revoked

    async def remove(self, tenant: str, node: str, tier: str, keys: list[bytes]) -> tuple[int, int]:
        """The node no longer holds these blocks; returns (removed, unknown to the index). Sent
        ``BATCH_KEYS`` at a time."""
        removed = unknown = 0
        for i in range(0, len(keys), BATCH_KEYS):
            body = _batch(tenant, node, tier, keys[i : i + BATCH_KEYS])
            data = await _keyed(self, PlacementRemoveReply, "/v1/placements/remove", body)
            removed, unknown = removed + data.removed, unknown + data.unknown
        return removed, unknown

    async def pin(self, tenant: str, keys: list[bytes], ttl: int | None = None) -> int:
        """Keep these blocks wherever they are held, until unpinned (or for ``ttl`` seconds)."""
        body = {"tenant": tenant, "keys": [k.hex() for k in keys], "ttl": ttl}
        return (await self._typed(PinReply, "POST", "/v1/placements/pin", body)).pinned

    async def heat(self, hits: list[tuple[str, bytes, int]]) -> int:
        """Accesses a follower conductor counted in its lookups, for the leader's hot replication,
        packed by tenant (a leader of the release before refuses them: a 400, and its rates miss
        them until it is upgraded)."""
        body = HeatRequest.packing(hits).model_dump(mode="json", exclude_defaults=True)
        return (await self._typed(HeatReply, "POST", "/v1/heat", body)).accepted

    async def feed(self, term: int, after: int, snapshot_row: int | None = None, wait_s: float = 0.0) -> FeedReply:
        """The leader's placement changes for a follower conductor: those after ``after`` in
        ``term``, or a snapshot's page (``reset`` on its first; ``snapshot_row`` asks for the next);
        waits up to ``wait_s`` for a change."""
        body = {"term": term, "after": after, "snapshot_row": snapshot_row, "wait_s": wait_s}
        raw = await self._call("POST", "/v1/placements/feed", body, timeout=wait_s + self.timeout, raw=True)
        return FeedReply.model_validate_json(raw)

    async def unpin(self, tenant: str, keys: list[bytes]) -> int:
        body = {"tenant": tenant, "keys": [k.hex() for k in keys]}
        return (await self._typed(UnpinReply, "POST", "/v1/placements/unpin", body)).unpinned

    async def node_blocks(self, node: str) -> list[NodeBlock]:
        """Every replica the index places on ``node``: tenant, key (hex), tier, size, pinned."""
        return (await self._typed(NodeBlocksReply, "GET", f"/v1/nodes/{node}/blocks")).blocks

    async def node_pins(self, node: str) -> tuple[int, list[tuple[str, bytes]]]:
        """(pins version, the pinned blocks ``node`` holds)."""
        data = await self._typed(NodePinsReply, "GET", f"/v1/nodes/{node}/pins")
        return data.version, [(p.tenant, bytes.fromhex(p.key)) for p in data.pins]

    async def register(self, member: MemberInfo, ttl: int = 5) -> int:
        """Register a node or worker; returns its lease."""
        body = {"member": member.model_dump(exclude={"lease"}), "ttl": ttl}
        try:
            return (await self._typed(RegisterReply, "POST", "/v1/members/register", body)).lease
        except ConductorError as exc:  # a conductor of the previous release refuses the fields it does not know
            if exc.status != 400 or not any(f"member.{name}:" in str(exc) for name in MemberInfo.ADDED):
                raise
        log.info("the conductor is of an earlier release: %s registers as that release knew members", member.node_id)
        body["member"] = member.model_dump(exclude={"lease", *MemberInfo.ADDED})
        return (await self._typed(RegisterReply, "POST", "/v1/members/register", body)).lease

    async def keep_alive(
        self, node_id: str, lease: int, stats: MemberStats | None = None, timeout: float | None = None
    ) -> KeepAliveReply:
        """Renew the lease (and tell the conductor how the member's store is doing). Raises
        ``ConductorError`` with status 404 once it has expired (register again). Returns the pins
        version, the cluster's run-time settings and the node's replication tasks. ``timeout``: each
        attempt's (a member gives up on a conductor it cannot reach well within its TTL, and tries
        the next, which relays it to the leader)."""
        body = {"node_id": node_id, "lease": lease, "stats": stats.model_dump() if stats is not None else None}
        return KeepAliveReply.model_validate(await self._call("POST", "/v1/members/keepalive", body, timeout=timeout))

    async def leave(self, node_id: str, lease: int) -> None:
        await self._call("POST", "/v1/members/leave", {"node_id": node_id, "lease": lease})

    # The OpenAI-compatible API ------------------------------------------------------------------

    async def complete(
        self,
        prompt: str | list[int],
        *,
        model: str = "tiercake-reference",
        max_tokens: int = 16,
        temperature: float = 0.0,
        tenant: str | None = None,
        session: Session | None = None,
        **extra,
    ) -> dict:
        """``/v1/completions``, whole: the OpenAI response (usage includes cached prompt tokens).
        ``session``: the conversation it belongs to and what to do with its KV afterwards."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}
        return await self._call("POST", "/v1/completions", body, headers=_serving_headers(tenant, session) or None)

    async def models(self) -> list[dict]:
        """``/v1/models``: the served model, with ``max_model_len`` (its context)."""
        return (await self._call("GET", "/v1/models"))["data"]

    async def stream_completion(
        self,
        prompt: str | list[int],
        *,
        model: str = "tiercake-reference",
        max_tokens: int = 16,
        temperature: float = 0.0,
        tenant: str | None = None,
        session: Session | None = None,
        **extra,
    ):
        """``/v1/completions`` streamed: each server-sent chunk as a dict, the last one with usage."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        url = self.conductors.url(self.conductors.current)
        async with self._http().post(
            url + "/v1/completions", json=body, headers=_serving_headers(tenant, session)
        ) as r:
            if r.status >= 400:
                error = parse_error(await r.json(content_type=None), r.status)
                raise ConductorError(r.status, error.message, error.code)
            async for chunk in _server_sent(r):
                yield chunk

    # Serving control ----------------------------------------------------------------------------

    async def cluster(self) -> ClusterView:
        """Nodes and workers (tiers with capacity, use, blocks, hits; loads) and the serving hit ratio."""
        return await self._typed(ClusterView, "GET", "/v1/cluster")

    async def prefix(self, prompt: str | list[int], tenant: str = "default") -> PrefixReply:
        """Who holds how much of a prompt's prefix (``blocks``; ``holders``: id -> tokens, blocks, tiers)."""
        return await self._typed(PrefixReply, "POST", "/v1/prefix", {"prompt": prompt, "tenant": tenant})

    async def pin_prefix(self, prompt: str | list[int], tenant: str = "default", ttl: int | None = None) -> int:
        """Keep a prompt's full blocks wherever they are held (a system prompt, say)."""
        body = {"prompt": prompt, "tenant": tenant, "ttl": ttl}
        return (await self._typed(PinPrefixReply, "POST", "/v1/prefix/pin", body)).pinned_blocks

    async def unpin_prefix(self, prompt: str | list[int], tenant: str = "default") -> int:
        body = {"prompt": prompt, "tenant": tenant}
        return (await self._typed(PinPrefixReply, "POST", "/v1/prefix/unpin", body)).unpinned_blocks

    async def flush(self, tiers: list[str] | None = None, *, wait: bool = False, timeout_s: float = 30.0) -> int:
        """Every node and worker drops the blocks it may (not pinned, leased or in use); with
        ``tiers``, only those tiers' copies, pushed down to the next tier (``["gpu"]``: the workers'
        caches; ``["pool"]``: the nodes' pools, leaving their blocks on SSD). Members apply it at their
        next keep-alive (a second or two), to what they hold then (a block still being written through
        or read at that moment stays). Without ``wait`` it returns the flush epoch once it is
        durable; with ``wait``, once every member that was live has applied it and reported what it
        removed (the index then lists none of it), or ``ConductorError`` 504 after ``timeout_s``
        naming the members that have not."""
        body = {"tiers": tiers, "wait": wait, "timeout_s": timeout_s}
        answer = await self._call("POST", "/v1/flush", body, timeout=timeout_s + self.timeout if wait else None)
        return FlushReply.model_validate(answer).flush_epoch

    async def flush_applied(self, node_id: str, epoch: int) -> None:
        """A member tells the leader it has applied flush ``epoch`` (and reported what it removed)."""
        await self._call("POST", "/v1/flush/applied", {"node_id": node_id, "epoch": epoch})

    async def set_policy(
        self, router: str | None = None, router_params: dict | None = None, eviction: dict[str, dict] | None = None
    ) -> PolicyReply:
        """Switch the router and/or tiers' eviction policies (``{tier: {"policy", "params"}}``) at run time."""
        body = {"router": router, "router_params": router_params or {}, "eviction": eviction}
        return await self._typed(PolicyReply, "POST", "/v1/policy", body)

    async def sessions(self, tenant: str | None = None) -> list[SessionInfo]:
        """The sessions the front served (one tenant's, or all), as it last saw them: every page."""
        found: list[SessionInfo] = []
        offset: int | None = 0
        while offset is not None:
            query = f"?offset={offset}" + (f"&tenant={quote(tenant)}" if tenant is not None else "")
            page = await self._typed(SessionsReply, "GET", "/v1/sessions" + query)
            found += page.sessions
            offset = page.next_offset
        return found

    async def change_session(
        self,
        session: str,
        tenant: str = "default",
        *,
        close: bool = False,
        retain_s: float | None = None,
        priority: int | None = None,
    ) -> SessionInfo:
        """Close a session (its KV goes first everywhere), or keep it ``retain_s`` / at ``priority``;
        ``session`` is its id as ``sessions()`` lists it."""
        body = {"tenant": tenant, "close": close, "retain_s": retain_s, "priority": priority}
        path = f"/v1/sessions/{quote(session, safe='')}"
        return (await self._typed(SessionsReply, "POST", path, body)).sessions[0]

    async def members(self) -> list[MemberInfo]:
        return (await self._typed(MembersReply, "GET", "/v1/members")).members

    async def leader(self) -> ConductorInfo | None:
        """The leading conductor (None while there is none)."""
        return (await self._typed(LeaderReply, "GET", "/v1/leader")).leader

    async def object_map(self) -> ObjectMap:
        """Who owns each slot of the key-value store's objects."""
        return await self._typed(ObjectMap, "GET", "/v1/objects/map")

    async def seed_object_map(self, offered: ObjectMap) -> SlotReportsReply:
        """Offer a node's last object map to a conductor that has none (after it lost its backend)."""
        return await self._typed(SlotReportsReply, "POST", "/v1/objects/seed", offered.model_dump(mode="json"))

    async def release_node(self, node: str) -> NodeReleaseReply:
        """``node`` gone for good: the slots it pinned move, and what it alone persisted is lost."""
        return await self._typed(NodeReleaseReply, "POST", "/v1/objects/release", {"node": node})

    async def slot_reports(self, reports: list[SlotReady]) -> SlotReportsReply:
        """A primary's word that backups now hold its slots whole (or no more: ``lagging``), or took
        them over (``handed_off``); per report, '' or why it was refused."""
        return await self._typed(
            SlotReportsReply, "POST", "/v1/objects/reports", {"reports": [r.model_dump() for r in reports]}
        )


BATCH_KEYS = 16384  # block keys per placement request (the server takes up to MAX_KEYS)


def _packed(keys: Sequence[bytes]) -> str:
    """Block keys as the control API takes them: back to back, base64."""
    return base64.b64encode(b"".join(keys)).decode()


async def _keyed(client: Client, model: type[R], path: str, body: dict, read: bool = False) -> R:
    """A request that carries block keys, packed; to a conductor of the release before (it answers
    the packed form with a 400 on ``keys``, ``chains`` or ``blocks``), as hex lists from then on."""
    if not client.hex_keys:
        try:
            return await client._typed(model, "POST", path, body, read=read)
        except ConductorError as exc:
            refused = str(exc)
            if exc.status != 400 or not any(s in refused for s in ("valid array", "valid list", "blocks")):
                raise
        log.info("the conductor is of an earlier release: block keys go to it as hex lists")
        client.hex_keys = True
    return await client._typed(model, "POST", path, _hex_keys(body), read=read)


def _hex_keys(body: dict) -> dict:
    """A request's packed keys as the release before takes them: hex lists, and a batch with sizes as
    a list of blocks."""

    def hexes(packed: str) -> list[str]:
        raw = base64.b64decode(packed)
        return [raw[i : i + 32].hex() for i in range(0, len(raw), 32)]

    out = dict(body)
    if "chains" in out:
        out["chains"] = [hexes(chain) for chain in out["chains"]]
    if "keys" in out:
        out["keys"] = hexes(out["keys"])
    if "sizes" in out and "node" in out:
        out["blocks"] = [{"key": k, "size": s} for k, s in zip(out.pop("keys"), out.pop("sizes"), strict=True)]
    return out


def _batch(tenant: str, node: str, tier: str, keys: list[bytes], sizes: list[int] | None = None) -> dict:
    """A placement change's body: blocks of one tenant on one node and tier (with sizes: additions)."""
    body: dict[str, Any] = {"tenant": tenant, "node": node, "tier": tier, "keys": _packed(keys)}
    if sizes is not None:
        body["sizes"] = list(sizes)
    return body


def _serving_headers(tenant: str | None, session: Session | None) -> dict[str, str]:
    headers = {"X-Tiercake-Tenant": tenant} if tenant else {}
    return headers | session.headers() if session is not None else headers


async def _server_sent(resp: aiohttp.ClientResponse):
    """A streamed completion's chunks, each a dict, until ``[DONE]``; an error event (the status was
    200 already: its type tells what it stands for) or a stream cut short is a ``ConductorError``."""
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = parse_error(chunk, 502)
            raise ConductorError(429 if error.type == "rate_limit_error" else 502, error.message, error.code)
        yield chunk
    raise ConductorError(502, "the stream ended without [DONE]: the response is incomplete")


class NodeDirectory:
    """The live node agents, from the member list, kept for a process that moves blocks to and from
    them (a worker, vLLM's connector, the key-value store): each known to ``engine`` (a
    ``TransferEngine``) by its advertised address. ``refresh`` asks again at most every ``every``
    seconds unless forced; ``to_node`` runs a transfer against a node, learning it first if unknown and
    once more after asking again when it could not be reached (a restarted node agent may listen
    elsewhere). ``moved_only``: that second attempt only when the node is listed at another address
    (on a serving path, a node that stalls would otherwise cost a second deadline)."""

    def __init__(self, client: Client, engine, every: float = 0.5, moved_only: bool = False) -> None:
        self.client, self.engine, self.every, self.moved_only = client, engine, every, moved_only
        self.members: dict[str, MemberInfo] = {}
        self._asked_at = -float("inf")

    def __contains__(self, node: object) -> bool:
        return node in self.members

    async def refresh(self, force: bool = True) -> None:
        if not force and time.monotonic() - self._asked_at < self.every:
            return
        self._asked_at = time.monotonic()
        members = {m.node_id: m for m in await self.client.members() if m.role == "node"}
        if self.engine is not None:
            for m in members.values():
                self.engine.ensure_peer(m.node_id, m.host, m.port)
        self.members = members

    async def to_node(self, node: str, attempt: Callable[[], Awaitable[list[TransferResult]]]) -> list[TransferResult]:
        from tiercake.transfer import unreachable

        if node not in self.members and self.engine.address(node) is None:
            await self.refresh()
        results = await attempt()
        if unreachable(results):
            known = self.engine.address(node)
            try:
                await self.refresh()
            except ConductorError:  # no second chance to learn of: the transfer's own failure stands
                return results
            if node in self.members and not (self.moved_only and self.engine.address(node) == known):
                results = await attempt()
        return results
