"""A node's directory of the objects it serves, in shared memory, so that a reader on the same host
finds an object's bytes in the pool and copies them without asking the node.

The node (one writer, on its event loop) publishes each current version it owns as primary:
object id -> (where its bytes lie in the pool's data space, size, version). A reader in another
process looks an object up and copies its bytes straight out of the mapped pool. Entries are
seqlocked: the writer makes an entry's sequence odd, changes it, makes it even again; a reader reads
the sequence, the entry and the bytes, then the sequence again, and keeps what it copied only if
the sequence did not move. The node unpublishes an entry before the block under it can be freed or
reused (an upsert's new version, a remove, an eviction), so a reader that copied from a block being
reused sees the sequence moved and reads again. (x86 keeps a core's stores in order and loads in
order, which is all a seqlock needs; elsewhere the reader would need fences, and ``ordered_memory``
turns the directory off.)

The directory says only what the node serves: a slot it stopped serving (moved, frozen for a
handoff) is unpublished first, and the header's ``valid_until`` (CLOCK_MONOTONIC, one clock for the
host) is the end of the node's lease: past it, a reader trusts nothing here (the node may be cut off,
its slots about to move) and asks over the protocol. A miss here is not an answer either: the object
may be on the node's disk only, or the directory full; the reader then asks the node.

A directory names the pool its offsets are in (the pool region's instance): a reader that mapped
another pool (the node came back on a new one) must not read these offsets in its own. And a reader
whose file was deleted (the node came back on a new directory file, as after a reboot) trusts nothing
in it however long its lease seemed to run: the new node may have removed what it lists.

Mooncake's read lease: a get holds the object against removes (without force) for the lease's TTL,
because its master, which grants the lease, is the one that removes. A read here asks nobody, so the
reader writes when it read beside the entry (``reads``, one f64 per entry, CLOCK_MONOTONIC) before it
copies, and the node, before it removes, takes the entry out and then looks (``withdraw``). The two
are a Dekker pair (each stores, then loads what the other stored): x86 may let a load pass an earlier
store, so each side puts a full barrier between them (``_fence``), and then either the node sees the
read (the object stays, leased) or the reader sees the entry moved (it asks the node, which has
removed it). Two readers of one entry at once may leave the earlier of two nearly equal times.

    header (4 KiB): magic, format, capacity (a power of two), instance, pool instance, valid_until (f64)
    entries, 64 bytes each: sequence u32, state u8 (0 empty, 1 live, 2 removed), _, object id 32 B,
                            pool offset u64, size u64, version u64
    reads, 8 bytes each: when a same-host reader last copied the entry's object (f64; 0: never)
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import threading
import time
from pathlib import Path

import numpy as np

_MAGIC = b"TCOD"
_FORMAT = 2
_HEAD = struct.Struct("<4sIQ16s16sd")  # magic, format, capacity, instance, pool instance, valid_until
HEADER_BYTES = 4096
_ENTRY = struct.Struct("<IB3x32sQQQ")  # sequence, state, object id, offset, size, version (4 bytes spare)
ENTRY_BYTES = 64
EMPTY, LIVE, REMOVED = 0, 1, 2
_POOL_AT = 4 + 4 + 8 + 16  # where the pool's instance lies in the header
_VALID_AT = _POOL_AT + 16  # and valid_until


def ordered_memory() -> bool:
    """Whether this machine's memory order lets a seqlock work without fences (x86-64's TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


_BARRIER = threading.Lock()


def _fence() -> None:
    """A full memory barrier: taking an uncontended lock is a locked read-modify-write, which x86
    orders against every earlier store and later load (what ``mfence`` does)."""
    _BARRIER.acquire()
    _BARRIER.release()


def _file_bytes(capacity: int) -> int:
    return HEADER_BYTES + capacity * (ENTRY_BYTES + 8)


def _start(oid: bytes, mask: int) -> int:
    return int.from_bytes(oid[8:16], "little") & mask


class ObjectDirectory:
    """The node's side: create (or take over) the file, publish and unpublish entries."""

    def __init__(self, path: str | Path, capacity: int, pool_instance: bytes) -> None:
        """``pool_instance``: the instance id (16 bytes) of the pool region whose data space the
        published offsets are in."""
        if len(pool_instance) != 16:
            raise ValueError(f"a pool instance is 16 bytes, got {len(pool_instance)}")
        size = 1
        while size < max(capacity, 64):
            size <<= 1
        self.path = Path(path)
        self.capacity = size
        total = _file_bytes(size)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, total)
            self._mem = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        struct.pack_into("<d", self._mem, _VALID_AT, 0.0)  # nothing here is to be trusted until it is rebuilt
        # every entry empty, its sequence moved on (a reader midway through an old entry reads again)
        entries = np.frombuffer(self._mem, dtype=np.uint32, offset=HEADER_BYTES, count=size * ENTRY_BYTES // 4)
        entries = entries.reshape(size, ENTRY_BYTES // 4)
        entries[:, 0] += 2
        entries[:, 1] = 0
        del entries
        self._reads = np.frombuffer(self._mem, dtype=np.float64, offset=HEADER_BYTES + size * ENTRY_BYTES, count=size)
        self._reads[:] = 0.0
        self.instance = os.urandom(16)
        _HEAD.pack_into(self._mem, 0, _MAGIC, _FORMAT, size, self.instance, pool_instance, 0.0)
        self._where: dict[bytes, int] = {}  # object id -> its entry
        self._used = 0  # entries live or removed (open addressing: removed ones stay in the probe chains)

    def set_valid_until(self, until: float) -> None:
        """Readers may trust the directory until ``until`` (CLOCK_MONOTONIC): the node's lease."""
        struct.pack_into("<d", self._mem, _VALID_AT, until)

    def publish(self, oid: bytes, offset: int, size: int, version: int, read_at: float = 0.0) -> bool:
        """The object's current version lies at ``offset`` of the pool's data space; False when the
        directory has no room (readers then ask the node). An object not listed yet starts with its
        last read at ``read_at`` (an upsert's new version keeps the entry and its reads)."""
        at = self._where.get(oid)
        if at is None:
            if (self._used + 1) * 4 > self.capacity * 3:
                self._rebuild()
                if (self._used + 1) * 4 > self.capacity * 3:
                    return False
            at = self._free_entry(oid)
            self._where[oid] = at
            self._used += 1
            self._reads[at] = read_at
        self._write(at, LIVE, oid, offset, size, version)
        return True

    def unpublish(self, oid: bytes) -> None:
        at = self._where.pop(oid, None)
        if at is not None:
            self._write(at, REMOVED, oid, 0, 0, 0)

    def withdraw(self, oid: bytes) -> float:
        """Unpublish ahead of a remove and say when a same-host reader last copied the object
        (CLOCK_MONOTONIC; 0.0: never, or not listed). A read that this does not see fails its own
        check and asks the node (the module's docstring)."""
        at = self._where.pop(oid, None)
        if at is None:
            return 0.0
        self._write(at, REMOVED, oid, 0, 0, 0)
        _fence()
        return float(self._reads[at])

    def clear(self) -> None:
        for oid in list(self._where):
            self.unpublish(oid)
        self._rebuild()

    def close(self, unlink: bool = False) -> None:
        self.set_valid_until(0.0)
        del self._reads  # (an exported view keeps the mapping from closing)
        self._mem.close()
        if unlink:
            self.path.unlink(missing_ok=True)

    def _write(self, at: int, state: int, oid: bytes, offset: int, size: int, version: int) -> None:
        pos = HEADER_BYTES + at * ENTRY_BYTES
        seq = struct.unpack_from("<I", self._mem, pos)[0]
        struct.pack_into("<I", self._mem, pos, (seq + 1) | 1)  # odd: being changed
        _ENTRY.pack_into(self._mem, pos, (seq + 1) | 1, state, oid, offset, size, version)
        struct.pack_into("<I", self._mem, pos, ((seq + 1) | 1) + 1)  # even again: whole

    def _free_entry(self, oid: bytes) -> int:
        mask = self.capacity - 1
        at = _start(oid, mask)
        while True:
            state = self._mem[HEADER_BYTES + at * ENTRY_BYTES + 4]
            if state != LIVE:
                return at
            at = (at + 1) & mask

    def _rebuild(self) -> None:
        """Empty the removed entries (probe chains otherwise only grow): every live one moved to where
        a fresh insert would put it."""
        live = [(oid, self._read(at), float(self._reads[at])) for oid, at in self._where.items()]
        for at in range(self.capacity):
            pos = HEADER_BYTES + at * ENTRY_BYTES
            if self._mem[pos + 4] != EMPTY:
                self._write(at, EMPTY, b"\0" * 32, 0, 0, 0)
        self._where.clear()
        self._used = 0
        for oid, (offset, size, version), read_at in live:
            self.publish(oid, offset, size, version, read_at)

    def _read(self, at: int) -> tuple[int, int, int]:
        _, _, _, offset, size, version = _ENTRY.unpack_from(self._mem, HEADER_BYTES + at * ENTRY_BYTES)
        return offset, size, version


class DirectoryReader:
    """A reader's side: look objects up and copy their bytes out of the pool, or say to ask the node."""

    def __init__(self, path: str | Path, pool_data: np.ndarray, pool_instance: bytes) -> None:
        """``pool_data``: the data space of the node's pool region as mapped here; ``pool_instance``:
        that region's instance id (the directory is read only while it names the same)."""
        self.path = Path(path)
        try:  # kept open: its link count says whether the file was deleted
            self._fd, prot = os.open(self.path, os.O_RDWR), mmap.PROT_READ | mmap.PROT_WRITE
        except PermissionError:  # reads, but no leases: the node learns of them from the notes alone
            self._fd, prot = os.open(self.path, os.O_RDONLY), mmap.PROT_READ
        try:
            size = os.fstat(self._fd).st_size
            self._mem = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except OSError:
            os.close(self._fd)
            raise
        magic, fmt, capacity, self.instance, _, _ = _HEAD.unpack_from(self._mem, 0)
        if magic != _MAGIC or fmt != _FORMAT or _file_bytes(capacity) > size:
            self._mem.close()
            os.close(self._fd)
            raise ValueError(f"{path}: not an object directory")
        self._reads = (
            np.frombuffer(self._mem, dtype=np.float64, offset=HEADER_BYTES + capacity * ENTRY_BYTES, count=capacity)
            if prot & mmap.PROT_WRITE
            else None
        )
        self.mask = capacity - 1
        self.pool = pool_data
        self.pool_instance = pool_instance
        self.usable = ordered_memory()

    def stale(self) -> bool:
        """Whether this is no longer the node's directory for the pool mapped here: its file deleted
        (the node restarted on a new one) or taken over by a node on another pool. A stale reader is
        dropped and the node asked where it keeps its pool and directory now."""
        return os.fstat(self._fd).st_nlink == 0 or self._mem[_POOL_AT : _POOL_AT + 16] != self.pool_instance

    def valid(self) -> bool:
        """Whether reads may be trusted now: the node's lease runs and the directory is not stale."""
        return self.usable and time.monotonic() < struct.unpack_from("<d", self._mem, _VALID_AT)[0] and not self.stale()

    def read(self, oid: bytes, out: np.ndarray | None) -> np.ndarray | int | None:
        """The object's bytes (copied into ``out``, or into a new array), its size when ``out`` is too
        small, or None when the directory cannot say (the caller asks the node)."""
        mem, mask = self._mem, self.mask
        at = _start(oid, mask)
        for _ in range(64):  # a probe chain is short; a long one: ask the node
            pos = HEADER_BYTES + at * ENTRY_BYTES
            for _attempt in range(4):
                seq, state, key, offset, size, _version = _ENTRY.unpack_from(mem, pos)
                if seq & 1:
                    continue  # being changed: read it again
                if state == EMPTY:
                    return None
                if state != LIVE or key != oid:
                    break  # another object's: further along the chain
                if out is not None and out.size < size:
                    return size
                if offset + size > self.pool.size:
                    return None
                if self._reads is not None:  # the lease, before the copy and its check (``withdraw``)
                    self._reads[at] = time.monotonic()
                    _fence()
                target = out[:size] if out is not None else np.empty(size, dtype=np.uint8)
                target[:] = self.pool[offset : offset + size]
                if struct.unpack_from("<I", mem, pos)[0] == seq:
                    return target
            else:
                return None  # changing under us: ask the node
            at = (at + 1) & mask
        return None

    def close(self) -> None:
        self._reads = None
        self._mem.close()
        os.close(self._fd)
