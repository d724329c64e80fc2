"""The embedded metadata backend: etcd's semantics in this process, for a one-machine deployment."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from .metadata import (
    TXN_OPS,
    CompactedError,
    Delete,
    FencedError,
    Guards,
    KeyValue,
    LeaseNotFoundError,
    MetadataBackend,
    Put,
    WatchEvent,
    chunks,
    guards,
)


@dataclass(slots=True)
class _Lease:
    ttl: int
    deadline: float
    keys: set[bytes] = field(default_factory=set)


class EmbeddedBackend(MetadataBackend):
    """A sorted in-memory key space with revisions, leases and watches; ``history`` events are kept
    for watches that start from a past revision."""

    def __init__(self, history: int = 100_000) -> None:
        self._data: dict[bytes, KeyValue] = {}
        self._sorted: list[bytes] = []
        self._revision = 0
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._log: deque[WatchEvent] = deque(maxlen=history)
        self._watchers: set[tuple[bytes, asyncio.Queue]] = set()
        self._expiry: asyncio.Task | None = None
        self._truncated = False  # the history has lost its oldest events

    async def start(self) -> EmbeddedBackend:
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().create_task(self._expire_leases())
        return self

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
            self._expiry = None

    # Reads ----------------------------------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        return self._data.get(key)

    async def range(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        start = bisect.bisect_left(self._sorted, prefix)
        out = []
        for key in itertools.islice(self._sorted, start, None):
            if not key.startswith(prefix):
                break
            out.append(self._data[key])
        return out, self._revision

    # Writes: every transaction is one revision ------------------------------------------------------

    def _apply(self, ops: Sequence[Put | Delete]) -> int:
        for op in ops:  # check first: a transaction applies whole or not at all
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseNotFoundError(f"lease {op.lease:x} not found")
        self.writes += len(ops)
        self._revision += 1
        events = []
        for op in ops:
            if isinstance(op, Put):
                self._set(op.key, op.value, op.lease)
                events.append(WatchEvent("put", op.key, op.value, self._revision))
            elif self._remove(op.key):
                events.append(WatchEvent("delete", op.key, b"", self._revision))
        self._publish(events)
        return self._revision

    def _set(self, key: bytes, value: bytes, lease: int) -> None:
        old = self._data.get(key)
        if old is None:
            bisect.insort(self._sorted, key)
        elif old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if lease:
            self._leases[lease].keys.add(key)
        self._data[key] = KeyValue(key, value, lease, self._revision)

    def _remove(self, key: bytes) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        del self._sorted[bisect.bisect_left(self._sorted, key)]
        if old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        return True

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        return self._apply([Put(key, value, lease)])

    async def delete(self, key: bytes) -> bool:
        if key not in self._data:
            return False
        self._apply([Delete(key)])
        return True

    async def commit(self, ops: Sequence[Put | Delete], concurrency: int = 1, guard: Guards = None) -> int:
        revision = self._revision
        for chunk in chunks(ops, TXN_OPS):
            for held_by in guards(guard):
                held = self._data.get(held_by.key)
                if held is None or held.value != held_by.value:
                    raise FencedError(
                        f"refused: {held_by.key.decode(errors='replace')} no longer holds what this writer "
                        "expects (a new leader was elected, or the record changed)"
                    )
            revision = self._apply(chunk)
        return revision

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        if key in self._data:
            return False
        self._apply([Put(key, value, lease)])
        return True

    # Leases ---------------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        if ttl < 1:
            raise ValueError("a lease TTL is at least 1 second")
        lease = next(self._lease_ids)
        self._leases[lease] = _Lease(ttl, time.monotonic() + ttl)
        return lease

    async def refresh_lease(self, lease: int) -> int:
        held = self._leases.get(lease)
        if held is None or held.deadline <= time.monotonic():
            raise LeaseNotFoundError(f"lease {lease:x} expired or was revoked")
        held.deadline = time.monotonic() + held.ttl
        return held.ttl

    async def revoke_lease(self, lease: int) -> None:
        held = self._leases.pop(lease, None)
        if held is not None and held.keys:
            self._revision += 1
            events = []
            for key in sorted(held.keys):
                if self._remove(key):
                    events.append(WatchEvent("delete", key, b"", self._revision))
            self._publish(events)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for lease in [lid for lid, held in self._leases.items() if held.deadline <= now]:
                await self.revoke_lease(lease)

    # Watches --------------------------------------------------------------------------------------

    def _publish(self, events: list[WatchEvent]) -> None:
        for event in events:
            if len(self._log) == self._log.maxlen:
                self._truncated = True
            self._log.append(event)
            for prefix, queue in self._watchers:
                if event.key.startswith(prefix):
                    queue.put_nowait(event)

    async def watch(self, prefix: bytes, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        watcher = (prefix, queue)
        # No await between registering and taking the history: every event is either in the
        # snapshot (revision <= now) or arrives through the queue (revision > now), never both.
        self._watchers.add(watcher)
        history = list(self._log) if start_revision > 0 else []
        try:
            if start_revision > 0 and self._truncated:
                oldest = history[0].revision if history else self._revision + 1
                if start_revision < oldest:
                    raise CompactedError(f"revision {start_revision} is older than the kept history ({oldest})")
            for event in history:
                if event.revision >= start_revision and event.key.startswith(prefix):
                    yield event
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(watcher)
