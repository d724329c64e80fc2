"""Metadata backends: the conductor's durable key-value view, on etcd or in process.

One interface, two implementations that pass one conformance suite (``tests/conductor/test_metadata.py``):

- ``EtcdBackend``: a real etcd v3 cluster through the asyncio client ``etcd3aio``;
- ``EmbeddedBackend``: the same semantics in this process, so one machine needs nothing else.

Semantics the conductor relies on: a global revision that every change increments; ``commit`` of a
batch of puts and deletes in transactions of at most ``TXN_OPS`` operations (etcd's default limit),
each transaction atomic; leases whose keys vanish when they expire; ``create`` that succeeds only
for an absent key (leader election); and watches from a revision, so a follower that rebuilt its
state at revision R misses nothing after it.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

TXN_OPS = 128  # etcd's default --max-txn-ops


class MetadataError(Exception):
    """Base of the metadata backends' errors."""


class MetadataUnavailableError(MetadataError):
    """The backend cannot be reached now; the operation may be retried (nothing was applied, or a
    retry is idempotent)."""


class LeaseNotFoundError(MetadataError):
    """The lease expired or was revoked."""


class CompactedError(MetadataError):
    """A watch asked for history older than what the backend still keeps."""


class FencedError(MetadataError):
    """A guarded write was refused: its guard no longer held (the writer was deposed as leader)."""


@dataclass(frozen=True, slots=True)
class Guard:
    """A condition every transaction of a guarded batch checks atomically: ``key`` holds ``value``
    (the election key holds this conductor's record), so a deposed leader's writes in flight are
    refused by the backend instead of landing after its term."""

    key: bytes
    value: bytes


Guards = Guard | tuple[Guard, ...] | None  # what a commit checks: nothing, one condition, or all of several


def guards(guard: Guards) -> tuple[Guard, ...]:
    return () if guard is None else (guard,) if isinstance(guard, Guard) else guard


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    lease: int = 0
    mod_revision: int = 0


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: bytes
    value: bytes
    revision: int


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"  # every key


async def retry_unavailable(op: Callable[[], Awaitable[T]], attempts: int = 40, delay: float = 0.25) -> T:
    """Run ``op`` until the backend answers: ``MetadataUnavailableError`` is retryable by contract.
    The last error is raised after ``attempts`` tries."""
    for _ in range(attempts - 1):
        try:
            return await op()
        except MetadataUnavailableError:
            await asyncio.sleep(delay)
    return await op()


def chunks(ops: Sequence, size: int = TXN_OPS) -> list[Sequence]:
    return [ops[i : i + size] for i in range(0, len(ops), size)]


class MetadataBackend(ABC):
    """The operations the conductor needs. Keys and values are bytes."""

    writes = 0  # keys put or deleted through this backend so far (what this process asked it to store)

    @abstractmethod
    async def start(self) -> MetadataBackend: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def get(self, key: bytes) -> KeyValue | None: ...

    @abstractmethod
    async def range(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key with ``prefix``, sorted, and the revision the answer is consistent at."""

    @abstractmethod
    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Returns the revision of the change."""

    @abstractmethod
    async def delete(self, key: bytes) -> bool:
        """True when the key existed."""

    @abstractmethod
    async def commit(self, ops: Sequence[Put | Delete], concurrency: int = 1, guard: Guards = None) -> int:
        """Apply a batch in transactions of at most ``TXN_OPS`` operations; each transaction is
        atomic, the batch as a whole is not. With ``concurrency`` above 1, up to that many
        transactions are in flight and may apply in any order: pass each key once. With ``guard``
        (one or several), a transaction applies only while every guard holds; ``FencedError`` when
        one did not (those before it applied, under the guard). Returns the highest revision the
        batch reached."""

    @abstractmethod
    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Put only if ``key`` does not exist; False (and no change) if it does."""

    @abstractmethod
    async def grant_lease(self, ttl: int) -> int: ...

    @abstractmethod
    async def refresh_lease(self, lease: int) -> int:
        """Renew once; returns the remaining TTL. LeaseNotFoundError once it has expired."""

    @abstractmethod
    async def revoke_lease(self, lease: int) -> None:
        """Revoke now (its keys are deleted). Revoking an unknown lease is not an error."""

    def detached(self) -> MetadataBackend | None:
        """Another, unstarted connection to the same store, for another thread's loop to start and
        use (the election's lease renewals); None when no other thread may reach the store."""
        return None

    @abstractmethod
    def watch(self, prefix: bytes, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Events for keys with ``prefix`` from ``start_revision`` (0: from now), in order."""


async def follow(
    meta: MetadataBackend,
    prefix: bytes,
    start_revision: int,
    apply: Callable[[WatchEvent], None],
    what: str,
    *,
    present: Iterable[bytes] | None,
) -> None:
    """Apply every change under ``prefix`` from ``start_revision`` on, forever; a watch cut by an
    unreachable backend resumes where it stopped, so no change is missed.

    Where the history it needs was compacted away (a watch down longer than etcd keeps revisions),
    the caller's view is brought to the state as it is now: ``present`` names the keys the view
    holds at ``start_revision`` (what the caller's range found); each of them gone is applied as a
    delete, each key there as a put, and the watch goes on from there. ``present=None``: the prefix
    carries news, not state (a relayed keep-alive is only news when it is new): the watch goes on
    from now, replaying nothing."""
    keys = None if present is None else set(present)
    reread = False
    while True:
        try:
            if reread:
                start_revision = await _reread(meta, prefix, keys, apply)
                reread = False
            async for event in meta.watch(prefix, start_revision):
                apply(event)
                start_revision = event.revision + 1
                if keys is not None:
                    (keys.add if event.kind == "put" else keys.discard)(event.key)
        except MetadataUnavailableError as exc:
            log.warning("%s: watch interrupted (%s); resuming", what, exc)
            await asyncio.sleep(0.5)
        except CompactedError as exc:
            log.warning("%s: %s; reading the state as it is now", what, exc)
            reread = True
        except Exception:  # noqa: BLE001 - a view that stops following is wrong from then on, silently
            log.exception("%s: the watch failed; resuming", what)
            await asyncio.sleep(0.5)


async def _reread(
    meta: MetadataBackend, prefix: bytes, keys: set[bytes] | None, apply: Callable[[WatchEvent], None]
) -> int:
    """``follow``'s catch-up after a compaction: the revision to watch from, with what changed in
    between applied to the view (``keys``, kept up to date; None: nothing applied)."""
    kvs, revision = await meta.range(prefix)
    if keys is not None:
        there = {kv.key for kv in kvs}
        for key in sorted(keys - there):
            apply(WatchEvent("delete", key, b"", revision))
        for kv in kvs:
            apply(WatchEvent("put", kv.key, kv.value, revision))
        keys.clear()
        keys.update(there)
    return revision + 1
