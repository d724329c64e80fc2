"""A get, as the primary of its items' slots answers it, through either door, and a same-host
reader's release of what it read through the pool.

A get reads the current version under a store lease (the block cannot go while its bytes are sent)
and grants Mooncake's read lease. Through the pool (a same-host reader) the answer is where the bytes
are, under a lease of ``SHM_LEASE_S`` that the reader releases (``OBJ_RELEASE``) once it copied them.

The rules are here once: ``_readable`` (what an item may read) and ``_in_memory`` (its bytes as they
lie in memory). ``serve`` is the coroutine, which also reads from disk; ``now`` (``now.py``) answers a
get whose objects are all in memory and small enough to send at once, and declines any other.
"""

from __future__ import annotations

import socket

import numpy as np

from tiercake.blocks import object_id
from tiercake.tiers import ObjectNotFoundError, StoreError
from tiercake.tiers.objects import ObjectTable, Stored
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import FLAG_SHM, Op, Status
from tiercake.transfer.sockio import send_frame

from .now import Answered, Deadline, later, send_now
from .ownership import Ownership

SHM_LEASE_S = 30.0  # a same-host reader that dies holds its objects' blocks this long at most
FAST_MAX_BYTES = 4 << 20  # a larger get's bytes take the coroutine's way (and its bulk threads)

Read = tuple[w.Got, np.ndarray | None, int | None]  # the answer, the bytes to send, the store lease held


class Gets:
    def __init__(self, table: ObjectTable, ownership: Ownership, pool_tier: str | None, counts: dict[str, int]) -> None:
        self.table, self.ownership = table, ownership
        self.pool_tier = pool_tier
        self.counts = counts

    # The rules ------------------------------------------------------------------------------------

    def _readable(self, req: w.GetRequest, item: w.GetItem) -> w.Got | Stored:
        """The object a get item names, or the answer that refuses it."""
        if not item.name:
            return w.Got(Status.INVALID, message="an object needs a name")
        oid = object_id(item.name, req.tenant)
        refused = self.ownership.refusal(oid, req.epoch)
        if refused is not None:
            return w.Got(refused.status, message=refused.message)
        stored = self.table.get(oid)
        if stored is None:
            return w.Got(Status.NOT_FOUND)
        if 0 <= item.capacity < stored.size:
            message = f"the object is {stored.size} bytes, the buffer holds {item.capacity}"
            return w.Got(Status.TOO_SMALL, stored.size, stored.version, message=message)
        return stored

    def _in_memory(self, req: w.GetRequest, item: w.GetItem, shm: bool) -> Read | Stored:
        """One item's read from memory, its read lease granted; or the object, whose bytes are on
        disk only (the coroutine reads them)."""
        stored = self._readable(req, item)
        if isinstance(stored, w.Got):
            return stored, None, None
        if shm:
            self.table.lease(stored)
            return (w.Got(Status.OK, 0, stored.version), None, None) if stored.size == 0 else self._in_pool(stored)
        lease = self.table.read_lease(stored) if stored.size else None
        if stored.size and lease is None:
            return stored
        self.table.lease(stored)
        if lease is None:
            return w.Got(Status.OK, 0, stored.version), None, None
        view = lease.host_array()[stored.offset : stored.offset + stored.size]
        return w.Got(Status.OK, stored.size, stored.version), view, lease.id

    def _in_pool(self, stored: Stored) -> Read:
        """Where a same-host reader finds the bytes, under a lease it releases."""
        if self.pool_tier is None:
            return w.Got(Status.NOT_IN_MEMORY, message="no shared pool here"), None, None
        try:
            lease = self.table.store.acquire_lease(stored.block, SHM_LEASE_S, tier=self.pool_tier)
        except ObjectNotFoundError:
            return w.Got(Status.NOT_IN_MEMORY, stored.size, stored.version), None, None
        return w.Got(Status.OK, stored.size, stored.version, lease.slot[0] + stored.offset, lease.id), None, None

    def release_now(self, leases: list[int]) -> None:
        """End store leases (sent, or a same-host reader's copy done); a block evicted while leased
        is freed now (rare)."""
        for lease in leases:
            copy = self.table.store.end_lease(lease)
            if copy is not None:
                later(copy.tier.backend.release(copy.slot))

    # The coroutine --------------------------------------------------------------------------------

    async def serve(self, conn: socket.socket, flags: int, request: int, req: w.GetRequest, deadline: Deadline) -> None:
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

    async def _read(self, req: w.GetRequest, item: w.GetItem, shm: bool) -> Read:
        read = self._in_memory(req, item, shm)
        if not isinstance(read, Stored):
            return read
        self.table.lease(read)
        try:
            payload = await self.table.read_disk(read)
        except StoreError as exc:  # a corrupt copy: dropped by the store, never served
            return w.Got(Status.NOT_FOUND, message=str(exc)), None, None
        return w.Got(Status.OK, read.size, read.version), payload, None

    # The door that answers at once ----------------------------------------------------------------

    def now(self, conn: socket.socket, flags: int, request: int, req: w.GetRequest, deadline: Deadline) -> Answered:
        shm = bool(flags & FLAG_SHM)
        answers: list[w.Got] = []
        data: list[np.ndarray] = []
        leases: list[int] = []
        total = 0
        for item in req.items:
            try:
                read = self._in_memory(req, item, shm)
            except StoreError:
                read = None  # the coroutine's read answers it
            if not isinstance(read, tuple):  # on disk only: the coroutine reads it
                self.release_now(leases)
                return False
            got, payload, lease = read
            answers.append(got)
            if lease is not None:
                leases.append(lease)
            if payload is not None:
                data.append(payload)
                total += payload.size
            if total > FAST_MAX_BYTES:
                self.release_now(leases)
                return False
        self.counts["get"] += 1
        reply = w.encode(w.GetReply(self.ownership.map.epoch, answers))
        return send_now(conn, Op.OBJ_GET_REPLY, request, reply, data, deadline, after=lambda: self.release_now(leases))
