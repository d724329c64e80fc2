"""Polling a little before sleeping, on both ends of a small request.

A process that blocks leaves its core idle, and on a virtual machine an idle core takes about 100 us
to wake (measured on the 2-core machines here: a 64 KiB request and answer between two processes
took 156 us with both sides blocking and 58 us with the caller polling). A small object's whole
call costs less than that, so each end polls for a short while before it sleeps:

- the blocking client, for its answer, before a blocking receive (``SpinWait``);
- the node agent's event loop, for the next request, just after it was busy (``SpinningSelector``):
  an idle node sleeps at once, a node answering a stream of small requests stays awake between them.

Both give up for a while when their polls keep finding nothing (a slow peer, a client that thinks
between calls); neither polls while its thread has been waiting for a core (the kernel's count of
the thread's time on a run queue, sampled every ``CHECK_S``): on a busy host a poll only takes the
core from the process it waits for (measured here, with two other processes spinning on the two
cores: 64 KiB gets at 0.13-0.19 GB/s polling, 0.39 not polling); nor on a single core. ``budget_s`` 0 turns either
off (``transfer.spin_us`` for the node, ``spin_s`` for the client).
"""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Budget:
    """How long to poll, and when not to: after ``MISSES_OFF`` fruitless polls in a row, the next
    ``OFF_CALLS`` waits do not poll; nor does a thread that waited for a core more than
    ``CONTENDED`` of the last ``CHECK_S`` seconds. One thread's (the one that waits)."""

    MISSES_OFF = 4
    OFF_CALLS = 64
    CHECK_S = 0.1
    CONTENDED = 0.05

    def __init__(self, budget_s: float) -> None:
        if not (isinstance(budget_s, (int, float)) and 0 <= budget_s <= 0.1):
            raise ValueError(f"a poll budget is between 0 and 0.1 seconds, got {budget_s!r}")
        self.budget_s = float(budget_s) if (os.cpu_count() or 1) > 1 else 0.0
        self.misses = 0
        self.off = 0
        self.contended = False
        self._sampled = (0.0, 0)  # (when, the thread's run-queue nanoseconds then)

    def polls(self) -> bool:
        if self.off:
            self.off -= 1
            return False
        now = time.monotonic()
        if now - self._sampled[0] >= self.CHECK_S:
            waited = _queued_ns()
            if waited is not None:
                when, before = self._sampled
                self.contended = when > 0 and (waited - before) / 1e9 > self.CONTENDED * (now - when)
                self._sampled = (now, waited)
        return self.budget_s > 0 and not self.contended

    def hit(self) -> None:
        self.misses = 0

    def miss(self) -> None:
        self.misses += 1
        if self.misses >= self.MISSES_OFF:
            self.misses, self.off = 0, self.OFF_CALLS


def _queued_ns() -> int | None:
    """How long the calling thread has waited on a run queue, in all (Linux's schedstat); None
    where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class SpinWait(_Budget):
    """The blocking client's poll for an answer."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(budget_s)
        self._byte = bytearray(1)

    def wait(self, sock: socket.socket) -> None:
        """Return once the socket has something to read, or the budget is spent (the caller then
        blocks as usual)."""
        if not self.polls():
            return
        deadline = time.perf_counter() + self.budget_s
        peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
        while True:
            try:
                sock.recv_into(self._byte, 1, peek)
                self.hit()
                return  # data, or the peer closed (0): the receive finds out which
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return  # the receive raises it properly
            if time.perf_counter() > deadline:
                self.miss()
                return


class SpinningSelector(selectors.EpollSelector):
    """An event loop's selector that, within ``budget_s`` of its last event, polls for the next
    one before it sleeps (never past the loop's own timeout)."""

    def __init__(self, budget_s: float) -> None:
        super().__init__()
        self.budget = _Budget(budget_s)
        self._last = 0.0

    def select(self, timeout: float | None = None):
        if timeout is not None and timeout <= 0:
            return super().select(0)
        now = time.perf_counter()
        if now - self._last < self.budget.budget_s and self.budget.polls():
            end = now + (self.budget.budget_s if timeout is None else min(self.budget.budget_s, timeout))
            while True:
                ready = super().select(0)
                if ready:
                    self.budget.hit()
                    self._last = time.perf_counter()
                    return ready
                if time.perf_counter() > end:
                    break
            self.budget.miss()
        ready = super().select(timeout if timeout is None else max(0.0, timeout - (time.perf_counter() - now)))
        if ready:
            self._last = time.perf_counter()
        return ready


def run(main: Coroutine[Any, Any, T], spin_s: float) -> T:
    """``asyncio.run(main)`` on a loop whose selector polls (``SpinningSelector``); spin_s 0: a
    plain loop."""
    if spin_s <= 0:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(SpinningSelector(spin_s))) as runner:
        return runner.run(main)
