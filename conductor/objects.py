"""The object map: which node owns each slot of the key-value store's objects (``ObjectMap``).

Objects are not placed one by one: an object's name picks its slot, and the map gives each slot a
chain of nodes, the primary first. The primary owns the slot's objects (their versions, their bytes,
their replication to the backups, ``workers/objects.py``); the conductor is off the per-object path
and only keeps the map, in etcd under ``OBJECT_MAP``, written by the leader alone (fenced like every
leader write) and followed by every conductor. Members see its epoch in their keep-alive answers.

How it changes (``plan``, on the leader, a few times a second):

- the first map: every slot's chain is the live nodes in rendezvous order for that slot (highest
  random weight), up to ``replicas_max``: each node is primary for about as many slots;
- a member absent (its lease expired) for ``failover_s`` leaves every chain: where it was primary,
  the first backup that holds the whole slot (``ready``) takes over. A node agent that restarts
  sooner keeps its slots (and, with its pool adopted, what it held). A node's own check stops it
  serving as soon as its lease is not surely alive, before anyone can take over: never two primaries;
- a chain shorter than ``replicas_max`` (a node gone, or joined since) gets the best live node in
  rendezvous order appended; it is not ready until its primary has copied the slot to it and says so
  (``mark_ready``);
- rebalance: where a slot's rendezvous-first node is a ready backup, the map asks the primary to hand
  the slot to it (``handoff``); the primary stops serving it and says so (``mark_ready(handed_off=
  True)``), and the next map makes that backup the primary;
- a slot whose primary holds objects persisted on it alone (``pinned``: it says so before it
  acknowledges the first) never moves away from that primary while it is absent: the objects are on
  its SSD and nowhere else, so the slot is unavailable until it returns (or an operator ``release``s
  it: those objects are then lost, knowingly). Its handoff moves the pin with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable

from tiercake.messages import ObjectMap, SlotReady
from tiercake.transfer.protocol import OBJECTS_SINCE

from .membership import Membership
from .metadata import Guard, MetadataBackend, Put, WatchEvent, follow

log = logging.getLogger(__name__)

OBJECT_MAP = b"/tiercake/objects/map"


class MapRefused(Exception):
    """A primary's report that does not fit the current map (an older epoch, another primary)."""


def rendezvous(slot: int, nodes: list[str]) -> list[str]:
    """``nodes`` in the slot's rendezvous order (highest random weight first): removing a node moves
    only its own slots, adding one takes about 1/n of every other's."""

    def weight(node: str) -> bytes:
        return hashlib.blake2b(f"{slot}\0{node}".encode(), digest_size=8).digest()

    return sorted(nodes, key=weight, reverse=True)


def plan(current: ObjectMap, alive: list[str], gone: set[str], slots: int, replicas_max: int) -> ObjectMap:
    """The next map: ``current`` without the members ``gone`` for good, each chain moving towards its
    slot's rendezvous-best live nodes (the ones missing appended, to be copied; those no longer among
    the best dropped once the best all hold the slot), and a handoff asked where the best node is a
    ready backup. Returns ``current`` itself when nothing changes."""
    alive = sorted(alive)
    if not alive:
        # nobody to move a slot to: what looks like every node gone is likelier this conductor cut off
        # from them (or their leases lapsing together); either way the chains wait as they are
        return current
    if not current.chains:
        chains = [rendezvous(s, alive)[:replicas_max] for s in range(slots)]
        return ObjectMap(epoch=current.epoch + 1, chains=chains, ready=[len(c) for c in chains])
    chains, ready, handoff = [], [], {}
    for s, (chain, ready_n) in enumerate(zip(current.chains, current.ready)):
        if chain and current.pinned.get(s) == chain[0] and chain[0] not in alive:
            # what the primary alone persisted is nowhere else: the slot waits for it, however long
            # it is away (its objects answer "not ready", never "not found")
            chains.append(list(chain))
            ready.append(ready_n)
            continue
        chain, ready_n = _next_chain(chain, ready_n, rendezvous(s, alive)[:replicas_max], gone, replicas_max)
        chains.append(chain)
        ready.append(ready_n)
        best = rendezvous(s, alive)[0] if alive else None
        if best is not None and best != chain[0] and best in chain[1:ready_n] and chain[0] in alive:
            handoff[s] = best
    proposal = ObjectMap(epoch=current.epoch, chains=chains, ready=ready, handoff=handoff, pinned=current.pinned)
    if proposal.chains == current.chains and proposal.ready == current.ready and proposal.handoff == current.handoff:
        return current
    return proposal.model_copy(update={"epoch": current.epoch + 1})


def _next_chain(
    chain: list[str], ready_n: int, ideal: list[str], gone: set[str], replicas_max: int
) -> tuple[list[str], int]:
    # the members that held the whole slot stay in front, in their order: the first is the primary
    whole = [n for n in chain[:ready_n] if n not in gone]
    rest = [n for n in chain[ready_n:] if n not in gone]
    if not whole:  # nobody holds the whole slot any more: what the others hold is all there is
        whole, rest = rest[:1], rest[1:]
    if not whole:  # a slot with nobody left starts empty on the best live nodes: nothing to copy
        return list(ideal), len(ideal)
    chain = whole + rest + [n for n in ideal if n not in whole and n not in rest]
    ready_n = len(whole)
    # past replicas_max, members no longer among the best leave, once the best all hold the slot (never
    # the primary: a handoff moves it first)
    while len(chain) > replicas_max and all(n in chain[:ready_n] for n in ideal):
        extra = [i for i in range(len(chain) - 1, 0, -1) if chain[i] not in ideal]
        if not extra:
            break
        at = extra[0]
        del chain[at]
        if at < ready_n:
            ready_n -= 1
    return chain, ready_n


class ObjectMapKeeper:
    def __init__(
        self,
        meta: MetadataBackend,
        members: Membership,
        guard: Guard,
        leading: Callable[[], bool],
        *,
        slots: int = 256,
        replicas_max: int = 3,
        failover_s: float = 10.0,
        bootstrap_s: float = 2.0,
        every: float = 0.2,
        ttl_of: Callable[[str], float] = lambda node: 0.0,
    ) -> None:
        """``bootstrap_s``: how long after the first node is seen the first map is made, so that
        restarted nodes can offer the map they last had (``seed``) to a conductor that lost it (the
        embedded backend keeps nothing across a restart). ``ttl_of``: a node's member TTL, which its
        absence must last too before its slots move (a keep-alive a follower relayed may be
        acknowledged as the leader deletes the member: the node serves until its lease, counted from
        that keep-alive, runs out; ``liveness.py``)."""
        self.meta = meta
        self.members = members
        self.guard = guard
        self.leading = leading
        self.slots = slots
        self.replicas_max = replicas_max
        self.failover_s = failover_s
        self.bootstrap_s = bootstrap_s
        self.every = every
        self.ttl_of = ttl_of
        self._first_node_at: float | None = None
        self.map = ObjectMap()
        self._stored = (0, 0)  # (revision, epoch) of the newest map seen stored: a keep-alive's epoch check
        self._absent: dict[str, float] = {}  # chain member -> monotonic time it was first seen absent
        self._lock = asyncio.Lock()  # one writer of the map in this conductor
        self._tasks: list[asyncio.Task] = []
        self.changed = asyncio.Event()

    @classmethod
    def of(
        cls,
        meta: MetadataBackend,
        members: Membership,
        guard: Guard,
        leading: Callable[[], bool],
        objects=None,
        ttl_of: Callable[[str], float] = lambda node: 0.0,
    ):
        """Kept as ``objects`` (an ``ObjectsConfig``; default: its defaults) says."""
        from tiercake.config import ObjectsConfig

        objects = objects or ObjectsConfig()
        return cls(
            meta,
            members,
            guard,
            leading,
            slots=objects.slots,
            replicas_max=objects.replicas_max,
            failover_s=objects.failover_s,
            bootstrap_s=objects.bootstrap_s,
            ttl_of=ttl_of,
        )

    async def start(self) -> ObjectMapKeeper:
        kv = await self.meta.get(OBJECT_MAP)
        revision = 0
        present = [] if kv is None else [OBJECT_MAP]
        if kv is not None:
            self.map = ObjectMap.model_validate_json(kv.value)
            revision = kv.mod_revision
            self._stored = (revision, self.map.epoch)
        else:
            _, revision = await self.meta.range(OBJECT_MAP)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(follow(self.meta, OBJECT_MAP, revision + 1, self._apply, "object map", present=present)),
            loop.create_task(self._keep_forever()),
        ]
        return self

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _apply(self, event: WatchEvent) -> None:
        if event.kind == "put" and event.key == OBJECT_MAP:
            seen = ObjectMap.model_validate_json(event.value)
            self._stored = max(self._stored, (event.revision, seen.epoch))
            if seen.epoch >= self.map.epoch:
                self.map = seen
                self.changed.set()
                self.changed = asyncio.Event()

    def nodes(self) -> list[str]:
        """The node agents that may own slots: those that speak the object operations (a node agent of
        the previous release, during an upgrade, serves blocks only)."""
        return [m.node_id for m in self.members.alive("node") if m.transfer_version >= OBJECTS_SINCE]

    async def _keep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            if not self.leading():
                self._absent.clear()  # a new leader starts the clocks again: later, never sooner
                continue
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the map's keeper must outlive one failed round
                log.exception("object map: a round failed")

    async def step(self) -> ObjectMap:
        """One round: the next map, written if it changed."""
        async with self._lock:
            alive = self.nodes()
            now = time.monotonic()
            members = {n for chain in self.map.chains for n in chain}
            for node in members:
                if node in alive:
                    self._absent.pop(node, None)
                else:
                    self._absent.setdefault(node, now)
            for node in [n for n in self._absent if n not in members]:
                del self._absent[node]
            gone = {n for n, since in self._absent.items() if now - since >= max(self.failover_s, self.ttl_of(n))}
            if not self.map.chains:
                if not alive:
                    return self.map
                self._first_node_at = self._first_node_at or now
                if now - self._first_node_at < self.bootstrap_s:
                    return self.map  # a restarted node may still offer the map it had
            nxt = plan(self.map, alive, gone, self.slots, self.replicas_max)
            if nxt is not self.map:
                await self._write(nxt)
            return self.map

    async def stored_epoch(self) -> int:
        """The epoch of the map in the backend now (0: none yet): what a follower's copy, which a
        watch brings, may lag behind."""
        kv = await self.meta.get(OBJECT_MAP)
        if kv is None:
            return 0
        revision, epoch = self._stored
        if kv.mod_revision and kv.mod_revision == revision:
            return epoch  # the map this conductor parsed already (a follower's keep-alives ask often)
        epoch = ObjectMap.model_validate_json(kv.value).epoch
        self._stored = max(self._stored, (kv.mod_revision, epoch))
        return epoch

    async def seed(self, offered: ObjectMap) -> bool:
        """A node's last map, offered to a conductor that has none (its backend forgot it): taken
        when this conductor has no map yet, so the slots stay with the nodes that hold them."""
        async with self._lock:
            if self.map.chains or not offered.chains or len(offered.ready) != len(offered.chains):
                return False
            await self._write(
                offered.model_copy(update={"epoch": max(offered.epoch, self.map.epoch) + 1, "handoff": {}})
            )
            log.info("object map: seeded from a node's last map (%d slots)", offered.slots)
            return True

    async def mark(self, reports: list[SlotReady]) -> tuple[ObjectMap, list[str]]:
        """Primaries' reports, in one change of the map: a backup now holds the whole slot (it was
        copied there), holds it no more (``lagging``: it failed a write), or took the slot over
        (``handed_off``). Per report, '' or why it was refused (the slot's primary or that member
        changed since)."""
        async with self._lock:
            current = self.map
            chains, ready, handoff = [list(c) for c in current.chains], list(current.ready), dict(current.handoff)
            pinned = dict(current.pinned)
            refused = []
            for report in reports:
                try:
                    _apply_report(report, chains, ready, handoff, pinned)
                    refused.append("")
                except MapRefused as exc:
                    refused.append(str(exc))
            changed = {"chains": chains, "ready": ready, "handoff": handoff, "pinned": pinned}
            if any(value != getattr(current, field) for field, value in changed.items()):
                await self._write(current.model_copy(update={"epoch": current.epoch + 1, **changed}))
            return self.map, refused

    async def release(self, node: str) -> list[int]:
        """An operator's word that ``node`` is gone for good with what it alone persisted: its pinned
        slots may move (their objects that were persisted on it alone are lost). The slots released."""
        async with self._lock:
            released = sorted(s for s, holder in self.map.pinned.items() if holder == node)
            if released:
                pinned = {s: n for s, n in self.map.pinned.items() if n != node}
                await self._write(self.map.model_copy(update={"epoch": self.map.epoch + 1, "pinned": pinned}))
                log.warning(
                    "object map: slots %s released from %s: what it alone persisted there is lost", released, node
                )
            return released

    async def _write(self, nxt: ObjectMap) -> None:
        revision = await self.meta.commit([Put(OBJECT_MAP, nxt.model_dump_json().encode())], guard=self.guard)
        self._stored = max(self._stored, (revision, nxt.epoch))
        self.map = nxt
        self.changed.set()
        self.changed = asyncio.Event()
        log.info(
            "object map: epoch %d (%d slots over %s)",
            nxt.epoch,
            nxt.slots,
            ", ".join(sorted({n for c in nxt.chains for n in c})) or "no nodes",
        )


def _apply_report(
    report: SlotReady, chains: list[list[str]], ready: list[int], handoff: dict[int, str], pinned: dict[int, str]
) -> None:
    s = report.slot
    if not 0 <= s < len(chains) or not chains[s] or chains[s][0] != report.primary:
        raise MapRefused(f"slot {s}: {report.primary} is not its primary")
    chain = chains[s]
    if report.pinned:  # the primary holds, or is about to acknowledge, an object persisted on it alone
        if report.node != report.primary:
            raise MapRefused(f"slot {s}: only its primary pins it, to itself")
        pinned[s] = report.primary
        return
    if report.node not in chain[1:]:
        raise MapRefused(f"slot {s}: {report.node} is not one of its backups")
    at = chain.index(report.node)
    if report.lagging:
        if at < ready[s]:  # after the ready members: never promoted before it is copied again
            chain.append(chain.pop(at))
            ready[s] -= 1
            handoff.pop(s, None)
    elif report.handed_off:
        if handoff.get(s) != report.node or at >= ready[s]:
            raise MapRefused(f"slot {s}: no handoff to {report.node} was asked")
        chain.insert(0, chain.pop(at))  # the old primary stays, as a ready backup
        del handoff[s]
        if pinned.get(s) == report.primary:  # its objects persisted alone went with the slot
            pinned[s] = report.node
    elif at >= ready[s]:
        chain.insert(ready[s], chain.pop(at))
        ready[s] += 1
