"""The placement index: which node and tier hold each block, in this conductor's memory.

Design note (docs/SCALE.md). A block's placement is a routing hint that its holder can always say
again, and a fleet has 10^8 of them changing at a million a second: far past what a consensus store
holds (etcd: a few GiB, tens of thousands of writes a second). So no placement is written to etcd.
The leader, which members report to, keeps the index in a ``BlockTable`` (48 bytes a block) and
logs each batch of changes it applied; followers follow that log over HTTP (``changes_after``, or
a ``snapshot`` page by page when one is in another term or too far behind) and answer lookups from
their mirror. Nothing a member acknowledged is lost when the leader dies: the follower that wins
keeps its mirror (``keep_mirror``) if it is fresh, and every member re-reports the changes it had
acknowledged in the window the new term names (``KeepAliveReply.rereport_s``); otherwise the new
leader starts empty and members re-report everything. A member that leaves takes its replicas with
it (``drop_node``, logged).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .block_table import DEFAULT_RESERVE, KEY_BYTES, MAX_HOLDER_BITS, BlockKeys, BlockTable, as_keys, key_bytes

LOG_KEYS = 1 << 24  # block keys the change log keeps for followers (at most 600 MiB, a minute of a fleet's fill)
SNAPSHOT_ROWS = 1 << 16  # rows of the table per snapshot page
TIER_ORDER = {"gpu": 0, "pool": 1, "ssd": 2}  # fastest first; other tier names after these


@dataclass(frozen=True, slots=True)
class Replica:
    node: str
    tier: str


@dataclass(frozen=True, slots=True)
class Change:
    """One batch of changes the leader applied, as followers apply it: blocks of one tenant that
    ``node`` now holds (``add``, with each block's size) or no longer holds (``remove``) in ``tier``,
    or every replica of ``node`` gone (``drop``: it left)."""

    kind: Literal["add", "remove", "drop"]
    tenant: str = ""
    node: str = ""
    tier: str = ""
    keys: np.ndarray = field(default_factory=lambda: np.zeros((0, KEY_BYTES // 8), dtype=np.uint64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))


@dataclass(slots=True)
class NodePrefix:
    """How much of a chain one node holds: the leading ``length`` blocks, each one's tier bits (in
    ``table``'s numbering) and size."""

    length: int
    bits: np.ndarray
    block_sizes: np.ndarray
    tier_name: dict[int, str]  # tier bit -> name, for the bits this prefix has

    @property
    def tiers(self) -> dict[str, int]:
        """Tier -> blocks of the prefix it holds."""
        return {name: int(np.count_nonzero(self.bits >> b & 1)) for b, name in self.tier_name.items()}

    def runs(self) -> list[tuple[str, int]]:
        """The tier each block is served from (its fastest), run-length encoded in chain order: what
        a reader of the prefix will get from where."""
        fastest = {}
        for bits in np.unique(self.bits).tolist():
            names = [self.tier_name[b] for b in range(MAX_HOLDER_BITS) if bits >> b & 1]
            fastest[bits] = min(names, key=lambda t: (TIER_ORDER.get(t, len(TIER_ORDER)), t))
        out: list[tuple[str, int]] = []
        for bits in self.bits.tolist():
            tier = fastest[bits]
            if out and out[-1][0] == tier:
                out[-1] = (tier, out[-1][1] + 1)
            else:
                out.append((tier, 1))
        return out

    def sizes(self) -> list[int]:
        """Each block's size in bytes, in chain order (its copies in every tier have the same)."""
        return self.block_sizes.tolist()


@dataclass(slots=True)
class IndexStats:
    lookups: int = 0
    batches: int = 0  # change batches applied (reports, removals, commits)
    ops: int = 0  # replicas added or removed by them
    bytes: int = 0  # of block keys and sizes those changes carried
    # changes by tier and kind ("pool+": added to a pool, "ssd-": removed from an SSD tier)
    changes: Counter = field(default_factory=Counter)
    largest_batch: int = 0


def _check(name: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{name} must be non-empty and contain no '/': {value!r}")
    return value


def _sizes(sizes: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    array = np.asarray(sizes, dtype=np.int64)
    if array.shape != (n,):
        raise ValueError(f"{n} keys for {array.size} sizes")
    if n and (array.min() < 0 or array.max() >= 1 << 32):
        raise ValueError("a block's size is 0 to 4 GiB - 1")
    return array.astype(np.uint32)


class PlacementIndex:
    def __init__(self, log_keys: int = LOG_KEYS, reserve: int = DEFAULT_RESERVE) -> None:
        self.table = BlockTable(reserve)
        self.stats = IndexStats()
        self.log_keys = log_keys
        # the leader's log of applied changes for its followers: (sequence number, change), oldest first
        self._log: deque[tuple[int, Change]] = deque()
        self._logged_keys = 0
        self.seq = 0  # the sequence number of the last logged change
        self._logged = asyncio.Event()  # set (and replaced) at each logged change
        self._maintainer: asyncio.Task | None = None

    async def start(self) -> PlacementIndex:
        self._maintainer = asyncio.get_running_loop().create_task(self._maintain_forever())
        return self

    async def close(self) -> None:
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer

    async def _maintain_forever(self) -> None:
        while True:  # a table that grew is moved on while changes are few, a slice at a time
            await asyncio.sleep(0.01)
            self.table.slots.maintain()

    # Changes --------------------------------------------------------------------------------------

    def add_many(self, tenant: str, keys: BlockKeys, node: str, tier: str, sizes: Sequence[int] | np.ndarray) -> int:
        """``node`` holds these blocks in ``tier`` (each of the given size); returns how many replicas
        were new (or changed size). Logged for followers."""
        _check("tenant", tenant), _check("node", node), _check("tier", tier)
        array = as_keys(keys)
        size = _sizes(sizes, len(array))
        new = self.table.add(tenant, array, node, tier, size)
        count = int(np.count_nonzero(new))
        self._count(tier + "+", len(array), count)
        if count:
            self._record(Change("add", tenant, node, tier, array[new], size[new]))
        return count

    def remove_many(self, tenant: str, keys: BlockKeys, node: str, tier: str) -> int:
        """``node`` no longer holds these blocks in ``tier``; returns how many replicas the index had."""
        array = as_keys(keys)
        removed = self.table.remove(tenant, array, node, tier)
        count = int(np.count_nonzero(removed))
        self._count(tier + "-", len(array), count)
        if count:
            self._record(Change("remove", tenant, node, tier, array[removed]))
        return count

    def _count(self, kind: str, sent: int, applied: int) -> None:
        stats = self.stats
        stats.batches += 1
        stats.ops += applied
        stats.bytes += sent * (KEY_BYTES + 4)
        stats.changes[kind] += applied
        stats.largest_batch = max(stats.largest_batch, sent)

    def drop_node(self, node: str) -> int:
        """Forget every replica of ``node`` (it left: logged, so followers forget them too); returns how many."""
        dropped = self.table.drop_node(node)
        if dropped:
            self._record(Change("drop", node=node))
        return dropped

    def clear(self) -> int:
        """Forget everything (this conductor's term began with nothing to keep, or ended: it follows
        the next leader from a snapshot); returns how many replicas it held."""
        held = len(self.table)
        self.table = BlockTable(self.table.reserve)
        self._log.clear()
        self._logged_keys = 0
        return held

    def keep_mirror(self, members: Iterable[str]) -> int:
        """A follower that wins keeps what it mirrored of the old leader's index, but for the nodes no
        longer ``members`` (they left while nobody led, so nobody logged it); its own followers start
        from a snapshot of the new term. Returns how many replicas it kept."""
        live = set(members)
        for node in [n for n in self.table.nodes.names[1:] if n not in live]:
            self.table.drop_node(node)
        self._log.clear()
        self._logged_keys = 0
        return len(self.table)

    def _record(self, change: Change) -> None:
        self.seq += 1
        self._log.append((self.seq, change))
        self._logged_keys += len(change.keys) + 1
        while self._logged_keys > self.log_keys and len(self._log) > 1:
            _, old = self._log.popleft()
            self._logged_keys -= len(old.keys) + 1
        self._logged.set()
        self._logged = asyncio.Event()

    # The followers' feed --------------------------------------------------------------------------

    def changes_after(self, after: int, max_keys: int = 1 << 17) -> list[Change] | None:
        """The logged changes after sequence number ``after``, in order, up to about ``max_keys``
        keys; None when they are no longer (or never were) in the log: the caller needs a snapshot."""
        first = self._log[0][0] - 1 if self._log else self.seq
        if not first <= after <= self.seq:
            return None
        out, keys = [], 0
        for seq, change in self._log:  # the follower is usually a few entries behind: read from the end
            if seq > after:
                out.append(change)
                keys += len(change.keys) + 1
                if keys >= max_keys:
                    break
        return out

    def snapshot(self, start_row: int, rows: int | None = None) -> tuple[list[Change], int | None]:
        """Every replica in rows ``[start_row, start_row + rows)`` of the table (``SNAPSHOT_ROWS`` by
        default), as ``add`` changes by tenant, node and tier, and the row to ask for next (None: that
        was the last). Taken page by page while changes go on, it is fuzzy, and exact once the changes
        logged after its first page are applied over it (each change says what a replica is now, so
        applying it again is harmless)."""
        table = self.table
        live = table.live_rows(start_row, rows or SNAPSHOT_ROWS)
        changes = []
        for held, nids, bits in table.holdings(live):
            for b in range(MAX_HOLDER_BITS):
                has = (bits >> b & 1).astype(bool)
                if not has.any():
                    continue
                picked, owners = held[has], nids[has]
                groups = table.tenant[picked].astype(np.uint64) << np.uint64(32) | owners.astype(np.uint64)
                order = np.argsort(groups, kind="stable")
                picked, groups = picked[order], groups[order]
                starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]]).tolist() + [len(groups)]
                for first, end in zip(starts[:-1], starts[1:], strict=True):
                    group, mine = int(groups[first]), picked[first:end]
                    tenant, node = table.tenants.names[group >> 32], table.nodes.names[group & 0xFFFFFFFF]
                    changes.append(Change("add", tenant, node, table.tiers.name(b), table.keys[mine], table.size[mine]))
        nxt = start_row + (rows or SNAPSHOT_ROWS)
        return changes, (nxt if nxt < table.end else None)

    async def wait_change(self, after: int, timeout: float) -> None:
        """Return once a change after ``after`` is logged, or after ``timeout`` seconds."""
        if self.seq == after:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._logged.wait(), timeout)

    def apply(self, changes: Iterable[Change], reset: bool = False) -> None:
        """A follower applies what the leader logged (``reset``: the first page of a snapshot, which
        replaces what it had)."""
        if reset:
            self.clear()
        for change in changes:
            if change.kind == "add":
                self.table.add(change.tenant, change.keys, change.node, change.tier, change.sizes)
            elif change.kind == "remove":
                self.table.remove(change.tenant, change.keys, change.node, change.tier)
            else:
                self.table.drop_node(change.node)

    # Reads (memory only) --------------------------------------------------------------------------

    def holders(self, tenant: str, key: bytes) -> dict[Replica, int]:
        return self.holders_many(tenant, [key])[0]

    def holders_many(self, tenant: str, keys: Sequence[bytes]) -> list[dict[Replica, int]]:
        """Each block's replicas and their sizes (one find for them all)."""
        return [
            {Replica(node, tier): size for node, tier, size in held}
            for held in self.table.holders(tenant, as_keys(keys) if keys else np.zeros((0, 4), np.uint64))
        ]

    def lookup(self, tenant: str, keys: BlockKeys) -> dict[str, NodePrefix]:
        """For each node holding the chain's first block: the longest prefix of ``keys`` it holds (in
        any of its tiers), walking until the last node drops out."""
        self.stats.lookups += 1
        array = as_keys(keys)
        if not len(array):
            return {}
        table = self.table
        found = {}
        for node, (bits, sizes) in table.chain(tenant, array).items():
            present = int(np.bitwise_or.reduce(bits)) if len(bits) else 0
            names = {b: table.tiers.name(b) for b in range(MAX_HOLDER_BITS) if present >> b & 1}
            found[node] = NodePrefix(len(bits), bits, sizes, names)
        return found

    def node_blocks(self, node: str) -> list[tuple[str, bytes, str, int]]:
        """(tenant, block key, tier, size) of every replica on ``node``."""
        table = self.table
        rows, bits = table.node_rows(node)
        keys = key_bytes(table.keys[rows])
        return [
            (table.tenants.names[int(table.tenant[row])], key, table.tiers.name(b), int(table.size[row]))
            for row, key, held in zip(rows.tolist(), keys, bits.tolist(), strict=True)
            for b in range(MAX_HOLDER_BITS)
            if held >> b & 1
        ]

    def used_bytes(self, node: str, tier: str) -> int:
        """Bytes of the blocks ``node`` holds in ``tier``, by the index's count."""
        return self.table.used_bytes(node, tier)

    def __len__(self) -> int:
        return len(self.table)
