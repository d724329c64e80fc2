"""The pool tier: one node-wide shared-memory region that any process on the node maps.

The region is a file mapped ``MAP_SHARED``: under ``/dev/shm`` by default (POSIX shared memory), or
any other path, such as a file on a DAX file system or a ``/dev/daxX.Y`` device for CXL memory. The
owner (the node agent) allocates; other processes ``attach`` and read or write blocks in place at the
offsets the owner hands out. A small header at the start lets an attacher check what it mapped.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np
import torch

from .backend import MemoryTierBackend
from .buffers import PAGE, round_up
from .errors import PayloadError

_MAGIC = b"TCPOOL01"
_HEADER = struct.Struct("<8sQQQ16s")  # magic, region size, data offset, page size, instance id
DATA_OFFSET = PAGE


class PoolFormatError(RuntimeError):
    """The mapped path is not a tiercake pool region (wrong magic or size)."""


class PoolInUseError(RuntimeError):
    """Another live process owns the pool region at this path."""


class PoolRegion:
    """A mapped shared-memory region. Use ``create`` in the owner and ``attach`` elsewhere."""

    def __init__(self, path: Path, size: int, fd: int, mem: mmap.mmap, owner: bool, page_size: int,
                 instance: str) -> None:
        self.path = path
        # new at every create: a process that mapped an earlier region at the same path (a node agent
        # that restarted) can tell its mapping is stale
        self.instance = instance
        self.size = size
        self.page_size = page_size
        self.owner = owner
        self._fd = fd
        self._mem = mem
        self.bytes = torch.frombuffer(mem, dtype=torch.uint8)  # one view over the whole region
        self.array = np.frombuffer(mem, dtype=np.uint8)  # the same bytes for numpy and sockets

    @classmethod
    def create(cls, path: str | Path, size: int, page_size: int = PAGE, prefault: bool = True) -> PoolRegion:
        """Create (or take over) the region at ``path`` with ``size`` bytes of data space."""
        if size <= 0:
            raise ValueError("pool size must be positive")
        if page_size % PAGE:
            raise ValueError(f"page_size must be a multiple of {PAGE}")
        path = Path(path)
        total = DATA_OFFSET + round_up(size, page_size)
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:  # one owner per region: a second node agent must not reformat a live pool
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PoolInUseError(f"pool region {path} is owned by another live process") from None
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.ftruncate(fd, total)
                try:  # reserve the space now: a sparse file on a full tmpfs is a SIGBUS at first touch
                    os.posix_fallocate(fd, 0, total)
                except OSError as exc:
                    if not existed:
                        path.unlink(missing_ok=True)
                    raise OSError(exc.errno, f"pool region {path}: cannot reserve {total} bytes ({exc.strerror}); "
                                  f"the file system has less free space than the pool's capacity") from None
            mem = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        instance = os.urandom(16)
        region = cls(path, total, fd, mem, owner=True, page_size=page_size, instance=instance.hex())
        if prefault:
            # Untouched memory fills at under 1 GB/s here; pay that once, at start, not per put.
            step = 64 << 20
            flat = np.frombuffer(mem, dtype=np.uint8)
            for start in range(DATA_OFFSET, total, step):
                flat[start : start + step] = 0
        mem[: _HEADER.size] = _HEADER.pack(_MAGIC, total, DATA_OFFSET, page_size, instance)
        return region

    @classmethod
    def attach(cls, path: str | Path) -> PoolRegion:
        """Map an existing region created by another process."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < _HEADER.size:
                raise PoolFormatError(f"{path}: too short to be a pool region")
            magic, total, data_offset, page_size, instance = _HEADER.unpack(head)
            if magic != _MAGIC or data_offset != DATA_OFFSET:
                raise PoolFormatError(f"{path}: not a tiercake pool region")
            mem = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, total, fd, mem, owner=False, page_size=page_size, instance=instance.hex())

    @property
    def data_size(self) -> int:
        return self.size - DATA_OFFSET

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the data space, in place."""
        if self._mem.closed:
            raise ValueError(f"pool region {self.path} is closed")
        if offset < 0 or nbytes < 0 or DATA_OFFSET + offset + nbytes > self.size:
            raise PayloadError(f"pool view [{offset}, {offset + nbytes}) is outside the region")
        start = DATA_OFFSET + offset
        return self.bytes[start : start + nbytes]

    def host_array(self, offset: int, nbytes: int) -> np.ndarray:
        """The same bytes as ``view`` as a numpy array (slicing it is about 10x cheaper)."""
        if offset < 0 or nbytes < 0 or DATA_OFFSET + offset + nbytes > self.size:
            raise PayloadError(f"pool view [{offset}, {offset + nbytes}) is outside the region")
        start = DATA_OFFSET + offset
        return self.array[start : start + nbytes]

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; the owner also removes a regular file it created unless ``unlink=False``."""
        if self._mem.closed:
            return
        del self.bytes, self.array
        try:
            self._mem.close()
        except BufferError:
            # live tensor views still point into the region; leave the mapping to the process's end
            pass
        os.close(self._fd)
        if (self.owner if unlink is None else unlink) and self.path.exists() and self.path.is_file():
            self.path.unlink()


class ExtentAllocator:
    """First-fit allocation of page-granular extents, with coalescing on free."""

    def __init__(self, size: int, page_size: int = PAGE) -> None:
        self.page_size = page_size
        self.pages = size // page_size
        self._starts: list[int] = [0]  # free extents, sorted by start page
        self._lengths: dict[int, int] = {0: self.pages}
        self.used_pages = 0

    def allocate(self, nbytes: int) -> int | None:
        """Byte offset of a free extent holding ``nbytes``, or None when no extent is large enough."""
        need = max(1, -(-nbytes // self.page_size))
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= need:
                del self._lengths[start]
                if length == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[start + need] = length - need
                self.used_pages += need
                return start * self.page_size
        return None

    def free(self, offset: int, nbytes: int) -> None:
        start = offset // self.page_size
        length = max(1, -(-nbytes // self.page_size))
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + length) or (
            i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > start
        ):
            raise ValueError(f"double free of pool extent at page {start}")
        self.used_pages -= length
        if i < len(self._starts) and self._starts[i] == start + length:  # merge with the next extent
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:  # and the previous
            self._lengths[self._starts[i - 1]] += length
            return
        self._starts.insert(i, start)
        self._lengths[start] = length

    @property
    def free_extents(self) -> int:
        return len(self._starts)


class PoolTier(MemoryTierBackend):
    """The store's view of the pool: variable-size objects in page-granular extents."""

    kind = "pool"
    rank = 1

    @classmethod
    def from_config(cls, cfg, layout) -> PoolTier:
        path = cfg.path or f"/dev/shm/tiercake-{cfg.tier_name}"
        return cls(PoolRegion.create(path, int(cfg.capacity), page_size=cfg.page_size, prefault=cfg.prefault),
                   name=cfg.tier_name)

    def __init__(self, region: PoolRegion, name: str = "pool") -> None:
        self.region = region
        self.name = name
        self.allocator = ExtentAllocator(region.data_size, region.page_size)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.pages * self.allocator.page_size

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_pages * self.allocator.page_size

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity_bytes

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        if not self.accepts(nbytes):
            raise PayloadError(f"tier {self.name!r}: cannot hold {nbytes} bytes (capacity {self.capacity_bytes})")
        offset = self.allocator.allocate(nbytes)
        return None if offset is None else (offset, nbytes)

    def view(self, slot: tuple[int, int], nbytes: int) -> torch.Tensor:
        return self.region.view(slot[0], nbytes)

    def host_array(self, slot: tuple[int, int], nbytes: int) -> np.ndarray:
        return self.region.host_array(slot[0], nbytes)

    def in_use(self, slot: tuple[int, int]) -> bool:
        return False

    async def release(self, slot: tuple[int, int]) -> None:
        self.allocator.free(*slot)

    def close(self) -> None:
        self.region.close()
