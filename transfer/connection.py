"""The client side of the transfer protocol: authenticated connections and a pool of them per peer."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tiercake import dead_peer
from tiercake.started import started
from tiercake.tiers.buffers import INLINE_COPY_MAX

from . import protocol as p
from .protocol import Op, ReplyItem, Status
from .sockio import IOV_MAX, recv_frame, recv_into_all, send_all, send_frame, tls_handshake, tune
from .spin import SpinWait

_request_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class PeerAddress:
    node_id: str
    host: str
    port: int


def item_error(reply: ReplyItem, peer: str) -> p.ItemError:
    return p.ItemError(f"{peer}: {reply.status.name.lower().replace('_', ' ')}: {reply.message}", reply.status)


def check_count(replies: list, items: list) -> None:
    if len(replies) != len(items):
        raise p.ProtocolError(f"{len(replies)} replies to {len(items)} items")


def write_results(ready: list[ReplyItem], done: list[ReplyItem], peer: str) -> list[BaseException | None]:
    """Per item of a write: refused at reservation (WRITE_READY), or at commit (WRITE_DONE), or None
    (a transport's results: any item's failure is an exception)."""
    check_count(done, ready)
    results: list[BaseException | None] = []
    for r, d in zip(ready, done):
        failed = r if r.status is not Status.OK else d if d.status is not Status.OK else None
        results.append(None if failed is None else item_error(failed, peer))
    return results


class _Request:
    """One request on a connection (a class, not a generator: this is on every small read's path)."""

    __slots__ = ("conn",)

    def __init__(self, conn: PeerConnection) -> None:
        self.conn = conn

    async def __aenter__(self) -> int:
        return next(_request_ids)

    async def __aexit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.conn.close()  # mid-request failure: the stream can no longer be trusted


class PeerConnection:
    """One authenticated stream to a peer's transfer server; one request at a time.

    Any failure in the middle of a request (peer death, timeout, cancellation, a reply that does not
    fit what was asked) leaves the stream in an unknown state, so the connection is closed and marked
    broken; the pool never hands it out again.
    """

    def __init__(
        self,
        address: PeerAddress,
        secret: bytes | p.Credential,
        node_id: str,
        buffer_bytes: int | None = None,
        tls: ssl.SSLContext | None = None,
        needs: int = p.OLDEST,
    ) -> None:
        """``needs``: the oldest protocol version the caller can use with the server."""
        self.address = address
        self.needs = needs
        self.tls = tls  # a client context: the stream is TLS, the server's certificate checked against it
        self.secret = secret
        self.node_id = node_id
        self.buffer_bytes = buffer_bytes
        self._sock: socket.socket | None = None
        self.info: p.PeerInfo | None = None
        self.version = p.VERSION  # the session's, once the handshake has chosen it
        self.broken = False
        self.ucx: Any = None  # a transport's per-connection state (UCX endpoints)
        self.on_close: Callable[[], object] | None = None

    @property
    def sock(self) -> socket.socket:
        """The stream (``PeerClosedError`` before ``open`` made it)."""
        if self._sock is None:
            raise p.PeerClosedError(f"connection to {self.address.node_id} is not open")
        return self._sock

    async def open(self) -> PeerConnection:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.address.host, self.address.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        tune(sock, self.buffer_bytes)
        try:
            await loop.sock_connect(sock, sockaddr)
            if self.tls is not None:
                hostname = self.address.host if self.tls.check_hostname else None  # ours checks the CA only
                sock = self.tls.wrap_socket(sock, server_hostname=hostname, do_handshake_on_connect=False)
                self._sock = sock
                try:
                    await tls_handshake(sock)
                except ssl.SSLError as exc:
                    raise p.AuthenticationError(f"{self.address.node_id}: TLS handshake failed: {exc}") from exc
            self._sock = sock
            await self._handshake()
        except BaseException:
            self.close()
            raise
        return self

    async def _handshake(self) -> None:
        try:
            _, _, _, nonce = await recv_frame(self.sock, expect=[Op.HELLO], max_body=p.HANDSHAKE_BODY)
        except p.ProtocolError as exc:
            raise p.AuthenticationError(f"{self.address.node_id}: {exc}") from exc
        self.version = p.session_version(nonce, self.address.node_id, self.needs)
        p.speak(self.sock, self.version)
        mine = os.urandom(p.NONCE_BYTES)
        cred = p.credential(self.secret)
        claim = p.proof(cred.key, cred.role(self.node_id), bytes(nonce), mine)
        await send_frame(self.sock, Op.AUTH, 0, mine + claim + self.node_id.encode())
        try:
            _, _, _, body = await recv_frame(self.sock, expect=[Op.WELCOME], max_body=p.WELCOME_BODY)
        except (p.ProtocolError, p.PeerClosedError) as exc:
            raise p.AuthenticationError(f"{self.address.node_id} refused us: {exc}") from exc
        if not p.verify(cred.key, cred.server_role, mine, bytes(nonce), bytes(body[:32])):
            raise p.AuthenticationError(f"{self.address.node_id} could not prove it knows the {cred.kind} secret")
        self.info = p.PeerInfo.model_validate_json(bytes(body[32:]))

    def close(self) -> None:
        self.broken = True
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        if self._sock is not None:
            self._sock.close()

    def request(self) -> _Request:
        """``async with conn.request() as request_id:`` one request of several frames (a same-host
        object put); a failure inside closes the stream."""
        return self._request()

    async def reply(self, request: int, op: Op) -> bytearray:
        """The body of the answer ``op`` to ``request``."""
        return await self._reply(request, op)

    def _request(self) -> _Request:
        """``async with conn._request() as request_id:`` one request; a failure inside closes the stream."""
        if self.broken or self._sock is None:
            raise p.PeerClosedError(f"connection to {self.address.node_id} is closed")
        return _Request(self)

    async def _reply(self, request: int, op: Op) -> bytearray:
        _, _, got, body = await recv_frame(self.sock, expect=[op])
        if got != request:
            raise p.ProtocolError(f"reply to request {got}, expected {request}")
        return body

    # Operations -----------------------------------------------------------------------------------

    async def exchange(
        self,
        op: Op,
        answer: Op,
        body: bytes,
        flags: int = 0,
        data: Sequence = (),
        receive: Callable[[bytearray], Sequence] | None = None,
    ) -> bytearray:
        """One request of any operation (the key-value store's objects use it): the frame and the
        bulk bytes ``data`` out, the answer's body back. ``receive``, given the answer's body, names
        the buffers the bulk bytes that follow the answer land in, in order."""
        async with self._request() as request:
            await send_frame(self.sock, op, request, body, flags, data)
            reply = await self._reply(request, answer)
            if receive is not None:
                targets = receive(reply)
                if targets:
                    await recv_into_all(self.sock, targets)
        return reply

    async def send_only(self, op: Op, body: bytes, flags: int = 0) -> None:
        """A request the peer answers nothing to (a release of leases)."""
        async with self._request() as request:
            await send_frame(self.sock, op, request, body, flags)

    async def read(
        self, items: list[tuple[bytes, np.ndarray]], checksum: bool = False
    ) -> tuple[list[p.ItemError | None], list[bytes]]:
        """Fill each destination with its block, in place; per-item errors, and the seals the peer
        keeps with the blocks."""
        flags = p.FLAG_CHECKSUM if checksum else 0
        async with self._request() as request:
            await send_frame(self.sock, Op.READ, request, p.encode_read([(k, d.size) for k, d in items]), flags)
            replies = p.decode_read_reply(await self._reply(request, Op.READ_REPLY))
            check_count(replies, items)
            targets = []
            for (_, dst), reply in zip(items, replies):
                if reply.status is Status.OK:
                    if reply.length != dst.size:
                        raise p.ProtocolError(f"peer sends {reply.length} bytes for a {dst.size}-byte destination")
                    targets.append(dst)
            await recv_into_all(self.sock, targets)
        results: list[p.ItemError | None] = []
        for (_, dst), reply in zip(items, replies):
            if reply.status is not Status.OK:
                results.append(item_error(reply, self.address.node_id))
            elif checksum and xxhash.xxh3_64_intdigest(dst.data) != reply.checksum:
                results.append(p.ItemError(f"{self.address.node_id}: checksum mismatch in transit", Status.CHECKSUM))
            else:
                results.append(None)
        return results, [reply.seal for reply in replies]

    async def write(
        self,
        items: list[tuple[p.WriteItem, np.ndarray]],
        checksum: bool = False,
        copy_into_pool: Callable[[int, np.ndarray], None] | None = None,
    ) -> list[BaseException | None]:
        """Store each source as a block on the peer. With ``copy_into_pool`` (same host), the bytes
        are copied into the peer's shared pool at the offsets it reserved instead of streamed."""
        flags = (p.FLAG_CHECKSUM if checksum else 0) | (p.FLAG_SHM if copy_into_pool else 0)
        for it, src in items:
            it.length = src.size
            it.checksum = xxhash.xxh3_64_intdigest(src.data) if checksum else 0
        if copy_into_pool is None and sum(src.size for _, src in items) <= p.MAX_EAGER_BYTES:
            return await self._write_eager(items, flags | p.FLAG_EAGER)
        async with self._request() as request:
            await send_frame(self.sock, Op.WRITE, request, p.encode_write([it for it, _ in items]), flags)
            ready = p.decode_lease_reply(await self._reply(request, Op.WRITE_READY))
            check_count(ready, items)
            accepted = [(src, r) for (_, src), r in zip(items, ready) if r.status is Status.OK]
            if copy_into_pool is not None:

                def copy_all() -> None:
                    for src, r in accepted:
                        copy_into_pool(r.offset, src)

                if sum(src.size for src, _ in accepted) > INLINE_COPY_MAX:
                    await asyncio.to_thread(copy_all)  # large copies off the event loop
                else:
                    copy_all()
                await send_frame(self.sock, Op.WRITE_COMMIT, request)
            else:
                await send_all(self.sock, [src for src, _ in accepted])
            done = p.decode_statuses(await self._reply(request, Op.WRITE_DONE))
        return write_results(ready, done, self.address.node_id)

    async def _write_eager(self, items: list[tuple[p.WriteItem, np.ndarray]], flags: int) -> list[BaseException | None]:
        """A small write in one round trip: the table and every item's bytes at once, then WRITE_DONE
        (an item the peer refuses has its bytes dropped there)."""
        async with self._request() as request:
            await send_frame(
                self.sock, Op.WRITE, request, p.encode_write([it for it, _ in items]), flags, [src for _, src in items]
            )
            done = p.decode_statuses(await self._reply(request, Op.WRITE_DONE))
            check_count(done, items)
        return [None if d.status is Status.OK else item_error(d, self.address.node_id) for d in done]

    async def lease(self, items: list[tuple[bytes, int, float]]) -> list[ReplyItem]:
        async with self._request() as request:
            await send_frame(self.sock, Op.LEASE, request, p.encode_lease(items))
            replies = p.decode_lease_reply(await self._reply(request, Op.LEASE_REPLY))
            check_count(replies, items)
        return replies

    async def delete(self, keys: list[bytes]) -> list[p.ItemError | None]:
        """Remove every copy of each block on the peer; per-item errors (NOT_FOUND, LEASED, PINNED)."""
        return await self._keys_op(Op.DELETE, Op.DELETE_REPLY, keys)

    async def stage(self, keys: list[bytes]) -> list[p.ItemError | None]:
        """Have the peer bring blocks only on its disk into memory; per-item errors (NOT_FOUND, FULL)."""
        return await self._keys_op(Op.STAGE, Op.STAGE_REPLY, keys)

    async def session(self, notice: p.SessionNotice, keys: Sequence[bytes]) -> None:
        """Tell the peer's tiers a session's new state (``p.SESSION``); raises ``ItemError`` if refused."""
        async with self._request() as request:
            await send_frame(self.sock, Op.SESSION, request, p.encode_session(notice, keys))
            (reply,) = p.decode_statuses(await self._reply(request, Op.SESSION_REPLY))
        if reply.status is not Status.OK:
            raise item_error(reply, self.address.node_id)

    async def _keys_op(self, op: Op, answer: Op, keys: list[bytes]) -> list[p.ItemError | None]:
        async with self._request() as request:
            await send_frame(self.sock, op, request, p.encode_keys(keys))
            replies = p.decode_statuses(await self._reply(request, answer))
            check_count(replies, keys)
        return [None if r.status is Status.OK else item_error(r, self.address.node_id) for r in replies]

    async def release(self, items: list[tuple[bytes, int]], wait: bool = False) -> None:
        """Free the leases on the peer. Unless ``wait``, the frame goes with ``FLAG_NO_REPLY`` and
        nothing comes back: the peer frees the leases when the frame arrives, so a read through the
        shared pool costs one round trip and one answer. With ``wait``, returns once the peer has
        freed them."""
        async with self._request() as request:
            await send_frame(self.sock, Op.RELEASE, request, p.encode_release(items), 0 if wait else p.FLAG_NO_REPLY)
            if wait:
                await self._reply(request, Op.RELEASE_REPLY)


class PeerChannel:
    """Up to ``streams`` connections to one peer, opened on demand and reused."""

    def __init__(
        self,
        address: PeerAddress,
        secret: bytes | p.Credential,
        node_id: str,
        streams: int = 2,
        buffer_bytes: int | None = None,
        connect_timeout: float = 5.0,
        tls: ssl.SSLContext | None = None,
        needs: int = p.OLDEST,
    ) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.address = address
        self.secret = secret
        self.node_id = node_id
        self.streams = streams
        self.buffer_bytes = buffer_bytes
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.needs = needs
        self._idle: list[PeerConnection] = []
        self._slots = asyncio.Semaphore(streams)
        self.info: p.PeerInfo | None = None
        self.version = p.VERSION  # the session's, once the handshake has chosen it

    async def _open(self) -> PeerConnection:
        conn = PeerConnection(self.address, self.secret, self.node_id, self.buffer_bytes, self.tls, self.needs)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await conn.open()
        except TimeoutError:
            conn.close()
            raise p.PeerClosedError(
                f"{self.address.node_id} at {self.address.host}:{self.address.port} did not "
                f"answer within {self.connect_timeout} s"
            ) from None
        except OSError as exc:
            if isinstance(exc, p.TransferError):
                raise
            raise p.PeerClosedError(
                f"cannot reach {self.address.node_id} at {self.address.host}:{self.address.port}: {exc}"
            ) from exc
        self.info, self.version = conn.info, conn.version
        return conn

    def connection(self) -> _Lent:
        """``async with channel.connection() as conn:`` a connection of the pool, for one holder."""
        return _Lent(self)

    async def peer_info(self) -> p.PeerInfo:
        if self.info is None:
            async with self.connection():
                pass
        return started(self.info, f"the channel to {self.address.node_id}")

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class _Lent:
    """A connection lent from a channel's pool; back to the pool unless it broke."""

    __slots__ = ("channel", "conn")

    def __init__(self, channel: PeerChannel) -> None:
        self.channel = channel
        self.conn: PeerConnection | None = None

    async def __aenter__(self) -> PeerConnection:
        channel = self.channel
        await channel._slots.acquire()
        try:
            self.conn = channel._idle.pop() if channel._idle else await channel._open()
        except BaseException:
            channel._slots.release()
            raise
        return self.conn

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None and not self.conn.broken:
            self.channel._idle.append(self.conn)
        self.channel._slots.release()


class Channels:
    """A ``PeerChannel`` per peer, its address learnt through ``resolve`` (node id -> (host, port), or
    None when the node is unknown): node agents replicating to each other, a key-value store client
    talking to the nodes that own its objects."""

    def __init__(
        self,
        node_id: str,
        secret: bytes | p.Credential,
        resolve: Callable,
        *,
        streams: int = 2,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = 5.0,
        buffer_bytes: int | None = None,
    ) -> None:
        self.node_id = node_id
        self.secret = secret
        self.resolve = resolve
        self.streams = streams
        self.tls = tls
        self.connect_timeout = connect_timeout
        self.buffer_bytes = buffer_bytes
        self._channels: dict[str, PeerChannel] = {}

    async def get(self, node: str) -> PeerChannel:
        channel = self._channels.get(node)
        if channel is None:
            address = await self.resolve(node)
            if address is None:
                raise p.PeerClosedError(f"node {node} is not a live member")
            channel = PeerChannel(
                PeerAddress(node, *address),
                self.secret,
                self.node_id,
                self.streams,
                self.buffer_bytes,
                self.connect_timeout,
                self.tls,
                needs=p.OBJECTS_SINCE,
            )
            self._channels[node] = channel
        return channel

    def forget(self, node: str) -> None:
        """After a failure: the next ``get`` resolves the node again (a restarted one listens elsewhere)."""
        channel = self._channels.pop(node, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class BlockingConnection:
    """``PeerConnection``'s blocking twin, for a caller with no event loop on its hot path (the
    key-value store's synchronous client): the same handshake and frames, one request at a time on
    the caller's thread. A failure in the middle of a request closes it; ``broken`` then says so."""

    def __init__(
        self,
        address: PeerAddress,
        secret: bytes | p.Credential,
        node_id: str,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = 5.0,
        spin: SpinWait | None = None,
        needs: int = p.OLDEST,
    ) -> None:
        self.address, self.secret, self.node_id, self.tls = address, secret, node_id, tls
        self.needs = needs
        self.connect_timeout = connect_timeout
        self.spin = spin if tls is None else None  # a TLS socket cannot peek without blocking
        self._sock: socket.socket | None = None
        self.info: p.PeerInfo | None = None
        self.version = p.VERSION  # the session's, once the handshake has chosen it
        self.broken = False
        self._timeout: float | None = -1.0  # what the socket's timeouts are set to (-1: not yet)

    @property
    def sock(self) -> socket.socket:
        """The stream (``PeerClosedError`` before ``open`` made it)."""
        if self._sock is None:
            raise p.PeerClosedError(f"connection to {self.address.node_id} is not open")
        return self._sock

    def open(self) -> BlockingConnection:
        try:
            sock = socket.create_connection((self.address.host, self.address.port), self.connect_timeout)
        except OSError as exc:
            raise p.PeerClosedError(
                f"cannot reach {self.address.node_id} at {self.address.host}:{self.address.port}: {exc}"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dead_peer.watch(sock)
        try:
            if self.tls is not None:
                hostname = self.address.host if self.tls.check_hostname else None
                try:
                    sock = self.tls.wrap_socket(sock, server_hostname=hostname)
                except ssl.SSLError as exc:
                    raise p.AuthenticationError(f"{self.address.node_id}: TLS handshake failed: {exc}") from exc
            self._sock = sock
            self._handshake()
        except BaseException:
            self.close()
            raise
        return self

    def _timeouts(self, timeout: float | None) -> None:
        """Each send and receive waits at most ``timeout`` seconds for the peer. A plain socket stays
        blocking with the kernel's timeouts (SO_RCVTIMEO, SO_SNDTIMEO): Python's own timeout would
        poll before every call, a system call more each time; set again only when it changes much."""
        current = self._timeout
        if current is not None and current >= 0 and timeout is not None and current / 2 <= timeout <= current:
            return
        if self.tls is not None:
            self.sock.settimeout(timeout)
        else:
            self.sock.settimeout(None)
            seconds = timeout or 0.0
            value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout = timeout

    def _handshake(self) -> None:
        try:
            _, _, _, nonce = _recv_frame(self.sock, [Op.HELLO], p.HANDSHAKE_BODY)
        except p.ProtocolError as exc:
            raise p.AuthenticationError(f"{self.address.node_id}: {exc}") from exc
        self.version = p.session_version(nonce, self.address.node_id, self.needs)
        p.speak(self.sock, self.version)
        mine = os.urandom(p.NONCE_BYTES)
        cred = p.credential(self.secret)
        claim = p.proof(cred.key, cred.role(self.node_id), bytes(nonce), mine)
        _send_frame(self.sock, Op.AUTH, 0, mine + claim + self.node_id.encode())
        try:
            _, _, _, body = _recv_frame(self.sock, [Op.WELCOME], p.WELCOME_BODY)
        except (p.ProtocolError, p.PeerClosedError) as exc:
            raise p.AuthenticationError(f"{self.address.node_id} refused us: {exc}") from exc
        if not p.verify(cred.key, cred.server_role, mine, bytes(nonce), bytes(body[:32])):
            raise p.AuthenticationError(f"{self.address.node_id} could not prove it knows the {cred.kind} secret")
        self.info = p.PeerInfo.model_validate_json(bytes(body[32:]))

    def exchange(
        self,
        op: Op,
        answer: Op,
        body: bytes,
        flags: int = 0,
        data: Sequence = (),
        receive: Callable[[bytearray], Sequence] | None = None,
        timeout: float | None = None,
    ) -> bytearray:
        """``PeerConnection.exchange``, blocking, within ``timeout`` seconds (``TimeoutError``)."""
        if self.broken or self._sock is None:
            raise p.PeerClosedError(f"connection to {self.address.node_id} is closed")
        request = next(_request_ids)
        try:
            self._timeouts(timeout)
            _send_frame(self.sock, op, request, body, flags, data)
            if self.spin is not None:
                self.spin.wait(self.sock)
            _, _, got, reply = _recv_frame(self.sock, [answer], p.MAX_BODY)
            if got != request:
                raise p.ProtocolError(f"reply to request {got}, expected {request}")
            if receive is not None:
                targets = receive(reply)
                if targets:
                    _recv_into(self.sock, targets)
            return reply
        except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's timeout (SO_RCVTIMEO)
            self.close()
            raise TimeoutError(f"{self.address.node_id} did not answer within {timeout} s") from None
        except BaseException:
            self.close()
            raise

    def send_only(self, op: Op, body: bytes, flags: int = 0) -> None:
        """A request the peer answers nothing to."""
        if self.broken or self._sock is None:
            raise p.PeerClosedError(f"connection to {self.address.node_id} is closed")
        try:
            self._timeouts(self.connect_timeout)
            _send_frame(self.sock, op, next(_request_ids), body, flags)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.broken = True
        if self._sock is not None:
            self._sock.close()


def _send_frame(
    sock: socket.socket, op: Op, request: int, body: bytes = b"", flags: int = 0, data: Sequence = ()
) -> None:
    views = [memoryview(p.FRAME.pack(p.MAGIC, p.version_of(sock), op, flags, request, len(body))), memoryview(body)]
    views += [memoryview(d).cast("B") if memoryview(d).ndim != 1 else memoryview(d) for d in data]
    views = [v for v in views if len(v)]
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        try:
            sent = sock.send(views[0]) if tls else sock.sendmsg(views[:IOV_MAX])
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise p.PeerClosedError(f"peer closed the connection while we sent: {exc}") from exc
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]


def _recv_into(sock: socket.socket, buffers: Sequence) -> None:
    """Fill each buffer in turn: many at a time with one ``recvmsg_into`` (a batch of small objects
    was a system call per object), one at a time on TLS (which has no scatter read)."""
    views = [memoryview(b).cast("B") if memoryview(b).ndim != 1 else memoryview(b) for b in buffers]
    views = [v for v in views if len(v)]
    tls = isinstance(sock, ssl.SSLSocket)
    i = 0  # the first buffer not yet full
    while i < len(views):
        try:
            got = sock.recv_into(views[i]) if tls else sock.recvmsg_into(views[i : i + IOV_MAX])[0]
        except ConnectionResetError as exc:
            raise p.PeerClosedError(f"peer reset the connection mid-transfer: {exc}") from exc
        if got == 0:
            raise p.PeerClosedError("peer closed the connection mid-transfer")
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]


def _recv_frame(sock: socket.socket, expect: Sequence[Op], max_body: int) -> tuple[Op, int, int, bytearray]:
    head = bytearray(p.FRAME.size)
    _recv_into(sock, [head])
    magic, version, op, flags, request, length = p.FRAME.unpack(head)
    if magic != p.MAGIC:
        raise p.ProtocolError(f"not a tiercake transfer stream (magic {bytes(magic)!r})")
    if (why := p.spoken(version, op)) is not None:
        raise p.ProtocolError(why)
    if length > max_body:
        raise p.ProtocolError(f"frame body of {length} bytes is over the limit of {max_body}")
    body = bytearray(length)
    _recv_into(sock, [body])
    if op == Op.ERROR:
        raise p.ProtocolError(f"peer refused: {body.decode(errors='replace')}")
    if op not in expect:
        raise p.ProtocolError(f"expected {'/'.join(o.name for o in expect)}, got {op}")
    return Op(op), flags, request, body
