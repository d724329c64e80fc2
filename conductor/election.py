"""Leader election through the metadata backend: the leader key is created only if absent and is
attached to the candidate's lease, so a leader that stops keeping its lease alive (killed, paused,
partitioned) loses the key within the TTL, and a standby that is waiting on the key's deletion takes
over. A leader that finds its lease gone steps down at once: it must not act after its term."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from .metadata import KeyValue, LeaseNotFoundError, MetadataBackend, MetadataUnavailableError

log = logging.getLogger(__name__)

ELECTION = b"/tiercake/leader/"


class LeaderElection:
    def __init__(
        self, meta: MetadataBackend, candidate: str, name: str = "conductor", ttl: int = 3, prefix: bytes = ELECTION
    ) -> None:
        self.meta = meta
        self.candidate = candidate
        self.key = prefix + name.encode()
        self.ttl = ttl
        self.lease = 0
        self.leading = asyncio.Event()
        self.terms = 0
        self.changes_seen = 0  # leader changes this candidate saw: its own wins and vacancies
        self.won_term = 0  # the term (see ``term``) of this candidate's latest win
        self._valid_until = 0.0  # monotonic: the lease surely lives until then
        self._task: asyncio.Task | None = None
        # called with True just before this candidate starts leading and with False once it stopped:
        # what it kept in memory for its term only is reset there, with no await in between
        self.on_change: Callable[[bool], None] | None = None

    @property
    def is_leader(self) -> bool:
        """Leading, and the lease surely still alive: a process paused past its TTL (SIGSTOP, a long
        stall) is not the leader when it resumes, even before its next renewal fails."""
        return self.leading.is_set() and time.monotonic() < self._valid_until

    async def leader(self) -> str | None:
        """Who leads now, as the backend says (any candidate or client may ask)."""
        kv = await self.meta.get(self.key)
        return kv.value.decode() if kv else None

    async def term(self) -> int:
        """The current term: the backend revision at which the leader won (the election key's), new at
        every win, so a change tells a member a new leader is in charge; 0 while nobody leads."""
        kv: KeyValue | None = await self.meta.get(self.key)
        return kv.mod_revision if kv else 0

    def _set_leading(self, leading: bool) -> None:
        if leading == self.leading.is_set():
            return
        if self.on_change is not None:
            self.on_change(leading)
        if leading:
            self.leading.set()
        else:
            self.leading.clear()

    async def start(self) -> LeaderElection:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            try:
                await self._campaign()
                await self._hold()
            except MetadataUnavailableError as exc:
                log.warning("election %s: backend unavailable (%s)", self.candidate, exc)
            self._set_leading(False)
            await asyncio.sleep(0.2)

    async def _campaign(self) -> None:
        while True:
            granted = time.monotonic()
            self.lease = await self.meta.grant_lease(self.ttl)
            if await self.meta.create(self.key, self.candidate.encode(), lease=self.lease):
                kv = await self.meta.get(self.key)
                self.won_term = kv.mod_revision if kv is not None and kv.value == self.candidate.encode() else 0
                self._valid_until = granted + self.ttl
                self.terms += 1
                self.changes_seen += 1
                self._set_leading(True)
                log.info("election: %s leads (term %d)", self.candidate, self.terms)
                return
            await self.meta.revoke_lease(self.lease)
            await self._wait_vacant()

    async def _wait_vacant(self) -> None:
        kvs, revision = await self.meta.range(self.key)
        if not kvs:
            return
        async for event in self.meta.watch(self.key, revision + 1):
            if event.key == self.key and event.kind == "delete":
                self.changes_seen += 1
                return

    async def _hold(self) -> None:
        while True:
            await asyncio.sleep(max(self.ttl / 4, 0.2))  # renew well before the validity runs out
            asked = time.monotonic()
            try:
                await self.meta.refresh_lease(self.lease)
                self._valid_until = asked + self.ttl
            except LeaseNotFoundError:
                log.warning("election: %s lost its lease; stepping down", self.candidate)
                return
            except MetadataUnavailableError:
                # Cannot renew: once the TTL may have run out, someone else may lead. Step down.
                log.warning("election: %s cannot renew; stepping down", self.candidate)
                return

    def crash(self) -> None:
        """Stop everything without resigning, as a killed process would."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._set_leading(False)

    async def resign(self) -> None:
        self.crash()
        with contextlib.suppress(MetadataUnavailableError):
            await self.meta.revoke_lease(self.lease)
