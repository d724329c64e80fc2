"""Which slots of the object map this node serves, and from when to when.

A node serves a slot as its primary while both hold:

- its copy of the object map names it the slot's primary, and that copy is as new as the epoch the
  conductor last told it of (every keep-alive answer carries the map's epoch: an older copy is
  fetched again before the node serves by it);
- its member lease is surely alive: the last keep-alive that succeeded was *sent* less than the
  lease's TTL ago. The conductor moves a slot to another node only once the lease has expired there
  (and ``objects.failover_s`` more), so a node that is paused, partitioned or cut off from the
  conductor stops serving before anyone else can start: never two primaries of one slot.

A slot being handed to another node (a rebalance) is frozen here meanwhile: its requests are
answered UNAVAILABLE, and the client tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tiercake.blocks import object_slot
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import KeepAliveReply, ObjectMap
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import Status

log = logging.getLogger(__name__)

LEASE_MARGIN = 0.9  # of the member TTL: the node's own view of its lease ends before etcd's can


class Ownership:
    def __init__(self, node_id: str, client: Client | None, ttl: float, map_path: Path | None = None) -> None:
        """``client``: the conductor (None: a standalone node serves no objects); ``map_path``: where
        the last map is kept, to offer a conductor that lost it (it is never served by)."""
        self.node_id = node_id
        self.client = client
        self.ttl = ttl
        self._primary_of: frozenset[int] = frozenset()
        self.map = ObjectMap()  # (the property keeps what every request asks of it)
        self.map_path = map_path
        self.saved = _load(map_path)  # the map this node had before it restarted, if any
        self._offered = False
        self.lease_until = 0.0  # monotonic
        self.known_epoch = 0  # the newest map epoch the conductor told of
        self.frozen: set[int] = set()
        self.listeners: list[Callable[[ObjectMap, ObjectMap], None]] = []  # (old, new) on every new map
        self._refreshing: asyncio.Task | None = None
        self._pending_lease = 0.0  # a lease renewal waiting for the map it was told of

    @property
    def map(self) -> ObjectMap:
        return self._map

    @map.setter
    def map(self, new: ObjectMap) -> None:
        # what each item of a request asks, kept as plain values: the slot count, the slots this node
        # is the primary of (a 128-item put asked the map's model a thousand times)
        self._map, self.slots = new, new.slots
        self._primary_of = frozenset(s for s, chain in enumerate(new.chains) if chain and chain[0] == self.node_id)

    # What the conductor tells ----------------------------------------------------------------------

    def note_keepalive(self, sent_at: float, answer: KeepAliveReply) -> None:
        """A keep-alive sent at ``sent_at`` (monotonic) succeeded: the lease is alive until
        ``sent_at`` plus most of the TTL, once this node's map is as new as the answer's epoch."""
        until = sent_at + LEASE_MARGIN * self.ttl
        if answer.objects_epoch == 0 and self.saved is not None and not self._offered:
            self._offered = True  # the conductor has no map: offer the one this node had
            asyncio.get_running_loop().create_task(self._offer(self.saved))
        self.known_epoch = max(self.known_epoch, answer.objects_epoch)
        if self.map.epoch >= answer.objects_epoch:
            self.lease_until = max(self.lease_until, until)
        else:
            self._pending_lease = max(self._pending_lease, until)
            self.refresh_soon()

    def note_registered(self) -> None:
        """A new lease (a start, or after the old one expired): nothing is served until a keep-alive
        under it succeeds, and the map is fetched again (slots may have moved while the lease was gone)."""
        self.lease_until = 0.0
        self.refresh_soon()

    def refresh_soon(self) -> None:
        if self.client is not None and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        assert self.client is not None  # refresh_soon starts it only with a client
        for attempt in range(50):
            try:
                fetched = await self.client.object_map()
            except ConductorError as exc:
                log.warning("node %s: fetching the object map failed: %s", self.node_id, exc)
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            self.install(fetched)
            if fetched.epoch >= self.known_epoch:
                return
            await asyncio.sleep(0.05)  # a follower that has not seen the newest map yet: ask again

    async def _offer(self, saved: ObjectMap) -> None:
        assert self.client is not None  # offered only with a client
        try:
            answer = await self.client.seed_object_map(saved)
        except ConductorError as exc:
            log.warning("node %s: offering the last object map failed: %s", self.node_id, exc)
            self._offered = False
            return
        log.info(
            "node %s: offered its last object map (epoch %d): %s",
            self.node_id,
            saved.epoch,
            "taken" if not answer.refused else answer.refused[0],
        )
        self.install(answer.map)

    def install(self, fetched: ObjectMap) -> None:
        if fetched.epoch < self.map.epoch:
            return
        old, self.map = self.map, fetched
        self.known_epoch = max(self.known_epoch, fetched.epoch)
        if fetched.epoch >= self.known_epoch and self._pending_lease:
            self.lease_until = max(self.lease_until, self._pending_lease)
            self._pending_lease = 0.0
        if fetched.epoch != old.epoch:
            _save(self.map_path, fetched)
            self.frozen = {s for s in self.frozen if self.is_primary(s)}
            for listener in self.listeners:
                listener(old, fetched)

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing

    # What the node may do ---------------------------------------------------------------------------

    def slot_of(self, oid: bytes) -> int:
        return object_slot(oid, self.slots) if self.slots else 0

    def lease_alive(self) -> bool:
        return time.monotonic() < self.lease_until

    def serves(self, slot: int, client_epoch: int) -> Status | None:
        """None when this node serves ``slot`` now; else why not: WRONG_OWNER (its map names another
        primary: the client's map is older, or this one is and is being fetched) or UNAVAILABLE
        (its own primary, but its lease is not surely alive, or the slot is being handed off)."""
        if client_epoch > self.map.epoch:
            self.known_epoch = max(self.known_epoch, client_epoch)
            self.refresh_soon()
            return Status.UNAVAILABLE
        if slot not in self._primary_of:
            return Status.WRONG_OWNER
        if slot in self.frozen or not self.lease_alive() or self.map.epoch < self.known_epoch:
            return Status.UNAVAILABLE
        return None

    def refusal(self, oid: bytes, client_epoch: int) -> w.Result | None:
        """``serves`` for the object ``oid``, as an item's answer: None when this node serves it."""
        status = self.serves(self.slot_of(oid), client_epoch)
        return None if status is None else w.Result(status, f"by map epoch {self.map.epoch}")

    def backups(self, slot: int) -> list[str]:
        return self.map.chains[slot][1:] if slot in self._primary_of else []

    def is_backup(self, slot: int, primary: str) -> bool:
        chain = self.map.chains[slot] if 0 <= slot < self.slots else []
        return bool(chain) and chain[0] == primary and self.node_id in chain[1:]

    def is_primary(self, slot: int) -> bool:
        """The map names this node the slot's primary (whether it serves it now: ``serves``)."""
        return slot in self._primary_of

    def primary_slots(self) -> list[int]:
        return sorted(self._primary_of)


def _load(path: Path | None) -> ObjectMap | None:
    if path is None or not path.exists():
        return None
    try:
        return ObjectMap.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        log.warning("the saved object map %s cannot be read (%s); ignored", path, exc)
        return None


def _save(path: Path | None, current: ObjectMap) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(current.model_dump_json())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot keep the object map in %s: %s", path, exc)
