"""The node agent: owns the node's pool and SSD tiers, serves them through the transfer server, and
(when conductor URLs are configured) registers with the conductor and keeps it told what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from tiercake.conductor.client import Client
from tiercake.config import TiercakeConfig, reachable_host
from tiercake.errors import app_runner, bearer_guard, error_middleware
from tiercake.heap import freeze_startup_heap
from tiercake.messages import MemberInfo
from tiercake.metrics import metrics_handler, registry_of, store_families
from tiercake.started import started
from tiercake.tiers import TieredStore
from tiercake.tiers.build import build_store
from tiercake.tiers.pool import OBJECT_MAP_SUFFIX, beside
from tiercake.transfer import TransferEngine, TransferServer
from tiercake.transfer import protocol as p

from ..conductor_link import ConductorLink, member_stats
from .objects import NodeObjects

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, config: TiercakeConfig) -> None:
        self.config = config
        self.store: TieredStore | None = None
        self.server: TransferServer | None = None
        self.engine: TransferEngine | None = None
        self.link: ConductorLink | None = None
        self.objects: NodeObjects | None = None
        self._client: Client | None = None
        self._metrics: web.AppRunner | None = None
        self.metrics_url: str | None = None

    async def start(self) -> NodeAgent:
        cfg = self.config
        secret = cfg.transfer.secret()  # fail before touching any tier
        node_secret = cfg.transfer.node_secret()
        if cfg.conductor.urls and node_secret is None:
            raise ValueError(
                f"no node secret: node agents of a cluster prove it to each other for replication (set "
                f"${cfg.transfer.node_secret_env} or transfer.node_secret_file; never give it to clients)"
            )
        # building pre-faults the pool (about 1 s per GB here): off the event loop
        self.store = await (await asyncio.to_thread(build_store, cfg.store)).open()
        pool = next((t.tier_name for t in cfg.store.tiers if t.kind == "pool"), None)
        disk = next((t.tier_name for t in cfg.store.tiers if not t.spec().in_memory), None)
        try:
            if cfg.conductor.urls:
                tokens = cfg.conductor.tokens()
                self._client = Client(
                    cfg.conductor.urls, token=tokens[0] if tokens else None, ssl=cfg.tls.client_context()
                )
            # the key-value store's objects: their table rebuilt before anyone can ask for them
            objects = self.objects = NodeObjects(
                cfg.node_id,
                self.store,
                secret,
                self._client,
                ttl=cfg.conductor.member_ttl,
                lease_ttl=cfg.objects.lease_ttl_s,
                pool_tier=pool,
                disk_tier=disk,
                tls=cfg.transfer_tls_client(),
                map_path=_map_path(cfg),
                node_secret=node_secret,
            )
            await objects.recover()
            server = self.server = await TransferServer(
                self.store,
                secret,
                cfg.node_id,
                cfg.transfer.host,
                cfg.transfer.port,
                pool_tier=pool,
                max_block_bytes=int(cfg.transfer.max_block_bytes),
                buffer_bytes=cfg.transfer.buffer_bytes,
                ucx="ucx" in cfg.transfer.transports,  # served only when the cluster uses it: less to attack
                tls=cfg.transfer_tls_server(),
                objects=objects.server,
                node_secret=node_secret,
            ).start()
            if cfg.transfer.metrics_port is not None:
                await self._serve_metrics()
            if self._client is not None:  # (made when the config names conductors)
                await self._join(secret, self._client, server, objects)
        except BaseException:
            await self.close()
            raise
        return self

    async def _join(self, secret: bytes, client: Client, server: TransferServer, objects: NodeObjects) -> None:
        cfg = self.config
        self.engine = TransferEngine(
            cfg.node_id,
            secret,
            self.store,
            transports=tuple(cfg.transfer.transports),
            streams=cfg.transfer.streams,
            checksum=cfg.transfer.checksum,
            tls=cfg.transfer_tls_client(),
        )
        host, port = server.address
        member = MemberInfo(
            node_id=cfg.node_id,
            role="node",
            host=reachable_host(host, cfg.transfer.advertise_host),
            port=port,
            transfer_version=p.VERSION,
            tiers={t.tier_name: int(t.capacity) for t in cfg.store.tiers},
        )
        link = ConductorLink(client, member, self.store, ttl=cfg.conductor.member_ttl, engine=self.engine)
        link.on_registered.append(objects.on_registered)
        link.on_keepalive.append(objects.on_keepalive)
        self.link = await link.start()

    async def _serve_metrics(self) -> None:
        """``/metrics``: the node's tiers as its store sees them now, and its transfer server's counts."""
        cfg = self.config
        tokens = [] if cfg.conductor.metrics_open else cfg.conductor.tokens()
        app = web.Application(middlewares=[error_middleware, bearer_guard(tokens)])
        app.add_routes([web.get("/metrics", metrics_handler(registry_of(self._families)))])
        self._metrics = app_runner(app, access_log=None)
        await self._metrics.setup()
        site = web.TCPSite(
            self._metrics, cfg.transfer.host, cfg.transfer.metrics_port, ssl_context=cfg.tls.server_context()
        )
        await site.start()
        host, port = self._metrics.addresses[0][:2]
        self.metrics_url = f"{cfg.tls.scheme}://{reachable_host(host, cfg.transfer.advertise_host)}:{port}/metrics"

    def _families(self):
        node = self.config.node_id
        server = started(self.server, "the node agent")
        yield from store_families({node: member_stats(started(self.store, "the node agent"))})
        counts = self.objects.server.counts if self.objects is not None else {}
        for name, doc, value in (
            ("transfer_served_bytes", "bytes this node's transfer server sent to readers", server.served_bytes),
            ("transfer_refused_connections", "connections that failed authentication", server.refused),
            (
                "transfer_forbidden_requests",
                "requests beyond their credential (a tenant's key asking for blocks, or for another tenant's objects)",
                server.forbidden + counts.get("forbidden", 0),
            ),
            (
                "replication_forged",
                "replications refused because the peer was not the node it named as the slot's primary",
                counts.get("replicate_forged", 0),
            ),
        ):
            family = CounterMetricFamily(f"tiercake_{name}", doc, labels=["member"])
            family.add_metric([node], value)
            yield family

    async def close(self) -> None:
        if self._metrics is not None:
            await self._metrics.cleanup()
        if self.link is not None:
            await self.link.close()
        if self.server is not None:
            await self.server.close()
        if self.objects is not None:
            await self.objects.close()
        if self._client is not None:
            await self._client.close()
        if self.engine is not None:
            await self.engine.close()
        if self.store is not None:
            await self.store.close()

    async def serve_forever(self, announce=sys.stdout) -> None:
        """Run until SIGINT or SIGTERM. Prints one JSON line with the address once ready."""
        await self.start()
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        host, port = started(self.server, "the node agent").address
        announced = {"node_id": self.config.node_id, "host": host, "port": port}
        if self.metrics_url is not None:
            announced["metrics_url"] = self.metrics_url
        print(json.dumps(announced), file=announce, flush=True)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
            await self.close()


def _map_path(cfg: TiercakeConfig) -> Path | None:
    """Where the node keeps its last object map: in its SSD directory, else beside its pool file."""
    for tier in cfg.store.tiers:
        if tier.kind == "ssd" and tier.path:
            Path(tier.path).mkdir(parents=True, exist_ok=True)
            return Path(tier.path) / "object-map.json"
    for tier in cfg.store.tiers:
        if tier.kind == "pool" and tier.adopt:
            return beside(tier.path or f"/dev/shm/tiercake-{tier.tier_name}", OBJECT_MAP_SUFFIX)
    return None
