"""The Mooncake trace format (one JSON object per line), with optional ``tenant`` and session fields:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}
    {..., "session": "s17", "turn": 3, "pause_ms": 4200, "closes": false, "fork_of": "s9"}

A session is a conversation: each turn's prompt extends the previous turn's. ``pause_ms`` is the pause
the client announced after the turn (a tool call's expected length), ``closes`` says the session
ends with it, ``fork_of`` names the session a subagent forked from (sharing its prefix). Traces
without sessions get them from ``infer_sessions``, which reads only the past: a pause or a close the
trace does not carry stays unknown, as it is to a cache while it serves. ``oracle_announcements``
fills them from the trace's own future (the gap to the session's next turn, the last turn closing):
an upper bound to compare with, never what a client was told.

``hash_ids`` are chained ids of 512-token prefix blocks (equal ids: a reusable prefix), so
``len(hash_ids) == ceil(input_length / 512)``. Readers validate every line and name the one that is
wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not valid in the format (the message names the file and line)."""


class TraceRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    timestamp: int = Field(ge=0, description="arrival, in milliseconds")
    input_length: int = Field(gt=0)
    output_length: int = Field(ge=0)
    hash_ids: tuple[int, ...] = Field(min_length=1)
    tenant: str | None = None
    session: str | None = Field(default=None, min_length=1, max_length=256)
    turn: int | None = Field(default=None, ge=0)
    pause_ms: int | None = Field(default=None, ge=0, description="the pause announced after this turn")
    closes: bool | None = None
    fork_of: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _blocks_cover_the_input(self) -> TraceRecord:
        expected = -(-self.input_length // TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) != expected:
            raise ValueError(
                f"{len(self.hash_ids)} hash_ids for {self.input_length} input tokens "
                f"(expected {expected} blocks of {TRACE_BLOCK_TOKENS})"
            )
        return self

    def block_tokens(self, i: int) -> int:
        """Tokens in block ``i`` (the last one may be partial)."""
        if i < len(self.hash_ids) - 1:
            return TRACE_BLOCK_TOKENS
        return self.input_length - TRACE_BLOCK_TOKENS * (len(self.hash_ids) - 1)


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Every record of a trace file, in file order (``limit``: the first ones only)."""
    return list(iter_trace(path, limit))


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRecord]:
    path = Path(path)
    with path.open() as f:
        n = 0
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            try:
                yield TraceRecord.model_validate_json(line)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first["loc"]) or "line"
                raise TraceError(f"{path}:{number}: {where}: {first['msg']}") from None
            n += 1


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Write records in the format (``tenant`` only where set); returns how many."""
    n = 0
    with Path(path).open("w") as f:
        for record in records:
            f.write(json.dumps(record.model_dump(exclude_none=True, mode="json"), separators=(", ", ": ")) + "\n")
            n += 1
    return n


def infer_sessions(records: Iterable[TraceRecord], min_blocks: int = 2) -> list[TraceRecord]:
    """The records with sessions inferred: a request whose blocks extend a previous request's whole
    prompt continues that request's session (the first to extend it; a later one forks a new session
    from it). A prompt's partial last block is left out of the match, since the next turn fills it and
    its hash changes. A match shorter than ``min_blocks`` full blocks starts a new session instead
    (one block shared by every request is a system prompt, not a conversation). Each record gets
    ``session``, ``turn`` and ``fork_of``, from what came before it only; its ``pause_ms`` and
    ``closes`` stay as the trace carries them. Records that already carry a session keep it. Tenants
    are apart."""
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
    records = list(records)
    if not records:
        return []
    ends: dict[tuple, int] = {}  # (tenant, the last full block of a prompt) -> that record's index
    session_of: list[str] = []
    turn_of: list[int] = []
    fork_of: list[str | None] = [None] * len(records)
    continued: set[int] = set()
    turns: dict[str, int] = {}
    for n, record in enumerate(records):
        parent = _extended(record, ends, min_blocks)
        if record.session is not None:
            session = record.session
        elif parent is not None and parent not in continued:
            session = session_of[parent]
            continued.add(parent)
        else:
            session = f"s{n}"
            if parent is not None:
                fork_of[n] = session_of[parent]
        turn = turns.get(session, -1) + 1 if record.turn is None else record.turn
        turns[session] = turn
        session_of.append(session)
        turn_of.append(turn)
        full = len(record.hash_ids) - (record.input_length % TRACE_BLOCK_TOKENS != 0)
        if full >= 1:
            ends[(record.tenant, record.hash_ids[full - 1])] = n
    return [
        record.model_copy(update={"session": session, "turn": turn, "fork_of": record.fork_of or fork})
        for record, session, turn, fork in zip(records, session_of, turn_of, fork_of)
    ]


def oracle_announcements(records: Iterable[TraceRecord]) -> list[TraceRecord]:
    """The records as if every client had known its future: each turn's ``pause_ms`` the exact gap to
    its session's next turn, ``closes`` true on its last. It reads what is yet to come, so it scores
    the ``oracle`` level only (records need ``session``; those without one are left as they are)."""
    records = list(records)
    out = list(records)
    later: dict[tuple, TraceRecord] = {}  # (tenant, session) -> its next turn, walking backwards
    for n in range(len(records) - 1, -1, -1):
        record = records[n]
        if record.session is None:
            continue
        key = (record.tenant, record.session)
        after = later.get(key)
        later[key] = record
        pause = None if after is None else max(0, after.timestamp - record.timestamp)
        out[n] = record.model_copy(update={"pause_ms": pause, "closes": after is None})
    return out


def _extended(record: TraceRecord, ends: dict[tuple, int], min_blocks: int) -> int | None:
    """The latest earlier record whose whole (full-block) prompt this one extends, if it is long enough.
    Hash ids are chained, so a prompt is named by its last block and position."""
    ids = record.hash_ids
    for i in range(len(ids) - 1, min_blocks - 2, -1):
        found = ends.get((record.tenant, ids[i]))
        if found is not None:
            return found
    return None


def synthetic_trace(
    requests: int = 1000,
    *,
    tenants: int = 2,
    system_prompts: int = 4,
    system_blocks: int = 8,
    turn_blocks: tuple[int, int] = (1, 6),
    new_session_p: float = 0.3,
    output_tokens: tuple[int, int] = (16, 512),
    rate_per_s: float = 2.0,
    bursty: bool = False,
    seed: int = 0,
) -> list[TraceRecord]:
    """A seeded trace in the same format: multi-turn sessions (each turn's prompt is the whole
    conversation so far plus new blocks), system prompts shared within a tenant, several tenants
    (their ids never meet), Poisson arrivals at ``rate_per_s`` or, ``bursty``, alternating periods at
    five times and a fifth of that rate."""
    import random

    if requests <= 0 or tenants <= 0 or system_prompts <= 0 or rate_per_s <= 0:
        raise ValueError("requests, tenants, system_prompts and rate_per_s must be positive")
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    prompts = {
        (t, p): [next(next_id) for _ in range(system_blocks)] for t in range(tenants) for p in range(system_prompts)
    }
    sessions: list[tuple[int, list[int]]] = []  # (tenant, the conversation's ids so far)
    records: list[TraceRecord] = []
    clock = 0.0
    burst_left, fast = 0, False
    for _ in range(requests):
        if bursty:
            if burst_left <= 0:
                fast, burst_left = not fast, rng.randint(20, 60)
            burst_left -= 1
            rate = rate_per_s * (5 if fast else 0.2)
        else:
            rate = rate_per_s
        clock += rng.expovariate(rate)
        if not sessions or rng.random() < new_session_p:
            tenant = rng.randrange(tenants)
            sessions.append((tenant, list(prompts[(tenant, rng.randrange(system_prompts))])))
            index = len(sessions) - 1
        else:
            index = rng.randrange(len(sessions))
        tenant, ids = sessions[index]
        ids = ids + [next(next_id) for _ in range(rng.randint(*turn_blocks))]
        sessions[index] = (tenant, ids)
        input_length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(1, TRACE_BLOCK_TOKENS)
        records.append(
            TraceRecord(
                timestamp=int(clock * 1000),
                input_length=input_length,
                output_length=rng.randint(*output_tokens),
                hash_ids=tuple(ids),
                tenant=f"tenant-{tenant}" if tenants > 1 else None,
            )
        )
    return records
