"""The transfer engine: submit a batch of transfers, await it, get a status per item.

A transfer moves ``length`` bytes from a source location to a destination location. A location is
either a block in some node's store (``BlockLoc``: node and key) or memory in this process
(``BufferLoc``: a tensor and an offset). Per pair of endpoints the engine picks a transport
(``transports.py``): the local store for this node, the shared pool for another process on the same
host, TCP between hosts. Writes into a store go through its two-phase put, so a block becomes
visible only when it is whole; on a timeout or cancellation nothing half-written is ever visible.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercake.plugins import TRANSPORTS
from tiercake.tiers import ObjectExistsError, PoolRegion, StoreError, TieredStore
from tiercake.tiers.buffers import INLINE_COPY_MAX, as_bytes, copy_into, host_bytes, size_of

from . import protocol as p
from .connection import PeerAddress, PeerChannel
from .protocol import Status
from .server import session_event
from .transports import Peer, PoolLease, ReadReq, ShmTransport, Transport, TransportContext, WriteReq

PROBE_KEY = bytes(32)  # asked for by answers(): no content hashes to it


@dataclass(frozen=True, slots=True)
class BlockLoc:
    """A block in ``node``'s store. ``parent`` (its chain parent), ``tenant`` and ``seal`` are used
    when it is written from a buffer (a block pulled from another node keeps the seal it had)."""

    node: str
    key: bytes
    parent: bytes | None = None
    tenant: str = ""
    seal: bytes = b""


@dataclass(frozen=True, slots=True)
class BufferLoc:
    """``length`` bytes at byte ``offset`` of a buffer in this process: an ndarray or a buffer (host
    memory), or a torch tensor (host or device memory)."""

    tensor: Any
    offset: int = 0


@dataclass(slots=True)
class Transfer:
    src: BlockLoc | BufferLoc
    dst: BlockLoc | BufferLoc
    length: int


@dataclass(slots=True)
class TransferResult:
    ok: bool
    transport: str = ""
    error: BaseException | None = None
    nbytes: int = 0
    seal: bytes = b""  # a read or a pull: the seal the source keeps with the block (check it before use)

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error

    @property
    def exists(self) -> bool:
        """Failed only because the destination already holds the block (a write that was not needed)."""
        return isinstance(self.error, ObjectExistsError) or getattr(self.error, "status", None) == Status.EXISTS


@dataclass(slots=True)
class _Group:
    reads: list[tuple[int, ReadReq]] = field(default_factory=list)
    writes: list[tuple[int, WriteReq]] = field(default_factory=list)


def unreachable(results: list[TransferResult]) -> bool:
    """Every item failed because the peer could not be reached, hung up or did not answer in time
    (not because of a block): the peer may have moved (a restarted node agent listens elsewhere)."""
    return bool(results) and all(isinstance(r.error, (p.PeerClosedError, OSError)) for r in results)


class TransferEngine:
    # A deadline follows what a batch should take: a peer that stalls (stopped, partitioned, its disk
    # hung) is given up on in about a second, not after a fixed 30 s that holds a prefill and its
    # gpu blocks meanwhile; the caller recomputes or retries.
    ASSUMED_RATE = 200e6  # before any batch was measured: far below every transport here
    MIN_RATE = 50e6
    DEADLINE_FLOOR_S = 1.0  # connection setup and round trips, whatever the size
    DEADLINE_SLACK = 4.0
    DEADLINE_CEILING_S = 30.0

    def __init__(
        self,
        node_id: str,
        secret: bytes,
        store: TieredStore | None = None,
        *,
        transports: tuple[str, ...] = ("local", "shm", "tcp"),
        streams: int = 2,
        checksum: bool = False,
        buffer_bytes: int | None = None,
        connect_timeout: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: a client context (``transfer_tls_client``): every connection to a peer is TLS, its
        certificate checked against it (peers must serve TLS then)."""
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown:
            raise ValueError(f"unknown transports {unknown}; known: {TRANSPORTS.names()}")
        self.node_id = node_id
        self.secret = secret
        self.store = store
        self.streams = streams
        self.buffer_bytes = buffer_bytes
        self.connect_timeout = connect_timeout
        self.tls = tls
        self._order = transports
        self._transports: dict[str, Transport] = {
            name: _transport_class(name).create(TransportContext(store, checksum)) for name in transports
        }
        self._channels: dict[str, PeerChannel] = {}
        self.bytes_moved: dict[str, int] = defaultdict(int)
        self.rate = self.ASSUMED_RATE  # bytes/s of recent batches (EWMA), for deadlines

    def deadline_for(self, nbytes: int) -> float:
        """Seconds a batch of ``nbytes`` may take before it is given up on: the floor plus a slack
        times its expected time at the measured rate, at most the ceiling."""
        return min(self.DEADLINE_CEILING_S, self.DEADLINE_FLOOR_S + self.DEADLINE_SLACK * nbytes / self.rate)

    def _measured(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:  # smaller batches measure latency, not rate
            self.rate = max(self.MIN_RATE, 0.7 * self.rate + 0.3 * nbytes / seconds)

    def add_peer(self, node_id: str, host: str, port: int) -> None:
        old = self._channels.pop(node_id, None)
        if old is not None:
            old.close()
        self._channels[node_id] = PeerChannel(
            PeerAddress(node_id, host, port),
            self.secret,
            self.node_id,
            self.streams,
            self.buffer_bytes,
            self.connect_timeout,
            self.tls,
        )

    @property
    def peers(self) -> set[str]:
        return set(self._channels)

    def address(self, node_id: str) -> tuple[str, int] | None:
        """Where this engine reaches ``node_id`` (None: an unknown peer)."""
        channel = self._channels.get(node_id)
        return None if channel is None else (channel.address.host, channel.address.port)

    def ensure_peer(self, node_id: str, host: str, port: int) -> None:
        """``add_peer`` unless the peer is already known at that address (keeps its connections)."""
        channel = self._channels.get(node_id)
        if channel is None or (channel.address.host, channel.address.port) != (host, port):
            self.add_peer(node_id, host, port)

    async def _peer(self, node: str) -> Peer:
        if node == self.node_id:
            return Peer(node, None, None)
        channel = self._channels.get(node)
        if channel is None:
            raise p.ItemError(f"unknown node {node!r}: add it with add_peer()", Status.NOT_FOUND)
        return Peer(node, channel, await channel.peer_info())

    def transport_for(self, peer: Peer) -> Transport:
        for name in self._order:
            transport = self._transports[name]
            if type(transport).usable(peer, self.node_id):
                return transport
        raise p.ItemError(f"no transport reaches {peer.node_id} (enabled: {', '.join(self._order)})")

    async def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        for transport in self._transports.values():
            await transport.close()

    # The batch API --------------------------------------------------------------------------------

    async def transfer(
        self,
        batch: list[Transfer],
        timeout: float | None = None,
        verify: Callable[[bytes, object, bytes], bool] | None = None,
    ) -> list[TransferResult]:
        """Run a batch; one result per item, in order. Items fail alone, with a typed error; on a
        timeout, every unfinished item reports ``TimeoutError``. ``verify(key, host bytes, seal)``
        checks each block pulled into this node's store before it is committed: one it refuses is
        not stored and fails with ``SealError``."""
        results = [TransferResult(False) for _ in batch]
        groups: dict[str, _Group] = defaultdict(_Group)
        pulls: list[tuple[int, BlockLoc, BlockLoc]] = []
        for i, item in enumerate(batch):
            try:
                self._plan(i, item, groups, pulls, results)
            except (p.TransferError, StoreError, ValueError, TypeError) as exc:
                results[i].error = exc
        by_node: dict[str, list] = defaultdict(list)
        for i, src, dst in pulls:
            by_node[src.node].append((i, src, dst, batch[i].length))
        jobs = [self._pull(items, results, verify) for items in by_node.values()]
        return await self._execute(groups, results, timeout, jobs)

    async def _execute(
        self, groups: dict[str, _Group], results: list[TransferResult], timeout: float | None, jobs: list | None = None
    ) -> list[TransferResult]:
        jobs = [self._run_group(node, group, results) for node, group in groups.items()] + (jobs or [])
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                if len(jobs) == 1:
                    await jobs[0]  # the common case: no task to create and schedule
                else:
                    await asyncio.gather(*jobs)
        except TimeoutError:
            for result in results:
                if not result.ok and result.error is None:
                    result.error = TimeoutError(f"transfer did not finish within {timeout:.2f} s")
        else:
            self._measured(sum(r.nbytes for r in results if r.ok), time.perf_counter() - started)
        return results

    def _plan(self, i, item: Transfer, groups, pulls, results) -> None:
        if item.length <= 0:
            raise ValueError(f"item {i}: length must be positive, got {item.length}")
        src, dst = item.src, item.dst
        if isinstance(src, BufferLoc) and isinstance(dst, BufferLoc):
            copy_into(_slice(dst, item.length), _slice(src, item.length))
            results[i] = TransferResult(True, "local", nbytes=item.length)
        elif isinstance(src, BlockLoc) and isinstance(dst, BufferLoc):
            groups[src.node].reads.append((i, ReadReq(src.key, _slice(dst, item.length))))
        elif isinstance(src, BufferLoc) and isinstance(dst, BlockLoc):
            groups[dst.node].writes.append(
                (i, WriteReq(dst.key, _slice(src, item.length), dst.parent, dst.tenant, dst.seal))
            )
        elif isinstance(src, BlockLoc) and isinstance(dst, BlockLoc) and dst.node == self.node_id != src.node:
            pulls.append((i, src, dst))
        else:
            raise ValueError(
                f"item {i}: unsupported transfer {type(src).__name__}({getattr(src, 'node', '')}) -> "
                f"{type(dst).__name__}({getattr(dst, 'node', '')}); a block moves between this "
                "process and one node, or from a node into this node's store"
            )

    async def _run_group(self, node: str, group: _Group, results: list[TransferResult]) -> None:
        try:
            peer = await self._peer(node)
            transport = self.transport_for(peer)
        except (p.TransferError, OSError) as exc:
            for i, _ in group.reads + group.writes:
                results[i].error = exc
            return
        if group.reads:
            done = await transport.read(peer, [req for _, req in group.reads])
            for (i, read), err in zip(group.reads, done):
                results[i] = self._moved(transport.name, err, size_of(read.dst), read.seal)
        if group.writes:
            done = await transport.write(peer, [req for _, req in group.writes])
            for (i, write), err in zip(group.writes, done):
                results[i] = self._moved(transport.name, err, size_of(write.src), b"")

    def _moved(self, transport: str, err: BaseException | None, nbytes: int, seal: bytes) -> TransferResult:
        """One item's result, its bytes counted when it moved."""
        if err is not None:
            return TransferResult(False, transport, err)
        self.bytes_moved[transport] += nbytes
        return TransferResult(True, transport, None, nbytes, seal)

    async def _pull(self, items: list[tuple[int, BlockLoc, BlockLoc, int]], results, verify=None) -> None:
        """Blocks from one other node into this node's store: reserve a slot for each, read them all in
        one batch straight into the slots, commit each that arrived whole (and that ``verify`` passes)."""
        if self.store is None:
            for i, *_ in items:
                results[i].error = p.ItemError("this engine has no local store to pull into", Status.NOT_FOUND)
            return
        handles = []
        try:
            for i, _, dst, length in items:
                try:
                    handles.append(
                        (i, length, await self.store.put_start(dst.key, length, parent=dst.parent, tenant=dst.tenant))
                    )
                except (StoreError, ValueError, TypeError) as exc:
                    results[i].error = exc
            if not handles:
                return
            try:
                peer = await self._peer(items[0][1].node)
                transport = self.transport_for(peer)
                keys = {i: src.key for i, src, _, _ in items}
                reads = [ReadReq(keys[i], handle.buffer) for i, _, handle in handles]
                done = await transport.read(peer, reads)
            except (p.TransferError, OSError) as exc:
                for i, _, _ in handles:
                    results[i].error = exc
                return
            if verify is not None:
                done = await _verified(verify, reads, done)
            for (i, length, handle), req, err in zip(handles, reads, done):
                if err is not None:
                    results[i].error = err
                    continue
                try:
                    handle.note_written(length)
                    handle.set_seal(req.seal)  # the copy keeps the source's seal: a later reader checks it too
                    await self.store.commit(handle)
                    results[i] = TransferResult(True, transport.name, nbytes=length, seal=req.seal)
                    self.bytes_moved[transport.name] += length
                except StoreError as exc:
                    results[i].error = exc
        finally:
            for _, _, handle in handles:
                if not handle.done:
                    await self.store.revoke(handle)

    # Conveniences ---------------------------------------------------------------------------------

    # The two common batches skip the general planning: each whole destination (or source) buffer
    # is one block of ``node``.

    async def read_blocks(
        self, node: str, keys: list[bytes], dsts: list, timeout: float | None = None
    ) -> list[TransferResult]:
        """Read each key of ``node`` into the buffer beside it (exactly the block's size)."""
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys for {len(dsts)} buffers")
        group = _Group(reads=[(i, ReadReq(k, as_bytes(d))) for i, (k, d) in enumerate(zip(keys, dsts))])
        return await self._execute({node: group}, [TransferResult(False) for _ in keys], timeout)

    async def write_blocks(
        self,
        node: str,
        keys: list[bytes],
        srcs: list,
        *,
        chain: bool = False,
        tenant: str = "",
        seals: list[bytes] | None = None,
        timeout: float | None = None,
    ) -> list[TransferResult]:
        """Store each buffer as the block of the key beside it on ``node`` (``chain``: each block's
        parent is the previous key; ``seals``: each block's seal, kept with it)."""
        if len(keys) != len(srcs) or (seals is not None and len(seals) != len(keys)):
            raise ValueError(
                f"{len(keys)} keys for {len(srcs)} buffers" + ("" if seals is None else f" and {len(seals)} seals")
            )
        writes = [
            (
                i,
                WriteReq(
                    k, as_bytes(s), keys[i - 1] if chain and i else None, tenant, b"" if seals is None else seals[i]
                ),
            )
            for i, (k, s) in enumerate(zip(keys, srcs))
        ]
        return await self._execute({node: _Group(writes=writes)}, [TransferResult(False) for _ in keys], timeout)

    async def lease_blocks(self, node: str, keys: list[bytes], length: int, timeout: float) -> PoolLease | None:
        """``keys`` of ``node`` (each ``length`` bytes) leased in its shared pool for reading in place,
        or None when ``node`` is not a peer on this host whose pool this process can map (read them
        with ``read_blocks`` then). Give the lease back with ``release_blocks``."""
        peer = await self._peer(node)
        transport = self.transport_for(peer)
        if not isinstance(transport, ShmTransport):
            return None
        async with asyncio.timeout(timeout):
            return await transport.lease(peer, keys, length)

    async def pool_region(self, node: str) -> PoolRegion | None:
        """``node``'s shared pool, mapped here, or None when it is not a peer on this host whose pool
        this process can map."""
        peer = await self._peer(node)
        transport = self.transport_for(peer)
        if not isinstance(transport, ShmTransport) or peer.info is None:
            return None
        return transport.region(peer.info)

    async def release_blocks(self, node: str, lease: PoolLease) -> None:
        """Give back what ``lease_blocks`` leased (the peer also frees it after ``lease_ttl``)."""
        peer = await self._peer(node)
        transport = self.transport_for(peer)
        if isinstance(transport, ShmTransport):
            await transport.release(peer, lease)

    async def delete_blocks(self, node: str, keys: list[bytes], timeout: float | None = None) -> list[TransferResult]:
        """Remove each key's every copy on ``node``. An item fails alone: ``Status.NOT_FOUND`` (nothing
        to remove), ``LEASED`` (a reader holds it now: retry), ``PINNED`` (hard-pinned there)."""

        async def here(store) -> list[BaseException | None]:
            errors: list[BaseException | None] = []
            for key in keys:
                try:
                    await store.remove(key)
                    errors.append(None)
                except StoreError as exc:
                    errors.append(exc)
            return errors

        return await self._keys_op(node, keys, "delete", here, lambda conn: conn.delete(keys), timeout)

    async def stage_blocks(self, node: str, keys: list[bytes], timeout: float | None = None) -> list[TransferResult]:
        """Ask ``node`` to bring the blocks it holds only on disk into its memory tier, ahead of a read
        (a prefetch: nothing moves here). An item fails alone: ``NOT_FOUND``, or ``FULL`` when it
        stays on disk (not admitted, no room, or past the node's bound for one call)."""

        async def here(store) -> list[BaseException | None]:
            return list(await store.stage(keys))

        return await self._keys_op(
            node,
            keys,
            "stage",
            here,
            lambda conn: conn.stage(keys),
            timeout if timeout is not None else self.deadline_for(len(keys) * (1 << 20)),
        )

    async def session_event(
        self, node: str, notice: p.SessionNotice, keys: Sequence[bytes], timeout: float | None = None
    ) -> TransferResult:
        """Tell ``node``'s tiers a session's new state with the blocks its next turn reads (their
        eviction policies keep or demote them by it). A peer of an older release is not told (ok,
        nothing done); an unreachable one fails the result."""
        result = TransferResult(False, transport="control")
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.deadline_for(0)):
                peer = await self._peer(node)
                if peer.channel is None:
                    if self.store is None:
                        raise p.ItemError("this engine has no local store", Status.NOT_FOUND)
                    self.store.on_session(session_event(notice, keys))
                else:
                    async with peer.channel.connection() as conn:
                        if conn.version >= p.SESSIONS_SINCE:
                            await conn.session(notice, keys)
            result.ok = True
        except (p.TransferError, OSError) as exc:
            result.error = exc
        except TimeoutError:
            result.error = TimeoutError(f"session notice to {node} did not finish in time")
        return result

    async def answers(self, node: str, timeout: float = 1.0) -> bool:
        """Whether ``node`` answers a request within ``timeout`` (a stage of a key no block has: the
        node looks it up and says it is not there, and nothing moves). A node this engine no longer
        knows counts as answering: whether it is a member is not this question."""
        if node != self.node_id and node not in self._channels:
            return True
        results = await self.stage_blocks(node, [PROBE_KEY], timeout=timeout)
        return not isinstance(results[0].error, (TimeoutError, OSError))

    async def _keys_op(
        self, node: str, keys: list[bytes], what: str, here, there, timeout: float | None
    ) -> list[TransferResult]:
        """A control op over keys on ``node``: ``here(store)`` on this process's own store, else
        ``there(connection)`` on the node's; each item's result apart."""
        results = [TransferResult(False) for _ in keys]
        if not keys:
            return results
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.deadline_for(0)):
                peer = await self._peer(node)
                if peer.channel is None:  # this process's own store
                    if self.store is None:
                        raise p.ItemError("this engine has no local store", Status.NOT_FOUND)
                    errors = await here(self.store)
                else:
                    async with peer.channel.connection() as conn:
                        errors = await there(conn)
        except (p.TransferError, OSError) as exc:
            errors = [exc] * len(keys)
        except TimeoutError:
            errors = [TimeoutError(f"{what} on {node} did not finish in time")] * len(keys)
        for result, err in zip(results, errors):
            result.ok, result.error, result.transport = err is None, err, "control"
        return results


async def _verified(verify, reads: list[ReadReq], done: list) -> list:
    """``done`` with a ``SealError`` for each read that arrived but fails ``verify`` (off the event
    loop when the bytes are many)."""

    def check() -> list:
        out = list(done)
        for j, (req, err) in enumerate(zip(reads, done)):
            if err is None and not verify(req.key, host_bytes(req.dst), req.seal):
                out[j] = p.SealError(f"block {req.key.hex()[:16]}: its seal does not verify (forged or corrupt)")
        return out

    if sum(size_of(req.dst) for req in reads) > INLINE_COPY_MAX:
        return await asyncio.to_thread(check)
    return check()


def _transport_class(name: str) -> type[Transport]:
    cls = TRANSPORTS.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"transport {name!r} resolves to {cls!r}, which is not a Transport")
    return cls


def _slice(loc: BufferLoc, length: int) -> Any:
    flat = as_bytes(loc.tensor)
    if loc.offset == 0 and length == size_of(flat):
        return flat
    if loc.offset < 0 or loc.offset + length > size_of(flat):
        raise ValueError(f"buffer of {size_of(flat)} bytes has no [{loc.offset}, {loc.offset + length})")
    return flat[loc.offset : loc.offset + length]
