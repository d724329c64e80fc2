"""The key-value store's operations as a node answers them on its transfer port (``object_wire.py``):
a router onto one module per operation (``put.py``, ``get.py``, ``query.py``, ``remove.py``,
``replicate.py``), each holding its rules once.

Each request is about objects of one tenant; each item is answered on its own. The primary of an
item's slot (``Ownership.serves``) does the work; any other node answers WRONG_OWNER or UNAVAILABLE
and the client finds the right one.

Two doors lead to each operation: ``handle``, a coroutine on the connection's task, and ``fast``, the
inbox's hook, which answers within the reader callback what needs no wait (``now.py``) and leaves the
rest to ``handle``. A tenant's key reaches that tenant's objects only: ``fast`` leaves its requests
to ``handle``, which checks the tenant of what it asks.
"""

from __future__ import annotations

import socket

from tiercake.tiers.objects import ObjectTable
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import CLUSTER, FLAG_NO_REPLY, TENANT, Op, PeerIdentity, ProtocolError
from tiercake.transfer.sockio import send_frame

from .forbidden import TENANT_REQUESTS, refuse_foreign
from .get import Gets
from .now import Answered, Deadline, send_now
from .ownership import Ownership
from .put import Puts
from .query import query
from .remove import Remover
from .replicate import BackupSide
from .replication import Replicator

OBJECT_OPS = (Op.OBJ_PUT, Op.OBJ_GET, Op.OBJ_RELEASE, Op.OBJ_QUERY, Op.OBJ_REMOVE, Op.OBJ_REPLICATE)
# what the server counts: requests by operation, and refusals: "replicate_forged" (a peer that is not
# the node it names as the slot's primary), "replicate_refused" (a node that is not the primary by this
# node's map), "forbidden" (a tenant's key asking for another tenant's objects)
COUNTS = ("put", "get", "query", "remove", "replicate", "replicate_forged", "replicate_refused", "forbidden")


class ObjectServer:
    """The transfer server's hook for object operations (``TransferServer(objects=...)``)."""

    ops = OBJECT_OPS

    def __init__(
        self, node_id: str, table: ObjectTable, ownership: Ownership, replicator: Replicator, pool_tier: str | None
    ) -> None:
        self.node_id, self.table, self.ownership, self.replicator = node_id, table, ownership, replicator
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.puts = Puts(table, ownership, replicator, pool_tier, self.counts)
        self.gets = Gets(table, ownership, pool_tier, self.counts)
        self.remover = Remover(table, ownership, replicator)
        self.backup = BackupSide(node_id, table, ownership, self.counts)

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
        deadline: Deadline,
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
            await self.puts.serve(conn, flags, request, w.decode(w.PutRequest, body), deadline)
        elif op is Op.OBJ_GET:
            await self.gets.serve(conn, flags, request, w.decode(w.GetRequest, body), deadline)
        elif op is Op.OBJ_RELEASE:
            await self.table.store.release_leases(w.decode(w.ReleaseRequest, body).leases)
        elif op is Op.OBJ_QUERY:
            reply = self._query(w.decode(w.QueryRequest, body))
            if not flags & FLAG_NO_REPLY:  # without: a same-host reader's note of what it read (the leases)
                await send_frame(conn, Op.OBJ_QUERY_REPLY, request, w.encode(reply))
        elif op is Op.OBJ_REMOVE:
            self.counts["remove"] += 1
            removed = await self.remover.remove(w.decode(w.RemoveRequest, body))
            await send_frame(conn, Op.OBJ_REMOVE_REPLY, request, w.encode(removed))
        elif op is Op.OBJ_REPLICATE:
            await self.backup.serve(conn, peer, request, w.decode(w.ReplicateRequest, body), deadline)
        else:
            raise ProtocolError(f"{op.name} is not an object request")

    def fast(
        self,
        conn: socket.socket,
        peer: PeerIdentity,
        op: Op,
        flags: int,
        request: int,
        body: bytearray,
        deadline: Deadline,
    ) -> Answered:
        """True when answered; False to leave the request to ``handle``; or a continuation."""
        if peer.kind != CLUSTER:
            return False
        try:
            if op is Op.OBJ_GET:
                return self.gets.now(conn, flags, request, w.decode(w.GetRequest, body), deadline)
            if op is Op.OBJ_PUT:
                return self.puts.now(conn, flags, request, w.decode(w.PutRequest, body), deadline)
            if op is Op.OBJ_QUERY:
                reply = self._query(w.decode(w.QueryRequest, body))
                if flags & FLAG_NO_REPLY:
                    return True
                return send_now(conn, Op.OBJ_QUERY_REPLY, request, w.encode(reply), [], deadline)
            if op is Op.OBJ_RELEASE:
                self.gets.release_now(w.decode(w.ReleaseRequest, body).leases)
                return True
        except ProtocolError:
            return False  # the coroutine's decoding says what is wrong with it
        return False

    def _query(self, req: w.QueryRequest) -> w.QueryReply:
        self.counts["query"] += 1
        return query(self.node_id, self.table, self.ownership, self.replicator, req)
