"""The connector's line to tiercake from inside vLLM: synchronous calls over an event loop of its own.

vLLM calls its connector synchronously, from the scheduler and from the model runner. tiercake's
client and transfer engine are asyncio. A ``TiercakeLink`` runs one event loop in a daemon thread,
owns the conductor client and the transfer engine on it, and gives the connector blocking calls with
a deadline (lookups, loads) and fire-and-forget writes whose completion it counts. Nothing here
blocks vLLM longer than the deadline it was given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

import torch

from tiercake.blocks import Sealer
from tiercake.conductor.client import Client, ConductorError, NodeDirectory
from tiercake.config import TlsConfig
from tiercake.loop_thread import LoopThread
from tiercake.tiers import StoreError
from tiercake.tiers.pool import PoolPlaces, PoolRegion
from tiercake.transfer import BlockLoc, BufferLoc, Transfer, TransferEngine, TransferError, TransferResult
from tiercake.transfer.protocol import SessionNotice
from tiercake.transfer.transports import PoolLease
from tiercake.workers.vllm.pool_watch import PoolWatch

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _one(result: Awaitable[TransferResult]) -> list[TransferResult]:
    return [await result]


class TiercakeLink:
    """A conductor client and a transfer engine on a private event loop (see the module docstring)."""

    def __init__(
        self,
        conductors: list[str],
        token: str | None,
        secret: bytes | None,
        identity: str,
        transports: tuple[str, ...] = ("shm", "tcp"),
        members_every: float = 0.5,
        ca_file: str | None = None,
        transfer_tls: bool = False,
    ) -> None:
        """``ca_file``: the CA of the cluster's TLS (https conductors; with ``transfer_tls``, the node
        agents' TLS transfer ports too)."""
        self.identity = identity
        self._loop = LoopThread(f"tiercake-{identity}")
        if transfer_tls and not ca_file:
            raise ValueError("transfer_tls needs ca_file: the CA the node agents' certificates are checked against")

        async def build() -> tuple[Client, TransferEngine | None]:
            tls = TlsConfig(ca_file=ca_file)
            client = Client(conductors, token=token, timeout=5.0, retries=2, ssl=tls.client_context())
            engine = (
                TransferEngine(
                    identity, secret, transports=transports, tls=tls.transfer_client_context() if transfer_tls else None
                )
                if secret
                else None
            )
            return client, engine

        self.client, self.engine = self.call(build(), 10.0)
        self.nodes = NodeDirectory(self.client, self.engine, every=members_every)
        self.pool_watch: PoolWatch | None = None  # of the node's pool (watch_pool)
        self._watch: concurrent.futures.Future | None = None
        self._places: dict[str, PoolPlaces] = {}  # node -> its pool read by index entries (pool_places)

    # Plumbing ------------------------------------------------------------------------------------

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the link's loop and wait at most ``timeout`` seconds (TimeoutError)."""
        try:
            return self._loop.call(coro, timeout)
        except TimeoutError:
            raise TimeoutError(f"tiercake did not answer within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self._loop.submit(coro)

    def close(self, timeout: float = 10.0) -> None:
        if self._watch is not None:
            self._watch.cancel()

        async def shut() -> None:
            if self.engine is not None:
                await self.engine.close()
            await self.client.close()

        try:
            self.call(shut(), timeout)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("tiercake link %s: close: %s", self.identity, exc)
        self._loop.stop(timeout)

    # Calls ---------------------------------------------------------------------------------------

    async def _longest(self, tenant: str, keys: list[bytes]) -> tuple[str | None, int]:
        found = await self.client.lookup(tenant, keys)
        if not found:
            return None, 0
        await self.nodes.refresh(force=any(node not in self.nodes for node in found))
        live = {node: holding.length for node, holding in found.items() if node in self.nodes}
        if not live:
            return None, 0
        node = max(live, key=lambda n: live[n])
        return node, live[node]

    def watch_pool(self, node: str, every: float) -> None:
        """Keep ``node``'s pool index here (``local_prefix``), reread every ``every`` seconds on the
        link's loop (see ``PoolWatch``); nothing without a transfer engine."""

        if self.engine is not None:
            self.pool_watch = PoolWatch(node, every, lambda: self._pool_region(node))
            self._watch = self.submit(self.pool_watch.run())

    async def _pool_region(self, node: str) -> PoolRegion | None:
        """``node``'s pool mapped here (a node not yet in the member list is looked up first)."""
        assert self.engine is not None
        if node not in self.nodes and self.engine.address(node) is None:
            await self.nodes.refresh()
        return await self.engine.pool_region(node)

    @property
    def pool_index_state(self) -> str:
        """Whether the watched pool's index is read here, or why not."""
        return "not watched" if self.pool_watch is None else self.pool_watch.state

    def local_prefix(self, tenant: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the watched pool held for ``tenant`` (0 before the
        first read): microseconds, no round trip; a hint the lease confirms."""
        return 0 if self.pool_watch is None else self.pool_watch.leading(tenant, keys)

    def pool_entries(self, tenant: str, keys: list[bytes]) -> tuple[str, list[int]]:
        """The watched pool's region (its instance id) and the index entries of the leading ``keys``
        it held at the last read: where the worker side reads them without a lease (``PoolPlaces``)."""
        index = None if self.pool_watch is None else self.pool_watch.index
        if index is None:
            return "", []
        return index.region.instance, index.entries(tenant, keys)

    def pool_places(self, node: str, instance: str, timeout: float) -> PoolPlaces | None:
        """``node``'s pool, mapped here, when it is the region ``instance`` (what the scheduler side
        read the entries from); None otherwise. The link's loop is asked only when the region is new
        here (once per node agent start)."""
        places = self._places.get(node)
        if places is None or places.region.instance != instance:
            try:
                region = self.call(self._pool_region(node), timeout) if self.engine is not None else None
            except (TimeoutError, OSError, ConductorError, TransferError, StoreError) as exc:
                log.info("tiercake link %s: %s's pool is not mapped here: %s", self.identity, node, exc)
                region = None
            if region is None or region.instance != instance or region.index is None:
                return None
            places = self._places[node] = PoolPlaces(region)
        return places

    def touch(self, node: str, keys: list[bytes], length: int) -> None:
        """Tell ``node`` these blocks of its pool were just read without a lease, in the background:
        a lease given straight back, so that its eviction policy counts the reads."""
        if self.engine is None:
            return
        engine = self.engine

        async def touch() -> None:
            lease = await engine.lease_blocks(node, keys, length, 5.0)
            if lease is not None:
                await engine.release_blocks(node, lease)

        def done(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.debug("tiercake link %s: touch on %s: %s", self.identity, node, future.exception())

        self.submit(touch()).add_done_callback(done)

    def longest_prefix_soon(self, tenant: str, keys: list[bytes]) -> concurrent.futures.Future:
        """``longest_prefix`` without waiting: a future of (node, blocks), (None, 0) on failure."""

        async def ask() -> tuple[str | None, int]:
            try:
                return await self._longest(tenant, keys)
            except (ConductorError, OSError) as exc:
                log.warning("tiercake link %s: lookup failed, computing instead: %s", self.identity, exc)
                return None, 0

        return self.submit(ask())

    def longest_prefix(self, tenant: str, keys: list[bytes], timeout: float) -> tuple[str | None, int]:
        """The live node agent that holds the longest prefix of ``keys``, and how many blocks;
        (None, 0) when none does or tiercake cannot say within ``timeout``."""
        if not keys or self.engine is None:
            return None, 0
        try:
            return self.call(self._longest(tenant, keys), timeout)
        except (ConductorError, TimeoutError, OSError) as exc:
            log.warning("tiercake link %s: lookup failed, computing instead: %s", self.identity, exc)
            return None, 0

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise TransferError("this link was given no transfer secret: it moves no blocks")
        return self.engine

    def read(self, node: str, keys: list[bytes], dsts: list[torch.Tensor], timeout: float) -> list[TransferResult]:
        """Read each block into the buffer beside it; a result per block (all failed on a timeout)."""
        try:
            engine = self._engine()
            return self.call(
                self.nodes.to_node(node, lambda: engine.read_blocks(node, keys, dsts, timeout=timeout)),
                timeout + 1.0,
            )
        except (TimeoutError, OSError, ConductorError, TransferError) as exc:
            log.warning("tiercake link %s: read from %s failed: %s", self.identity, node, exc)
            return [TransferResult(False, error=exc) for _ in keys]

    def lease(self, node: str, keys: list[bytes], length: int, timeout: float) -> PoolLease | None:
        """``keys`` (each ``length`` bytes) held in ``node``'s shared pool for reading in place (see
        ``PoolLease``; give it back with ``release``), or None when ``node`` is not on this host or
        cannot be reached (read the blocks with ``read`` then: it has its own second chance)."""

        async def lease() -> PoolLease | None:
            engine = self._engine()
            if node not in self.nodes and engine.address(node) is None:
                await self.nodes.refresh()
            return await engine.lease_blocks(node, keys, length, timeout)

        try:
            return self.call(lease(), timeout + 1.0)
        except (TimeoutError, OSError, ConductorError, TransferError, StoreError) as exc:
            log.warning("tiercake link %s: lease from %s failed, reading instead: %s", self.identity, node, exc)
            return None

    def tell_session(self, node: str, notice: SessionNotice, keys: list[bytes]) -> None:
        """Tell ``node``'s tiers a session's new state, without waiting (in the order of the calls:
        one loop runs them); a failure is logged, the policies then act on what they knew."""
        if self.engine is None:
            return
        engine = self.engine

        async def tell() -> list[TransferResult]:
            return await self.nodes.to_node(node, lambda: _one(engine.session_event(node, notice, keys)))

        def done(future: concurrent.futures.Future) -> None:
            failed = future.exception() if not future.cancelled() else None
            if failed is None and not future.cancelled():
                failed = future.result()[0].error
            if failed is not None:
                log.info("tiercake link %s: session notice to %s: %s", self.identity, node, failed)

        self.submit(tell()).add_done_callback(done)

    def release(self, node: str, lease: PoolLease) -> None:
        """Give ``lease`` back, without waiting (the node frees it after its ttl in any case)."""

        def done(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.warning("tiercake link %s: release on %s: %s", self.identity, node, future.exception())

        self.submit(self._engine().release_blocks(node, lease)).add_done_callback(done)

    def write(
        self,
        node: str,
        items: list[tuple[bytes, bytes | None, torch.Tensor]],
        tenant: str,
        sealer: Sealer,
        timeout: float,
    ) -> concurrent.futures.Future[list[TransferResult]]:
        """Seal and store each (key, parent, host bytes) on ``node`` in the background (parents first)."""

        async def write() -> list[TransferResult]:
            seals = await asyncio.to_thread(lambda: [sealer.seal(key, src.numpy()) for key, _, src in items])
            batch = [
                Transfer(BufferLoc(src), BlockLoc(node, key, parent, tenant, seal), src.numel())
                for (key, parent, src), seal in zip(items, seals)
            ]
            engine = self._engine()
            return await self.nodes.to_node(node, lambda: engine.transfer(batch, timeout=timeout))

        return self.submit(write())
