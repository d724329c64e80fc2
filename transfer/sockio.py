"""Scatter-gather I/O on non-blocking sockets under asyncio.

asyncio's own ``sock_sendall``/``sock_recv_into`` take one buffer; a batch of blocks wants one
``sendmsg`` of many buffers and one ``recvmsg_into`` that lands each block in its destination. These
helpers try the system call first and wait for the socket only when it would block, so a ready
socket costs no event-loop round trip. No data is copied in Python.

A TLS socket (``ssl.SSLSocket``, the transfer port with ``transfer.tls``) takes the same calls: it
has no ``sendmsg``/``recvmsg_into``, so its buffers go one ``send``/``recv_into`` at a time, and a
call that would block waits for whichever direction TLS asks for (a read may need a write).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiercake import dead_peer

from .protocol import FRAME, MAGIC, MAX_BODY, Op, PeerClosedError, ProtocolError, spoken, version_of

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024


def tune(sock: socket.socket, buffer_bytes: int | None) -> None:
    """Non-blocking, no Nagle delay, a peer that stops acknowledging dropped in seconds
    (``dead_peer``); fixed buffers when asked (else the kernel autotunes)."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dead_peer.watch(sock)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


async def _ready(sock: socket.socket, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.fileno()
    if fd < 0:
        raise PeerClosedError("socket is closed")

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, wake)
    try:
        await fut
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


def _views(buffers: Sequence) -> list[memoryview]:
    views = []
    for b in buffers:
        v = memoryview(b)
        if v.ndim != 1 or v.itemsize != 1:
            v = v.cast("B")
        if len(v):
            views.append(v)
    return views


def _advance(views: list[memoryview], done: int) -> None:
    while views and done >= len(views[0]):
        done -= len(views.pop(0))
    if views and done:
        views[0] = views[0][done:]


# Above this many bytes, bulk data moves in a worker thread on a blocking socket: one thread blocked
# in sendmsg / recvmsg_into(MSG_WAITALL) with the GIL released beats an event-loop wake-up per
# socket-buffer's worth of data. Below it the hand-off to the thread (and back) costs more than it
# saves: at 512 KiB, a 1 MiB read took twice as long as on the event loop (docs/BENCHMARKS.md). A
# bounded pool: when every bulk thread is busy, the event loop does the work itself, so no number of
# concurrent transfers (even both ends in one process) can deadlock.
BULK_THREAD_BYTES = int(os.environ.get("TIERCAKE_BULK_THREAD_BYTES", 8 << 20))
BULK_THREADS = 32
_bulk_pool = ThreadPoolExecutor(max_workers=BULK_THREADS, thread_name_prefix="tiercake-bulk")
_bulk_free = threading.BoundedSemaphore(BULK_THREADS)


def _blocking(sock: socket.socket, views: list[memoryview], send: bool) -> None:
    sock.setblocking(True)
    tls = isinstance(sock, ssl.SSLSocket)
    try:
        while views:
            try:
                if tls:
                    done = sock.send(views[0]) if send else sock.recv_into(views[0])
                    if done == 0 and not send:
                        raise PeerClosedError("peer closed the connection mid-transfer")
                elif send:
                    done = sock.sendmsg(views[:IOV_MAX])
                else:
                    done = sock.recvmsg_into(views[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
                    if done == 0:
                        raise PeerClosedError("peer closed the connection mid-transfer")
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise PeerClosedError(f"peer closed the connection mid-transfer: {exc}") from exc
            _advance(views, done)
    finally:
        if sock.fileno() >= 0:
            sock.setblocking(False)


def _worth_a_thread(views: list[memoryview]) -> bool:
    """Whether these bytes are many enough for a bulk thread (``BULK_THREAD_BYTES``)."""
    total = len(views[0]) if len(views) == 1 else sum(len(v) for v in views)
    return total >= BULK_THREAD_BYTES


async def _bulk(sock: socket.socket, views: list[memoryview], send: bool) -> bool:
    """Move a large payload (``_worth_a_thread``) in a bulk thread; False when no thread is free."""
    if not _bulk_free.acquire(blocking=False):
        return False
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(_bulk_pool, _blocking, sock, views, send)
    future.add_done_callback(lambda _: _bulk_free.release())
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        # A timeout or cancellation: unblock the thread, and let it finish before anyone closes
        # (and the OS reuses) the socket's descriptor.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(BaseException):
            await future
        raise
    return True


async def send_all(sock: socket.socket, buffers: Sequence) -> None:
    views = _views(buffers)
    if views and _worth_a_thread(views) and await _bulk(sock, views, send=True):
        return
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        try:
            sent = sock.send(views[0]) if tls else sock.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            await _ready(sock, writable=True)
            continue
        except ssl.SSLWantReadError:
            await _ready(sock, writable=False)
            continue
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PeerClosedError(f"peer closed the connection while we sent: {exc}") from exc
        _advance(views, sent)


async def recv_into_all(sock: socket.socket, buffers: Sequence) -> None:
    """Fill every buffer in order; PeerClosedError if the stream ends first."""
    views = _views(buffers)
    if views and _worth_a_thread(views) and await _bulk(sock, views, send=False):
        return
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        try:
            got = sock.recv_into(views[0]) if tls else sock.recvmsg_into(views[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            await _ready(sock, writable=False)
            continue
        except ssl.SSLWantWriteError:
            await _ready(sock, writable=True)
            continue
        except ConnectionResetError as exc:
            raise PeerClosedError(f"peer reset the connection mid-transfer: {exc}") from exc
        if got == 0:
            raise PeerClosedError("peer closed the connection mid-transfer")
        _advance(views, got)


async def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    got = 0
    if n and not isinstance(sock, ssl.SSLSocket):
        # A frame's header and table usually wait in the socket already: one call, no lists of views.
        # Anything else (nothing there yet, part of it, the peer gone) takes the general way, which
        # says what happened.
        with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionResetError):
            got = sock.recv_into(buf)
    if got < n:
        await recv_into_all(sock, [memoryview(buf)[got:]])
    return buf


async def discard(sock: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    """Read and drop ``n`` bytes (data for an item that was refused after it was sent)."""
    scratch = bytearray(min(n, chunk))
    while n > 0:
        step = min(n, len(scratch))
        await recv_into_all(sock, [memoryview(scratch)[:step]])
        n -= step


async def wait_hangup(sock: socket.socket) -> None:
    """Return when the peer closes the stream; consume nothing. If the peer sends data instead (its
    next request: it is alive), wait until cancelled."""
    while True:
        await _ready(sock, writable=False)
        try:
            peek = sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            return
        if not peek:
            return
        await asyncio.Event().wait()  # alive: never set; the caller cancels us


async def tls_handshake(sock: ssl.SSLSocket) -> None:
    """Run a non-blocking socket's TLS handshake; ``ssl.SSLError`` when it fails (no certificate the
    other side trusts, a plain peer)."""
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _ready(sock, writable=False)
        except ssl.SSLWantWriteError:
            await _ready(sock, writable=True)


async def send_frame(
    sock: socket.socket,
    op: Op,
    request: int,
    body: bytes = b"",
    flags: int = 0,
    data: Sequence = (),
    version: int | None = None,
) -> None:
    """A frame at the socket's session version (``version``: at that one, for a HELLO)."""
    version = version_of(sock) if version is None else version
    await send_all(sock, [FRAME.pack(MAGIC, version, op, flags, request, len(body)), body, *data])


async def recv_frame(
    sock: socket.socket, expect: Sequence[Op] | None = None, max_body: int = MAX_BODY
) -> tuple[Op, int, int, bytearray]:
    """(op, flags, request id, body). ProtocolError on a bad magic, version, op or size. Before the
    peer is authenticated, ``max_body`` is what its handshake can need: nothing larger is allocated or
    read for a stranger."""
    _, op, flags, request, body = await recv_versioned(sock, expect, max_body)
    return op, flags, request, body


async def recv_versioned(
    sock: socket.socket, expect: Sequence[Op] | None = None, max_body: int = MAX_BODY
) -> tuple[int, Op, int, int, bytearray]:
    """``recv_frame`` with the version the frame was framed at first."""
    head = await recv_exactly(sock, FRAME.size)
    magic, version, op, flags, request, length = FRAME.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"not a tiercake transfer stream (magic {bytes(magic)!r})")
    if (why := spoken(version, op)) is not None:
        raise ProtocolError(why)
    if length > max_body:
        raise ProtocolError(f"frame body of {length} bytes is over the limit of {max_body}")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown operation {op}") from None
    if expect is not None and op not in expect and op is not Op.ERROR:  # refused before its body is read
        raise ProtocolError(f"expected {'/'.join(o.name for o in expect)}, got {op.name}")
    body = await recv_exactly(sock, length)
    if op is Op.ERROR:
        raise ProtocolError(f"peer refused: {body.decode(errors='replace')}")
    return version, op, flags, request, body


async def receive_or_discard(conn, items: list[tuple[Any, int]]) -> None:
    """Each item's bytes, in order: into its target, or read and dropped (an item refused: the
    stream stays in step)."""
    run: list = []
    for target, n in items:
        if target is not None:
            run.append(target)
            continue
        if run:
            await recv_into_all(conn, run)
            run = []
        if n:
            await discard(conn, n)
    if run:
        await recv_into_all(conn, run)
