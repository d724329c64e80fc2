"""A paused session's blocks brought back from disk before its announced resume: its client said
when the next turn comes (a tool call's expected length), so its blocks that were demoted to SSD are
staged into memory ``lead_s`` before then, and its next turn reads them from memory.

One timer per session (a new notice replaces it), at most ``MAX_PLANNED`` at once (the oldest plans
give way). Staging goes through ``TieredStore.stage``: the memory tier's policy makes room, and one
staging moves at most its bound (a quarter of the memory tiers), so a prefetch never flushes what is
being served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

from tiercake.policies import SessionEvent, SessionState

from .backend import DiskTierBackend

if TYPE_CHECKING:
    from .store import TieredStore

log = logging.getLogger(__name__)

MAX_PLANNED = 10_000


class SessionPrefetch:
    def __init__(self, store: TieredStore, lead_s: float = 1.0) -> None:
        self.store, self.lead_s = store, lead_s
        self._planned: dict[Hashable, asyncio.TimerHandle] = {}
        self._running: set[asyncio.Task] = set()
        self.staged = 0  # blocks brought into memory ahead of a resume

    def plan(self, event: SessionEvent) -> None:
        """Replaces the session's plan: a paused session with an announced resume and blocks on disk
        is staged ``lead_s`` before it; any other notice cancels what was planned."""
        old = self._planned.pop(event.session, None)
        if old is not None:
            old.cancel()
        if event.state is not SessionState.PAUSED or event.resume_in is None or not event.keys:
            return
        if not any(isinstance(t.backend, DiskTierBackend) for t in self.store.tiers):
            return  # nothing is ever on disk here
        while len(self._planned) >= MAX_PLANNED:
            self._planned.pop(next(iter(self._planned))).cancel()
        delay = max(0.0, event.resume_in - self.lead_s)
        keys = [k for k in event.keys if isinstance(k, bytes)]
        loop = asyncio.get_running_loop()
        self._planned[event.session] = loop.call_later(delay, self._start, event.session, keys)

    def _start(self, session: Hashable, keys: list[bytes]) -> None:
        self._planned.pop(session, None)
        task = asyncio.get_running_loop().create_task(self._stage(keys))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _stage(self, keys: list[bytes]) -> None:
        try:
            results = await self.store.stage(keys)
        except Exception:
            log.exception("store: staging a session's blocks before its resume failed")
            return
        self.staged += sum(r is None for r in results)

    async def close(self) -> None:
        for handle in self._planned.values():
            handle.cancel()
        self._planned.clear()
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
