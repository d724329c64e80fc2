"""The one HTTP error format of every tiercake API (the front, the control API, the workers): OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (``messages.ErrorReply``), with ``retryable`` when
the same request may succeed if sent again and ``leader`` when a follower refuses a write."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from http import HTTPStatus
from typing import TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, ValidationError

from .messages import ErrorInfo, ErrorReply

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

# a body must arrive within this: a client that sends headers and then trickles (slowloris) holds a
# connection and a buffer until it does
BODY_DEADLINE_S = 30.0
# and its line and headers within this of their first byte (a slow-headers client, the same attack)
HEAD_DEADLINE_S = 10.0
# after answering a request whose body it did not read (a 408, a 401), a server reads on for this long
# before it closes the connection; aiohttp's own 10 s let a trickling client hold it that much longer
LINGER_S = 2.0
# the request bodies one HTTP server holds at once (body_reader)
BODY_BUDGET_BYTES = 64 << 20
# Small bodies (a keep-alive, a lookup) may go this far past the budget, which large ones never do: a
# fleet's re-reports once filled the budget, members' keep-alives were refused with it, their leases
# lapsed, and each lapse brought another full re-report.
SMALL_BODY_BYTES, SMALL_BODY_RESERVE = 64 << 10, 16 << 20


def app_runner(app: web.Application, **kwargs) -> web.AppRunner:
    """The ``AppRunner`` every tiercake HTTP server runs under (the linger above; aiohttp's own
    answers to requests it cannot parse in the one error format too)."""
    return _Runner(app, lingering_time=LINGER_S, **kwargs)


class _JsonErrors(RequestHandler):
    """aiohttp answers a request it cannot parse (a bad request line, header, chunk or method) before any
    handler or middleware sees it, in plain text; here in the one JSON format. And a request's head
    (its line and headers) must be whole within ``HEAD_DEADLINE_S`` of its first byte: aiohttp has no
    such deadline, and a client trickling headers held a connection for as long as it liked. A new
    connection's first head has the same deadline from the moment it is accepted (an idle one is
    closed); between requests, aiohttp's keep-alive timeout closes an idle one."""

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # a connection that sends nothing at all is held no longer than one that trickles its head
        self._head_deadline = self._loop.call_later(HEAD_DEADLINE_S, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count > heads:  # a request's head is whole: its body has BODY_DEADLINE_S
            self._stop_head_deadline()
        elif self._head_deadline is None and self._current_request is None and self.transport is not None:
            self._head_deadline = self._loop.call_later(HEAD_DEADLINE_S, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._current_request is None and self.transport is not None:
            self.logger.info("closing a connection whose request head took over %g s", HEAD_DEADLINE_S)
            self.transport.abort()

    def _stop_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_deadline()
        super().connection_lost(exc)

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        self.logger.debug("unparsable request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way: no error can follow it")
        text = "internal error" if status >= 500 else (message or HTTPStatus(status).phrase).splitlines()[0]
        resp = ApiError(status, f"unparsable request: {text}"[:300]).response()
        resp.force_close()
        return resp


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrors(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorsServer  # the same server, handing connections to _JsonErrors
        return server


# OpenAI's error types by status, for errors that name none
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error to answer with: raise it from a handler (the middleware renders it) or call
    ``response()``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
        *,
        retryable: bool = False,
        leader: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.headers, self.param = status, code, headers or {}, param
        self.kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retryable, self.leader = retryable, leader

    def reply(self) -> ErrorReply:
        return ErrorReply(
            error=ErrorInfo(
                message=str(self),
                type=self.kind,
                code=self.code,
                param=self.param,
                retryable=self.retryable,
                leader=self.leader,
            )
        )

    def response(self) -> web.Response:
        body = self.reply().model_dump_json(exclude_defaults=False)
        return web.json_response(text=body, status=self.status, headers=self.headers)


def error_response(
    status: int, message: str, kind: str | None = None, code: str | None = None, headers: dict | None = None, **extra
) -> web.Response:
    return ApiError(status, message, kind, code, headers, **extra).response()


def parse_body(model: type[M], raw: bytes, what: str = "invalid body") -> M:
    """A request body as ``model``: JSON that says one thing (a name given twice in one object is a 400,
    not the last one winning, as pydantic's parser would have it; NaN and Infinity are not numbers),
    then the model's own rules (``invalid`` names the field)."""
    try:
        json.loads(raw, object_pairs_hook=_once, parse_constant=_no_constant)
    except _Twice as exc:
        raise ApiError(400, f"{what}: {exc.name}: given twice in one object", param=exc.name) from None
    except RecursionError:  # a 100,000-deep body once answered 500
        raise ApiError(400, f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        pass  # not JSON: pydantic's parser says where
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid(exc, what) from None


class _Twice(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _once(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for name, value in pairs:
        if name in seen:
            raise _Twice(name)
        seen[name] = value
    return seen


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def invalid(exc: ValidationError, what: str = "invalid body") -> ApiError:
    """A 400 that names the first field pydantic refused, in the message and as OpenAI's ``param``."""
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own words
    return ApiError(400, f"{what}: {where + ': ' if where else ''}{message}", param=where or None)


def bearer(request: web.Request) -> str:
    """The token of ``Authorization: Bearer <token>`` ("" when there is none)."""
    header = request.headers.get("Authorization", "")
    return header[7:] if header.startswith("Bearer ") else ""


def require_bearer(request: web.Request, tokens: list[str]) -> None:
    """A 401 unless the request presents one of ``tokens`` (compared in constant time)."""
    given = bearer(request).encode()
    if not any(hmac.compare_digest(given, t.encode()) for t in tokens):
        raise ApiError(401, "a valid bearer token is required", code="invalid_token")


def bearer_guard(tokens: list[str], open_paths: tuple[str, ...] = ()):
    """Middleware: ``require_bearer`` on every path but ``open_paths`` (nothing, with no tokens)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if tokens and request.path not in open_paths:
            require_bearer(request, tokens)
        return await handler(request)

    return guard


@web.middleware
async def error_middleware(request: web.Request, handler):
    """``ApiError`` and aiohttp's own errors (unknown route, wrong method, body too large) in the one
    format; anything unexpected is a 500 in it too, never a plain-text page."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return error_response(
            exc.status,
            exc.text if exc.status == 413 and exc.text else exc.reason,
            headers={k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")},
        )
    except Exception as exc:  # noqa: BLE001 - a bug: logged, answered in the format
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}", retryable=True)


def parse_error(data: object, status: int) -> ErrorInfo:
    """The error a tiercake API answered with (a client's view; tolerant of bodies from elsewhere)."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        try:
            return ErrorReply.model_validate(data).error
        except ValueError:
            pass
    message = data.get("error", data) if isinstance(data, dict) else data
    return ErrorInfo(message=str(message), type="server_error" if status >= 500 else "invalid_request_error")


def body_reader(budget_bytes: int = BODY_BUDGET_BYTES):
    """A middleware that reads the body whole within ``BODY_DEADLINE_S`` (else a 408), before the
    handler, which then reads it from memory. Innermost, after any authentication: nobody unknown gets
    a buffer. The bodies a server holds at once (announced, being read, or held by a handler still
    running) stay within ``budget_bytes``: past it a new body is a 503 with Retry-After, before a byte
    of it is read (64 clients announcing 8 MiB bodies once held 512 MiB of a front); a small body may
    use a reserve past it (``SMALL_BODY_RESERVE``)."""
    held = 0

    @web.middleware
    async def read_body(request: web.Request, handler):
        nonlocal held
        if not request.can_read_body:
            return await handler(request)
        # a chunked body may grow to the app's limit; a larger announced one is aiohttp's 413
        charge = min(request.content_length or request.client_max_size, request.client_max_size)
        if held + charge > budget_bytes + (SMALL_BODY_RESERVE if charge <= SMALL_BODY_BYTES else 0):
            raise ApiError(
                503,
                "the server holds as many request bodies as it may; retry",
                code="busy",
                headers={"Retry-After": "1", "Connection": "close"},
                retryable=True,
            )
        held += charge
        try:
            try:
                async with asyncio.timeout(BODY_DEADLINE_S):
                    await request.read()
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {BODY_DEADLINE_S:g} s",
                    code="body_timeout",
                    headers={"Connection": "close"},
                ) from None
            return await handler(request)
        finally:
            held -= charge

    return read_body
