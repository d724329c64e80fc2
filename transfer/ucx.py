"""The UCX transport (``ucxx``, the optional ``ucx`` extra): the RDMA-capable path for real clusters.

Control stays on the authenticated TCP stream (tables, statuses, leases, commits); only the bulk bytes
move over UCX, as tagged messages between endpoints that both sides create from each other's worker
address, exchanged over that stream (UCX_HELLO). Per pair of endpoints the configuration differs:

- same host (equal boot ids): endpoints *without* UCX peer-failure handling, which lets UCX pick its
  shared-memory transports (posix, sysv, cma) -- with failure handling on, UCX refuses them ("no peer
  failure handler") and falls back to TCP;
- other hosts: endpoints *with* failure handling; UCX picks RDMA where the fabric has it, else TCP.

Liveness comes from the TCP stream and the engine's timeouts: when a transfer fails or is cancelled
the UCX endpoint is closed, which cancels its outstanding receives before any buffer is reused or any
reserved slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
from typing import Any

from tiercake.tiers.buffers import copy_into, host_bytes, size_of
from tiercake.tiers.store import PutHandle

from . import protocol as p
from .connection import PeerConnection, check_count, item_error, write_results
from .paths import Bulk, DataPath, ServerSide, receive_targets
from .protocol import Op, Status
from .sockio import send_frame, wait_hangup
from .transports import Peer, ReadReq, Results, TcpTransport, WriteReq, _host

log = logging.getLogger(__name__)

# ucxx sets UCX variables that this UCX build does not know; its warning about them is noise
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

try:  # optional: the rest of tiercake never needs it
    import ucxx
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    ucxx = None

_connection_ids = itertools.count(1)


def available() -> bool:
    return ucxx is not None


def tag(connection: int, request: int, index: int) -> int:
    """A 64-bit tag unique per receiving worker: connection (20 bits), request (32), item (12)."""
    return ((connection & 0xFFFFF) << 44) | ((request & 0xFFFFFFFF) << 12) | (index & 0xFFF)


def worker_address() -> bytes:
    return bytes(ucxx.get_worker_address())


def seal(secret: bytes, address: bytes) -> bytes:
    """A worker address behind its MAC. UCX takes a malformed address as fatal and aborts the whole
    process (found by fuzzing the transfer port), so only an address a tiercake peer packed is ever
    handed to it: garbage, truncation and corruption in transit are refused as protocol errors."""
    return hmac.new(secret, b"tiercake-ucx-address" + address, hashlib.sha256).digest() + address


def unseal(secret: bytes, sealed: bytes) -> bytes:
    address = sealed[32:]
    if not address or not hmac.compare_digest(sealed[:32], seal(secret, address)[:32]):
        raise p.ProtocolError("UCX_HELLO does not carry a worker address sealed by a tiercake peer")
    return address


async def endpoint_to(address: bytes, same_host: bool) -> Any:
    return await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=not same_host
    )


CANCEL_WAIT = 2.0  # seconds to wait for an aborted endpoint's requests to be cancelled


class UcxStuckError(p.PeerClosedError):
    """Receives into reserved memory could not be cancelled: that memory must never be reused."""


def abort_endpoint(ep: Any) -> None:
    """Abort the endpoint, which cancels what it still has in flight. ``abort`` blocks the calling
    thread while UCX closes, so it is bounded to 100 ms."""
    if ep is not None:
        with contextlib.suppress(Exception):
            ep.abort(period=100_000_000, max_attempts=1)


async def close_endpoint(ep: Any) -> None:
    abort_endpoint(ep)


# Server side ---------------------------------------------------------------------------------------


class UcxPath(DataPath):
    """The server half of the UCX transport: endpoints made by UCX_HELLO, closed with the connection;
    the bulk bytes of READ and WRITE requests with FLAG_UCX go over them as tagged messages."""

    flag = p.FLAG_UCX
    ops = (Op.UCX_HELLO,)

    def __init__(self, server: ServerSide, conn) -> None:
        super().__init__(server, conn)
        self.ep: Any = None
        self.connection = next(_connection_ids)

    @classmethod
    def enabled(cls, server: ServerSide) -> bool:
        return server.ucx

    async def handle(self, op: Op, flags: int, request: int, body: bytearray) -> None:
        if len(body) < 2:
            raise p.ProtocolError("short UCX_HELLO")
        same_host = body[0] == 1
        address = unseal(self.server.secret, bytes(body[1:]))
        await close_endpoint(self.ep)
        self.ep = await endpoint_to(address, same_host)
        reply = self.connection.to_bytes(4, "little") + seal(self.server.secret, worker_address())
        await send_frame(self.conn, Op.UCX_HELLO, request, reply)

    def check(self) -> Any:
        if self.ep is None:  # before any reply: a UCX request without endpoints is refused whole
            raise p.ProtocolError("UCX transfer before UCX_HELLO")
        return self.ep

    async def send(self, request: int, flags: int, table: bytes, data: Bulk) -> None:
        """The table over the stream, each item over UCX (under the server's leases); a peer that
        hangs up cancels them all."""
        await send_frame(self.conn, Op.READ_REPLY, request, table, flags)
        ep = self.check()
        sends = [ep.send(a, tag=tag(self.connection, request, i), force_tag=True) for i, a in data]
        if not await self._until_done_or_hangup(ep, asyncio.gather(*sends)):
            # nobody will ever receive these; the leased blocks may go (at worst UCX reads them late)
            log.warning("UCX sends to a departed peer were not cancelled within %s s", CANCEL_WAIT)
            raise p.PeerClosedError("peer left during a UCX read")

    async def receive(self, request: int, accepted: list[tuple[int, PutHandle]]) -> None:
        """Each item into its slot; a peer that hangs up on the stream cancels them all."""
        ep = self.check()
        targets, staged = receive_targets([h for _, h in accepted])
        receives = [
            ep.recv(t, tag=tag(self.connection, request, i), force_tag=True) for (i, _), t in zip(accepted, targets)
        ]
        if not await self._until_done_or_hangup(ep, asyncio.gather(*receives)):
            # UCX may still write into these slots: keep them reserved forever rather than free
            # memory that a stray receive could overwrite.
            log.error("transfer server %s: quarantining %d reserved blocks", self.server.node_id, len(accepted))
            for _, handle in accepted:
                handle.done = True
            raise UcxStuckError("UCX receives from a departed peer could not be cancelled")
        for handle, host in staged:
            copy_into(handle.buffer, host)

    async def _until_done_or_hangup(self, ep, work: asyncio.Future) -> bool:
        """Wait for the work; if the peer hangs up on the stream first (same-host endpoints have no
        UCX failure handling, so the stream is what tells), abort the endpoint and wait for the work
        to be cancelled. True when the work is over (done or cancelled); False when it may still run.
        Raises PeerClosedError after a hang-up."""
        hangup = asyncio.ensure_future(wait_hangup(self.conn))
        try:
            done, _ = await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
                return True
        except BaseException:
            await self._abort(ep, work)
            raise
        finally:
            hangup.cancel()
            with contextlib.suppress(BaseException):
                await hangup
        if not await self._abort(ep, work):
            return False
        raise p.PeerClosedError("peer left during a UCX transfer")

    async def _abort(self, ep, work: asyncio.Future) -> bool:
        await close_endpoint(ep)
        self.ep = None
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(work), CANCEL_WAIT)
        return work.done()

    async def close(self) -> None:
        await close_endpoint(self.ep)
        self.ep = None


# Client side ---------------------------------------------------------------------------------------


class UcxTransport(TcpTransport):
    """Tables over the peer's TCP stream, bytes over UCX (shared memory on one host, RDMA or TCP across)."""

    name = "ucx"
    server_path = UcxPath

    @classmethod
    def usable(cls, peer: Peer, local_node: str) -> bool:
        return available() and peer.channel is not None and peer.info is not None and peer.info.ucx

    async def _endpoint(self, conn: PeerConnection, peer: Peer) -> tuple[Any, int]:
        state = getattr(conn, "ucx", None)
        if state is None:
            same_host = peer.info is not None and peer.info.boot_id == p.boot_id()
            key = p.credential(conn.secret).key
            async with conn.request() as request:
                await send_frame(conn.sock, Op.UCX_HELLO, request, bytes([same_host]) + seal(key, worker_address()))
                body = await conn.reply(request, Op.UCX_HELLO)
                ep = await endpoint_to(unseal(key, bytes(body[4:])), same_host)
            state = (ep, int.from_bytes(body[:4], "little"))
            conn.ucx = state
            conn.on_close = lambda: abort_endpoint(ep)
        return state

    async def read(self, peer: Peer, items: list[ReadReq]) -> Results:
        staged = [_host(it.dst) for it in items]
        async with peer.remote.connection() as conn:
            ep, connection = await self._endpoint(conn, peer)
            async with conn.request() as request:
                body = p.encode_read([(it.key, size_of(it.dst)) for it in items])
                await send_frame(conn.sock, Op.READ, request, body, p.FLAG_UCX)
                replies = p.decode_read_reply(await conn.reply(request, Op.READ_REPLY))
                check_count(replies, items)
                receives = []
                for i, ((target, _), reply) in enumerate(zip(staged, replies)):
                    if reply.status is Status.OK:
                        if reply.length != target.size:
                            raise p.ProtocolError(f"peer sends {reply.length} bytes for a {target.size}-byte buffer")
                        receives.append(ep.recv(target, tag=tag(connection, request, i), force_tag=True))
                await asyncio.gather(*receives)
        results: Results = []
        for it, (_, staging), reply in zip(items, staged, replies):
            if reply.status is not Status.OK:
                results.append(item_error(reply, peer.node_id))
                continue
            if staging is not None:
                copy_into(it.dst, staging)
            it.seal = reply.seal
            results.append(None)
        return results

    async def write(self, peer: Peer, items: list[WriteReq]) -> Results:
        sources = [host_bytes(it.src) for it in items]
        async with peer.remote.connection() as conn:
            ep, connection = await self._endpoint(conn, peer)
            async with conn.request() as request:
                table = p.encode_write([it.item(s.size) for it, s in zip(items, sources)])
                await send_frame(conn.sock, Op.WRITE, request, table, p.FLAG_UCX)
                ready = p.decode_lease_reply(await conn.reply(request, Op.WRITE_READY))
                check_count(ready, items)
                await asyncio.gather(
                    *(
                        ep.send(s, tag=tag(connection, request, i), force_tag=True)
                        for i, (s, r) in enumerate(zip(sources, ready))
                        if r.status is Status.OK
                    )
                )
                done = p.decode_statuses(await conn.reply(request, Op.WRITE_DONE))
        return write_results(ready, done, peer.node_id)
