"""The worker process: an HTTP shell around one ``ServingEngine`` (``contract.py``).

It serves what the front calls (``POST /generate`` streams ``TokenEvent`` lines as NDJSON, ``/load``,
``/health``), turns the engine's typed errors into statuses in the one error format, registers the
worker with the conductor (its role, URL, KV capacity and fitted timings) and, through its
``ConductorLink``, reports the blocks its engine caches, so routing sees what each worker holds.

Roles: ``prefill`` (computes a prompt, writes its full blocks through to the node agent, returns the
first token and the handoff), ``decode`` (takes over a prefilled request: pulls the prompt's blocks
from the node, recomputes at most one partial block, decodes), ``worker`` (both).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, cast

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiercake.conductor.client import Client
from tiercake.config import TiercakeConfig, reachable_host
from tiercake.errors import app_runner, bearer_guard, body_reader, error_middleware, error_response, parse_body
from tiercake.heap import freeze_startup_heap
from tiercake.messages import ErrorReply, GenerateRequest, MemberInfo, SessionCommand, WorkerHealth
from tiercake.metrics import metrics_handler, registry_of, store_families
from tiercake.started import started
from tiercake.transfer.protocol import VERSION as TRANSFER_VERSION

from .conductor_link import ConductorLink, member_stats
from .contract import EngineBusy, RequestRejected, ServingEngine
from .reference.engine import ReferenceEngine

log = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode", "worker"]
ROLES: tuple[WorkerRole, ...] = ("prefill", "decode", "worker")


# builds and starts the engine, given the conductor client (None when the config names no conductor)
EngineFactory = Callable[[Client | None], Awaitable[ServingEngine]]


class Worker:
    def __init__(
        self,
        config: TiercakeConfig,
        role: str = "worker",
        worker_id: str | None = None,
        data_dir: str | Path | None = None,
        advertise: str | None = None,
        engine: EngineFactory | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: prefill, decode or worker")
        self.config = config
        self.role = role
        self.worker_id = worker_id or f"{config.node_id}-{role}"
        self.data_dir = Path(data_dir) if data_dir else None
        self.advertise = advertise  # the host the front reaches this worker at (default: see reachable_host)
        self.engine: ServingEngine | None = None
        self._factory = engine or (lambda client: ReferenceEngine(config, self.worker_id, self.data_dir).start(client))
        self._closers: list = []
        self._tokens: list[str] = []
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Worker:
        cfg = self.config
        try:
            tokens = self._tokens = cfg.conductor.required_tokens()  # none only when the config says insecure
            client = (
                Client(cfg.conductor.urls, token=tokens[0] if tokens else None, ssl=cfg.tls.client_context())
                if cfg.conductor.urls
                else None
            )
            if client is not None:
                self._closers.append(client.close)
            self.engine = await self._factory(client)
            self._closers.append(self.engine.close)
            runner = app_runner(self._app())
            await runner.setup()
            site = web.TCPSite(runner, host, port, ssl_context=cfg.tls.server_context())
            await site.start()
            self._closers.append(runner.cleanup)
            bound = runner.addresses[0][:2]
            advertised = reachable_host(bound[0], self.advertise)
            self.url = f"{cfg.tls.scheme}://{advertised}:{bound[1]}"
            if client is not None:
                await self._join(client, advertised, bound[1])
        except BaseException:
            await self.close()
            raise
        return self

    @property
    def serving(self) -> ServingEngine:
        """The engine serving requests (``start`` makes it)."""
        return started(self.engine, "the worker")

    async def _join(self, client: Client, host: str, port: int) -> None:
        engine = self.serving
        member = MemberInfo(
            node_id=self.worker_id,
            role=cast(WorkerRole, self.role),  # one of ROLES (checked when made)
            host=host,
            port=port,
            url=self.url,
            tiers={"gpu": engine.gpu_capacity_bytes},
            engine=engine.name,
            perf=engine.perf,
            kv_space=engine.kv_space,
            transfer_version=TRANSFER_VERSION,
        )
        # a decode worker's gpu blocks are not indexed: work is routed to it by load, never by its
        # cache (the prompt's blocks are on the node already), and each block it pulled would cost
        # two index changes (in, then evicted)
        link = await ConductorLink(
            client,
            member,
            engine.store,
            ttl=self.config.conductor.member_ttl,
            report=self.role != "decode",
            held=engine.held,
        ).start()
        self._closers.append(link.close)

    async def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                await self._closers.pop()()

    def _app(self) -> web.Application:
        """Work comes only from a front that holds the cluster's control token: the request names the
        tenant and salt it runs under, so nobody else may send one. ``/health`` is for probes,
        ``/metrics`` for scrapers (unless ``conductor.metrics_open`` is false)."""
        open_paths = ("/health", "/metrics") if self.config.conductor.metrics_open else ("/health",)
        app = web.Application(
            client_max_size=16 << 20,
            middlewares=[error_middleware, bearer_guard(self._tokens, open_paths), body_reader()],
        )
        app.add_routes(
            [
                web.post("/generate", self._generate),
                web.post("/session", self._session),
                web.get("/health", self._health),
                web.get("/load", self._load),
                web.get("/metrics", metrics_handler(registry_of(self._families))),
            ]
        )
        return app

    def _families(self):
        """This worker's own series: its engine's queue and KV blocks, and its gpu tier."""
        engine, labels = self.serving, ["worker", "role"]
        load, key = engine.load(), [self.worker_id, self.role]
        for name, doc, value in (
            ("waiting", "requests waiting for a prefill slot", load.waiting),
            ("prefilling", "requests being prefilled", load.prefilling),
            ("running", "sequences decoding", load.running),
            ("kv_free_blocks", "KV blocks free on the device", load.free_blocks),
            ("kv_blocks", "KV blocks on the device", load.blocks),
        ):
            family = GaugeMetricFamily(f"tiercake_worker_{name}", doc, labels=labels)
            family.add_metric(key, value)
            yield family
        done = CounterMetricFamily("tiercake_worker_sequences_completed", "sequences finished", labels=labels)
        done.add_metric(key, load.completed)
        yield done
        if engine.store is not None:
            yield from store_families({self.worker_id: member_stats(engine.store)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(GenerateRequest, await request.read())
        events = self.serving.generate(body)
        try:
            first = await anext(events)
        except RequestRejected as exc:
            return error_response(400, str(exc))
        except EngineBusy as exc:
            return error_response(503, str(exc), "server_error", "worker_busy", retryable=True)
        except Exception as exc:  # noqa: BLE001
            log.exception("worker %s: prefill failed", self.worker_id)
            return error_response(500, f"prefill failed: {exc}", "server_error", retryable=True)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            event = first
            while True:
                await response.write(event.model_dump_json(exclude_defaults=True).encode() + b"\n")
                if event.finish_reason is not None:
                    break
                event = await anext(events)
        except Exception as exc:  # noqa: BLE001 - the stream says so and ends
            with contextlib.suppress(ConnectionError, RuntimeError):
                line = ErrorReply.model_validate({"error": {"message": str(exc), "type": "server_error"}})
                await response.write(line.model_dump_json().encode() + b"\n")
        finally:
            await events.aclose()  # a client that went away frees its sequence
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response

    async def _session(self, request: web.Request) -> web.Response:
        """The front's change of a session this worker ran (close, retain, priority)."""
        command = parse_body(SessionCommand, await request.read())
        try:
            self.serving.change_session(command)
        except LookupError as exc:
            return error_response(404, str(exc), code="session_not_found")
        except NotImplementedError as exc:
            return error_response(501, str(exc), "server_error", "not_implemented")
        return web.json_response({"changed": True})

    async def _health(self, _: web.Request) -> web.Response:
        health = WorkerHealth(
            status="ok",
            worker=self.worker_id,
            role=self.role,
            engine=self.serving.name,
            pid=os.getpid(),
            frozen_objects=gc.get_freeze_count(),
        )
        return web.json_response(text=health.model_dump_json())

    async def _load(self, _: web.Request) -> web.Response:
        return web.json_response(text=self.serving.load().model_dump_json())

    async def serve_forever(self, host: str, port: int, announce=sys.stdout) -> None:
        await self.start(host, port)
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(json.dumps({"worker": self.worker_id, "role": self.role, "url": self.url}), file=announce, flush=True)
        try:
            await stop.wait()
        finally:
            await self.close()
