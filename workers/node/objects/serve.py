"""The key-value store's operations as a node answers them on its transfer port (``object_wire.py``).

Each request is about objects of one tenant; each item is answered on its own. The primary of an
item's slot (``Ownership.serves``) does the work; any other node answers WRONG_OWNER or UNAVAILABLE
and the client finds the right one.

A put stages each item's new version (its block reserved, the bytes received straight into it),
then, per item under that object's lock: a present object keeps its first value unless the put is an
upsert (Mooncake's rule), the new state goes to the slot's backups when it is replicated, and only
then is it installed, in one step, and acknowledged. A get reads the current version under a
store lease (the block cannot go while its bytes are sent) and grants Mooncake's read lease. A
remove, under the object's lock, is refused while a read lease holds the object (unless forced),
goes to the backups, then leaves the table.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import numpy as np

from tiercake.blocks import object_id
from tiercake.tiers import ObjectNotFoundError, StoreError, TierFullError
from tiercake.tiers.objects import Meta, ObjectTable, Staged, Stored, kept_pin
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import (
    FLAG_EAGER,
    FLAG_NO_REPLY,
    FLAG_SHM,
    NODE,
    TENANT,
    Op,
    PeerIdentity,
    ProtocolError,
    Status,
)
from tiercake.transfer.sockio import receive_or_discard, recv_frame, send_frame

from .answer_now import AnswerNow
from .batches import await_every
from .forbidden import TENANT_REQUESTS, refuse_foreign
from .ownership import Ownership
from .remove import Remover
from .replication import BackupSide, Replicator, ReplicaUnsafe, replica_of

log = logging.getLogger(__name__)

SHM_LEASE_S = 30.0  # a same-host reader that dies holds its objects' blocks this long at most
OBJECT_OPS = (Op.OBJ_PUT, Op.OBJ_GET, Op.OBJ_RELEASE, Op.OBJ_QUERY, Op.OBJ_REMOVE, Op.OBJ_REPLICATE)
# what the server counts: requests by operation, and refusals: "replicate_forged" (a peer that is not
# the node it names as the slot's primary), "replicate_refused" (a node that is not the primary by this
# node's map), "forbidden" (a tenant's key asking for another tenant's objects)
COUNTS = ("put", "get", "query", "remove", "replicate", "replicate_forged", "replicate_refused", "forbidden")
# the request each operation a tenant's key may send carries (its ``tenant`` is checked)
_REQUESTS = {
    Op.OBJ_PUT: w.PutRequest,
    Op.OBJ_GET: w.GetRequest,
    Op.OBJ_QUERY: w.QueryRequest,
    Op.OBJ_REMOVE: w.RemoveRequest,
}


class ObjectServer(AnswerNow):
    """The transfer server's hook for object operations (``TransferServer(objects=...)``)."""

    ops = OBJECT_OPS

    def __init__(
        self, node_id: str, table: ObjectTable, ownership: Ownership, replicator: Replicator, pool_tier: str | None
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.ownership = ownership
        self.replicator = replicator
        self.backup = BackupSide(node_id, table, ownership)
        self.remover = Remover(table, ownership, replicator, self._owner_check)
        self.pool_tier = pool_tier
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)

    @property
    def directory_path(self) -> str | None:
        """Where same-host readers find this node's directory of objects (``PeerInfo.objects_path``)."""
        directory = self.table.directory
        return str(directory.path) if directory is not None else None

    async def handle(
        self,
        conn: socket.socket,
        peer: PeerIdentity,
        op: Op,
        flags: int,
        request: int,
        body: bytearray,
        deadline: Callable[[int], object],
    ) -> None:
        """Answer one request of ``peer``; ``deadline(nbytes)`` is the server's watchdog for the bytes
        it moves. A tenant's key reaches that tenant's objects only: every item of a request for
        another tenant is answered FORBIDDEN."""
        if peer.kind == TENANT and op is not Op.OBJ_REPLICATE:
            decoded = w.decode(TENANT_REQUESTS[op], body)
            if decoded.tenant != peer.name:
                self.counts["forbidden"] += 1
                await refuse_foreign(conn, op, flags, request, decoded, peer, self.ownership.map.epoch, deadline)
                return
        if op is Op.OBJ_PUT:
            await self._put(conn, flags, request, w.decode(w.PutRequest, body), deadline)
        elif op is Op.OBJ_GET:
            await self._get(conn, flags, request, w.decode(w.GetRequest, body), deadline)
        elif op is Op.OBJ_RELEASE:
            await self.table.store.release_leases(w.decode(w.ReleaseRequest, body).leases)
        elif op is Op.OBJ_QUERY:
            reply = self._query(w.decode(w.QueryRequest, body))
            if not flags & FLAG_NO_REPLY:  # without: a same-host reader's note of what it read (the leases)
                await send_frame(conn, Op.OBJ_QUERY_REPLY, request, w.encode(reply))
        elif op is Op.OBJ_REMOVE:
            removed = await self._remove(w.decode(w.RemoveRequest, body))
            await send_frame(conn, Op.OBJ_REMOVE_REPLY, request, w.encode(removed))
        elif op is Op.OBJ_REPLICATE:
            await self._replicate(conn, peer, request, w.decode(w.ReplicateRequest, body), deadline)
        else:
            raise ProtocolError(f"{op.name} is not an object request")

    # Put ----------------------------------------------------------------------------------------

    async def _put(self, conn, flags: int, request: int, req: w.PutRequest, deadline) -> None:
        self.counts["put"] += 1
        shm = bool(flags & FLAG_SHM)
        if shm == bool(flags & FLAG_EAGER):
            raise ProtocolError("an object put's bytes come either eagerly on the stream or through the pool")
        if shm and self.pool_tier is None:
            raise ProtocolError("this node has no shared pool to put objects into")
        staged = [await self._stage(req, item, shm) async for item in await_every(req.items)]
        try:
            with deadline(sum(item.size for item in req.items)):
                if shm:
                    offsets = [s.handle.copy.slot[0] + s.offset if isinstance(s, Staged) else -1 for s in staged]
                    ready = w.PutReady(
                        self.ownership.map.epoch,
                        offsets,
                        [s if isinstance(s, w.Result) else w.Result(Status.OK) for s in staged],
                    )
                    await send_frame(conn, Op.OBJ_PUT_READY, request, w.encode(ready))
                    await recv_frame(conn, expect=[Op.OBJ_PUT_COMMIT])  # the client copied into the pool
                else:
                    await receive_or_discard(
                        conn,
                        [
                            (s.payload_array() if isinstance(s, Staged) else None, item.size)
                            for s, item in zip(staged, req.items)
                        ],
                    )
            if len(staged) == 1 or not any(item.persist or self._forwards(req, item) for item in req.items):
                results = [  # no task each
                    await self._finish_put(req, item, s) async for item, s in await_every(zip(req.items, staged))
                ]
            else:  # backups or a disk to wait for: the items' round trips and syncs overlap (the SSD log
                # writes what is in flight together, one sync for all: serially, 4,096 syncs)
                results = await asyncio.gather(*(self._finish_put(req, item, s) for item, s in zip(req.items, staged)))
        finally:
            for s in staged:
                if isinstance(s, Staged) and not s.handle.done:
                    await self.table.abort(s)
        await send_frame(conn, Op.OBJ_PUT_REPLY, request, w.encode(w.PutReply(self.ownership.map.epoch, results)))

    def _forwards(self, req: w.PutRequest, item: w.PutItem) -> bool:
        """The item's write goes to backups too (its put waits for them)."""
        if item.replicas > 1 or not item.name:
            return item.replicas > 1
        oid = object_id(item.name, req.tenant)
        old = self.table.get(oid)
        return (old is not None and old.meta.replicas > 1) or self.replicator.wants(
            self.ownership.slot_of(oid), replicated=False
        )

    async def _stage(self, req: w.PutRequest, item: w.PutItem, shm: bool) -> Staged | w.Result:
        if not item.name or not req.tenant:
            return w.Result(Status.INVALID, "an object needs a name and a tenant")
        oid = object_id(item.name, req.tenant)
        refused = self._owner_check(oid, req.epoch) or self._check_put(item, self.ownership.slot_of(oid))
        if refused is not None:
            return refused
        if not item.upsert and self.table.get(oid) is not None:
            return w.Result(Status.EXISTS)  # Mooncake keeps the first value: no need for the bytes
        meta = Meta(item.replicas, item.persist, item.hard_pin, None if item.soft_pin_ms < 0 else item.soft_pin_ms)
        if item.soft_pin_ms < w.KEEP_SOFT_PIN:
            return w.Result(Status.INVALID, f"a soft pin's TTL is not negative, got {item.soft_pin_ms}")
        try:
            staged = self.table.stage_now(oid, req.tenant, item.name, item.size, meta) or await self.table.stage(
                oid, req.tenant, item.name, item.size, meta
            )
        except TierFullError as exc:
            return w.Result(Status.FULL, str(exc))
        except (StoreError, ValueError) as exc:
            return w.Result(Status.INVALID, str(exc))
        if shm and staged.handle.tier != self.pool_tier:
            await self.table.abort(staged)
            return w.Result(Status.NOT_IN_MEMORY, "the pool cannot take it: send it on the stream")
        return staged

    def _check_put(self, item: w.PutItem, slot: int) -> w.Result | None:
        if item.size < 0:
            return w.Result(Status.INVALID, f"an object's size is not negative, got {item.size}")
        if not 1 <= item.replicas <= 255:
            return w.Result(Status.INVALID, f"replicas is 1 to 255, got {item.replicas}")
        nodes = 1 + len(self.ownership.backups(slot))
        if item.replicas > nodes:
            return w.Result(
                Status.FULL,
                f"{item.replicas} replicas asked, but this object's slot has {nodes} "
                "node(s) (objects.replicas_max, and the nodes alive)",
            )
        return None

    def _owner_check(self, oid: bytes, epoch: int) -> w.Result | None:
        status = self.ownership.serves(self.ownership.slot_of(oid), epoch)
        return None if status is None else w.Result(status, f"by map epoch {self.ownership.map.epoch}")

    async def _finish_put(self, req: w.PutRequest, item: w.PutItem, staged: Staged | w.Result) -> w.Result:
        if isinstance(staged, w.Result):
            return staged
        oid, slot = staged.oid, self.ownership.slot_of(staged.oid)
        async with self.table.lock(oid):
            refused = self._owner_check(oid, req.epoch)  # the map may have moved while the bytes came
            if refused is not None:
                return refused
            old = self.table.get(oid)
            if old is not None and not item.upsert:
                return w.Result(Status.EXISTS)  # a racing first put won: its value stays
            if item.persist and item.replicas <= 1 and not await self.replicator.reporter.pinned(slot):
                return w.Result(Status.REPLICA_FAILED, "the conductor could not be told this node holds it alone")
            version = max(old.version + 1 if old is not None else 0, time.time_ns())
            if item.soft_pin_ms == w.KEEP_SOFT_PIN:
                staged.meta = kept_pin(staged.meta, old)
            try:
                prepared = await self.table.prepare(staged, version)
            except TierFullError as exc:
                return w.Result(Status.FULL, str(exc))
            except (StoreError, OSError) as exc:
                return w.Result(Status.INTERNAL, str(exc))
            if item.replicas > 1 and len(self.replicator.forward_to.get(slot, ())) < item.replicas - 1:
                self.table.discard(prepared)  # nothing was sent: the client may ask again
                if len(self.ownership.backups(slot)) >= item.replicas - 1:
                    return w.Result(Status.UNAVAILABLE, "a backup of this slot is being copied it: ask again")
                return w.Result(Status.FULL, f"{item.replicas} replicas asked, the slot has fewer nodes")
            if item.replicas > 1 or (old is not None and old.meta.replicas > 1):
                replica = (
                    replica_of(prepared)
                    if item.replicas > 1
                    else w.Replica(req.tenant, item.name, version, removed=True)
                )  # no more on the backups
                payload = staged.payload_array() if item.replicas > 1 else None
                try:
                    acks = await self.replicator.forward(slot, replica, payload, replicated=True)
                except ReplicaUnsafe as exc:
                    self.table.discard(prepared)
                    return w.Result(Status.REPLICA_FAILED, str(exc))
                if acks < item.replicas - 1:
                    self.table.discard(prepared)
                    return w.Result(Status.REPLICA_FAILED, f"{acks + 1} of {item.replicas} nodes took it")
            if item.replicas <= 1 and self.replicator.wants(slot, replicated=False):
                await self.replicator.forward(slot, replica_of(prepared), staged.payload_array(), replicated=False)
            self.table.install(prepared)
        return w.Result(Status.OK)

    # Get ----------------------------------------------------------------------------------------

    async def _get(self, conn, flags: int, request: int, req: w.GetRequest, deadline) -> None:
        self.counts["get"] += 1
        shm = bool(flags & FLAG_SHM)
        answers: list[w.Got] = []
        data: list[np.ndarray] = []
        leases: list[int] = []
        try:
            for item in req.items:
                got, payload, lease = await self._read(req, item, shm)
                answers.append(got)
                if lease is not None:
                    leases.append(lease)
                if payload is not None:
                    data.append(payload)
            reply = w.encode(w.GetReply(self.ownership.map.epoch, answers))
            with deadline(sum(d.size for d in data)):
                await send_frame(conn, Op.OBJ_GET_REPLY, request, reply, 0, data)
            if shm:
                leases = []  # the reader releases them (OBJ_RELEASE), or they expire
        finally:
            if leases:
                await self.table.store.release_leases(leases)

    async def _read(self, req: w.GetRequest, item: w.GetItem, shm: bool):
        """(answer, bytes to send or None, store lease or None) for one item."""
        refusal, stored = self._readable(req, item)
        if refusal is not None:
            return refusal, None, None
        self.table.lease(stored)
        if stored.size == 0:
            return w.Got(Status.OK, 0, stored.version), None, None
        if shm:
            return self._lease_in_pool(stored)
        lease = self.table.read_lease(stored)
        if lease is None:
            try:
                payload = await self.table.read_disk(stored)
            except StoreError as exc:  # a corrupt copy: dropped by the store, never served
                return w.Got(Status.NOT_FOUND, message=str(exc)), None, None
            return w.Got(Status.OK, stored.size, stored.version), payload, None
        view = lease.host_array()[stored.offset : stored.offset + stored.size]
        return w.Got(Status.OK, stored.size, stored.version), view, lease.id

    def _lease_in_pool(self, stored: Stored):
        if self.pool_tier is None:
            return w.Got(Status.NOT_IN_MEMORY, message="no shared pool here"), None, None
        try:
            lease = self.table.store.acquire_lease(stored.block, SHM_LEASE_S, tier=self.pool_tier)
        except ObjectNotFoundError:
            return w.Got(Status.NOT_IN_MEMORY, stored.size, stored.version), None, None
        return w.Got(Status.OK, stored.size, stored.version, lease.slot[0] + stored.offset, lease.id), None, None

    # Query and remove (``remove.py``) ---------------------------------------------------------------------------

    def _query(self, req: w.QueryRequest) -> w.QueryReply:
        self.counts["query"] += 1
        items = []
        ages = req.ages_ms if len(req.ages_ms) == len(req.names) else None
        for i, name in enumerate(req.names):
            if not name:
                items.append(w.Described(Status.INVALID, message="an object needs a name"))
                continue
            oid = object_id(name, req.tenant)
            refused = self._owner_check(oid, req.epoch)
            if refused is not None:
                items.append(w.Described(refused.status, message=refused.message))
                continue
            stored = self.table.get(oid)
            if stored is None:
                items.append(w.Described(Status.NOT_FOUND))
                continue
            if req.lease:  # from when it was read (a note comes after the reads it tells of)
                self.table.lease(stored, 0.0 if ages is None else min(max(ages[i], 0), 60_000) / 1e3)
            slot = self.ownership.slot_of(oid)
            holders = [self.node_id] + (
                sorted(self.replicator.forward_to.get(slot, ())) if stored.meta.replicas > 1 else []
            )
            items.append(
                w.Described(Status.OK, stored.size, stored.version, stored.meta.replicas, stored.meta.persist, holders)
            )
        return w.QueryReply(self.ownership.map.epoch, items)

    async def _remove(self, req: w.RemoveRequest) -> w.RemoveReply:
        self.counts["remove"] += 1
        return await self.remover.remove(req)

    # Replication (a backup's side) ----------------------------------------------------------------

    async def _replicate(self, conn, peer: PeerIdentity, request: int, req: w.ReplicateRequest, deadline) -> None:
        self.counts["replicate"] += 1
        sizes = [0 if item.removed else item.size for item in req.items]
        if peer.kind != NODE or peer.name != req.primary:
            # only a node agent proves the node secret, and only under its own name: a client (the
            # cluster secret, a tenant's key) or another node naming the primary is a forgery
            self.counts["replicate_forged"] += 1
            log.warning(
                "node %s: refused a replication of slot %d naming %s as its primary, from %s",
                self.node_id,
                req.slot,
                req.primary,
                peer,
            )
            with deadline(sum(sizes)):
                await receive_or_discard(conn, [(None, n) for n in sizes])
            refused = w.Result(Status.FORBIDDEN, f"only the node {req.primary} itself replicates as it")
            reply = w.ReplicateReply(self.ownership.map.epoch, [refused] * max(1, len(req.items)))
            await send_frame(conn, Op.OBJ_REPLICATE_REPLY, request, w.encode(reply))
            return
        if not await self.backup.accepts(req):
            self.counts["replicate_refused"] += 1
            with deadline(sum(sizes)):
                await receive_or_discard(conn, [(None, n) for n in sizes])
            refused = w.Result(
                Status.WRONG_OWNER,
                f"{req.primary} is not slot {req.slot}'s primary by map epoch "
                f"{self.ownership.map.epoch}, or this node is not its backup",
            )
            reply = w.ReplicateReply(self.ownership.map.epoch, [refused] * max(1, len(req.items)))
            await send_frame(conn, Op.OBJ_REPLICATE_REPLY, request, w.encode(reply))
            return
        if req.phase == w.SYNC_BEGIN:
            self.backup.begin_sync(req.slot)
            log.info("node %s: slot %d is copied here from %s", self.node_id, req.slot, req.primary)
        elif req.phase == w.SYNC_END:
            dropped = self.backup.end_sync(req.slot)
            log.info(
                "node %s: slot %d copied from %s (%d it held are gone there)",
                self.node_id,
                req.slot,
                req.primary,
                dropped,
            )
        staged = await self.backup.stage(req)
        try:
            with deadline(sum(sizes)):
                await receive_or_discard(
                    conn, [(s.payload_array() if isinstance(s, Staged) else None, n) for s, n in zip(staged, sizes)]
                )
            results = await self.backup.finish(req, staged)
        finally:
            for s in staged:
                if isinstance(s, Staged) and not s.handle.done:
                    await self.table.abort(s)
        await send_frame(
            conn, Op.OBJ_REPLICATE_REPLY, request, w.encode(w.ReplicateReply(self.ownership.map.epoch, results))
        )
