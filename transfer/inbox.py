"""A connection's requests read by the event loop's reader callback, not by a waiting task.

A task that awaits each request pays, per request, a future, a reader added to and taken off the
selector, and a wake-up through the loop: about 50 us of CPU on the 2-core machines we run on, more
than answering a small request takes. So the reader stays registered while the connection is idle,
and its callback reads whatever frames have arrived and hands each to ``fast``, which answers it on
the spot (no await: the common small put and get, a query, a release) or declines it. A declined
frame (a request that must wait for something: eviction, a disk, a replica, a lock) goes to the
connection's task, which takes the reader off while it works, exactly as before. ``fast`` may also
return a continuation: a coroutine function the task runs to finish what the callback began (the
rest of a reply the socket would not take at once).

Invariant: the reader is registered only while the task waits in ``next``; so a frame is never read
while the task is writing, and the callback is the only reader while it is registered.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from .protocol import FRAME, MAGIC, MAX_BODY, Op, PeerClosedError, ProtocolError, spoken

BODY_CHUNK = 64 << 10  # a body's first allocation; it doubles as its bytes arrive

Frame = tuple[Op, int, int, bytearray]
# True: answered; False: the task's; else a continuation
Fast = Callable[[Op, int, int, bytearray], bool | Callable[..., Any]]


class Inbox:
    def __init__(self, sock: socket.socket, fast: Fast, max_body: int = MAX_BODY) -> None:
        self.sock, self.fast, self.max_body = sock, fast, max_body
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self._head = bytearray(FRAME.size)
        self._body: bytearray | None = None  # None: reading a header
        self._length = 0  # the body's announced length (``_body`` grows to it as its bytes come)
        self._pos = 0
        self._frame: tuple[Op, int, int] | None = None
        self._waiter: asyncio.Future | None = None
        self._registered = False
        self.fast_served = 0

    async def next(self) -> Frame | Callable:
        """The next frame ``fast`` declined, or a continuation it returned. ``PeerClosedError`` when
        the peer hangs up, ``ProtocolError`` on a bad frame."""
        got = self._pump()  # frames that arrived while the task worked
        if got is not None:
            return _result(got)
        self._waiter = self.loop.create_future()
        self.loop.add_reader(self.fd, self._on_readable)
        self._registered = True
        try:
            return await self._waiter
        finally:
            self._waiter = None
            if self._registered:
                self._registered = False
                self.loop.remove_reader(self.fd)

    def _on_readable(self) -> None:
        got = self._pump(from_loop=True)
        if got is None or self._waiter is None or self._waiter.done():
            return
        self._registered = False  # the task takes over: no reads until it waits again
        self.loop.remove_reader(self.fd)
        if isinstance(got, BaseException):
            self._waiter.set_exception(got)
        else:
            self._waiter.set_result(got)

    def _pump(self, from_loop: bool = False) -> Frame | Callable | BaseException | None:
        """Read and serve frames until the socket is empty (None), or one is for the task; from the
        selector's callback, one frame a call (the selector calls again while more is there)."""
        while True:
            target = self._head if self._body is None else self._body
            if self._body is not None and self._pos == len(target) < self._length:
                target.extend(bytes(min(len(target), self._length - len(target))))  # what came: room for as much more
            if self._pos < len(target):
                try:
                    n = self.sock.recv_into(memoryview(target)[self._pos :])
                except (BlockingIOError, InterruptedError):
                    return None
                except (ConnectionResetError, OSError) as exc:
                    return PeerClosedError(f"peer reset the connection: {exc}")
                if n == 0:
                    return PeerClosedError("peer closed the connection")
                self._pos += n
                continue
            if self._body is None:
                failed = self._header()
                if failed is not None:
                    return failed
                if self._body:
                    continue
            frame, body = self._frame, self._body
            assert frame is not None and body is not None  # its header was read
            op, flags, request = frame
            self._body, self._pos = None, 0
            if op is Op.ERROR:
                return ProtocolError(f"peer refused: {body.decode(errors='replace')}")
            try:
                answer = self.fast(op, flags, request, body)
            except Exception as exc:  # a bug in a fast answer: the connection ends, and says why
                return ProtocolError(f"answering {op.name} failed: {exc!r}")
            if answer is True:
                self.fast_served += 1
                if from_loop:
                    return None  # a next frame waiting makes the selector call again: no receive to find none
                continue
            return (op, flags, request, body) if answer is False else answer

    def _header(self) -> ProtocolError | None:
        magic, version, op, flags, request, length = FRAME.unpack(self._head)
        if magic != MAGIC:
            return ProtocolError(f"not a tiercake transfer stream (magic {bytes(magic)!r})")
        if (why := spoken(version)) is not None:
            return ProtocolError(why)
        if length > self.max_body:
            return ProtocolError(f"frame body of {length} bytes is over the limit of {self.max_body}")
        try:
            op = Op(op)
        except ValueError:
            return ProtocolError(f"unknown operation {op}")
        self._frame = (op, flags, request)
        # room for the body as it comes, not as announced: a peer that announces 16 MiB and sends a
        # few bytes holds a few bytes' worth (20 such peers once held 320 MiB)
        self._body, self._pos, self._length = bytearray(min(length, BODY_CHUNK)), 0, length
        return None


def _result(got):
    if isinstance(got, BaseException):
        raise got
    return got
