"""The transfer server: a node's store, exposed to authenticated peers.

Peers read blocks by key (the store's leases are held while the bytes go out), write blocks by key
(a two-phase put per block: the data lands in the reserved slot and becomes visible only at commit;
a peer that dies mid-batch leaves nothing visible), and, on the same host, lease blocks of the shared
pool to copy them in place. Every connection must first prove it knows the cluster secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tiercake.tiers import (
    ObjectExistsError,
    ObjectNotFoundError,
    PayloadError,
    PutInProgressError,
    StoreError,
    TieredStore,
    TierFullError,
)
from tiercake.tiers.store import PutHandle

from . import protocol as p
from . import ucx as ucx_module
from .protocol import Op, ReplyItem, Status
from .sockio import recv_frame, recv_into_all, send_frame, tune

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0


def status_of(exc: BaseException) -> Status:
    """The wire status for a store error."""
    for kind, status in (
        (ObjectNotFoundError, Status.NOT_FOUND),
        (ObjectExistsError, Status.EXISTS),
        (PutInProgressError, Status.IN_PROGRESS),
        (TierFullError, Status.FULL),
        (PayloadError, Status.LENGTH_MISMATCH),
        (p.TransferError, getattr(exc, "status", Status.INTERNAL)),
    ):
        if isinstance(exc, kind):
            return status
    return Status.INTERNAL


def host_bytes(t: torch.Tensor):
    """A numpy view of a CPU tensor (the socket reads and writes it in place)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


class TransferServer:
    def __init__(
        self,
        store: TieredStore,
        secret: bytes,
        node_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        pool_tier: str | None = "pool",
        max_block_bytes: int = 1 << 30,
        buffer_bytes: int | None = None,
        ucx: bool | None = None,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self.store = store
        self.secret = secret
        self.node_id = node_id
        self.host = host
        self.port = port
        self.max_block_bytes = max_block_bytes
        self.buffer_bytes = buffer_bytes
        self.pool_tier = pool_tier if pool_tier in {t.name for t in store.tiers} else None
        self.ucx = ucx_module.available() if ucx is None else ucx
        if self.ucx and not ucx_module.available():
            raise ValueError("ucx=True, but the ucxx package is not installed (pip install 'tiercake[ucx]')")
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self.refused = 0  # connections that failed authentication
        self.served_bytes = 0

    def info(self) -> p.PeerInfo:
        pool_path, pool_size = None, 0
        if self.pool_tier is not None:
            region = self.store.tier(self.pool_tier).backend.region
            pool_path, pool_size = str(region.path), region.size
        return p.PeerInfo(
            node_id=self.node_id, boot_id=p.boot_id(), pool_path=pool_path, pool_size=pool_size,
            max_block_bytes=self.max_block_bytes, ucx=self.ucx,
        )

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("server is not started")
        return self._listener.getsockname()[:2]

    async def start(self) -> TransferServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept())
        return self

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def __aenter__(self) -> TransferServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _addr = await loop.sock_accept(self._listener)
            tune(conn, self.buffer_bytes)
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    # One connection -------------------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    peer = await self._handshake(conn)
            except (p.TransferError, TimeoutError, OSError) as exc:
                self.refused += 1
                log.warning("transfer server %s: refused a connection: %s", self.node_id, exc)
                with contextlib.suppress(OSError, p.TransferError):
                    await send_frame(conn, Op.ERROR, 0, f"authentication failed: {exc}".encode())
                return
            await self._requests(conn, peer)
        except asyncio.CancelledError:
            pass
        finally:
            conn.close()

    async def _handshake(self, conn: socket.socket) -> str:
        nonce = os.urandom(p.NONCE_BYTES)
        await send_frame(conn, Op.HELLO, 0, nonce)
        _, _, _, body = await recv_frame(conn, expect=[Op.AUTH])
        if len(body) < p.NONCE_BYTES + 32:
            raise p.AuthenticationError("short AUTH frame")
        client_nonce, claimed, peer = (
            bytes(body[: p.NONCE_BYTES]), bytes(body[p.NONCE_BYTES : p.NONCE_BYTES + 32]), bytes(body[p.NONCE_BYTES + 32 :])
        )
        if not p.verify(self.secret, b"client", nonce, client_nonce, claimed):
            raise p.AuthenticationError("wrong proof of the cluster secret")
        server_proof = p.proof(self.secret, b"server", client_nonce, nonce)
        await send_frame(conn, Op.WELCOME, 0, server_proof + self.info().model_dump_json().encode())
        return peer.decode(errors="replace")

    async def _requests(self, conn: socket.socket, peer: str) -> None:
        session = _Session(conn, ucx_module.UcxServerSide() if self.ucx else None)
        try:
            await self._serve_requests(session, peer)
        finally:
            if session.ucx is not None:
                await session.ucx.close()

    async def _serve_requests(self, session: _Session, peer: str) -> None:
        conn = session.conn
        handlers = {
            Op.READ: self._read,
            Op.WRITE: self._write,
            Op.LEASE: self._lease,
            Op.RELEASE: self._release,
            Op.UCX_HELLO: self._ucx_hello,
        }
        while True:
            try:
                op, flags, request, body = await recv_frame(conn)
            except p.PeerClosedError:
                return  # the client hung up between requests: normal
            except p.ProtocolError as exc:
                log.warning("transfer server %s: bad frame from %s: %s", self.node_id, peer, exc)
                with contextlib.suppress(OSError, p.TransferError):
                    await send_frame(conn, Op.ERROR, 0, str(exc).encode())
                return
            handler = handlers.get(op)
            try:
                if handler is None:
                    raise p.ProtocolError(f"{op.name} is not a request")
                await handler(session, flags, request, body)
            except p.PeerClosedError as exc:
                log.info("transfer server %s: %s left mid-request: %s", self.node_id, peer, exc)
                return
            except p.ProtocolError as exc:
                log.warning("transfer server %s: bad request from %s: %s", self.node_id, peer, exc)
                with contextlib.suppress(OSError, p.TransferError):
                    await send_frame(conn, Op.ERROR, request, str(exc).encode())
                return

    # READ -----------------------------------------------------------------------------------------

    async def _ucx_hello(self, session: _Session, flags: int, request: int, body: bytearray) -> None:
        if session.ucx is None:
            raise p.ProtocolError("this node does not speak UCX")
        await session.ucx.hello(session.conn, request, body)

    def _ucx(self, session: _Session, flags: int):
        if not flags & p.FLAG_UCX:
            return None
        if session.ucx is None:
            raise p.ProtocolError("this node does not speak UCX")
        session.ucx.require()  # before any reply: a UCX request without endpoints is refused whole
        return session.ucx

    async def _read(self, session: _Session, flags: int, request: int, body: bytearray) -> None:
        conn = session.conn
        ucx = self._ucx(session, flags)
        items = p.decode_read(body)
        replies: list[ReplyItem] = []
        data = []
        leases: list[int] = []
        try:
            for key, expected in items:
                try:
                    view, lease = self._leased_block(key)
                    if view is None:  # only on disk: read (and maybe promote) it
                        view = (await self.store.get(key)).numpy()
                except (StoreError, ValueError, TypeError) as exc:
                    replies.append(ReplyItem(status_of(exc), message=str(exc)))
                    continue
                if lease is not None:
                    leases.append(lease)
                if view.size != expected:
                    replies.append(ReplyItem(Status.LENGTH_MISMATCH, message=f"block is {view.size} bytes, "
                                             f"{expected} were asked"))
                    continue
                checksum = xxhash.xxh3_64_intdigest(view) if flags & p.FLAG_CHECKSUM else 0
                replies.append(ReplyItem(Status.OK, view.size, checksum))
                data.append((len(replies) - 1, view))
            table = p.encode_read_reply(replies)
            if ucx is not None:
                await send_frame(conn, Op.READ_REPLY, request, table, flags)
                await ucx.send_items(conn, request, data)
            else:
                await send_frame(conn, Op.READ_REPLY, request, table, flags, [view for _, view in data])
            self.served_bytes += sum(view.size for _, view in data)
        finally:
            await self.store.release_leases(leases)

    def _leased_block(self, key: bytes) -> tuple[np.ndarray | None, int | None]:
        """The block's bytes in host memory under a lease (released by the caller), or (None, None)
        when it is only on disk. ObjectNotFoundError when it is nowhere."""
        try:
            lease = self.store.acquire_lease(key, math.inf)
        except ObjectNotFoundError:
            if not self.store.contains(key):
                raise
            return None, None
        array = lease.host_array()
        return (host_bytes(lease.data) if array is None else array), lease.id

    # WRITE ----------------------------------------------------------------------------------------

    async def _write(self, session: _Session, flags: int, request: int, body: bytearray) -> None:
        conn = session.conn
        ucx = self._ucx(session, flags)
        items = p.decode_write(body)
        shm = bool(flags & p.FLAG_SHM)
        if shm and self.pool_tier is None:
            raise p.ProtocolError("this node has no shared pool to write into")
        handles: list[PutHandle | None] = []
        ready: list[ReplyItem] = []
        try:
            for it in items:
                if it.length > self.max_block_bytes:
                    handles.append(None)
                    ready.append(ReplyItem(Status.LENGTH_MISMATCH, message=f"{it.length} bytes is over this node's "
                                           f"limit of {self.max_block_bytes}"))
                    continue
                try:
                    handle = await self.store.put_start(
                        it.key, it.length, parent=it.parent, tenant=it.tenant, tier=self.pool_tier if shm else None
                    )
                except (StoreError, ValueError, TypeError) as exc:
                    handles.append(None)
                    ready.append(ReplyItem(status_of(exc), message=str(exc)))
                    continue
                handles.append(handle)
                offset = handle.copy.slot[0] if shm else 0
                ready.append(ReplyItem(Status.OK, it.length, offset=offset))
            await send_frame(conn, Op.WRITE_READY, request, p.encode_lease_reply(ready), flags)
            accepted = [(i, h) for i, h in enumerate(handles) if h is not None]
            if shm:
                await recv_frame(conn, expect=[Op.WRITE_COMMIT])  # the peer copied into the pool
            else:
                targets, staged = _receive_targets([h for _, h in accepted])
                if ucx is not None:
                    try:
                        await ucx.receive_items(conn, request, [(i, t) for (i, _), t in zip(accepted, targets)])
                    except ucx_module.UcxStuckError:
                        # UCX may still write into these slots: keep them reserved forever rather
                        # than free memory that a stray receive could overwrite.
                        log.error("transfer server %s: quarantining %d reserved blocks", self.node_id, len(accepted))
                        for _, handle in accepted:
                            handle.done = True
                        raise
                else:
                    await recv_into_all(conn, targets)
                for handle, host in staged:
                    handle.buffer.copy_(host)
            done: list[ReplyItem] = []
            for it, handle in zip(items, handles):
                if handle is None:
                    done.append(ReplyItem(Status.BAD_REQUEST, message="refused before the data was sent"))
                    continue
                if flags & p.FLAG_CHECKSUM and xxhash.xxh3_64_intdigest(host_bytes(handle.buffer)) != it.checksum:
                    await self.store.revoke(handle)
                    done.append(ReplyItem(Status.CHECKSUM, message="checksum mismatch: the block was not stored"))
                    continue
                handle.note_written(it.length)
                try:
                    await self.store.commit(handle)
                    done.append(ReplyItem(Status.OK, it.length))
                except (StoreError, OSError) as exc:
                    done.append(ReplyItem(status_of(exc), message=str(exc)))
            await send_frame(conn, Op.WRITE_DONE, request, p.encode_statuses(done), flags)
        finally:
            for handle in handles:  # anything not committed is revoked: nothing half-written is visible
                if handle is not None and not handle.done:
                    await self.store.revoke(handle)

    # LEASE / RELEASE (same host) ------------------------------------------------------------------

    async def _lease(self, session: _Session, flags: int, request: int, body: bytearray) -> None:
        conn = session.conn
        replies = []
        for key, expected, ttl in p.decode_lease(body):
            if self.pool_tier is None:
                replies.append(ReplyItem(Status.NOT_IN_MEMORY, message="no shared pool on this node"))
                continue
            try:
                lease = self.store.acquire_lease(key, min(max(ttl, 0.001), 600.0), tier=self.pool_tier)
            except ObjectNotFoundError as exc:
                status = Status.NOT_IN_MEMORY if self.store.contains(key) else Status.NOT_FOUND
                replies.append(ReplyItem(status, message=str(exc)))
                continue
            if lease.data.numel() != expected:
                await self.store.release_lease(key, lease.id)
                replies.append(ReplyItem(Status.LENGTH_MISMATCH, message=f"block is {lease.data.numel()} bytes, "
                                         f"{expected} were asked"))
                continue
            replies.append(ReplyItem(Status.OK, expected, offset=lease.slot[0], lease=lease.id))
        await send_frame(conn, Op.LEASE_REPLY, request, p.encode_lease_reply(replies), flags)

    async def _release(self, session: _Session, flags: int, request: int, body: bytearray) -> None:
        for key, lease in p.decode_release(body):
            await self.store.release_lease(key, lease)
        await send_frame(session.conn, Op.RELEASE_REPLY, request, b"", flags)


@dataclass(slots=True)
class _Session:
    """One authenticated connection and what it has set up."""

    conn: socket.socket
    ucx: ucx_module.UcxServerSide | None = None


def _receive_targets(handles: list[PutHandle]) -> tuple[list[np.ndarray], list[tuple[PutHandle, torch.Tensor]]]:
    """Where each accepted item's bytes land in place: its reserved slot, or, for a device tier, a
    host staging buffer copied over afterwards (the second list)."""
    staged: list[tuple[PutHandle, torch.Tensor]] = []
    targets = []
    for handle in handles:
        target = handle.host_target()
        if target is None:
            host = torch.empty(handle.entry.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            staged.append((handle, host))
            target = host.numpy()
        targets.append(target)
    return targets, staged

