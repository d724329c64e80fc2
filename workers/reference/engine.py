"""tiercake's reference engine behind the worker contract: the reference model over a paged gpu tier,
the continuous-batching scheduler, and the timings the router predicts with, fitted on this machine
at start (and persisted in the data directory, so a restart does not measure again)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import torch

from tiercake.blocks import block_keys
from tiercake.conductor.client import Client
from tiercake.config import TiercakeConfig
from tiercake.messages import (
    GenerateRequest,
    SessionCommand,
    SessionDirective,
    TokenEvent,
    WorkerLoadReply,
    WorkerPerf,
)
from tiercake.policies import fit_prefill
from tiercake.started import started
from tiercake.tiers import GpuBackend, GpuBlockPool, Tier, TieredStore, TierFullError
from tiercake.tiers.gpu import default_device
from tiercake.transfer import TransferEngine

from ..contract import EngineBusy, ServingEngine
from ..sessions import SessionNotifier
from .model import PagedChunk, ReferenceModel
from .runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class ReferenceEngine(ServingEngine):
    name = "reference"

    def __init__(self, config: TiercakeConfig, worker_id: str, data_dir: Path | None = None) -> None:
        self.config = config
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.inference: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self._perf = WorkerPerf()
        self._closers: list = []
        self.sessions: SessionNotifier | None = None

    async def start(self, client: Client | None) -> ReferenceEngine:
        """Build the model, its gpu tier, the transfer engine and the scheduler; fit the timings.
        ``client``: the conductor (prefix lookups and members); None for a standalone engine."""
        cfg, serving = self.config, self.config.serving
        try:
            device = serving.device or default_device()
            model = ReferenceModel(serving.model, device=device)
            layout = serving.layout()
            pool = GpuBlockPool(serving.gpu_blocks, layout.shape, layout.torch_dtype(), device)
            store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=layout.nbytes).open()
            self._closers.append(store.close)
            transfer = TransferEngine(
                self.worker_id,
                cfg.transfer.secret(),
                store,
                transports=tuple(cfg.transfer.transports),
                streams=cfg.transfer.streams,
                checksum=cfg.transfer.checksum,
                tls=cfg.transfer_tls_client(),
            )
            self._closers.append(transfer.close)
            self.inference = ModelRunner(
                model,
                store,
                cfg.serving_namespace(),
                worker_id=self.worker_id,
                transfer=transfer,
                conductor=client,
                node=cfg.node_id,
                max_context=serving.max_context,
                prefill_chunk=serving.prefill_chunk_tokens,
                seals=cfg.transfer.seal_material(),
            )
            self._closers.append(self.inference.flush)
            self._closers.append(self.inference.link.fence.close)
            self.sessions = SessionNotifier(store, transfer, cfg.node_id)
            self._closers.append(self.sessions.close)
            self._perf = await asyncio.to_thread(calibrate, self.inference, self.data_dir)
            self.scheduler = Scheduler(self.inference, serving.max_batch, prefetch=serving.prefetch).start()
            self._closers.append(self.scheduler.close)
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                await self._closers.pop()()

    @property
    def perf(self) -> WorkerPerf:
        return self._perf

    @property
    def _runner(self) -> ModelRunner:
        return started(self.inference, "this worker")

    @property
    def _batches(self) -> Scheduler:
        return started(self.scheduler, "this worker")

    @property
    def _notices(self) -> SessionNotifier:
        return started(self.sessions, "this worker", LookupError)

    @property
    def store(self) -> TieredStore | None:
        return self.inference.store if self.inference is not None else None

    @property
    def gpu_capacity_bytes(self) -> int:
        kv = self._runner.kv
        return kv.num_blocks * kv.block_nbytes

    def load(self) -> WorkerLoadReply:
        kv, batches = self._runner.kv, self._batches
        return WorkerLoadReply(
            **batches.load, free_blocks=kv.num_free, blocks=kv.num_blocks, completed=batches.completed
        )

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        if request.session is not None:
            session_events = self._session_events(request, request.session)
            async for event in session_events:
                yield event
            return
        async for event in self._generate(request):
            yield event

    def change_session(self, command: SessionCommand) -> None:
        self._notices.changed(command.session, command.tenant)

    async def _session_events(
        self, request: GenerateRequest, session: SessionDirective
    ) -> AsyncGenerator[TokenEvent, None]:
        """``_generate`` between the session's notices: active with the prompt's blocks, then paused
        with the blocks of prompt and answer (what its next turn starts with), or closed."""
        namespace = self._runner.namespace_for(request.salt if request.salt is not None else request.tenant)
        prompt = block_keys(namespace, request.tokens)
        notices = self._notices
        notices.started(session, request.tenant, prompt)
        tokens = list(request.tokens)
        try:
            async for event in self._generate(request):
                tokens.append(event.token)
                yield event
        finally:  # the answer's full blocks extend the prompt's chain: only they are hashed
            notices.ended(session, request.tenant, block_keys(namespace, tokens, known=prompt))

    async def _generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        events = self._batches.generate(request)
        try:
            try:
                event = await anext(events)
            except TierFullError as exc:  # every gpu block is in use by running sequences
                raise EngineBusy(f"worker busy: {exc}") from None
            while True:
                if event.stats is not None:
                    event.stats.copy_bytes_per_s = self._perf.copy_bytes_per_s
                if event.finish_reason is not None:
                    if request.handoff:  # the decode worker pulls the blocks next: they must be there
                        event.handoff = await self._runner.handoff(len(request.tokens))
                    yield event
                    return
                yield event
                event = await anext(events)
        finally:
            await events.aclose()  # a client that went away frees its sequence


PERF_FIELDS = set(WorkerPerf.model_fields)


def calibrate(engine: ModelRunner, cache: Path | None) -> WorkerPerf:
    """Fit the prefill-time model and measure a decode step on this machine; reuse a persisted fit of
    the same model, block size and device. Workers of one data folder (``up --workers N``) take turns:
    the first measures, the others read its fit. Measured each beside the others, two equal workers
    fitted different costs, and the router took that noise for a difference between them."""
    ident = hashlib.sha256(
        json.dumps([engine.model.config.model_dump(), engine.block_size, str(engine.kv.device)]).encode()
    ).hexdigest()[:16]
    if cache is None:
        return _measure(engine)
    path = cache / f"calibration-{ident}.json"
    with contextlib.ExitStack() as held:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(open(path.with_suffix(".lock"), "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (and when the process dies)
        except OSError as e:  # a folder that refuses locks (ENOLCK on some NFS mounts) or writes
            log.warning("calibration of %s not shared through %s: %s", ident, path.parent, e)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads(path.read_text())
            if set(saved) >= PERF_FIELDS:  # a file from an older version lacks some: measure again
                return WorkerPerf.model_validate(saved)
        perf = _measure(engine)
        try:
            part = path.with_suffix(f".{os.getpid()}.part")  # unlocked, two writers must not share one
            part.write_text(perf.model_dump_json())
            part.replace(path)
        except OSError as e:
            log.warning("calibration of %s not saved in %s: %s", ident, path.parent, e)
    return perf


def _measure(engine: ModelRunner) -> WorkerPerf:
    model = engine.model
    bs = engine.block_size
    limit = min(engine.max_context // 2, engine.kv.num_blocks * bs // 2)
    lengths = sorted({max(bs, min(n, limit)) for n in (bs, 4 * bs, 16 * bs, 64 * bs)})
    scratch = torch.zeros(
        (-(-max(lengths) // bs) * 2, *engine.kv.block_shape), dtype=engine.kv.dtype, device=engine.kv.device
    )
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
    return WorkerPerf(
        prefill_a=fit.a,
        prefill_b=fit.b,
        prefill_q=fit.q,
        decode_step_s=(time.perf_counter() - started) / 5,
        copy_bytes_per_s=_copy_rate(engine.kv.device),
    )


def _copy_rate(device: torch.device) -> float:
    """Bytes per second of a warm copy into the gpu tier's memory: the floor of loading a block."""
    src = torch.ones(16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return src.numel() / best
