"""A node's link to the conductor: registration under a kept-alive lease, and reports of every block
that appears in or leaves the node's store; what the leader asks in its answers (pins, replication
tasks, flushes, eviction settings) is carried out by ``LeaderOrders`` (``leader_orders.py``).

What is reported comes from a ``HeldBlocks``: the store itself, or, for an engine whose cache tiercake
does not own (vLLM's prefix cache), the engine's account of it; pins, flushes, eviction settings and
replication act on the store and are skipped without one.

When the lease is found expired (the node was paused, partitioned or restarted), the node registers
again and re-reports everything its store holds, so its blocks (its SSD tier's after a restart)
become findable again. Placements live in the conductors' memory only, so when a new leader's term
begins the node re-reports what the new leader may lack: the changes the old one acknowledged in the
window the new one names (it kept its mirror of the old one's), or everything. A conductor that
cannot be reached is retried; nothing is dropped: changes queue up and are sent, coalesced, once it
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol

from tiercake.blocks import is_object_tenant
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import (
    KeepAliveReply,
    MemberInfo,
    MemberStats,
    TierStats,
)
from tiercake.tiers import BlockChange, TieredStore
from tiercake.transfer import TransferEngine

from .leader_orders import LeaderOrders

log = logging.getLogger(__name__)

RECENT_S = 60.0  # how long acknowledged changes are kept for a new leader's re-report window


class HeldBlocks(Protocol):
    """What a member reports to the index (a ``TieredStore`` is one)."""

    listeners: list[Callable[[BlockChange], None]]  # told of every copy that appears or leaves

    def holdings(self) -> list[BlockChange]:
        """Every copy held now, as the change that made it appear."""
        ...


class ConductorLink:
    def __init__(
        self,
        client: Client,
        member: MemberInfo,
        store: TieredStore | None,
        *,
        ttl: int = 5,
        engine: TransferEngine | None = None,
        flush_interval: float = 0.05,
        report: bool = True,
        held: HeldBlocks | None = None,
    ) -> None:
        self.client = client
        self.member = member
        self.store = store
        # what is reported; None: a member, but what it holds is not indexed (nobody is routed by it)
        self.reported: HeldBlocks | None = (held if held is not None else store) if report else None
        self.ttl = ttl
        self.flush_interval = flush_interval
        self.lease = 0
        self.registrations = 0
        # (tenant, key, tier) -> (added, nbytes): the latest change of each copy not yet reported
        self._changes: dict[tuple[str, bytes, str], tuple[bool, int]] = {}
        # the same, acknowledged in the last RECENT_S: (tenant, key, tier) -> (when, added, nbytes),
        # oldest first, for a new leader that kept its mirror of the old one's volatile replicas
        self._recent: OrderedDict[tuple[str, bytes, str], tuple[float, bool, int]] = OrderedDict()
        # copies a new term asked for again: sent, at the next send, as last acknowledged then (a
        # change of one in flight meanwhile is newer than what was acknowledged before it)
        self._redo: set[tuple[str, bytes, str]] = set()
        self._wakeup = asyncio.Event()
        self._sending = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.orders = LeaderOrders(client, member.node_id, store, engine, self.send_reports)
        self._term = 0  # the leader's term the volatile tiers were reported in
        # told of every registration (a new lease) and every keep-alive that succeeded, with the time
        # it was sent: the key-value store's owner of slots serves only while its lease is surely alive
        self.on_registered: list[Callable[[], None]] = []
        self.on_keepalive: list[Callable[[float, KeepAliveReply], None]] = []

    @property
    def attempt_s(self) -> float | None:
        """How long a keep-alive waits on one conductor where there is another to try: a third of the
        TTL, then the next one (a follower relays it to the leader). It waited the client's 5 s on a
        leader cut off from it, and the lease ran out behind that wait with a follower in reach. With
        one conductor, the client's own timeout: there is nobody else to ask, and a slow answer on a
        busy machine still keeps the member registered."""
        return max(self.ttl / 3, 0.2) if len(self.client.urls) > 1 else None

    async def start(self) -> ConductorLink:
        if self.reported is not None:
            self.reported.listeners.append(self._on_change)
        await self._register()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep_alive()), loop.create_task(self._report_forever())]
        return self

    async def close(self, leave: bool = True) -> None:
        """Stop; with ``leave`` the lease is revoked, so the node and its placements go at once."""
        if self.reported is not None:
            with contextlib.suppress(ValueError):
                self.reported.listeners.remove(self._on_change)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.orders.close()
        if leave and self.lease:
            with contextlib.suppress(ConductorError):
                await self.client.leave(self.member.node_id, self.lease)

    # Registration ---------------------------------------------------------------------------------

    async def _register(self) -> None:
        self.lease = await self.client.register(self.member, self.ttl)
        self.registrations += 1
        self.orders.pins_version = -1  # fetched again: the leader may have changed them meanwhile
        for listener in self.on_registered:
            listener()
        if self.orders.flush_epoch is None or self.on_keepalive:
            sent = time.monotonic()
            answer = await self.client.keep_alive(self.member.node_id, self.lease, timeout=self.attempt_s)
            if self.orders.flush_epoch is None:  # what the cluster has flushed so far is not for us to flush
                self.orders.flush_epoch = answer.settings.flush.epoch
                self._term = answer.term
            self._kept_alive(sent, answer)
        # everything held goes out again: the old lease took the node's placements with it
        for change in self.reported.holdings() if self.reported is not None else ():
            self._on_change(change)
        log.info(
            "node %s: registered (lease %x), re-reporting %d copies",
            self.member.node_id,
            self.lease,
            len(self._changes),
        )

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(max(self.ttl / 3, 0.2))
            try:
                await self._keep_alive_once()
            except Exception:  # noqa: BLE001 - the membership must outlive any one failure
                log.exception("node %s: a keep-alive failed; the next one goes on", self.member.node_id)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the link is closing
                # a cancellation nobody asked of this task, leaked by a library's timeout
                log.exception(
                    "node %s: a keep-alive was cancelled from within; the next one goes on", self.member.node_id
                )

    async def _keep_alive_once(self) -> None:
        """One keep-alive; what its answer asks is carried out off this loop (``LeaderOrders``)."""
        sent = time.monotonic()
        try:
            answer = await self.client.keep_alive(
                self.member.node_id, self.lease, self._stats(), timeout=self.attempt_s
            )
        except ConductorError as exc:
            if exc.status == 404:
                log.warning("node %s: lease expired; registering again", self.member.node_id)
                await self._register_again()
            else:
                log.warning("node %s: keep-alive failed (%s); retrying", self.member.node_id, exc)
            return
        self._kept_alive(sent, answer)
        self._note_term(answer)
        self.orders.take(answer)

    async def _register_again(self) -> None:
        """A registration after the lease lapsed. Whatever it meets, the keep-alive loop goes on and
        tries again: once, the loop ended on an error no handler expected (a body cut short by a
        partition), and the node agent stayed out of the cluster for good while it ran."""
        try:
            await self._register()
        except ConductorError as exc:
            log.warning("node %s: registering failed (%s); trying again", self.member.node_id, exc)
        except Exception:  # noqa: BLE001 - the membership must outlive any one failure
            log.exception("node %s: registering failed; trying again", self.member.node_id)

    def _kept_alive(self, sent: float, answer: KeepAliveReply) -> None:
        for listener in self.on_keepalive:
            try:
                listener(sent, answer)
            except Exception:  # noqa: BLE001 - a listener must not stop the keep-alives
                log.exception("node %s: a keep-alive listener failed", self.member.node_id)

    # Reports --------------------------------------------------------------------------------------

    def _note_term(self, answer: KeepAliveReply) -> None:
        """A new leader may lack some of this node's copies: report again those acknowledged in the
        window it names when it kept its mirror of the old leader's index, else all of them."""
        term, window = answer.term, answer.rereport_s
        if term and term != self._term:
            if self._term and self.reported is not None:
                if window is not None and window <= RECENT_S:
                    since = time.monotonic() - window
                    again = [copy for copy, (at, _, _) in self._recent.items() if at >= since]
                    self._redo.update(again)
                    self._wakeup.set()
                    count = len(again)
                else:
                    held = self.reported.holdings()
                    for change in held:
                        self._on_change(change)
                    count = len(held)
                log.info(
                    "node %s: new leader (term %d), re-reporting %d copies (%s)",
                    self.member.node_id,
                    term,
                    count,
                    "everything" if window is None or window > RECENT_S else f"the last {window:.1f} s",
                )
            self._term = term

    def _on_change(self, change: BlockChange) -> None:
        if is_object_tenant(change.tenant):
            return  # a key-value store object's block: its slot's owner knows it, the index does not
        self._changes[(change.tenant, change.key, change.tier)] = (change.added, change.nbytes)
        self._wakeup.set()

    async def send_reports(self) -> None:
        """Send every queued change; returns once the conductor has recorded them. One sender at a
        time: a copy's addition and removal reach the conductor in the order they happened."""
        async with self._sending:
            await self._send_reports()

    async def _send_reports(self) -> None:
        while self._changes or self._redo:
            redo, self._redo = self._redo, set()
            for copy in redo:  # nothing is in flight now: what was last acknowledged is the latest
                if copy not in self._changes and copy in self._recent:
                    self._changes[copy] = self._recent[copy][1:]
            pending, self._changes = self._changes, {}
            groups: dict[tuple[bool, str, str], list[tuple[bytes, int]]] = defaultdict(list)
            for (tenant, key, tier), (added, nbytes) in pending.items():
                groups[(added, tenant, tier)].append((key, nbytes))
            # all at once: each copy is in one group only (the leader applies each group as one batch)
            outcomes = await asyncio.gather(
                *(self._send_group(added, tenant, tier, blocks) for (added, tenant, tier), blocks in groups.items()),
                return_exceptions=True,
            )
            self._note_acknowledged(groups, outcomes)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                for copy, state in pending.items():  # keep them, unless a newer change came meanwhile
                    self._changes.setdefault(copy, state)
                raise failed[0]

    def _note_acknowledged(
        self, groups: dict[tuple[bool, str, str], list[tuple[bytes, int]]], outcomes: Sequence[object]
    ) -> None:
        """Keep the acknowledged changes of the last ``RECENT_S``, for a new leader's window."""
        now = time.monotonic()
        recent = self._recent
        for ((added, tenant, tier), blocks), outcome in zip(groups.items(), outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                for key, nbytes in blocks:
                    copy = (tenant, key, tier)
                    recent[copy] = (now, added, nbytes)
                    recent.move_to_end(copy)
        while recent and next(iter(recent.values()))[0] < now - RECENT_S:
            recent.popitem(last=False)

    async def _send_group(self, added: bool, tenant: str, tier: str, blocks: list[tuple[bytes, int]]) -> None:
        keys = [k for k, _ in blocks]
        if added:
            await self.client.report(tenant, self.member.node_id, tier, keys, [n for _, n in blocks])
        else:
            await self.client.remove(tenant, self.member.node_id, tier, keys)
        log.debug(
            "node %s: reported %s %d blocks of %s in %s",
            self.member.node_id,
            "new" if added else "gone",
            len(keys),
            tenant,
            tier,
        )

    async def _report_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(self.flush_interval)  # let a burst of changes gather into one report
            try:
                await self.send_reports()
            except Exception as exc:  # noqa: BLE001 - nothing may end the reports: the changes stay queued
                if isinstance(exc, ConductorError):
                    log.warning("node %s: report failed (%s); retrying", self.member.node_id, exc)
                else:
                    log.exception("node %s: report failed; retrying", self.member.node_id)
                await asyncio.sleep(0.5)
                self._wakeup.set()

    def _stats(self) -> MemberStats:
        return member_stats(self.store) if self.store is not None else MemberStats()


def member_stats(store: TieredStore) -> MemberStats:
    """What a member says of its store: in its keep-alives, and on its own /metrics."""
    stats = store.stats()
    return MemberStats(
        misses=stats["misses"],
        tiers={
            name: TierStats.model_validate(
                t
                | {
                    "eviction": t["eviction"].get("policy"),
                    "sessions": t["eviction"].get("sessions", {}),
                    "session_blocks": t["eviction"].get("held", 0),
                }
            )
            for name, t in stats["tiers"].items()
        },
    )
