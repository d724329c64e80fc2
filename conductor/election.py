"""Leader election through the metadata backend: the leader key is created only if absent and is
attached to the candidate's lease, so a leader that stops keeping its lease alive (killed, paused,
partitioned) loses the key within the TTL, and a standby that is waiting on the key's deletion takes
over. A leader that finds its lease gone steps down at once: it must not act after its term."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from tiercake.loop_thread import LoopThread

from .metadata import KeyValue, LeaseNotFoundError, MetadataBackend, MetadataUnavailableError

log = logging.getLogger(__name__)

ELECTION = b"/tiercake/leader/"
TICK_S = 0.1  # how often the election's loop says it turns
STALL_S = 10.0  # a loop that has not turned for this long gives the lead up


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
        self._ticked = time.monotonic()  # when this candidate's loop last turned (``_tick``)
        self._stop_renewing = threading.Event()  # tells the renewals' thread to end
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
            except Exception:  # noqa: BLE001 - a candidate whose loop ended would never lead again
                log.exception("election %s: the campaign failed; campaigning again", self.candidate)
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
        """Renew the lease until it is lost. On a backend another thread can reach (etcd), the renewals
        run on a thread of their own: a turn of this loop held for seconds by a burst of requests
        once let the lease lapse and handed leadership over mid-fill, and the next leader's loop met
        the same burst. The thread stops renewing when this loop has not turned for ``STALL_S``: a
        loop stuck for good must not keep the lead."""
        detached = self.meta.detached()
        if detached is None:
            await self._renew(self.meta)
            return
        thread = LoopThread(f"election {self.candidate[:40]}")
        ticking = asyncio.get_running_loop().create_task(self._tick())
        self._stop_renewing.clear()
        renewing = thread.submit(self._renew(detached, own=True))
        try:  # shielded: a crash stops the renewals by the flag, so that they close their connection
            await asyncio.shield(asyncio.wrap_future(renewing))
        finally:
            ticking.cancel()
            self._stop_renewing.set()
            await asyncio.to_thread(_finish, renewing, thread, self.ttl + 10)

    async def _tick(self) -> None:
        while True:
            self._ticked = time.monotonic()
            await asyncio.sleep(TICK_S)

    async def _renew(self, meta: MetadataBackend, own: bool = False) -> None:
        """Renew every quarter of the TTL until the lease is lost or cannot be renewed (``own``: on a
        backend this coroutine starts and closes, on its thread's loop)."""
        try:
            if own:
                await meta.start()
            while True:
                await asyncio.sleep(max(self.ttl / 4, 0.2))  # renew well before the validity runs out
                if own and self._stop_renewing.is_set():
                    return
                if own and time.monotonic() - self._ticked > STALL_S:
                    log.warning("election: %s's loop has not turned for %.0f s; stepping down", self.candidate, STALL_S)
                    return
                asked = time.monotonic()
                try:
                    await meta.refresh_lease(self.lease)
                    self._valid_until = asked + self.ttl
                except LeaseNotFoundError:
                    log.warning("election: %s lost its lease; stepping down", self.candidate)
                    return
                except MetadataUnavailableError:
                    # Cannot renew: once the TTL may have run out, someone else may lead. Step down.
                    log.warning("election: %s cannot renew; stepping down", self.candidate)
                    return
        finally:
            if own:
                await meta.close()
                await asyncio.sleep(0.05)  # gRPC finishes its cancelled calls before the loop stops

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


def _finish(renewing: concurrent.futures.Future, thread: LoopThread, wait_s: float) -> None:
    """Wait (on a worker thread) for the renewals to end and close their connection, then stop their loop."""
    with contextlib.suppress(Exception):
        renewing.result(wait_s)
    thread.stop()
