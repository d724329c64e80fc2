"""The serving workload of a chaos run: prompts in flight, every answer checked against a recompute."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from tiercake.conductor.client import Client, ConductorError

if TYPE_CHECKING:
    from tiercake.workers.reference.runner import ModelRunner

MAX_TOKENS = 4


class Oracle:
    """Greedy answers computed from scratch, in this process: the reference model over a gpu tier of
    its own, nothing cached, no conductor, no node."""

    def __init__(self, config) -> None:
        self.config = config
        self._engine: ModelRunner | None = None
        self._answers: dict[tuple[int, ...], str] = {}
        self._lock = asyncio.Lock()  # one sequence at a time: the engine's tier is small
        self._computed = 0

    async def answer(self, prompt: list[int], max_tokens: int) -> str:
        key = (*prompt, -max_tokens)
        if key not in self._answers:
            async with self._lock:
                if key not in self._answers:
                    self._answers[key] = await self._compute(prompt, max_tokens)
        return self._answers[key]

    async def _compute(self, prompt: list[int], max_tokens: int) -> str:
        from tiercake.workers.reference.model import decode
        from tiercake.workers.reference.runner import next_token

        engine = await self._engine_once()
        self._computed += 1  # a tenant of its own each time: nothing computed before is reused
        seq = await engine.prefill(prompt, tenant=f"oracle-{self._computed}", max_new_tokens=max_tokens)
        out: list[int] = []
        try:
            while len(out) < max_tokens:
                out.append(next_token(seq.logits))
                if len(out) < max_tokens:
                    await engine.decode([seq], [out[-1]])
        finally:
            engine.free(seq)
        assert seq.stats.cached_tokens == 0
        return decode(out)

    async def _engine_once(self):
        if self._engine is None:
            import torch

            from tiercake.tiers import GpuBackend, GpuBlockPool, Tier, TieredStore
            from tiercake.workers.reference.model import ReferenceModel
            from tiercake.workers.reference.runner import ModelRunner

            serving = self.config.serving
            layout = serving.layout()
            pool = GpuBlockPool(64, layout.shape, getattr(torch, layout.dtype), "cpu")
            store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=layout.nbytes).open()
            self._engine = ModelRunner(
                ReferenceModel(serving.model),
                store,
                self.config.serving_namespace(),
                worker_id="oracle",
                max_context=serving.max_context,
            )
        return self._engine


@dataclass
class Tally:
    ok: int = 0
    wrong: int = 0
    failed: int = 0  # after the retries a client makes (RETRIES)
    retried: int = 0
    errors: list[str] = field(default_factory=list)
    last_ok: float = 0.0  # monotonic time of the latest correct answer
    served: list[tuple[float, int, int]] = field(default_factory=list)  # (when, prompt tokens, cached tokens)

    def rate(self, since: float, until: float) -> float:
        """Correct answers per second in [since, until)."""
        return sum(since <= at < until for at, _, _ in self.served) / (until - since)

    def hit_ratio(self, since: float, until: float) -> float | None:
        """Cached prompt tokens over prompt tokens of the requests answered in [since, until)."""
        window = [(p, c) for at, p, c in self.served if since <= at < until]
        prompt = sum(p for p, _ in window)
        return sum(c for _, c in window) / prompt if prompt else None


RETRIES = 5  # a request's tries after its first, as OpenAI's client makes them (on 408, 429, 5xx, a lost connection)
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


class Load:
    """Requests from the trace, ``concurrency`` in flight, each answer checked by the oracle."""

    def __init__(
        self, url: str, oracle: Oracle, prompts: list[tuple[list[int], str | None]], concurrency: int = 2
    ) -> None:
        self.url, self.oracle, self.prompts, self.concurrency = url, oracle, prompts, concurrency
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._busy = 0
        self._tasks: list[asyncio.Task] = []

    async def pause(self) -> None:
        """No new requests until ``resume``; returns once those in flight are done."""
        self._running.clear()
        while self._busy:
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        self._running.set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(i)) for i in range(self.concurrency)]

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        self._stop.set()
        self._running.set()
        await asyncio.gather(*self._tasks)

    async def _run(self, lane: int) -> None:
        rng = random.Random(lane)
        async with Client([self.url], timeout=60, retries=1) as client:
            while not self._stop.is_set():
                await self._running.wait()
                prompt, tenant = self.prompts[rng.randrange(len(self.prompts))]
                self._busy += 1
                try:
                    await self.one(client, prompt, tenant)
                finally:
                    self._busy -= 1

    async def one(self, client: Client, prompt: list[int], tenant: str | None) -> bool:
        tally = self.tally
        answer = await self._asked(client, prompt, tenant)
        if answer is None:
            return False
        if answer["choices"][0]["text"] != await self.oracle.answer(prompt, MAX_TOKENS):
            tally.wrong += 1
            tally.errors.append(f"WRONG answer for a {len(prompt)}-token prompt of {tenant}")
            return False
        tally.ok += 1
        tally.last_ok = time.monotonic()
        usage = answer["usage"]
        tally.served.append(
            (
                tally.last_ok,
                usage["prompt_tokens"],
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            )
        )
        return True

    async def _asked(self, client: Client, prompt: list[int], tenant: str | None) -> dict | None:
        """The answer, after as many retries as a client makes, backing off (None: it failed)."""
        tally = self.tally
        for attempt in range(RETRIES + 1):
            try:
                return await client.complete(prompt, max_tokens=MAX_TOKENS, tenant=tenant)
            except ConductorError as exc:
                error: Exception = exc
                if exc.status not in RETRYABLE:
                    break
            except (TimeoutError, aiohttp.ClientError) as exc:
                error = exc
            if attempt < RETRIES:
                tally.retried += 1
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
        tally.failed += 1
        tally.errors.append(str(error)[:160])
        await asyncio.sleep(0.2)  # a failing cluster is not hammered
        return None
