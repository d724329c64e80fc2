"""What both layouts of the ssd tier share (``files.py``: a file per block; ``log.py``: segments):
the directory and its lock, the I/O threads and their buffers, compression, the record's read and
decode, the accounting of what is stored. A layout adds its slot type ``S`` and where records lie."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar

import numpy as np
import zstandard

from ..backend import DiskTierBackend, RecoveredBlock
from ..buffers import PAGE, aligned_buffer, empty, host_bytes, round_up
from ..errors import CorruptBlockError, PayloadError, StoreError
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
    shuffle16,
    unshuffle16,
)

log = logging.getLogger(__name__)


class SlotBytes(Protocol):
    """What every layout's slot has: the block's raw size and the buffer a two-phase put fills."""

    nbytes: int
    staging: np.ndarray | None


S = TypeVar("S", bound=SlotBytes)


class SsdLockedError(StoreError):
    """Another process already owns this SSD directory."""


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


class SsdLayout(SsdKind, DiskTierBackend, Generic[S]):
    """An ssd tier's storage, less where its records lie (the layout's)."""

    capacity_bytes = 0  # plain attributes here (set in __init__, counted as records come and go)
    used_bytes = 0

    @classmethod
    def from_config(cls, cfg, layout) -> Self:
        """This layout as ``cfg`` sets it (the registry's ``ssd``, ``ssd.SsdBackend``, picks the layout)."""
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

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity_bytes

    def in_use(self, slot: S) -> bool:
        return False

    def staging(self, slot: S) -> np.ndarray:
        """A host buffer that a two-phase put writes into before ``persist``."""
        if slot.staging is None:
            slot.staging = empty(slot.nbytes)
        return slot.staging

    # I/O ------------------------------------------------------------------------------------------

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @staticmethod
    def _payload(slot: SlotBytes, key: bytes, parent: bytes | None, tenant: str, seal: bytes, src: Any) -> np.ndarray:
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

    # Recovery -------------------------------------------------------------------------------------

    async def recover(self) -> list[RecoveredBlock]:
        """Index every intact block on disk (oldest first; ``_scan``, in an I/O thread), counted."""
        found = await self._run(self._scan)
        for block in found:
            self.used_bytes += block.slot.reserved
            self.stored_bytes += block.slot.stored
            self.raw_bytes += block.nbytes
        return found

    @abstractmethod
    def _scan(self) -> list[RecoveredBlock]:
        """(An I/O thread.) The intact blocks on disk; temporaries and broken records deleted."""

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        os.close(self._lock_fd)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


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


def _drop_other_layout(directory: Path, pattern: str, name: str) -> None:
    """Blocks the other layout wrote here (the tier's layout was changed): deleted, since this layout
    cannot serve them and they would hold disk space the tier does not count."""
    stale = list(directory.rglob(pattern)) if directory.is_dir() else []
    if stale:
        log.warning("ssd tier %s: deleting %d block files of the other layout under %s", name, len(stale), directory)
        for path in stale:
            path.unlink(missing_ok=True)
