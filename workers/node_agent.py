"""The node agent: owns the node's pool and SSD tiers, serves them through the transfer server, and
(when conductor URLs are configured) registers with the conductor and keeps it told what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

from tiercake.conductor.client import Client
from tiercake.tiers import TieredStore
from tiercake.tiers.build import build_store
from tiercake.transfer import TransferEngine, TransferServer

from tiercake.config import TiercakeConfig, reachable_host
from tiercake.messages import MemberInfo

from .conductor_link import ConductorLink

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, config: TiercakeConfig) -> None:
        self.config = config
        self.store: TieredStore | None = None
        self.server: TransferServer | None = None
        self.engine: TransferEngine | None = None
        self.link: ConductorLink | None = None
        self._client: Client | None = None

    async def start(self) -> NodeAgent:
        cfg = self.config
        secret = cfg.transfer.secret()  # fail before touching any tier
        # building pre-faults the pool (about 1 s per GB here): off the event loop
        self.store = await (await asyncio.to_thread(build_store, cfg.store)).open()
        pool = next((t.tier_name for t in cfg.store.tiers if t.kind == "pool"), None)
        try:
            self.server = await TransferServer(
                self.store, secret, cfg.node_id, cfg.transfer.host, cfg.transfer.port, pool_tier=pool,
                max_block_bytes=int(cfg.transfer.max_block_bytes), buffer_bytes=cfg.transfer.buffer_bytes,
                ucx="ucx" in cfg.transfer.transports,  # served only when the cluster uses it: less to attack
            ).start()
            if cfg.conductor.urls:
                await self._join(secret)
        except BaseException:
            await self.close()
            raise
        return self

    async def _join(self, secret: bytes) -> None:
        cfg = self.config
        tokens = cfg.conductor.tokens()
        self._client = Client(cfg.conductor.urls, token=tokens[0] if tokens else None, ssl=cfg.tls.client_context())
        self.engine = TransferEngine(cfg.node_id, secret, self.store, transports=tuple(cfg.transfer.transports),
                                     streams=cfg.transfer.streams, checksum=cfg.transfer.checksum)
        host, port = self.server.address
        member = MemberInfo(node_id=cfg.node_id, role="node", host=reachable_host(host, cfg.transfer.advertise_host),
                            port=port,
                            tiers={t.tier_name: int(t.capacity) for t in cfg.store.tiers})
        self.link = await ConductorLink(self._client, member, self.store, ttl=cfg.conductor.member_ttl,
                                        engine=self.engine).start()

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        if self._client is not None:
            await self._client.close()
        if self.engine is not None:
            await self.engine.close()
        if self.server is not None:
            await self.server.close()
        if self.store is not None:
            await self.store.close()

    async def serve_forever(self, announce=sys.stdout) -> None:
        """Run until SIGINT or SIGTERM. Prints one JSON line with the address once ready."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        host, port = self.server.address
        print(json.dumps({"node_id": self.config.node_id, "host": host, "port": port}), file=announce, flush=True)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
            await self.close()
