"""Transports: one small interface, one plug-in per substrate.

A transport moves a batch of blocks between this process and one peer: ``read`` fills local
destination buffers from the peer's blocks, ``write`` stores local source buffers as blocks on the
peer. It reports a per-item error (or None) and never returns bytes that failed a check. The engine
picks, per peer, the first transport in its preference order whose ``usable`` says yes. A transport
whose bytes take their own path into the peer's transfer server also declares that path's server
half (``server_path``, see ``paths.py``). Adding a transport means registering it in
``tiercake.plugins.TRANSPORTS``, and no caller and no server code changes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tiercake.tiers import PoolRegion, StoreError, TieredStore
from tiercake.tiers.buffers import copy_async, copy_into, device_staging, host_bytes, on_host, size_of

from . import protocol as p
from .connection import PeerChannel, item_error
from .paths import DataPath, ShmPath, StreamPath
from .protocol import Status

Results = list[BaseException | None]


@dataclass(slots=True)
class ReadReq:
    key: bytes
    dst: Any  # flat uint8 (``buffers.as_bytes``), exactly the block's size
    seal: bytes = b""  # filled in by the transport: the seal the holder keeps with the block


@dataclass(slots=True)
class WriteReq:
    key: bytes
    src: Any  # flat uint8 (``buffers.as_bytes``)
    parent: bytes | None = None
    tenant: str = ""
    seal: bytes = b""  # kept with the block by the holder

    def item(self, length: int = 0) -> p.WriteItem:
        """Its entry in a WRITE table."""
        return p.WriteItem(self.key, length, self.parent, tenant=self.tenant, seal=self.seal)


@dataclass(slots=True)
class Peer:
    """What a transport knows of the other side."""

    node_id: str
    channel: PeerChannel | None  # None for this process itself
    info: p.PeerInfo | None

    @property
    def remote(self) -> PeerChannel:
        """The channel to a peer in another process (a transport that uses it checked there is one)."""
        if self.channel is None:
            raise p.TransferError(f"{self.node_id} is this process: there is no channel to it")
        return self.channel


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What an engine gives each of its transports: its node's store, and whether to checksum."""

    store: TieredStore | None = None
    checksum: bool = False


class Transport(ABC):
    """A substrate between this process and a peer. A new one is a subclass plus one registration in
    ``tiercake.plugins.TRANSPORTS`` (or an entry point in ``tiercake.transports``); engines then take
    it by name from their preference list."""

    name: ClassVar[str]
    server_path: ClassVar[type[DataPath] | None] = None  # its half in the transfer server, if it has one

    def __init__(self, checksum: bool = False) -> None:
        self.checksum = checksum

    @classmethod
    def create(cls, context: TransportContext) -> Transport:
        """The transport for one engine."""
        return cls(checksum=context.checksum)

    @classmethod
    @abstractmethod
    def usable(cls, peer: Peer, local_node: str) -> bool:
        """Whether this transport can reach ``peer`` from here."""

    @abstractmethod
    async def read(self, peer: Peer, items: list[ReadReq]) -> Results:
        """Fill each item's ``dst`` with its block and set its ``seal`` to the one the peer keeps
        with it (a reader of KV refuses a block without a seal that verifies); an error per item."""

    @abstractmethod
    async def write(self, peer: Peer, items: list[WriteReq]) -> Results:
        """Store each item's ``src`` as a block on the peer, in order, with its parent, tenant and
        seal (``WriteReq.item`` is its WRITE table entry); an error per item."""

    async def close(self) -> None:
        pass


def _host(t: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """A host array to receive into; for device memory, a staging buffer to copy over after."""
    if on_host(t):
        return t, None
    staging = device_staging(size_of(t))
    return staging, staging


class LocalTransport(Transport):
    """Same process: the local store's own get and put (memcpy / ``Tensor.copy_``)."""

    name = "local"

    @classmethod
    def create(cls, context: TransportContext) -> LocalTransport:
        return cls(context.store)

    def __init__(self, store: TieredStore | None) -> None:
        super().__init__()  # no checksum: nothing crosses a wire
        self.store = store

    @classmethod
    def usable(cls, peer: Peer, local_node: str) -> bool:
        return peer.node_id == local_node

    def _need_store(self) -> TieredStore:
        if self.store is None:
            raise p.ItemError("this engine has no local store", Status.NOT_FOUND)
        return self.store

    async def read(self, peer: Peer, items: list[ReadReq]) -> Results:
        store = self._need_store()
        results = [_error_of(r) for r in await store.get_many([(it.key, it.dst) for it in items])]
        for it in items:
            it.seal = store.seal_of(it.key)
        return results

    async def write(self, peer: Peer, items: list[WriteReq]) -> Results:
        store = self._need_store()
        done: Results = []
        for it in items:  # in order: a chain's parents go first
            try:
                await store.put(it.key, it.src, parent=it.parent, tenant=it.tenant, seal=it.seal)
                done.append(None)
            except (StoreError, ValueError, TypeError) as exc:
                done.append(exc)
        return done


def _error_of(result: object) -> BaseException | None:
    return result if isinstance(result, BaseException) else None


def _split(items: list, streams: int, size) -> list[list]:
    """Contiguous runs of about equal bytes, one per stream (order within a run is kept)."""
    if streams <= 1 or len(items) <= 1:
        return [items]
    total = sum(size(it) for it in items)
    runs: list[list] = []
    current: list = []
    acc = 0
    target = total / min(streams, len(items))
    for it in items:
        current.append(it)
        acc += size(it)
        if acc >= target * (len(runs) + 1) and len(runs) < streams - 1:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


class TcpTransport(Transport):
    """Between nodes: the batch is split over the peer's connections, each one ``sendmsg`` of the
    whole run out and one ``recvmsg_into`` straight into the destinations."""

    name = "tcp"
    server_path: ClassVar[type[DataPath] | None] = StreamPath

    @classmethod
    def usable(cls, peer: Peer, local_node: str) -> bool:
        return peer.channel is not None

    async def _run(self, peer: Peer, runs: list[list], op) -> Results:
        async def one(run: list) -> Results:
            try:
                async with peer.remote.connection() as conn:
                    return await op(conn, run)
            except p.TransferError as exc:
                return [exc] * len(run)
            except OSError as exc:
                return [p.PeerClosedError(f"{peer.node_id}: {exc}")] * len(run)
            except (StoreError, ValueError) as exc:  # e.g. a pool offset from the peer outside the pool
                return [p.ItemError(f"{peer.node_id}: {exc}", Status.BAD_REQUEST)] * len(run)

        if len(runs) == 1:
            return await one(runs[0])
        out: Results = []
        for part in await asyncio.gather(*(one(run) for run in runs)):
            out.extend(part)
        return out

    async def read(self, peer: Peer, items: list[ReadReq]) -> Results:
        staged = [_host(it.dst) for it in items]

        async def op(conn, run):
            errors, seals = await conn.read([(items[i].key, staged[i][0]) for i in run], self.checksum)
            for i, seal in zip(run, seals):
                items[i].seal = seal
            return errors

        runs = _split(list(range(len(items))), peer.remote.streams, lambda i: size_of(items[i].dst))
        results = await self._run(peer, runs, op)
        for it, (_, staging), err in zip(items, staged, results):
            if staging is not None and err is None:
                copy_into(it.dst, staging)
        return results

    async def write(self, peer: Peer, items: list[WriteReq]) -> Results:
        async def op(conn, run):
            return await conn.write([(items[i].item(), host_bytes(items[i].src)) for i in run], self.checksum)

        # one stream: a chain's blocks must commit in order on the peer
        return await self._run(peer, [list(range(len(items)))], op)


@dataclass(slots=True)
class PoolLease:
    """Blocks of a same-host peer held in its shared pool under a lease, to be read in place: each
    key's ``(offset, length, seal)`` in ``region`` (its data space), or why it is not leased
    (``NOT_IN_MEMORY``: only on the peer's disk; read it over the stream). Give it back with
    ``ShmTransport.release``: until then the peer neither frees nor moves those bytes (at most
    ``ShmTransport.lease_ttl``)."""

    region: PoolRegion
    blocks: list[tuple[int, int, bytes] | BaseException]
    held: list[tuple[bytes, int]]  # (key, lease id) of every leased block


class ShmTransport(TcpTransport):
    """Another process on the same host: control over the peer's stream, bytes through the shared
    pool mapped here, copied in place (memcpy speed). Blocks that are only on the peer's disk are
    read over the stream instead, and so are reads too small to repay the lease and its release."""

    name = "shm"
    server_path = ShmPath
    lease_ttl = 30.0
    # A read of fewer bytes goes over the stream: below it, the lease's extra frame and the wake-up it
    # causes cost more than the two copies through the socket (crossover measured between 512 KiB and
    # 1 MiB, docs/BENCHMARKS.md). Writes up to MAX_EAGER_BYTES go over the stream too: an eager write
    # is one round trip, a write into the pool two.
    stream_below_bytes = 1 << 20

    def __init__(self, checksum: bool = False) -> None:
        super().__init__(checksum)
        self._regions: dict[str, PoolRegion] = {}

    @classmethod
    def usable(cls, peer: Peer, local_node: str) -> bool:
        info = peer.info
        return (
            peer.channel is not None
            and info is not None
            and info.pool_path is not None
            and info.boot_id == p.boot_id()
            and peer.channel.version >= p.POOL_FORMAT_SINCE
        )

    def region(self, info: p.PeerInfo | None) -> PoolRegion:
        """The peer's pool, mapped here, as the connection's WELCOME describes it: a node agent that
        restarted has a new region (maybe at the same path), and the old mapping must not be used."""
        if info is None or info.pool_path is None:
            raise p.ItemError("the peer announced no pool to read in place", Status.BAD_REQUEST)
        region = self._regions.get(info.node_id)
        if region is not None and region.instance != info.pool_id:
            region.close(unlink=False)
            region = None
        if region is None:
            region = PoolRegion.attach(info.pool_path)
            if region.instance != info.pool_id:
                region.close(unlink=False)
                raise p.ItemError(
                    f"{info.node_id}: its pool at {info.pool_path} is not the one it announced", Status.BAD_REQUEST
                )
            self._regions[info.node_id] = region
        return region

    async def read(self, peer: Peer, items: list[ReadReq]) -> Results:
        if sum(size_of(it.dst) for it in items) < self.stream_below_bytes:
            return await super().read(peer, items)
        results: Results = [None] * len(items)
        over_stream: list[int] = []

        async def in_place(conn, run) -> Results:
            region = self.region(conn.info)
            replies = await conn.lease([(it.key, size_of(it.dst), self.lease_ttl) for it in items])
            held = []
            try:
                for i, (it, reply) in enumerate(zip(items, replies)):
                    if reply.status is Status.OK:
                        held.append((it.key, reply.lease))
                        it.seal = reply.seal
                        await copy_async(it.dst, region.view(reply.offset, reply.length))  # bounds-checked
                    elif reply.status is Status.NOT_IN_MEMORY:
                        over_stream.append(i)
                    else:
                        results[i] = item_error(reply, peer.node_id)
            finally:
                if held:
                    await conn.release(held)
            return results

        results = await self._run(peer, [list(range(len(items)))], in_place)
        if over_stream:  # only on the peer's disk: read those over the stream
            streamed = await super().read(peer, [items[i] for i in over_stream])
            for i, err in zip(over_stream, streamed):
                results[i] = err
        return results

    async def lease(self, peer: Peer, keys: list[bytes], length: int) -> PoolLease:
        """Lease ``keys`` (each ``length`` bytes) in the peer's pool for reading in place, in one round
        trip (see ``PoolLease``). A failure of the whole batch raises (``TransferError``, ``OSError``)."""
        async with peer.remote.connection() as conn:
            region = self.region(conn.info)
            replies = await conn.lease([(key, length, self.lease_ttl) for key in keys])
        blocks: list[tuple[int, int, bytes] | BaseException] = []
        held = []
        for key, reply in zip(keys, replies):
            if reply.status is Status.OK:
                held.append((key, reply.lease))
                region.host_array(reply.offset, reply.length)  # bounds-checked: PayloadError if outside
                blocks.append((reply.offset, reply.length, reply.seal))
            else:
                blocks.append(item_error(reply, peer.node_id))
        return PoolLease(region, blocks, held)

    async def release(self, peer: Peer, lease: PoolLease) -> None:
        """Give ``lease``'s blocks back to the peer (nothing comes back: one frame)."""
        if lease.held:
            async with peer.remote.connection() as conn:
                await conn.release(lease.held)

    async def write(self, peer: Peer, items: list[WriteReq]) -> Results:
        if sum(size_of(it.src) for it in items) <= p.MAX_EAGER_BYTES:  # one round trip over the stream
            return await super().write(peer, items)

        async def op(conn, run):
            region = self.region(conn.info)

            def copy_into_pool(offset: int, src: np.ndarray) -> None:
                np.copyto(region.view(offset, src.size), src)  # the caller runs it off the loop

            return await conn.write(
                [(items[i].item(), host_bytes(items[i].src)) for i in run], self.checksum, copy_into_pool
            )

        return await self._run(peer, [list(range(len(items)))], op)

    async def close(self) -> None:
        for region in self._regions.values():
            region.close(unlink=False)
        self._regions.clear()
