"""The key-value store's object operations on the transfer port: one request, one reply.

The frames are the transfer protocol's (``protocol.py``: header, body, then bulk bytes), after the
same HMAC handshake; the bodies are msgpack (msgspec ``Struct``s, array-like: a 64 KiB put's table is
about 40 bytes and costs under a microsecond to encode or decode). Every request names the object
map epoch the client routed it by, and every reply the epoch the node serves by, so a client with an
older map refreshes it and a node with an older one asks for the new one.

    OBJ_PUT      PutRequest, then (FLAG_EAGER) every item's bytes in order  ->  PutReply
                 or (FLAG_SHM, same host) ->  PutReady (pool offsets); the client copies the bytes
                 into the shared pool there; OBJ_PUT_COMMIT  ->  PutReply
    OBJ_GET      GetRequest  ->  GetReply, then the bytes of every item found, in order; or (FLAG_SHM)
                 GetReply with pool offsets and lease ids, the client copies from the pool and sends
                 OBJ_RELEASE (no reply)
    OBJ_QUERY    QueryRequest  ->  QueryReply (exists, size, version, durability, holders)
    OBJ_REMOVE   RemoveRequest (names, or every object of the tenant, or those matching a pattern)  ->  RemoveReply
    OBJ_REPLICATE  node to node only: a primary's writes and removes for its slot's backups, and the
                 whole slot when a backup (re)joins (phase SYNC_BEGIN, items, SYNC_END)  ->  ReplicateReply

Statuses are ``protocol.Status``; per item, never for the whole request. A malformed body is a
``ProtocolError``: an ERROR frame and a closed connection, as for the block operations.
"""

from __future__ import annotations

import msgspec

from .protocol import MAX_ITEMS, ProtocolError

NO_SOFT_PIN = -1
KEEP_SOFT_PIN = -2  # an upsert: the object keeps the soft pin it had (Mooncake's PRESERVE)


class PutItem(msgspec.Struct, array_like=True, frozen=True):
    name: bytes
    size: int
    upsert: bool = False  # replace the value (else a present object keeps its first value, as in Mooncake)
    replicas: int = 1
    persist: bool = False
    hard_pin: bool = False
    soft_pin_ms: int = NO_SOFT_PIN


class PutRequest(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    epoch: int
    items: list[PutItem]


class Result(msgspec.Struct, array_like=True, frozen=True):
    status: int
    message: str = ""


class PutReady(msgspec.Struct, array_like=True, frozen=True):
    """Same-host puts: where in the pool each accepted item's bytes go (-1: refused, see ``results``)."""

    epoch: int
    offsets: list[int]
    results: list[Result]


class PutReply(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    results: list[Result]


class GetItem(msgspec.Struct, array_like=True, frozen=True):
    name: bytes
    capacity: int = -1  # the reader's buffer (-1: any size); a larger object is TOO_SMALL, no bytes sent


class GetRequest(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    epoch: int
    items: list[GetItem]


class Got(msgspec.Struct, array_like=True, frozen=True):
    status: int
    size: int = 0
    version: int = 0
    offset: int = 0  # FLAG_SHM: where the object's bytes lie in the pool
    lease: int = 0  # FLAG_SHM: the lease to release
    message: str = ""


class GetReply(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    items: list[Got]


class ReleaseRequest(msgspec.Struct, array_like=True, frozen=True):
    leases: list[int]


class QueryRequest(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    epoch: int
    names: list[bytes]
    lease: bool = True  # Mooncake's exists grants a read lease
    ages_ms: list[int] = []  # a same-host reader's note (FLAG_NO_REPLY): how long ago it read each name


class Described(msgspec.Struct, array_like=True, frozen=True):
    status: int
    size: int = 0
    version: int = 0
    replicas: int = 0
    persist: bool = False
    holders: list[str] = []  # the nodes holding it, primary first
    message: str = ""


class QueryReply(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    items: list[Described]


class RemoveRequest(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    epoch: int
    names: list[bytes] = []
    force: bool = False  # remove even while a reader's lease holds it
    every: bool = False  # every object of the tenant this node owns (names ignored)
    pattern: str | None = None  # with ``every``: only names matching this regular expression (Python's re)


class RemoveReply(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    results: list[Result]
    removed: int = 0  # with ``every``: how many went


class Replica(msgspec.Struct, array_like=True, frozen=True):
    """One object's state as the primary has it: its bytes follow (unless ``removed``)."""

    tenant: str
    name: bytes
    version: int
    size: int = 0
    replicas: int = 1
    persist: bool = False
    hard_pin: bool = False
    soft_pin_ms: int = NO_SOFT_PIN
    removed: bool = False


ITEMS, SYNC_BEGIN, SYNC_END = 0, 1, 2


class ReplicateRequest(msgspec.Struct, array_like=True, frozen=True):
    slot: int
    epoch: int
    primary: str
    phase: int = ITEMS  # SYNC_BEGIN: a full copy of the slot follows; SYNC_END: it is whole (what it did not send goes)
    items: list[Replica] = []


class ReplicateReply(msgspec.Struct, array_like=True, frozen=True):
    epoch: int
    results: list[Result]


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(kind: type, body: bytes | bytearray | memoryview):
    """``body`` as a ``kind``; ``ProtocolError`` when it is not one (or holds too many items)."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message = decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {kind.__name__}: {exc}") from None
    for field in ("items", "names", "results", "leases"):
        if len(getattr(message, field, ())) > MAX_ITEMS:
            raise ProtocolError(f"{kind.__name__} of more than {MAX_ITEMS} items")
    return message
