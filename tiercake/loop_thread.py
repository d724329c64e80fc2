"""An asyncio event loop on a daemon thread, for blocking callers of tiercake's async code (vLLM's
connector, the synchronous key-value store client): they submit coroutines and wait with a deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    CLEANUP_S = 5.0  # how long a timed-out call may take to clean up before the caller stops waiting

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds (then it is cancelled
        and TimeoutError raised). Not from the loop's own thread (it would wait for itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.call from its own loop would deadlock; await the coroutine instead")

        async def bounded() -> T:  # cancelled on the loop, so that its cleanup runs before we answer
            try:
                async with asyncio.timeout(timeout):
                    return await coro
            except TimeoutError:
                raise TimeoutError(f"no answer within {timeout} s") from None

        future = asyncio.run_coroutine_threadsafe(bounded(), self.loop)
        try:
            return future.result(None if timeout is None else timeout + self.CLEANUP_S)
        except concurrent.futures.TimeoutError:  # the coroutine did not even let itself be cancelled
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (after whatever the caller awaited to clean up) and join its thread."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
