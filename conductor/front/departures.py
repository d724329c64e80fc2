"""Requests on a worker that leaves the cluster are not waited for.

A worker whose membership lease lapsed (cut off, stopped, SIGSTOPped) will not answer the requests
it holds; their connections could stay open until the read timeout (a minute). The front watches
the membership: when a worker's record goes, each of its requests still in flight ends at once, with
``WorkerUnavailable`` before its first token (the dispatcher tries another worker) or
``StreamBroken`` after it (the client is told)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncGenerator

from tiercake.conductor.membership import Membership
from tiercake.messages import TokenEvent

from .worker_client import StreamBroken, WorkerError, WorkerUnavailable


class Departures:
    """The front's requests in flight per worker (one owner: this object), ended when it leaves."""

    def __init__(self, members: Membership) -> None:
        self._serving: dict[str, set[asyncio.Event]] = defaultdict(set)  # per worker: each request's "it left"
        members.leave_listeners.append(self._left)

    def _left(self, worker: str) -> None:
        for left in self._serving.pop(worker, ()):
            left.set()

    async def watch(self, worker: str, events: AsyncGenerator[TokenEvent, None]) -> AsyncGenerator[TokenEvent, None]:
        """``events`` while ``worker`` is a member; closed when it is not."""
        left = asyncio.Event()
        self._serving[worker].add(left)
        gone = asyncio.ensure_future(left.wait())
        emitted = 0
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                await asyncio.wait((step, gone), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, WorkerError):
                        await step
                    why = "left the cluster (its lease lapsed) while serving the request"
                    raise (StreamBroken if emitted else WorkerUnavailable)(worker, why)
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                emitted += 1
                yield event
        finally:
            gone.cancel()
            self._serving.get(worker, set()).discard(left)
            await events.aclose()
