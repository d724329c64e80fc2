"""A remove as a slot's primary answers it: under the object's lock, refused while a reader's lease
holds the object (unless forced), sent to the slot's backups when the object is replicated, then out
of the table, and answered once no block of it is left for a restart to find. A remove of every
object of a tenant (or those whose names match a pattern) takes the objects of the slots this node
serves, and says which it could not remove yet, so that the caller asks again."""

from __future__ import annotations

import asyncio

from tiercake.blocks import object_id
from tiercake.tiers.objects import ObjectTable, compile_pattern
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import Status

from .ownership import Ownership
from .replication import Replicator, ReplicaUnsafe


class Remover:
    def __init__(self, table: ObjectTable, ownership: Ownership, replicator: Replicator) -> None:
        self.table, self.ownership, self.replicator = table, ownership, replicator

    async def remove(self, req: w.RemoveRequest) -> w.RemoveReply:
        if req.every:
            return await self._remove_every(req)
        if len(req.names) == 1:
            results = [await self._remove_one(req.tenant, req.names[0], req.epoch, req.force)]
        else:
            results = await asyncio.gather(*(self._remove_one(req.tenant, n, req.epoch, req.force) for n in req.names))
        return w.RemoveReply(self.ownership.map.epoch, list(results))

    async def _remove_one(self, tenant: str, name: bytes, epoch: int, force: bool) -> w.Result:
        if not name:
            return w.Result(Status.INVALID, "an object needs a name")
        oid = object_id(name, tenant)
        async with self.table.lock(oid):
            refused = self.ownership.refusal(oid, epoch)
            if refused is not None:
                return refused
            stored = self.table.get(oid)
            if stored is None:
                return w.Result(Status.NOT_FOUND)
            if not force and not self.table.withdraw(stored):
                return w.Result(Status.LEASED, "a reader's lease holds it (Mooncake's default_kv_lease_ttl)")
            slot, replicated = self.ownership.slot_of(oid), stored.meta.replicas > 1
            if self.replicator.wants(slot, replicated):
                try:
                    await self.replicator.forward(
                        slot, w.Replica(tenant, name, stored.version, removed=True), None, replicated=replicated
                    )
                except ReplicaUnsafe as exc:
                    self.table.publish(stored)  # not removed: same-host readers find it again
                    return w.Result(Status.REPLICA_FAILED, str(exc))
            self.table.remove(oid)
            await self.table.retired()  # answered once no block of it is left for a restart to find
        return w.Result(Status.OK)

    async def _remove_every(self, req: w.RemoveRequest) -> w.RemoveReply:
        """Every object of the tenant in the slots this node serves (matching ``pattern``, if any).
        A client's pattern is matched with RE2's semantics (time linear in the name: no pattern can
        backtrack for seconds), over a snapshot of the names, on a thread: the event loop, and with it
        every other tenant's requests and this node's keep-alives, never waits for it."""
        try:
            pattern = compile_pattern(req.pattern) if req.pattern is not None else None
        except ValueError as exc:
            return w.RemoveReply(self.ownership.map.epoch, [w.Result(Status.INVALID, str(exc))])
        mine = [s for s in self.table if s.record.tenant == req.tenant]
        if pattern is not None:
            matched = await asyncio.to_thread(lambda: [pattern.search(s.record.name) is not None for s in mine])
            mine = [s for s, hit in zip(mine, matched) if hit]
        names = [s.record.name for s in mine if self.ownership.serves(self.ownership.slot_of(s.oid), req.epoch) is None]
        results = await asyncio.gather(*(self._remove_one(req.tenant, n, req.epoch, req.force) for n in names))
        removed = sum(1 for r in results if r.status == Status.OK)
        # what this node could not remove now but may later (its lease not surely alive, the slot moved):
        # said, so that the caller asks again; leased and vanished objects are simply not counted
        again = [r for r in results if r.status in (Status.UNAVAILABLE, Status.WRONG_OWNER)]
        return w.RemoveReply(self.ownership.map.epoch, again[:1], removed)
