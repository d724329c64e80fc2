"""A follower conductor's calls to the leader: the accesses its lookups counted, forwarded every
second (the leader decides replication), and the leader's placement index, mirrored by long polls
of its change log (the leader alone hears of placements). It keeps one client per leader URL until
it closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from tiercake.messages import PlacementChange

from .block_table import as_keys
from .client import Client, ConductorError
from .metadata import MetadataUnavailableError
from .placement import Change

if TYPE_CHECKING:
    from .service import Conductor

log = logging.getLogger(__name__)

FEED_WAIT_S = 2.0  # a follower's long poll for the leader's placement changes
# A mirror in step had a poll answered at the log's end this recently: the leader holds a poll up to
# FEED_WAIT_S and answers it at once when a change comes, so past this it lost the leader or fell behind
IN_STEP_S = FEED_WAIT_S + 1.0
FEED_POLL_S = 0.5  # its pause after a failed poll, or while it leads
FEED_GATHER_S = 0.02  # and after an answer with changes, so the next one gathers a batch
HEAT_FORWARD_S = 1.0  # how often a follower sends its lookups' access counts to the leader
MAX_HEAT_OUT = 50_000  # distinct blocks a follower keeps counts for between two sends
# blocks' counts in one request to the leader: it parses and adds a request in one turn of its loop
# (50,000 in the release before's form took it 180 ms, a stall for every lookup, keep-alive and
# report behind them)
HEAT_CHUNK = 2048


class LeaderLink:
    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.followed_term = 0  # the leader's term this follower's feed answered in last
        # what that leader asks its members to re-report, and when it said so (monotonic)
        self._followed_window: tuple[float | None, float] = (None, 0.0)
        self._synced_at: float | None = None  # monotonic: when the mirror was last in step with a leader
        self._at_end: float | None = None  # monotonic: when a poll's answer last reached the log's end
        self._heat_out: dict[tuple[str, bytes], int] = {}
        self._peers: dict[str, Client] = {}  # leader URL -> a client of it
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._forward_heat_forever()))
        self._tasks.append(loop.create_task(self._follow_forever()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for peer in self._peers.values():
            await peer.close()

    def followed_window(self) -> float | None:
        """The leader's re-report window (``Conductor.rereport_s``) as of now: what it said, plus the
        time since it said it."""
        window, said = self._followed_window
        return None if window is None else window + time.monotonic() - said

    def stepped_down(self) -> None:
        """This conductor stopped leading: its index is exact as of now, a mirror in step."""
        self._synced_at = time.monotonic()

    def mirror_age(self) -> float | None:
        """Seconds since the mirror of the index was last in step with a leader; None without one."""
        return None if self._synced_at is None else time.monotonic() - self._synced_at

    def in_step(self) -> bool:
        """Whether the mirror follows the leader's log now (a poll's answer reached the log's end less
        than ``IN_STEP_S`` ago, and a poll is held meanwhile): clients may send it their lookups."""
        if self._synced_at is None or self._at_end is None:  # (a leader's role is its own: read_role)
            return False
        return time.monotonic() - self._at_end < IN_STEP_S

    def count(self, hits: list[tuple[str, bytes]]) -> None:
        """Accesses a follower's lookup found, for the next send (bounded: past ``MAX_HEAT_OUT``
        distinct blocks, new ones wait for the send after)."""
        for hit in hits:
            if hit in self._heat_out or len(self._heat_out) < MAX_HEAT_OUT:
                self._heat_out[hit] = self._heat_out.get(hit, 0) + 1

    async def _forward_heat_forever(self) -> None:
        while True:
            try:
                await self._forward_heat()
            except Exception:  # noqa: BLE001 - one failure must not end the forwarding for good
                log.exception("conductor %s: forwarding access counts failed", self.conductor.conductor_id)
                await asyncio.sleep(HEAT_FORWARD_S)

    async def _forward_heat(self) -> None:
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
                hits = [(t, k, n) for (t, k), n in batch.items()]
                for start in range(0, len(hits), HEAT_CHUNK):  # one after another: the leader serves between
                    await peer.heat(hits[start : start + HEAT_CHUNK])
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

    async def _follow_forever(self) -> None:
        while True:  # a mirror that stopped following would be stale from then on, silently
            try:
                await self._follow()
            except Exception:  # noqa: BLE001 - started over from a snapshot
                self.followed_term = 0
                log.exception("conductor %s: following the leader's placements failed", self.conductor.conductor_id)
                await asyncio.sleep(FEED_POLL_S)

    async def _follow(self) -> None:
        """A follower mirrors the leader's placement index (the leader alone hears of placements): a
        snapshot first, page by page, then each change, by long polls; it starts over whenever the
        term changes or it falls further behind than the leader's log keeps."""
        term = seq = 0
        row: int | None = None  # the next page of a snapshot being read
        began = 0.0  # when its first page was asked for
        while True:
            if self.conductor.is_leader:
                term = seq = self.followed_term = 0  # on stepping down it starts over from a snapshot
                row = None
                await asyncio.sleep(FEED_POLL_S)
                continue
            peer = await self._leader_peer()
            if peer is None:
                self.followed_term = 0
                await asyncio.sleep(FEED_POLL_S)
                continue
            sent = time.monotonic()
            try:
                answer = await peer.feed(term, seq, row, wait_s=0.0 if row is not None else FEED_WAIT_S)
            except ConductorError as exc:
                self.followed_term = 0  # the leader may have changed: ask the backend meanwhile
                log.debug("conductor %s: placement changes not fetched: %s", self.conductor.conductor_id, exc)
                await asyncio.sleep(FEED_POLL_S)
                continue
            if self.conductor.is_leader:  # it won meanwhile: its own term began with its mirror
                continue
            self.conductor.index.apply((_change(c) for c in answer.changes), reset=answer.reset)
            if answer.reset:
                began = sent  # the snapshot holds what was acknowledged before its first page
            if answer.reset or row is not None:  # a snapshot's page: a mirror in part is not kept on a win
                row = answer.next_row
                self._synced_at = began if row is None else None
            elif not answer.more:
                self._synced_at = sent  # it holds what was acknowledged before this poll
                self._at_end = time.monotonic()
            term, seq = answer.term, answer.seq
            self.followed_term, self._followed_window = term, (answer.rereport_s, sent)
            if answer.changes and row is None and not answer.more:
                await asyncio.sleep(FEED_GATHER_S)  # the next answer carries what came meanwhile


def _change(wire: PlacementChange) -> Change:
    return Change(
        wire.kind,
        wire.tenant,
        wire.node,
        wire.tier,
        as_keys(wire.keys),
        np.frombuffer(wire.sizes, dtype="<u4").astype(np.uint32),
    )
