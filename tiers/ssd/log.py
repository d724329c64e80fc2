"""The ssd tier's log layout: blocks appended to large segment files instead of one file per block.

A file per block costs a create, a rename and a close (0.3-0.5 ms on ext4), several times the I/O of
a 64 KiB block. Here a block is a *record* appended to the active segment: a header page (the same
header, checksums and flags as the files layout, ``tiers/ssd/files.py``) and the stored payload, padded to
a page, so every record is direct-I/O aligned. One writer thread owns the tail: what ``persist``
calls queue while a write runs goes out in the next ``pwritev`` (group commit), so a batch of puts
costs one system call, not three per block.

- **Release** marks the record dead in place (its header rewritten with the dead flag), so a restart
  never brings an evicted or removed block back, and punches its payload out of the file
  (``FALLOC_FL_PUNCH_HOLE``), so the disk space comes back at once. What stays is the dead header
  page (and, on a file system that cannot punch holes, the payload) until compaction.
- **Compaction** copies the live records of the segment with the fewest live bytes to the tail and
  deletes the segment, whenever dead records span more than ``compact_dead`` of the capacity. It
  moves up to ``COMPACT_CHUNK_BYTES`` at a time: one read on the I/O threads, one group commit.
- **A failed append** (a full disk) is cut off the segment again (``ftruncate``): the tail stays
  known and the space comes back.
- **Recovery** walks each segment's headers in order. A torn append (a writer killed mid-``pwritev``)
  ends the walk of its segment: the records after it were never written. A header that survived over
  a torn payload fails its payload checksum when read: a miss, never a torn block. Appends after a
  restart go to a new segment; of two records of one key (a crash mid-compaction, an overwrite) the
  newer counts.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import RecoveredBlock
from ..buffers import PAGE, aligned_buffer, copy_into, empty, on_host, round_up, size_of
from ..errors import CorruptBlockError, DiskFullError, PayloadError, StoreError
from .layout import SsdLayout, _drop_other_layout
from .record import (
    _FLAG_DEAD,
    HEADER_SIZE,
    _check_block,
    _Header,
    _parse_header,
    pack_header,
    pack_header_check,
    pwritev_all,
)

log = logging.getLogger(__name__)

MAX_BATCH_RECORDS = 256  # a pwritev takes at most 1024 buffers: header, payload, tail page per record
MAX_BATCH_BYTES = 16 << 20
SEGMENT_BYTES = 64 << 20
# a coalesced read stops at this many bytes: past it one large read is no faster than several in
# parallel on the I/O threads (measured: 16 x 1 MiB in one preadv read 0.6-0.8 of raw, in parallel 0.8-1.0)
READ_RUN_BYTES = 2 << 20
COMPACT_CHUNK_BYTES = 4 << 20  # live records a compaction reads in one thread hop and writes in one group commit


@dataclass(slots=True)
class LogSlot:
    """Where one block lies: its segment and offset once written (``segment`` None before)."""

    nbytes: int  # raw payload bytes
    reserved: int  # bytes counted against capacity: the largest record before the write, its size after
    segment: int | None = None
    offset: int = 0
    stored: int = 0  # payload bytes on disk (compressed size when compressed)
    staging: np.ndarray | None = field(default=None, repr=False)


@dataclass(slots=True)
class Segment:
    id: int
    path: Path
    fd: int
    length: int = 0  # bytes written
    live: dict[int, LogSlot] = field(default_factory=dict)  # offset -> the slot whose record is there
    live_bytes: int = 0
    readers: int = 0  # reads in flight: the file is closed only after the last
    retired: bool = False

    @property
    def dead_bytes(self) -> int:
        return self.length - self.live_bytes


@dataclass(slots=True)
class _Read:
    """A queued read of one record straight into ``out`` (see ``SsdLogBackend._coalesced``)."""

    segment: Segment
    offset: int
    length: int  # the record's
    key: bytes
    out: np.ndarray
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _finish_run(run: list[_Read], done: asyncio.Future) -> None:
    results: list[BaseException | None]
    if done.cancelled():
        results = [None] * len(run)
        for read in run:
            read.future.cancel()
    else:
        failure = done.exception()
        results = [failure] * len(run) if failure is not None else done.result()
    for read, result in zip(run, results, strict=True):
        if read.future.done():
            continue  # its caller was cancelled
        if result is None:
            read.future.set_result(None)
        else:
            read.future.set_exception(result)


@dataclass(slots=True)
class _Append:
    """One record to append: a block's header and payload, or a record copied whole by compaction (``raw``)."""

    payload: np.ndarray | None
    header: bytes | None
    stored: int  # payload bytes on disk
    raw: np.ndarray | None = None  # a whole record (compaction)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    sync: bool = False  # on the device (fdatasync) before its future is done

    @property
    def length(self) -> int:
        return self.raw.size if self.raw is not None else PAGE + round_up(self.stored)


def segment_records(path: Path) -> list[tuple[int, int, bool]]:
    """(offset, record length, dead) of every record a segment file holds, in order, up to the first
    that does not parse (a torn append). For tools and tests; recovery walks the same way."""
    return [
        (offset, head.data_offset + round_up(head.stored_len), bool(head.flags & _FLAG_DEAD))
        for offset, head in walk_records(path)
    ]


def block_payloads(
    root: str | Path, tenants: Callable[[str], bool] = lambda tenant: True
) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of the stored payload of every live block an ssd tier directory holds, of
    either layout, oldest first (files by modification time, then the log's records in append order),
    of the store tenants ``tenants`` admits. For tools and tests that look at (or damage) a tier from
    outside its process."""
    root = Path(root)
    out = []
    for path in sorted((root / "blocks").rglob("*.blk"), key=lambda p: p.stat().st_mtime):
        try:
            with open(path, "rb") as f:
                head = _parse_header(path, f.read(HEADER_SIZE), os.fstat(f.fileno()).st_size)
        except (CorruptBlockError, OSError):
            continue
        if tenants(head.tenant):
            out.append((path, head.data_offset, head.stored_len))
    for seg in sorted((root / "segments").glob("*.seg")):
        out.extend(
            (seg, offset + head.data_offset, head.stored_len)
            for offset, head in walk_records(seg)
            if not head.flags & _FLAG_DEAD and tenants(head.tenant)
        )
    return out


def walk_records(
    path: Path, on_torn: Callable[[CorruptBlockError], None] | None = None
) -> Iterator[tuple[int, _Header]]:
    """(offset, header) of every record of a segment file, dead ones included, in order, up to the
    first header that does not parse. ``on_torn`` hears of that one unless it is the zeros past the end
    of what was written: anything else there is a torn append (and nothing after it was written)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0
        while offset + PAGE <= size:
            f.seek(offset)
            head = f.read(HEADER_SIZE)
            try:
                parsed = _parse_header(f"{path}@{offset}", head, size - offset)
            except CorruptBlockError as exc:
                if on_torn is not None and any(head):
                    on_torn(exc)
                return
            yield offset, parsed
            offset += parsed.data_offset + round_up(parsed.stored_len)


class SsdLogBackend(SsdLayout[LogSlot]):
    """The ssd tier with blocks appended to segment files under ``root/segments``."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int | None = None,
        *,
        segment_bytes: int | None = None,
        compact_dead: float = 0.25,
        **kw,
    ) -> None:
        super().__init__(root, capacity_bytes, **kw)
        self.segments_dir = self.root / "segments"
        self.segments_dir.mkdir(exist_ok=True)
        # a segment is a small share of the tier, so that compacting one frees a useful amount at a time
        self.segment_bytes = segment_bytes or max(4 << 20, min(SEGMENT_BYTES, round_up(self.capacity_bytes // 16)))
        self.compact_dead = compact_dead
        self.segments: dict[int, Segment] = {}
        self._active: Segment | None = None  # the writer thread's; the loop only reads it
        self._next_id = 1
        self._queue: deque[_Append] = deque()
        self._flusher: asyncio.Task | None = None
        self._compactor: asyncio.Task | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiercake-{self.name}-log")
        self._created: list[Segment] = []  # the writer's new segments, for the loop to list
        self._wbuf = _WriterBuffers()
        self.compactions = 0
        self.compacted_bytes = 0  # live bytes copied by compaction
        self._punch = True  # until the file system refuses FALLOC_FL_PUNCH_HOLE
        self._reads: list[_Read] = []  # queued in this pass of the event loop (see _coalesced)
        self._marks: set[asyncio.Task] = set()  # dead marks of abandoned records, in flight

    # Capacity -------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> LogSlot | None:
        if not self.accepts(nbytes):
            raise PayloadError(f"tier {self.name!r}: cannot hold {nbytes} bytes (capacity {self.capacity_bytes})")
        reserve = PAGE + round_up(nbytes)
        if self.used_bytes + reserve > self.capacity_bytes:
            return None
        self.used_bytes += reserve
        return LogSlot(nbytes=nbytes, reserved=reserve)

    @property
    def disk_bytes(self) -> int:
        """Bytes the segment files take on the disk (punched payloads excluded)."""
        return sum(os.fstat(s.fd).st_blocks * 512 for s in self.segments.values() if s.fd >= 0)

    @property
    def dead_bytes(self) -> int:
        return sum(s.dead_bytes for s in self.segments.values())

    # Writes ---------------------------------------------------------------------------------------

    async def persist(
        self,
        slot: LogSlot,
        key: bytes,
        parent: bytes | None,
        src: Any = None,
        tenant: str = "",
        seal: bytes = b"",
        sync: bool = False,
    ) -> None:
        """Append the block (from ``src`` or the slot's staging buffer) and wait until it is written
        (with ``sync``, until the device holds it: its batch ends with an ``fdatasync``)."""
        payload = self._payload(slot, key, parent, tenant, seal, src)
        if self.compression:
            stored, flags = await self._run(self._encode, payload)
        else:
            stored, flags = payload, 0
        header = pack_header(flags, PAGE, key, parent, tenant.encode(), seal, payload.size, stored)
        appended = self._append(_Append(stored, header, stored.size, sync=sync))
        try:
            segment, offset = await asyncio.shield(appended)
        except asyncio.CancelledError:  # the record may land anyway: then it is marked dead, not orphaned
            appended.add_done_callback(self._abandoned)
            raise
        self._place(slot, segment, offset, stored.size)
        slot.staging = None
        self.stored_bytes += stored.size
        self.raw_bytes += slot.nbytes

    def _place(self, slot: LogSlot, segment: Segment, offset: int, stored: int) -> None:
        length = PAGE + round_up(stored)
        self.used_bytes += length - slot.reserved
        slot.reserved = length
        slot.segment, slot.offset, slot.stored = segment.id, offset, stored
        segment.live[offset] = slot
        segment.live_bytes += length

    def _append(self, item: _Append) -> asyncio.Future:
        """Queue a record; the future gives its (segment, offset) once written."""
        self._queue.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return item.future

    def _abandoned(self, appended: asyncio.Future) -> None:
        """A record written for a put that was cancelled meanwhile: no slot holds it, so it is dead
        (counted so: its segment's live bytes never included it) and is marked so on disk."""
        if appended.cancelled() or appended.exception() is not None:
            return
        segment, offset = appended.result()
        self._marks.add(task := asyncio.get_running_loop().create_task(self._mark(segment, offset)))
        task.add_done_callback(self._marks.discard)

    async def _flush(self) -> None:
        """Write what is queued, batch after batch, until the queue is empty: one writer at a time."""
        while self._queue:
            batch: list[_Append] = []
            size = 0
            while self._queue and len(batch) < MAX_BATCH_RECORDS and (not batch or size < MAX_BATCH_BYTES):
                item = self._queue.popleft()
                batch.append(item)
                size += item.length
            try:
                placed = await asyncio.get_running_loop().run_in_executor(self._writer, self._write_batch, batch)
            except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            finally:
                while self._created:
                    segment = self._created.pop(0)
                    self.segments[segment.id] = segment
            for item, (segment, offset) in zip(batch, placed, strict=True):
                if not item.future.done():
                    item.future.set_result((segment, offset))

    def _write_batch(self, batch: list[_Append]) -> list[tuple[Segment, int]]:
        """(Writer thread.) Append the records, a segment at a time; their (segment, offset)."""
        placed: list[tuple[Segment, int]] = []
        start = 0
        while start < len(batch):
            segment = self._active
            if segment is None or (segment.length and segment.length + batch[start].length > self.segment_bytes):
                segment = self._active = self._new_segment()
            end, tail = start, segment.length
            while end < len(batch) and (end == start or tail + batch[end].length <= self.segment_bytes):
                placed.append((segment, tail))
                tail += batch[end].length
                end += 1
            self._write_records(segment, batch[start:end])
            segment.length = tail
            start = end
        return placed

    def _write_records(self, segment: Segment, records: list[_Append]) -> None:
        iov = self._wbuf.iov(records)
        try:
            pwritev_all(segment.fd, iov, segment.length)
            if self.fsync or any(r.sync for r in records):
                os.fdatasync(segment.fd)
        except OSError as exc:
            try:  # cut what part of the batch landed, so the tail is known and the space comes back
                os.ftruncate(segment.fd, segment.length)
            except OSError:
                self._active = None  # the tail is unknown: appends go on in a new segment
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFullError(f"tier {self.name!r}: {self.root}: {os.strerror(exc.errno)}") from exc
            raise

    def _new_segment(self) -> Segment:
        seg_id = self._next_id
        self._next_id += 1
        path = self.segments_dir / f"{seg_id:010d}.seg"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct_io else 0), 0o644)
        segment = Segment(seg_id, path, fd)
        _sync_dir(self.segments_dir)  # the new file's name, durable before a synced record in it is acknowledged
        self._created.append(segment)  # list.append is atomic; the loop takes them after the batch
        return segment

    # Reads ----------------------------------------------------------------------------------------

    async def read_into(self, slot: LogSlot, key: bytes, dst: Any) -> None:
        if size_of(dst) != slot.nbytes:
            raise PayloadError(f"destination is {size_of(dst)} bytes, block is {slot.nbytes}")
        if slot.segment is None:
            raise PayloadError("block is not on disk yet")
        segment = self.segments[slot.segment]
        target = dst if on_host(dst) else empty(slot.nbytes)
        out = target
        segment.readers += 1
        try:
            if (
                self.direct_io
                and slot.stored == slot.nbytes
                and slot.nbytes % PAGE == 0
                and out.ctypes.data % PAGE == 0
            ):
                await self._coalesced(_Read(segment, slot.offset, slot.reserved, key, out))
            else:
                await self._run(
                    self._read_record,
                    segment.fd,
                    slot.offset,
                    slot.reserved,
                    f"{segment.path}@{slot.offset}",
                    key,
                    slot.nbytes,
                    out,
                    self.direct_io,
                )
        except CorruptBlockError:
            self.corrupt_dropped += 1  # the store drops the copy, which marks the record dead
            raise
        finally:
            segment.readers -= 1
            self._close_if_retired(segment)
        if target is not dst:
            copy_into(dst, target)

    async def read_head(self, slot: LogSlot, key: bytes, nbytes: int, want: int) -> bytes:
        if slot.segment is None:
            raise PayloadError("block is not on disk yet")
        segment = self.segments[slot.segment]
        segment.readers += 1
        try:
            where = f"{segment.path}@{slot.offset}"
            return await self._run(
                self._head_of, segment.fd, slot.offset, slot.reserved, where, key, slot.nbytes, want, self.direct_io
            )
        finally:
            segment.readers -= 1
            self._close_if_retired(segment)

    def _coalesced(self, read: _Read) -> asyncio.Future:
        """Queue a read of a whole, raw, page-sized record into page-aligned memory. The reads queued in
        one pass of the event loop (a ``get_many``) are sorted, and each run of records that lie next to
        each other (blocks appended together) is read with one ``preadv``, straight into the
        destinations: a batch of small blocks becomes a few large sequential reads."""
        self._reads.append(read)
        if len(self._reads) == 1:
            asyncio.get_running_loop().call_soon(self._dispatch_reads)
        return read.future

    def _dispatch_reads(self) -> None:
        reads, self._reads = sorted(self._reads, key=lambda r: (r.segment.id, r.offset)), []
        loop = asyncio.get_running_loop()
        run: list[_Read] = []
        run_bytes = 0
        for read in reads + [None]:
            if run and (
                read is None
                or read.segment is not run[-1].segment
                or read.offset != run[-1].offset + run[-1].length
                or len(run) == MAX_BATCH_RECORDS
                or run_bytes + read.length > READ_RUN_BYTES
            ):
                done = loop.run_in_executor(self._executor, self._read_run, run)
                done.add_done_callback(functools.partial(_finish_run, run))
                run, run_bytes = [], 0
            if read is not None:
                run.append(read)
                run_bytes += read.length

    def _read_run(self, run: list[_Read]) -> list[CorruptBlockError | None]:
        """(I/O thread.) One ``preadv`` of adjacent records: each header into a page of its own, each
        payload into its destination; then each record checked on its own."""
        heads = self._tls.pages(len(run))
        iov = []
        for i, read in enumerate(run):
            iov += [heads[i], read.out]
        got = os.preadv(run[0].segment.fd, iov, run[0].offset)
        results: list[CorruptBlockError | None] = []
        end = 0
        for i, read in enumerate(run):
            end += read.length
            where = f"{read.segment.path}@{read.offset}"
            try:
                if got < end:
                    raise CorruptBlockError(f"{where}: truncated: the segment ends inside the record")
                head = _parse_header(where, heads[i][:HEADER_SIZE].tobytes(), read.length)
                if head.flags & ~_FLAG_DEAD or head.data_offset != PAGE or head.stored_len != read.out.size:
                    raise CorruptBlockError(f"{where}: header does not describe this record")
                _check_block(where, head, read.key, read.out.size, read.out)
                results.append(None)
            except CorruptBlockError as exc:
                results.append(exc)
        return results

    def extent(self, slot: LogSlot) -> tuple[Path, int, int]:
        """Where a block's record lies on disk: (segment file, offset, length). For tools and tests."""
        if slot.segment is None:
            raise PayloadError("block is not on disk yet")
        return self.segments[slot.segment].path, slot.offset, slot.reserved

    # Release and compaction ----------------------------------------------------------------------

    async def release(self, slot: LogSlot) -> None:
        self.used_bytes -= slot.reserved
        slot.staging = None
        if slot.segment is None:
            return  # reserved, never written
        segment = self.segments.get(slot.segment)
        seg_offset, slot.segment = slot.offset, None
        self.stored_bytes -= slot.stored
        self.raw_bytes -= slot.nbytes
        if segment is None or segment.live.pop(seg_offset, None) is not slot:
            return
        segment.live_bytes -= slot.reserved
        await self._mark(segment, seg_offset)
        self._maybe_compact()

    async def _mark(self, segment: Segment, offset: int) -> None:
        """Mark the record dead on disk (``_mark_dead``); the file stays open until the mark is written."""
        if segment.retired:
            return  # the whole segment goes
        segment.readers += 1
        try:
            await self._run(self._mark_dead, segment, offset)
        finally:
            segment.readers -= 1
            self._close_if_retired(segment)

    def _mark_dead(self, segment: Segment, offset: int) -> None:
        """(I/O thread.) Rewrite the record's header with the dead flag, so no restart revives it, and
        punch its payload out of the file, so the disk space comes back now rather than at compaction."""
        page = self._tls.head_page
        if os.preadv(segment.fd, [page.data], offset) < HEADER_SIZE:
            return
        head = bytes(page[:HEADER_SIZE])
        try:
            parsed = _parse_header(segment.path, head, segment.length - offset)
        except CorruptBlockError:
            return  # already unreadable: recovery ends its walk here or skips it
        marked = pack_header_check(head, parsed.flags | _FLAG_DEAD)
        page[: len(marked)] = np.frombuffer(marked, dtype=np.uint8)
        os.pwritev(segment.fd, [page.data], offset)
        if self._punch and parsed.stored_len:
            self._punch = punch_hole(segment.fd, offset + parsed.data_offset, round_up(parsed.stored_len))

    def _maybe_compact(self) -> None:
        if self._compactor is not None and not self._compactor.done():
            return
        if self.dead_bytes > self._dead_limit():  # the active segment's share is left to the loop below
            self._compactor = asyncio.get_running_loop().create_task(self._compact())

    def _dead_limit(self) -> int:
        return max(self.segment_bytes, int(self.capacity_bytes * self.compact_dead))

    async def _compact(self) -> None:
        """Move the live records of the emptiest sealed segments to the tail, and delete those segments,
        until dead bytes are back under the limit."""
        while True:
            sealed = [s for s in self.segments.values() if s is not self._active and s.dead_bytes > 0]
            if sum(s.dead_bytes for s in sealed) <= self._dead_limit():
                return
            victim = min(sealed, key=lambda s: s.live_bytes)
            try:
                await self._evacuate(victim)
            except Exception:  # noqa: BLE001 - the segment stays; the next release tries again
                log.exception("ssd tier %s: compacting %s failed", self.name, victim.path)
                return

    async def _evacuate(self, victim: Segment) -> None:
        """Copy the victim's live records to the tail, up to ``COMPACT_CHUNK_BYTES`` at a time (one thread
        hop reads them, one group commit writes them), then delete it."""
        chunk: list[tuple[int, LogSlot]] = []
        size = 0
        for offset, slot in sorted(victim.live.items()):
            if chunk and size + slot.reserved > COMPACT_CHUNK_BYTES:
                await self._move(victim, chunk)
                chunk, size = [], 0
            if victim.live.get(offset) is slot:  # else released meanwhile
                chunk.append((offset, slot))
                size += slot.reserved
        if chunk:
            await self._move(victim, chunk)
        victim.retired = True
        self.segments.pop(victim.id, None)
        await self._run(os.unlink, victim.path)
        self.compactions += 1
        self._close_if_retired(victim)

    async def _move(self, victim: Segment, chunk: list[tuple[int, LogSlot]]) -> None:
        victim.readers += 1
        try:
            raws = await self._run(lambda: [self._read_raw(victim, offset, slot.reserved) for offset, slot in chunk])
        finally:
            victim.readers -= 1
        # synced: the victim is unlinked next, and a synced block must not exist only in the page cache
        appended = await asyncio.gather(
            *(
                self._append(_Append(None, None, slot.stored, raw=raw, sync=True))
                for (_, slot), raw in zip(chunk, raws)
            ),
            return_exceptions=True,
        )
        failed = None
        for (offset, slot), result in zip(chunk, appended):
            if isinstance(result, BaseException):
                failed = failed or result  # this one stays where it is
                continue
            segment, new_offset = result
            if victim.live.get(offset) is slot:
                del victim.live[offset]
                victim.live_bytes -= slot.reserved
                self._place_moved(slot, segment, new_offset)
            else:  # released while it was copied: the copy must not come back either
                await self._mark(segment, new_offset)
            self.compacted_bytes += slot.reserved
        if failed is not None:
            raise failed  # the victim keeps what was not moved; the next release tries again

    def _place_moved(self, slot: LogSlot, segment: Segment, offset: int) -> None:
        slot.segment, slot.offset = segment.id, offset
        segment.live[offset] = slot
        segment.live_bytes += slot.reserved

    def _read_raw(self, segment: Segment, offset: int, length: int) -> np.ndarray:
        mem, view = aligned_buffer(length)
        out = np.frombuffer(view, dtype=np.uint8)[:length]
        if os.preadv(segment.fd, [out.data], offset) != length:
            raise CorruptBlockError(f"{segment.path}@{offset}: short read while compacting")
        return out

    def _close_if_retired(self, segment: Segment) -> None:
        if segment.retired and segment.readers == 0 and segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    # Recovery -------------------------------------------------------------------------------------

    async def recover(self) -> list[RecoveredBlock]:
        found = await super().recover()  # through _scan below
        self._maybe_compact()  # what was dead at the crash may be past the limit already
        return found

    def _scan(self) -> list[RecoveredBlock]:
        """Every key's newest record decides, dead ones included: a compaction that copied a record
        and then saw it removed (the copy marked dead) may have crashed before it deleted the old
        segment, whose record of the key is still live; the dead copy outranks it (a copy keeps its
        creation time and lies in a newer segment), so the removed block stays removed."""
        _drop_other_layout(self.blocks_dir, "*.blk", self.name)
        newest: dict[bytes, tuple[tuple, RecoveredBlock | None, Segment]] = {}
        for path in sorted(self.segments_dir.glob("*.seg")):
            try:
                seg_id = int(path.stem)
            except ValueError:
                continue
            fd = os.open(path, os.O_RDWR | (os.O_DIRECT if self.direct_io else 0))
            segment = Segment(seg_id, path, fd, length=os.fstat(fd).st_size)
            self.segments[seg_id] = segment
            self._next_id = max(self._next_id, seg_id + 1)
            for offset, head in walk_records(path, self._torn):
                rank = (head.created_ns, seg_id, offset)
                if head.key in newest and newest[head.key][0] > rank:
                    continue
                _, old, old_segment = newest.get(head.key, (None, None, None))
                if old is not None and old_segment is not None:  # an older live record: left dead
                    old_segment.live.pop(old.slot.offset, None)  # (not marked; never read)
                    old_segment.live_bytes -= old.slot.reserved
                if head.flags & _FLAG_DEAD:
                    newest[head.key] = (rank, None, segment)
                    continue
                length = head.data_offset + round_up(head.stored_len)
                slot = LogSlot(
                    nbytes=head.raw_len, reserved=length, segment=seg_id, offset=offset, stored=head.stored_len
                )
                block = RecoveredBlock(
                    head.key, head.parent, head.raw_len, slot, head.created_ns / 1e9, head.tenant, head.seal
                )
                newest[head.key] = (rank, block, segment)
                segment.live[offset] = slot
                segment.live_bytes += length
        found = [block for _, block, _ in newest.values() if block is not None]
        found.sort(key=lambda b: b.mtime)
        return found

    def _torn(self, exc: CorruptBlockError) -> None:
        log.warning("ssd tier %s: %s; the segment ends here", self.name, exc)
        self.corrupt_dropped += 1

    def close(self) -> None:
        if self._compactor is not None and not self._compactor.done():
            self._compactor.cancel()  # a compaction stopped between two moves leaves every block whole
        while self._queue:  # appends not yet handed to the writer fail; the batch being written finishes
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(StoreError(f"tier {self.name!r} is closed"))
        self._writer.shutdown(wait=True)
        super().close()
        for segment in self.segments.values():
            if segment.fd >= 0:
                os.close(segment.fd)
                segment.fd = -1
        self._wbuf.close()


class _WriterBuffers:
    """The writer thread's aligned header and tail pages, and staging for payloads that are not
    page-aligned (direct I/O needs every buffer aligned)."""

    def __init__(self) -> None:
        self._mem, view = aligned_buffer(2 * MAX_BATCH_RECORDS * PAGE)
        self.pages = np.frombuffer(view, dtype=np.uint8).reshape(2 * MAX_BATCH_RECORDS, PAGE)
        self._view = view
        self._staging: np.ndarray | None = None
        self._staging_mem: mmap.mmap | None = None
        self._lock = threading.Lock()

    def iov(self, records: list[_Append]) -> list[np.ndarray]:
        iov: list[np.ndarray] = []
        unaligned = sum(round_up(r.stored) for r in records if r.payload is not None and r.payload.ctypes.data % PAGE)
        staging = self._staging_for(unaligned)
        used = 0
        for i, rec in enumerate(records):
            if rec.raw is not None:
                iov.append(rec.raw)
                continue
            data, header = rec.payload, rec.header
            if data is None or header is None:
                raise PayloadError("a block's record without its header or payload")
            head = self.pages[2 * i]
            head[:] = 0
            head[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            iov.append(head)
            padded = round_up(data.size)
            if staging is not None and data.ctypes.data % PAGE:
                staged = staging[used : used + padded]
                staged[: data.size] = data
                staged[data.size :] = 0
                used += padded
                iov.append(staged)
                continue
            whole = data.size - data.size % PAGE
            if whole:
                iov.append(data[:whole])
            if whole < data.size:
                tail = self.pages[2 * i + 1]
                tail[: data.size - whole] = data[whole:]
                tail[data.size - whole :] = 0
                iov.append(tail)
        return iov

    def _staging_for(self, nbytes: int) -> np.ndarray | None:
        if nbytes == 0:
            return None
        if self._staging is None or self._staging.size < nbytes:
            self.close_staging()
            self._staging_mem, view = aligned_buffer(max(nbytes, 4 << 20))
            self._staging = np.frombuffer(view, dtype=np.uint8)
        return self._staging

    def close_staging(self) -> None:
        self._staging = None  # the mmap is freed with its last view

    def close(self) -> None:
        self.close_staging()
        self.pages = np.empty((0, PAGE), dtype=np.uint8)  # the pages' mapping goes with its last view


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free ``length`` bytes of the file at ``offset`` (they read as zeros after); False when the file
    system cannot (the space then comes back at compaction)."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SsdLogTier = SsdLogBackend  # the name before 0.2; kept for callers
