"""The Mooncake trace format (one JSON object per line), with an optional ``tenant`` field:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

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
