"""The worker process: the model over its own gpu tier, a continuous-batching scheduler, and an HTTP
API the front calls (``POST /generate`` streams tokens as NDJSON).

Roles: ``prefill`` (computes a prompt, writes its full blocks through to the node agent, returns the
first token), ``decode`` (takes over a prefilled request: pulls the prompt's blocks from the node,
recomputes at most one partial block, decodes), ``worker`` (both). A worker registers with the
conductor, reports its gpu tier's blocks (so routing sees what each worker holds) and publishes its
timings, fitted at start-up on this machine (and persisted), for the router's TTFT predictions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tiercake.conductor.client import Client
from tiercake.conductor.membership import MemberInfo
from tiercake.config import TiercakeConfig, reachable_host
from tiercake.policies import fit_prefill
from tiercake.tiers import GpuBlockPool, GpuTier, Tier, TieredStore, TierFullError
from tiercake.tiers.gpu import default_device
from tiercake.transfer import TransferEngine

from .conductor_link import ConductorLink
from .inference import ContextLimitError, InferenceEngine
from .model import ReferenceModel
from .scheduler import GenerationRequest, Scheduler

log = logging.getLogger(__name__)


class SourceHint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str = Field(min_length=1)
    blocks: int = Field(ge=0)
    tier: str = Field(default="handoff", description="the tier the node holds them in (for the statistics)")


class GenerateBody(BaseModel):
    """What the front sends a worker (token ids: the front tokenizes)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    temperature: float = Field(default=0.0, ge=0)
    tenant: str = Field(default="default", min_length=1)
    salt: str | None = None
    seed: int | None = None
    pull: bool = True
    source: SourceHint | None = Field(default=None, description="where a prefill worker wrote the prompt's blocks")


PERF_KEYS = {"prefill_a", "prefill_b", "prefill_q", "decode_step_s", "copy_bytes_per_s"}


def calibrate(engine: InferenceEngine, cache: Path | None) -> dict[str, float]:
    """Fit the prefill-time model and measure a decode step on this machine; reuse a persisted fit of
    the same model, block size and device."""
    model = engine.model
    ident = hashlib.sha256(json.dumps([model.config.model_dump(), engine.block_size, str(engine.pool.device)])
                           .encode()).hexdigest()[:16]
    path = cache / f"calibration-{ident}.json" if cache else None
    if path is not None and path.exists():
        with contextlib.suppress(ValueError, KeyError):
            saved = {k: float(v) for k, v in json.loads(path.read_text()).items()}
            if set(saved) >= PERF_KEYS:  # a file from an older version lacks some: measure again
                return saved
    from .model import PagedChunk

    bs = engine.block_size
    limit = min(engine.max_context // 2, engine.pool.num_blocks * bs // 2)
    lengths = sorted({max(bs, min(n, limit)) for n in (bs, 4 * bs, 16 * bs, 64 * bs)})
    scratch = torch.zeros((-(-max(lengths) // bs) * 2, *engine.pool.block_shape), dtype=engine.pool.dtype,
                          device=engine.pool.device)
    table = list(range(scratch.shape[0]))
    samples = []
    for n in lengths:
        for cached in (0, n // 2 // bs * bs):
            tokens = [(7 * i) % 256 for i in range(n)]
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                model.forward_paged([PagedChunk(tokens[cached:], cached, table)], scratch)
                best = min(best, time.perf_counter() - started)
            samples.append((n - cached, cached, best))
    if len({s[:2] for s in samples}) < 3:
        samples += [(1, 0, samples[0][2])]
    fit = fit_prefill(samples)
    started = time.perf_counter()
    for i in range(5):
        model.forward_paged([PagedChunk([1], lengths[0] + i, table)], scratch)
    perf = {"prefill_a": fit.a, "prefill_b": fit.b, "prefill_q": fit.q,
            "decode_step_s": (time.perf_counter() - started) / 5, "copy_bytes_per_s": _copy_rate(engine.pool)}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(perf))
    return perf


def _copy_rate(pool: GpuBlockPool) -> float:
    """Bytes per second of a warm copy into the gpu tier's memory: the floor of loading a block."""
    src = torch.ones(16 << 20, dtype=torch.uint8, device=pool.device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        if pool.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return src.numel() / best


class Worker:
    def __init__(self, config: TiercakeConfig, role: str = "worker", worker_id: str | None = None,
                 data_dir: str | Path | None = None, advertise: str | None = None) -> None:
        if role not in ("prefill", "decode", "worker"):
            raise ValueError(f"unknown role {role!r}: prefill, decode or worker")
        self.config = config
        self.role = role
        self.worker_id = worker_id or f"{config.node_id}-{role}"
        self.data_dir = Path(data_dir) if data_dir else None
        self.advertise = advertise  # the host the front reaches this worker at (default: see reachable_host)
        self.engine: InferenceEngine | None = None
        self.scheduler: Scheduler | None = None
        self._closers: list = []
        self.url = ""
        self.perf: dict[str, float] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Worker:
        cfg, serving = self.config, self.config.serving
        try:
            secret = cfg.transfer.secret()
            device = serving.device or default_device()
            model = ReferenceModel(serving.model, device=device)
            layout = serving.layout()
            pool = GpuBlockPool(serving.gpu_blocks, layout.shape, layout.torch_dtype(), device)
            store = await TieredStore([Tier(GpuTier(pool))], payload_nbytes=layout.nbytes).open()
            self._closers.append(store.close)
            tokens = cfg.conductor.tokens()
            client = Client(cfg.conductor.urls, token=tokens[0] if tokens else None) if cfg.conductor.urls else None
            if client is not None:
                self._closers.append(client.close)
            transfer = TransferEngine(self.worker_id, secret, store, transports=tuple(cfg.transfer.transports),
                                      streams=cfg.transfer.streams, checksum=cfg.transfer.checksum)
            self._closers.append(transfer.close)
            self.engine = InferenceEngine(
                model, store, pool, cfg.serving_namespace(), worker_id=self.worker_id, transfer=transfer,
                conductor=client, node=cfg.node_id, max_context=serving.max_context,
                prefill_chunk=serving.prefill_chunk_tokens,
            )
            self._closers.append(self.engine.flush)
            self.perf = await asyncio.to_thread(calibrate, self.engine, self.data_dir)
            self.scheduler = Scheduler(self.engine, serving.max_batch).start()
            self._closers.append(self.scheduler.close)
            runner = web.AppRunner(self._app())
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            self._closers.append(runner.cleanup)
            bound = runner.addresses[0][:2]
            advertised = reachable_host(bound[0], self.advertise)
            self.url = f"http://{advertised}:{bound[1]}"
            if client is not None:
                member = MemberInfo(node_id=self.worker_id, role=self.role, host=advertised, port=bound[1],
                                    url=self.url, tiers={"gpu": pool.num_blocks * pool.block_nbytes}, perf=self.perf)
                # a decode worker's gpu blocks are not indexed: work is routed to it by load, never by
                # its cache (the prompt's blocks are on the node already), and each block it pulled
                # would cost two durable index changes (in, then evicted)
                link = await ConductorLink(client, member, store, ttl=cfg.conductor.member_ttl,
                                           report=self.role != "decode").start()
                self._closers.append(link.close)
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                await self._closers.pop()()

    def _app(self) -> web.Application:
        async def generate(request: web.Request) -> web.StreamResponse:
            try:
                body = GenerateBody.model_validate_json(await request.read())
            except ValidationError as exc:
                return web.json_response({"error": "invalid body", "details": json.loads(exc.json(include_url=False))},
                                         status=400)
            job = GenerationRequest(body.tokens, body.max_tokens, body.temperature, body.tenant, body.salt,
                                    body.seed, body.pull, body.source.model_dump() if body.source else None)
            events = self.scheduler.generate(job)
            try:
                first = await anext(events)
            except (ValueError, ContextLimitError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
            except TierFullError as exc:  # every gpu block is in use by running sequences
                return web.json_response({"error": f"worker busy: {exc}"}, status=503)
            except Exception as exc:  # noqa: BLE001
                log.exception("worker %s: prefill failed", self.worker_id)
                return web.json_response({"error": f"prefill failed: {exc}"}, status=500)
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            try:
                event = first
                while True:
                    line = {"token": event.token, "index": event.index, "finish_reason": event.finish_reason}
                    if event.stats is not None:
                        line["stats"] = {"prompt_tokens": event.stats.prompt_tokens,
                                         "cached_tokens": event.stats.cached_tokens,
                                         "sources": event.stats.sources, "lookup_s": event.stats.lookup_s,
                                         "load_s": event.stats.load_s, "compute_s": event.stats.compute_s,
                                         "load_bytes": event.stats.load_bytes, "load_tier": event.stats.load_tier,
                                         "written_to": event.stats.written_to,
                                         "copy_bytes_per_s": self.perf.get("copy_bytes_per_s")}
                    if event.finish_reason is not None and self.role == "prefill":
                        await self.engine.flush()  # the decode worker pulls the blocks next
                    await response.write(json.dumps(line).encode() + b"\n")
                    if event.finish_reason is not None:
                        break
                    event = await anext(events)
            except Exception as exc:  # noqa: BLE001 - the stream says so and ends
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write(json.dumps({"error": str(exc)}).encode() + b"\n")
            finally:
                await events.aclose()  # a client that went away frees its sequence
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write_eof()
            return response

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "worker": self.worker_id, "role": self.role, "pid": os.getpid()})

        async def load(_: web.Request) -> web.Response:
            pool = self.engine.pool
            return web.json_response({**self.scheduler.load, "free_blocks": pool.num_free,
                                      "blocks": pool.num_blocks, "completed": self.scheduler.completed})

        app = web.Application(client_max_size=16 << 20)
        app.add_routes([web.post("/generate", generate), web.get("/health", health), web.get("/load", load)])
        return app

    async def serve_forever(self, host: str, port: int, announce=sys.stdout) -> None:
        await self.start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(json.dumps({"worker": self.worker_id, "role": self.role, "url": self.url}), file=announce, flush=True)
        try:
            await stop.wait()
        finally:
            await self.close()
