"""The front's side of the worker contract: ``POST /generate`` on a worker, its NDJSON lines parsed
into ``TokenEvent``s, and every failure typed by what the caller may do about it:

- ``WorkerUnavailable``: the worker could not be reached, or failed before its first token (5xx):
  another worker may serve the request (the one retry rule of the dispatcher). ``RequestFailed``, a
  kind of it: the worker is alive and answered that this request failed (a 5xx it wrote): the worker
  is not at fault until other workers serve other requests and this one fails everywhere.
- ``WorkerRefused``: the worker refused the request as malformed (4xx): no other worker will take it.
- ``StreamBroken``: the worker failed after some tokens: the client's response is already under way.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import aiohttp
from pydantic import ValidationError

from tiercake import dead_peer
from tiercake.errors import parse_error
from tiercake.messages import ErrorReply, GenerateRequest, MemberInfo, SessionCommand, TokenEvent


class WorkerError(Exception):
    def __init__(self, worker: str, message: str) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker


class WorkerUnavailable(WorkerError):
    """Retryable on another worker: nothing reached the client yet."""


class WorkerBusy(WorkerUnavailable):
    """Alive, but with no room for the request now (its gpu tier is held by running sequences):
    another worker may take it, and this one will again soon."""


class RequestFailed(WorkerUnavailable):
    """The worker answered, with a server error for this request: it is up; the request may be what
    fails (the dispatcher tries it on one more worker, and does not sideline this one)."""


class WorkerRefused(WorkerError):
    """The request itself is wrong (the worker's 4xx): not retryable."""

    def __init__(self, worker: str, status: int, message: str) -> None:
        super().__init__(worker, message)
        self.status, self.reason = status, message


class StreamBroken(WorkerError):
    """The worker failed mid-stream."""


class WorkerClient:
    def __init__(self, token: str | None = None, ssl=None) -> None:
        self._http: aiohttp.ClientSession | None = None
        self.token = token  # the cluster's control token: workers take work only from who holds it
        self.ssl = ssl  # what https workers are verified with (None: the system's CAs)

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            # a worker that stops acknowledging (its replies dropped) is left in seconds (dead_peer);
            # a connection not made in 2 s survives one lost SYN and no more
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=60),
                headers=headers,
                connector=dead_peer.connector(self.ssl),
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def change_session(self, member: MemberInfo, command: SessionCommand) -> None:
        """Have the worker that ran a session's last turn tell its tiers of a change.
        ``WorkerUnavailable``: it could not be reached; ``WorkerRefused``: it said no (404: it does
        not know the session; 501: its engine cannot)."""
        try:
            resp = await self.http().post(
                member.url + "/session", data=command.model_dump_json(), headers={"Content-Type": "application/json"}
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise WorkerUnavailable(member.node_id, repr(exc)) from exc
        async with resp:
            if resp.status >= 400:
                error = parse_error(await resp.json(content_type=None), resp.status)
                raise WorkerRefused(member.node_id, resp.status, error.message)

    async def generate(self, member: MemberInfo, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """The worker's events. Before the first: ``WorkerUnavailable`` or ``WorkerRefused``; after
        it: ``StreamBroken``."""
        worker = member.node_id
        body = request.model_dump_json(exclude_defaults=True)
        try:
            resp = await self.http().post(
                member.url + "/generate", data=body, headers={"Content-Type": "application/json"}
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise WorkerUnavailable(worker, repr(exc)) from exc
        async with resp:
            if resp.status >= 400:
                try:
                    error = parse_error(await resp.json(content_type=None), resp.status)
                except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                    raise WorkerUnavailable(worker, f"HTTP {resp.status}: {exc!r}") from exc
                if resp.status < 500:
                    raise WorkerRefused(worker, resp.status, error.message)
                if error.code == "worker_busy":
                    raise WorkerBusy(worker, error.message)
                raise RequestFailed(worker, error.message)
            emitted = 0
            try:
                async for line in resp.content:
                    if line.strip():
                        event = _event(line)
                        emitted += 1
                        yield event
            except (TimeoutError, aiohttp.ClientError, _BadLine) as exc:
                message = str(exc) if isinstance(exc, _BadLine) else f"failed mid-stream: {exc!r}"
                raise (StreamBroken if emitted else WorkerUnavailable)(worker, message) from exc
            if not emitted:
                raise WorkerUnavailable(worker, "answered with no token")


class _BadLine(Exception):
    """A line that is not an event: the worker's error line, or garbage."""


def _event(line: bytes) -> TokenEvent:
    try:
        data = json.loads(line)
        if isinstance(data, dict) and "error" in data:
            raise _BadLine(ErrorReply.model_validate(data).error.message)
        return TokenEvent.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise _BadLine(f"sent a malformed event: {exc}") from None
