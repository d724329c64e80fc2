"""The node agent: owns the node's pool and SSD tiers and serves them through the transfer server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

from tiercake.config import TiercakeConfig
from tiercake.tiers import TieredStore
from tiercake.tiers.build import build_store
from tiercake.transfer import TransferServer

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, config: TiercakeConfig) -> None:
        self.config = config
        self.store: TieredStore | None = None
        self.server: TransferServer | None = None

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
            ).start()
        except BaseException:
            await self.store.close()
            raise
        return self

    async def close(self) -> None:
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
