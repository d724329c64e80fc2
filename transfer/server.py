"""The transfer server: a node's store, exposed to authenticated peers.

Peers read blocks by key (the store's leases are held while the bytes go out), write blocks by key
(a two-phase put per block: the data lands in the reserved slot and becomes visible only at commit;
a peer that dies mid-batch leaves nothing visible), and, on the same host, lease blocks of the shared
pool to copy them in place. Every connection must first prove it knows the cluster secret. How a
request's bytes travel (the stream, the shared pool, UCX, a plug-in's path) is the business of the
data paths in ``paths.py``, which the registered transports declare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
from collections.abc import Sequence

import numpy as np
import xxhash

from tiercake.credentials import tenant_key
from tiercake.policies import SessionEvent, SessionState
from tiercake.started import started
from tiercake.tiers import (
    ObjectExistsError,
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPinnedError,
    PayloadError,
    PoolBackend,
    PutInProgressError,
    StoreError,
    TieredStore,
    TierFullError,
)
from tiercake.tiers.buffers import host_bytes
from tiercake.tiers.store import PutHandle

from . import protocol as p
from . import ucx as ucx_module
from .inbox import Inbox
from .paths import ServerSide, Session, StreamPath, registered_paths
from .protocol import Op, ReplyItem, Status
from .sockio import recv_frame, recv_versioned, send_frame, tls_handshake, tune

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# A request's bytes must move within STALL_TIMEOUT plus their size at MIN_RATE: a peer that reserved
# slots and went silent, or stopped reading a reply while the server holds the blocks' leases, would
# otherwise pin that space until its connection closed.
STALL_TIMEOUT = 30.0
MIN_RATE = 10e6  # bytes per second


def status_of(exc: BaseException) -> Status:
    """The wire status for a store error."""
    for kind, status in (
        (ObjectNotFoundError, Status.NOT_FOUND),
        (ObjectExistsError, Status.EXISTS),
        (PutInProgressError, Status.IN_PROGRESS),
        (TierFullError, Status.FULL),
        (PayloadError, Status.LENGTH_MISMATCH),
        (ObjectLeasedError, Status.LEASED),
        (ObjectPinnedError, Status.PINNED),
        (p.TransferError, getattr(exc, "status", Status.INTERNAL)),
    ):
        if isinstance(exc, kind):
            return status
    return Status.INTERNAL


# what a tenant's key may ask: its objects (each item's tenant is checked by the object server)
TENANT_OPS = frozenset({Op.OBJ_PUT, Op.OBJ_GET, Op.OBJ_QUERY, Op.OBJ_REMOVE})
# a tenant's client is not told where the node's pool and directory are: reading them in place would
# show every tenant's bytes (the files are the node agent's anyway)
TENANT_HIDES = {"pool_path": None, "pool_size": 0, "pool_id": None, "objects_path": None}


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
        tls: ssl.SSLContext | None = None,
        stall_timeout: float = STALL_TIMEOUT,
        objects=None,
        node_secret: bytes | None = None,
    ) -> None:
        """``tls``: a server context (``transfer_tls_server``): the port speaks TLS only, before the
        cluster secret's challenge; UCX is then not served (its bytes would bypass TLS). ``objects``:
        what answers the key-value store's object operations (``workers.node.objects.ObjectServer``: its
        ``ops`` and ``handle``); None: they are refused. ``node_secret``: what other node agents prove
        (the replication plane); None: no peer is a node here."""
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        if node_secret is not None and (len(node_secret) < 16 or node_secret == secret):
            raise ValueError("the node secret is at least 16 bytes, and not the cluster secret (clients hold that)")
        self.store = store
        self.secret = secret
        self.node_secret = node_secret
        self.node_id = node_id
        self.host = host
        self.port = port
        self.max_block_bytes = max_block_bytes
        self.stall_timeout = stall_timeout
        self.buffer_bytes = buffer_bytes
        self.pool_tier = pool_tier if pool_tier in {t.name for t in store.tiers} else None
        self.tls = tls
        self.ucx = (ucx_module.available() and tls is None) if ucx is None else ucx
        if self.ucx and tls is not None:
            raise ValueError("UCX moves bytes outside the TLS stream: a TLS transfer server does not serve it")
        if self.ucx and not ucx_module.available():
            raise ValueError("ucx=True, but the ucxx package is not installed (pip install 'tiercake[ucx]')")
        self.objects = objects
        self._side = ServerSide(store, node_id, self.pool_tier, self.ucx, secret)
        self._paths = registered_paths()  # every registered transport's server half, by request flag
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self.refused = 0  # connections that failed authentication
        self.forbidden = 0  # requests beyond their credential (a tenant's key asking for blocks)
        self.stalled = 0  # connections dropped because a request's bytes stopped moving
        self._moving: dict[asyncio.Task, float] = {}  # connection task -> deadline of the bytes it moves
        self._watchdog_task: asyncio.Task | None = None
        self.served_bytes = 0

    def info(self) -> p.PeerInfo:
        pool_path, pool_size, pool_id = None, 0, None
        if self.pool_tier is not None:
            backend = self.store.tier(self.pool_tier).backend
            assert isinstance(backend, PoolBackend)  # the node's tier of kind pool
            region = backend.region
            pool_path, pool_size, pool_id = str(region.path), region.size, region.instance
        directory = getattr(self.objects, "directory_path", None)
        return p.PeerInfo(
            node_id=self.node_id,
            boot_id=p.boot_id(),
            pool_path=pool_path,
            pool_size=pool_size,
            pool_id=pool_id,
            max_block_bytes=self.max_block_bytes,
            ucx=self.ucx,
            objects_path=directory,
        )

    @property
    def address(self) -> tuple[str, int]:
        return started(self._listener, "the transfer server").getsockname()[:2]

    async def start(self) -> TransferServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept(sock))
        self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())
        return self

    async def close(self) -> None:
        for task in (self._accept_task, self._watchdog_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def __aenter__(self) -> TransferServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _addr = await loop.sock_accept(listener)
            tune(conn, self.buffer_bytes)
            if self.tls is not None:  # the handshake runs in the connection's task, under its deadline
                conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    # One connection -------------------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    if isinstance(conn, ssl.SSLSocket):  # (wrapped when the server has TLS)
                        await tls_handshake(conn)
                    peer = await self._handshake(conn)
            except ssl.SSLError as exc:  # not TLS, or no certificate we trust: nothing to answer in
                self.refused += 1
                log.warning("transfer server %s: refused a connection: TLS: %s", self.node_id, exc)
                return
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

    async def _handshake(self, conn: socket.socket) -> p.PeerIdentity:
        nonce = p.hello_nonce()
        await send_frame(conn, Op.HELLO, 0, nonce, version=p.OLDEST)  # any version we speak can read it
        version, _, _, _, body = await recv_versioned(conn, expect=[Op.AUTH], max_body=p.HANDSHAKE_BODY)
        if len(body) < p.NONCE_BYTES + 32:
            raise p.AuthenticationError("short AUTH frame")
        client_nonce, claimed, name = (
            bytes(body[: p.NONCE_BYTES]),
            bytes(body[p.NONCE_BYTES : p.NONCE_BYTES + 32]),
            bytes(body[p.NONCE_BYTES + 32 :]).decode(errors="replace"),
        )
        used = next(
            (c for c in self._credentials(name) if p.verify(c.key, c.role(name), nonce, client_nonce, claimed)), None
        )
        if used is None:
            raise p.AuthenticationError("wrong proof of the cluster secret (or of a node or tenant key)")
        server_proof = p.proof(used.key, used.server_role, client_nonce, nonce)
        p.speak(conn, version)  # the client's choice: ours, or an older one it speaks
        info = self.info() if used.kind != p.TENANT else self.info().model_copy(update=TENANT_HIDES)
        await send_frame(conn, Op.WELCOME, 0, server_proof + info.encode_for(version))
        return p.PeerIdentity(used.kind, name)

    def _credentials(self, name: str) -> list[p.Credential]:
        """What a peer calling itself ``name`` may have proved: the cluster secret, the node secret, its
        tenant's key."""
        known = [p.Credential(self.secret)]
        if self.node_secret is not None:
            known.append(p.Credential(self.node_secret, p.NODE))
        if name:
            known.append(p.Credential(tenant_key(self.secret, name), p.TENANT))
        return known

    async def _requests(self, conn: socket.socket, peer: p.PeerIdentity) -> None:
        session = Session(conn, self._side, self._paths)
        try:
            await self._serve_requests(session, peer)
        finally:
            await session.close()

    async def _serve_requests(self, session: Session, peer: p.PeerIdentity) -> None:
        conn = session.conn
        inbox = None
        if self.objects is not None and not isinstance(conn, ssl.SSLSocket):

            def fast(op: Op, flags: int, request: int, body: bytearray):
                return op in self.objects.ops and self.objects.fast(
                    conn, peer, op, flags, request, body, self._deadline
                )

            inbox = Inbox(conn, fast)  # small object requests answered by the reader callback
        while True:
            try:
                if inbox is None:
                    op, flags, request, body = await recv_frame(conn)
                else:
                    got = await inbox.next()
                    if callable(got):  # the rest of a request the callback began
                        op, request = None, 0
                    else:
                        op, flags, request, body = got
            except p.PeerClosedError:
                return  # the client hung up between requests: normal
            except p.ProtocolError as exc:
                log.warning("transfer server %s: bad frame from %s: %s", self.node_id, peer, exc)
                with contextlib.suppress(OSError, p.TransferError):
                    await send_frame(conn, Op.ERROR, 0, str(exc).encode())
                return
            try:
                if op is not None and peer.kind == p.TENANT and op not in TENANT_OPS:
                    raise p.Forbidden(f"{peer}'s key reaches its objects only, not {op.name}")
                if op is None:
                    assert callable(got)  # the rest of a request the callback began
                    await got()
                elif op is Op.READ:
                    await self._read(session, flags, request, body)
                elif op is Op.WRITE:
                    await self._write(session, flags, request, body)
                elif op is Op.DELETE:
                    await self._delete(session, request, body)
                elif op is Op.STAGE:
                    await self._stage(session, request, body)
                elif op is Op.SESSION:
                    await self._session(session, request, body)
                elif op in session.ops:
                    await session.ops[op].handle(op, flags, request, body)
                elif self.objects is not None and op in self.objects.ops:
                    await self.objects.handle(conn, peer, op, flags, request, body, self._deadline)
                else:
                    raise p.ProtocolError(f"{op.name} is not a request")
            except p.PeerClosedError as exc:
                log.info("transfer server %s: %s left mid-request: %s", self.node_id, peer, exc)
                return
            except (p.ProtocolError, p.Forbidden) as exc:
                if isinstance(exc, p.Forbidden):
                    self.forbidden += 1
                log.warning("transfer server %s: refused a request from %s: %s", self.node_id, peer, exc)
                with contextlib.suppress(OSError, p.TransferError):
                    await send_frame(conn, Op.ERROR, request, str(exc).encode())
                return

    # READ -----------------------------------------------------------------------------------------

    async def _read(self, session: Session, flags: int, request: int, body: bytearray) -> None:
        path = session.path(flags)
        items = p.decode_read(body)
        replies: list[ReplyItem] = []
        data = []
        leases: list[int] = []
        try:
            for key, expected in items:
                try:
                    view, lease = self._leased_block(key)
                    if view is None:  # only on disk: read (and maybe promote) it
                        view = await self.store.get(key)
                except (StoreError, ValueError, TypeError) as exc:
                    replies.append(ReplyItem(status_of(exc), message=str(exc)))
                    continue
                if lease is not None:
                    leases.append(lease)
                if view.size != expected:
                    replies.append(
                        ReplyItem(Status.LENGTH_MISMATCH, message=f"block is {view.size} bytes, {expected} were asked")
                    )
                    continue
                checksum = xxhash.xxh3_64_intdigest(view.data) if flags & p.FLAG_CHECKSUM else 0
                replies.append(ReplyItem(Status.OK, view.size, checksum, seal=self.store.seal_of(key)))
                data.append((len(replies) - 1, view))
            nbytes = sum(view.size for _, view in data)
            with self._deadline(nbytes):
                await path.send(request, flags, p.encode_read_reply(replies), data)
            self.served_bytes += nbytes
        finally:
            await self.store.release_leases(leases)

    def _deadline(self, nbytes: int) -> _Deadline:
        """``with self._deadline(n):`` a request's bytes must move within ``stall_timeout`` plus ``n`` at
        ``MIN_RATE``; the watchdog cancels a connection past it, and what the request held (reservations,
        leases) is given back by its caller's ``finally``. No timer per request: this is on every read."""
        return _Deadline(self._moving, time.monotonic() + self.stall_timeout + nbytes / MIN_RATE)

    async def _watchdog(self) -> None:
        """Drop the connections whose request's bytes stopped moving (``_deadline``)."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_timeout / 3))
            now = time.monotonic()
            for task, deadline in list(self._moving.items()):
                if now > deadline and not task.done():
                    self.stalled += 1
                    log.warning(
                        "transfer server %s: dropped a peer whose request's bytes stopped moving for %.1f s",
                        self.node_id,
                        self.stall_timeout,
                    )
                    task.cancel()

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

    # DELETE ---------------------------------------------------------------------------------------

    async def _delete(self, session: Session, request: int, body: bytearray) -> None:
        replies = []
        for key in p.decode_keys(body):
            try:
                await self.store.remove(key)
                replies.append(ReplyItem(Status.OK))
            except (StoreError, ValueError, TypeError) as exc:
                replies.append(ReplyItem(status_of(exc), message=str(exc)))
        await send_frame(session.conn, Op.DELETE_REPLY, request, p.encode_statuses(replies))

    # STAGE ----------------------------------------------------------------------------------------

    async def _stage(self, session: Session, request: int, body: bytearray) -> None:
        """Blocks a reader will ask for soon, from disk into memory (within the store's bound)."""
        errors = await self.store.stage(p.decode_keys(body))
        replies = [ReplyItem(Status.OK) if e is None else ReplyItem(status_of(e), message=str(e)) for e in errors]
        await send_frame(session.conn, Op.STAGE_REPLY, request, p.encode_statuses(replies))

    # SESSION --------------------------------------------------------------------------------------

    async def _session(self, session: Session, request: int, body: bytearray) -> None:
        """A conversation's state changed: the tiers' eviction policies are told, on this node's clock."""
        notice, keys = p.decode_session(body)
        self.store.on_session(session_event(notice, keys))
        await send_frame(session.conn, Op.SESSION_REPLY, request, p.encode_statuses([ReplyItem(Status.OK)]))

    # WRITE ----------------------------------------------------------------------------------------

    async def _write(self, session: Session, flags: int, request: int, body: bytearray) -> None:
        path = session.path(flags)
        items = p.decode_write(body)
        eager = bool(flags & p.FLAG_EAGER)
        if eager and not isinstance(path, StreamPath):
            raise p.ProtocolError("an eager write goes over the stream only")
        if eager and (total := sum(it.length for it in items)) > p.MAX_EAGER_BYTES:
            raise p.ProtocolError(f"an eager write of {total} bytes is over the limit of {p.MAX_EAGER_BYTES}")
        handles: list[PutHandle | None] = []
        ready: list[ReplyItem] = []
        try:
            for it in items:
                if it.length > self.max_block_bytes:
                    handles.append(None)
                    ready.append(
                        ReplyItem(
                            Status.LENGTH_MISMATCH,
                            message=f"{it.length} bytes is over this node's limit of {self.max_block_bytes}",
                        )
                    )
                    continue
                try:
                    handle = await self.store.put_start(
                        it.key, it.length, parent=it.parent, tenant=it.tenant, seal=it.seal, tier=path.write_tier()
                    )
                except (StoreError, ValueError, TypeError) as exc:
                    handles.append(None)
                    ready.append(ReplyItem(status_of(exc), message=str(exc)))
                    continue
                handles.append(handle)
                ready.append(ReplyItem(Status.OK, it.length, offset=path.write_offset(handle)))
            with self._deadline(sum(it.length for it, h in zip(items, handles) if h is not None or eager)):
                if eager:  # the data is on its way already: no WRITE_READY
                    assert isinstance(path, StreamPath)  # (checked above)
                    await path.receive_eager([it.length for it in items], handles)
                else:
                    await send_frame(session.conn, Op.WRITE_READY, request, p.encode_lease_reply(ready), flags)
                    await path.receive(request, [(i, h) for i, h in enumerate(handles) if h is not None])
            done: list[ReplyItem] = []
            for it, landed, reserved in zip(items, handles, ready):
                if landed is None:
                    done.append(
                        reserved if eager else ReplyItem(Status.BAD_REQUEST, message="refused before the data was sent")
                    )
                    continue
                if flags & p.FLAG_CHECKSUM and xxhash.xxh3_64_intdigest(host_bytes(landed.buffer).data) != it.checksum:
                    await self.store.revoke(landed)
                    done.append(ReplyItem(Status.CHECKSUM, message="checksum mismatch: the block was not stored"))
                    continue
                landed.note_written(it.length)
                try:
                    await self.store.commit(landed)
                    done.append(ReplyItem(Status.OK, it.length))
                except (StoreError, OSError) as exc:
                    done.append(ReplyItem(status_of(exc), message=str(exc)))
            await send_frame(session.conn, Op.WRITE_DONE, request, p.encode_statuses(done), flags)
        finally:
            for begun in handles:  # anything not committed is revoked: nothing half-written is visible
                if begun is not None and not begun.done:
                    await self.store.revoke(begun)


class _Deadline:
    """The current task's bytes must move by ``deadline`` (``time.monotonic``) while inside."""

    __slots__ = ("moving", "deadline", "task")

    def __init__(self, moving: dict[asyncio.Task, float], deadline: float) -> None:
        self.moving, self.deadline = moving, deadline

    def __enter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None  # entered in a task
        self.task = task
        self.moving[task] = self.deadline

    def __exit__(self, *exc: object) -> None:
        self.moving.pop(self.task, None)


def session_event(notice: p.SessionNotice, keys: Sequence[bytes], at: float | None = None) -> SessionEvent:
    """A worker's notice as the tiers' policies take it, timed by this process's monotonic clock."""
    return SessionEvent(
        notice.session,
        SessionState(notice.state),
        time.monotonic() if at is None else at,
        tuple(keys),
        notice.resume_in,
        notice.retain_s,
        notice.priority,
        notice.tenant,
    )
