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

import asyncio
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from ..backend import DiskTierBackend, RecoveredBlock
from ..buffers import PAGE, aligned_buffer, copy_into, empty, host_bytes, on_host, round_up, size_of
from ..errors import CorruptBlockError, DiskFullError, PayloadError, StoreError
from ..kinds import SsdKind
from .record import (
    _FLAG_DEAD,
    _FLAG_SHUFFLE16,
    _FLAG_ZSTD,
    HEADER_SIZE,
    MAX_KEY,
    MAX_SEAL,
    MAX_TENANT,
    _check_block,
    _Header,
    _parse_header,
    pack_header,
    pwritev_all,
    shuffle16,
    unshuffle16,
)

log = logging.getLogger(__name__)


class SsdLockedError(StoreError):
    """Another process already owns this SSD directory."""


@dataclass(slots=True)
class SsdSlot:
    nbytes: int  # raw payload bytes
    reserved: int  # bytes counted against capacity: raw size before the write, file size after
    path: Path | None = None
    stored: int = 0  # payload bytes in the file (compressed size when compressed)
    staging: np.ndarray | None = field(default=None, repr=False)


class _ThreadBuffers(threading.local):
    """Per-I/O-thread aligned staging memory and zstd contexts, reused across calls."""

    def __init__(self) -> None:
        self.mem: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.array: np.ndarray | None = None
        self.compressor: zstandard.ZstdCompressor | None = None
        self.decompressor = zstandard.ZstdDecompressor()
        self._pages = aligned_buffer(2 * PAGE)
        self.head_page = np.frombuffer(self._pages[1], dtype=np.uint8)[:PAGE]
        self.tail_page = np.frombuffer(self._pages[1], dtype=np.uint8)[PAGE:]
        self._many: tuple | None = None  # (mmap, [n, PAGE] pages) for the headers of a coalesced read

    def pages(self, n: int) -> np.ndarray:
        """At least ``n`` aligned pages, as rows."""
        if self._many is None or len(self._many[1]) < n:
            mem, view = aligned_buffer(max(n, 64) * PAGE)
            self._many = (mem, np.frombuffer(view, dtype=np.uint8).reshape(-1, PAGE))
        return self._many[1]

    def get(self, nbytes: int) -> np.ndarray:
        if self.array is None or self.array.size < nbytes:
            if self.view is not None and self.mem is not None:
                self.array = None
                self.view.release()
                self.mem.close()
            self.mem, self.view = aligned_buffer(max(nbytes, 1 << 20))
            self.array = np.frombuffer(self.view, dtype=np.uint8)
        return self.array


class SsdFilesBackend(SsdKind, DiskTierBackend):
    """Blocks as files under ``root``; every file operation runs in the tier's I/O threads."""

    capacity_bytes = 0  # plain attributes here (set in __init__, counted as files come and go)
    used_bytes = 0

    @classmethod
    def from_config(cls, cfg, layout) -> SsdFilesBackend:
        """The file-per-block layout; the registry's ``ssd`` (``ssd.SsdBackend``) picks the layout."""
        return cls(cfg.path, **cls.settings_of(cfg))

    @staticmethod
    def settings_of(cfg) -> dict:
        """What every layout takes from an ssd ``TierConfig``."""
        return dict(
            capacity_bytes=int(cfg.capacity),
            compression=cfg.compression,
            shuffle=cfg.shuffle,
            zstd_level=cfg.zstd_level,
            direct_io=cfg.direct_io,
            fsync=cfg.fsync,
            io_threads=cfg.io_threads,
            name=cfg.tier_name,
        )

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int | None = None,
        compression: bool = False,
        shuffle: bool = True,
        zstd_level: int = 1,
        direct_io: bool | None = None,
        direct_min: int = 256 << 10,
        fsync: bool = False,
        io_threads: int = 4,
        name: str = "ssd",
    ) -> None:
        self.name = name
        self.root = Path(root)
        self.blocks_dir = self.root / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SsdLockedError(f"SSD directory {self.root} is in use by another process") from None
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else _disk_size(self.root)
        self.compression = compression
        self.shuffle = shuffle
        self.zstd_level = zstd_level
        self.fsync = fsync
        self.direct_io = _probe_direct_io(self.blocks_dir) if direct_io is None else direct_io
        # Below this size the page padding O_DIRECT needs would cost more space than it saves time.
        self.direct_min = direct_min
        self._executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"tiercake-{name}")
        self._tls = _ThreadBuffers()
        self._tmp_seq = 0
        self.used_bytes = 0
        self.stored_bytes = 0  # bytes of committed files (for the compression ratio)
        self.raw_bytes = 0  # raw payload bytes of committed files
        self.corrupt_dropped = 0

    # Capacity -------------------------------------------------------------------------------------

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity_bytes

    def allocate(self, nbytes: int) -> SsdSlot | None:
        if not self.accepts(nbytes):
            raise PayloadError(f"tier {self.name!r}: cannot hold {nbytes} bytes (capacity {self.capacity_bytes})")
        reserve = PAGE + round_up(nbytes) if self._direct(nbytes) else HEADER_SIZE + nbytes  # the largest file
        if self.used_bytes + reserve > self.capacity_bytes:
            return None
        self.used_bytes += reserve
        return SsdSlot(nbytes=nbytes, reserved=reserve)

    def in_use(self, slot: SsdSlot) -> bool:
        return False

    def staging(self, slot: SsdSlot) -> np.ndarray:
        """A host buffer that a two-phase put writes into before ``persist``."""
        if slot.staging is None:
            slot.staging = empty(slot.nbytes)
        return slot.staging

    # I/O ------------------------------------------------------------------------------------------

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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

    @staticmethod
    def _payload(slot, key: bytes, parent: bytes | None, tenant: str, seal: bytes, src: Any) -> np.ndarray:
        """The bytes a persist writes (``src``, else the slot's staging buffer), as host memory, once the
        names that go in the header are checked against its fields."""
        if len(key) > MAX_KEY or (parent is not None and len(parent) > MAX_KEY):
            raise PayloadError(f"keys stored on SSD are at most {MAX_KEY} bytes")
        if len(seal) > MAX_SEAL:
            raise PayloadError(f"seals stored on SSD are at most {MAX_SEAL} bytes")
        if len(tenant.encode()) > MAX_TENANT:
            raise PayloadError(f"tenant names stored on SSD are at most {MAX_TENANT} bytes")
        data = slot.staging if src is None else src
        if data is None:
            raise PayloadError("nothing to persist: no source and no staging buffer")
        data = host_bytes(data)
        if data.size != slot.nbytes:
            raise PayloadError(f"block is {data.size} bytes, slot holds {slot.nbytes}")
        return data

    def _encode(self, payload: np.ndarray) -> tuple[np.ndarray, int]:
        if not self.compression:
            return payload, 0
        flags = _FLAG_ZSTD
        data = payload
        if self.shuffle and payload.size % 2 == 0:
            data = shuffle16(payload)
            flags |= _FLAG_SHUFFLE16
        if self._tls.compressor is None:
            self._tls.compressor = zstandard.ZstdCompressor(level=self.zstd_level)
        packed = self._tls.compressor.compress(data.data)
        if len(packed) >= payload.size:
            return payload, 0
        return np.frombuffer(packed, dtype=np.uint8), flags

    def _direct(self, nbytes: int) -> bool:
        return self.direct_io and nbytes >= self.direct_min

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

    def _read_record(
        self, fd: int, base: int, size: int, where: object, key: bytes, nbytes: int, out: np.ndarray, direct: bool
    ) -> None:
        """Read the record of ``size`` bytes at ``base`` (a header, then its payload at the header's
        offset), check it and decode it into ``out``. ``where`` names it in errors.

        With direct I/O, an uncompressed payload is read straight into a page-aligned ``out`` in one
        ``preadv``; otherwise the whole record goes through a staging buffer."""
        tls = self._tls
        if direct and out.ctypes.data % PAGE == 0:
            whole = nbytes - nbytes % PAGE
            iov = [tls.head_page.data, out[:whole].data] + ([tls.tail_page.data] if whole < nbytes else [])
            got = os.preadv(fd, iov, base)
            head = _parse_header(where, tls.head_page[:HEADER_SIZE].tobytes(), size)
            if head.flags & ~_FLAG_DEAD == 0 and head.data_offset == PAGE and head.stored_len == nbytes:
                if got < PAGE + nbytes:
                    raise CorruptBlockError(f"{where}: truncated: read {got} bytes")
                out[whole:] = tls.tail_page[: nbytes - whole]
                _check_block(where, head, key, nbytes, out)
                return
        buf = tls.get(round_up(size))
        got = os.preadv(fd, [buf[: round_up(size) if direct else size].data], base)
        head = _parse_header(where, buf[:HEADER_SIZE].tobytes(), got)
        stored = buf[head.data_offset : head.data_offset + head.stored_len]
        _check_block(where, head, key, nbytes, stored)
        self._decode(where, head, stored, nbytes, out)

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

    def _head_of(
        self, fd: int, base: int, size: int, where: object, key: bytes, nbytes: int, want: int, direct: bool
    ) -> bytes:
        """The payload's first ``want`` bytes: the header's page and those (one ``pread``) where the
        payload is stored raw; the whole record, decoded, where it is compressed."""
        want = min(want, nbytes)
        length = min(round_up(PAGE + want), round_up(size)) if direct else min(PAGE + want, size)
        buf = self._tls.get(round_up(length))
        got = os.preadv(fd, [buf[:length].data], base)
        head = _parse_header(where, buf[:HEADER_SIZE].tobytes(), size)
        if head.key != key or head.raw_len != nbytes:
            raise CorruptBlockError(f"{where}: header names another block")
        if head.flags & _FLAG_ZSTD:  # compressed: only the whole decodes
            out = empty(nbytes)
            self._read_record(fd, base, size, where, key, nbytes, out, direct)
            return bytes(out[:want])
        if got < head.data_offset + want:
            raise CorruptBlockError(f"{where}: truncated: read {got} bytes")
        return bytes(buf[head.data_offset : head.data_offset + want])

    def _decode(self, where: object, head: _Header, stored: np.ndarray, nbytes: int, out: np.ndarray) -> None:
        if not head.flags & _FLAG_ZSTD:
            out[:] = stored
            return
        try:
            raw = self._tls.decompressor.decompress(stored.data, max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise CorruptBlockError(f"{where}: {exc}") from exc
        planes = np.frombuffer(raw, dtype=np.uint8)
        if planes.size != nbytes:
            raise CorruptBlockError(f"{where}: decompressed to {planes.size} bytes, expected {nbytes}")
        if head.flags & _FLAG_SHUFFLE16:
            unshuffle16(planes, out)
        else:
            out[:] = planes

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

    async def recover(self) -> list[RecoveredBlock]:
        """Index every intact block on disk (oldest first); delete temporaries and broken files."""
        found = await self._run(self._scan)
        for block in found:
            self.used_bytes += block.slot.reserved
            self.stored_bytes += block.slot.stored
            self.raw_bytes += block.nbytes
        return found

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

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        os.close(self._lock_fd)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


def _drop_other_layout(directory: Path, pattern: str, name: str) -> None:
    """Blocks the other layout wrote here (the tier's layout was changed): deleted, since this layout
    cannot serve them and they would hold disk space the tier does not count."""
    stale = list(directory.rglob(pattern)) if directory.is_dir() else []
    if stale:
        log.warning("ssd tier %s: deleting %d block files of the other layout under %s", name, len(stale), directory)
        for path in stale:
            path.unlink(missing_ok=True)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _disk_size(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


def _probe_direct_io(directory: Path) -> bool:
    """Whether the file system under ``directory`` takes O_DIRECT (tmpfs, for one, does not)."""
    probe = directory / f".direct-probe-{os.getpid()}"
    mem, view = aligned_buffer(PAGE)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.write(fd, view)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
        view.release()
        mem.close()


SsdTier = SsdFilesBackend  # the name before 0.2 (a backend, not a store tier); kept for callers
