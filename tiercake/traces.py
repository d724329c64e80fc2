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
    model_config = ConfigDict(extra="ignore", frozen=True)

    timestamp: int = Field(ge=0, description="arrival, in milliseconds")
    input_length: int = Field(gt=0)
    output_length: int = Field(ge=0)
    hash_ids: tuple[int, ...] = Field(min_length=1)
    tenant: str | None = None

    @model_validator(mode="after")
    def _blocks_cover_the_input(self) -> TraceRecord:
        expected = -(-self.input_length // TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) != expected:
            raise ValueError(f"{len(self.hash_ids)} hash_ids for {self.input_length} input tokens "
                             f"(expected {expected} blocks of {TRACE_BLOCK_TOKENS})")
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
