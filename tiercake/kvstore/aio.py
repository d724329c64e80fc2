"""``AsyncStore``: Mooncake Store's object API over a running tiercake cluster, for asyncio callers.

Each object's name picks its slot, and the object map (from the conductor, fetched once and again
only when a node says it moved on) names the slot's primary: every call goes straight to the nodes
that own its objects, one request per node, whatever the number of objects, and the conductor is
not asked on the way. The contract (docs/ARCHITECTURE.md, "The key-value store"):

- per object, linearizable: a get sees the last completed write; an upsert is atomic (old value or
  new, never nothing, never a mix); of racing first puts one value wins and stays (Mooncake's rule: a
  put of a present name succeeds and keeps the first value); a remove is final;
- what ``Durability`` asks is kept before a put returns: ``replicas`` nodes hold the object (its
  slot's primary and backups: a node's death loses nothing), ``persist`` puts it on each one's SSD,
  synced. At the memory level it is a cache the node may evict, but a node agent restart does not
  lose it (the pool is adopted);
- a get or an exists grants Mooncake's read lease: the object is not evicted, nor removed unless by
  force, for ``objects.lease_ttl_s`` (5 s);
- a node that cannot answer (restarting, or its slots moving to another) is asked again, with the
  map fetched anew, for up to ``retry_s``; a write whose request reached a node that then failed is
  not sent again: its outcome is unknown (``TransferFailed``), as Mooncake's TRANSFER_FAIL.

Bytes move on the node's transfer port: on the stream (one round trip), or on the same host, for
large objects, through the node's shared pool (the client copies in place).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiercake.blocks import object_id, object_slot
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import ObjectMap
from tiercake.tiers.buffers import is_tensor, size_of
from tiercake.tiers.pool import PoolRegion
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import Channels, PeerConnection
from tiercake.transfer.protocol import (
    FLAG_EAGER,
    FLAG_NO_REPLY,
    FLAG_SHM,
    Op,
    Status,
    TransferError,
)
from tiercake.transfer.spin import SpinWait

from .errors import InvalidParams, NotReady, ObjectNotFound, RpcFailed, StoreApiError, TransferFailed
from .links import BlockingLinks, LinkNotOpened
from .requests import (
    MEMORY,
    Described,
    Durability,
    Item,
    NotSent,
    Outcome,
    Retry,
    chunks,
    deadline_s,
    device_bytes,
    exactly,
    finish_reads,
    get_request,
    get_results,
    get_targets,
    merged,
    name_bytes,
    outcome,
    put_request,
    put_results,
    query_results,
    readable,
    remove_results,
    unless_failed,
    writable,
)
from .same_host import SameHost
from .setup_args import client_credential

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SPIN_S = 300e-6  # a blocking connection's poll for a reply before it blocks (SpinWait)


class AsyncStore:
    SHM_MIN_BYTES = 1 << 20  # same host: objects read from this size go through the shared pool
    # and written from this one: below it a put on the stream is answered in one round trip by the
    # node's reader callback, where the pool's takes two through its event loop (docs/BENCHMARKS.md)
    SHM_PUT_MIN_BYTES = 4 << 20

    def __init__(
        self,
        conductors: str | Sequence[str],
        *,
        secret: bytes | str | None = None,
        tenant_key: bytes | str | None = None,
        token: str | None = None,
        tenant: str = "default",
        transports: Sequence[str] = ("shm", "tcp"),
        identity: str | None = None,
        ssl=None,
        streams: int = 2,
        conductor_timeout: float = 5.0,
        transfer_tls=None,
        retry_s: float = 30.0,
        timeout_s: float = 5.0,
        blocking: bool = False,
        spin_s: float = SPIN_S,
    ) -> None:
        """``conductors``: the conductor URLs; ``secret``: the cluster's transfer secret, or
        ``tenant_key``: the tenant's own key (``tiercake secret tenant``; it reaches that tenant's
        objects only, over the stream, and is the control API's token too); ``token``: the control
        token; ``tenant``: whose objects (tenants never see each other's); ``transports``:
        ``shm`` (same host, through the node's pool) and/or ``tcp``; ``ssl``: the conductors' TLS client
        context; ``transfer_tls``: the node agents' (``transfer.tls``); ``retry_s``: how long a call
        keeps asking when the owner of an object cannot answer; ``timeout_s``: how long one request
        to a node may take, plus its bytes at 20 MB/s (a node that stops answering fails its share of
        a call by then, not the whole call). ``blocking``: requests on the stream go on blocking
        connections, waited for in place: for a store whose event loop serves one blocking caller
        (the synchronous client's, ``threads.py``), where an asyncio wait costs more than the wait;
        ``spin_s``: how long such a connection polls for a reply before it blocks (``SpinWait``; 0:
        never; never on a single core, where polling only keeps the node from answering)."""
        if not isinstance(tenant, str) or not tenant or "/" in tenant or "#" in tenant or len(tenant.encode()) > 200:
            raise ValueError(f"a tenant is a non-empty name of at most 200 bytes without '/' or '#', got {tenant!r}")
        urls = [conductors] if isinstance(conductors, str) else list(conductors)
        self.tenant = tenant
        who = client_credential(secret, tenant_key, tenant, identity, token)
        self.identity = who.identity
        self.client = Client(urls, token=who.token, timeout=conductor_timeout, ssl=ssl)
        credential = who.credential
        self.channels = Channels(self.identity, credential, self._address, streams=streams, tls=transfer_tls)
        self.blocking = blocking
        self.stale = False  # a node answered with a newer map epoch than this store's (the fast path saw it)
        spin = SpinWait(spin_s)  # checks spin_s
        self.spin = spin if blocking and spin.budget_s > 0 else None
        # TLS: every byte on the encrypted stream; a tenant's key: the node's pool is not its to map
        self.shm = "shm" in transports and transfer_tls is None and who.may_map_pools
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.map = ObjectMap()
        self.members: dict[str, tuple[str, int]] = {}
        self.same_host = SameHost(tenant, self.shm)
        self.links = BlockingLinks(self.channels, self.identity, self.same_host, timeout_s, self.spin)
        self._map_lock = asyncio.Lock()
        self._refreshing: asyncio.Task | None = None  # a background fetch of the map, after a node failed

    async def open(self) -> AsyncStore:
        try:
            await self.refresh()
        except BaseException:
            await self.close()  # nothing of it is left open when it cannot start
            raise
        return self

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        self.channels.close()
        self.links.close()
        self.same_host.close()
        await self.client.close()

    async def __aenter__(self) -> AsyncStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def refresh(self, at_least: int = 0) -> None:
        """Fetch the object map and the node agents' addresses again."""
        async with self._map_lock:
            if at_least and self.map.epoch >= at_least:
                return
            try:
                fetched, members = await asyncio.gather(self.client.object_map(), self.client.members())
            except ConductorError as exc:
                raise RpcFailed(f"no conductor answered: {exc}") from None
            if fetched.epoch >= self.map.epoch:
                self.map = fetched
            moved = {m.node_id: (m.host, m.port) for m in members if m.role == "node"}
            for node, address in moved.items():
                if self.members.get(node) not in (None, address):
                    self.channels.forget(node)  # restarted elsewhere
                    self.links.forget(node)
                    self.same_host.drop(node)
            self.members = moved

    async def _address(self, node: str) -> tuple[str, int] | None:
        if node not in self.members:
            await self.refresh()
        return self.members.get(node)

    # Single objects: each a batch of one --------------------------------------------------------

    async def put(self, name: str, value, *, replace: bool = False, durability: Durability = MEMORY) -> None:
        """Store ``value`` (bytes, a buffer, an array or a tensor: its bytes) under ``name``; a present
        object keeps its first value unless ``replace`` (Mooncake's ``upsert``)."""
        unless_failed((await self.put_many([name], [value], replace=replace, durability=durability))[0])

    async def get(self, name: str) -> bytes:
        return bytes(await self.get_array(name))

    async def get_array(self, name: str) -> np.ndarray:
        """The object's bytes (a uint8 array of exactly its size)."""
        got = (await self.get_many([name]))[0]
        return unless_failed(got)

    async def get_tensor(self, name: str) -> torch.Tensor:
        import torch

        return torch.from_numpy(await self.get_array(name))

    async def get_into(self, name: str, buffer) -> int:
        """Read the object into ``buffer`` (writable, at least its size); returns its size."""
        got = (await self.get_many_into([name], [buffer]))[0]
        return unless_failed(got)

    async def exists(self, name: str) -> bool:
        return (await self.exists_many([name]))[0]

    async def get_size(self, name: str) -> int:
        return (await self.describe(name)).size

    async def describe(self, name: str) -> Described:
        got = (await self.describe_many([name]))[0]
        return unless_failed(got)

    async def remove(self, name: str, *, force: bool = False) -> None:
        unless_failed((await self.remove_many([name], force=force))[0])

    # Batches --------------------------------------------------------------------------------------

    async def put_many(
        self, names: Sequence[str], values: Sequence, *, replace: bool = False, durability: Durability = MEMORY
    ) -> list[Outcome]:
        """Store each value under the name beside it: None for each stored (or present already, without
        ``replace``), or why not. An object that failed leaves nothing behind. A name twice in one
        batch: the first value is stored, the second is Mooncake's second put of a name."""
        outcomes, items, like = self.plan_puts(names, values, replace, durability)
        return merged(outcomes, items, await self.put_items(items, like))

    def plan_puts(
        self, names: Sequence[str], values: Sequence, replace: bool, durability: Durability
    ) -> tuple[list, list[Item], w.PutItem]:
        """(outcomes so far: the refusals, the items to send, what each put asks)."""
        if len(names) != len(values):
            raise InvalidParams(f"{len(names)} keys for {len(values)} values")
        outcomes: list = [None] * len(names)
        items: list[Item] = []
        seen: dict[bytes, int] = {}
        for i, (name, value) in enumerate(zip(names, values)):
            try:
                raw = name_bytes(name)
                payload = readable(value)
                if not payload.size:
                    raise InvalidParams(f"object {name!r}: a value holds at least one byte")
            except InvalidParams as exc:
                outcomes[i] = exc
                continue
            oid = object_id(raw, self.tenant)
            if oid in seen and not replace:
                continue  # the first put of the name decides
            seen[oid] = i
            items.append(Item(i, raw, oid, payload=payload))
        pin = w.NO_SOFT_PIN if durability.soft_pin_ms is None else durability.soft_pin_ms
        if durability.keep_pin and replace:
            pin = w.KEEP_SOFT_PIN
        return (
            outcomes,
            items,
            w.PutItem(b"", 0, replace, durability.replicas, durability.persist, durability.hard_pin, pin),
        )

    async def put_items(self, items: list[Item], like: w.PutItem) -> dict[int, object]:
        return await self._dispatch(items, lambda node, group: self._put_on(node, group, like), writes=True)

    async def get_many(self, names: Sequence[str]) -> list[np.ndarray | StoreApiError]:
        """Each object's bytes (a uint8 array of exactly its size), or why not."""
        return await self._read_many(names, [None] * len(names))

    async def get_many_into(self, names: Sequence[str], buffers: Sequence) -> list[int | StoreApiError]:
        """Read each object into the buffer beside it; its size, or why not (a buffer too small is
        ``InvalidParams``, and nothing is written into it)."""
        if len(names) != len(buffers):
            raise InvalidParams(f"{len(names)} keys for {len(buffers)} buffers")
        got = await self._read_many(names, list(buffers))
        return [g if isinstance(g, StoreApiError) else g.size if isinstance(g, np.ndarray) else g for g in got]

    async def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each object exists (a read lease is granted on each found). ``StoreApiError`` when
        the cluster cannot tell (Mooncake answers -1 for those: ``exists_codes``)."""
        return [unless_failed(code) for code in await self.exists_codes(names)]

    async def exists_codes(self, names: Sequence[str]) -> list[bool | StoreApiError]:
        got = await self.describe_many(names)
        return [False if isinstance(g, ObjectNotFound) else g if isinstance(g, StoreApiError) else True for g in got]

    async def describe_many(self, names: Sequence[str], *, lease: bool = True) -> list[Described | StoreApiError]:
        outcomes, items = self.plan_names(names)
        return merged(outcomes, items, await self.query_items(items, lease))

    async def query_items(self, items: list[Item], lease: bool) -> dict[int, object]:
        return await self._dispatch(items, lambda node, group: self._query_on(node, group, lease), writes=False)

    async def remove_many(self, names: Sequence[str], *, force: bool = False) -> list[Outcome]:
        """Remove each object; None for each removed, or why not (``ObjectHasLease`` while a reader's
        lease holds it, unless ``force``)."""
        outcomes, items = self.plan_names(names)
        return merged(outcomes, items, await self.remove_items(items, force))

    async def remove_items(self, items: list[Item], force: bool) -> dict[int, object]:
        return await self._dispatch(items, lambda node, group: self._remove_on(node, group, force), writes=True)

    async def remove_all(self, *, force: bool = False) -> int:
        """Remove every object of this tenant; returns how many went. Objects a reader's lease holds
        stay (unless ``force``), as Mooncake's ``remove_all`` leaves them."""
        return await self.remove_matching(None, force=force)

    async def remove_matching(self, pattern: str | None, *, force: bool = False) -> int:
        """Remove every object of this tenant whose name matches the regular expression ``pattern``
        (a search with RE2's semantics, on each node off its event loop; None: every object); returns
        how many went."""
        if pattern is not None and not isinstance(pattern, str):
            raise InvalidParams("a pattern is a str")
        removed, deadline = 0, time.monotonic() + self.retry_s
        while True:
            await self.refresh()
            nodes = sorted({chain[0] for chain in self.map.chains if chain})
            answers = await asyncio.gather(*(self._remove_every_on(n, pattern, force) for n in nodes))
            removed += sum(count for count, _ in answers)
            again = [why for _, why in answers if why is not None]
            if not again:
                return removed
            if time.monotonic() > deadline:  # some objects could not be removed in time: how many is unknown
                raise TransferFailed(f"{removed} removed, and not all: {again[0]}")
            await asyncio.sleep(0.05)

    # Routing and retrying -----------------------------------------------------------------------

    def plan_names(self, names: Sequence[str]) -> tuple[list, list[Item]]:
        """(outcomes so far: the bad names, an item for each good one)."""
        outcomes: list = [None] * len(names)
        items = []
        for i, name in enumerate(names):
            try:
                raw = name_bytes(name)
            except InvalidParams as exc:
                outcomes[i] = exc
                continue
            items.append(Item(i, raw, object_id(raw, self.tenant)))
        return outcomes, items

    def plan_reads(self, names: Sequence[str], buffers: list) -> tuple[list, list[Item]]:
        """``plan_names``, with each item's buffer to read into (None: one of the object's size)."""
        outcomes, items = self.plan_names(names)
        for it in items:
            buffer = buffers[it.index]
            if buffer is None:
                continue
            try:
                if is_tensor(buffer) and buffer.device.type != "cpu":
                    it.device = device_bytes(buffer)
                    it.out = np.empty(size_of(it.device), dtype=np.uint8)
                else:
                    it.out = writable(buffer)
            except InvalidParams as exc:
                outcomes[it.index] = exc
        return outcomes, [it for it in items if outcomes[it.index] is None]

    async def get_items(self, items: list[Item]) -> dict[int, object]:
        return await self._dispatch(items, self._get_on, writes=False)

    async def _read_many(self, names: Sequence[str], buffers: list) -> list:
        outcomes, items = self.plan_reads(names, buffers)
        return finish_reads(outcomes, items, await self.get_items(items))

    async def _dispatch(
        self, items: list[Item], send: Callable[[str, list[Item]], Awaitable[dict]], writes: bool
    ) -> dict[int, object]:
        """Send each item to its slot's primary, a request per node, until every item has its outcome
        (asking again, with the map fetched anew, those a node could not take) or ``retry_s`` is over."""
        results: dict[int, object] = {}
        pending = items
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        away: set[str] = set()  # nodes of pinned slots absent from the members, in a round of this call
        if pending and not self.map.chains:
            await self.refresh()
        while pending:
            groups: dict[str, list[Item]] = defaultdict(list)
            for it in pending:
                slot = object_slot(it.oid, self.map.slots) if self.map.slots else 0
                node = self.map.primary(slot) if self.map.slots else None
                if node is None:
                    results[it.index] = Retry("no node owns its slot yet")
                elif node not in self.members and self.map.pinned.get(slot) == node:
                    # away, as the members fetched before this round say too (the round before asked
                    # for them): what it alone persisted is unavailable, not lost
                    results[it.index] = (
                        NotReady(
                            f"object {it.name[:80]!r}: its node {node} is away, and what it persisted is there "
                            "alone: readable again once it is back"
                        )
                        if node in away
                        else Retry(f"its node {node} is away")
                    )
                    away.add(node)
                else:
                    groups[node].append(it)
            if not groups:
                answers = []
            elif len(groups) == 1:  # the common case: no task for it
                answers = [await self._guarded(*next(iter(groups.items())), send, writes)]
            else:
                answers = await asyncio.gather(
                    *(self._guarded(node, group, send, writes) for node, group in groups.items())
                )
            for answer in answers:
                results.update(answer)
            retries = {it.index: r for it in pending if isinstance(r := results.get(it.index), Retry)}
            pending = [it for it in pending if it.index in retries]
            if not pending:
                break
            if time.monotonic() + delay > deadline:
                for it in pending:
                    results[it.index] = TransferFailed(
                        f"object {it.name[:80]!r}: {retries[it.index].why} (asked for {self.retry_s:.0f} s)"
                    )
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            if any(r.refresh for r in retries.values()):
                try:
                    await self.refresh()
                except RpcFailed as exc:
                    log.warning("kvstore: %s", exc)
        return results

    async def _guarded(self, node: str, group: list[Item], send, writes: bool) -> dict[int, object]:
        """``send`` one node's items in requests of at most ``MAX_ITEMS`` items (and, for puts,
        ``MAX_REQUEST_BYTES``); a node that cannot be reached has its items asked again."""
        answers: dict[int, object] = {}
        for chunk in chunks(group):
            try:
                async with asyncio.timeout(deadline_s(self.timeout_s, chunk)):
                    answers.update(await send(node, chunk))
            except NotSent as exc:
                self.channels.forget(node)
                self.links.forget(node)
                answers.update({it.index: Retry(f"{node} could not be reached: {exc.__cause__}") for it in chunk})
            except (TransferError, OSError, TimeoutError) as exc:
                self.channels.forget(node)
                self.links.forget(node)
                self._refresh_soon()  # the node may have lost its slots meanwhile: the next call knows
                if writes:  # it may have been applied: not sent again
                    answers.update(
                        {it.index: TransferFailed(f"{node} failed mid-request: {exc or 'timed out'}") for it in chunk}
                    )
                else:
                    answers.update({it.index: Retry(f"{node} failed mid-request: {exc}") for it in chunk})
        return answers

    async def _connection(self, node: str):
        try:
            # a connection not made within half the timeout was not made (a host cut off drops the
            # attempt): nothing was sent, so a write may go to the slot's next owner; past the whole
            # timeout, the request's own deadline would call its outcome unknown
            async with asyncio.timeout(self.timeout_s / 2):
                channel = await self.channels.get(node)
                lent = channel.connection()
                conn = await lent.__aenter__()
        except (TransferError, OSError, RpcFailed, TimeoutError) as exc:
            raise NotSent() from exc
        return lent, conn

    async def _on(self, node: str, call: Callable[[PeerConnection], Awaitable]):
        lent, conn = await self._connection(node)
        try:
            return await call(conn)
        finally:
            await lent.__aexit__(None, None, None)

    async def _exchange(
        self, node: str, op: Op, answer: Op, body: bytes, flags: int = 0, data=(), receive=None, timeout=None
    ) -> bytearray:
        """One request on the stream: on an asyncio connection, or a blocking one (``blocking``)."""
        if not self.blocking:
            await self._flush_notes(node)
            return await self._on(node, lambda conn: conn.exchange(op, answer, body, flags, data, receive))
        address = await self._address(node)
        if address is None:
            raise NotSent() from TransferError(f"node {node} is not a live member")
        try:
            return self.links.exchange(node, address, self.map.epoch, op, answer, body, flags, data, receive, timeout)
        except LinkNotOpened as exc:
            raise NotSent() from exc

    def _note_epoch(self, epoch: int) -> None:
        if epoch > self.map.epoch:
            asyncio.get_running_loop().create_task(self._refresh_quietly(epoch))

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly(0))

    async def _refresh_quietly(self, epoch: int) -> None:
        try:
            await self.refresh(at_least=epoch)
        except RpcFailed as exc:
            log.warning("kvstore: %s", exc)

    # One node's share ---------------------------------------------------------------------------

    async def _put_on(self, node: str, group: list[Item], like: w.PutItem) -> dict[int, object]:
        region = None
        if any(it.data.size >= self.SHM_PUT_MIN_BYTES and not it.stream for it in group):
            region = await self.same_host.pool(node, self.channels)
        pooled: list[Item] = []
        streamed: list[Item] = []
        for it in group:  # (one pass: a membership test compared items field by field, n^2 of them)
            through = region is not None and it.data.size >= self.SHM_PUT_MIN_BYTES and not it.stream
            (pooled if through else streamed).append(it)
        out: dict[int, object] = {}
        if pooled and region is not None:
            request = put_request(self.tenant, self.map.epoch, pooled, like)

            async def through_pool(conn: PeerConnection, region: PoolRegion = region) -> w.PutReply:
                return await self._put_through_pool(conn, region, request, pooled)

            reply = await self._on(node, through_pool)
            self._note_epoch(reply.epoch)
            out.update(put_results(reply, pooled))
        if streamed:
            data = [it.data for it in streamed if it.data.size]
            body = await self._exchange(
                node,
                Op.OBJ_PUT,
                Op.OBJ_PUT_REPLY,
                w.encode(put_request(self.tenant, self.map.epoch, streamed, like)),
                FLAG_EAGER,
                data,
                timeout=deadline_s(self.timeout_s, group),
            )
            reply = w.decode(w.PutReply, body)
            self._note_epoch(reply.epoch)
            out.update(put_results(reply, streamed))
        return out

    async def _put_through_pool(
        self, conn: PeerConnection, region: PoolRegion, request: w.PutRequest, group: list[Item]
    ) -> w.PutReply:
        self._check_pool(conn, region)
        async with conn.request() as rid:
            from tiercake.transfer.sockio import send_frame

            await send_frame(conn.sock, Op.OBJ_PUT, rid, w.encode(request), FLAG_SHM)
            ready = w.decode(w.PutReady, await conn.reply(rid, Op.OBJ_PUT_READY))
            copies = [(offset, it.data) for offset, it in zip(exactly(ready.offsets, group), group) if offset >= 0]

            def copy_all() -> None:
                for offset, payload in copies:
                    region.host_array(offset, payload.size)[:] = payload

            if sum(p.size for _, p in copies) > 4 << 20:
                await asyncio.to_thread(copy_all)  # a large copy off the event loop
            else:
                copy_all()
            await send_frame(conn.sock, Op.OBJ_PUT_COMMIT, rid)
            return w.decode(w.PutReply, await conn.reply(rid, Op.OBJ_PUT_REPLY))

    def _check_pool(self, conn: PeerConnection, region: PoolRegion) -> None:
        """Before anything of a request through the pool is sent: the pool mapped here is the one the
        node serves now (a node restarted at the same address on a new pool file would otherwise
        reserve offsets in its new pool that this process copies into the old one: acknowledged
        puts of bytes it never got). Else the old mapping goes and the request is asked again."""
        if conn.info is None or conn.info.pool_id != region.instance:
            self.same_host.drop(conn.address.node_id)
            raise NotSent() from TransferError(f"{conn.address.node_id} serves another pool now")

    async def _get_on(self, node: str, group: list[Item]) -> dict[int, object]:
        out, group = await self._from_directory(node, group)
        if group:
            out.update(await self._get_asked(node, group))
        return out

    async def _get_asked(self, node: str, group: list[Item]) -> dict[int, object]:
        region = None
        if any(it.out is not None and it.out.size >= self.SHM_MIN_BYTES and not it.stream for it in group):
            region = await self.same_host.pool(node, self.channels)
        pooled = [
            it
            for it in group
            if region is not None and it.out is not None and it.out.size >= self.SHM_MIN_BYTES and not it.stream
        ]
        streamed = [it for it in group if it not in pooled]
        out: dict[int, object] = {}
        if pooled and region is not None:
            out.update(await self._get_through_pool(node, region, pooled))
        if streamed:
            out.update(await self._get_streamed(node, streamed))
        return out

    async def _get_streamed(self, node: str, group: list[Item]) -> dict[int, object]:
        request = get_request(self.tenant, self.map.epoch, group)
        decoded: list[w.GetReply] = []

        def targets(body: bytearray) -> list:
            decoded.append(w.decode(w.GetReply, body))
            return get_targets(decoded[0], group, node)

        await self._exchange(
            node,
            Op.OBJ_GET,
            Op.OBJ_GET_REPLY,
            w.encode(request),
            receive=targets,
            timeout=deadline_s(self.timeout_s, group),
        )
        self._note_epoch(decoded[0].epoch)
        return get_results(decoded[0], group)

    async def _get_through_pool(self, node: str, region: PoolRegion, group: list[Item]) -> dict[int, object]:
        request = w.GetRequest(self.tenant, self.map.epoch, [w.GetItem(it.name, it.buffer.size) for it in group])

        async def call(conn: PeerConnection) -> w.GetReply:
            self._check_pool(conn, region)
            reply = w.decode(w.GetReply, await conn.exchange(Op.OBJ_GET, Op.OBJ_GET_REPLY, w.encode(request), FLAG_SHM))
            leased = [(it, got) for it, got in zip(group, exactly(reply.items, group)) if got.status == Status.OK]

            def copy_all() -> None:
                for it, got in leased:
                    it.buffer[: got.size] = region.host_array(got.offset, got.size)

            try:
                if sum(got.size for _, got in leased) > 4 << 20:
                    await asyncio.to_thread(copy_all)
                else:
                    copy_all()
            finally:
                if leased:
                    await conn.send_only(Op.OBJ_RELEASE, w.encode(w.ReleaseRequest([g.lease for _, g in leased])))
            return reply

        reply = await self._on(node, call)
        self._note_epoch(reply.epoch)
        out: dict[int, object] = {}
        for it, got in zip(group, reply.items):
            if got.status == Status.OK:
                out[it.index] = it.buffer[: got.size]
            elif got.status == Status.NOT_IN_MEMORY:
                it.stream = True  # on the node's disk only: the stream brings it
                out[it.index] = Retry("not in the pool", refresh=False)
            else:
                out[it.index] = outcome(got.status, got.message, it.name, write=False)
        return out

    async def _query_on(self, node: str, group: list[Item], lease: bool) -> dict[int, object]:
        request = w.QueryRequest(self.tenant, self.map.epoch, [it.name for it in group], lease)
        body = await self._exchange(node, Op.OBJ_QUERY, Op.OBJ_QUERY_REPLY, w.encode(request))
        reply = w.decode(w.QueryReply, body)
        self._note_epoch(reply.epoch)
        return query_results(reply, group)

    async def _remove_on(self, node: str, group: list[Item], force: bool) -> dict[int, object]:
        request = w.RemoveRequest(self.tenant, self.map.epoch, [it.name for it in group], force)
        body = await self._exchange(node, Op.OBJ_REMOVE, Op.OBJ_REMOVE_REPLY, w.encode(request))
        reply = w.decode(w.RemoveReply, body)
        self._note_epoch(reply.epoch)
        return remove_results(reply, group)

    async def _remove_every_on(self, node: str, pattern: str | None, force: bool) -> tuple[int, str | None]:
        """(how many ``node`` removed, why it could not remove the rest now: None when it could)."""
        request = w.RemoveRequest(self.tenant, self.map.epoch, [], force, True, pattern)
        try:
            body = await self._on(
                node, lambda conn: conn.exchange(Op.OBJ_REMOVE, Op.OBJ_REMOVE_REPLY, w.encode(request))
            )
        except NotSent as exc:
            raise TransferFailed(f"{node} could not be reached: {exc.__cause__}") from None
        except (TransferError, OSError) as exc:
            raise TransferFailed(f"{node} failed mid-request: {exc}") from None
        reply = w.decode(w.RemoveReply, body)
        self._note_epoch(reply.epoch)
        for r in reply.results:
            answer = outcome(r.status, r.message, b"", write=True)
            if isinstance(answer, Retry):
                return reply.removed, answer.why  # the rest of its objects: ask again
            if answer is not None:
                raise answer
        return reply.removed, None

    # The shared pool of a node on this host -----------------------------------------------------

    async def _from_directory(self, node: str, group: list[Item]) -> tuple[dict[int, object], list[Item]]:
        """Same host: the items the node's directory has, copied straight out of its pool (no round
        trip), and those left to ask it for."""
        if not self.shm or (not self.same_host.mapped(node) and await self.same_host.pool(node, self.channels) is None):
            return {}, group
        reader = self.same_host.directory(node)
        if reader is None:
            return {}, group
        found: dict[int, object] = {}
        rest = []
        for it in group:
            got = reader.read(it.oid, it.out) if it.device is None else None
            if isinstance(got, np.ndarray):
                found[it.index] = got
            else:
                rest.append(it)  # not there (or the buffer is too small: the node says so)
        # Mooncake's read lease, granted as the node would for a get: noted, and told the node ahead of
        # the next request to it (``SameHost``), or once enough are noted
        if found and self.same_host.note_reads(node, [it.name for it in group if it.index in found]):
            await self._flush_notes(node)
        return found, rest

    async def _flush_notes(self, node: str) -> None:
        note = self.same_host.take_note(node, self.map.epoch)
        if note is not None:
            await self._send_only(node, Op.OBJ_QUERY, note, FLAG_NO_REPLY)

    async def _send_only(self, node: str, op: Op, body: bytes, flags: int) -> None:
        try:
            if self.blocking and self.links.send_only(node, op, body, flags):
                return
            await self._on(node, lambda conn: conn.send_only(op, body, flags))
        except (TransferError, OSError, NotSent) as exc:
            log.info("kvstore: a note to %s was lost (%s): its read leases are not granted", node, exc)
            self.links.forget(node)
