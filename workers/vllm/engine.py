"""``VllmEngine``: a vLLM OpenAI server behind tiercake's worker contract, so that tiercake's front
routes across vLLM instances with the same routers, dispatcher and retry rule as across its own
workers.

A worker process (``tiercake worker --engine vllm --vllm-url URL``) stands beside one vLLM server that
runs the TiercakeConnector (``process.serve_command``). At start it

- learns from one probe request how the instance keys its blocks (the connector's namespace, block
  bytes and the node it saves to) and announces it (``KVSpace``): the front keys prompts the same
  way, so it sees what this instance and the nodes hold;
- fits the instance's prefill and decode timings from a few probe prompts (the router's TTFT model).

Then each ``GenerateRequest`` goes to vLLM's ``/v1/completions`` as token ids, with the tenant's
index tenant and salt for the connector and a cache salt for vLLM's own prefix cache, and the tokens
come back as ``TokenEvent``s. A streamed answer's reuse figures come with its last event (vLLM tells
them only at the end); a one-token request (a prefill for a decode worker) is asked whole, so its
one event has them all.

The worker's account of vLLM's own prefix cache is reported to the index as its gpu tier, so routing
prefers the instance that holds a prompt's prefix. Where vLLM publishes its KV events (the connector
says where, ``process.kv_events_config``), it is exact: ``events.EventMirror`` follows them. Otherwise
``PrefixMirror`` estimates it: the blocks of the prompts sent to the instance, least recently used out
first, bounded by its KV blocks, as SGLang's router keeps one of what it sent to each worker. Either
way, a block that is not where the index says costs a load from the tiers or a recompute, never a
wrong token.

For a prefill with a handoff (P/D), the event is sent once the prompt's full blocks are indexed on
the node the instance saves to (the contract's rule), so the decode instance's connector finds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec

from tiercake.blocks import BlockKey, Namespace, block_keys
from tiercake.conductor.client import Client, ConductorError, NodeDirectory
from tiercake.messages import (
    GenerateRequest,
    KVHandoff,
    KVSpace,
    PrefillStats,
    SessionCommand,
    TokenEvent,
    TokenLogprob,
    WorkerLoadReply,
    WorkerPerf,
)
from tiercake.started import started
from tiercake.tiers import BlockChange
from tiercake.transfer import TransferEngine

from ..conductor_link import HeldBlocks
from ..contract import ServingEngine
from ..sessions import SessionNotifier
from .events import EventMirror, EventsEndpoints
from .server_api import VllmServer, VllmUnavailable

log = logging.getLogger(__name__)

PROBE_TENANT = "tiercake-probe"  # the probes' blocks are indexed apart from every real tenant
EVENTS_WAIT_S = 10.0  # the most the worker waits at start for the KV events of its probes
HANDOFF_WAIT_S = 10.0  # the most a prefill waits for its blocks to be indexed on the node


class PrefixMirror:
    """What vLLM's own prefix cache probably holds: the prompts' blocks, least recently used out
    first, at most ``capacity`` blocks. Reported like a store's gpu tier (``HeldBlocks``)."""

    tier = "gpu"

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity, self.block_bytes = capacity, block_bytes
        self.listeners: list[Callable[[BlockChange], None]] = []
        self._blocks: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def touch(self, tenant: str, keys: Sequence[bytes]) -> None:
        """``keys`` (a prompt's full blocks, in chain order) are now in vLLM's cache, the newest."""
        for key in keys:
            copy = (tenant, key)
            if copy in self._blocks:
                self._blocks.move_to_end(copy)
            else:
                self._blocks[copy] = None
                self._tell(tenant, key, True)
        while len(self._blocks) > self.capacity:
            (tenant, key), _ = self._blocks.popitem(last=False)
            self._tell(tenant, key, False)

    def holdings(self) -> list[BlockChange]:
        return [BlockChange(key, self.tier, self.block_bytes, tenant, True) for tenant, key in self._blocks]

    def _tell(self, tenant: str, key: bytes, added: bool) -> None:
        change = BlockChange(key, self.tier, self.block_bytes, tenant, added)
        for listener in self.listeners:
            listener(change)


def cache_salt(salt: str) -> str | None:
    """vLLM's ``cache_salt`` for a tiercake salt: a digest (vLLM takes at most 128 characters, without
    '@', '/' or '\\'), distinct per salt, so tenants never share vLLM's own prefix cache either."""
    return hashlib.blake2b(salt.encode(), digest_size=16).hexdigest() if salt else None


def token_id(name: str) -> int:
    """A token as vLLM names it with ``return_tokens_as_token_ids`` (``token_id:123``)."""
    return int(name.rpartition(":")[2])


class VllmEngine(ServingEngine):
    """See the module docstring."""

    name = "vllm"

    def __init__(
        self,
        url: str,
        client: Client | None = None,
        *,
        timeout_s: float = 600.0,
        wait_s: float = 0.0,
        transfer: TransferEngine | None = None,
    ) -> None:
        """``wait_s``: how long to wait for the vLLM server to answer at start (0: it must be up; a
        sidecar started with vLLM waits while vLLM loads its model). ``transfer``: the engine that
        tells the node of the control API's session changes (it closes with this engine); without
        it those changes answer 501."""
        self.vllm = VllmServer(url, timeout_s)
        self.url = self.vllm.url
        self.wait_s = wait_s
        self.client = client  # the conductor: where a prefill's handoff waits for its blocks
        self.transfer = transfer
        self.sessions: SessionNotifier | None = None  # once the node the connector saves to is known
        self.model = ""
        self.space: KVSpace | None = None
        self.node: str | None = None  # where the connector saves
        self.mirror: PrefixMirror | EventMirror | None = None
        self._events_task: asyncio.Task | None = None
        self._perf = WorkerPerf()
        self._kv_blocks = 0
        self._in_flight = 0
        self._completed = 0

    async def start(self) -> VllmEngine:
        self.vllm.open()
        try:
            self.model = await self.vllm.served_model(self.wait_s)
            self._kv_blocks = await self.vllm.num_kv_blocks()
            rng, salt = random.Random(), f"probe-{random.getrandbits(64):016x}"
            events = await self._learn_space(rng, salt)
            mirror = self._follow_events(events) if events is not None else None
            await self._fit(rng, salt)
            if mirror is not None and events is not None:  # (one is None exactly when the other is)
                await self._events_flowing(mirror, events)
        except BaseException:
            await self.close()
            raise
        if events is None:
            self.mirror = PrefixMirror(self._kv_blocks, self._space.block_bytes)
        if self.transfer is not None and self.node is not None and self.client is not None:
            self.sessions = SessionNotifier(None, self.transfer, self.node, NodeDirectory(self.client, self.transfer))
        log.info(
            "vllm worker: %s serves %s with %d KV blocks of %d bytes, saving to %s; its cache %s; fitted %s",
            self.url,
            self.model,
            self._kv_blocks,
            self._space.block_bytes,
            self.node,
            "from its KV events" if events else "estimated from the prompts sent",
            self._perf,
        )
        return self

    @property
    def _space(self) -> KVSpace:
        """How vLLM keys its blocks (``start`` learns it from the first probe)."""
        return started(self.space, "the vLLM worker")

    def _follow_events(self, where: EventsEndpoints) -> EventMirror:
        self.mirror = mirror = EventMirror(
            self._space.namespace, self._space.block_bytes, max_blocks=4 * self._kv_blocks or 1 << 20
        )
        self._events_task = task = asyncio.create_task(mirror.follow(where), name="vllm-kv-events")
        task.add_done_callback(self._events_ended)
        return mirror

    def _events_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "vllm worker: following %s's KV events stopped (%s): what it caches is no longer "
                "reported as it changes",
                self.url,
                task.exception(),
            )

    async def _events_flowing(self, mirror: EventMirror, where: EventsEndpoints) -> None:
        """The fit's probes stored blocks: their events must have come (else the endpoints are wrong)."""
        try:
            await asyncio.wait_for(mirror.batches.wait(), EVENTS_WAIT_S)
        except TimeoutError:
            task = self._events_task
            failed = task is not None and task.done() and not task.cancelled() and task.exception()
            raise VllmUnavailable(
                f"vLLM at {self.url} says it publishes KV events at {where.endpoint}, but none came within "
                f"{EVENTS_WAIT_S:g} s" + (f" ({failed})" if failed else "") + ": check its --kv-events-config "
                "(process.serve_command sets it up)"
            ) from None

    async def _learn_space(self, rng: random.Random, salt: str) -> EventsEndpoints | None:
        """How the instance keys its blocks, from a first probe's figures; where it publishes its KV
        events, if it does."""
        first = await self.vllm.complete(self._probe([rng.randrange(3, 200) for _ in range(8)], 1, salt))
        figures = (first.get("kv_transfer_params") or {}).get("tiercake")
        if not figures or "namespace" not in figures:
            raise ValueError(
                f"vLLM at {self.url} does not run the TiercakeConnector (no tiercake figures in "
                "its answer): start it with process.serve_command's --kv-transfer-config"
            )
        self.space = KVSpace(
            namespace=Namespace.model_validate(figures["namespace"]), block_bytes=figures["block_bytes"]
        )
        self.node = figures.get("node")
        return msgspec.convert(figures["kv_events"], EventsEndpoints) if figures.get("kv_events") else None

    async def _fit(self, rng: random.Random, salt: str) -> None:
        """prefill = a + b*t from the fastest of two tries at two lengths, and one decode step from a
        longer answer (each probe a prompt never seen: a per-start salt)."""
        bs = self._space.namespace.block_size
        short, long_ = 2 * bs + 1, 16 * bs + 1
        timed: dict[int, float] = {}
        for length in (short, long_, short, long_):
            tokens = [rng.randrange(3, 200) for _ in range(length)]
            started = time.perf_counter()
            await self.vllm.complete(self._probe(tokens, 1, salt))
            timed[length] = min(timed.get(length, float("inf")), time.perf_counter() - started)
        b = max((timed[long_] - timed[short]) / (long_ - short), 1e-7)
        a = max(timed[short] - b * short, 1e-4)
        started = time.perf_counter()
        await self.vllm.complete(self._probe([rng.randrange(3, 200) for _ in range(short)], 9, salt))
        step = max((time.perf_counter() - started - timed[short]) / 8, 1e-4)
        self._perf = WorkerPerf(prefill_a=a, prefill_b=b, decode_step_s=step)

    def _probe(self, tokens: list[int], max_tokens: int, salt: str) -> dict:
        """A request under the probes' own tenant, whole, never ended early by an end-of-sequence token."""
        request = GenerateRequest(tokens=tokens, max_tokens=max_tokens, tenant=PROBE_TENANT, salt=salt)
        return self._body(request, stream=False) | {"ignore_eos": True}

    # The contract -------------------------------------------------------------------------------

    @property
    def perf(self) -> WorkerPerf:
        return self._perf

    @property
    def store(self) -> None:
        return None  # vLLM owns its KV cache

    @property
    def held(self) -> HeldBlocks | None:
        return self.mirror

    @property
    def kv_space(self) -> KVSpace | None:
        return self.space

    @property
    def gpu_capacity_bytes(self) -> int:
        return self._kv_blocks * (self.space.block_bytes if self.space else 0)

    def load(self) -> WorkerLoadReply:
        return WorkerLoadReply(running=self._in_flight, blocks=self._kv_blocks, completed=self._completed)

    async def close(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()
            await asyncio.gather(self._events_task, return_exceptions=True)
        await self.vllm.close()
        if self.sessions is not None:
            await self.sessions.close()
        if self.transfer is not None:
            await self.transfer.close()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self._in_flight += 1
        if isinstance(self.mirror, EventMirror):  # so that the blocks vLLM stores for it can be keyed
            salt = self._salt(request)
            self.mirror.remember(cache_salt(salt), request.tenant, salt)
        answer: list[int] = []
        try:
            events = self._one_event(request) if request.max_tokens == 1 else self._stream(request)
            async for event in events:
                answer.append(event.token)
                if event.finish_reason is not None:  # before it goes: the caller stops reading at the last
                    self._completed += 1
                    prompt = self._keys(request) if isinstance(self.mirror, PrefixMirror) else []
                    if isinstance(self.mirror, PrefixMirror):
                        self.mirror.touch(request.tenant, prompt)
                    if request.session is not None and self.sessions is not None:
                        # what the connector paused the session with: for the control API's changes
                        self.sessions.remember(request.session, self._keys(request, answer, known=prompt))
                yield event
        finally:
            self._in_flight -= 1

    # Requests to vLLM ---------------------------------------------------------------------------

    def _salt(self, request: GenerateRequest) -> str:
        return request.tenant if request.salt is None else request.salt

    def _keys(
        self, request: GenerateRequest, answer: Sequence[int] = (), known: Sequence[BlockKey] = ()
    ) -> list[BlockKey]:
        """The prompt's full blocks (and ``answer``'s after it) as the connector keys them; ``known``:
        the prompt's, hashed before."""
        namespace = self._space.namespace.model_copy(update={"tenant_salt": self._salt(request)})
        return block_keys(namespace, [*request.tokens, *answer], known=known)

    def change_session(self, command: SessionCommand) -> None:
        if self.sessions is None:
            why = "it has no cluster secret" if self.transfer is None else "it does not know its connector's node"
            raise NotImplementedError(f"this vLLM worker cannot tell its node of session changes: {why}")
        self.sessions.changed(command.session, command.tenant)

    def _body(self, request: GenerateRequest, stream: bool) -> dict:
        salt = self._salt(request)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.tokens,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": stream,
            "return_token_ids": True,
            "cache_salt": cache_salt(salt),
            "kv_transfer_params": {"tiercake": {"tenant": request.tenant, "salt": salt}},
        }
        if request.session is not None:  # the connector tells the node's tiers of the conversation
            body["kv_transfer_params"]["tiercake"]["session"] = request.session.model_dump(exclude_defaults=True)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.logprobs is not None:
            body |= {"logprobs": request.logprobs, "return_tokens_as_token_ids": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _one_event(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """A one-token request, asked whole: its event has the final figures (and, for a prefill with
        a handoff, where the prompt's blocks are)."""
        started = time.perf_counter()
        reply = await self.vllm.complete(self._body(request, stream=False))
        choice = reply["choices"][0]
        token = choice["token_ids"][0]
        elapsed, bs = time.perf_counter() - started, self._space.namespace.block_size
        stats = _prefill_stats(
            request, reply.get("usage") or {}, reply.get("kv_transfer_params"), elapsed, bs, self.node
        )
        handoff = await self._handoff(request) if request.handoff else None
        yield TokenEvent(
            token=token,
            index=0,
            finish_reason=choice.get("finish_reason") or "length",
            stats=stats,
            handoff=handoff,
            **_scores(choice.get("logprobs"), 0),
        )

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """The first token as soon as it comes; later ones one behind, so that the last carries the
        finish reason and the reuse figures of the usage chunk that follows it."""
        started, first_s = time.perf_counter(), 0.0
        index, finish = 0, None
        held: TokenEvent | None = None
        usage: dict = {}
        async with await self.vllm.post(self._body(request, stream=True)) as resp:
            async for line in resp.content:
                data = line.strip().removeprefix(b"data: ")
                if not data or data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise VllmUnavailable(f"vLLM at {self.url}: {chunk['error'].get('message')}")
                if not chunk.get("choices"):  # the usage chunk, after the last token
                    usage = chunk.get("usage") or {}
                    continue
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
                for i, token in enumerate(ids):
                    if held is not None:
                        yield held
                    held = TokenEvent(token=token, index=index, **_scores(choice.get("logprobs"), i))
                    index += 1
                    if held.index == 0 and not (finish and i == len(ids) - 1):  # not also the last
                        first_s = time.perf_counter() - started
                        yield held.model_copy(
                            update={
                                "stats": PrefillStats(prompt_tokens=len(request.tokens), final=False, compute_s=first_s)
                            }
                        )
                        held = None
        if held is None:
            raise VllmUnavailable(f"vLLM at {self.url} ended the answer without its last token")
        elapsed, bs = first_s or time.perf_counter() - started, self._space.namespace.block_size
        stats = _prefill_stats(request, usage, None, elapsed, bs, self.node)
        yield held.model_copy(update={"finish_reason": finish or "length", "stats": stats})

    async def _handoff(self, request: GenerateRequest) -> KVHandoff | None:
        """Where the decode worker finds the prompt's full blocks: the node the connector saves to, once
        the index shows them there (at most ``HANDOFF_WAIT_S``; then as many as it shows)."""
        if self.node is None or self.client is None:
            return None
        keys = self._keys(request)
        deadline, held = time.monotonic() + HANDOFF_WAIT_S, 0
        while keys:
            try:
                found = await self.client.lookup(request.tenant, keys)
                held = found[self.node].length if self.node in found else 0
            except ConductorError as exc:
                log.warning("vllm worker: lookup for a handoff failed: %s", exc)
            if held >= len(keys) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        return KVHandoff(node=self.node, blocks=held, tier="tiercake")


def _prefill_stats(
    request: GenerateRequest, usage: dict, transfer: dict | None, compute_s: float, block_size: int, node: str | None
) -> PrefillStats:
    """The request's reuse: vLLM's cached tokens, split into its own cache's and the connector's
    loads when the connector's figures are there (a whole answer; a stream has only the total)."""
    bs = block_size
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    figures = (transfer or {}).get("tiercake") or {}
    loaded = figures.get("loaded_tokens", 0)
    sources = {"gpu": (cached - loaded) // bs} if transfer else {"vllm": cached // bs}
    if loaded:
        sources[f"{node}:tiercake"] = loaded // bs
    return PrefillStats(
        prompt_tokens=len(request.tokens),
        cached_tokens=cached,
        sources={k: v for k, v in sources.items() if v},
        block_size=bs,
        load_s=figures.get("load_s", 0.0),
        load_bytes=figures.get("load_bytes", 0),
        load_tier="tiercake" if loaded else None,
        compute_s=compute_s,
    )


def _scores(logprobs: dict | None, i: int) -> dict:
    """Token ``i`` of a chunk's log-probabilities, as TokenEvent fields (none when not asked)."""
    if not logprobs or i >= len(logprobs.get("token_logprobs") or ()):
        return {}
    top = (logprobs.get("top_logprobs") or [None] * (i + 1))[i] or {}
    alternatives = sorted(
        (TokenLogprob(token=token_id(name), logprob=lp) for name, lp in top.items()), key=lambda a: -a.logprob
    )
    return {"logprob": logprobs["token_logprobs"][i], "top_logprobs": alternatives}
