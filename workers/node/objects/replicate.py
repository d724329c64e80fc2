"""A replication request, as a slot's backup answers it (the primary's side is ``replication.py``).

Only the node named as the slot's primary, proving the node secret under its own name, may send one,
and only while this node's map agrees that it is the slot's primary and this node a backup; anything
else is refused item by item, its bytes read and dropped so that the stream stays in step. A slot
copied whole (a backup that joins or comes back) is bracketed by SYNC_BEGIN and SYNC_END: what the
backup held of it and the primary did not send is dropped at the end. Versions only go forward.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from tiercake.blocks import object_id
from tiercake.tiers import StoreError, TierFullError
from tiercake.tiers.objects import ObjectTable, Staged
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import NODE, Op, PeerIdentity, Status
from tiercake.transfer.sockio import receive_or_discard, send_frame

from .now import Deadline
from .ownership import Ownership
from .replication import meta_of

log = logging.getLogger(__name__)


class BackupSide:
    """What a backup does with its primary's REPLICATE requests."""

    def __init__(self, node_id: str, table: ObjectTable, ownership: Ownership, counts: dict[str, int]) -> None:
        self.node_id = node_id
        self.table = table
        self.ownership = ownership
        self.counts = counts
        self.syncing: dict[int, set[bytes]] = {}  # slot -> the objects its primary sent since SYNC_BEGIN

    async def serve(
        self, conn: socket.socket, peer: PeerIdentity, request: int, req: w.ReplicateRequest, deadline: Deadline
    ) -> None:
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
        if not await self.accepts(req):
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
            self.begin_sync(req.slot)
            log.info("node %s: slot %d is copied here from %s", self.node_id, req.slot, req.primary)
        elif req.phase == w.SYNC_END:
            dropped = self.end_sync(req.slot)
            log.info(
                "node %s: slot %d copied from %s (%d it held are gone there)",
                self.node_id,
                req.slot,
                req.primary,
                dropped,
            )
        staged = await self.stage(req)
        try:
            with deadline(sum(sizes)):
                await receive_or_discard(
                    conn, [(s.payload_array() if isinstance(s, Staged) else None, n) for s, n in zip(staged, sizes)]
                )
            results = await self.finish(req, staged)
        finally:
            for s in staged:
                if isinstance(s, Staged) and not s.handle.done:
                    await self.table.abort(s)
        await send_frame(
            conn, Op.OBJ_REPLICATE_REPLY, request, w.encode(w.ReplicateReply(self.ownership.map.epoch, results))
        )

    async def accepts(self, request: w.ReplicateRequest) -> bool:
        if request.epoch > self.ownership.map.epoch:
            self.ownership.known_epoch = max(self.ownership.known_epoch, request.epoch)
            self.ownership.refresh_soon()
            deadline = time.monotonic() + 5.0
            while self.ownership.map.epoch < request.epoch and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        return self.ownership.is_backup(request.slot, request.primary)

    def begin_sync(self, slot: int) -> None:
        """The primary copies the slot here: what this node holds of it stays until the copy is over
        (a returning node reconciles, it is not emptied first), and is then kept only as the primary
        sent it."""
        self.syncing[slot] = set()

    def end_sync(self, slot: int) -> int:
        """The copy is over: drop what the primary did not send (removed meanwhile, or never there).
        How many objects went."""
        sent = self.syncing.pop(slot, set())
        gone = [s.oid for s in self.table if self.ownership.slot_of(s.oid) == slot and s.oid not in sent]
        for oid in gone:
            self.table.remove(oid)
        return len(gone)

    async def stage(self, request: w.ReplicateRequest) -> list:
        """Per item: a ``Staged`` version to receive the bytes of, a ``Result`` (refused: its bytes are
        dropped), or None (a removal, applied in ``finish``)."""
        staged: list = []
        for item in request.items:
            if item.removed:
                staged.append(None)
                continue
            try:
                staged.append(
                    await self.table.stage(
                        object_id(item.name, item.tenant), item.tenant, item.name, item.size, meta_of(item)
                    )
                )
            except TierFullError as exc:
                staged.append(w.Result(Status.FULL, str(exc)))
            except (StoreError, ValueError) as exc:
                staged.append(w.Result(Status.INVALID, str(exc)))
        return staged

    async def finish(self, request: w.ReplicateRequest, staged: list) -> list[w.Result]:
        results = []
        for item, one in zip(request.items, staged):
            oid = object_id(item.name, item.tenant)
            if isinstance(one, w.Result):
                results.append(one)
                continue
            if one is None:
                self.table.remove(oid)
                self.syncing.get(request.slot, set()).discard(oid)
                await self.table.retired()  # as the primary's remove: nothing left for a restart to find
                results.append(w.Result(Status.OK))
                continue
            self.syncing.get(request.slot, set()).add(oid)
            held = self.table.get(oid)
            if held is not None and held.version > item.version:  # versions only go forward: keep ours
                await self.table.abort(one)
                results.append(w.Result(Status.OK))
                continue
            try:
                self.table.install(await self.table.prepare(one, item.version))
                results.append(w.Result(Status.OK))
            except TierFullError as exc:
                results.append(w.Result(Status.FULL, str(exc)))
            except (StoreError, OSError) as exc:
                results.append(w.Result(Status.INTERNAL, str(exc)))
        return results
