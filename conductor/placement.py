"""The placement index: which node and tier hold each block, served from memory, durable in the
metadata backend, except for the volatile tiers.

A replica is the key ``<prefix><tenant>/<block key hex>/<node>/<tier>`` with a small JSON value,
attached to the node's lease, so a dead node's replicas disappear from the backend when its lease
expires, and from every index that follows the backend through its watch. Writes are group-committed:
concurrent ``add``/``remove`` calls are queued and flushed together in transactions of at most
``TXN_OPS`` operations; each call returns only once its change is durable, and memory changes only
then, so a lookup never reports a placement the backend could lose.

Volatile tiers (a worker's gpu tier by default) change with every request and matter only for
routing, so their replicas live in the conductors' memory only: no backend write. The leader, which
members report to, logs each change; followers follow that log over HTTP (``volatile_changes``, or a
whole ``volatile_snapshot`` when one is in another term or too far behind). A follower that wins
keeps its mirror (``keep_mirror``) when it is fresh, and the members re-report only what changed
since; otherwise the new leader starts with none and they re-report all of theirs when they see its
term (``KeepAliveReply``). A member that leaves takes its volatile replicas with it
(``drop_volatile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain, islice

from .metadata import TXN_OPS, Delete, Guard, MetadataBackend, MetadataUnavailableError, Put, WatchEvent
from .metadata import follow as follow_changes

log = logging.getLogger(__name__)

PREFIX = b"/tiercake/placements/"


@dataclass(frozen=True, slots=True)
class Replica:
    node: str
    tier: str


@dataclass(slots=True)
class NodePrefix:
    """How much of a chain one node holds: the leading ``length`` blocks, and in which tiers."""

    length: int
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> blocks of the prefix it holds
    per_block: list[dict] = field(default_factory=list)  # each block's tiers, in chain order (not copied)

    def runs(self) -> list[tuple[str, int]]:
        """The tier each block is served from (its fastest), run-length encoded in chain order: what
        a reader of the prefix will get from where. Computed on demand, off the lookup's hot path."""
        out: list[tuple[str, int]] = []
        for tiers in self.per_block:
            tier = min(tiers, key=lambda t: (TIER_ORDER.get(t, len(TIER_ORDER)), t))
            if out and out[-1][0] == tier:
                out[-1] = (tier, out[-1][1] + 1)
            else:
                out.append((tier, 1))
        return out

    def sizes(self) -> list[int]:
        """Each block's size in bytes, in chain order (its copies in every tier have the same)."""
        return [next(iter(tiers.values())) for tiers in self.per_block]


TIER_ORDER = {"gpu": 0, "pool": 1, "ssd": 2}  # fastest first; other tier names after these
VOLATILE_LOG = 1 << 16  # volatile changes a follower may fall behind by before it needs a snapshot


@dataclass(slots=True)
class IndexStats:
    replicas: int = 0
    commits: int = 0  # group-commit batches flushed
    txns: int = 0  # backend transactions those batches took (at most TXN_OPS changes each)
    ops: int = 0  # placement changes made durable
    bytes: int = 0  # of keys and values written to (or deleted from) the backend
    lookups: int = 0
    volatile_ops: int = 0  # placement changes in volatile tiers, kept in memory only
    # durable changes by tier and kind ("pool+": added to a pool, "ssd-": removed from an SSD tier)
    changes: Counter = field(default_factory=Counter)
    largest_batch: int = 0
    # called with (operations, seconds) of every flushed batch (the API feeds its histograms)
    on_batch: Callable[[int, float], None] | None = None


def _check(name: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{name} must be non-empty and contain no '/': {value!r}")
    return value


class PlacementIndex:
    def __init__(
        self,
        meta: MetadataBackend,
        prefix: bytes = PREFIX,
        max_batch: int = 2048,
        concurrency: int = 8,
        volatile_tiers: Iterable[str] = (),
        volatile_log: int = VOLATILE_LOG,
    ) -> None:
        self.meta = meta
        self.prefix = prefix
        self.max_batch = max_batch
        self.concurrency = concurrency  # transactions of one batch in flight at once
        # tenant -> block key -> node -> tier -> size: a lookup walks one dict per block and tests
        # node membership directly
        self._tenants: dict[str, dict[bytes, dict[str, dict[str, int]]]] = defaultdict(dict)
        self._queue: deque[tuple[list[Put | Delete], asyncio.Future]] = deque()  # group-commit items
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self.revision = 0
        self.stats = IndexStats()
        self.used: dict[tuple[str, str], int] = defaultdict(int)  # (node, tier) -> bytes placed there
        self.guard: Guard | None = None  # every commit checks it (the conductor's leadership)
        self.volatile_tiers = frozenset(volatile_tiers)
        # node -> (tenant, key, tier) of its replicas in volatile tiers, so they go with the node
        self._volatile: dict[str, set[tuple[str, bytes, str]]] = defaultdict(set)
        # the leader's log of volatile changes for its followers: (tenant, key, node, tier, size or None)
        self._log: deque[tuple[str, bytes, str, str, int | None]] = deque(maxlen=volatile_log)
        self.volatile_seq = 0  # the sequence number of the last logged change
        self._logged = asyncio.Event()  # set (and replaced) at each logged change

    # Keys -----------------------------------------------------------------------------------------

    def _meta_key(self, tenant: str, key: bytes, replica: Replica) -> bytes:
        return (
            self.prefix
            + f"{_check('tenant', tenant)}/{key.hex()}/{_check('node', replica.node)}/"
            f"{_check('tier', replica.tier)}".encode()
        )

    def _parse(self, meta_key: bytes) -> tuple[str, bytes, Replica] | None:
        """The replica a backend key names; None for a malformed key and for a volatile tier's (left
        by a conductor that kept that tier durable: the tier's replicas are re-reported instead)."""
        parts = meta_key[len(self.prefix) :].decode(errors="replace").split("/")
        if len(parts) != 4 or parts[3] in self.volatile_tiers:
            return None
        tenant, key_hex, node, tier = parts
        try:
            return tenant, bytes.fromhex(key_hex), Replica(node, tier)
        except ValueError:
            return None

    # Lifecycle ------------------------------------------------------------------------------------

    async def start(self, follow: bool = True) -> PlacementIndex:
        """Load everything from the backend, then (``follow``) apply its changes as they happen."""
        kvs, self.revision = await self.meta.range(self.prefix)
        for kv in kvs:
            parsed = self._parse(kv.key)
            if parsed is not None:
                self._set(*parsed, json.loads(kv.value).get("size", 0))
        loop = asyncio.get_running_loop()
        self._flusher = loop.create_task(self._flush_forever())
        if follow:
            self._follower = loop.create_task(
                follow_changes(self.meta, self.prefix, self.revision + 1, self._apply, "placement index")
            )
        return self

    async def close(self) -> None:
        for task in (self._flusher, self._follower):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for _, future in self._queue:
            if not future.done():
                future.set_exception(MetadataUnavailableError("placement index closed"))
        self._queue.clear()

    def _apply(self, event: WatchEvent) -> None:
        parsed = self._parse(event.key)
        if parsed is None:
            return
        tenant, key, replica = parsed
        if event.kind == "put":
            self._set(tenant, key, replica, json.loads(event.value).get("size", 0))
        else:
            self._unset(tenant, key, replica)
        self.revision = max(self.revision, event.revision)

    def _set(self, tenant: str, key: bytes, replica: Replica, size: int) -> None:
        tiers = self._tenants[tenant].setdefault(key, {}).setdefault(replica.node, {})
        if replica.tier not in tiers:
            self.stats.replicas += 1
        self.used[(replica.node, replica.tier)] += size - tiers.get(replica.tier, 0)
        tiers[replica.tier] = size

    def _unset(self, tenant: str, key: bytes, replica: Replica) -> None:
        blocks = self._tenants.get(tenant)
        nodes = blocks.get(key) if blocks else None
        tiers = nodes.get(replica.node) if nodes else None
        size = tiers.pop(replica.tier, None) if tiers else None
        if size is not None:
            self.stats.replicas -= 1
            self.used[(replica.node, replica.tier)] -= size
            if not tiers:
                del nodes[replica.node]
                if not nodes:
                    del blocks[key]

    # Writes (group commit) ------------------------------------------------------------------------

    async def add(self, tenant: str, key: bytes, node: str, tier: str, size: int, lease: int = 0) -> None:
        """Record a committed replica; returns once durable. ``lease``: the node's lease."""
        await self.add_many(tenant, [key], node, tier, [size], lease)

    async def add_many(
        self, tenant: str, keys: list[bytes], node: str, tier: str, sizes: list[int], lease: int = 0
    ) -> None:
        """Record replicas of many blocks on one node and tier (a request's new blocks); returns
        once all are durable. They travel as one item of the group commit."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys for {len(sizes)} sizes")
        replica = Replica(node, tier)
        if tier in self.volatile_tiers:
            _check("tenant", tenant), _check("node", node)
            for key, size in zip(keys, sizes):
                self._set_volatile(tenant, key, replica, size, log=True)
            self.stats.volatile_ops += len(keys)
            return
        ops = [
            Put(self._meta_key(tenant, key, replica), b'{"size": %d}' % size, lease) for key, size in zip(keys, sizes)
        ]
        self.stats.changes[tier + "+"] += len(ops)
        await self._submit(ops)
        for key, size in zip(keys, sizes):
            self._set(tenant, key, replica, size)

    async def remove(self, tenant: str, key: bytes, node: str, tier: str) -> None:
        """Forget a replica (evicted, demoted or removed on its node); returns once durable."""
        await self.remove_many(tenant, [key], node, tier)

    async def remove_many(self, tenant: str, keys: list[bytes], node: str, tier: str) -> None:
        """Forget replicas of many blocks on one node and tier; returns once all are durable. They
        travel as one item of the group commit."""
        replica = Replica(node, tier)
        if tier in self.volatile_tiers:
            for key in keys:
                self._unset_volatile(tenant, key, replica, log=True)
            self.stats.volatile_ops += len(keys)
            return
        self.stats.changes[tier + "-"] += len(keys)
        await self._submit([Delete(self._meta_key(tenant, key, replica)) for key in keys])
        for key in keys:
            self._unset(tenant, key, replica)

    # Volatile replicas ----------------------------------------------------------------------------

    def _set_volatile(self, tenant: str, key: bytes, replica: Replica, size: int, log: bool) -> None:
        self._set(tenant, key, replica, size)
        self._volatile[replica.node].add((tenant, key, replica.tier))
        if log:
            self._record(tenant, key, replica, size)

    def _unset_volatile(self, tenant: str, key: bytes, replica: Replica, log: bool) -> None:
        self._unset(tenant, key, replica)
        held = self._volatile.get(replica.node)
        if held is not None:
            held.discard((tenant, key, replica.tier))
        if log:
            self._record(tenant, key, replica, None)

    def _record(self, tenant: str, key: bytes, replica: Replica, size: int | None) -> None:
        self._log.append((tenant, key, replica.node, replica.tier, size))
        self.volatile_seq += 1
        self._logged.set()
        self._logged = asyncio.Event()

    def drop_volatile(self, node: str | None = None) -> int:
        """Forget the volatile replicas of ``node`` (it left: logged, so followers forget them too) or
        of every node (this conductor's term began or ended: the members re-report to whoever leads,
        and followers of the new term start from a snapshot); returns how many."""
        if node is None:
            dropped = sum(len(held) for held in self._volatile.values())
            for name, held in self._volatile.items():
                for tenant, key, tier in held:
                    self._unset(tenant, key, Replica(name, tier))
            self._volatile.clear()
            self._log.clear()
            return dropped
        held = list(self._volatile.pop(node, ()))
        for tenant, key, tier in held:
            self._unset(tenant, key, Replica(node, tier))
            self._record(tenant, key, Replica(node, tier), None)
        return len(held)

    def keep_mirror(self, members: Iterable[str]) -> int:
        """A follower that wins keeps what it mirrored of the old leader's volatile replicas, but for
        those of nodes no longer ``members`` (they left while nobody led, so nobody logged it); its
        followers start from a snapshot of the new term. Returns how many replicas it kept."""
        live = set(members)
        for node in [n for n in self._volatile if n not in live]:
            for tenant, key, tier in self._volatile.pop(node):
                self._unset(tenant, key, Replica(node, tier))
        self._log.clear()
        return sum(len(held) for held in self._volatile.values())

    def volatile_changes(self, after: int) -> list[tuple[str, bytes, str, str, int | None]] | None:
        """The logged changes after sequence number ``after``, in order; None when they are no longer
        (or never were) in the log: the caller needs ``volatile_snapshot``."""
        first = self.volatile_seq - len(self._log)  # the sequence number before the log's first change
        if not first <= after <= self.volatile_seq:
            return None
        return list(islice(self._log, after - first, None))

    def volatile_snapshot(self) -> list[tuple[str, bytes, str, str, int]]:
        """Every volatile replica: (tenant, key, node, tier, size)."""
        blocks = self._tenants
        return [
            (tenant, key, node, tier, blocks[tenant][key][node][tier])
            for node, held in self._volatile.items()
            for tenant, key, tier in held
        ]

    async def wait_volatile(self, after: int, timeout: float) -> None:
        """Return once a change after ``after`` is logged, or after ``timeout`` seconds."""
        if self.volatile_seq == after:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._logged.wait(), timeout)

    def apply_volatile(self, changes: Iterable[tuple[str, bytes, str, str, int | None]], reset: bool) -> None:
        """A follower applies what the leader logged (``reset``: a snapshot, replacing what it had)."""
        if reset:
            self.drop_volatile()
        for tenant, key, node, tier, size in changes:
            if size is None:
                self._unset_volatile(tenant, key, Replica(node, tier), log=False)
            else:
                self._set_volatile(tenant, key, Replica(node, tier), size, log=False)

    async def _submit(self, ops: list[Put | Delete]) -> None:
        if self._flusher is None:
            raise RuntimeError("the placement index is not started")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((ops, future))
        self._wakeup.set()
        await future

    async def _flush_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, taken = [], 0
                while self._queue and (not batch or taken + len(self._queue[0][0]) <= self.max_batch):
                    item = self._queue.popleft()
                    batch.append(item)
                    taken += len(item[0])
                # The last change of each key wins (a put then a delete is a delete), so every key
                # appears once and the batch's transactions may run concurrently in any order.
                latest = {op.key: op for ops, _ in batch for op in ops}
                started = time.perf_counter()
                try:
                    revision = await self.meta.commit(
                        list(latest.values()), concurrency=self.concurrency, guard=self.guard
                    )
                except Exception as exc:  # noqa: BLE001 - every waiter gets the error, none hangs
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.revision = max(self.revision, revision)
                self.stats.commits += 1
                self.stats.txns += -(-len(latest) // TXN_OPS)
                self.stats.ops += taken
                self.stats.bytes += sum(len(op.key) + len(getattr(op, "value", b"")) for op in latest.values())
                self.stats.largest_batch = max(self.stats.largest_batch, taken)
                if self.stats.on_batch is not None:
                    self.stats.on_batch(taken, time.perf_counter() - started)
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)

    # Reads (memory only) --------------------------------------------------------------------------

    def holders(self, tenant: str, key: bytes) -> dict[Replica, int]:
        nodes = self._tenants.get(tenant, {}).get(key, {})
        return {Replica(node, tier): size for node, tiers in nodes.items() for tier, size in tiers.items()}

    def lookup(self, tenant: str, keys: Iterable[bytes]) -> dict[str, NodePrefix]:
        """For each node holding the chain's first block: the longest prefix of ``keys`` it holds
        (in any of its tiers), walking until the last node drops out."""
        self.stats.lookups += 1
        blocks = self._tenants.get(tenant)
        keys = list(keys)
        if not blocks or not keys or keys[0] not in blocks:
            return {}
        result: dict[str, NodePrefix] = {}
        for node in blocks[keys[0]]:  # one tight walk per candidate node (usually one to three)
            seen = []
            for key in keys:
                nodes = blocks.get(key)
                tiers = nodes.get(node) if nodes is not None else None
                if tiers is None:
                    break
                seen.append(tiers)
            result[node] = NodePrefix(len(seen), dict(Counter(chain.from_iterable(seen))), seen)
        return result

    def node_blocks(self, node: str) -> list[tuple[str, bytes, str, int]]:
        """(tenant, block key, tier, size) of every replica on ``node``."""
        return [
            (tenant, key, tier, size)
            for tenant, blocks in self._tenants.items()
            for key, nodes in blocks.items()
            for tier, size in nodes.get(node, {}).items()
        ]

    def __len__(self) -> int:
        return self.stats.replicas
