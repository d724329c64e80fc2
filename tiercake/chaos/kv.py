"""The key-value workload of ``tiercake chaos`` (and of the store's history tests): clients of the
cluster's store put, upsert, remove and get a few keys while faults go on; every value carries its own
checksum, and each key's history is checked for linearizability (``tiercake.linearizability``).

``STEADY`` keys are put once at the start and then only upserted and read: a read that finds nothing
there has lost an acknowledged object. ``CHURN`` keys are put, upserted, removed and read. A write
answered by a transfer failure has an unknown outcome (it may have landed, late, or never): the
checker may place it anywhere after its call. A refusal (a full node, a bad argument) did not happen
and is left out. ``read_back`` reads every key once more (chaos calls it after each fault), so a
write a fault lost shows in its key's history even where no client happened to read it.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from tiercake.kvstore import AsyncStore, Durability, NoSpace, ObjectNotFound, StoreApiError, TransferFailed
from tiercake.linearizability import Op, check, explain

STEADY = ("s0", "s1", "s2")
CHURN = ("c0", "c1", "c2")
KB = 1 << 10


def value(client: int, seq: int, rng: random.Random, large: int = 256 * KB) -> bytes:
    """A value that says whose it is and checks itself: mostly small, one in twenty ``large``."""
    size = large if rng.random() < 0.05 else rng.randrange(16, 3000)
    body = f"{client}-{seq}-".encode() + rng.randbytes(size)
    return hashlib.sha256(body).digest() + body


def label(raw: bytes) -> str:
    """Whose a value is: "client-seq" (what ``value`` wrote after its checksum)."""
    return "-".join(part.decode(errors="replace") for part in raw[32:].split(b"-", 2)[:2])


def whole(raw: bytes) -> bool:
    """A value read back as it was written: never torn, never two writes mixed."""
    return hashlib.sha256(raw[32:]).digest() == raw[:32]


@dataclass
class KvVerdict:
    ops: int  # operations in the histories
    unknown: int  # of them, writes whose outcome the client never learnt
    violations: list[str]  # per key whose history no order explains: where it first fails
    lost: int  # reads of a steady key that found nothing: an acknowledged object gone
    torn: int  # reads that came back not whole
    stale: int = 0  # reads of a value overwritten (or removed) before the read began


class KvLoad:
    """``clients`` stores, each running operations on the keys until ``stop``."""

    def __init__(
        self,
        open_store: Callable[[], AsyncStore],
        clients: int = 4,
        durability: Durability | None = None,
        large: int = 256 * KB,
        pause_s: float = 0.0,
        prefix: str = "",
    ) -> None:
        """``large``: the size of one value in twenty; ``pause_s``: each client's pause between operations
        (a workload beside another on a small machine); ``prefix``: before every key's name (a fresh set
        of keys for each of several loads on one cluster)."""
        self.steady = tuple(prefix + k for k in STEADY)
        self.churn = tuple(prefix + k for k in CHURN)
        self.open_store, self.clients, self.large = open_store, clients, large
        self.durability = durability or Durability()
        self.pause_s = pause_s
        self.history: dict[str, list[Op]] = defaultdict(list)
        self.torn = 0
        self._stores: list[AsyncStore] = []
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()

    async def start(self, ops_each: int | None = None) -> None:
        """The stores opened, the steady keys put, the clients running (``ops_each`` operations each,
        or until ``stop``)."""
        for _ in range(self.clients):
            self._stores.append(await self.open_store().open())
        for key in self.steady:
            v = value(99, 0, random.Random(key), self.large)
            called = time.monotonic()
            await self._seed(key, v)
            self.history[key].append(Op("put", v, "ok", called, time.monotonic()))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._client(i, store, ops_each)) for i, store in enumerate(self._stores)]

    async def _seed(self, key: str, v: bytes, timeout: float = 30.0) -> None:
        """A steady key's first put, tried again while it is refused for want of nodes (a cluster
        just back from a fault places its replicas a moment later)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self._stores[0].put(key, v, durability=self.durability)
            except NoSpace:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def wait(self) -> None:
        """Until every client has run its operations."""
        await asyncio.gather(*self._tasks)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for store in self._stores:
            await store.close()
        self._stores.clear()

    async def read_back(self) -> None:
        """Every key read once, into its history."""
        for key in (*self.steady, *self.churn):
            await self._one(self._stores[0], key, "get", None)

    async def _client(self, client: int, store: AsyncStore, ops_each: int | None) -> None:
        rng = random.Random(client)
        seq = 0
        while not self._stop.is_set() and (ops_each is None or seq < ops_each):
            key = rng.choice(self.steady + self.churn)
            kind = rng.choice(
                ["upsert", "get", "get"] if key in self.steady else ["put", "upsert", "remove", "get", "get"]
            )
            await self._one(
                store, key, kind, value(client, seq, rng, self.large) if kind in ("put", "upsert") else None
            )
            seq += 1
            await asyncio.sleep(self.pause_s)

    async def _one(self, store: AsyncStore, key: str, kind: str, v: bytes | None) -> None:
        called = time.monotonic()
        try:
            result = await self._call(store, key, kind, v)
        except TransferFailed:
            if kind != "get":  # its outcome is unknown; a failed read says nothing
                self.history[key].append(Op(kind, v, "ok", called, None))
            return
        except StoreApiError:
            return  # refused: it did not happen
        self.history[key].append(Op(kind, v, result, called, time.monotonic()))

    async def _call(self, store: AsyncStore, key: str, kind: str, v: bytes | None) -> object:
        if kind == "get":
            try:
                got = await store.get(key)
            except ObjectNotFound:
                return None
            if not whole(got):
                self.torn += 1
            return got
        if kind == "remove":
            try:
                await store.remove(key, force=True)
            except ObjectNotFound:
                return "not_found"
            return "ok"
        await store.put(key, v, replace=kind == "upsert", durability=self.durability)
        return "ok"

    def verdict(self) -> KvVerdict:
        ops = [o for ops in self.history.values() for o in ops]
        violations = [
            f"{key}: {explain(ops, label=label)}" for key, ops in sorted(self.history.items()) if not check(ops)
        ]
        lost = sum(o.kind == "get" and o.result is None for key in self.steady for o in self.history[key])
        stale = sum(stale_reads(ops) for ops in self.history.values())
        return KvVerdict(len(ops), sum(o.returned is None for o in ops), violations, lost, self.torn, stale)


def stale_reads(ops: list[Op]) -> int:
    """Reads of one key that returned what a write known to have been overwritten before the read began
    had written (or nothing, where every removal came too early to explain it): reads no order of the
    key's history allows, counted one by one (``check`` says only whether one exists)."""
    writes = [o for o in ops if o.kind in ("put", "upsert") and o.result == "ok"]
    removes = [o for o in ops if o.kind == "remove" and o.result in ("ok", "not_found")]
    stale = 0
    for read in (o for o in ops if o.kind == "get" and o.returned is not None):
        done_before = [w for w in writes if w.returned is not None and w.returned < read.called]
        if read.result is None:
            latest = max(done_before, key=lambda w: w.called, default=None)  # the one a removal must follow
            stale += latest is not None and not any(_between(r, latest, read) for r in removes)
            continue
        source = next((w for w in writes if w.value == read.result), None)
        if source is None or source.returned is None:
            continue  # an unknown write's value, or one torn: the linearizability check speaks for it
        # an upsert replaces; a put leaves a present object as it was (Mooncake's), so proves nothing here
        stale += any(w.kind == "upsert" and w.called > source.returned for w in done_before)
        stale += any(
            r.returned is not None and r.called > source.returned and r.returned < read.called for r in removes
        )
    return stale


def _between(remove: Op, write: Op, read: Op) -> bool:
    """Whether ``remove`` may fall after ``write`` and before ``read`` in some order."""
    assert read.returned is not None  # only reads that returned are judged
    return (remove.returned is None or remove.returned > write.called) and remove.called < read.returned
