"""A put, as the primary of its items' slots answers it, through either door.

A put stages each item's new version (its block reserved, the bytes received straight into it),
then, per item under that object's lock: a present object keeps its first value unless the put is
an upsert (Mooncake's rule), the new state goes to the slot's backups when it is replicated, and only
then is it installed, in one step, and acknowledged.

The rules are here once: ``_admit`` before an item's bytes are taken, ``_decide`` when a staged
item is installed, ``_waits`` for what only the coroutine may do (backups, a disk, another write of
the key). ``serve`` is the coroutine; ``now`` (``now.py``) takes a put of at most a run of items
(``RUN``) that wait for nothing, with its bytes on the stream, and declines any other before it
changes anything. Once the bytes are in, a run whose items wait for nothing finishes at once
(``_finish_now``) on either door.
"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np

from tiercake.blocks import object_id
from tiercake.tiers import StoreError, TierFullError
from tiercake.tiers.objects import Meta, ObjectTable, Staged, Stored, kept_pin
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import FLAG_EAGER, FLAG_SHM, Op, ProtocolError, Status
from tiercake.transfer.sockio import receive_or_discard, recv_frame, recv_into_all, send_all, send_frame

from .batches import RUN, await_every
from .now import Answered, Deadline, frame, later, recv_now, send_now
from .ownership import Ownership
from .replication import Replicator, ReplicaUnsafe, replica_of

OK = w.Result(Status.OK)  # (frozen: one answer for every item that went in)
INLINE_BYTES = 1 << 20  # what of a put's bytes the callback receives itself; the task waits for the rest


class Puts:
    def __init__(
        self,
        table: ObjectTable,
        ownership: Ownership,
        replicator: Replicator,
        pool_tier: str | None,
        counts: dict[str, int],
    ) -> None:
        self.table, self.ownership, self.replicator = table, ownership, replicator
        self.pool_tier = pool_tier
        self.counts = counts

    # The rules ------------------------------------------------------------------------------------

    def _admit(self, req: w.PutRequest, item: w.PutItem) -> tuple[bytes, Meta] | w.Result:
        """An item's object id and metadata, or the answer that refuses it before its bytes come."""
        if not item.name or not req.tenant:
            return w.Result(Status.INVALID, "an object needs a name and a tenant")
        oid = object_id(item.name, req.tenant)
        refused = self.ownership.refusal(oid, req.epoch) or self._check_size(item, self.ownership.slot_of(oid))
        if refused is not None:
            return refused
        if not item.upsert and self.table.get(oid) is not None:
            return w.Result(Status.EXISTS)  # Mooncake keeps the first value: no need for the bytes
        if item.soft_pin_ms < w.KEEP_SOFT_PIN:
            return w.Result(Status.INVALID, f"a soft pin's TTL is not negative, got {item.soft_pin_ms}")
        return oid, Meta(item.replicas, item.persist, item.hard_pin, None if item.soft_pin_ms < 0 else item.soft_pin_ms)

    def _check_size(self, item: w.PutItem, slot: int) -> w.Result | None:
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

    def _waits(self, item: w.PutItem, oid: bytes) -> bool:
        """The item's put has something to wait for: backups (it is replicated, replaces a replicated
        version, or its slot is being copied to a backup), a synced disk copy, or another write of
        its key under way."""
        old = self.table.get(oid)
        return (
            item.replicas > 1
            or item.persist
            or (old is not None and old.meta.replicas > 1)
            or self.table.locked(oid)
            or self.replicator.wants(self.ownership.slot_of(oid), replicated=False)
        )

    def _decide(self, item: w.PutItem, staged: Staged, old: Stored | None) -> int | w.Result:
        """The new version's number, or why it is not installed after all: a racing first put of the
        key won (its value stays). (Whether the map moved while its bytes came is the caller's to ask
        where it awaited since ``_admit``.)"""
        if old is not None and not item.upsert:
            return w.Result(Status.EXISTS)
        if item.soft_pin_ms == w.KEEP_SOFT_PIN:
            staged.meta = kept_pin(staged.meta, old)
        return max(old.version + 1 if old is not None else 0, time.time_ns())

    # The coroutine --------------------------------------------------------------------------------

    async def serve(self, conn: socket.socket, flags: int, request: int, req: w.PutRequest, deadline: Deadline) -> None:
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
                    await self._through_pool(conn, request, staged)
                else:
                    views = [s.payload_array() if isinstance(s, Staged) else None for s in staged]
                    await receive_or_discard(conn, [(v, item.size) for v, item in zip(views, req.items)])
            results = await self._finish_all(req, staged)
        finally:
            await self._abort_unfinished(staged)
        await send_frame(conn, Op.OBJ_PUT_REPLY, request, self._reply(results))

    async def _finish_all(self, req: w.PutRequest, staged: list[Staged | w.Result]) -> list[w.Result]:
        """Every item's answer once its bytes are in, a run of ``RUN`` items at a time with a turn of
        the loop between: a run whose items wait for nothing finishes at once (``_finish_now``: a
        128-item put through the pool went from 61 to 40 us an item), any other the long way."""
        pairs = list(zip(req.items, staged))
        if len(pairs) > 1 and any(isinstance(s, Staged) and self._waits(item, s.oid) for item, s in pairs):
            # backups or a disk to wait for: the items' round trips and syncs overlap (the SSD log
            # writes what is in flight together, one sync for all: serially, 4,096 syncs)
            return await asyncio.gather(*(self._finish(req, item, s) for item, s in pairs))
        results: list[w.Result] = []
        for start in range(0, len(pairs), RUN):
            if start:
                await asyncio.sleep(0)
            run = pairs[start : start + RUN]
            if all(self._still_now(req, item, s) for item, s in run):
                results += self._finish_now(run)
            else:
                results += [await self._finish(req, item, s) for item, s in run]
        return results

    async def _through_pool(self, conn: socket.socket, request: int, staged: list[Staged | w.Result]) -> None:
        """A same-host client copies the bytes into the pool itself: tell it where, wait for its word."""
        offsets = [s.handle.copy.slot[0] + s.offset if isinstance(s, Staged) else -1 for s in staged]
        results = [s if isinstance(s, w.Result) else OK for s in staged]
        ready = w.PutReady(self.ownership.map.epoch, offsets, results)
        await send_frame(conn, Op.OBJ_PUT_READY, request, w.encode(ready))
        await recv_frame(conn, expect=[Op.OBJ_PUT_COMMIT])

    async def _stage(self, req: w.PutRequest, item: w.PutItem, shm: bool) -> Staged | w.Result:
        admitted = self._admit(req, item)
        if isinstance(admitted, w.Result):
            return admitted
        oid, meta = admitted
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

    async def _finish(self, req: w.PutRequest, item: w.PutItem, staged: Staged | w.Result) -> w.Result:
        if isinstance(staged, w.Result):
            return staged
        oid, slot = staged.oid, self.ownership.slot_of(staged.oid)
        async with self.table.lock(oid):
            refused = self.ownership.refusal(oid, req.epoch)  # the map may have moved meanwhile
            if refused is not None:
                return refused
            old = self.table.get(oid)
            version = self._decide(item, staged, old)
            if isinstance(version, w.Result):
                return version
            if item.persist and item.replicas <= 1 and not await self.replicator.reporter.pinned(slot):
                return w.Result(Status.REPLICA_FAILED, "the conductor could not be told this node holds it alone")
            try:
                prepared = await self.table.prepare(staged, version)
            except (StoreError, OSError) as exc:
                return _not_prepared(exc)
            refused = await self._to_backups(req, item, staged, prepared, old)
            if refused is not None:
                self.table.discard(prepared)
                return refused
            self.table.install(prepared)
        return OK

    async def _to_backups(
        self, req: w.PutRequest, item: w.PutItem, staged: Staged, prepared: Stored, old: Stored | None
    ) -> w.Result | None:
        """Send the prepared version to the slot's backups as it needs them; why not, if it may not
        be installed (fewer backups took it than the put asked for)."""
        slot = self.ownership.slot_of(staged.oid)
        if item.replicas > 1 and len(self.replicator.forward_to.get(slot, ())) < item.replicas - 1:
            if len(self.ownership.backups(slot)) >= item.replicas - 1:  # nothing was sent: ask again
                return w.Result(Status.UNAVAILABLE, "a backup of this slot is being copied it: ask again")
            return w.Result(Status.FULL, f"{item.replicas} replicas asked, the slot has fewer nodes")
        if item.replicas > 1 or (old is not None and old.meta.replicas > 1):
            replica = (  # else no more of it on the backups
                replica_of(prepared)
                if item.replicas > 1
                else w.Replica(req.tenant, item.name, prepared.version, removed=True)
            )
            payload = staged.payload_array() if item.replicas > 1 else None
            try:
                acks = await self.replicator.forward(slot, replica, payload, replicated=True)
            except ReplicaUnsafe as exc:
                return w.Result(Status.REPLICA_FAILED, str(exc))
            if acks < item.replicas - 1:
                return w.Result(Status.REPLICA_FAILED, f"{acks + 1} of {item.replicas} nodes took it")
        if item.replicas <= 1 and self.replicator.wants(slot, replicated=False):
            await self.replicator.forward(slot, replica_of(prepared), staged.payload_array(), replicated=False)
        return None

    async def _abort_unfinished(self, plans: list[Staged | w.Result]) -> None:
        for plan in plans:
            if isinstance(plan, Staged) and not plan.handle.done:
                await self.table.abort(plan)

    def _reply(self, results: list[w.Result]) -> bytes:
        return w.encode(w.PutReply(self.ownership.map.epoch, results))

    # The door that answers at once ----------------------------------------------------------------

    def now(self, conn: socket.socket, flags: int, request: int, req: w.PutRequest, deadline: Deadline) -> Answered:
        if flags & FLAG_SHM or not flags & FLAG_EAGER or len(req.items) > RUN:
            return False  # (more than a run of items: the coroutine gives the loop its turns)
        plans: list[Staged | w.Result] = []
        for item in req.items:
            plan = self._stage_now(req, item)
            if plan is None:
                for p in plans:
                    if isinstance(p, Staged):
                        later(self.table.abort(p))
                return False
            plans.append(plan)
        self.counts["put"] += 1
        views = [
            p.payload_array() if isinstance(p, Staged) else np.empty(max(0, item.size), dtype=np.uint8)
            for p, item in zip(plans, req.items)
        ]
        left = recv_now(conn, views, INLINE_BYTES)
        if not left:
            results = self._finish_now(list(zip(req.items, plans)))
            return send_now(conn, Op.OBJ_PUT_REPLY, request, self._reply(results), [], deadline)

        async def rest() -> None:  # not all there after all: receive the rest, and finish the long way
            try:  # if awaiting the bytes let another write of a key start, or the map move
                with deadline(sum(len(v) for v in left)):
                    await recv_into_all(conn, left)
                results = await self._finish_all(req, plans)
            finally:
                await self._abort_unfinished(plans)
            body = self._reply(results)
            await send_all(conn, [frame(Op.OBJ_PUT_REPLY, request, len(body)), body])

        return rest

    def _stage_now(self, req: w.PutRequest, item: w.PutItem) -> Staged | w.Result | None:
        """``_stage``'s answer, or None where the put must wait (``_waits``, or no memory at once)."""
        admitted = self._admit(req, item)
        if isinstance(admitted, w.Result):
            return admitted
        oid, meta = admitted
        if self._waits(item, oid):
            return None
        try:
            return self.table.stage_now(oid, req.tenant, item.name, item.size, meta)
        except (StoreError, ValueError) as exc:
            return w.Result(Status.INVALID, str(exc))

    def _still_now(self, req: w.PutRequest, item: w.PutItem, plan: Staged | w.Result) -> bool:
        """Whether a staged put may finish at once (``_finish_now``) after awaits: its version is in
        memory, nothing to wait for, and its slot still served."""
        if isinstance(plan, w.Result):
            return True
        return (
            plan.handle.in_memory
            and self.ownership.refusal(plan.oid, req.epoch) is None
            and not self._waits(item, plan.oid)
        )

    def _finish_now(self, pairs: list[tuple[w.PutItem, Staged | w.Result]]) -> list[w.Result]:
        """``_finish`` for each item, in order, with nothing to wait for (no backup, no disk, no lock
        held, the map's word: checked when staged, and nothing ran since, or ``_still_now`` asked again)."""
        results = []
        for item, plan in pairs:
            if isinstance(plan, w.Result):
                results.append(plan)
                continue
            version = self._decide(item, plan, self.table.get(plan.oid))  # the same key twice: first won
            if isinstance(version, w.Result):
                later(self.table.abort(plan))
                results.append(version)
                continue
            try:
                prepared = self.table.prepare_now(plan, version)
            except (StoreError, OSError) as exc:
                results.append(_not_prepared(exc))
                continue
            self.table.install(prepared)
            results.append(OK)
        return results


def _not_prepared(exc: Exception) -> w.Result:
    """The answer for a version ``prepare`` could not make."""
    if isinstance(exc, TierFullError):
        return w.Result(Status.FULL, str(exc))
    return w.Result(Status.INTERNAL, str(exc))
