"""The ssd tier's record: what both layouts write for a block (``files.py``, a file per block, and
``log.py``, records appended to segments), little-endian: a 512-byte header (magic, version, flags,
key, parent key, tenant, data offset, raw and stored lengths, an xxh3-64 checksum of the stored
payload, the block's seal, and a checksum of the header itself), then the stored payload, padded to
the direct-I/O alignment. Payloads of 16-bit values may be byte-plane shuffled before zstd."""

from __future__ import annotations

import errno
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import CorruptBlockError

HEADER_SIZE = 512  # the header's own bytes; the payload starts at ``data_offset`` (512, or a page)
MAX_KEY = 64
_MAGIC = b"TCKV"
_VERSION = 3  # 2: the block's tenant is in the header, so a restarted node can re-report it; 3: its seal
_FLAG_ZSTD = 1
_FLAG_SHUFFLE16 = 2
_FLAG_DEAD = 4  # the log layout: a released record, kept until its segment is compacted
MAX_TENANT = 128
MAX_SEAL = 32
# magic, version, flags, key_len, parent_len, tenant_len, data_offset, raw_len, stored_len, payload_xxh,
# created_ns, key, parent, tenant, seal_len, seal
_HEAD = struct.Struct(f"<4sHHHHHIQQQQ{MAX_KEY}s{MAX_KEY}s{MAX_TENANT}sB{MAX_SEAL}s")
_HEAD_V2 = struct.Struct(f"<4sHHHHHIQQQQ{MAX_KEY}s{MAX_KEY}s{MAX_TENANT}s")  # still read: blocks from before seals
_HEAD_CHECK = struct.Struct("<Q")
assert _HEAD.size + _HEAD_CHECK.size <= HEADER_SIZE


def shuffle16(data: np.ndarray) -> np.ndarray:
    """Byte planes of 16-bit values: all low bytes, then all high bytes (little-endian)."""
    values = data.view("<u2")
    planes = np.empty_like(data)
    planes[: values.size] = values  # the cast keeps the low byte
    planes[values.size :] = values >> 8
    return planes


def unshuffle16(planes: np.ndarray, out: np.ndarray) -> None:
    """Inverse of shuffle16, written into ``out`` (vectorised: ~15x a strided byte copy)."""
    half = planes.size // 2
    values = out.view("<u2")
    np.left_shift(planes[half:], 8, out=values, dtype="<u2")
    values |= planes[:half]


@dataclass(frozen=True, slots=True)
class _Header:
    version: int
    flags: int
    data_offset: int
    raw_len: int
    stored_len: int
    checksum: int
    key: bytes
    parent: bytes | None
    tenant: str
    seal: bytes
    created_ns: int = 0


def pack_header(
    flags: int,
    data_offset: int,
    key: bytes,
    parent: bytes | None,
    tenant: bytes,
    seal: bytes,
    raw_len: int,
    stored: np.ndarray,
    created_ns: int | None = None,
) -> bytes:
    """A record's header, its own checksum included (``_HEAD`` then ``_HEAD_CHECK``)."""
    head = _HEAD.pack(
        _MAGIC,
        _VERSION,
        flags,
        len(key),
        len(parent or b""),
        len(tenant),
        data_offset,
        raw_len,
        stored.size,
        xxhash.xxh3_64_intdigest(stored.data),
        time.time_ns() if created_ns is None else created_ns,
        key,
        parent or b"",
        tenant,
        len(seal),
        seal,
    )
    return head + _HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def pack_header_check(head: bytes, flags: int) -> bytes:
    """``head`` (a header that parsed) with its flags replaced and its own checksum recomputed."""
    (version,) = struct.unpack_from("<H", head, 4)
    body = bytearray(head[: (_HEAD if version == _VERSION else _HEAD_V2).size])
    struct.pack_into("<H", body, 6, flags)
    return bytes(body) + _HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(body))


def _parse_header(path: object, head: bytes, file_size: int) -> _Header:
    if len(head) < HEADER_SIZE or file_size < HEADER_SIZE:
        raise CorruptBlockError(f"{path}: truncated header")
    magic, version = struct.unpack_from("<4sH", head)
    layout = {_VERSION: _HEAD, 2: _HEAD_V2}.get(version) if magic == _MAGIC else None
    if layout is None:
        raise CorruptBlockError(f"{path}: not a tiercake block (magic {magic!r}, version {version})")
    (check,) = _HEAD_CHECK.unpack_from(head, layout.size)
    if xxhash.xxh3_64_intdigest(head[: layout.size]) != check:
        raise CorruptBlockError(f"{path}: header checksum mismatch")
    fields = layout.unpack_from(head)
    (
        _,
        _,
        flags,
        key_len,
        parent_len,
        tenant_len,
        data_offset,
        raw_len,
        stored_len,
        checksum,
        created_ns,
        key,
        parent,
        tenant,
    ) = fields[:14]
    seal = fields[15][: fields[14]] if version >= 3 else b""
    if data_offset + stored_len > file_size:
        raise CorruptBlockError(f"{path}: truncated: {file_size} bytes, header promises {data_offset + stored_len}")
    return _Header(
        version,
        flags,
        data_offset,
        raw_len,
        stored_len,
        checksum,
        key[:key_len],
        parent[:parent_len] if parent_len else None,
        tenant[:tenant_len].decode(errors="replace"),
        seal,
        created_ns,
    )


def _check_block(path: object, head: _Header, key: bytes, nbytes: int, stored: np.ndarray) -> None:
    if head.key != key or head.raw_len != nbytes:
        raise CorruptBlockError(f"{path}: header names another block")
    if xxhash.xxh3_64_intdigest(stored.data) != head.checksum:
        raise CorruptBlockError(f"{path}: payload checksum mismatch")


def pwritev_all(fd: int, buffers: list[np.ndarray], offset: int = 0) -> None:
    """pwritev of every buffer from ``offset``, at most IOV_MAX (1024) at a time; a short write is
    retried from where it stopped."""
    views = [b.data.cast("B") for b in buffers]
    while views:
        done = os.pwritev(fd, views[:1024], offset)
        if done == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
