"""The key-value store's own faults, beside the serving ones (``faults.py``), as a hostile client and
a rebooted host inflict them (issue 49's findings): each returns the check that is true once the
cluster is back, and records what it saw for the run's figures.

- ``forge_replication``: what every key-value client holds (the cluster secret) sends the node a
  SYNC_BEGIN (which made a backup drop the slot) and a version of 10^15 naming the slot's primary,
  for a few of its slots: each must be refused (FORBIDDEN), nothing of the store changed;
- ``regex_stall``: another tenant removes by a pattern that backtracks exponentially under Python's
  ``re`` (it once blocked a node's event loop for seconds) while the load runs;
- ``big_batch``: another tenant puts 16,000 small persisted objects in one call: every item answered,
  every one stored;
- ``kill_node_without_pool``: the node agent SIGKILLed and its pool file deleted (a host reboot);
  ``up`` starts it again on a new pool, and every acknowledged persisted object reads back.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tiercake.kvstore import AsyncStore, Durability
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import PeerAddress, PeerConnection
from tiercake.transfer.protocol import FLAG_EAGER, Op, Status
from tiercake.up import UpProcess

BATCH_ITEMS = 16_000
FORGED_SLOTS = 8  # slots a forgery is sent for


@dataclass
class StoreFindings:
    forged_sent: int = 0
    forged_refused: int = 0
    batch_answered: int = 0  # items of the big batch that were stored
    regex_s: float = 0.0  # how long the catastrophic pattern's removal took
    seen: list[str] = field(default_factory=list)  # the store faults injected


class StoreFaults:
    def __init__(self, up: UpProcess, secret: str, pool: Path, node_pid) -> None:
        """``node_pid``: a coroutine function giving the node agent's pid (the serving faults')."""
        self.up, self.secret, self.pool, self._node_pid = up, secret, pool, node_pid
        self.found = StoreFindings()

    def _store(self, tenant: str) -> AsyncStore:
        return AsyncStore(
            [self.up.control_url], secret=self.secret, token=self.up.token, ssl=self.up.ssl, tenant=tenant, retry_s=30.0
        )

    async def forge_replication(self):
        self.found.seen.append("forge_replication")
        async with self._store("chaos-forger") as store:
            await store.refresh()
            node, (host, port) = next(iter(store.members.items()))
            slots = [s for s, chain in enumerate(store.map.chains) if chain and chain[0] == node][:FORGED_SLOTS]
            epoch = store.map.epoch
        forged = w.Replica("chaos-kv", b"forged", 10**15, 5, 2, False, False, w.NO_SOFT_PIN)
        conn = await PeerConnection(PeerAddress(node, host, port), self.secret.encode(), "chaos-forger").open()
        try:
            for slot in slots:
                for request, data in (
                    (w.ReplicateRequest(slot, epoch, node, w.SYNC_BEGIN), []),
                    (w.ReplicateRequest(slot, epoch, node, w.ITEMS, [forged]), [np.frombuffer(b"forge", np.uint8)]),
                ):
                    body = await conn.exchange(
                        Op.OBJ_REPLICATE, Op.OBJ_REPLICATE_REPLY, w.encode(request), FLAG_EAGER, data
                    )
                    statuses = {r.status for r in w.decode(w.ReplicateReply, body).results}
                    self.found.forged_sent += 1
                    self.found.forged_refused += statuses == {Status.FORBIDDEN}
        finally:
            conn.close()
        return _always

    async def regex_stall(self):
        self.found.seen.append("regex_stall")
        async with self._store("chaos-regex") as store:
            names = [f"{'a' * 30}!{i}" for i in range(40)]
            await store.put_many(names, [b"x"] * len(names))
            started = asyncio.get_running_loop().time()
            await store.remove_matching("(a+)+$")
            self.found.regex_s = asyncio.get_running_loop().time() - started
            await store.remove_matching(None, force=True)
        return _always

    async def big_batch(self):
        self.found.seen.append("big_batch")
        async with self._store("chaos-batch") as store:
            names = [f"batch-{i}" for i in range(BATCH_ITEMS)]
            values = [i.to_bytes(4, "little") * 64 for i in range(BATCH_ITEMS)]
            answers = await store.put_many(names, values, durability=Durability(persist=True))
            self.found.batch_answered = sum(a is None for a in answers)
            await store.remove_matching(None, force=True)
        return _always

    async def kill_node_without_pool(self):
        self.found.seen.append("kill_node_without_pool")
        pid = await self._node_pid()
        os.kill(pid, signal.SIGKILL)
        for path in (self.pool, Path(f"{self.pool}.objects")):
            path.unlink(missing_ok=True)  # a reboot: the memory level is gone; what was persisted is not

        async def back() -> bool:
            try:
                return await self._node_pid() != pid
            except (LookupError, OSError):
                return False

        return back


async def _always() -> bool:
    return True
