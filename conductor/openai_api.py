"""The OpenAI adapter: ``/v1/completions`` (whole or streamed) and ``/v1/models``. It parses and
checks the request, resolves the tenant, keys the prompt once, hands a ``Job`` to the dispatcher and
renders what comes back in OpenAI's shapes. The first token decides the HTTP status: a failure before
it is a plain error response; after it, the response is under way and a failure ends it with an
error (an ``error`` event and ``[DONE]`` on a stream)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tiercake.blocks import block_keys
from tiercake.config import TiercakeConfig
from tiercake.errors import ApiError, invalid

from .dispatch import Dispatcher, Job
from .serving_stats import ServingStats, Timing
from .tenants import Quotas, Tenants
from .worker_client import WorkerError

OPEN_PATHS = ("/v1/completions", "/v1/models")  # API keys, not control tokens


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


# OpenAI's completion parameters this server does not honour, with the value that means "not used":
# clients that send them at that value are served; any other value is a 400 that names the parameter,
# never an answer that silently ignored it.
UNHONOURED = {"n": 1, "best_of": 1, "top_p": 1, "stop": None, "logprobs": None, "echo": False, "suffix": None,
              "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}


class CompletionRequest(BaseModel):
    """OpenAI's completion request. Unknown fields are refused (as OpenAI does); types are strict (a
    ``"16"``, ``2.0`` or ``true`` where an integer belongs is a 400, never coerced); the parameters in
    ``UNHONOURED`` are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    prompt: str | list[int] = Field(description="text, or token ids (bytes for the reference model)")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = Field(default=None, description="the caller's end user, for their logs: accepted, unused")
    n: int = 1
    best_of: int = 1
    top_p: float = 1
    stop: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    presence_penalty: float = 0
    frequency_penalty: float = 0
    logit_bias: dict[str, float] | None = None

    @field_validator(*UNHONOURED)
    @classmethod
    def _only_neutral(cls, value, info: ValidationInfo):
        neutral = UNHONOURED[info.field_name]
        if value != neutral and not (neutral is None and value in ([], {}, "")):
            raise ValueError(f"{value!r} is not supported by this server (leave it out, or send {neutral!r})")
        return value


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
        return [web.post("/v1/completions", self.completions), web.get("/v1/models", self.models)]

    async def models(self, request: web.Request) -> web.Response:
        self.tenants.of(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model_id, "object": "model", "created": 0, "owned_by": "tiercake",
             "max_model_len": self.serving.max_context}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with contextlib.ExitStack() as held:  # the tenant's quota, for the request's whole life
            try:
                req, job = await self._job(request, held)
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
            rid = f"cmpl-{uuid.uuid4().hex[:24]}"
            if req.stream:
                return await self._sse(request, rid, req, job, first, events)
            return await self._whole(rid, req, job, first, events)

    async def _job(self, request: web.Request, held: contextlib.ExitStack) -> tuple[CompletionRequest, Job]:
        tenant = self.tenants.of(request)
        try:
            req = CompletionRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            raise invalid(exc, "invalid request") from None
        if req.model != self.config.model_id:
            raise ApiError(404, f"model {req.model!r} does not exist; this cluster serves {self.config.model_id!r}",
                           "invalid_request_error", "model_not_found")
        tokens = list(req.prompt.encode("utf-8")) if isinstance(req.prompt, str) else req.prompt
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
        return req, Job(tokens, keys, index_tenant, salt, req.max_tokens, req.temperature, req.seed)

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

    @staticmethod
    def _choice(text: str, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    async def _whole(self, rid: str, req: CompletionRequest, job: Job, first: tuple[int, str | None],
                     events: AsyncIterator[tuple[int, str | None]]) -> web.Response:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, generated, finish = decoder.decode(bytes([first[0] % 256])), 1, first[1]
        try:
            async for token, finish in events:
                text += decoder.decode(bytes([token % 256]))
                generated += 1
        except MidStreamError as exc:
            return ApiError(502, f"{exc} (after {generated} tokens)", "server_error").response()
        finally:
            await events.aclose()  # a client gone mid-request: the worker's stream closes too
        text += decoder.decode(b"", final=True)
        self.stats.served += 1
        return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                  "model": req.model, "choices": [self._choice(text, finish or "length")],
                                  "usage": self._usage(job, generated)})

    async def _sse(self, request: web.Request, rid: str, req: CompletionRequest, job: Job,
                   first: tuple[int, str | None], events: AsyncIterator[tuple[int, str | None]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        created = int(time.time())

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [self._choice(text, finish)]}

        generated = 1
        try:
            await send(chunk(decoder.decode(bytes([first[0] % 256])), first[1]))
            async for token, finish in events:
                generated += 1
                await send(chunk(decoder.decode(bytes([token % 256])), finish))
            if req.stream_options and req.stream_options.include_usage:
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
