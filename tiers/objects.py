"""A node's objects (the key-value store's): the current version of each object this node holds, and
the blocks that hold their bytes.

An object is a tenant, a name and bytes. Its identity (``tiercake.blocks.object_id``) picks its slot,
and the object map says which node owns each slot; ``workers/objects.py`` keeps the rules of that
ownership (who may write, replication to the slot's backups). This module is only the local state,
and it has one owner: the table, on the event loop, with no await between a lookup and a change.

- Each written version is one block of the node's ``TieredStore`` (key ``object_block_key(oid,
  nonce)``, new at every write), laid out as a record: a header (``Record``: version, size, what the
  writer asked for, the tenant and name) and then the object's bytes. So the table is rebuilt from
  the store after a restart (an adopted pool, a recovered SSD): of two records of one object the
  higher version is current and the other is removed.
- A version is staged (``stage``: space reserved, the caller writes the bytes), then published
  (``publish``: header written, block committed, synced to disk if asked, and only then the table
  pointed at it, in one step): a reader finds the old version or the new one, whole, never nothing
  and never a mix.
- The version it replaced is retired: its block removed at once, or as soon as the readers copying
  it let go of it.
- Mooncake's read lease: a get or an exists holds the object for ``lease_ttl`` seconds; a remove
  (unless forced) is refused meanwhile, and eviction passes it over.
- Memory-level objects are a cache: the store may evict them (spilled to SSD first where there is
  one); when an object's last copy goes, it leaves the table and ``on_evicted`` is told. Replicated
  and persisted objects are kept (``Entry.keep``): they spill, but are never dropped; a node with no
  room for more answers "full".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import struct
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import re2

from tiercake.blocks import BlockKey, is_object_tenant, object_block_key, object_block_tenant, object_id

from .buffers import copy_into
from .directory import ObjectDirectory
from .errors import ObjectLeasedError, ObjectNotFoundError, PayloadError, StoreError
from .store import BlockChange, PutHandle, TieredStore

log = logging.getLogger(__name__)

_MAGIC = b"TCOR"
_FORMAT = 1
# magic, format, flags, replicas, persist, tenant bytes, name bytes, size, version, soft pin until (unix ms)
_HEAD = struct.Struct("<4sBBBBHIQQQ")
_ALIGN = 64  # the object's bytes start on a cache line
HARD_PIN, SOFT_PIN = 1, 2
MAX_NAME = 64 << 10
MAX_TENANT = 255


class RecordError(ValueError):
    """A block whose header is not an object record (torn, or not one of ours)."""


@dataclass(frozen=True, slots=True)
class Meta:
    """What a writer asked of one object (Mooncake's ``ReplicateConfig``, as far as it applies)."""

    replicas: int = 1  # nodes holding it before the put is acknowledged (the slot's primary and backups)
    persist: bool = False  # on SSD, synced, on each of them, before the acknowledgement
    hard_pin: bool = False  # never evicted
    soft_pin_ms: int | None = None  # evicted only when nothing else can be, for this long

    @property
    def kept(self) -> bool:
        """Durability the caller asked for: never dropped by eviction."""
        return self.replicas > 1 or self.persist or self.hard_pin


@dataclass(frozen=True, slots=True)
class Record:
    """The header of an object's block."""

    tenant: str
    name: bytes
    size: int
    version: int
    meta: Meta
    soft_pin_until_ms: int = 0  # unix time: a soft pin outlives a restart

    @property
    def offset(self) -> int:
        """Where the object's bytes start in its block."""
        return payload_offset(self.tenant, self.name)

    def encode(self) -> bytes:
        tenant = self.tenant.encode()
        flags = (HARD_PIN if self.meta.hard_pin else 0) | (SOFT_PIN if self.meta.soft_pin_ms is not None else 0)
        head = _HEAD.pack(
            _MAGIC,
            _FORMAT,
            flags,
            self.meta.replicas,
            int(self.meta.persist),
            len(tenant),
            len(self.name),
            self.size,
            self.version,
            self.soft_pin_until_ms,
        )
        return head + tenant + self.name

    @classmethod
    def decode(cls, raw: bytes | memoryview | np.ndarray) -> Record:
        raw = bytes(raw[: _HEAD.size + MAX_TENANT + MAX_NAME]) if not isinstance(raw, bytes) else raw
        if len(raw) < _HEAD.size:
            raise RecordError("shorter than an object record's header")
        magic, fmt, flags, replicas, persist, tlen, nlen, size, version, soft_until = _HEAD.unpack_from(raw)
        if magic != _MAGIC or fmt != _FORMAT or not replicas or len(raw) < _HEAD.size + tlen + nlen:
            raise RecordError("not an object record")
        tenant = raw[_HEAD.size : _HEAD.size + tlen].decode(errors="replace")
        name = raw[_HEAD.size + tlen : _HEAD.size + tlen + nlen]
        meta = Meta(replicas, bool(persist), bool(flags & HARD_PIN), 0 if flags & SOFT_PIN else None)
        return cls(tenant, name, size, version, meta, soft_until)


def payload_offset(tenant: str, name: bytes) -> int:
    return -(-(_HEAD.size + len(tenant.encode()) + len(name)) // _ALIGN) * _ALIGN


def header_bytes(tenant: str, name: bytes) -> int:
    """How many bytes of a record come before its object's: what ``read_head`` must read."""
    return payload_offset(tenant, name)


@dataclass(slots=True, eq=False)
class Stored:
    """The current version of one object on this node."""

    oid: bytes
    record: Record
    block: bytes
    lease_until: float = 0.0  # monotonic: Mooncake's read lease

    @property
    def size(self) -> int:
        return self.record.size

    @property
    def version(self) -> int:
        return self.record.version

    @property
    def meta(self) -> Meta:
        return self.record.meta

    @property
    def offset(self) -> int:
        return self.record.offset


@dataclass(slots=True, eq=False)
class Staged:
    """A version on its way in: its block reserved, its bytes being written (``payload``)."""

    oid: bytes
    tenant: str
    name: bytes
    size: int
    meta: Meta
    handle: PutHandle
    offset: int

    @property
    def block(self) -> bytes:
        return self.handle.key

    def payload(self) -> Any:
        """Where the object's bytes go (in place: the pool slot, or a disk tier's staging buffer)."""
        return self.handle.buffer[self.offset : self.offset + self.size]

    def payload_array(self) -> np.ndarray:
        """The same bytes for sockets."""
        return self.handle.host_target()[self.offset : self.offset + self.size]


@dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


# Block ids of staged versions: unique per process (a random start, then counting), never a syscall
_U64 = (1 << 64) - 1
_BLOCK_IDS = itertools.count(int.from_bytes(os.urandom(8), "little"))


class _Held:
    """One holder of an object's lock (a class, not a generator: it is on every write's path); the
    lock is forgotten when its last user is done."""

    __slots__ = ("locks", "oid", "held")

    def __init__(self, locks: dict[bytes, _KeyLock], oid: bytes) -> None:
        self.locks, self.oid = locks, oid

    async def __aenter__(self) -> None:
        held = self.locks.get(self.oid)
        if held is None:
            held = self.locks[self.oid] = _KeyLock()
        held.users += 1
        self.held = held
        try:
            await held.lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.held.lock.release()
        self._leave()

    def _leave(self) -> None:
        self.held.users -= 1
        if not self.held.users and self.locks.get(self.oid) is self.held:
            del self.locks[self.oid]


class ObjectTable:
    RETIRE_EVERY_S = 0.1

    def __init__(
        self,
        store: TieredStore,
        *,
        lease_ttl: float = 5.0,
        disk_tier: str | None = None,
        directory: ObjectDirectory | None = None,
        pool_tier: str | None = None,
    ) -> None:
        """``disk_tier``: where persisted objects go (the store's SSD tier; None: this node cannot
        persist, and such a put is refused). ``directory``: where the versions this node serves are
        published for same-host readers (``directory.py``), with ``publishes`` saying which objects
        those are (its owner's rule) and ``pool_tier`` where their bytes must lie to be published."""
        self.store = store
        self.directory = directory
        self.pool_tier = pool_tier
        self.publishes: Callable[[bytes], bool] = lambda oid: False
        self.lease_ttl = lease_ttl
        self.disk_tier = disk_tier
        self.objects: dict[bytes, Stored] = {}
        self.by_block: dict[bytes, bytes] = {}  # block of a current version -> its object
        self.by_tenant: dict[str, set[bytes]] = defaultdict(set)
        self._locks: dict[bytes, _KeyLock] = {}
        self._retiring: set[bytes] = set()
        self._retirer: asyncio.Task | None = None
        self.on_evicted: list[Callable[[Stored], None]] = []  # told (synchronously) of objects eviction took
        self.evicted = 0
        store.listeners.append(self._on_change)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.store.listeners.remove(self._on_change)
        if self._retirer is not None:
            self._retirer.cancel()

    def __len__(self) -> int:
        return len(self.objects)

    def __iter__(self) -> Iterator[Stored]:
        return iter(list(self.objects.values()))

    def get(self, oid: bytes) -> Stored | None:
        return self.objects.get(oid)

    # One writer per object --------------------------------------------------------------------------

    def lock(self, oid: bytes) -> _Held:
        """``async with table.lock(oid):`` one write (and its replication) at a time per object, in order."""
        return _Held(self._locks, oid)

    def locked(self, oid: bytes) -> bool:
        """A write of the object is under way (or waiting): a write that cannot wait goes the long way."""
        return oid in self._locks

    def writing(self) -> list[bytes]:
        """The objects a write is under way for (or waiting on), new ones included."""
        return list(self._locks)

    # Writing ----------------------------------------------------------------------------------------

    async def stage(self, oid: bytes, tenant: str, name: bytes, size: int, meta: Meta) -> Staged:
        """Reserve a new version's block; the caller writes ``size`` bytes into ``payload()`` and then
        publishes or aborts it. ``TierFullError`` when no tier has room (nothing may be evicted)."""
        if meta.persist and self.disk_tier is None:
            raise PayloadError("this node has no SSD tier: it cannot persist objects")
        if len(name) > MAX_NAME or len(tenant.encode()) > MAX_TENANT:
            raise PayloadError(f"object names are at most {MAX_NAME} bytes and tenants {MAX_TENANT}")
        if size < 0:
            raise PayloadError("an object's size is not negative")
        offset = payload_offset(tenant, name)
        block = object_block_key(oid, next(_BLOCK_IDS) & _U64)
        handle = await self.store.put_start(
            block, offset + size, tenant=object_block_tenant(tenant), exact_size=False, keep=meta.kept
        )
        return Staged(oid, tenant, name, size, meta, handle, offset)

    def stage_now(self, oid: bytes, tenant: str, name: bytes, size: int, meta: Meta) -> Staged | None:
        """``stage`` when it needs no wait (memory has room as it is, nothing to persist); None
        otherwise. ``PayloadError`` as ``stage``'s."""
        if meta.persist:
            return None
        if len(name) > MAX_NAME or len(tenant.encode()) > MAX_TENANT or size < 0:
            raise PayloadError(
                f"object names are at most {MAX_NAME} bytes and tenants {MAX_TENANT}; sizes are not negative"
            )
        offset = payload_offset(tenant, name)
        block = object_block_key(oid, next(_BLOCK_IDS) & _U64)
        handle = self.store.put_start_now(
            block, offset + size, tenant=object_block_tenant(tenant), exact_size=False, keep=meta.kept
        )
        return None if handle is None else Staged(oid, tenant, name, size, meta, handle, offset)

    async def prepare(self, staged: Staged, version: int) -> Stored:
        """Everything of a new version that can fail, done, and nothing of it visible yet: its record
        written, its block committed, its synced disk copy when it is persisted. ``install`` then
        makes it current; ``discard`` undoes it."""
        record = self._write_record(staged, version)
        await self.store.commit(staged.handle)
        try:
            if staged.meta.persist:
                assert self.disk_tier is not None  # ``stage`` refused a persisted object without one
                await self.store.persist_copy(staged.block, self.disk_tier, sync=True)
            self._pin(staged.block, staged.meta, record.soft_pin_until_ms)
        except BaseException:
            self.retire(staged.block)
            raise
        return Stored(staged.oid, record, staged.block)

    def prepare_now(self, staged: Staged, version: int) -> Stored:
        """``prepare`` of a version in memory that is not persisted (``stage_now``'s): no wait."""
        record = self._write_record(staged, version)
        self.store.commit_now(staged.handle)
        try:
            self._pin(staged.block, staged.meta, record.soft_pin_until_ms)
        except BaseException:
            self.retire(staged.block)
            raise
        return Stored(staged.oid, record, staged.block)

    def _write_record(self, staged: Staged, version: int) -> Record:
        record = Record(staged.tenant, staged.name, staged.size, version, staged.meta, _soft_pin_until_ms(staged.meta))
        handle = staged.handle
        head = record.encode()
        copy_into(handle.buffer[: len(head)], np.frombuffer(head, dtype=np.uint8))
        handle.note_written(handle.entry.nbytes - handle.written)
        return record

    def install(self, stored: Stored) -> Stored | None:
        """Make a prepared version current, in one step (no await): readers find it from now on, and
        the version it replaces (returned) is retired."""
        return self._install(stored)

    def discard(self, stored: Stored) -> None:
        """Undo a prepared version that will not be installed."""
        self.retire(stored.block)

    async def abort(self, staged: Staged) -> None:
        if not staged.handle.done:
            await self.store.revoke(staged.handle)

    def _install(self, stored: Stored) -> Stored | None:
        old = self.objects.get(stored.oid)
        self.objects[stored.oid] = stored
        self.by_block[stored.block] = stored.oid
        self.by_tenant[stored.record.tenant].add(stored.oid)
        if old is not None:
            self.by_block.pop(old.block, None)
            self.retire(old.block)
        self.publish(stored)  # the new version first: the old block is retired (freed) after it
        return old

    # The same-host directory -------------------------------------------------------------------

    def publish(self, stored: Stored) -> None:
        """Publish the object's current version for same-host readers, where its owner serves it and
        its bytes are in the pool; else make sure it is not published."""
        if self.directory is None or self.pool_tier is None:  # (a directory comes with a pool)
            return
        slot = self.store.slot_of(stored.block, self.pool_tier) if self.publishes(stored.oid) else None
        if slot is None or not self.directory.publish(stored.oid, slot[0] + stored.offset, stored.size, stored.version):
            self.directory.unpublish(stored.oid)

    def unpublish_if(self, which: Callable[[bytes], bool]) -> None:
        """Take the objects ``which`` picks out of the directory (their slot stopped being served)."""
        if self.directory is not None:
            for oid in [o for o in self.objects if which(o)]:
                self.directory.unpublish(oid)

    def republish(self) -> None:
        """Publish anew what this node serves (its map changed)."""
        if self.directory is not None:
            self.directory.clear()
            for stored in list(self.objects.values()):
                self.publish(stored)

    def _pin(self, block: bytes, meta: Meta, soft_until_ms: int) -> None:
        if meta.hard_pin:
            self.store.pin(block, hard=True)
        elif meta.soft_pin_ms is not None:
            ttl = max(0.0, soft_until_ms / 1e3 - time.time())
            if ttl > 0:
                self.store.pin(block, ttl=ttl)

    # Removing ---------------------------------------------------------------------------------------

    def remove(self, oid: bytes) -> Stored | None:
        """Forget the object (its block is retired); the version removed, or None."""
        stored = self.objects.pop(oid, None)
        if stored is None:
            return None
        if self.directory is not None:
            self.directory.unpublish(oid)
        self.by_block.pop(stored.block, None)
        tenant = self.by_tenant.get(stored.record.tenant)
        if tenant is not None:
            tenant.discard(oid)
            if not tenant:
                del self.by_tenant[stored.record.tenant]
        self.retire(stored.block)
        return stored

    def retire(self, block: bytes) -> None:
        """Remove a block no version points at, now or once its readers are done."""
        self._retiring.add(block)
        if self._retirer is None or self._retirer.done():
            self._retirer = asyncio.get_running_loop().create_task(self._retire())

    async def _retire(self) -> None:
        while self._retiring:
            for block in list(self._retiring):
                if block in self.by_block:  # current again (a backup handed the same version back)
                    self._retiring.discard(block)
                    continue
                try:
                    await self.store.remove(block)
                except ObjectNotFoundError:
                    pass
                except ObjectLeasedError:
                    continue  # a reader is copying it: next round
                except StoreError as exc:
                    log.warning("objects: could not remove retired block %s: %s", block.hex()[:16], exc)
                    if self.store.contains(block):
                        continue
                self._retiring.discard(block)
            if self._retiring:
                await asyncio.sleep(self.RETIRE_EVERY_S)

    async def drain(self) -> None:
        """Wait until every retired block is gone (tests, and a clean stop)."""
        while self._retirer is not None and not self._retirer.done():
            await asyncio.shield(self._retirer)

    async def retired(self, within: float = 2.0) -> bool:
        """Wait (at most ``within`` seconds) until every retired block is gone from the store, so that
        an acknowledged remove stays done across a crash: a restarted node rebuilds its table from the
        blocks it finds (``recover``), and a removed version, or an older one still retiring, would come
        back. False when a reader held one past ``within`` (it goes once the reader lets go)."""
        try:
            async with asyncio.timeout(within):
                await self.drain()
        except TimeoutError:
            return False
        return True

    # Mooncake's read lease --------------------------------------------------------------------------

    def lease(self, stored: Stored, age: float = 0.0) -> None:
        """A reader found the object ``age`` seconds ago: it stays (no remove without force, no
        eviction) for ``lease_ttl`` from then."""
        until = time.monotonic() - age + self.lease_ttl
        if until > stored.lease_until:
            stored.lease_until = until
            with contextlib.suppress(StoreError):
                self.store.hold(stored.block, until)

    @staticmethod
    def leased(stored: Stored) -> bool:
        return stored.lease_until > time.monotonic()

    def withdraw(self, stored: Stored) -> bool:
        """Ahead of a remove without force: False while a reader's lease holds the object (granted by
        this node, or a same-host reader's copy from the directory: then made this node's own lease,
        and the object published again); True when it may go (out of the directory already)."""
        if self.leased(stored):
            return False
        if self.directory is None:
            return True
        read_at = self.directory.withdraw(stored.oid)
        if read_at + self.lease_ttl <= time.monotonic():
            return True
        self.lease(stored, age=max(0.0, time.monotonic() - read_at))
        self.publish(stored)
        return False

    # Reading ----------------------------------------------------------------------------------------

    def read_lease(self, stored: Stored):
        """A lease on the version's block in memory (the store's ``Lease``: released by the caller), or
        None when it is only on disk (``read_disk``)."""
        try:
            return self.store.acquire_lease(stored.block, math.inf)
        except ObjectNotFoundError:
            if not self.store.contains(stored.block):
                raise
            return None

    async def read_disk(self, stored: Stored) -> np.ndarray:
        """The object's bytes read from a disk copy (maybe promoted into memory on the way)."""
        block = await self.store.get(stored.block)
        return block[stored.offset : stored.offset + stored.size]

    # Eviction and recovery --------------------------------------------------------------------------

    def _on_change(self, change: BlockChange) -> None:
        """A block came into or left a tier: a current version leaving the pool is unpublished (before
        its slot is freed: the store tells before it releases); coming back into it, published again;
        its last copy leaving, eviction took the object."""
        if not is_object_tenant(change.tenant):
            return
        oid = self.by_block.get(change.key)
        if oid is None:
            return
        stored = self.objects.get(oid)
        if stored is None or stored.block != change.key:
            return
        if change.tier == self.pool_tier and self.directory is not None:
            if change.added:
                self.publish(stored)
            else:
                self.directory.unpublish(oid)
        if change.added or self.store.contains(change.key):
            return
        self.objects.pop(oid)
        self.by_block.pop(change.key, None)
        self.by_tenant[stored.record.tenant].discard(oid)
        self.evicted += 1
        for listener in self.on_evicted:
            listener(stored)

    async def recover(self) -> int:
        """Rebuild the table from the object blocks the store holds (after a restart): the highest
        version of each object is current, older ones and blocks that are no record are removed.
        Returns how many objects it found."""
        best: dict[BlockKey, tuple[Record, bytes]] = {}
        stale: list[bytes] = []
        for block in self.store.keys():
            stored = self.store.stored_as(block)
            if stored is None or not is_object_tenant(stored[0]):
                continue
            nbytes = stored[1]
            try:
                record = Record.decode(await self._head(block))
            except (RecordError, StoreError) as exc:
                log.warning("objects: block %s is not a readable object record (%s); removed", block.hex()[:16], exc)
                stale.append(block)
                continue
            if nbytes != record.offset + record.size:
                log.warning(
                    "objects: block %s is %d bytes, its record says %d; removed",
                    block.hex()[:16],
                    nbytes,
                    record.offset + record.size,
                )
                stale.append(block)
                continue
            oid = object_id(record.name, record.tenant)
            held = best.get(oid)
            if held is None or record.version > held[0].version:
                if held is not None:
                    stale.append(held[1])
                best[oid] = (record, block)
            else:
                stale.append(block)
        for block in stale:
            with contextlib.suppress(StoreError):
                await self.store.remove(block)
        found = 0
        for oid, (record, block) in best.items():
            try:
                self.store.set_keep(block, record.meta.kept)
                self._pin(block, record.meta, record.soft_pin_until_ms)
            except StoreError as exc:  # gone since it was read (a corrupt copy dropped): not an object any more
                log.warning("objects: block %s of %r went during recovery (%s)", block.hex()[:16], record.name, exc)
                continue
            self._install(Stored(oid, record, block))
            found += 1
        return found

    async def _head(self, block: bytes) -> bytes:
        """The first bytes of a block: its record header (a view in memory, a read of those bytes from
        disk, never a promotion)."""
        return await self.store.read_head(block, _HEAD.size + MAX_TENANT + MAX_NAME)


def _soft_pin_until_ms(meta: Meta) -> int:
    return int(time.time() * 1e3) + meta.soft_pin_ms if meta.soft_pin_ms is not None else 0


def kept_pin(meta: Meta, old: Stored | None) -> Meta:
    """An upsert that keeps the object's soft pin: what is left of the old one, if any."""
    left = None
    if old is not None and old.meta.soft_pin_ms is not None:
        left = max(0, old.record.soft_pin_until_ms - int(time.time() * 1e3))
    return Meta(meta.replicas, meta.persist, meta.hard_pin, left)


MAX_PATTERN = 4096  # bytes of a pattern a client may send
_RE2 = re2.Options()
_RE2.log_errors = False  # a bad pattern is answered INVALID, not logged by RE2 on stderr
_RE2.max_mem = 8 << 20  # what one pattern's automaton may take


def compile_pattern(pattern: str):
    """A client's regular expression, compiled with RE2 (linear time; no backreferences or
    lookarounds); ``ValueError`` naming what is wrong."""
    if len(pattern.encode(errors="surrogatepass")) > MAX_PATTERN:
        raise ValueError(f"a pattern is at most {MAX_PATTERN} bytes")
    try:
        return re2.compile(pattern.encode(errors="surrogatepass"), _RE2)
    except re2.error as exc:
        raise ValueError(f"bad pattern (RE2's syntax: no backreferences or lookarounds): {exc}") from None
