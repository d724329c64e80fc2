"""The doors' shared way of answering within the transfer server's reader callback
(``transfer/inbox.py``): no await, no task, so no event-loop round between a request and its answer.

Each operation's module (``put.py``, ``get.py``, ``query.py``) has a ``now`` door beside its
coroutine: it takes only what needs no wait, by the operation's one set of checks, and declines
anything else before any state changes (the coroutine then answers it). What is left to send or
receive once the socket would block becomes a continuation (a coroutine function) the inbox runs.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from tiercake.transfer.protocol import FRAME, MAGIC, VERSION, Op
from tiercake.transfer.sockio import IOV_MAX, send_all

Continuation = Callable[[], Coroutine[Any, Any, None]]
Answered = bool | Continuation  # True: answered; False: left to the coroutine; else the rest to run
Deadline = Callable[[int], AbstractContextManager[object]]  # the server's watchdog for n bytes moved


def frame(op: Op, request: int, length: int, flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, VERSION, op, flags, request, length)


def recv_now(conn: socket.socket, views: list[np.ndarray], most: int) -> list[memoryview]:
    """Receive into ``views`` what the socket holds, up to about ``most`` bytes (the loop is not held
    longer); what is still to come (empty: all of it)."""
    left = [v.data.cast("B") for v in views if v.nbytes]
    taken = 0
    while left and taken < most:
        try:
            got = conn.recvmsg_into(left[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            break
        if got == 0:
            break  # the peer left: the task's receive says so
        taken += got
        while left and got >= len(left[0]):
            got -= len(left.pop(0))
        if left and got:
            left[0] = left[0][got:]
    return left


def send_now(
    conn: socket.socket,
    op: Op,
    request: int,
    body: bytes,
    data: list[np.ndarray],
    deadline: Deadline,
    after: Callable[[], None] | None = None,
) -> Answered:
    """Send a reply without waiting; True when it all went (``after`` run), else a continuation that
    sends the rest (and then runs ``after``)."""
    views = [
        memoryview(frame(op, request, len(body))),
        memoryview(body),
        *(d.data.cast("B") for d in data if d.nbytes),
    ]
    while views:
        try:
            sent = conn.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break  # the peer left: the task finds out when it sends the rest
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]
    if not views:
        if after is not None:
            after()
        return True

    async def rest() -> None:
        try:
            with deadline(sum(len(v) for v in views)):
                await send_all(conn, views)
        finally:
            if after is not None:
                after()

    return rest


_pending: set[asyncio.Task[object]] = set()


def later(coro: Coroutine[Any, Any, object]) -> None:
    """Run a clean-up coroutine soon (a slot to free: no wait for it on the answering path)."""
    task = asyncio.get_running_loop().create_task(coro)
    _pending.add(task)
    task.add_done_callback(_pending.discard)
