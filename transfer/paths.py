"""The server's half of each transport: the data path a request's bulk bytes take.

The transfer server owns everything about a request but its bytes: the tables, the store's leases
and two-phase puts, checksums and statuses. A data path moves the bytes of one READ or WRITE on one
authenticated connection, and may answer request ops of its own (a handshake, leases). A request
names its path by one flag bit (``DataPath.flag``; the stream itself is 0). A transport declares
its server half as ``Transport.server_path``; the server builds its table of paths from the
transport registry, so a new substrate is a client class and a server class, and no server code
changes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tiercake.plugins import TRANSPORTS, PluginNotFoundError
from tiercake.tiers import ObjectNotFoundError, TieredStore
from tiercake.tiers.buffers import copy_into, device_staging
from tiercake.tiers.store import PutHandle

from . import protocol as p
from .protocol import Op, ReplyItem, Status
from .sockio import recv_frame, recv_into_all, send_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerSide:
    """What a data path may use of its server."""

    store: TieredStore
    node_id: str
    pool_tier: str | None  # the shared pool, when this node has one
    ucx: bool  # whether this server speaks UCX
    secret: bytes = b""  # the cluster secret, for what a path must authenticate beyond the handshake


Bulk = list[tuple[int, np.ndarray]]  # (item index in the table, its bytes)


class DataPath(ABC):
    """How the bulk bytes of one request travel; one instance per connection and path.

    Contract: ``send`` sends the READ_REPLY ``table`` and then the bytes of ``data`` (the server
    holds the blocks' leases until it returns); ``receive`` lands the bytes of each accepted WRITE
    item in its reserved slot before returning (the server then checks and commits them) and
    raises ``PeerClosedError`` if the peer leaves. Neither may keep a reference to a slot or a
    view after it returns."""

    flag: ClassVar[int]  # the request flag bit that selects this path (0: the stream)
    ops: ClassVar[tuple[Op, ...]] = ()  # request ops this path answers itself

    def __init__(self, server: ServerSide, conn: socket.socket) -> None:
        self.server = server
        self.conn = conn

    @classmethod
    def enabled(cls, server: ServerSide) -> bool:
        """Whether a server like this one offers the path at all."""
        return True

    def write_tier(self) -> str | None:
        """The tier to reserve written blocks in (None: the store's choice)."""
        return None

    def write_offset(self, handle: PutHandle) -> int:
        """What WRITE_READY tells the peer about an accepted item's slot."""
        return 0

    def check(self) -> None:
        """Raise ProtocolError when this connection cannot use the path yet (before any reply)."""

    async def send(self, request: int, flags: int, table: bytes, data: Bulk) -> None:
        raise p.ProtocolError(f"{type(self).__name__} does not carry reads")

    async def receive(self, request: int, accepted: list[tuple[int, PutHandle]]) -> None:
        raise p.ProtocolError(f"{type(self).__name__} does not carry writes")

    async def handle(self, op: Op, flags: int, request: int, body: bytearray) -> None:
        """Answer one of ``ops``."""
        raise p.ProtocolError(f"{op.name} is not a request")

    async def close(self) -> None:
        pass


class StreamPath(DataPath):
    """The bytes follow the tables on the same TCP stream: one ``sendmsg`` out, ``recvmsg_into``
    straight into the reserved slots."""

    flag = 0

    async def send(self, request: int, flags: int, table: bytes, data: Bulk) -> None:
        await send_frame(self.conn, Op.READ_REPLY, request, table, flags, [view for _, view in data])

    async def receive(self, request: int, accepted: list[tuple[int, PutHandle]]) -> None:
        targets, staged = receive_targets([h for _, h in accepted])
        await recv_into_all(self.conn, targets)
        for handle, host in staged:
            copy_into(handle.buffer, host)

    async def receive_eager(self, lengths: list[int], handles: list[PutHandle | None]) -> None:
        """An eager write's data: every item's bytes in order, into its slot, or, for an item that was
        refused, into one scratch buffer that is dropped."""
        targets, staged = receive_targets([h for h in handles if h is not None])
        accepted = iter(targets)
        scratch = memoryview(bytearray(max([n for n, h in zip(lengths, handles) if h is None], default=0)))
        await recv_into_all(
            self.conn, [next(accepted) if h is not None else scratch[:n] for n, h in zip(lengths, handles)]
        )
        for handle, host in staged:
            copy_into(handle.buffer, host)


class ShmPath(DataPath):
    """Same host: a writer copies into the shared pool at the offsets reserved for it and says
    WRITE_COMMIT; a reader LEASEs blocks, copies them out of the pool in place and RELEASEs them."""

    flag = p.FLAG_SHM
    ops = (Op.LEASE, Op.RELEASE)

    def write_tier(self) -> str | None:
        return self.server.pool_tier

    def check(self) -> None:
        if self.server.pool_tier is None:
            raise p.ProtocolError("this node has no shared pool to write into")

    def write_offset(self, handle: PutHandle) -> int:
        return handle.copy.slot[0]

    async def receive(self, request: int, accepted: list[tuple[int, PutHandle]]) -> None:
        await recv_frame(self.conn, expect=[Op.WRITE_COMMIT])  # the peer copied into the pool

    async def handle(self, op: Op, flags: int, request: int, body: bytearray) -> None:
        if op is Op.LEASE:
            replies = [self._lease(key, expected, ttl) for key, expected, ttl in p.decode_lease(body)]
            refused = [r.lease for r in replies if r.status is Status.LENGTH_MISMATCH and r.lease]
            for r in replies:
                if r.status is Status.LENGTH_MISMATCH:
                    r.lease = 0
            if refused:
                await self.server.store.release_leases(refused)
            await send_frame(self.conn, Op.LEASE_REPLY, request, p.encode_lease_reply(replies), flags)
        else:
            for key, lease in p.decode_release(body):
                await self.server.store.release_lease(key, lease)
            if not flags & p.FLAG_NO_REPLY:
                await send_frame(self.conn, Op.RELEASE_REPLY, request, b"", flags)

    def _lease(self, key: bytes, expected: int, ttl: float) -> ReplyItem:
        """One key's lease (no await: a batch of 64 is on every same-host load). A refused length keeps
        its lease id in the reply for the caller to end."""
        store, pool = self.server.store, self.server.pool_tier
        if pool is None:
            return ReplyItem(Status.NOT_IN_MEMORY, message="no shared pool on this node")
        try:
            lease = store.acquire_lease(key, min(max(ttl, 0.001), 600.0), tier=pool)
        except ObjectNotFoundError as exc:
            return ReplyItem(Status.NOT_IN_MEMORY if store.contains(key) else Status.NOT_FOUND, message=str(exc))
        if lease.nbytes != expected:
            return ReplyItem(
                Status.LENGTH_MISMATCH, message=f"block is {lease.nbytes} bytes, {expected} were asked", lease=lease.id
            )
        return ReplyItem(Status.OK, expected, offset=lease.slot[0], lease=lease.id, seal=store.seal_of(key))


def receive_targets(handles: list[PutHandle]) -> tuple[list[np.ndarray], list[tuple[PutHandle, np.ndarray]]]:
    """Where each accepted item's bytes land in place: its reserved slot, or, for a device tier, a
    host staging buffer copied over afterwards (the second list)."""
    staged: list[tuple[PutHandle, np.ndarray]] = []
    targets = []
    for handle in handles:
        target = handle.host_target()
        if target is None:
            target = device_staging(handle.entry.nbytes)
            staged.append((handle, target))
        targets.append(target)
    return targets, staged


def registered_paths() -> dict[int, type[DataPath]]:
    """Every data path the registered transports declare, by flag. Two paths on one flag, or a flag
    that is not a single free bit, is a configuration error."""
    paths: dict[int, type[DataPath]] = {0: StreamPath}
    for name in TRANSPORTS.names():
        try:
            transport = TRANSPORTS.resolve(name)
        except (PluginNotFoundError, ImportError, AttributeError) as exc:
            log.warning("transport %r cannot be loaded, its data path is not served: %s", name, exc)
            continue
        path = getattr(transport, "server_path", None)
        if path is None or path is StreamPath:
            continue
        flag = path.flag
        if flag <= 0 or flag & (flag - 1) or flag & p.MODIFIER_FLAGS:
            raise ValueError(
                f"transport {name!r}: data path flag {flag:#x} must be one bit other than "
                f"the protocol's modifiers ({p.MODIFIER_FLAGS:#x})"
            )
        other = paths.get(flag)
        if other is not None and other is not path:
            raise ValueError(
                f"transports declare two data paths on flag {flag:#x}: {other.__name__} and {path.__name__}"
            )
        paths[flag] = path
    return paths


class Session:
    """One authenticated connection and the data paths it may use."""

    def __init__(self, conn: socket.socket, server: ServerSide, paths: dict[int, type[DataPath]]) -> None:
        self.conn = conn
        self.paths = {flag: cls(server, conn) for flag, cls in paths.items() if cls.enabled(server)}
        self.ops = {op: path for path in self.paths.values() for op in path.ops}

    def path(self, flags: int) -> DataPath:
        """The path a request's flags select, ready to use."""
        bits = flags & ~p.MODIFIER_FLAGS
        path = self.paths.get(bits)
        if path is None:
            raise p.ProtocolError(f"this node has no data path for request flags {bits:#x}")
        path.check()
        return path

    async def close(self) -> None:
        await asyncio.gather(*(path.close() for path in self.paths.values()), return_exceptions=True)
