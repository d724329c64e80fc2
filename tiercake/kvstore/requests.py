"""The key-value store client's requests and what their answers mean, with no I/O: what one node is
asked for its share of a call (``put_request``, ``get_request``...) and what each item's answer is
for the caller (``*_results``: an outcome, or ``Retry`` to ask again). ``AsyncStore`` sends them on
asyncio connections, and the synchronous client's fast path (``fast.py``) on blocking ones: the two
share every rule here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from tiercake.tiers.buffers import as_bytes, copy_into, host_bytes, is_tensor
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import MAX_ITEMS, Status, TransferError

from .errors import (
    IllegalClient,
    InvalidParams,
    NoSpace,
    NotReady,
    ObjectHasLease,
    ObjectNotFound,
    StoreApiError,
    TransferFailed,
)

Outcome = StoreApiError | None
MAX_NAME_BYTES = 64 << 10
MAX_REQUEST_BYTES = 256 << 20  # of one put request's bytes (a larger batch goes in several)
MAX_TABLE_BYTES = 8 << 20  # of one request's names


@dataclass(frozen=True, slots=True)
class Durability:
    """What a put asks of its objects (Mooncake's ``ReplicateConfig``, as tiercake obeys it)."""

    replicas: int = 1  # nodes holding it before the put returns (at most ``objects.replicas_max``)
    persist: bool = False  # on each of those nodes' SSD, synced, before the put returns
    hard_pin: bool = False  # never evicted
    soft_pin_ms: int | None = None  # evicted only when nothing else can be, for this long
    keep_pin: bool = False  # an upsert: the object keeps the soft pin it had (Mooncake's PRESERVE)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= 255:
            raise InvalidParams(f"replicas is 1 to 255, got {self.replicas!r}")
        if self.soft_pin_ms is not None and (
            not isinstance(self.soft_pin_ms, int) or not 0 <= self.soft_pin_ms < 1 << 62
        ):
            raise InvalidParams(f"a soft pin's TTL is a non-negative number of milliseconds, got {self.soft_pin_ms!r}")


MEMORY = Durability()


class Retry:
    """An item to ask again (its node did not own it, could not serve it, or could not be reached)."""

    __slots__ = ("why", "refresh")

    def __init__(self, why: str, refresh: bool = True) -> None:
        self.why, self.refresh = why, refresh


class NotSent(Exception):
    """No connection to the node: nothing of the request reached it."""


T = TypeVar("T")


@dataclass(slots=True)
class Item:
    index: int
    name: bytes
    oid: bytes
    payload: np.ndarray | None = None  # a put's bytes
    out: np.ndarray | None = None  # a get's buffer
    device: Any = None  # a torch tensor: a get into device memory: received on the host, then copied
    stream: bool = False  # a same-host get whose object is not in the pool: over the stream

    @property
    def data(self) -> np.ndarray:
        """A put's bytes (a get's item has none: asking is a bug of the caller)."""
        if self.payload is None:
            raise TypeError(f"item {self.index} is a read: it has no bytes to put")
        return self.payload

    @property
    def buffer(self) -> np.ndarray:
        """A get's buffer (a put's item has none: asking is a bug of the caller)."""
        if self.out is None:
            raise TypeError(f"item {self.index} is a write: it has no buffer to read into")
        return self.out


@dataclass(slots=True)
class Described:
    """What ``describe`` says of an object."""

    size: int
    version: int
    replicas: int
    persist: bool
    holders: list[str] = field(default_factory=list)


# One node's share of a call ------------------------------------------------------------------------


def put_request(tenant: str, epoch: int, group: list[Item], like: w.PutItem) -> w.PutRequest:
    return w.PutRequest(
        tenant,
        epoch,
        [
            w.PutItem(it.name, it.data.size, like.upsert, like.replicas, like.persist, like.hard_pin, like.soft_pin_ms)
            for it in group
        ],
    )


def put_results(reply: w.PutReply, group: list[Item]) -> dict[int, object]:
    out: dict[int, object] = {}
    for it, result in zip(group, exactly(reply.results, group)):
        if result.status == Status.NOT_IN_MEMORY:
            it.stream = True  # the pool could not take it now: the stream carries it
            out[it.index] = Retry("the pool had no room", refresh=False)
        else:
            out[it.index] = outcome(result.status, result.message, it.name, write=True)
    return out


def get_request(tenant: str, epoch: int, group: list[Item]) -> w.GetRequest:
    return w.GetRequest(tenant, epoch, [w.GetItem(it.name, -1 if it.out is None else it.out.size) for it in group])


def get_targets(reply: w.GetReply, group: list[Item], node: str) -> list[np.ndarray]:
    """Where the bytes that follow a streamed get's answer land: each found item's buffer (allocated
    for a get of any size)."""
    views = []
    for it, got in zip(group, exactly(reply.items, group)):
        if got.status == Status.OK and got.size:
            if it.out is None:
                it.out = np.empty(got.size, dtype=np.uint8)
            elif got.size > it.out.size:
                raise TransferError(f"{node} sends {got.size} bytes for a buffer of {it.out.size}")
            views.append(it.out[: got.size])
    return views


def get_results(reply: w.GetReply, group: list[Item]) -> dict[int, object]:
    out: dict[int, object] = {}
    for it, got in zip(group, reply.items):
        if got.status == Status.OK:
            out[it.index] = it.out[: got.size] if it.out is not None else np.empty(0, dtype=np.uint8)
        else:
            out[it.index] = outcome(got.status, got.message, it.name, write=False)
    return out


def query_results(reply: w.QueryReply, group: list[Item]) -> dict[int, object]:
    return {
        it.index: (
            Described(d.size, d.version, d.replicas, d.persist, list(d.holders))
            if d.status == Status.OK
            else outcome(d.status, d.message, it.name, write=False)
        )
        for it, d in zip(group, exactly(reply.items, group))
    }


def remove_results(reply: w.RemoveReply, group: list[Item]) -> dict[int, object]:
    return {
        it.index: outcome(r.status, r.message, it.name, write=True)
        for it, r in zip(group, exactly(reply.results, group))
    }


def chunks(group: list[Item]) -> list[list[Item]]:
    """Requests of at most ``MAX_ITEMS`` items, ``MAX_REQUEST_BYTES`` of a put's bytes and
    ``MAX_TABLE_BYTES`` of names (a frame's body is at most 16 MiB)."""
    chunks: list[list[Item]] = []
    current: list[Item] = []
    nbytes = names = 0
    for it in group:
        size = it.payload.size if it.payload is not None else 0
        if current and (
            len(current) >= MAX_ITEMS or nbytes + size > MAX_REQUEST_BYTES or names + len(it.name) > MAX_TABLE_BYTES
        ):
            chunks.append(current)
            current, nbytes, names = [], 0, 0
        current.append(it)
        nbytes += size
        names += len(it.name)
    if current:
        chunks.append(current)
    return chunks


PER_ITEM_S = 2e-3  # what one item may add to a request's deadline (a busy node's per-object work, a sync)
PER_BYTE_S = 1 / 20e6  # and one byte of it (a slow link or disk)


def deadline_s(base_s: float, chunk: list[Item]) -> float:
    """How long a request of ``chunk`` may take: the base, its bytes at 20 MB/s, and its items at
    ``PER_ITEM_S`` each (a deadline that ignored the count failed 8,000-item batches on a busy node
    with part of them stored); a get of any size (no buffer given) gets six times the base."""
    nbytes = sum(
        (it.payload.size if it.payload is not None else 0) + (it.out.size if it.out is not None else 0) for it in chunk
    )
    unknown = any(it.payload is None and it.out is None for it in chunk)
    return base_s * (6 if unknown else 1) + nbytes * PER_BYTE_S + len(chunk) * PER_ITEM_S


def exactly(answers: list, items: list) -> list:
    if len(answers) != len(items):
        raise TransferError(f"{len(answers)} answers to {len(items)} items")
    return answers


def outcome(status: int, message: str, name: bytes, *, write: bool):
    """What one item's status means for the caller: None (done), an error, or ask again."""
    what = f"object {name[:80]!r}" if name else "objects"
    if status == Status.OK or (status == Status.EXISTS and write):
        return None
    if status in (Status.WRONG_OWNER, Status.UNAVAILABLE):
        return Retry(f"{Status(status).name.lower()}: {message}")
    text = f"{what}: {Status(status).name.lower().replace('_', ' ')}" + (f": {message}" if message else "")
    if status == Status.NOT_FOUND:
        return ObjectNotFound(text)
    if status == Status.LEASED:
        return ObjectHasLease(text)
    if status == Status.FULL:
        return NoSpace(text)
    if status == Status.FORBIDDEN:
        return IllegalClient(text)
    if status == Status.AWAY:
        return NotReady(text)
    if status in (Status.INVALID, Status.TOO_SMALL, Status.LENGTH_MISMATCH, Status.BAD_REQUEST):
        return InvalidParams(text)
    return TransferFailed(text)  # REPLICA_FAILED, INTERNAL: the outcome of a write is unknown


def unless_failed(result: T | StoreApiError) -> T:
    """An item's result, or its failure raised."""
    if isinstance(result, StoreApiError):
        raise result
    return result


def name_bytes(name) -> bytes:
    if not isinstance(name, str):
        raise InvalidParams(f"object keys are str, got {type(name).__name__}")
    raw = name.encode(errors="surrogatepass")
    if not raw:
        raise InvalidParams("object keys are not empty")
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidParams(f"object keys are at most {MAX_NAME_BYTES} bytes, got {len(raw)}")
    return raw


def readable(value) -> np.ndarray:
    """The bytes of a value to put, without a copy where they are host memory."""
    try:
        if is_tensor(value):
            if not value.is_contiguous():
                raise InvalidParams("a tensor to put must be contiguous")
            return host_bytes(value.detach())
        if isinstance(value, np.ndarray):
            if not value.flags.c_contiguous:
                raise InvalidParams("an array to put must be C-contiguous (np.ascontiguousarray)")
            return value.reshape(-1).view(np.uint8)
        view = memoryview(value)
        if not view.contiguous:
            raise InvalidParams("a buffer to put must be contiguous")
        return np.frombuffer(view.cast("B") if view.ndim != 1 or view.itemsize != 1 else view, dtype=np.uint8)
    except InvalidParams:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidParams(f"a value to put is bytes, a buffer, an array or a tensor: {exc}") from None


def writable(buffer) -> np.ndarray:
    """A buffer to read into, refusing read-only memory (bytes, a read-only array)."""
    try:
        if is_tensor(buffer):
            if not buffer.is_contiguous():
                raise InvalidParams("a tensor to read into must be contiguous")
            return as_bytes(buffer.detach())  # a CPU tensor's memory, as an array
        if isinstance(buffer, np.ndarray):
            if not buffer.flags.writeable or not buffer.flags.c_contiguous:
                raise InvalidParams("an array to read into must be writable and C-contiguous")
            return buffer.reshape(-1).view(np.uint8)
        view = memoryview(buffer)
        if view.readonly or not view.contiguous:
            raise InvalidParams(f"a {type(buffer).__name__} to read into must be writable and contiguous")
        return np.frombuffer(view.cast("B") if view.ndim != 1 or view.itemsize != 1 else view, dtype=np.uint8)
    except InvalidParams:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidParams(f"a buffer to read into is a writable buffer, array or tensor: {exc}") from None


def device_bytes(buffer):
    """A device tensor's bytes, flat (a torch tensor on its device)."""
    if not buffer.is_contiguous():
        raise InvalidParams("a tensor to read into must be contiguous")
    return as_bytes(buffer.detach())


# What a batch's calls give back, in the callers' order ----------------------------------------


def merged(outcomes: list, items: list[Item], done: dict[int, object]) -> list:
    for it in items:
        outcomes[it.index] = done[it.index]
    return outcomes


def finish_reads(outcomes: list, items: list[Item], done: dict[int, object]) -> list:
    """The reads' outcomes, device buffers filled from the host copies they were read into."""
    for it in items:
        got = done[it.index]
        if it.device is not None and isinstance(got, np.ndarray):
            copy_into(it.device[: got.size], got)
        outcomes[it.index] = got
    return outcomes
