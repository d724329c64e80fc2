"""A follower conductor's calls to the leader: the accesses its lookups counted, forwarded every
second (the leader decides replication), and the leader's volatile replicas, mirrored by long polls
(the leader alone hears of them). It keeps one client per leader URL until it closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from .client import Client, ConductorError
from .metadata import MetadataUnavailableError

if TYPE_CHECKING:
    from .service import Conductor

log = logging.getLogger(__name__)

VOLATILE_WAIT_S = 2.0  # a follower's long poll for the leader's volatile changes
VOLATILE_POLL_S = 0.5  # its pause after a failed poll, or while it leads
VOLATILE_GATHER_S = 0.02  # and after an answer with changes, so the next one gathers a batch
HEAT_FORWARD_S = 1.0  # how often a follower sends its lookups' access counts to the leader
MAX_HEAT_OUT = 50_000  # distinct blocks a follower keeps counts for between two sends


class LeaderLink:
    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.followed_term = 0  # the leader's term this follower's volatile feed answered in last
        self.followed_rereport_s: float | None = None  # what that leader asks its members to re-report
        self._synced_at: float | None = None  # monotonic: when the mirror was last in step with a leader
        self._heat_out: dict[tuple[str, bytes], int] = {}
        self._peers: dict[str, Client] = {}  # leader URL -> a client of it
        self._tasks: list[asyncio.Task] = []

    def start(self, follow_volatile: bool) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._forward_heat_forever()))
        if follow_volatile:
            self._tasks.append(loop.create_task(self._follow_volatile_forever()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for peer in self._peers.values():
            await peer.close()

    def mirror_age(self) -> float | None:
        """Seconds since the volatile mirror was last in step with a leader; None without one."""
        return None if self._synced_at is None else time.monotonic() - self._synced_at

    def count(self, hits: list[tuple[str, bytes]]) -> None:
        """Accesses a follower's lookup found, for the next send (bounded: past ``MAX_HEAT_OUT``
        distinct blocks, new ones wait for the send after)."""
        for hit in hits:
            if hit in self._heat_out or len(self._heat_out) < MAX_HEAT_OUT:
                self._heat_out[hit] = self._heat_out.get(hit, 0) + 1

    async def _forward_heat_forever(self) -> None:
        """Every second, a follower sends the accesses its lookups counted to the leader (dropped if the
        leader cannot take them: rates are estimates, and the next second brings more)."""
        while True:
            await asyncio.sleep(HEAT_FORWARD_S)
            if self.conductor.is_leader or not self._heat_out:
                self._heat_out.clear()
                continue
            batch, self._heat_out = self._heat_out, {}
            peer = await self._leader_peer()
            if peer is None:
                continue
            try:
                await peer.heat([(t, k, n) for (t, k), n in batch.items()])
            except ConductorError as exc:
                log.warning("conductor %s: access counts not sent to the leader: %s", self.conductor.conductor_id, exc)

    async def _leader_peer(self) -> Client | None:
        """A client of the leader, for a follower's calls to it; None when no other conductor leads."""
        try:
            leader = await self.conductor.leader()
        except MetadataUnavailableError:
            return None
        if leader is None or not leader.url or leader.conductor_id == self.conductor.conductor_id:
            return None
        if leader.url not in self._peers:  # kept until close: leaders are few, and calls may be in flight
            self._peers[leader.url] = Client(
                [leader.url], token=self.conductor.peer_token, timeout=5, retries=1, ssl=self.conductor.peer_ssl
            )
        return self._peers[leader.url]

    async def _follow_volatile_forever(self) -> None:
        """A follower mirrors the leader's volatile replicas (the leader alone hears of them): a
        snapshot first, then each change, by long polls; it starts over whenever the term changes."""
        term = seq = 0
        while True:
            if self.conductor.is_leader:
                term = seq = self.followed_term = 0  # on stepping down it starts over from a snapshot
                self._synced_at = None
                await asyncio.sleep(VOLATILE_POLL_S)
                continue
            peer = await self._leader_peer()
            if peer is None:
                self.followed_term = 0
                await asyncio.sleep(VOLATILE_POLL_S)
                continue
            try:
                answer = await peer.volatile(term, seq, wait_s=VOLATILE_WAIT_S)
            except ConductorError as exc:
                self.followed_term = 0  # the leader may have changed: ask the backend meanwhile
                log.debug("conductor %s: volatile replicas not fetched: %s", self.conductor.conductor_id, exc)
                await asyncio.sleep(VOLATILE_POLL_S)
                continue
            if self.conductor.is_leader:  # it won meanwhile: its own term began with none
                continue
            self.conductor.index.apply_volatile(
                ((c.tenant, bytes.fromhex(c.key), c.node, c.tier, c.size) for c in answer.changes), answer.reset
            )
            term, seq = answer.term, answer.seq
            self.followed_term, self.followed_rereport_s = term, answer.rereport_s
            self._synced_at = time.monotonic()
            if answer.changes:
                await asyncio.sleep(VOLATILE_GATHER_S)  # the next answer carries what came meanwhile
