"""The OpenAI adapter: ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed) and
``/v1/models``. It parses and checks the request into one ``Ask`` (a chat's messages through the chat
template), resolves the tenant, keys each prompt once, hands the dispatcher one ``Job`` per answer (a
prompt's ``n`` answers, for every prompt of a list), runs them together as ``Answer``s and renders
what comes back in the endpoint's shape (``openai_models.py``). The first tokens decide the HTTP
status: a failure before every answer has its first is a plain error response; after, the response
is under way and a failure ends it with an error (an ``error`` event and ``[DONE]`` on a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from aiohttp import web
from pydantic import ValidationError

from tiercake.blocks import block_keys
from tiercake.config import TiercakeConfig
from tiercake.errors import ApiError, invalid, parse_body
from tiercake.messages import TokenEvent
from tiercake.tokenizer import Tokenizer, load_tokenizer

from .dispatch import Dispatcher, Job
from .openai_models import (
    ChatCompletionRequest,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    Stopper,
    stop_strings,
)
from .serving_stats import ServingStats
from .sessions import session_of
from .tenants import Quotas, Tenants
from .worker_client import StreamBroken, WorkerError

# API keys, not control tokens; an entry ending in "/" opens every path under it
OPEN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/")
TENANT = web.RequestKey("tiercake_tenant", str)  # the request's tenant, once known


@dataclass(slots=True)
class Ask:
    """What either endpoint asks for, once parsed: the prompts as token ids and how to answer them."""

    model: str
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: list[str]
    stop_ids: frozenset[int]
    top_p: float
    logprobs: int | None  # alternatives per token; None: no log-probabilities
    tokenizer: Tokenizer
    session_key: str | None = None  # the body's name for the session (prompt_cache_key, else user)

    def stopper(self) -> Stopper:
        return Stopper(self.stop, self.stop_ids, self.tokenizer.detokenizer())

    def seed_of(self, choice: int) -> int | None:
        """Answer j of a prompt samples with seed+j: n answers differ, and each is reproducible."""
        return None if self.seed is None else self.seed + choice


def _ask(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int | None,
    tokenizer: Tokenizer,
) -> Ask:
    """The parts both requests share, taken the same way."""
    return Ask(
        req.model,
        prompts,
        req.n,
        max_tokens,
        req.temperature,
        req.seed,
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        stop_strings(req.stop),
        frozenset(req.stop_token_ids or ()),
        req.top_p,
        logprobs,
        tokenizer,
        req.prompt_cache_key if req.prompt_cache_key is not None else req.user,
    )


def completion_ask(raw: bytes, tokenizer: Tokenizer) -> Ask:
    req = parse_body(CompletionRequest, raw, "invalid request")
    try:
        prompts = req.prompts(tokenizer)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="prompt") from None
    return _ask(req, prompts, req.max_tokens, req.logprobs, tokenizer)


def chat_ask(raw: bytes, tokenizer: Tokenizer) -> Ask:
    req = parse_body(ChatCompletionRequest, raw, "invalid request")
    try:
        limit, alternatives = req.limit(), req.alternatives()
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    prompt = tokenizer.chat([(m.role, m.content) for m in req.messages])
    return _ask(req, [prompt], limit, alternatives, tokenizer)


class Answer:
    """One choice as it is produced: its job, the worker's token stream, the text it makes (held back
    where a stop string may begin) and, when asked for, each token's log-probabilities."""

    def __init__(self, index: int, job: Job, events: AsyncGenerator[TokenEvent, None], ask: Ask) -> None:
        self.index, self.job, self.events = index, job, events
        self.stopper = ask.stopper()
        self.with_logprobs = ask.logprobs is not None
        self.tokenizer = ask.tokenizer
        self.generated = 0
        self.finish: str | None = None
        self.scored: list[TokenEvent] = []  # tokens with their log-probabilities, in order
        self.offsets: list[int] = []  # where each scored token's text begins

    def take(self, event: TokenEvent) -> str:
        """The text ``event`` makes safe to show; ``finish`` is set once the answer ended."""
        self.generated += 1
        if self.with_logprobs and event.token not in self.stopper.stop_ids:
            self.scored.append(event)
            self.offsets.append(self.stopper.decoded)
        text = self.stopper.feed(event.token)
        if self.stopper.stopped:
            self.finish = "stop"
        elif event.finish_reason is not None:
            text += self.stopper.rest()
            self.finish = event.finish_reason
        return text

    def logprobs(self, shape, since: int = 0) -> dict | None:
        """The log-probabilities of the tokens scored from ``since`` on, in the endpoint's shape."""
        if not self.with_logprobs:
            return None
        return shape.logprobs(self.scored[since:], self.offsets[since:], self.tokenizer)

    async def close(self) -> None:
        """Ends the worker stream (stopped early, or the client went away), which frees the sequence."""
        await self.events.aclose()


# failures after the first token: the worker's, or the dispatcher's (no decode worker left)
MidStreamError = (WorkerError, ApiError)


class OpenAIApi:
    def __init__(
        self,
        config: TiercakeConfig,
        tenants: Tenants,
        dispatcher: Dispatcher,
        stats: ServingStats,
    ) -> None:
        self.config = config
        self.serving = config.serving
        self.tenants = tenants
        self.sessions = dispatcher.sessions  # the front's one book, which the router reads too
        self.quotas = Quotas(config.serving)
        self.dispatcher = dispatcher
        self.stats = stats
        self.tokenizer = load_tokenizer(config.serving.tokenizer, config.serving.model.vocab)

    def routes(self) -> list:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
        ]

    @web.middleware
    async def key_first(self, request: web.Request, handler):
        """The caller's API key checked before its body is read (the handler checks it again, cheaply):
        a stranger gets a 401, not a buffer."""
        path = request.path
        if path in OPEN_PATHS or path.startswith("/v1/models/"):
            self.tenants.of(request)
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        """The served model, once a worker that can take a prompt is a member (a 503 with Retry-After
        before: a client that lists models and then asks would otherwise get "no live worker")."""
        return web.json_response({"object": "list", "data": [self._served(request)]})

    async def model(self, request: web.Request) -> web.Response:
        """``/v1/models/{id}``: the served model by its id, else OpenAI's 404."""
        served = self._served(request)
        if request.match_info["model"] != served["id"]:
            raise ApiError(
                404,
                f"model {request.match_info['model']!r} does not exist; this cluster serves {served['id']!r}",
                "invalid_request_error",
                "model_not_found",
            )
        return web.json_response(served)

    def _served(self, request: web.Request) -> dict:
        self.tenants.of(request)
        if not self.dispatcher.can_serve():
            raise ApiError(
                503,
                f"{self.config.model_id!r} is not served yet: no worker has registered; retry",
                "server_error",
                "no_worker",
                headers={"Retry-After": "1"},
                retryable=True,
            )
        return {
            "id": self.config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "tiercake",
            "max_model_len": self.serving.max_context,
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, completion_ask, CompletionShape)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat_ask, ChatShape)

    async def _serve(self, request: web.Request, parse: Callable[[bytes, Tokenizer], Ask], shape) -> web.StreamResponse:
        with contextlib.ExitStack() as held:  # the tenant's quota, for the request's whole life
            answers: list[Answer] = []
            try:
                ask, jobs = await self._jobs(request, held, parse)
                held.callback(self._turn_ended, request, jobs)
                answers = [Answer(i, job, self.dispatcher.run(job), ask) for i, job in enumerate(jobs)]
                firsts = await _together(_first(a) for a in answers)
            except ApiError as exc:
                await _close(answers)
                self.stats.outcome(str(exc.status))
                return exc.response()
            except BaseException:
                await _close(answers)
                raise
            self.stats.outcome("ok")
            rid = f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}"
            if ask.stream:
                return await self._sse(request, rid, ask, answers, firsts, shape)
            return await self._whole(rid, ask, answers, firsts, shape)

    async def _jobs(
        self, request: web.Request, held: contextlib.ExitStack, parse: Callable[[bytes, Tokenizer], Ask]
    ) -> tuple[Ask, list[Job]]:
        """The request checked and admitted, as one job per answer (prompt i's j-th answer: job i*n+j)."""
        tenant = self.tenants.of(request)
        try:
            ask = parse(await request.read(), self.tokenizer)
        except ValidationError as exc:
            raise invalid(exc, "invalid request") from None
        if ask.model != self.config.model_id:
            raise ApiError(
                404,
                f"model {ask.model!r} does not exist; this cluster serves {self.config.model_id!r}",
                "invalid_request_error",
                "model_not_found",
            )
        vocab, several = self.tokenizer.vocab, len(ask.prompts) > 1
        for i, tokens in enumerate(ask.prompts):
            which = f"prompt {i}" if several else "the prompt"
            if not tokens:
                raise ApiError(400, f"{which} is empty", param="prompt")
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"token ids must lie in [0, {vocab}) ({which})", param="prompt")
            if len(tokens) + ask.max_tokens > self.serving.max_context:
                raise ApiError(
                    400,
                    f"{len(tokens)} prompt tokens + max_tokens {ask.max_tokens} exceed the context "
                    f"length of {self.serving.max_context} ({which})",
                    code="context_length_exceeded",
                )
        if any(not 0 <= t < vocab for t in ask.stop_ids):
            raise ApiError(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
        session = session_of(request.headers, ask.session_key, tenant)
        request[TENANT] = tenant
        held.enter_context(self.quotas.admit(tenant, ask.n * sum(len(p) + ask.max_tokens for p in ask.prompts)))
        index_tenant, salt = self.tenants.namespace(tenant)
        namespace = self.config.serving_namespace(salt)
        affinity = self.sessions.began(tenant, session) if session is not None else ()
        jobs = []
        for tokens in ask.prompts:
            keys = block_keys(namespace, tokens)  # the front's only hashing of it
            for j in range(ask.n):
                await self.stats.arrived(
                    keys, tokens, ask.max_tokens, index_tenant, session.id if session is not None else None
                )
                jobs.append(
                    Job(
                        tokens,
                        keys,
                        index_tenant,
                        salt,
                        ask.max_tokens,
                        ask.temperature,
                        ask.seed_of(j),
                        ask.top_p,
                        ask.logprobs,
                        session=session,
                        affinity=affinity,
                    )
                )
        return ask, jobs

    def _turn_ended(self, request: web.Request, jobs: list[Job]) -> None:
        """The session's turn is over (answered, failed or abandoned): the book says so."""
        session = jobs[0].session if jobs else None
        if session is not None:
            self.sessions.ended(request[TENANT], session, jobs[-1].worker, jobs[-1].prefilled_on)

    # Rendering ----------------------------------------------------------------------------------

    @staticmethod
    def _usage(ask: Ask, answers: list[Answer]) -> dict:
        """Tokens as OpenAI counts them (each prompt once, every answer's tokens); tiercake's figures
        summed over the answers' requests (``ttft_s``: the slowest first token)."""
        per_prompt = answers[:: ask.n]
        timings = [a.job.timing for a in answers]
        prompt_tokens, completion_tokens = sum(len(a.job.tokens) for a in per_prompt), sum(a.generated for a in answers)
        sources: Counter[str] = Counter()
        for t in timings:
            sources.update(t.stats.sources)
        handed = [t.decode_cached_tokens for t in timings if t.decode_cached_tokens is not None]
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(a.job.timing.stats.cached_tokens for a in per_prompt)},
            "tiercake": {
                "ttft_s": round(max(t.ttft_s for t in timings), 6),
                "route_s": round(sum(t.route_s - t.lookup_s for t in timings), 6),
                "sources": dict(sources),
                "prefilled_on": sorted({a.job.prefilled_on for a in answers if a.job.prefilled_on}),
                "lookup_s": round(sum(t.lookup_s + t.stats.lookup_s for t in timings), 6),
                "load_s": sum(t.stats.load_s for t in timings),
                "load_tier": timings[0].stats.load_tier,
                "compute_s": sum(t.stats.compute_s for t in timings),
                "prefetched_blocks": sum(t.stats.prefetched_blocks for t in timings),
                "decode_cached_tokens": sum(handed) if handed else None,
            },
        }

    async def _whole(self, rid: str, ask: Ask, answers: list[Answer], firsts: list[TokenEvent], shape) -> web.Response:
        try:
            texts = await _together(_rest(a, first) for a, first in zip(answers, firsts))
        except MidStreamError as exc:
            done = sum(a.generated for a in answers)
            if isinstance(exc, ApiError):  # the front's own refusal after the prefill (every decode worker full: a 429)
                return ApiError(exc.status, f"{exc} (after {done} tokens)", exc.kind, exc.code, exc.headers).response()
            return ApiError(502, f"{exc} (after {done} tokens)", "server_error").response()
        finally:
            await _close(answers)  # stopped early, or a client gone mid-request: the worker streams close too
        self.stats.served += 1
        choices = [
            shape.choice(a.index, text, a.finish or "length", a.logprobs(shape)) for a, text in zip(answers, texts)
        ]
        return web.json_response(
            {
                "id": rid,
                "object": shape.object,
                "created": int(time.time()),
                "model": ask.model,
                "choices": choices,
                "usage": self._usage(ask, answers),
            }
        )

    async def _sse(
        self, request: web.Request, rid: str, ask: Ask, answers: list[Answer], firsts: list[TokenEvent], shape
    ) -> web.StreamResponse:
        """One chunk per token of each answer, as its tokens come (answers interleave, told apart by
        their index), then the usage if asked for and ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        async def piece(answer: Answer, event: TokenEvent, first: bool = False) -> None:
            since = len(answer.scored)
            text = answer.take(event)  # even empty (held back): a chat's first delta names the role
            choice = shape.chunk_choice(answer.index, text, answer.finish, first, answer.logprobs(shape, since))
            await send(
                {"id": rid, "object": shape.chunk_object, "created": created, "model": ask.model, "choices": [choice]}
            )
            if answer.finish is not None:
                await answer.close()  # ended by a stop: the worker's stream closes, freeing the sequence

        pending: dict[asyncio.Future, Answer] = {}
        try:
            for answer, first in zip(answers, firsts):
                await piece(answer, first, first=True)
                if answer.finish is None:
                    pending[asyncio.ensure_future(_next(answer))] = answer
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answer = pending.pop(task)
                    await piece(answer, task.result())
                    if answer.finish is None:
                        pending[asyncio.ensure_future(_next(answer))] = answer
            if ask.include_usage:
                await send(
                    {
                        "id": rid,
                        "object": shape.chunk_object,
                        "created": created,
                        "model": ask.model,
                        "choices": [],
                        "usage": self._usage(ask, answers),
                    }
                )
            await send("[DONE]")
            self.stats.served += 1
        except MidStreamError as exc:  # a worker died mid-stream, or no decode worker has room: say so, end
            refusal = exc if isinstance(exc, ApiError) else ApiError(502, str(exc), "server_error")
            await send(json.loads(refusal.reply().model_dump_json()))
            await send("[DONE]")
        finally:  # the client went away, or a failure: closing the worker streams frees their sequences
            await _settle(pending)
            await _close(answers)
        await response.write_eof()
        return response


async def _together(awaitables) -> list:
    """Run them at once; the first failure cancels the others and is raised as itself."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _settle(tasks)


async def _settle(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close(answers: list[Answer]) -> None:
    for answer in answers:
        with contextlib.suppress(Exception):
            await answer.close()


async def _first(answer: Answer) -> TokenEvent:
    """An answer's first token: it decides the HTTP status, so a failure here is a plain error."""
    try:
        return await anext(answer.events)
    except StopAsyncIteration:
        raise ApiError(500, "the worker produced nothing", "server_error") from None
    except WorkerError as exc:
        raise ApiError(502, str(exc), "server_error") from None


async def _next(answer: Answer) -> TokenEvent:
    try:
        return await anext(answer.events)
    except StopAsyncIteration:
        raise StreamBroken("dispatcher", "the stream ended before its last token") from None


async def _rest(answer: Answer, first: TokenEvent) -> str:
    """The whole text of an answer whose first token came."""
    text = answer.take(first)
    while answer.finish is None:
        text += answer.take(await _next(answer))
    return text
