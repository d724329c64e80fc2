"""Object requests answered within the transfer server's reader callback (``transfer/inbox.py``):
no await, no task, so no event-loop round between the request and its answer.

Only what needs no wait is taken, and every rule is ``serve.py``'s (the same checks, in the same
order, with the same answers):

- a put whose bytes come on the stream, of objects that are not replicated or persisted, whose
  keys no other write holds, into memory with room as it is (what of its bytes has not arrived
  yet, or is more than ``INLINE_BYTES``, the connection's task receives; it then finishes the put
  the long way, under each object's lock);
- a get of objects in memory, whose reply the socket takes at once (else the connection's task
  sends the rest, and releases the leases after);
- a query, and a same-host reader's release of its leases.

Anything else (eviction, a disk, a backup to wait for, a large transfer) is declined before any
state changes, and ``serve.py``'s coroutine answers it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import numpy as np

from tiercake.blocks import object_id
from tiercake.tiers import StoreError, TierFullError
from tiercake.tiers.objects import Meta, Staged, kept_pin
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import (
    CLUSTER,
    FLAG_EAGER,
    FLAG_NO_REPLY,
    FLAG_SHM,
    FRAME,
    MAGIC,
    VERSION,
    Op,
    PeerIdentity,
    ProtocolError,
    Status,
)
from tiercake.transfer.sockio import IOV_MAX, recv_into_all, send_all

log = logging.getLogger(__name__)

FAST_MAX_BYTES = 4 << 20  # a larger get's bytes take the task's way (and its bulk threads)
INLINE_BYTES = 1 << 20  # what of a put's bytes the callback receives itself; the task waits for the rest


class AnswerNow:
    """Mixed into ``ObjectServer``: ``fast`` is the inbox's hook."""

    def fast(
        self, conn: socket.socket, peer: PeerIdentity, op: Op, flags: int, request: int, body: bytearray, deadline
    ):
        """True when answered; False to leave the request to ``handle``; or a continuation. A tenant's
        key is left to ``handle``, which checks the tenant of what it asks."""
        if peer.kind != CLUSTER:
            return False
        try:
            if op is Op.OBJ_GET:
                return self._get_now(conn, flags, request, w.decode(w.GetRequest, body), deadline)
            if op is Op.OBJ_PUT:
                return self._put_now(conn, flags, request, w.decode(w.PutRequest, body), deadline)
            if op is Op.OBJ_QUERY:
                reply = self._query(w.decode(w.QueryRequest, body))
                return (
                    True
                    if flags & FLAG_NO_REPLY
                    else _send_now(conn, Op.OBJ_QUERY_REPLY, request, w.encode(reply), [], deadline)
                )
            if op is Op.OBJ_RELEASE:
                self._end_leases(w.decode(w.ReleaseRequest, body).leases)
                return True
        except ProtocolError:
            return False  # the task's decoding says what is wrong with it
        return False

    # Get ----------------------------------------------------------------------------------------

    def _get_now(self, conn, flags: int, request: int, req: w.GetRequest, deadline):
        shm = bool(flags & FLAG_SHM)
        answers: list[w.Got] = []
        data: list[np.ndarray] = []
        leases: list[int] = []
        total = 0
        for item in req.items:
            got, payload, lease = self._read_now(req, item, shm)
            if got is None:  # on disk only: the task reads it
                self._end_leases(leases)
                return False
            answers.append(got)
            if lease is not None:
                leases.append(lease)
            if payload is not None:
                data.append(payload)
                total += payload.size
            if total > FAST_MAX_BYTES:
                self._end_leases(leases)
                return False
        self.counts["get"] += 1
        reply = w.encode(w.GetReply(self.ownership.map.epoch, answers))
        return _send_now(conn, Op.OBJ_GET_REPLY, request, reply, data, deadline, after=lambda: self._end_leases(leases))

    def _readable(self, req: w.GetRequest, item: w.GetItem):
        """The object a get item names, or the answer that refuses it: (refusal, None) or (None, stored)."""
        if not item.name:
            return w.Got(Status.INVALID, message="an object needs a name"), None
        oid = object_id(item.name, req.tenant)
        refused = self._owner_check(oid, req.epoch)
        if refused is not None:
            return w.Got(refused.status, message=refused.message), None
        stored = self.table.get(oid)
        if stored is None:
            return w.Got(Status.NOT_FOUND), None
        if 0 <= item.capacity < stored.size:
            message = f"the object is {stored.size} bytes, the buffer holds {item.capacity}"
            return w.Got(Status.TOO_SMALL, stored.size, stored.version, message=message), None
        return None, stored

    def _read_now(self, req: w.GetRequest, item: w.GetItem, shm: bool):
        """``_read`` without its disk read: (None, None, None) for an object only on disk."""
        refusal, stored = self._readable(req, item)
        if refusal is not None:
            return refusal, None, None
        if shm:
            self.table.lease(stored)
            if stored.size == 0:
                return w.Got(Status.OK, 0, stored.version), None, None
            return self._lease_in_pool(stored)
        try:
            lease = self.table.read_lease(stored) if stored.size else None
        except StoreError:
            return None, None, None  # the task's read answers it
        if stored.size and lease is None:
            return None, None, None
        self.table.lease(stored)
        if lease is None:
            return w.Got(Status.OK, 0, stored.version), None, None
        view = lease.host_array()[stored.offset : stored.offset + stored.size]
        return w.Got(Status.OK, stored.size, stored.version), view, lease.id

    def _end_leases(self, leases: list[int]) -> None:
        for lease in leases:
            copy = self.table.store.end_lease(lease)
            if copy is not None:  # evicted while leased: its slot is freed now (rare)
                _later(copy.tier.backend.release(copy.slot))

    # Put ----------------------------------------------------------------------------------------

    def _put_now(self, conn, flags: int, request: int, req: w.PutRequest, deadline):
        if flags & FLAG_SHM or not flags & FLAG_EAGER:
            return False
        plans: list[Staged | w.Result] = []
        for item in req.items:
            plan = self._stage_now(req, item)
            if plan is None:
                for p in plans:
                    if isinstance(p, Staged):
                        _later(self.table.abort(p))
                return False
            plans.append(plan)
        self.counts["put"] += 1
        views = [
            p.payload_array() if isinstance(p, Staged) else np.empty(max(0, item.size), dtype=np.uint8)
            for p, item in zip(plans, req.items)
        ]
        left = _recv_now(conn, views, INLINE_BYTES)
        if left:  # not all there after all: the task waits for the rest, then finishes the long way

            async def rest() -> None:  # (under each object's lock: other writes may start meanwhile)
                try:
                    with deadline(sum(len(v) for v in left)):
                        await recv_into_all(conn, left)
                    if all(self._still_now(req, item, p) for item, p in zip(req.items, plans)):
                        results = self._finish_now(req, plans)
                    else:
                        results = [await self._finish_put(req, item, p) for item, p in zip(req.items, plans)]
                finally:
                    for p in plans:
                        if isinstance(p, Staged) and not p.handle.done:
                            await self.table.abort(p)
                body = _put_reply(self, results)
                await send_all(conn, [_frame(Op.OBJ_PUT_REPLY, request, len(body)), body])

            return rest
        results = self._finish_now(req, plans)
        return _send_now(conn, Op.OBJ_PUT_REPLY, request, _put_reply(self, results), [], deadline)

    def _stage_now(self, req: w.PutRequest, item: w.PutItem) -> Staged | w.Result | None:
        """``_stage``'s answer, or None where a put must wait (``_finish_put``'s reasons included)."""
        if not item.name or not req.tenant:
            return w.Result(Status.INVALID, "an object needs a name and a tenant")
        oid = object_id(item.name, req.tenant)
        slot = self.ownership.slot_of(oid)
        refused = self._owner_check(oid, req.epoch) or self._check_put(item, slot)
        if refused is not None:
            return refused
        old = self.table.get(oid)
        if not item.upsert and old is not None:
            return w.Result(Status.EXISTS)
        if item.soft_pin_ms < w.KEEP_SOFT_PIN:
            return w.Result(Status.INVALID, f"a soft pin's TTL is not negative, got {item.soft_pin_ms}")
        if (
            item.replicas > 1
            or item.persist
            or (old is not None and old.meta.replicas > 1)
            or self.table.locked(oid)
            or self.replicator.wants(slot, replicated=False)
        ):
            return None
        meta = Meta(item.replicas, item.persist, item.hard_pin, None if item.soft_pin_ms < 0 else item.soft_pin_ms)
        try:
            return self.table.stage_now(oid, req.tenant, item.name, item.size, meta)
        except (StoreError, ValueError) as exc:
            return w.Result(Status.INVALID, str(exc))

    def _still_now(self, req: w.PutRequest, item: w.PutItem, plan: Staged | w.Result) -> bool:
        """Whether a put staged by ``_stage_now`` may still finish without waiting, after its bytes
        took awaits to come: what made it so is checked again (no write of the key began, the map
        did not move, no backup wants the slot, the version it replaces is not replicated)."""
        if isinstance(plan, w.Result):
            return True
        if self.table.locked(plan.oid) or self._owner_check(plan.oid, req.epoch) is not None:
            return False
        old = self.table.get(plan.oid)
        return not (old is not None and old.meta.replicas > 1) and not self.replicator.wants(
            self.ownership.slot_of(plan.oid), replicated=False
        )

    def _finish_now(self, req: w.PutRequest, plans: list) -> list[w.Result]:
        """``_finish_put`` for each staged item, in order, with nothing to wait for (no backup, no
        lock held: checked when staged, and nothing ran since)."""
        results = []
        for item, plan in zip(req.items, plans):
            if isinstance(plan, w.Result):
                results.append(plan)
                continue
            old = self.table.get(plan.oid)
            if old is not None and not item.upsert:  # the same key twice in the batch: the first won
                _later(self.table.abort(plan))
                results.append(w.Result(Status.EXISTS))
                continue
            version = max(old.version + 1 if old is not None else 0, time.time_ns())
            if item.soft_pin_ms == w.KEEP_SOFT_PIN:
                plan.meta = kept_pin(plan.meta, old)
            try:
                prepared = self.table.prepare_now(plan, version)
            except TierFullError as exc:
                results.append(w.Result(Status.FULL, str(exc)))
                continue
            except (StoreError, OSError) as exc:
                results.append(w.Result(Status.INTERNAL, str(exc)))
                continue
            self.table.install(prepared)
            results.append(w.Result(Status.OK))
        return results


def _put_reply(server, results: list[w.Result]) -> bytes:
    return w.encode(w.PutReply(server.ownership.map.epoch, results))


def _frame(op: Op, request: int, length: int, flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, VERSION, op, flags, request, length)


def _recv_now(conn: socket.socket, views: list[np.ndarray], most: int) -> list[memoryview]:
    """Receive into ``views`` what the socket holds, up to about ``most`` bytes (the loop is not held
    longer); what is still to come (empty: all of it)."""
    left = [memoryview(v).cast("B") for v in views if v.nbytes]
    taken = 0
    while left and taken < most:
        try:
            got = conn.recvmsg_into(left[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            break
        if got == 0:
            break  # the peer left: the task's receive says so
        taken += got
        while left and got >= len(left[0]):
            got -= len(left.pop(0))
        if left and got:
            left[0] = left[0][got:]
    return left


def _send_now(conn: socket.socket, op: Op, request: int, body: bytes, data: list, deadline, after=None):
    """Send a reply without waiting; True when it all went (``after`` run), else a continuation that
    sends the rest (and then runs ``after``)."""
    views = [
        memoryview(_frame(op, request, len(body))),
        memoryview(body),
        *(memoryview(d).cast("B") for d in data if d.nbytes),
    ]
    while views:
        try:
            sent = conn.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break  # the peer left: the task finds out when it sends the rest
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]
    if not views:
        if after is not None:
            after()
        return True

    async def rest() -> None:
        try:
            with deadline(sum(len(v) for v in views)):
                await send_all(conn, views)
        finally:
            if after is not None:
                after()

    return rest


_pending: set[asyncio.Task] = set()


def _later(coro) -> None:
    """Run a clean-up coroutine soon (a slot to free: no wait for it on the answering path)."""
    task = asyncio.get_running_loop().create_task(coro)
    _pending.add(task)
    task.add_done_callback(_pending.discard)
