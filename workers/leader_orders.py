"""What the leader asks of a member in each keep-alive's answer, carried out off the keep-alive loop
(``ConductorLink``), one answer at a time: the node's pins applied to its store, replication copies
pulled from their sources and extra replicas dropped, a cluster-wide flush applied and confirmed
once its removals are reported, and the eviction policies the cluster sets per tier.

Off the loop because a replication pull from a peer cut off waits out its deadline, and a lease of a
few seconds must not lapse behind it. An answer that comes while the last one is still acted on is
skipped: the next carries the same pins and settings, and the leader hands a task out again once its
deadline passes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import ClusterSettings, EvictionSpec, KeepAliveReply, ReplicationTask
from tiercake.policies import create_eviction
from tiercake.tiers import StoreError, TieredStore
from tiercake.transfer import BlockLoc, Transfer, TransferEngine

log = logging.getLogger(__name__)


class LeaderOrders:
    def __init__(
        self,
        client: Client,
        node_id: str,
        store: TieredStore | None,
        engine: TransferEngine | None,
        send_reports: Callable[[], Awaitable[None]],
    ) -> None:
        self.client, self.node_id, self.store = client, node_id, store
        self.engine = engine  # for replication pulls; None: tasks to copy are ignored
        self.send_reports = send_reports  # every queued change reported (before a flush is confirmed)
        self.pins: set[tuple[str, bytes]] = set()
        self.pins_version = -1  # of the pins applied; -1: fetch them at the next answer
        self.flush_epoch: int | None = None  # learnt at the first registration: a joining node does not flush
        self._eviction: dict[str, EvictionSpec] = {}
        self._acting: asyncio.Task | None = None  # acting on the latest answer taken
        self._tasks: set[asyncio.Task] = set()  # that, and flush confirmations under way

    def take(self, answer: KeepAliveReply) -> None:
        """Act on ``answer`` in the background, unless the last one is still being acted on."""
        if self._acting is None or self._acting.done():
            self._acting = self._spawn(self._act_on(answer))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _act_on(self, answer: KeepAliveReply) -> None:
        try:
            if self.store is not None:  # else nothing here to pin or copy into
                if answer.pins_version != self.pins_version:
                    await self._sync_pins(self.store)
                if answer.tasks:
                    await self._run_tasks(self.store, answer.tasks)
            await self.apply_settings(answer.settings)
        except ConductorError as exc:
            log.warning("node %s: %s", self.node_id, exc)
        except Exception:  # noqa: BLE001 - the next answer must be acted on still
            log.exception("node %s: acting on the keep-alive answer failed", self.node_id)

    async def apply_settings(self, settings: ClusterSettings) -> None:
        flush = settings.flush
        epoch, known = flush.epoch, self.flush_epoch  # (known from the registration on)
        if known is not None and epoch > known:
            tiers, store = flush.tiers, self.store
            mine = None if tiers is None or store is None else [t.name for t in store.tiers if t.name in tiers]
            if store is not None and (mine is None or mine):
                removed = await store.flush(mine)
                log.info("node %s: flushed %d blocks (%s)", self.node_id, removed, mine or "every tier")
            self.flush_epoch = epoch
            # confirmed apart: a confirmation retried through a leader change must not hold the
            # next answer's orders
            self._spawn(self._flushed(epoch))
        eviction = settings.eviction
        if eviction != self._eviction and self.store is not None:
            names = {t.name for t in self.store.tiers}
            for tier, spec in eviction.items():
                if tier in names and spec != self._eviction.get(tier):
                    try:
                        self.store.set_eviction(tier, create_eviction(spec.policy, spec.params))
                    except (LookupError, TypeError, ValueError) as exc:
                        log.warning("node %s: eviction policy %s for %s refused: %s", self.node_id, spec, tier, exc)
            self._eviction = eviction

    async def _flushed(self, epoch: int) -> None:
        """Tell the leader the flush is applied, once what it removed is reported (an operator waiting
        on a synchronous flush then finds the index without those copies)."""
        try:
            await self.send_reports()
            await self.client.flush_applied(self.node_id, epoch)
        except ConductorError as exc:  # a synchronous flush then names this member as late
            log.warning("node %s: could not confirm flush %d: %s", self.node_id, epoch, exc)

    async def _sync_pins(self, store: TieredStore) -> None:
        version, pins = await self.client.node_pins(self.node_id)
        wanted = set(pins)
        for _tenant, key in wanted - self.pins:
            with contextlib.suppress(StoreError):  # gone meanwhile: the next report says so
                store.pin(key, hard=True)
        for _tenant, key in self.pins - wanted:
            with contextlib.suppress(StoreError):
                store.unpin(key)
        self.pins = wanted
        self.pins_version = version

    async def _run_tasks(self, store: TieredStore, tasks: list[ReplicationTask]) -> None:
        copies = [t for t in tasks if t.source and not store.contains(bytes.fromhex(t.key))]
        for task in tasks:
            if task.source is None:
                with contextlib.suppress(StoreError):  # leased or pinned here: it stays
                    await store.remove(bytes.fromhex(task.key))
        if not copies or self.engine is None:
            return
        members = {m.node_id: m for m in await self.client.members()}
        batch = []
        for task in copies:
            source = members.get(task.source) if task.source else None
            if source is None:
                continue
            self.engine.ensure_peer(source.node_id, source.host, source.port)
            key = bytes.fromhex(task.key)
            batch.append(
                Transfer(BlockLoc(source.node_id, key), BlockLoc(self.node_id, key, tenant=task.tenant), task.size)
            )
        for result in await self.engine.transfer(batch, timeout=self.engine.deadline_for(sum(t.length for t in batch))):
            if not result.ok:
                log.warning("node %s: replication pull failed: %s", self.node_id, result.error)
