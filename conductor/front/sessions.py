"""A request's session: who it belongs to (from the headers that agent clients send, or OpenAI's
``prompt_cache_key`` and ``user``) and what its client asks of its KV (tiercake's directive headers).

Identity, first found wins:

| source | session | parent (a subagent's) |
|---|---|---|
| tiercake | ``X-Tiercake-Session`` | ``X-Tiercake-Parent-Session`` |
| NVIDIA Dynamo's canonical headers | ``X-Dynamo-Session-ID`` | ``X-Dynamo-Parent-Session-ID`` |
| Claude Code | ``X-Claude-Code-Session-ID`` (+ ``X-Claude-Code-Agent-ID`` for a subagent) | the session (+ ``X-Claude-Code-Parent-Agent-ID``) |
| Codex | ``Thread-ID`` or ``Session-ID`` | ``X-Codex-Parent-Thread-ID`` |
| OpenCode | ``X-Session-ID`` | ``X-Parent-Session-ID`` |
| OpenAI's body | ``prompt_cache_key``, else ``user`` | |

Directives (optional, need a session): ``X-Tiercake-Session-Retain`` (seconds its KV is kept while
paused), ``X-Tiercake-Session-Priority`` (-100..100, higher kept longer), ``X-Tiercake-Session-Pause``
(seconds until the next turn, e.g. a tool call's expected length), ``X-Tiercake-Session-Final`` or
``X-Dynamo-Session-Final`` (``true``: the conversation ends with this request).

Ids are hashed with the tenant (``session_hash``): never a cache key across tenants, and the client's
string goes no further than here. A bad directive is a 400 naming its header.
"""

from __future__ import annotations

import hashlib
import math

from multidict import CIMultiDictProxy

from tiercake.errors import ApiError
from tiercake.messages import MAX_SESSION_S, SessionDirective

MAX_ID = 256
# (session header, parent header): the first whose session header is present names the session
IDENTITY = (
    ("x-tiercake-session", "x-tiercake-parent-session"),
    ("x-dynamo-session-id", "x-dynamo-parent-session-id"),
    ("x-claude-code-session-id", None),  # subagents: below
    ("thread-id", "x-codex-parent-thread-id"),
    ("session-id", None),
    ("x-session-id", "x-parent-session-id"),
)
RETAIN, PRIORITY, PAUSE, FINAL = (
    "x-tiercake-session-retain",
    "x-tiercake-session-priority",
    "x-tiercake-session-pause",
    "x-tiercake-session-final",
)
FINALS = (FINAL, "x-dynamo-session-final")


def session_hash(tenant: str, session: str) -> str:
    """The tenant-scoped id the rest of tiercake knows a session by."""
    return hashlib.blake2b(f"{tenant}\0{session}".encode(), digest_size=16, person=b"tiercake-session").hexdigest()


def session_of(headers: CIMultiDictProxy[str], body_key: str | None, tenant: str) -> SessionDirective | None:
    """The request's session and its directives, or None (a directive without a session is a 400)."""
    raw, parent = _identity(headers, body_key)
    directives = {h for h in (RETAIN, PRIORITY, PAUSE, *FINALS) if h in headers}
    if raw is None:
        if directives:
            first = sorted(directives)[0]
            raise ApiError(
                400, f"{first} needs a session (X-Tiercake-Session, or an agent's session header)", param=first
            )
        return None
    return SessionDirective(
        id=session_hash(tenant, raw),
        parent=None if parent is None else session_hash(tenant, parent),
        retain_s=_seconds(headers, RETAIN, positive=True),
        priority=_priority(headers),
        pause_s=_seconds(headers, PAUSE, positive=False),
        close=any(_flag(headers, h) for h in FINALS),
    )


def _identity(headers: CIMultiDictProxy[str], body_key: str | None) -> tuple[str | None, str | None]:
    for session_header, parent_header in IDENTITY:
        session = headers.get(session_header)
        if session is None:
            continue
        _check_id(session, session_header)
        if session_header == "x-claude-code-session-id":
            return _claude_code(headers, session)
        parent = headers.get(parent_header) if parent_header else None
        if parent is not None:
            _check_id(parent, parent_header or "")
        return session, parent
    if body_key is not None:
        _check_id(body_key, "prompt_cache_key")
        return body_key, None
    return None, None


def _claude_code(headers: CIMultiDictProxy[str], session: str) -> tuple[str, str | None]:
    """A Claude Code subagent is its own session (the agent id within the root session), its parent
    the agent that started it, else the root."""
    agent = headers.get("x-claude-code-agent-id")
    if agent is None:
        return session, None
    _check_id(agent, "x-claude-code-agent-id")
    parent_agent = headers.get("x-claude-code-parent-agent-id")
    if parent_agent is not None:
        _check_id(parent_agent, "x-claude-code-parent-agent-id")
    return f"{session}/{agent}", session if parent_agent is None else f"{session}/{parent_agent}"


def _check_id(value: str, header: str) -> None:
    if not 0 < len(value) <= MAX_ID or not value.isprintable():
        raise ApiError(400, f"{header} must be 1-{MAX_ID} printable characters", param=header)


def _seconds(headers: CIMultiDictProxy[str], header: str, positive: bool) -> float | None:
    text = headers.get(header)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low_ok = value > 0 if positive else value >= 0
    if not (math.isfinite(value) and low_ok and value <= MAX_SESSION_S):
        bound = "> 0" if positive else ">= 0"
        raise ApiError(400, f"{header} must be seconds {bound} and at most {MAX_SESSION_S:.0f}", param=header)
    return value


def _priority(headers: CIMultiDictProxy[str]) -> int:
    text = headers.get(PRIORITY)
    if text is None:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 1000
    if not -100 <= value <= 100:
        raise ApiError(400, f"{PRIORITY} must be an integer from -100 to 100", param=PRIORITY)
    return value


def _flag(headers: CIMultiDictProxy[str], header: str) -> bool:
    text = headers.get(header)
    if text is None:
        return False
    if text.lower() not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{header} must be true or false", param=header)
    return text.lower() in ("true", "1")
