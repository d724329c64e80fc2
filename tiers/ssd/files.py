"""The ssd tier: one file per block under a directory, written and read off the event loop.

File format (little-endian): a 512-byte header (magic, version, flags, key, parent key, raw and
stored lengths, an xxh3-64 checksum of the stored payload, and a checksum of the header itself),
then the stored payload, padded to the direct-I/O alignment. A block is written to a temporary name
and renamed into place, so a process killed mid-write never leaves a half-written block under a
block's name; the checksums catch what a torn device write would leave. On start the tier scans its
directory and rebuilds its index from the headers (Mooncake loses its SSD data on restart; we keep
it). A block that fails a check is deleted, reported and counted, and the read is a miss.

Compression is zstd, optionally after a byte-plane shuffle of 16-bit values (fp16/bf16 KV puts the
exponent bytes together, which compresses far better). Blocks that do not shrink are stored raw."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import RecoveredBlock
from ..buffers import PAGE, copy_into, empty, on_host, round_up, size_of
from ..errors import CorruptBlockError, DiskFullError, PayloadError
from .layout import SsdLayout, _drop_other_layout
from .record import (
    HEADER_SIZE,
    _parse_header,
    pack_header,
    pwritev_all,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SsdSlot:
    nbytes: int  # raw payload bytes
    reserved: int  # bytes counted against capacity: raw size before the write, file size after
    path: Path | None = None
    stored: int = 0  # payload bytes in the file (compressed size when compressed)
    staging: np.ndarray | None = field(default=None, repr=False)


class SsdFilesBackend(SsdLayout[SsdSlot]):
    """Blocks as files under ``root``; every file operation runs in the tier's I/O threads."""

    # Capacity -------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> SsdSlot | None:
        if not self.accepts(nbytes):
            raise PayloadError(f"tier {self.name!r}: cannot hold {nbytes} bytes (capacity {self.capacity_bytes})")
        reserve = PAGE + round_up(nbytes) if self._direct(nbytes) else HEADER_SIZE + nbytes  # the largest file
        if self.used_bytes + reserve > self.capacity_bytes:
            return None
        self.used_bytes += reserve
        return SsdSlot(nbytes=nbytes, reserved=reserve)

    # I/O ------------------------------------------------------------------------------------------

    def _path_for(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.blocks_dir / hexkey[:2] / f"{hexkey}.blk"

    async def persist(
        self,
        slot: SsdSlot,
        key: bytes,
        parent: bytes | None,
        src: Any = None,
        tenant: str = "",
        seal: bytes = b"",
        sync: bool = False,
    ) -> None:
        """Write the block's file from ``src`` (or the slot's staging buffer) and make it visible
        (with ``sync``, on the device, its name too, before this returns)."""
        payload = self._payload(slot, key, parent, tenant, seal, src)
        self._tmp_seq += 1
        path = self._path_for(key)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{self._tmp_seq}")
        size, stored = await self._run(self._write_file, path, tmp, key, parent, tenant.encode(), seal, payload, sync)
        self.used_bytes += size - slot.reserved
        slot.reserved = size
        slot.stored = stored
        slot.path = path
        slot.staging = None
        self.stored_bytes += stored
        self.raw_bytes += slot.nbytes

    def _write_file(
        self,
        path: Path,
        tmp: Path,
        key: bytes,
        parent: bytes | None,
        tenant: bytes,
        seal: bytes,
        payload: np.ndarray,
        sync: bool = False,
    ) -> tuple[int, int]:
        """Write the file; returns its size on disk and the stored payload length.

        Direct I/O (large blocks): the header fills the first page and the payload is written from
        where it lies when it is page-aligned (a pool slot is), so no copy is made; only a partial
        last page goes through a staging page. Buffered I/O (small blocks): one ``pwritev`` of header
        and payload, which the kernel copies into the page cache.
        """
        stored, flags = self._encode(payload)
        direct = self._direct(payload.size)
        data_offset = PAGE if direct else HEADER_SIZE
        head = pack_header(flags, data_offset, key, parent, tenant, seal, payload.size, stored)
        tls = self._tls
        page = tls.head_page
        page[:] = 0
        page[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        if direct:
            whole = stored.size - stored.size % PAGE
            if stored.ctypes.data % PAGE == 0:
                iov = [page, stored[:whole]]
                if whole < stored.size:
                    tls.tail_page[:] = 0
                    tls.tail_page[: stored.size - whole] = stored[whole:]
                    iov.append(tls.tail_page)
            else:
                staged = tls.get(round_up(stored.size))
                staged[: stored.size] = stored
                staged[stored.size : round_up(stored.size)] = 0
                iov = [page, staged[: round_up(stored.size)]]
        else:
            iov = [page[:HEADER_SIZE], stored]
        total = sum(len(b) for b in iov)
        path.parent.mkdir(exist_ok=True)
        open_flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(tmp, open_flags, 0o644)
            try:
                pwritev_all(fd, iov)
                if self.fsync or sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            if sync:  # the rename itself, durable
                dirfd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dirfd)
                finally:
                    os.close(dirfd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFullError(f"tier {self.name!r}: {self.root}: {os.strerror(exc.errno)}") from exc
            raise
        return total, stored.size

    async def read_into(self, slot: SsdSlot, key: bytes, dst: Any) -> None:
        """Fill ``dst`` with the block; CorruptBlockError when any check fails."""
        if size_of(dst) != slot.nbytes:
            raise PayloadError(f"destination is {size_of(dst)} bytes, block is {slot.nbytes}")
        if slot.path is None:  # still staged: a two-phase put not yet persisted
            raise PayloadError("block is not on disk yet")
        target = dst if on_host(dst) else empty(slot.nbytes)
        try:
            await self._run(self._read_file, slot.path, key, slot.nbytes, target)
        except CorruptBlockError:
            self.corrupt_dropped += 1  # the store drops the copy, which deletes the file
            raise
        if target is not dst:
            copy_into(dst, target)

    def _read_file(self, path: Path, key: bytes, nbytes: int, out: np.ndarray) -> None:
        """Read, check and decode a block into ``out``. With direct I/O, an uncompressed block is read
        straight into a page-aligned ``out`` in one ``preadv``; otherwise through a staging buffer."""
        direct = self._direct(nbytes)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            raise CorruptBlockError(f"{path}: file is gone") from None
        try:
            self._read_record(fd, 0, os.fstat(fd).st_size, path, key, nbytes, out, direct)
        finally:
            os.close(fd)

    async def read_head(self, slot: SsdSlot, key: bytes, nbytes: int, want: int) -> bytes:
        path = slot.path
        if path is None:
            raise PayloadError("block is not on disk yet")

        def read() -> bytes:
            direct = self._direct(slot.nbytes)
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError:
                raise CorruptBlockError(f"{slot.path}: file is gone") from None
            try:
                return self._head_of(fd, 0, slot.reserved, slot.path, key, slot.nbytes, want, direct)
            finally:
                os.close(fd)

        return await self._run(read)

    def extent(self, slot: SsdSlot) -> tuple[Path, int, int]:
        """Where a block's record lies on disk: (file, offset, length). For tools and tests."""
        if slot.path is None:
            raise PayloadError("block is not on disk yet")
        return slot.path, 0, slot.reserved

    async def release(self, slot: SsdSlot) -> None:
        if slot.path is not None:
            await self._run(_unlink, slot.path)
            self.stored_bytes -= slot.stored
            self.raw_bytes -= slot.nbytes
        self.used_bytes -= slot.reserved
        slot.staging = None

    # Recovery -------------------------------------------------------------------------------------

    def _scan(self) -> list[RecoveredBlock]:
        _drop_other_layout(self.root / "segments", "*.seg", self.name)
        found: list[RecoveredBlock] = []
        for sub in self.blocks_dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if ".tmp-" in path.name:
                    path.unlink(missing_ok=True)  # a write that never finished
                    continue
                if not path.name.endswith(".blk"):
                    continue
                try:
                    st = path.stat()
                    with open(path, "rb") as f:
                        head = f.read(HEADER_SIZE)
                    header = _parse_header(path, head, st.st_size)
                    if path.name != f"{header.key.hex()}.blk":
                        raise CorruptBlockError(f"{path}: header names another block")
                except (CorruptBlockError, OSError) as exc:
                    log.warning("ssd tier %s: dropping %s", self.name, exc)
                    self.corrupt_dropped += 1
                    path.unlink(missing_ok=True)
                    continue
                slot = SsdSlot(nbytes=header.raw_len, reserved=st.st_size, path=path, stored=header.stored_len)
                found.append(
                    RecoveredBlock(
                        header.key, header.parent, header.raw_len, slot, st.st_mtime, header.tenant, header.seal
                    )
                )
        found.sort(key=lambda b: b.mtime)
        return found


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


SsdTier = SsdFilesBackend  # the name before 0.2 (a backend, not a store tier); kept for callers
