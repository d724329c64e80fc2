"""Continuous batching: requests join the running batch as soon as their prefill is done and leave it
when they finish or their client goes away; every step decodes one token for every running sequence.
Prefills run beside the batch, not in front of it: a prefill is a task whose forward passes (chunks
of the prompt) take turns with the decode steps at the engine's compute lock, so a long prompt
delays the running sequences by a chunk at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import torch

from tiercake.messages import GenerateRequest, TokenEvent, TokenLogprob

from .runner import ModelRunner, Sequence, StoreError, logprobs_of, next_token

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Running:
    request: GenerateRequest
    out: asyncio.Queue
    seq: Sequence | None = None
    generated: int = 0
    generator: torch.Generator | None = None
    cancelled: bool = False
    pending: int = 0  # the token the next decode step feeds
    started: float = field(default_factory=time.monotonic)
    prefetch: asyncio.Task | None = None  # the prefix's prefetch while the job waits (a Prefetched)


class Scheduler:
    def __init__(self, engine: ModelRunner, max_batch: int = 32, max_prefills: int = 1, prefetch: bool = False) -> None:
        self.engine = engine
        self.prefetch = prefetch  # stage a waiting job's prefix into the node's memory
        self.max_batch = max_batch
        # prefills at once: each holds its whole prompt's blocks from its start, so more than one
        # at a time would let a burst of long prompts exhaust the gpu tier that one at a time fits
        self.max_prefills = max_prefills
        self._waiting: asyncio.Queue[_Running] = asyncio.Queue()
        self._running: list[_Running] = []
        self._prefilling: set[asyncio.Task] = set()
        self._wake = asyncio.Event()  # new work or a prefill done, for an idle loop
        self._task: asyncio.Task | None = None
        self.completed = 0

    @property
    def load(self) -> dict[str, int]:
        return {"waiting": self._waiting.qsize(), "prefilling": len(self._prefilling), "running": len(self._running)}

    def start(self) -> Scheduler:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def close(self) -> None:
        for task in [self._task, *self._prefilling]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for job in self._running:
            self._finish(job, error=RuntimeError("worker shutting down"))
        self._running.clear()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Tokens as they are produced. Leaving the iteration early (a client that went away)
        frees the sequence at the next step."""
        if request.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        job = _Running(request, asyncio.Queue())
        if request.seed is not None:
            job.generator = torch.Generator().manual_seed(request.seed)
        if (
            self.prefetch
            and request.pull
            and request.source is not None
            and (not self._waiting.empty() or len(self._prefilling) >= self.max_prefills)
        ):
            # it will wait: meanwhile the node brings what it holds of the prefix only on disk into memory,
            # and the worker pulls the prefix into its gpu tier as far as there is room
            job.prefetch = asyncio.get_running_loop().create_task(
                self.engine.prefetch(request.tokens, request.tenant, request.salt, request.source)
            )
        await self._waiting.put(job)
        self._wake.set()
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled = True

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            while (
                not self._waiting.empty()
                and len(self._prefilling) < self.max_prefills
                and len(self._running) + len(self._prefilling) < self.max_batch
            ):
                job = self._waiting.get_nowait()
                if not job.cancelled:
                    task = loop.create_task(self._admit(job))
                    self._prefilling.add(task)
                    task.add_done_callback(self._prefill_done)
            self._running = [j for j in self._running if not self._drop_cancelled(j)]
            if self._running:
                await self._step()
            else:
                await self._wake.wait()  # idle: until new work arrives or a prefill is done

    def _prefill_done(self, task: asyncio.Task) -> None:
        self._prefilling.discard(task)
        self._wake.set()

    async def _admit(self, job: _Running) -> None:
        r = job.request
        try:
            # a prefetch still under way is waited for: the prefill would load the same blocks itself
            prefetched = None
            if job.prefetch is not None:
                try:
                    prefetched = await job.prefetch
                except Exception as exc:  # noqa: BLE001 - a prefetch never fails the request
                    log.info("scheduler: prefetch failed: %s", exc)
            job.seq = await self.engine.prefill(
                r.tokens,
                r.tenant,
                r.salt,
                max_new_tokens=r.max_tokens,
                pull=r.pull,
                source=r.source,
                prefetched=prefetched,
            )
        except asyncio.CancelledError:
            job.out.put_nowait(RuntimeError("worker shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            job.out.put_nowait(exc)
            return
        if self._emit_or_fail(job, first=True) and job.seq is not None:
            self._running.append(job)

    def _emit_or_fail(self, job: _Running, first: bool = False) -> bool:
        """Emit the job's next token; if that fails, the job alone ends with the error and its blocks
        go back (one bad request must never wedge the loop or leak its sequence)."""
        try:
            self._emit(job, first)
            return True
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the worker's
            log.exception("sampling a token failed")
            self._finish(job, error=exc)
            return False

    def _emit(self, job: _Running, first: bool = False) -> None:
        r, seq = job.request, job.seq
        assert seq is not None  # a job emits only while it holds its sequence
        token = next_token(seq.logits, r.temperature, job.generator, r.top_p)
        job.generated += 1
        done = job.generated >= r.max_tokens
        event = TokenEvent(
            token=token,
            index=job.generated - 1,
            stats=seq.stats if first else None,
            finish_reason="length" if done else None,
        )
        if r.logprobs is not None:
            event.logprob, top = logprobs_of(seq.logits, token, r.logprobs)
            event.top_logprobs = [TokenLogprob(token=t, logprob=lp) for t, lp in top]
        job.out.put_nowait(event)
        job.pending = token
        if done:
            self._finish(job)

    def _finish(self, job: _Running, error: BaseException | None = None) -> None:
        if error is not None:
            job.out.put_nowait(error)
        if job.seq is not None:
            self.engine.free(job.seq)
            job.seq = None
            self.completed += 1

    def _drop_cancelled(self, job: _Running) -> bool:
        if job.seq is None:
            return True
        if job.cancelled:
            self._finish(job)
            return True
        return False

    async def _step(self) -> None:
        jobs, seqs = [], []
        for job in self._running:  # room for the next token first: a full gpu tier fails one request
            if job.seq is None:  # ended meanwhile
                continue
            try:
                await self.engine.reserve(job.seq, len(job.seq.tokens) + 1)
                jobs.append(job)
                seqs.append(job.seq)
            except StoreError as exc:
                self._finish(job, error=exc)
        if not jobs:
            return
        try:
            await self.engine.decode(seqs, [j.pending for j in jobs])
        except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep serving
            log.exception("decode step failed")
            for job in jobs:
                self._finish(job, error=exc)
            self._running = []
            return
        for job in jobs:
            if job.seq is not None:
                self._emit_or_fail(job)
