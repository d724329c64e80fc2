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
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from tiercake.blocks import Sealer
from tiercake.conductor.client import Client, ConductorError, NodeDirectory
from tiercake.config import TlsConfig
from tiercake.loop_thread import LoopThread
from tiercake.transfer import BlockLoc, BufferLoc, Transfer, TransferEngine, TransferResult

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        node = max(live, key=live.get)
        return node, live[node]

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

    def read(self, node: str, keys: list[bytes], dsts: list[torch.Tensor], timeout: float) -> list[TransferResult]:
        """Read each block into the buffer beside it; a result per block (all failed on a timeout)."""
        try:
            return self.call(
                self.nodes.to_node(node, lambda: self.engine.read_blocks(node, keys, dsts, timeout=timeout)),
                timeout + 1.0,
            )
        except (TimeoutError, OSError, ConductorError) as exc:
            log.warning("tiercake link %s: read from %s failed: %s", self.identity, node, exc)
            return [TransferResult(False, error=exc) for _ in keys]

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
            return await self.nodes.to_node(node, lambda: self.engine.transfer(batch, timeout=timeout))

        return self.submit(write())
