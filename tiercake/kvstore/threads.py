"""How the synchronous client runs ``AsyncStore``'s coroutines for blocking callers.

Each calling thread gets an event loop and an ``AsyncStore`` of its own, and a call runs on the
caller's thread: no hand-off to another thread and back, which cost about 100 us a call on the 2-core
machines here (a 64 KiB put took 760-920 us through a loop thread, 500-600 us on the caller's).
Threads share nothing but the settings; each store learns the object map on its own. A caller that
is itself inside a running event loop cannot block on another loop in its thread: its calls go to
one loop thread instead (``LoopThread``), as before.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from tiercake.loop_thread import LoopThread

from .aio import AsyncStore
from .fast import FastPath


class ThreadClients:
    def __init__(self, factory: Callable[[], Coroutine[Any, Any, AsyncStore]]) -> None:
        self.factory = factory
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[tuple[asyncio.AbstractEventLoop, AsyncStore]] = []
        self._loop_thread: LoopThread | None = None
        self._loop_thread_store: AsyncStore | None = None
        self.closed = False

    def any_store(self) -> AsyncStore | None:
        """Some thread's store (for what every store knows alike: the node agents' addresses)."""
        with self._lock:
            return self._all[0][1] if self._all else self._loop_thread_store

    def run(self, call: Callable[[AsyncStore], Coroutine[Any, Any, Any]], timeout: float):
        """``call(store)`` with this thread's store, at most ``timeout`` seconds (TimeoutError)."""
        if self.closed:
            raise RuntimeError("the client is closed")
        if asyncio._get_running_loop() is not None:  # inside a running loop: a loop thread does it
            return self._in_loop_thread(call, timeout)
        loop, store = self._mine(timeout)
        return loop.run_until_complete(_bounded(call(store), timeout))

    def fast(self, plan: Callable, fast: Callable, slow: Callable, finish: Callable, timeout: float):
        """A call through the fast path (``fast.py``) first: ``plan(store)`` gives (outcomes so far,
        items, extras); ``fast(path, items, *extras)`` does what it can and leaves the rest, which
        ``slow(store, rest, *extras)`` (a coroutine) does on this thread's loop; ``finish(outcomes,
        items, done)`` the answer."""
        if self.closed:
            raise RuntimeError("the client is closed")
        if asyncio._get_running_loop() is not None:

            async def all_slow(store: AsyncStore):
                outcomes, items, *extras = plan(store)
                return finish(outcomes, items, await slow(store, items, *extras))

            return self._in_loop_thread(all_slow, timeout)
        loop, store = self._mine(timeout)
        if store.stale:
            store.stale = False
            loop.run_until_complete(_bounded(store.refresh(), timeout))
        outcomes, items, *extras = plan(store)
        done, rest = self._local.fast.run(fast, items, extras)
        if rest:
            done.update(loop.run_until_complete(_bounded(slow(store, rest, *extras), timeout)))
        return finish(outcomes, items, done)

    def _mine(self, timeout: float) -> tuple[asyncio.AbstractEventLoop, AsyncStore]:
        mine = getattr(self._local, "client", None)
        if mine is None:
            loop = asyncio.new_event_loop()
            try:
                store = loop.run_until_complete(_bounded(self.factory(), timeout))
            except BaseException:
                loop.close()
                raise
            mine = self._local.client = (loop, store)
            self._local.fast = _Fast(FastPath(store))
            with self._lock:
                self._all.append(mine)
        return mine

    def _in_loop_thread(self, call, timeout: float):
        with self._lock:
            if self._loop_thread is None:
                self._loop_thread = LoopThread("tiercake-kvstore")
        if self._loop_thread_store is None:
            self._loop_thread_store = self._loop_thread.call(self.factory(), timeout)
        return self._loop_thread.call(call(self._loop_thread_store), timeout)

    def close(self, timeout: float) -> None:
        """Close every thread's store (from any thread: a loop not running may be run by another; from
        inside a running loop, another thread does it)."""
        if asyncio._get_running_loop() is not None:
            closer = threading.Thread(target=self.close, args=(timeout,), name="tiercake-kvstore-close")
            closer.start()
            closer.join(timeout + 10)
            return
        self.closed = True
        with self._lock:
            clients, self._all = self._all, []
        for loop, store in clients:
            try:
                if not loop.is_running():
                    loop.run_until_complete(_bounded(store.close(), timeout))
            finally:
                if not loop.is_running():
                    loop.close()
        if self._loop_thread is not None:
            try:
                if self._loop_thread_store is not None:
                    self._loop_thread.call(self._loop_thread_store.close(), timeout)
            finally:
                self._loop_thread.stop()


class _Fast:
    __slots__ = ("path",)

    def __init__(self, path: FastPath) -> None:
        self.path = path

    def run(self, fast: Callable, items: list, extras: list):
        return fast(self.path, items, *extras)


async def _bounded(coro, timeout: float):
    try:
        async with asyncio.timeout(timeout):
            return await coro
    except TimeoutError:
        raise TimeoutError(f"no answer within {timeout} s") from None
