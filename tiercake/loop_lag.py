"""How late a process's event loop runs its timers: the worst lag of each window, and a warning when a
turn of the loop was held long enough to matter (a conductor renews its election lease every 0.75 s
and loses it after 3 s; a member renews every third of its TTL)."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

TICK_S = 0.05
WINDOW_S = 10.0
WARN_S = 0.5


class LoopLag:
    """Run ``watch()`` as a task; ``worst`` is the largest lag (seconds) of the last full window."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.worst = 0.0
        self._current = 0.0

    async def watch(self) -> None:
        started = time.monotonic()
        while True:
            asked = time.monotonic()
            await asyncio.sleep(TICK_S)
            lag = time.monotonic() - asked - TICK_S
            self._current = max(self._current, lag)
            if lag > WARN_S:
                log.warning("%s: the event loop was held %.2f s (a turn of it ran that long)", self.name, lag)
            if asked - started >= WINDOW_S:
                self.worst, self._current, started = self._current, 0.0, asked
