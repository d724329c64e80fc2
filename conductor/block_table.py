"""The placement index's table: which nodes, in which tiers, hold each block, in flat arrays.

Design note. A fleet's index holds 10^8 replicas. As a dict of dicts (a 32-byte ``bytes`` key to a
dict of nodes to a dict of tiers) each cost 740-840 bytes of a conductor's memory, and a full
garbage collection walked them all. Here a block is one row of fixed-width numpy arrays:

    keys   (rows, 4) uint64  the 32-byte block key
    tenant (rows,)   uint16  the tenant's id (``tenants`` names it)
    size   (rows,)   uint32  bytes (every copy of a block has the same)
    node   (rows, 2) uint32  up to two holders inline: a node's id (0: none; slot 1 only if slot 0) ...
    bits   (rows, 2) uint8   ... and a bit per tier it holds the block in (``TIER_BITS``)

plus ``extra``, row -> {node id: bits}, for a third holder on (a hot block replicated wide). That is
48 bytes a block; a block in a node's pool and on its SSD is one holder with two bits. Each node's
rows are listed too (``NodeRows``, 4-8 bytes a replica), so a node's leaving costs its own rows. The
rows live in one reserved anonymous mapping (``MAP_NORESERVE``): pages become memory as rows are
first used, and growing never copies. An open-addressing table of row ids (linear probing,
tombstones) finds a key; it grows into a table of four times its live keys by migrating
``MIGRATE_SLOTS`` slots per change batch (a finder looks in both meanwhile), so no call stalls the
conductor's loop for a rehash of 10^8 keys. Every operation takes a batch of keys of one tenant and
works over arrays.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tiercake.blocks import KEY_BYTES

KEY_WORDS = KEY_BYTES // 8
# A slot is 0 (EMPTY: never used, so a new table is untouched zero pages until keys land in it),
# -1 (GONE: its key was removed; probing goes on past it), or a key's tag and its row + 1 (> 0).
EMPTY, GONE = 0, -1
BUCKET = 8  # slots a probe reads at once: 8 of (31-bit tag, row + 1) in 64 bits, one cache line
MAX_LOAD = 0.75  # slots in use (live or gone) before the table moves to a bigger (or cleaner) one
GROWTH = 2.5  # a new table has this many slots per key (then 0.4 full)
MIN_SLOTS = 1 << 10
MIGRATE_SLOTS = 1 << 16  # slots of the old table moved per change batch while it is being left
_ROW = np.int64(0xFFFFFFFF)
_TAG_BIT = np.int64(1 << 30)  # set in every tag, so no tag is 0 and an empty slot never matches one
_SPAN = np.arange(2 * BUCKET)
MAX_HOLDER_BITS = 8  # tiers a conductor tells apart
DEFAULT_RESERVE = 1 << 30  # rows reserved (48 GiB of address space, memory only as used)
ROW_BYTES = KEY_BYTES + 2 + 4 + 2 * 4 + 2
# The fixed bits of the usual tiers (fastest first); other tier names take the bits left, in the
# order a conductor first hears of them.
TIER_BITS = {"gpu": 0, "pool": 1, "ssd": 2}
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value where the module lacks it

_M = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64)
_F1, _F2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


class IndexFullError(Exception):
    """The table holds as many blocks as its reservation (``conductor.index_max_blocks``)."""


class TooManyNamesError(ValueError):
    """More tenants, nodes or tiers than the table's ids can name."""


# Block keys as callers hold them: 32-byte keys in a list, back to back, or as ``as_keys`` gives them.
BlockKeys = Sequence[bytes] | bytes | np.ndarray


def as_keys(keys: BlockKeys) -> np.ndarray:
    """Block keys as a (n, 4) uint64 array: from 32-byte ``bytes`` each, their concatenation, or
    such an array already. ``ValueError`` for a key of another length."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.shape[1] != KEY_WORDS or keys.dtype != np.uint64:
            raise ValueError(f"keys must be a (n, {KEY_WORDS}) uint64 array, got {keys.dtype}{keys.shape}")
        return keys
    if isinstance(keys, bytes | bytearray | memoryview):
        raw = bytes(keys)
    else:
        if any(len(k) != KEY_BYTES for k in keys):
            bad = next(len(k) for k in keys if len(k) != KEY_BYTES)
            raise ValueError(f"a block key is {KEY_BYTES} bytes, got {bad}")
        raw = b"".join(keys)
    if len(raw) % KEY_BYTES:
        raise ValueError(f"keys must be a whole number of {KEY_BYTES}-byte keys, got {len(raw)} bytes")
    return np.frombuffer(raw, dtype="<u8").reshape(-1, KEY_WORDS)


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The inverse of ``as_keys``: each row as its 32 bytes."""
    raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def _hash(keys: np.ndarray, salt: np.uint64) -> np.ndarray:
    """64 bits of each key and its tenant: MurmurHash3's finalizer on each of the key's four words
    (each xored with its own seed, the first also with the tenant's), xored together. Every input bit
    reaches every output bit, so keys need not be uniform: tests' and benches' are counters in a few
    bytes, which a multiply alone leaves in a handful of bits."""
    words = keys ^ _M
    words[:, 0] ^= salt
    words ^= words >> np.uint64(33)
    words *= _F1
    words ^= words >> np.uint64(33)
    words *= _F2
    words ^= words >> np.uint64(33)
    return np.bitwise_xor.reduce(words, axis=1)


class _Names:
    """Names to small ids and back (id 0 unused: it means none)."""

    def __init__(self, what: str, limit: int) -> None:
        self.what, self.limit = what, limit
        self.ids: dict[str, int] = {}
        self.names: list[str] = [""]

    def id(self, name: str, create: bool = True) -> int:
        found = self.ids.get(name)
        if found is not None or not create:
            return found or 0
        if len(self.names) >= self.limit:
            raise TooManyNamesError(f"more than {self.limit - 1} {self.what}s in the placement index")
        self.ids[name] = len(self.names)
        self.names.append(name)
        return self.ids[name]


class _TierBits(_Names):
    """Tier names to the bit a copy in that tier sets: the usual tiers' fixed (``TIER_BITS``), the
    others' the bits left, in the order they are first heard of."""

    def __init__(self) -> None:
        super().__init__("tier", MAX_HOLDER_BITS - len(TIER_BITS) + 1)

    def bit(self, tier: str, create: bool = True) -> int:
        """-1 for a tier not seen (with ``create`` False)."""
        if tier in TIER_BITS:
            return TIER_BITS[tier]
        tid = self.id(tier, create)
        return len(TIER_BITS) + tid - 1 if tid else -1

    def name(self, bit: int) -> str:
        fixed = [name for name, b in TIER_BITS.items() if b == bit]
        return fixed[0] if fixed else self.names[bit - len(TIER_BITS) + 1]


class _Slots:
    """One open-addressing table: buckets of ``BUCKET`` slots, each a key's tag and its row
    (``tag << 32 | row + 1``), probed a bucket at a time (the next bucket when one is full)."""

    def __init__(self, capacity: int) -> None:
        # Zero pages (all EMPTY) that become memory as keys land. Not huge pages: keys land at random,
        # and the first key in each 2 MiB would have it zeroed whole (a 2 GiB table zeroed by the
        # first batch of a thousand keys, a second's stall); 4 KiB pages spread that over the move.
        self._map = mmap.mmap(-1, capacity * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
        self.ids = np.frombuffer(self._map, dtype=np.int64).reshape(capacity // BUCKET, BUCKET)
        self.mask = np.uint64(capacity // BUCKET - 1)
        self.used = 0  # slots live or gone

    def __len__(self) -> int:
        return self.ids.size


@dataclass(slots=True)
class Found:
    """Where a batch's keys are: each one's row (-1: absent), its slot, and which table holds it."""

    rows: np.ndarray
    slots: np.ndarray
    in_old: np.ndarray


class KeySlots:
    """Where each block's row is: a table of ``_Slots`` from a key (and its tenant) to its row,
    compared against the rows' own keys. It grows by moving to a table of ``GROWTH`` slots per key a
    slice at a time (a finder looks in both meanwhile), so no call holds the loop for a rehash of
    10^8 keys."""

    def __init__(self, keys: np.ndarray, tenant: np.ndarray, salt: Callable[[int], np.uint64]) -> None:
        self.keys, self.tenant, self.salt = keys, tenant, salt  # the rows' keys and tenants, shared
        self._slots = _Slots(MIN_SLOTS)
        self._old: _Slots | None = None  # the table being left, and how far it has been moved
        self._cursor = 0

    def _probe(self, slots: _Slots, h: np.ndarray, keys: np.ndarray, tid: int) -> tuple[np.ndarray, np.ndarray]:
        """Each key's row in ``slots`` (-1: absent) and the slot holding it. A probe reads two buckets
        at once: a key goes past its bucket only when that is full, which at 0.75 full happens to a
        few keys in a hundred, and reading the next one with it spares their batch a second round
        (a chain's lookup is then one round: about a dozen numpy calls)."""
        n = len(h)
        rows = np.full(n, -1, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        tag = (h >> np.uint64(34)).astype(np.int64) | _TAG_BIT
        flat, wrap = slots.ids.reshape(-1), slots.ids.size - 1
        at = (h & slots.mask).astype(np.int64) * BUCKET
        todo: np.ndarray | None = None  # the keys still looked for (None: all of them)
        while True:
            span = (at[:, None] + _SPAN) & wrap  # (keys, 2 * BUCKET) slots
            line = flat[span]
            ki, si = np.nonzero((line >> 32) == (tag if todo is None else tag[todo])[:, None])  # empty, gone < 0
            hit = np.zeros(len(line), dtype=bool)
            if ki.size:
                r = (line[ki, si] & _ROW) - 1
                asked = ki if todo is None else todo[ki]
                same = (self.keys[r] == keys[asked]).all(axis=1) & (self.tenant[r] == tid)
                hit[ki[same]] = True
                rows[asked[same]] = r[same]
                where[asked[same]] = span[ki[same], si[same]]
            on = ~hit & (line != EMPTY).all(axis=1)  # a bucket with a never-used slot ends the probe
            if not on.any():
                return rows, where
            todo = np.flatnonzero(on) if todo is None else todo[on]
            at = (at[on] + 2 * BUCKET) & wrap

    def find(self, tid: int, keys: np.ndarray, h: np.ndarray) -> Found:
        """Where each of a batch's keys (of tenant ``tid``, hashed ``h``) is."""
        rows, slots = self._probe(self._slots, h, keys, tid)
        in_old = np.zeros(len(rows), dtype=bool)
        if self._old is not None:
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                old_rows, old_slots = self._probe(self._old, h[missing], keys[missing], tid)
                there = old_rows >= 0
                rows[missing[there]] = old_rows[there]
                slots[missing[there]] = old_slots[there]
                in_old[missing[there]] = True
        return Found(rows, slots, in_old)

    def place(self, h: np.ndarray, rows: np.ndarray, slots: _Slots | None = None) -> np.ndarray:
        """Put new rows (keys not in any table) into ``slots``; returns each one's final row: itself,
        or the row of an equal key placed earlier in the same batch (a key twice in one report)."""
        slots = slots or self._slots
        final = rows.copy()
        todo = np.arange(len(rows))
        tag = (h >> np.uint64(34)).astype(np.int64) | _TAG_BIT
        entry = (tag << 32) | (rows + 1)
        b = (h & slots.mask).astype(np.int64)
        flat, mask = slots.ids.reshape(-1), int(slots.mask)
        while todo.size:
            line = slots.ids[b]
            mine = rows[todo]
            done = np.zeros(todo.size, dtype=bool)
            ki, si = np.nonzero((line >> 32) == tag[todo, None])  # an equal key placed this batch?
            if ki.size:
                r = (line[ki, si] & _ROW) - 1
                same = (self.tenant[r] == self.tenant[mine[ki]]) & (self.keys[r] == self.keys[mine[ki]]).all(axis=1)
                done[ki[same]] = True
                final[todo[ki[same]]] = r[same]
            free = line <= 0
            has = ~done & free.any(axis=1)
            claim = np.flatnonzero(has)
            if claim.size:
                at = b[claim] * BUCKET + free[claim].argmax(axis=1)
                was = flat[at]
                flat[at] = entry[todo[claim]]  # several may claim one slot: the last write wins it
                won = flat[at] == entry[todo[claim]]
                done[claim[won]] = True
                slots.used += int(np.count_nonzero(was[won] == EMPTY))
            full = ~done & ~has  # no free slot in this bucket: the next one
            todo, b = todo[~done], np.where(full[~done], (b[~done] + 1) & mask, b[~done])
        return final

    def forget(self, found: Found, which: np.ndarray) -> None:
        """The keys at ``which`` of a ``found`` batch are gone from their table."""
        for table, in_old in ((self._slots, False), (self._old, True)):
            if table is not None:
                picked = which[found.in_old[which] == in_old]
                table.ids.reshape(-1)[found.slots[picked]] = GONE

    def maintain(self, changed: int = 0) -> None:
        """Move a slice of the table being left, if any: more after a batch of more changes, so the
        move ends long before the new table fills (and some while idle: ``PlacementIndex``'s timer)."""
        if self._old is not None:
            self._migrate(max(MIGRATE_SLOTS, 8 * changed))

    def room(self, incoming: int, blocks: int) -> None:
        """Make sure ``incoming`` more keys fit the current table under ``MAX_LOAD``: when they would
        not, finish any move under way and start one to a table of four times the keys (or a clean
        one of the same size, when removals left it full of tombstones)."""
        slots = self._slots
        if slots.used + incoming <= MAX_LOAD * len(slots):
            return
        if self._old is not None:
            self._migrate(len(self._old))
        capacity = MIN_SLOTS
        while capacity < GROWTH * (blocks + incoming):
            capacity *= 2
        self._old, self._slots, self._cursor = self._slots, _Slots(capacity), 0
        self._migrate(MIGRATE_SLOTS)

    def _migrate(self, count: int) -> None:
        """Move the next ``count`` slots of the table being left into the current one."""
        old = self._old
        if old is None:
            return
        flat = old.ids.reshape(-1)
        part = flat[self._cursor : self._cursor + count]
        rows = (part[part > 0] & _ROW) - 1
        if rows.size:
            tids = self.tenant[rows]
            for tid in np.unique(tids):
                mine = rows[tids == tid]
                self.place(_hash(self.keys[mine], self.salt(int(tid))), mine)
        part[part > 0] = GONE  # probes of the old table still pass over it
        self._cursor += count
        if self._cursor >= len(old):
            self._old = None

    def __len__(self) -> int:
        return len(self._slots) + (len(self._old) if self._old is not None else 0)


class NodeRows:
    """Each node's rows, so that a node's leaving (or a snapshot of its holdings) costs its own
    rows, not a walk of 10^8 (0.6 s of the loop, on the leader and every follower at once).

    A row is listed when the node first holds it; one the node stops holding stays listed (a
    reader checks each against the table) until the list is filtered, which happens when it has
    grown to twice what was live at its last filtering: appends cost O(1) amortized and a list
    holds at most about twice its node's rows, 4 bytes each."""

    MIN_FILTER = 1024  # entries a list may reach before its first filtering

    def __init__(self, held: Callable[[np.ndarray, int], np.ndarray]) -> None:
        self._held = held  # (rows, node id) -> which rows the node holds now
        self._rows: list[np.ndarray] = []  # per node id: its rows, the first ``_len`` of them in use
        self._len: list[int] = []
        self._filter_at: list[int] = []

    def add(self, nid: int, rows: np.ndarray) -> None:
        """Node ``nid`` now holds ``rows`` (it did not a moment ago)."""
        while nid >= len(self._rows):
            self._rows.append(np.empty(0, np.uint32))
            self._len.append(0)
            self._filter_at.append(self.MIN_FILTER)
        n, listed = self._len[nid], self._rows[nid]
        if n + len(rows) > self._filter_at[nid]:
            live = self.of(nid)
            n = len(live)
            listed[:n] = live
            self._filter_at[nid] = max(self.MIN_FILTER, 2 * (n + len(rows)))
        if n + len(rows) > len(listed):  # grown by a quarter: less idle room than doubling
            grown = np.empty(max(n + len(rows), len(listed) + len(listed) // 4, 64), np.uint32)
            grown[:n] = listed[:n]
            listed = self._rows[nid] = grown
        listed[n : n + len(rows)] = rows
        self._len[nid] = n + len(rows)

    def of(self, nid: int) -> np.ndarray:
        """The rows node ``nid`` holds, sorted."""
        if nid >= len(self._rows):
            return np.zeros(0, np.int64)
        rows = np.unique(self._rows[nid][: self._len[nid]]).astype(np.int64)
        return rows[self._held(rows, nid)]

    def clear(self, nid: int) -> None:
        """Node ``nid`` holds nothing now."""
        if nid < len(self._rows):
            self._rows[nid], self._len[nid], self._filter_at[nid] = np.empty(0, np.uint32), 0, self.MIN_FILTER

    def nbytes(self) -> int:
        return sum(listed.nbytes for listed in self._rows)


class BlockTable:
    def __init__(self, reserve: int = DEFAULT_RESERVE) -> None:
        self.reserve = reserve
        try:
            self._map = mmap.mmap(-1, reserve * ROW_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as exc:
            raise IndexFullError(
                f"cannot reserve address space for {reserve} blocks ({reserve * ROW_BYTES >> 20} MiB): {exc}; "
                "lower conductor.index_max_blocks"
            ) from None
        buf, offset = memoryview(self._map), 0

        def carve(dtype, shape) -> np.ndarray:
            nonlocal offset
            array = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
            offset += array.nbytes
            return array

        self.keys = carve(np.uint64, (reserve, KEY_WORDS))
        self.node = carve(np.uint32, (reserve, 2))
        self.size = carve(np.uint32, (reserve,))
        self.tenant = carve(np.uint16, (reserve,))
        self.bits = carve(np.uint8, (reserve, 2))
        self.extra: dict[int, dict[int, int]] = {}  # row -> node id -> bits, past the two inline holders
        self.end = 0  # rows ever used
        self._free = np.empty(0, dtype=np.int64)  # rows given back, reused first
        self.slots = KeySlots(self.keys, self.tenant, self._salt)
        self.tenants = _Names("tenant", 1 << 16)
        self.nodes = _Names("node", 1 << 32)
        self.tiers = _TierBits()
        self._salts: dict[int, np.uint64] = {}
        self.node_rows_of = NodeRows(lambda rows, nid: self._holder_bits(rows, nid) != 0)
        self.used = np.zeros((1, MAX_HOLDER_BITS), dtype=np.int64)  # [node id, tier bit] -> bytes
        self.replicas = 0
        self.blocks = 0

    # Names ----------------------------------------------------------------------------------------

    def _node(self, name: str, create: bool = True) -> int:
        nid = self.nodes.id(name, create)
        if nid >= len(self.used):
            grown = np.zeros((max(nid + 1, 2 * len(self.used)), MAX_HOLDER_BITS), dtype=np.int64)
            grown[: len(self.used)] = self.used
            self.used = grown
        return nid

    def _salt(self, tid: int) -> np.uint64:
        salt = self._salts.get(tid)
        if salt is None:
            salt = self._salts[tid] = np.uint64(xxhash.xxh3_64_intdigest(self.tenants.names[tid].encode()))
        return salt

    def used_bytes(self, node: str, tier: str) -> int:
        nid, bit = self.nodes.id(node, create=False), self.tiers.bit(tier, create=False)
        return int(self.used[nid, bit]) if nid and bit >= 0 else 0

    # Finding --------------------------------------------------------------------------------------

    def find(self, tenant: str, keys: np.ndarray) -> np.ndarray:
        """Each key's row (-1: not held anywhere)."""
        tid = self.tenants.id(tenant, create=False)
        if not tid or not len(keys):
            return np.full(len(keys), -1, dtype=np.int64)
        return self._find(tid, keys).rows

    def _find(self, tid: int, keys: np.ndarray, h: np.ndarray | None = None) -> Found:
        return self.slots.find(tid, keys, _hash(keys, self._salt(tid)) if h is None else h)

    # Rows -----------------------------------------------------------------------------------------

    def _allocate(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free))
        rows = self._free[len(self._free) - reuse :]
        self._free = self._free[: len(self._free) - reuse]
        fresh = n - reuse
        if self.end + fresh > self.reserve:
            self._free = np.concatenate([self._free, rows])
            raise IndexFullError(
                f"the placement index holds {self.blocks} blocks, its reservation (conductor.index_max_blocks "
                f"= {self.reserve}); raise it or add a conductor shard"
            )
        rows = np.concatenate([rows, np.arange(self.end, self.end + fresh, dtype=np.int64)])
        self.end += fresh
        return rows

    def _forget(self, found: Found, which: np.ndarray) -> None:
        """The keys at ``which`` of a ``found`` batch have no holder left: out of the table, rows freed."""
        self.slots.forget(found, which)
        self._release(found.rows[which])
        self.blocks -= len(which)

    def _release(self, rows: np.ndarray) -> None:
        self.node[rows] = 0
        self.bits[rows] = 0
        self._free = np.concatenate([self._free, rows.astype(np.int64)])

    def _insert(self, tid: int, keys: np.ndarray, h: np.ndarray, size: np.ndarray) -> np.ndarray:
        """Rows for keys held nowhere yet; a key twice in the batch gets one row."""
        self.slots.room(len(keys), self.blocks)
        rows = self._allocate(len(keys))
        self.keys[rows] = keys
        self.tenant[rows] = tid
        self.size[rows] = size
        self.node[rows] = 0
        self.bits[rows] = 0
        final = self.slots.place(h, rows)
        spare = rows[final != rows]
        if spare.size:
            self._free = np.concatenate([self._free, spare])
        self.blocks += len(rows) - len(spare)
        return final

    # Holders --------------------------------------------------------------------------------------

    def _hold(self, rows: np.ndarray, nid: int, bit: int) -> np.ndarray:
        """Record that node ``nid`` holds each row in tier ``bit``; True where it was not held there."""
        flag = np.uint8(1 << bit)
        n0, n1 = self.node[rows, 0], self.node[rows, 1]
        at0 = (n0 == nid) | (n0 == 0)
        at1 = ~at0 & ((n1 == nid) | (n1 == 0))
        new = np.zeros(len(rows), dtype=bool)
        holder = (at0 & (n0 == 0)) | (at1 & (n1 == 0))  # rows the node did not hold in any tier
        for slot, chosen in ((0, at0), (1, at1)):
            r = rows[chosen]
            if r.size:
                was = self.bits[r, slot]
                new[chosen] = (was & flag) == 0
                self.node[r, slot] = nid
                self.bits[r, slot] = was | flag
        for i in np.flatnonzero(~at0 & ~at1):  # a third holder on: rare, a hot block's
            holders = self.extra.setdefault(int(rows[i]), {})
            was = holders.get(nid, 0)
            new[i] = not was & int(flag)
            holder[i] = not was
            holders[nid] = was | int(flag)
        if holder.any():
            self.node_rows_of.add(nid, rows[holder])
        return new

    def _unhold(self, rows: np.ndarray, nid: int, bit: int) -> np.ndarray:
        """Node ``nid`` no longer holds each row in tier ``bit``; True where it did."""
        flag = np.uint8(1 << bit)
        gone = np.zeros(len(rows), dtype=bool)
        for slot in (0, 1):
            at = np.flatnonzero(self.node[rows, slot] == nid)
            if at.size:
                r = rows[at]
                was = self.bits[r, slot]
                gone[at] = (was & flag) != 0
                self.bits[r, slot] = was & ~flag
        if self.extra:
            for i in np.flatnonzero(~gone):
                holders = self.extra.get(int(rows[i]))
                if holders and holders.get(nid, 0) & int(flag):
                    gone[i] = True
                    holders[nid] &= ~int(flag)
                    if not holders[nid]:
                        del holders[nid]
                    if not holders:
                        del self.extra[int(rows[i])]
        self._compact(rows)
        return gone

    def _compact(self, rows: np.ndarray) -> None:
        """Holders with no tier left give their slot up: slot 1 moves to slot 0, and a holder kept
        in ``extra`` moves inline."""
        for slot in (0, 1):
            empty = rows[(self.bits[rows, slot] == 0) & (self.node[rows, slot] != 0)]
            self.node[empty, slot] = 0
        lone = rows[(self.node[rows, 0] == 0) & (self.node[rows, 1] != 0)]
        self.node[lone, 0], self.bits[lone, 0] = self.node[lone, 1], self.bits[lone, 1]
        self.node[lone, 1], self.bits[lone, 1] = 0, 0
        if self.extra:
            for row in rows[self.node[rows, 1] == 0]:
                holders = self.extra.get(int(row))
                if holders:
                    nid, bits = holders.popitem()
                    slot = 0 if self.node[row, 0] == 0 else 1
                    self.node[row, slot], self.bits[row, slot] = nid, bits
                    if not holders:
                        del self.extra[int(row)]

    def _holder_bits(self, rows: np.ndarray, nid: int) -> np.ndarray:
        """The tier bits node ``nid`` holds each row in (0: none)."""
        n0, n1 = self.node[rows, 0], self.node[rows, 1]
        bits = np.where(n0 == nid, self.bits[rows, 0], np.where(n1 == nid, self.bits[rows, 1], 0)).astype(np.uint8)
        if self.extra:
            for i in np.flatnonzero((bits == 0) & (n1 != 0)):
                bits[i] = self.extra.get(int(rows[i]), {}).get(nid, 0)
        return bits

    # Changes --------------------------------------------------------------------------------------

    def add(self, tenant: str, keys: np.ndarray, node: str, tier: str, sizes: np.ndarray) -> np.ndarray:
        """``node`` holds these blocks in ``tier``: True for each replica that is new (or whose size
        changed). A key twice in ``keys`` counts once, at its first place."""
        if not len(keys):
            return np.zeros(0, dtype=bool)
        tid = self.tenants.id(tenant)
        nid, bit = self._node(node), self.tiers.bit(tier)
        h = _hash(keys, self._salt(tid))
        rows = self._find(tid, keys, h).rows
        resized = np.zeros(len(keys), dtype=bool)
        present = np.flatnonzero(rows >= 0)
        if present.size:
            changed = present[self.size[rows[present]] != sizes[present]]
            if changed.size:
                self._resize(rows[changed], sizes[changed])
                resized[changed] = True
        absent = np.flatnonzero(rows < 0)
        if absent.size:
            rows[absent] = self._insert(tid, keys[absent], h[absent], sizes[absent])
        unique, first = np.unique(rows, return_index=True)
        new = np.zeros(len(keys), dtype=bool)
        fresh = self._hold(unique, nid, bit)
        new[first] = fresh | resized[first]
        self.replicas += int(np.count_nonzero(fresh))
        self.used[nid, bit] += int(self.size[unique[fresh]].sum(dtype=np.int64))
        self.slots.maintain(len(keys))
        return new

    def _resize(self, rows: np.ndarray, sizes: np.ndarray) -> None:
        """A block reported with another size: every holder's bytes follow (rare; sizes are the same
        wherever a block is)."""
        for row, size in zip(rows.tolist(), sizes.tolist(), strict=True):
            delta = size - int(self.size[row])
            for nid, bits in self._holders_of(row):
                for b in range(MAX_HOLDER_BITS):
                    if bits >> b & 1:
                        self.used[nid, b] += delta
            self.size[row] = size

    def remove(self, tenant: str, keys: np.ndarray, node: str, tier: str) -> np.ndarray:
        """``node`` no longer holds these blocks in ``tier``: True for each replica the table had."""
        tid, nid = self.tenants.id(tenant, create=False), self.nodes.id(node, create=False)
        bit = self.tiers.bit(tier, create=False)
        removed = np.zeros(len(keys), dtype=bool)
        if not tid or not nid or bit < 0 or not len(keys):
            return removed
        found = self._find(tid, keys)
        at = np.flatnonzero(found.rows >= 0)
        rows, first = np.unique(found.rows[at], return_index=True)
        at = at[first]
        gone = self._unhold(rows, nid, bit)
        removed[at] = gone
        self.replicas -= int(np.count_nonzero(gone))
        self.used[nid, bit] -= int(self.size[rows[gone]].sum(dtype=np.int64))
        empty = self.node[rows, 0] == 0
        if empty.any():
            self._forget(found, at[empty])
        self.slots.maintain(len(keys))
        return removed

    def drop_node(self, node: str) -> int:
        """Forget every replica ``node`` holds (it left); returns how many there were."""
        nid = self.nodes.id(node, create=False)
        if not nid:
            return 0
        rows = self.node_rows_of.of(nid)
        self.node_rows_of.clear(nid)
        dropped = int(_POPCOUNT[self._holder_bits(rows, nid)].sum())
        for slot in (0, 1):
            self.bits[rows[self.node[rows, slot] == nid], slot] = 0
        for row in rows.tolist() if self.extra else ():
            holders = self.extra.get(row, {})
            if holders.pop(nid, 0) and not holders:
                del self.extra[row]
        self._compact(rows)
        empty = rows[self.node[rows, 0] == 0]
        for tid in np.unique(self.tenant[empty]):
            mine = empty[self.tenant[empty] == tid]
            found = self._find(int(tid), self.keys[mine].copy())
            self._forget(found, np.flatnonzero(found.rows >= 0))
        self.replicas -= dropped
        self.used[nid] = 0
        return dropped

    # Reads ----------------------------------------------------------------------------------------

    def _holders_of(self, row: int) -> list[tuple[int, int]]:
        out = [(int(self.node[row, s]), int(self.bits[row, s])) for s in (0, 1) if self.node[row, s]]
        return out + list(self.extra.get(row, {}).items())

    def holders(self, tenant: str, keys: np.ndarray) -> list[list[tuple[str, str, int]]]:
        """(node, tier, size) of each replica of each block."""
        names = self.nodes.names
        out: list[list[tuple[str, str, int]]] = []
        for row in self.find(tenant, keys).tolist():
            if row < 0:
                out.append([])
                continue
            size = int(self.size[row])
            out.append(
                [
                    (names[nid], self.tiers.name(b), size)
                    for nid, bits in self._holders_of(row)
                    for b in range(MAX_HOLDER_BITS)
                    if bits >> b & 1
                ]
            )
        return out

    def chain(self, tenant: str, keys: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """For each node holding the chain's first block: the tier bits of each block of the longest
        prefix it holds, and their sizes."""
        rows = self.find(tenant, keys)
        if not len(rows) or rows[0] < 0:
            return {}
        miss = np.flatnonzero(rows < 0)
        rows = rows[: miss[0]] if miss.size else rows
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for nid, _ in self._holders_of(int(rows[0])):
            bits = self._holder_bits(rows, nid)
            gap = np.flatnonzero(bits == 0)
            length = int(gap[0]) if gap.size else len(rows)
            out[self.nodes.names[nid]] = (bits[:length], self.size[rows[:length]])
        return out

    def node_rows(self, node: str) -> tuple[np.ndarray, np.ndarray]:
        """The rows ``node`` holds, and its tier bits on each."""
        nid = self.nodes.id(node, create=False)
        if not nid:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        rows = self.node_rows_of.of(nid)
        return rows, self._holder_bits(rows, nid)

    def live_rows(self, start: int, count: int) -> np.ndarray:
        """The rows in ``[start, start + count)`` that hold a block."""
        stop = min(self.end, start + count)
        return start + np.flatnonzero(self.node[start:stop, 0] != 0)

    def holdings(self, rows: np.ndarray) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The holders of ``rows``, as arrays: (rows, node ids, tier bits), once per inline slot and
        once for the holders kept beside the rows."""
        for slot in (0, 1):
            held = rows[self.node[rows, slot] != 0]
            yield held, self.node[held, slot].copy(), self.bits[held, slot].copy()
        extra = [(row, nid, bits) for row in rows.tolist() for nid, bits in self.extra.get(row, {}).items()]
        if extra:
            held, nids, bits = zip(*extra)
            yield np.array(held, np.int64), np.array(nids, np.uint32), np.array(bits, np.uint8)

    def memory(self) -> int:
        """Bytes in use: the rows ever used and the hash tables (what a conductor's RSS holds)."""
        return self.end * ROW_BYTES + len(self.slots) * 8 + self.node_rows_of.nbytes()

    def __len__(self) -> int:
        return self.replicas
