"""How an object (a name and any number of bytes) lies in tiercake's blocks.

- An object of at most ``INLINE_MAX`` bytes is one block: a ``HEADER``-byte header, then its bytes.
- A larger one is a head block holding only the header, then ``ceil(size / CHUNK)`` chunk blocks of
  ``CHUNK`` bytes (the last one shorter), chained from the head (``object_chunk_keys``).

The head's key comes from the tenant and the name (``object_head_key``); the header carries the
object's size and a version drawn at each put, which is in every chunk's key, so a reader that read
one version's head never reads another version's chunks. The head is written last: once it is
visible, the object is whole. The index knows each block's size, so a head's size alone tells an
inline object's size (``size_from_head``).
"""

from __future__ import annotations

import math
import secrets
import struct
from dataclasses import dataclass

from tiercake.blocks import BlockKey, object_chunk_keys, object_head_key

HEADER = 64
INLINE_MAX = 1 << 20
CHUNK = 4 << 20
MAX_NAME_BYTES = 64 << 10  # Mooncake takes long keys too; past this a key is a mistake, not a name
MAX_OBJECT_BYTES = 1 << 40

_MAGIC = b"TCOB"
_FORMAT = 1
_HEADER = struct.Struct("<4sBxxxQQQ")  # magic, format, size, version, chunk bytes (then zeros to HEADER)


class LayoutError(ValueError):
    """A head block that is not an object header (a foreign block under the key, or a torn one)."""


def name_bytes(name: str) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"object keys are str, got {type(name).__name__}")
    raw = name.encode()
    if not raw:
        raise ValueError("object keys are not empty")
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"object keys are at most {MAX_NAME_BYTES} bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True, slots=True)
class Header:
    size: int
    version: int
    chunk: int = CHUNK

    @property
    def inline(self) -> bool:
        return self.size <= INLINE_MAX

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, _FORMAT, self.size, self.version, self.chunk).ljust(HEADER, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        if len(raw) < _HEADER.size:
            raise LayoutError(f"an object header is {HEADER} bytes, got {len(raw)}")
        magic, fmt, size, version, chunk = _HEADER.unpack_from(raw)
        if magic != _MAGIC or fmt != _FORMAT or not 0 < chunk <= 1 << 30:
            raise LayoutError("not a tiercake object header")
        return cls(size, version, chunk)


@dataclass(frozen=True, slots=True)
class ObjectBlocks:
    """Every block of one version of one object: keys, sizes, and where each chunk's bytes lie."""

    head: BlockKey
    header: Header
    chunks: list[BlockKey]

    @classmethod
    def new(cls, name: bytes, tenant: str, size: int) -> ObjectBlocks:
        if size <= 0:
            raise ValueError("an object holds at least one byte")
        if size > MAX_OBJECT_BYTES:
            raise ValueError(f"objects are at most {MAX_OBJECT_BYTES} bytes, got {size}")
        return cls.of(object_head_key(name, tenant), Header(size, secrets.randbits(64)))

    @classmethod
    def of(cls, head: bytes, header: Header) -> ObjectBlocks:
        count = 0 if header.inline else math.ceil(header.size / header.chunk)
        return cls(BlockKey(head), header, object_chunk_keys(head, header.version, count))

    @property
    def head_bytes(self) -> int:
        return HEADER + (self.header.size if self.header.inline else 0)

    def chunk_spans(self) -> list[tuple[int, int]]:
        """(offset, length) in the object of each chunk."""
        size, step = self.header.size, self.header.chunk
        return [(at, min(step, size - at)) for at in range(0, size, step)] if self.chunks else []


def size_from_head(head_bytes: int) -> int | None:
    """An inline object's size from its head block's size alone; None for a chunked object's head."""
    return head_bytes - HEADER if head_bytes > HEADER else None
