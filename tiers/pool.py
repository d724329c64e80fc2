"""The pool tier: one node-wide shared-memory region that any process on the node maps.

The region is a file mapped ``MAP_SHARED``: under ``/dev/shm`` by default (POSIX shared memory), or
any other path, such as a file on a DAX file system or a ``/dev/daxX.Y`` device for CXL memory. The
owner (the node agent) allocates; other processes ``attach`` and read or write blocks in place at the
offsets the owner hands out. A small header at the start lets an attacher check what it mapped.

The region outlives its owner. Between the header and the data space lies the region's own index
(``PoolIndex``): one fixed-size entry per committed block (key, parent, tenant, seal, offset, size).
An entry is written whole before its state byte marks it committed, and its state byte is cleared
before its extent is freed, so a process killed between any two stores leaves the index describing
exactly the committed blocks. A node agent that restarts at the same path with the same geometry
adopts the region: its blocks come back through ``PoolBackend.recover`` (what a put had reserved but not
committed is free again). Only a host reboot, or a new size, loses them.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np

from .backend import MemoryTierBackend, RecoveredBlock
from .buffers import PAGE, round_up
from .errors import PayloadError
from .kinds import PoolKind

log = logging.getLogger(__name__)

_MAGIC = b"TCPOOL02"  # 02: the region carries its index (01 regions are formatted anew)
# magic, region size, data offset, page size, instance id, index entries, index entry bytes
_HEADER = struct.Struct("<8sQQQ16sQQ")
HEADER_BYTES = PAGE

# One index entry. The variable fields have room for the longest each may be (keys and parents up to
# 64 bytes, seals up to 32, tenants up to 255, as the transfer protocol allows).
ENTRY_DT = np.dtype(
    [
        ("state", "u1"),
        ("klen", "u1"),
        ("plen", "u1"),
        ("slen", "u1"),
        ("tlen", "u1"),
        ("_pad", "u1", (3,)),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("_pad2", "<u8"),
        ("key", "u1", (64,)),
        ("parent", "u1", (64,)),
        ("seal", "u1", (32,)),
        ("tenant", "u1", (255,)),
        ("_pad3", "u1", (65,)),
    ]
)
assert ENTRY_DT.itemsize == 512
# the same entry, all but its state byte, for one struct.pack_into (numpy's per-field writes cost ~30 us)
_ENTRY = struct.Struct("<xBBBB3xQQ8x64s64s32s255s65x")
assert _ENTRY.size == ENTRY_DT.itemsize
FREE, COMMITTED = 0, 1


from .errors import PoolFormatError, PoolInUseError  # noqa: E402,F401 (re-exported)
from .pool_files import DIRECTORY_SUFFIX, OBJECT_MAP_SUFFIX, beside, lock_holder, remove_pool  # noqa: E402,F401 (re-exported)


def default_index_entries(data_bytes: int, page_size: int) -> int:
    """One entry per four pages (blocks of 16 KiB on average fill both at once), at least 256."""
    return max(256, data_bytes // page_size // 4)


class PoolRegion:
    """A mapped shared-memory region. Use ``create`` in the owner and ``attach`` elsewhere."""

    def __init__(
        self,
        path: Path,
        size: int,
        fd: int,
        mem: mmap.mmap,
        owner: bool,
        page_size: int,
        instance: str,
        data_offset: int,
        entries: int,
        adopted: bool = False,
    ) -> None:
        self.path = path
        # new at every format: a process that mapped an earlier region at the same path (a node agent
        # that restarted onto a new pool) can tell its mapping is stale; kept when a region is adopted
        self.instance = instance
        self.size = size
        self.page_size = page_size
        self.owner = owner
        self.data_offset = data_offset
        self.adopted = adopted  # create() found a region of the same geometry and kept its blocks
        self._fd = fd
        self._mem = mem
        self.array = np.frombuffer(mem, dtype=np.uint8)  # one view over the whole region
        self.index = np.frombuffer(mem, dtype=ENTRY_DT, count=entries, offset=HEADER_BYTES) if entries else None

    @classmethod
    def create(
        cls,
        path: str | Path,
        size: int,
        page_size: int = PAGE,
        prefault: bool = True,
        index_entries: int | None = None,
        adopt: bool = False,
    ) -> PoolRegion:
        """Create (or take over) the region at ``path`` with ``size`` bytes of data space. With
        ``adopt``, a region already there with the same size, page size and index is kept as it is
        (its blocks, its instance id); anything else is formatted anew."""
        if size <= 0:
            raise ValueError("pool size must be positive")
        if page_size % PAGE:
            raise ValueError(f"page_size must be a multiple of {PAGE}")
        data = round_up(size, page_size)
        entries = index_entries if index_entries is not None else default_index_entries(data, page_size)
        if entries < 1:
            raise ValueError("a pool's index holds at least one entry")
        data_offset = round_up(HEADER_BYTES + entries * ENTRY_DT.itemsize, page_size)
        total = data_offset + data
        path = Path(path)
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:  # one owner per region: a second node agent must not reformat a live pool
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PoolInUseError(
                    f"pool region {path} is owned by another live process ({lock_holder(fd)}): stop it, or give "
                    "this one a pool of its own (--data-dir: the default pool follows it; or the pool tier's path)"
                ) from None
            kept = _same_geometry(fd, total, data_offset, page_size, entries) if adopt and existed else None
            if stat.S_ISREG(os.fstat(fd).st_mode):
                if kept is None:
                    os.ftruncate(fd, total)
                try:  # reserve the space now: a sparse file on a full tmpfs is a SIGBUS at first touch
                    os.posix_fallocate(fd, 0, total)
                except OSError as exc:
                    if not existed:
                        path.unlink(missing_ok=True)
                    raise OSError(
                        exc.errno,
                        f"pool region {path}: cannot reserve {total} bytes ({exc.strerror}); "
                        f"the file system has less free space than the pool's capacity",
                    ) from None
            mem = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        instance = kept if kept is not None else os.urandom(16)
        region = cls(
            path,
            total,
            fd,
            mem,
            owner=True,
            page_size=page_size,
            instance=instance.hex(),
            data_offset=data_offset,
            entries=entries,
            adopted=kept is not None,
        )
        if kept is None and region.index is not None:
            # a new format: no entry of an earlier region may survive (not truncated to nothing first: a
            # process that still maps the old region would fault on the pages in between)
            region.index[:] = np.zeros(1, dtype=ENTRY_DT)
            if prefault:
                # Untouched memory fills at under 1 GB/s here; pay that once, at start, not per put.
                step = 64 << 20
                for start in range(data_offset, total, step):
                    region.array[start : start + step] = 0
            mem[: _HEADER.size] = _HEADER.pack(
                _MAGIC, total, data_offset, page_size, instance, entries, ENTRY_DT.itemsize
            )
        return region

    @classmethod
    def attach(cls, path: str | Path) -> PoolRegion:
        """Map an existing region created by another process."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            header = _read_header(fd)
            if header is None:
                raise PoolFormatError(f"{path}: not a tiercake pool region")
            total, data_offset, page_size, instance, entries = header
            mem = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(
            path,
            total,
            fd,
            mem,
            owner=False,
            page_size=page_size,
            instance=instance.hex(),
            data_offset=data_offset,
            entries=entries,
        )

    @property
    def data_size(self) -> int:
        return self.size - self.data_offset

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of the data space, in place."""
        if self._mem.closed:
            raise ValueError(f"pool region {self.path} is closed")
        if offset < 0 or nbytes < 0 or self.data_offset + offset + nbytes > self.size:
            raise PayloadError(f"pool view [{offset}, {offset + nbytes}) is outside the region")
        start = self.data_offset + offset
        return self.array[start : start + nbytes]

    host_array = view  # a pool is host memory: the view is what a socket reads and writes

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; the owner also removes a regular file it created (and what lies beside it: the
        object directory, the last object map) unless ``unlink=False``."""
        if self._mem.closed:
            return
        del self.array
        self.index = None
        try:
            self._mem.close()
        except BufferError:
            # live tensor views still point into the region; leave the mapping to the process's end
            pass
        os.close(self._fd)
        if (self.owner if unlink is None else unlink) and self.path.exists() and self.path.is_file():
            remove_pool(self.path)


def _read_header(fd: int) -> tuple[int, int, int, bytes, int] | None:
    """(size, data offset, page size, instance, index entries) of a region's header, or None."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) < _HEADER.size:
        return None
    magic, total, data_offset, page_size, instance, entries, entry_bytes = _HEADER.unpack(head)
    if magic != _MAGIC or entry_bytes != ENTRY_DT.itemsize or data_offset < HEADER_BYTES + entries * entry_bytes:
        return None
    return total, data_offset, page_size, instance, entries


def _same_geometry(fd: int, total: int, data_offset: int, page_size: int, entries: int) -> bytes | None:
    """The instance id of the region in ``fd`` if its geometry is the one asked for (it can be adopted)."""
    header = _read_header(fd)
    if header is None or header[:3] != (total, data_offset, page_size) or header[4] != entries:
        if header is not None or os.fstat(fd).st_size:
            log.warning(
                "pool region: the region found has another size or format; formatting it anew (its blocks are dropped)"
            )
        return None
    if os.fstat(fd).st_size < total:
        return None
    return header[3]


class PoolIndex:
    """The region's index of committed blocks, and which of its entries are free (this process's)."""

    def __init__(self, region: PoolRegion) -> None:
        if region.index is None:
            raise PoolFormatError(f"{region.path}: the region has no index")
        self.table = region.index
        self._mem: mmap.mmap | None = region._mem
        self._free = list(range(len(self.table) - 1, -1, -1))  # popped from the end: entry 0 first

    def __len__(self) -> int:
        return len(self.table)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, entry: int) -> None:
        self._free.append(entry)

    def commit(
        self, entry: int, offset: int, nbytes: int, key: bytes, parent: bytes | None, tenant: str, seal: bytes
    ) -> bool:
        """Describe a block in ``entry``, then mark it committed (the state byte last). False when a
        field is longer than an entry holds (longer than the transfer protocol allows): the block is
        then not described, and a restarted owner does not find it."""
        tenant_raw, parent = tenant.encode(), parent or b""
        if len(key) > 64 or len(parent) > 64 or len(seal) > 32 or len(tenant_raw) > 255:
            return False
        mem = self._mem
        if mem is None:
            raise PoolFormatError("the pool is closed: nothing is committed into it")
        at = HEADER_BYTES + entry * ENTRY_DT.itemsize
        mem[at] = FREE
        _ENTRY.pack_into(
            mem,
            at,
            len(key),
            len(parent),
            len(seal),
            len(tenant_raw),
            offset,
            nbytes,
            key,
            parent,
            seal,
            tenant_raw,
        )
        mem[at] = COMMITTED  # last: until here the entry describes nothing
        return True

    def clear(self, entry: int) -> None:
        if self._mem is not None:  # closed: nothing left to describe (a late release after close)
            self._mem[HEADER_BYTES + entry * ENTRY_DT.itemsize] = FREE

    def committed(self) -> list[tuple[int, RecoveredBlock]]:
        """(entry, block) of every committed entry, in offset order."""
        found = []
        for entry in np.flatnonzero(self.table["state"] == COMMITTED).tolist():
            row = self.table[entry]
            key = bytes(row["key"][: row["klen"]])
            parent = bytes(row["parent"][: row["plen"]]) or None
            found.append(
                (
                    entry,
                    RecoveredBlock(
                        key,
                        parent,
                        int(row["nbytes"]),
                        (int(row["offset"]), int(row["nbytes"])),
                        0.0,
                        tenant=bytes(row["tenant"][: row["tlen"]]).decode(errors="replace"),
                        seal=bytes(row["seal"][: row["slen"]]),
                    ),
                )
            )
        found.sort(key=lambda item: item[1].slot[0])
        return found

    def adopted(self, entries: set[int]) -> None:
        """After recovery: every entry but these is free."""
        self._free = [e for e in range(len(self.table) - 1, -1, -1) if e not in entries]


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

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Take the extent at ``offset`` (a block recovered there); False if it is not wholly free."""
        start, need = offset // self.page_size, max(1, -(-nbytes // self.page_size))
        if offset % self.page_size or start + need > self.pages:
            return False
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return False
        free_start = self._starts[i]
        free_len = self._lengths[free_start]
        if free_start + free_len < start + need:
            return False
        del self._lengths[free_start]
        del self._starts[i]
        if start > free_start:  # what is left before it
            self._starts.insert(i, free_start)
            self._lengths[free_start] = start - free_start
            i += 1
        if free_start + free_len > start + need:  # and after it
            self._starts.insert(i, start + need)
            self._lengths[start + need] = free_start + free_len - start - need
        self.used_pages += need
        return True

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


class PoolBackend(PoolKind, MemoryTierBackend):
    """The store's view of the pool: variable-size objects in page-granular extents, each committed one
    described in the region's index (so a restarted owner adopts it: ``recover``)."""

    @classmethod
    def from_config(cls, cfg, layout) -> PoolBackend:
        region = PoolRegion.create(
            cfg.region_path,
            int(cfg.capacity),
            page_size=cfg.page_size,
            prefault=cfg.prefault,
            index_entries=cfg.index_entries,
            adopt=cfg.adopt,
        )
        return cls(region, name=cfg.tier_name, keep=cfg.adopt and cfg.keep_on_stop)

    def __init__(self, region: PoolRegion, name: str = "pool", keep: bool = False) -> None:
        """``keep``: closing leaves the region's file for the next owner to adopt (else it is removed)."""
        self.region = region
        self.name = name
        self.keep = keep
        self.allocator = ExtentAllocator(region.data_size, region.page_size)
        self.index = PoolIndex(region)
        self._entries: dict[int, int] = {}  # extent offset -> its index entry

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
        entry = self.index.take()
        if entry is None:
            return None  # every index entry describes a block: full, as if out of space (the store evicts)
        offset = self.allocator.allocate(nbytes)
        if offset is None:
            self.index.give(entry)
            return None
        self._entries[offset] = entry
        return (offset, nbytes)

    def on_commit(self, slot: tuple[int, int], key: bytes, parent: bytes | None, tenant: str, seal: bytes) -> None:
        if not self.index.commit(self._entries[slot[0]], slot[0], slot[1], key, parent, tenant, seal):
            log.warning(
                "pool %s: block %s has a key, parent, seal or tenant too long for the region's index; "
                "a restarted node agent will not find it",
                self.name,
                key.hex()[:16],
            )

    async def recover(self) -> list[RecoveredBlock]:
        """The committed blocks of an adopted region (nothing for a new one)."""
        if not self.region.adopted:
            return []
        blocks, kept = [], set()
        for entry, block in self.index.committed():
            offset, nbytes = block.slot
            if not 0 < block.nbytes <= self.capacity_bytes or not self.allocator.reserve(offset, nbytes):
                log.warning(
                    "pool %s: index entry %d (%d bytes at %d) overlaps another or lies outside the region; dropped",
                    self.name,
                    entry,
                    nbytes,
                    offset,
                )
                self.index.clear(entry)
                continue
            self._entries[offset] = entry
            kept.add(entry)
            blocks.append(block)
        self.index.adopted(kept)
        if blocks:
            log.info(
                "pool %s: adopted %d blocks (%d bytes) from %s",
                self.name,
                len(blocks),
                self.used_bytes,
                self.region.path,
            )
        return blocks

    def view(self, slot: tuple[int, int], nbytes: int) -> np.ndarray:
        return self.region.view(slot[0], nbytes)

    def host_array(self, slot: tuple[int, int], nbytes: int) -> np.ndarray:
        return self.region.host_array(slot[0], nbytes)

    def in_use(self, slot: tuple[int, int]) -> bool:
        return False

    async def release(self, slot: tuple[int, int]) -> None:
        entry = self._entries.pop(slot[0], None)
        if entry is not None:
            self.index.clear(entry)  # described no more before the extent can be handed out again
            self.index.give(entry)
        self.allocator.free(*slot)

    def close(self) -> None:
        # a live view of the mapping would keep it (and its lock) open
        self.index.table, self.index._mem = self.index.table[:0].copy(), None
        self.region.close(unlink=not self.keep)


PoolTier = PoolBackend  # the name before 0.2 (a backend, not a store tier); kept for callers


class PoolIndexReader:
    """Which blocks a region's index describes as committed, for a process that maps the region but
    does not own it (vLLM's connector answering "is this prefix on my node?" without a round trip).

    ``refresh`` compares each entry's state, place and key with what it saw last and reads only
    the entries that changed. An answer can be stale either way (a block committed or freed since):
    a reader treats it as a hint and leases what it reads, so a stale answer costs time, never bytes."""

    def __init__(self, region: PoolRegion) -> None:
        if region.index is None:
            raise PoolFormatError(f"{region.path}: the region has no index")
        self.region = region
        self.table = region.index
        # each entry's first 40 bytes (state, lengths, offset, size, the key's first 8 bytes: one cache
        # line) as five words, one strided copy a refresh
        self._heads = self.table.view(np.uint8).reshape(len(self.table), ENTRY_DT.itemsize)[:, :40]
        self._seen = np.zeros((len(self.table), 5), dtype="<u8")
        self._held: dict[int, tuple[str, bytes]] = {}  # entry -> (tenant, key)
        self.blocks: dict[tuple[str, bytes], int] = {}  # (tenant, key) -> its entry

    def refresh(self) -> None:
        now = np.ascontiguousarray(self._heads).view("<u8")
        for entry in np.flatnonzero((now != self._seen).any(axis=1)).tolist():
            old = self._held.pop(entry, None)
            if old is not None and self.blocks.get(old) == entry:
                del self.blocks[old]
            row = self.table[entry]
            if row["state"] == COMMITTED:
                block = (bytes(row["tenant"][: row["tlen"]]).decode(errors="replace"), bytes(row["key"][: row["klen"]]))
                if row["state"] == COMMITTED:  # still: not freed while it was read
                    self._held[entry] = block
                    self.blocks[block] = entry
        self._seen = now

    def leading(self, tenant: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the index held for ``tenant`` at the last refresh."""
        blocks = self.blocks
        return next((i for i, key in enumerate(keys) if (tenant, key) not in blocks), len(keys))

    def entries(self, tenant: str, keys: list[bytes]) -> list[int]:
        """The index entries of the leading ``keys`` the index held for ``tenant`` at the last refresh
        (for ``PoolPlaces.read``: a hint, checked there)."""
        found = []
        for key in keys:
            entry = self.blocks.get((tenant, key))
            if entry is None:
                break
            found.append(entry)
        return found


class PoolPlaces:
    """Committed blocks of a region read by their index entries, without asking its owner for a lease
    (the connector's same-host load: no round trip on the forward pass's path).

    Nothing holds a block read this way: the owner may free its extent and give it to another block
    meanwhile. So a reader snapshots the blocks' entries (``read``), checks their seals over the
    mapped bytes, copies them, and then asks whether each entry is still what it snapshotted
    (``unchanged``). The owner clears an entry before it frees its extent, and writes a new block only
    into a freed extent, so an entry unchanged from before the seal check to after the copy means the
    bytes copied are the bytes checked; an entry committed again identically (same key, place and seal)
    holds identical bytes, since the seal binds them. A changed entry means that block and those after
    it are recomputed: a moved block costs time, never a wrong byte."""

    def __init__(self, region: PoolRegion) -> None:
        if region.index is None:
            raise PoolFormatError(f"{region.path}: the region has no index")
        self.region = region
        self.table = region.index
        self.data = region.array[region.data_offset :]

    def read(self, entries: list[int], keys: list[bytes], nbytes: int) -> tuple[np.ndarray, list[tuple[int, bytes]]]:
        """A snapshot of ``entries`` (each ``keys[i]``'s, as an index reader last saw them) and the
        (offset, seal) of the leading ones that still describe a committed block of that key and size."""
        if not entries or len(entries) > len(keys) or min(entries) < 0 or max(entries) >= len(self.table):
            return self.table[:0].copy(), []
        rows = self.table[entries]  # one copy of the rows: the snapshot ``unchanged`` compares against
        places = []
        data_size = self.data.size
        for row, key in zip(rows.tolist(), keys):
            state, klen, _, slen, _, _, offset, size, _, raw_key, _, seal, _, _ = row
            if state != COMMITTED or size != nbytes or bytes(raw_key[:klen]) != key or offset + size > data_size:
                break
            places.append((offset, bytes(seal[:slen])))
        return rows, places

    def unchanged(self, entries: list[int], snapshot: np.ndarray) -> int:
        """How many of ``entries``, from the first, still hold exactly what ``read`` snapshotted."""
        if not entries:
            return 0
        now = self.table[entries].view(np.uint8).reshape(len(entries), -1)
        then = snapshot[: len(entries)].view(np.uint8).reshape(len(entries), -1)
        same = (now == then).all(axis=1)
        return int(same.argmin()) if not same.all() else len(entries)
