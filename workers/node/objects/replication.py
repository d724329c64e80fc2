"""A slot's backups, from both ends: the primary forwarding every replicated write and remove, and
copying the whole slot to a backup that joins; the backup applying what its primary sends.

The primary (``Replicator``):

- ``forward``: an object's new state goes to every backup of its slot that takes writes, while the
  object's lock is held (so a backup sees one object's versions in the primary's order), before the
  write is installed and acknowledged. A backup that fails is recorded *lagging* with the conductor
  before anything more of that slot is acknowledged (``SlotReady(lagging=True)``): the conductor never
  promotes a backup that misses an acknowledged write. If the conductor cannot be told, the slot
  takes no replicated writes (``ReplicaUnsafe``) until it can.
- a backup the map lists as not ready (new in the chain, or lagging) is copied the slot: SYNC_BEGIN
  (it drops what it had of the slot), from then on it gets every forwarded write, then every
  replicated object of the slot, and every object a write was under way for as the copy began (that
  write chose its targets before), each under that object's lock, SYNC_END; then the conductor is
  told it is ready, and from then on it may be promoted.

The backup (``apply``): takes a REPLICATE only from the node its map names the slot's primary, and
only for a slot whose chain it is in (a newer epoch in the request makes it fetch the map first);
applies the items in order: a version replaces whatever it held of the object, a removal removes it.
Backups never serve reads: only the primary answers for its objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import ObjectMap, SlotReady
from tiercake.tiers.objects import Meta, ObjectTable, Stored
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import Channels
from tiercake.transfer.protocol import FLAG_EAGER, Op, Status, TransferError

from .ownership import Ownership

log = logging.getLogger(__name__)

K = TypeVar("K")

SYNC_BATCH_ITEMS = 64
SYNC_BATCH_BYTES = 8 << 20


class ReplicaUnsafe(Exception):
    """A backup failed and the conductor could not be told: the slot takes no replicated writes."""


def replica_of(stored: Stored) -> w.Replica:
    meta = stored.meta
    return w.Replica(
        stored.record.tenant,
        stored.record.name,
        stored.version,
        stored.size,
        meta.replicas,
        meta.persist,
        meta.hard_pin,
        w.NO_SOFT_PIN if meta.soft_pin_ms is None else meta.soft_pin_ms,
    )


def meta_of(replica: w.Replica) -> Meta:
    return Meta(
        replica.replicas,
        replica.persist,
        replica.hard_pin,
        None if replica.soft_pin_ms == w.NO_SOFT_PIN else replica.soft_pin_ms,
    )


class Reporter:
    """A primary's reports to the conductor, sent together: every report made within ``every`` of
    the first goes in one request (one change of the map for all of them)."""

    def __init__(self, client: Client | None, ownership: Ownership, every: float = 0.02) -> None:
        self.client = client
        self.ownership = ownership
        self.every = every
        self._queue: list[tuple[SlotReady, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def tell(self, report: SlotReady) -> str:
        """'' once applied, or why the conductor refused it; ``ConductorError`` when none answered."""
        if self.client is None:
            raise ConductorError(503, "no conductor")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((report, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        assert self.client is not None  # ``tell`` queues only with a client
        while self._queue:
            await asyncio.sleep(self.every)
            batch, self._queue = self._queue, []
            try:
                answer = await self.client.slot_reports([r for r, _ in batch])
            except (ConductorError, OSError) as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc if isinstance(exc, ConductorError) else ConductorError(503, str(exc)))
                continue
            self.ownership.install(answer.map)
            for (_, future), why in zip(batch, answer.refused):
                if not future.done():
                    future.set_result(why)

    async def pinned(self, slot: int) -> bool:
        """Whether the map pins ``slot`` to this node (``ObjectMap.pinned``), asking the conductor to
        first: an object persisted here alone is acknowledged only once the slot cannot move away
        while this node is away (else it would be silently absent, then dropped on its return)."""
        me = self.ownership.node_id
        if self.ownership.map.pinned.get(slot) == me:
            return True
        report = SlotReady(slot=slot, epoch=self.ownership.map.epoch, node=me, primary=me, pinned=True)
        for _ in range(3):
            try:
                refused = await self.tell(report)
            except ConductorError:
                await asyncio.sleep(0.2)
                continue
            if refused:
                log.info("node %s: the conductor refused to pin slot %d here: %s", me, slot, refused)
                return False
            return self.ownership.map.pinned.get(slot) == me
        return False

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._flusher


class Replicator:
    def __init__(
        self,
        node_id: str,
        table: ObjectTable,
        ownership: Ownership,
        channels: Channels,
        client: Client | None,
        *,
        timeout: float = 10.0,
    ) -> None:
        self.node_id = node_id
        self.table = table
        self.ownership = ownership
        self.channels = channels
        self.client = client
        self.timeout = timeout
        self.forward_to: dict[int, set[str]] = defaultdict(set)  # slot -> backups that get every write
        self.blocked: set[int] = set()  # slots with a failed backup the conductor was not yet told of
        self.reporter = Reporter(client, ownership)
        self.handing: dict[int, str] = {}  # slot -> the backup it is being handed to (a rebalance)
        self._handoff_dirty: set[int] = set()  # a write the handoff's target missed: copy again
        self._handoffs: dict[int, asyncio.Task] = {}
        self._syncs: dict[tuple[int, str], asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self.synced = 0  # slots copied to a backup
        ownership.listeners.append(self._on_map)

    async def close(self) -> None:
        await self.reporter.close()
        tasks = list(self._syncs.values()) + list(self._handoffs.values()) + list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # Following the map ------------------------------------------------------------------------------

    def _on_map(self, old: ObjectMap, new: ObjectMap) -> None:
        for slot in range(new.slots):
            chain = new.chains[slot]
            if not chain or chain[0] != self.node_id:
                self.forward_to.pop(slot, None)
                self.blocked.discard(slot)
                continue
            ready = set(chain[1 : new.ready[slot]])
            forward = self.forward_to[slot]
            forward &= set(chain[1:])  # a member that left the chain gets nothing more
            for backup in chain[1:]:
                syncing = self._syncs.get((slot, backup))
                if backup in ready:
                    if syncing is None:
                        forward.add(backup)  # ready by the map: it holds the slot (and got every write)
                elif syncing is None or syncing.done():
                    self._start_sync(slot, backup)
        for (slot, backup), task in list(self._syncs.items()):
            chain = new.chains[slot] if slot < new.slots else []
            if not chain or chain[0] != self.node_id or backup not in chain[1:]:
                task.cancel()
        for slot, target in new.handoff.items():
            if new.primary(slot) == self.node_id and slot not in self._handoffs:
                task = asyncio.get_running_loop().create_task(self._hand_off(slot, target))
                self._handoffs[slot] = task
                task.add_done_callback(_forget_when_done(self._handoffs, slot))
        for slot, task in list(self._handoffs.items()):
            if new.handoff.get(slot) is None or new.primary(slot) != self.node_id:
                task.cancel()

    def _start_sync(self, slot: int, backup: str) -> None:
        task = asyncio.get_running_loop().create_task(self._sync(slot, backup))
        self._syncs[(slot, backup)] = task
        task.add_done_callback(_forget_when_done(self._syncs, (slot, backup)))

    # Forwarding -------------------------------------------------------------------------------------

    def wants(self, slot: int, replicated: bool) -> bool:
        """Whether a write of this slot goes anywhere: a replicated one to the backups, any one to the
        node the slot is being handed to."""
        return replicated or slot in self.handing

    async def forward(self, slot: int, replica: w.Replica, payload: np.ndarray | None, replicated: bool) -> int:
        """Send one object's new state (held under its lock by the caller) to every backup of the slot
        that takes writes (``replicated``: the object's old or new version is on the backups), or, for
        a memory-level object, to the node the slot is being handed to; how many took it. Failed
        backups are recorded lagging before this returns; ``ReplicaUnsafe`` if that cannot be done."""
        if not replicated:
            await self._forward_handoff(slot, replica, payload)
            return 0
        if slot in self.blocked:
            raise ReplicaUnsafe(f"slot {slot} has a failed backup the conductor has not recorded yet")
        targets = sorted(self.forward_to.get(slot, ()))
        if not targets:
            return 0
        request = w.ReplicateRequest(slot, self.ownership.map.epoch, self.node_id, w.ITEMS, [replica])
        data = [] if payload is None else [payload]
        outcomes = await asyncio.gather(*(self._send(b, request, data) for b in targets), return_exceptions=True)
        acks = 0
        for backup, outcome in zip(targets, outcomes):
            if isinstance(outcome, BaseException):
                log.warning("node %s: backup %s of slot %d failed a write: %s", self.node_id, backup, slot, outcome)
                await self._demote(slot, backup)
            else:
                acks += 1
        return acks

    async def _forward_handoff(self, slot: int, replica: w.Replica, payload: np.ndarray | None) -> None:
        target = self.handing.get(slot)
        if target is None:
            return
        request = w.ReplicateRequest(slot, self.ownership.map.epoch, self.node_id, w.ITEMS, [replica])
        try:
            await self._send(target, request, [] if payload is None else [payload])
        except (TransferError, OSError, TimeoutError) as exc:
            log.info(
                "node %s: slot %d's handoff target %s missed a write (%s): copying again",
                self.node_id,
                slot,
                target,
                exc,
            )
            self._handoff_dirty.add(slot)

    async def _send(self, backup: str, request: w.ReplicateRequest, data: list) -> None:
        async with asyncio.timeout(self.timeout):
            try:
                channel = await self.channels.get(backup)
                async with channel.connection() as conn:
                    body = await conn.exchange(
                        Op.OBJ_REPLICATE, Op.OBJ_REPLICATE_REPLY, w.encode(request), FLAG_EAGER, data
                    )
            except (TransferError, OSError):
                self.channels.forget(backup)
                raise
        reply = w.decode(w.ReplicateReply, body)
        bad = next((r for r in reply.results if r.status != Status.OK), None)
        if len(reply.results) != len(request.items) or bad is not None:
            raise TransferError(
                f"{backup} refused: {Status(bad.status).name if bad else 'a short reply'} {bad.message if bad else ''}"
            )

    async def _demote(self, slot: int, backup: str) -> None:
        """``backup`` missed a write of ``slot``: it gets no more until it is copied the slot again, and
        the conductor must know before anything more is acknowledged."""
        self.forward_to[slot].discard(backup)
        try:
            await self._tell(
                SlotReady(slot=slot, epoch=self.ownership.map.epoch, node=backup, primary=self.node_id, lagging=True),
                attempts=3,
            )
        except (ConductorError, OSError) as exc:
            self.blocked.add(slot)
            self._spawn(self._unblock(slot, backup))
            raise ReplicaUnsafe(f"slot {slot}: backup {backup} failed and the conductor cannot be told: {exc}") from exc

    async def _unblock(self, slot: int, backup: str) -> None:
        while slot in self.blocked:
            await asyncio.sleep(0.5)
            with contextlib.suppress(ConductorError, OSError):
                await self._tell(
                    SlotReady(
                        slot=slot, epoch=self.ownership.map.epoch, node=backup, primary=self.node_id, lagging=True
                    ),
                    attempts=1,
                )
                self.blocked.discard(slot)

    async def _tell(self, report: SlotReady, attempts: int) -> None:
        """Tell the conductor (a refusal means the map moved on: the member left, or the report came
        twice; it is fetched again). ``ConductorError`` when none answered after ``attempts``."""
        for attempt in range(attempts):
            try:
                refused = await self.reporter.tell(report)
            except ConductorError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)
                continue
            if refused:
                log.info("node %s: the conductor refused %s: %s", self.node_id, report, refused)
                self.ownership.refresh_soon()
            return

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # Copying a slot to a backup ---------------------------------------------------------------------

    async def _sync(self, slot: int, backup: str) -> None:
        delay = 0.2
        while self.ownership.is_primary(slot) and backup in self.ownership.backups(slot):
            try:
                await self._copy_slot(slot, backup)
                await self._tell(
                    SlotReady(slot=slot, epoch=self.ownership.map.epoch, node=backup, primary=self.node_id), attempts=5
                )
                self.synced += 1
                return
            except asyncio.CancelledError:
                self.forward_to[slot].discard(backup)
                raise
            except (TransferError, OSError, ConductorError, TimeoutError) as exc:
                self.forward_to[slot].discard(backup)
                log.info(
                    "node %s: copying slot %d to %s failed (%s); again in %.1f s",
                    self.node_id,
                    slot,
                    backup,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _copy_slot(self, slot: int, backup: str) -> None:
        epoch = self.ownership.map.epoch
        await self._send(backup, w.ReplicateRequest(slot, epoch, self.node_id, w.SYNC_BEGIN), [])
        self.forward_to[slot].add(backup)  # every write from here on reaches it; what is there already follows
        await self._copy_objects(slot, backup, replicated=True)
        await self._send(backup, w.ReplicateRequest(slot, self.ownership.map.epoch, self.node_id, w.SYNC_END), [])

    async def _copy_objects(self, slot: int, backup: str, replicated: bool) -> None:
        """Every object of the slot, replicated ones or memory-level ones, in batches. The objects a
        write is under way for are copied too, under their locks once those writes are done: such a
        write chose its targets before ``backup`` was among them, and one that makes a new object
        installs it only after this list is taken: neither sent nor listed, it was never copied (the
        loss the lab's isolated node once showed: a put answered 'ok', then a read found nothing)."""
        oids = [
            s.oid for s in self.table if (s.meta.replicas > 1) == replicated and self.ownership.slot_of(s.oid) == slot
        ]
        writing = {o for o in self.table.writing() if self.ownership.slot_of(o) == slot}
        oids += sorted(writing.difference(oids))
        batch: list[bytes] = []
        nbytes = 0
        for oid in oids:
            stored = self.table.get(oid)
            if stored is None and oid not in writing:
                continue  # removed since it was listed
            batch.append(oid)
            nbytes += stored.size if stored is not None else 0
            if len(batch) >= SYNC_BATCH_ITEMS or nbytes >= SYNC_BATCH_BYTES:
                await self._copy_batch(slot, backup, batch, replicated)
                batch, nbytes = [], 0
        if batch:
            await self._copy_batch(slot, backup, batch, replicated)

    # Handing a slot to another node (a rebalance) ----------------------------------------------------

    async def _hand_off(self, slot: int, target: str) -> None:
        """Copy the slot's memory-level objects to ``target`` (a ready backup: it has the replicated
        ones), forwarding every write meanwhile; then stop serving the slot, wait out the writes in
        flight and tell the conductor, whose next map makes ``target`` the primary. This node stays a
        backup, and drops the memory-level objects it no longer owns."""
        delay = 0.2
        while self.ownership.map.handoff.get(slot) == target and self.ownership.is_primary(slot):
            self.handing[slot] = target
            self._handoff_dirty.discard(slot)
            try:
                await self._copy_objects(slot, target, replicated=False)
                self.ownership.frozen.add(slot)  # no write gets in now, and same-host readers ask the node
                self.table.unpublish_if(lambda oid: self.ownership.slot_of(oid) == slot)
                for oid in [o for o in self.table.writing() if self.ownership.slot_of(o) == slot]:
                    async with self.table.lock(oid):  # the writes that got in before the freeze are done
                        pass
                if slot in self._handoff_dirty:
                    raise TransferError(f"{target} missed a write")
                await self._tell(
                    SlotReady(
                        slot=slot, epoch=self.ownership.map.epoch, node=target, primary=self.node_id, handed_off=True
                    ),
                    attempts=3,
                )
                if self.ownership.map.primary(slot) == target:
                    dropped = [
                        s.oid for s in self.table if s.meta.replicas <= 1 and self.ownership.slot_of(s.oid) == slot
                    ]
                    for oid in dropped:
                        self.table.remove(oid)
                    log.info(
                        "node %s: handed slot %d to %s (%d memory-level objects moved)",
                        self.node_id,
                        slot,
                        target,
                        len(dropped),
                    )
                    return
            except asyncio.CancelledError:
                raise
            except (TransferError, OSError, ConductorError, TimeoutError) as exc:
                log.info(
                    "node %s: handing slot %d to %s failed (%s); again in %.1f s",
                    self.node_id,
                    slot,
                    target,
                    exc,
                    delay,
                )
            finally:
                self.handing.pop(slot, None)
                if slot in self.ownership.frozen:
                    self.ownership.frozen.discard(slot)
                    for stored in self.table:  # still this node's (a failed handoff): published again
                        if self.ownership.slot_of(stored.oid) == slot:
                            self.table.publish(stored)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _copy_batch(self, slot: int, backup: str, oids: list[bytes], replicated: bool = True) -> None:
        """The objects' current versions, each under its lock (taken in order: no writer holds two)."""
        async with contextlib.AsyncExitStack() as held:
            for oid in sorted(oids):
                await held.enter_async_context(self.table.lock(oid))
            items, data = [], []
            leases = []
            try:
                for oid in oids:
                    stored = self.table.get(oid)
                    if stored is None or (stored.meta.replicas > 1) != replicated:
                        continue
                    payload, lease = await self._payload(stored)
                    if lease is not None:
                        leases.append((stored.block, lease))
                    items.append(replica_of(stored))
                    data.append(payload)
                if items:
                    await self._send(
                        backup, w.ReplicateRequest(slot, self.ownership.map.epoch, self.node_id, w.ITEMS, items), data
                    )
            finally:
                for block, lease in leases:
                    await self.table.store.release_lease(block, lease)

    async def _payload(self, stored: Stored) -> tuple[np.ndarray, int | None]:
        lease = self.table.read_lease(stored)
        if lease is None:
            return await self.table.read_disk(stored), None
        return lease.host_array()[stored.offset : stored.offset + stored.size], lease.id


def _forget_when_done(tasks: dict[K, asyncio.Task[None]], key: K) -> Callable[[asyncio.Task[None]], None]:
    """A done callback that takes ``key``'s task out of ``tasks``, unless another took its place."""

    def done(task: asyncio.Task[None]) -> None:
        if tasks.get(key) is task:
            del tasks[key]

    return done
