"""The OpenAI adapter: ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed) and
``/v1/models``. It parses and checks the request into one ``Ask`` (a chat's messages through the chat
template), resolves the tenant, keys the prompt once, hands a ``Job`` to the dispatcher and renders
what comes back in the endpoint's shape (``openai_models.py``). The first token decides the HTTP status: a failure before
it is a plain error response; after it, the response is under way and a failure ends it with an
error (an ``error`` event and ``[DONE]`` on a stream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from pydantic import ValidationError

from tiercake.blocks import block_keys
from tiercake.config import TiercakeConfig
from tiercake.errors import ApiError, invalid

from .openai_models import (
    ChatCompletionRequest, ChatShape, CompletionRequest, CompletionShape, Stopper, render, stop_strings,
)
from .dispatch import Dispatcher, Job
from .serving_stats import ServingStats, Timing
from .tenants import Quotas, Tenants
from .worker_client import WorkerError

# API keys, not control tokens; an entry ending in "/" opens every path under it
OPEN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/")


@dataclass(slots=True)
class Ask:
    """What either endpoint asks for, once parsed: the prompt as token ids and how to answer."""

    model: str
    tokens: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: list[str]
    stop_ids: frozenset[int]
    top_p: float

    def stopper(self) -> Stopper:
        return Stopper(self.stop, self.stop_ids)


def _ask(req: CompletionRequest | ChatCompletionRequest, tokens: list[int], max_tokens: int) -> Ask:
    """The parts both requests share, taken the same way."""
    return Ask(req.model, tokens, max_tokens, req.temperature, req.seed, req.stream,
               bool(req.stream_options and req.stream_options.include_usage), stop_strings(req.stop),
               frozenset(req.stop_token_ids or ()), req.top_p)


def completion_ask(raw: bytes) -> Ask:
    req = CompletionRequest.model_validate_json(raw)
    return _ask(req, list(req.prompt.encode("utf-8")) if isinstance(req.prompt, str) else req.prompt, req.max_tokens)


def chat_ask(raw: bytes) -> Ask:
    req = ChatCompletionRequest.model_validate_json(raw)
    try:
        limit = req.limit()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="max_completion_tokens") from None
    return _ask(req, list(render(req.messages).encode("utf-8")), limit)


# failures after the first token: the worker's, or the dispatcher's (no decode worker left)
MidStreamError = (WorkerError, ApiError)


class OpenAIApi:
    def __init__(self, config: TiercakeConfig, tenants: Tenants, dispatcher: Dispatcher, stats: ServingStats) -> None:
        self.config = config
        self.serving = config.serving
        self.tenants = tenants
        self.quotas = Quotas(config.serving)
        self.dispatcher = dispatcher
        self.stats = stats

    def routes(self) -> list:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models), web.get("/v1/models/{model}", self.model)]

    async def models(self, request: web.Request) -> web.Response:
        """The served model, once a worker that can take a prompt is a member (a 503 with Retry-After
        before: a client that lists models and then asks would otherwise get "no live worker")."""
        return web.json_response({"object": "list", "data": [self._served(request)]})

    async def model(self, request: web.Request) -> web.Response:
        """``/v1/models/{id}``: the served model by its id, else OpenAI's 404."""
        served = self._served(request)
        if request.match_info["model"] != served["id"]:
            raise ApiError(404, f"model {request.match_info['model']!r} does not exist; this cluster serves "
                           f"{served['id']!r}", "invalid_request_error", "model_not_found")
        return web.json_response(served)

    def _served(self, request: web.Request) -> dict:
        self.tenants.of(request)
        if not self.dispatcher.can_serve():
            raise ApiError(503, f"{self.config.model_id!r} is not served yet: no worker has registered; retry",
                           "server_error", "no_worker", headers={"Retry-After": "1"}, retryable=True)
        return {"id": self.config.model_id, "object": "model", "created": 0, "owned_by": "tiercake",
                "max_model_len": self.serving.max_context}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, completion_ask, CompletionShape)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat_ask, ChatShape)

    async def _serve(self, request: web.Request, parse: Callable[[bytes], Ask], shape) -> web.StreamResponse:
        with contextlib.ExitStack() as held:  # the tenant's quota, for the request's whole life
            try:
                req, job = await self._job(request, held, parse)
                events = self.dispatcher.run(job)
                try:
                    first = await anext(events)
                except StopAsyncIteration:
                    raise ApiError(500, "the worker produced nothing", "server_error") from None
                except WorkerError as exc:
                    raise ApiError(502, str(exc), "server_error") from None
            except ApiError as exc:
                self.stats.outcome(str(exc.status))
                return exc.response()
            self.stats.outcome("ok")
            rid = f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}"
            if req.stream:
                return await self._sse(request, rid, req, job, first, events, shape)
            return await self._whole(rid, req, job, first, events, shape)

    async def _job(self, request: web.Request, held: contextlib.ExitStack,
                   parse: Callable[[bytes], Ask]) -> tuple[Ask, Job]:
        tenant = self.tenants.of(request)
        try:
            req = parse(await request.read())
        except ValidationError as exc:
            raise invalid(exc, "invalid request") from None
        if req.model != self.config.model_id:
            raise ApiError(404, f"model {req.model!r} does not exist; this cluster serves {self.config.model_id!r}",
                           "invalid_request_error", "model_not_found")
        tokens = req.tokens
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        vocab = self.serving.model.vocab
        if any(not 0 <= t < vocab for t in tokens):
            raise ApiError(400, f"token ids must lie in [0, {vocab})")
        if len(tokens) + req.max_tokens > self.serving.max_context:
            raise ApiError(400, f"{len(tokens)} prompt tokens + max_tokens {req.max_tokens} exceed the context "
                           f"length of {self.serving.max_context}", code="context_length_exceeded")
        held.enter_context(self.quotas.admit(tenant, len(tokens) + req.max_tokens))
        index_tenant, salt = self.tenants.namespace(tenant)
        keys = block_keys(self.config.serving_namespace(salt), tokens)  # the front's only hashing of it
        await self.stats.arrived(keys, tokens, req.max_tokens, index_tenant)
        return req, Job(tokens, keys, index_tenant, salt, req.max_tokens, req.temperature, req.seed, req.top_p)

    # Rendering ----------------------------------------------------------------------------------

    def _usage(self, job: Job, generated: int) -> dict:
        timing: Timing = job.timing
        stats = timing.stats
        return {"prompt_tokens": len(job.tokens), "completion_tokens": generated,
                "total_tokens": len(job.tokens) + generated,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
                "tiercake": {"ttft_s": round(timing.ttft_s, 6), "route_s": round(timing.route_s - timing.lookup_s, 6),
                             "sources": stats.sources, "lookup_s": round(timing.lookup_s + stats.lookup_s, 6),
                             "load_s": stats.load_s, "load_tier": stats.load_tier, "compute_s": stats.compute_s,
                             "decode_cached_tokens": timing.decode_cached_tokens}}

    async def _whole(self, rid: str, req: Ask, job: Job, first: tuple[int, str | None],
                     events: AsyncIterator[tuple[int, str | None]], shape) -> web.Response:
        stopper = req.stopper()
        text, generated, finish = stopper.feed(first[0]), 1, first[1]
        try:
            if not stopper.stopped:
                async for token, finish in events:
                    generated += 1
                    text += stopper.feed(token)
                    if stopper.stopped:
                        break
        except MidStreamError as exc:
            return ApiError(502, f"{exc} (after {generated} tokens)", "server_error").response()
        finally:
            await events.aclose()  # stopped early, or a client gone mid-request: the worker's stream closes too
        if stopper.stopped:
            finish = "stop"
        else:
            text += stopper.rest()
        self.stats.served += 1
        return web.json_response({"id": rid, "object": shape.object, "created": int(time.time()),
                                  "model": req.model, "choices": [shape.choice(text, finish or "length")],
                                  "usage": self._usage(job, generated)})

    async def _sse(self, request: web.Request, rid: str, req: Ask, job: Job, first: tuple[int, str | None],
                   events: AsyncIterator[tuple[int, str | None]], shape) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        stopper = req.stopper()
        created = int(time.time())

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(text: str, finish: str | None, first: bool = False) -> dict:
            return {"id": rid, "object": shape.chunk_object, "created": created, "model": req.model,
                    "choices": [shape.chunk_choice(text, finish, first)]}

        def piece(token: int, finish: str | None) -> tuple[str, str | None]:
            """The text to send for ``token`` and the finish reason, if it ends the answer."""
            text = stopper.feed(token)
            if stopper.stopped:
                return text, "stop"
            return (text + stopper.rest(), finish) if finish is not None else (text, None)

        generated = 1
        try:
            text, finish = piece(*first)
            await send(chunk(text, finish, first=True))  # even empty: a chat's first delta names the role
            if finish is None:
                async for token, worker_finish in events:
                    generated += 1
                    text, finish = piece(token, worker_finish)
                    await send(chunk(text, finish))  # one chunk per token, as vLLM streams (text may be held back)
                    if finish is not None:
                        break
            await events.aclose()  # ended by a stop: the worker's stream closes, freeing the sequence
            if req.include_usage:
                await send({**chunk("", None), "choices": [], "usage": self._usage(job, generated)})
            await send("[DONE]")
            self.stats.served += 1
        except MidStreamError as exc:  # a worker died mid-stream: say so, end the stream
            await send(json.loads(ApiError(502, str(exc), "server_error").reply().model_dump_json()))
            await send("[DONE]")
        except (ConnectionError, asyncio.CancelledError):
            # the client went away: closing the generator closes the worker stream, which frees the
            # sequence on the worker
            await events.aclose()
            raise
        await response.write_eof()
        return response
