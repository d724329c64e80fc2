"""The placement index: which node and tier hold each block, served from memory, durable in the
metadata backend.

A replica is the key ``<prefix><tenant>/<block key hex>/<node>/<tier>`` with a small JSON value,
attached to the node's lease, so a dead node's replicas disappear from the backend when its lease
expires, and from every index that follows the backend through its watch. Writes are group-committed:
concurrent ``add``/``remove`` calls are queued and flushed together in transactions of at most
``TXN_OPS`` operations; each call returns only once its change is durable, and memory changes only
then, so a lookup never reports a placement the backend could lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from .metadata import Delete, MetadataBackend, MetadataUnavailableError, Put, WatchEvent

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


@dataclass(slots=True)
class IndexStats:
    replicas: int = 0
    commits: int = 0  # group-commit batches flushed
    ops: int = 0  # placement changes made durable
    largest_batch: int = 0


def _check(name: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{name} must be non-empty and contain no '/': {value!r}")
    return value


class PlacementIndex:
    def __init__(self, meta: MetadataBackend, prefix: bytes = PREFIX, max_batch: int = 1024) -> None:
        self.meta = meta
        self.prefix = prefix
        self.max_batch = max_batch
        # (tenant, block key) -> replica -> size
        self._replicas: dict[tuple[str, bytes], dict[Replica, int]] = defaultdict(dict)
        self._queue: list[tuple[Put | Delete, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self.revision = 0
        self.stats = IndexStats()

    # Keys -----------------------------------------------------------------------------------------

    def _meta_key(self, tenant: str, key: bytes, replica: Replica) -> bytes:
        return self.prefix + f"{_check('tenant', tenant)}/{key.hex()}/{_check('node', replica.node)}/" \
            f"{_check('tier', replica.tier)}".encode()

    def _parse(self, meta_key: bytes) -> tuple[str, bytes, Replica] | None:
        parts = meta_key[len(self.prefix):].decode(errors="replace").split("/")
        if len(parts) != 4:
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
            self._follower = loop.create_task(self._follow(self.revision + 1))
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

    async def _follow(self, start_revision: int) -> None:
        while True:
            try:
                async for event in self.meta.watch(self.prefix, start_revision):
                    self._apply(event)
                    start_revision = event.revision + 1
            except MetadataUnavailableError as exc:
                log.warning("placement index: watch interrupted (%s); resuming", exc)
                await asyncio.sleep(0.5)

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
        held = self._replicas[(tenant, key)]
        if replica not in held:
            self.stats.replicas += 1
        held[replica] = size

    def _unset(self, tenant: str, key: bytes, replica: Replica) -> None:
        held = self._replicas.get((tenant, key))
        if held and held.pop(replica, None) is not None:
            self.stats.replicas -= 1
            if not held:
                del self._replicas[(tenant, key)]

    # Writes (group commit) ------------------------------------------------------------------------

    async def add(self, tenant: str, key: bytes, node: str, tier: str, size: int, lease: int = 0) -> None:
        """Record a committed replica; returns once durable. ``lease``: the node's lease."""
        replica = Replica(node, tier)
        value = json.dumps({"size": size}).encode()
        await self._submit(Put(self._meta_key(tenant, key, replica), value, lease))
        self._set(tenant, key, replica, size)

    async def remove(self, tenant: str, key: bytes, node: str, tier: str) -> None:
        """Forget a replica (evicted, demoted or removed on its node); returns once durable."""
        replica = Replica(node, tier)
        await self._submit(Delete(self._meta_key(tenant, key, replica)))
        self._unset(tenant, key, replica)

    async def _submit(self, op: Put | Delete) -> None:
        if self._flusher is None:
            raise RuntimeError("the placement index is not started")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((op, future))
        self._wakeup.set()
        await future

    async def _flush_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                try:
                    revision = await self.meta.commit([op for op, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiter gets the error, none hangs
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.revision = max(self.revision, revision)
                self.stats.commits += 1
                self.stats.ops += len(batch)
                self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)

    # Reads (memory only) --------------------------------------------------------------------------

    def holders(self, tenant: str, key: bytes) -> dict[Replica, int]:
        return dict(self._replicas.get((tenant, key), {}))

    def lookup(self, tenant: str, keys: Iterable[bytes]) -> dict[str, NodePrefix]:
        """For each node holding the chain's first block: the longest prefix of ``keys`` it holds
        (in any of its tiers), walking until the last node drops out."""
        result: dict[str, NodePrefix] = {}
        alive: dict[str, NodePrefix] | None = None
        position = 0
        for position, key in enumerate(keys):
            held = self._replicas.get((tenant, key), {})
            nodes: dict[str, list[str]] = defaultdict(list)
            for replica in held:
                nodes[replica.node].append(replica.tier)
            if alive is None:
                alive = {node: NodePrefix(0) for node in nodes}
            for node in list(alive):
                if node not in nodes:
                    result[node] = alive.pop(node)
                    continue
                prefix = alive[node]
                prefix.length = position + 1
                for tier in nodes[node]:
                    prefix.tiers[tier] = prefix.tiers.get(tier, 0) + 1
            if not alive:
                break
        result.update(alive or {})
        return result

    def node_blocks(self, node: str) -> list[tuple[str, bytes, str]]:
        """(tenant, block key, tier) of every replica on ``node``."""
        return [(t, k, r.tier) for (t, k), held in self._replicas.items() for r in held if r.node == node]

    def __len__(self) -> int:
        return self.stats.replicas
