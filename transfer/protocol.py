"""The transfer wire protocol: versioned frames, batch tables, statuses and errors.

Every message is a 20-byte frame header (magic, version, op, flags, request id, body length) and a
body. Batches travel as one table of fixed-size entries (plus variable keys and messages) followed
by the bulk data of every accepted item back to back, so a batch of 64 blocks is a handful of
``sendmsg``/``recvmsg_into`` calls that scatter straight into the destination buffers.

Connection start (mutual HMAC-SHA256 over fresh nonces; no secret crosses the wire):

    server -> HELLO   {nonce_s}
    client -> AUTH    {nonce_c, HMAC(key, role | nonce_s | nonce_c), name}
    server -> WELCOME {HMAC(key, server role | nonce_c | nonce_s), PeerInfo JSON}   or ERROR + close

Three credentials (``Credential``), one plane each, told apart by the role the proof is made under:
the cluster secret ("client": workers, vLLM, the cluster's own tools: every block and object), the
node secret ("node:<name>": node agents to each other, never given to clients; the only way in for
a slot's replication), and a tenant key ("tenant:<name>", derived from the cluster secret for one
tenant: that tenant's objects and nothing else). A server proves back with the key the client used.

Versions, N and N-1 (``OLDEST``..``VERSION``): the server frames its HELLO at ``OLDEST`` and ends
``nonce_s`` with a byte naming its own version (a version-3 server sends a bare 32-byte nonce; every
version proves over HELLO's whole body, so the byte is covered). The client speaks the lower of the
two versions and frames its AUTH at it; the server speaks what AUTH is framed at. Each side frames
everything after at that session version (``speak``/``version_of``), takes frames of any version it
speaks, and sends an older peer only what that version has (no object operations, no ``PeerInfo``
field added after it).

Operations (one request in flight per connection; the client keeps several connections):

    READ        table of (key, expected length)  ->  READ_REPLY table of (status, length, xxh3, seal) + data
    WRITE       table of (key, parent, tenant, length, xxh3, seal)  ->  WRITE_READY table of (status, pool offset)
                then the data of accepted items (or, with FLAG_SHM, a copy into the shared pool at
                those offsets and WRITE_COMMIT)  ->  WRITE_DONE table of (status)
                With FLAG_EAGER (at most MAX_EAGER_BYTES, over the stream): the data of every item
                follows the table at once, no WRITE_READY; the bytes of a refused item are read and
                dropped  ->  WRITE_DONE
    LEASE       table of (key, expected length, ttl)  ->  LEASE_REPLY (status, pool offset, lease id, seal):
                same-host peers then copy from the shared pool in place, and RELEASE the leases
    RELEASE     table of (key, lease id)  ->  RELEASE_REPLY, or nothing with FLAG_NO_REPLY (a reader
                that does not wait: the peer frees the leases when the frame arrives)
    DELETE      table of (key)  ->  DELETE_REPLY table of (status): every copy of each block removed,
                refused per item while a reader holds it (LEASED) or it is hard-pinned (PINNED)
    STAGE       table of (key)  ->  STAGE_REPLY table of (status): blocks only on disk brought into the
                memory tier above it ahead of a read (OK: in memory now; FULL: stays on disk)
    SESSION     (JSON length, SessionNotice JSON, table of (key))  ->  SESSION_REPLY table of one status: a
                conversation's state changed; the node's tiers' eviction policies are told, with the
                blocks its next turn reads (``tiercake.policies.SessionEvent``, timed by the node's clock)

A seal (``tiercake.blocks.Sealer``, up to 32 bytes, may be empty) is stored with a written block and
handed back with every read of it; the node keeps it and never checks it (it does not hold the key).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import math
import os
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tiercake.messages import MAX_SESSION_S

MAGIC = b"TCXF"
VERSION = 5  # 2: seals in WRITE, READ_REPLY and LEASE_REPLY; 3: RELEASE with FLAG_NO_REPLY, eager WRITE;
# 4: the key-value store's object operations (object_wire.py), HELLO names the server's version; 5: SESSION
OLDEST = 4  # the oldest version this side still speaks: a cluster upgrades one process at a time
FRAMED_SINCE = 3  # the frame header has been the same since: a HELLO of an older release is still read
OBJECTS_SINCE = 4  # the object operations: not sent to, nor asked of, an older peer
SESSIONS_SINCE = 5  # SESSION: an older peer is not told (its tiers' policies are session-blind anyway)
POOL_FORMAT_SINCE = 4  # the shared pool's region format (TCPOOL02): an older peer's pool is not mapped, nor ours by it
NONCE_BYTES = 32
MAX_BODY = 16 << 20  # metadata of one request; bulk data is counted separately
MAX_ITEMS = 4096
MAX_KEY = 64
MAX_SEAL = 32
HANDSHAKE_BODY = 4096  # HELLO, AUTH (nonce, proof, node id) and ERROR before authentication
WELCOME_BODY = 64 << 10  # the server's proof and PeerInfo

FRAME = struct.Struct("<4sBBHIQ")  # magic, version, op, flags, request id, body length

FLAG_CHECKSUM = 1  # the sender computes xxh3-64 of every item, the receiver verifies it
FLAG_SHM = 2  # WRITE on the same host: the data is copied into the shared pool, not streamed
FLAG_UCX = 4  # READ/WRITE whose bulk bytes travel over the connection's UCX endpoints
# The protocol's own modifiers take the top bits, so that the low ones stay free for plug-in data paths
FLAG_NO_REPLY = 1 << 15  # RELEASE: the peer answers nothing (a reply nobody waits for costs both sides a wake-up)
FLAG_EAGER = 1 << 14  # WRITE over the stream: the data follows the table at once, no WRITE_READY round trip
MODIFIER_FLAGS = FLAG_CHECKSUM | FLAG_NO_REPLY | FLAG_EAGER  # the bits that choose no data path
MAX_EAGER_BYTES = 1 << 20  # an eager write's whole data; a refused item's bytes cross the wire for nothing


class Op(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    READ = 10
    READ_REPLY = 11
    WRITE = 12
    WRITE_READY = 13
    WRITE_DONE = 14
    LEASE = 15
    LEASE_REPLY = 16
    RELEASE = 17
    RELEASE_REPLY = 18
    WRITE_COMMIT = 19
    UCX_HELLO = 20  # exchange UCX worker addresses (both directions use the same op)
    DELETE = 21
    DELETE_REPLY = 22
    STAGE = 23
    STAGE_REPLY = 24
    SESSION = 25
    SESSION_REPLY = 26
    # the key-value store's objects (object_wire.py): bodies are msgpack, bulk bytes follow as above
    OBJ_PUT = 30
    OBJ_PUT_READY = 31
    OBJ_PUT_COMMIT = 32
    OBJ_PUT_REPLY = 33
    OBJ_GET = 34
    OBJ_GET_REPLY = 35
    OBJ_RELEASE = 36
    OBJ_QUERY = 37
    OBJ_QUERY_REPLY = 38
    OBJ_REMOVE = 39
    OBJ_REMOVE_REPLY = 40
    OBJ_REPLICATE = 41
    OBJ_REPLICATE_REPLY = 42


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    LENGTH_MISMATCH = 2
    EXISTS = 3
    FULL = 4
    CHECKSUM = 5
    BAD_REQUEST = 6
    IN_PROGRESS = 7
    NOT_IN_MEMORY = 8  # a lease asked for a block that is only on disk: read it over the stream
    INTERNAL = 9
    LEASED = 10  # a DELETE of a block a reader holds: retry once the read is over
    PINNED = 11  # a DELETE of a hard-pinned block
    WRONG_OWNER = 12  # an object of a slot this node does not own (by its map: the reply's epoch)
    UNAVAILABLE = 13  # a slot this node owns but cannot serve now (its lease is not surely alive, a handoff)
    TOO_SMALL = 14  # the reader's buffer cannot hold the object
    INVALID = 15  # a request's parameters make no sense (an empty name, a replica count of 0)
    REPLICA_FAILED = 16  # the slot's backups could not take a replicated write: not stored
    FORBIDDEN = 17  # the connection's credential does not reach this (another tenant's object)
    AWAY = 18  # the object may be on a node that is away (persisted there): unavailable, not absent


class TransferError(Exception):
    """Base of the transfer engine's errors. ``status`` says what went wrong for one item."""

    status: Status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class Forbidden(TransferError):
    """The peer's credential does not reach what it asked for (a tenant's key for another tenant's
    objects or for blocks; a replication from a peer that is not the slot's primary node)."""

    status = Status.FORBIDDEN


class ProtocolError(TransferError):
    """The peer sent something this protocol does not allow; the connection is closed."""

    status = Status.BAD_REQUEST


class AuthenticationError(TransferError):
    """The peer could not prove it knows the cluster secret (or we could not)."""


class PeerClosedError(TransferError, ConnectionError):
    """The peer closed the connection or died in the middle of a transfer."""


class ItemError(TransferError):
    """One item of a batch failed; the others are unaffected."""


class SealError(ItemError):
    """A block arrived whole but its seal does not verify: forged, or corrupted where it was held.
    It was not stored; the reader recomputes it."""

    status = Status.CHECKSUM


# Tables --------------------------------------------------------------------------------------------
#
# A table is: item count (u32), one fixed-size record per item (a packed numpy dtype, decoded for the
# whole batch in one call), then the variable bytes (keys, parents, messages) back to back in item
# order. Every length is checked against the body: a malformed table is a ProtocolError.


def _dt(*fields: tuple[str, str]) -> np.dtype:
    return np.dtype(list(fields))  # packed: no alignment padding


READ_DT = _dt(("klen", "u1"), ("length", "<u8"))
READ_REPLY_DT = _dt(("status", "u1"), ("mlen", "<u2"), ("slen", "u1"), ("length", "<u8"), ("checksum", "<u8"))
WRITE_DT = _dt(("klen", "u1"), ("plen", "u1"), ("tlen", "u1"), ("slen", "u1"), ("length", "<u8"), ("checksum", "<u8"))
STATUS_DT = _dt(("status", "u1"), ("mlen", "<u2"))
LEASE_DT = _dt(("klen", "u1"), ("length", "<u8"), ("ttl", "<f8"))
LEASE_REPLY_DT = _dt(
    ("status", "u1"), ("mlen", "<u2"), ("slen", "u1"), ("offset", "<u8"), ("length", "<u8"), ("lease", "<u8")
)
RELEASE_DT = _dt(("klen", "u1"), ("lease", "<u8"))
KEYS_DT = _dt(
    ("klen", "u1"),
)

_STATUSES = {int(s): s for s in Status}


def _status(value: int) -> Status:
    try:
        return _STATUSES[value]
    except KeyError:
        raise ProtocolError(f"unknown status {value}") from None


SMALL_TABLE = 8  # up to this many items a table is packed and parsed with struct: numpy's per-call cost
# (several microseconds a call) is most of the time of a one-block request


@functools.cache
def _fields(dtype: np.dtype) -> tuple[tuple[str, np.dtype], ...]:
    """A record dtype's fields in order: each one's name and type."""
    assert dtype.names is not None and dtype.fields is not None  # a record dtype, not a plain one
    return tuple((name, dtype.fields[name][0]) for name in dtype.names)


@functools.cache
def _struct(dtype: np.dtype) -> struct.Struct:
    """The struct layout of one packed record of ``dtype`` (same bytes as numpy's)."""
    codes = {"u1": "B", "<u2": "H", "<u4": "I", "<u8": "Q", "<f8": "d"}
    return struct.Struct("<" + "".join(codes[kind.str.replace("|", "")] for _, kind in _fields(dtype)))


def _encode(dtype: np.dtype, rows: list[tuple], blobs: Sequence[bytes]) -> bytes:
    if len(rows) > MAX_ITEMS:
        raise ValueError(f"a batch holds at most {MAX_ITEMS} items, got {len(rows)}")
    if len(rows) <= SMALL_TABLE:
        record = _struct(dtype)
        try:
            fixed = b"".join(record.pack(*row) for row in rows)
        except struct.error as exc:
            raise ValueError(f"a table value is out of range: {exc}") from None
    else:
        fixed = np.array(rows, dtype=dtype).tobytes()
    return len(rows).to_bytes(4, "little") + fixed + b"".join(blobs)


def _decode(
    dtype: np.dtype, body: bytes | bytearray, var: tuple[str, ...]
) -> tuple[dict[str, list], list[list[bytes]]]:
    """The fixed records as one list per column, and, per item, the variable fields named by the
    length columns ``var``."""
    view = memoryview(body)
    if len(view) < 4:
        raise ProtocolError("truncated table")
    n = int.from_bytes(view[:4], "little")
    if n > MAX_ITEMS:
        raise ProtocolError(f"batch of {n} items is over the limit of {MAX_ITEMS}")
    end = 4 + n * dtype.itemsize
    if end > len(view):
        raise ProtocolError("truncated table")
    if n <= SMALL_TABLE:
        rows = list(_struct(dtype).iter_unpack(view[4:end]))
        columns = {name: [row[i] for row in rows] for i, (name, _) in enumerate(_fields(dtype))}
    else:
        records = np.frombuffer(view[4:end], dtype=dtype)
        columns = {name: records[name].tolist() for name, _ in _fields(dtype)}
    for name, kind in _fields(dtype):  # every float on the wire is a number (a NaN TTL once pinned a block for good)
        if kind.kind == "f" and not all(math.isfinite(v) for v in columns[name]):
            raise ProtocolError(f"{name}: not a finite number")
    sizes = [columns[f] for f in var]
    if sum(sum(column) for column in sizes) != len(view) - end:
        raise ProtocolError("table lengths do not match its body")
    blob = bytes(view[end:])
    fields: list[list[bytes]] = []
    pos = 0
    for i in range(n):
        item = []
        for column in sizes:
            item.append(blob[pos : pos + column[i]])
            pos += column[i]
        fields.append(item)
    return columns, fields


def _key(key: bytes) -> bytes:
    if not 0 < len(key) <= MAX_KEY:
        raise ValueError(f"keys are 1 to {MAX_KEY} bytes, got {len(key)}")
    return key


def _length(n: int) -> int:
    if n < 0:
        raise ValueError(f"negative length {n}")
    return n


def _message(text: str) -> bytes:
    return text.encode()[:1000]


def _seal(seal: bytes) -> bytes:
    if len(seal) > MAX_SEAL:
        raise ValueError(f"seals are at most {MAX_SEAL} bytes, got {len(seal)}")
    return seal


def encode_read(items: list[tuple[bytes, int]]) -> bytes:
    return _encode(READ_DT, [(len(_key(k)), _length(n)) for k, n in items], [k for k, _ in items])


def decode_read(body: bytes | bytearray) -> list[tuple[bytes, int]]:
    records, fields = _decode(READ_DT, body, ("klen",))
    return [(f[0], n) for f, n in zip(fields, records["length"])]


@dataclass(slots=True)
class ReplyItem:
    status: Status
    length: int = 0
    checksum: int = 0
    message: str = ""
    offset: int = 0  # LEASE_REPLY and WRITE_READY: where the block lies in the pool's data space
    lease: int = 0
    seal: bytes = b""  # READ_REPLY and LEASE_REPLY: what the writer stored with the block


def _with_seals(items: list[ReplyItem]) -> tuple[list[bytes], list[bytes]]:
    messages = [_message(it.message) for it in items]
    blobs = []
    for it, m in zip(items, messages):
        blobs += [m, _seal(it.seal)]
    return messages, blobs


def encode_read_reply(items: list[ReplyItem]) -> bytes:
    messages, blobs = _with_seals(items)
    rows = [(it.status, len(m), len(it.seal), it.length, it.checksum) for it, m in zip(items, messages)]
    return _encode(READ_REPLY_DT, rows, blobs)


def decode_read_reply(body: bytes | bytearray) -> list[ReplyItem]:
    records, fields = _decode(READ_REPLY_DT, body, ("mlen", "slen"))
    return [
        ReplyItem(_status(s), n, c, f[0].decode(errors="replace"), seal=f[1])
        for s, n, c, f in zip(records["status"], records["length"], records["checksum"], fields)
    ]


@dataclass(slots=True)
class WriteItem:
    key: bytes
    length: int
    parent: bytes | None = None
    checksum: int = 0
    tenant: str = ""
    seal: bytes = b""


def encode_write(items: list[WriteItem]) -> bytes:
    rows, blobs = [], []
    for it in items:
        parent = it.parent or b""
        if len(parent) > MAX_KEY:
            raise ValueError(f"parent keys are at most {MAX_KEY} bytes")
        tenant = it.tenant.encode()
        if len(tenant) > 255:
            raise ValueError("tenant names are at most 255 bytes")
        rows.append((len(_key(it.key)), len(parent), len(tenant), len(_seal(it.seal)), _length(it.length), it.checksum))
        blobs += [it.key, parent, tenant, it.seal]
    return _encode(WRITE_DT, rows, blobs)


def decode_write(body: bytes | bytearray) -> list[WriteItem]:
    records, fields = _decode(WRITE_DT, body, ("klen", "plen", "tlen", "slen"))
    return [
        WriteItem(f[0], n, f[1] or None, c, f[2].decode(errors="replace"), f[3])
        for f, n, c in zip(fields, records["length"], records["checksum"])
    ]


def encode_statuses(items: list[ReplyItem]) -> bytes:
    messages = [_message(it.message) for it in items]
    return _encode(STATUS_DT, [(it.status, len(m)) for it, m in zip(items, messages)], messages)


def decode_statuses(body: bytes | bytearray) -> list[ReplyItem]:
    records, fields = _decode(STATUS_DT, body, ("mlen",))
    return [ReplyItem(_status(s), message=f[0].decode(errors="replace")) for s, f in zip(records["status"], fields)]


def encode_lease(items: list[tuple[bytes, int, float]]) -> bytes:
    return _encode(LEASE_DT, [(len(_key(k)), _length(n), ttl) for k, n, ttl in items], [k for k, _, _ in items])


def decode_lease(body: bytes | bytearray) -> list[tuple[bytes, int, float]]:
    records, fields = _decode(LEASE_DT, body, ("klen",))
    return [(f[0], n, t) for f, n, t in zip(fields, records["length"], records["ttl"])]


def encode_lease_reply(items: list[ReplyItem]) -> bytes:
    messages, blobs = _with_seals(items)
    rows = [(it.status, len(m), len(it.seal), it.offset, it.length, it.lease) for it, m in zip(items, messages)]
    return _encode(LEASE_REPLY_DT, rows, blobs)


def decode_lease_reply(body: bytes | bytearray) -> list[ReplyItem]:
    records, fields = _decode(LEASE_REPLY_DT, body, ("mlen", "slen"))
    columns = (records[c] for c in ("status", "offset", "length", "lease"))
    return [
        ReplyItem(_status(s), n, 0, f[0].decode(errors="replace"), o, lease, f[1])
        for s, o, n, lease, f in zip(*columns, fields)
    ]


def encode_release(items: list[tuple[bytes, int]]) -> bytes:
    return _encode(RELEASE_DT, [(len(_key(k)), lease) for k, lease in items], [k for k, _ in items])


def decode_release(body: bytes | bytearray) -> list[tuple[bytes, int]]:
    records, fields = _decode(RELEASE_DT, body, ("klen",))
    return [(f[0], lease) for f, lease in zip(fields, records["lease"])]


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """A table of keys alone (DELETE, STAGE)."""
    return _encode(KEYS_DT, [(len(_key(k)),) for k in keys], keys)


def decode_keys(body: bytes | bytearray) -> list[bytes]:
    _, fields = _decode(KEYS_DT, body, ("klen",))
    return [f[0] for f in fields]


class SessionNotice(BaseModel):
    """A session's new state as a worker tells its node (the session id is the front's tenant-scoped
    hash, never the client's own string)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    session: str = Field(min_length=1, max_length=128)
    state: Literal["active", "paused", "closed"]
    resume_in: float | None = Field(default=None, ge=0, le=MAX_SESSION_S)
    retain_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_S)
    priority: int = Field(default=0, ge=-100, le=100)
    tenant: str = Field(default="", max_length=128, description="whose: quotas and floors are per tenant")


SESSION_HEADER = struct.Struct("<I")


def encode_session(notice: SessionNotice, keys: Sequence[bytes]) -> bytes:
    header = notice.model_dump_json().encode()
    return SESSION_HEADER.pack(len(header)) + header + encode_keys(keys)


def decode_session(body: bytes | bytearray) -> tuple[SessionNotice, list[bytes]]:
    if len(body) < SESSION_HEADER.size:
        raise ProtocolError("SESSION body too short")
    (n,) = SESSION_HEADER.unpack_from(body)
    end = SESSION_HEADER.size + n
    if end > len(body):
        raise ProtocolError("SESSION header runs past the body")
    try:
        notice = SessionNotice.model_validate_json(bytes(body[SESSION_HEADER.size : end]))
    except ValidationError as exc:
        raise ProtocolError(f"bad SESSION notice: {exc.errors()[0]['msg']}") from None
    return notice, decode_keys(bytes(body[end:]))


# Authentication ------------------------------------------------------------------------------------


class PeerInfo(BaseModel):
    """What a transfer server tells an authenticated client about itself."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node_id: str
    boot_id: str  # equal boot ids: same kernel, so the shared pool can be mapped
    pool_path: str | None = None
    pool_size: int = 0
    pool_id: str | None = None  # the pool region's instance: a restarted node has a new one
    max_block_bytes: int
    ucx: bool = False  # the server speaks UCX_HELLO (ucxx installed there)
    objects_path: str | None = None  # the node's directory of objects for same-host readers (tiers/directory.py)

    ADDED: ClassVar[dict[str, int]] = {"objects_path": 4}  # fields by the version that added them

    def encode_for(self, version: int) -> bytes:
        """The JSON a peer speaking ``version`` reads: an older one refuses fields it does not know, and
        cannot map a pool of a later format (it is told of none, and reads over the stream)."""
        info = self if version >= POOL_FORMAT_SINCE else self.model_copy(update={"pool_path": None, "pool_id": None})
        return info.model_dump_json(exclude={f for f, since in self.ADDED.items() if since > version}).encode()


# The session version of each socket whose peer speaks an older one (absent: ``VERSION``); weak, so a
# closed socket leaves nothing behind, and empty while every peer is current (the hot path's test).
_older: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speak(sock: object, version: int) -> None:
    """Frame everything sent on ``sock`` at ``version`` from now on."""
    if version == VERSION:
        _older.pop(sock, None)
    else:
        _older[sock] = version


def version_of(sock: object) -> int:
    """The version frames sent on ``sock`` are framed at."""
    return _older.get(sock, VERSION) if _older else VERSION


def spoken(version: int, op: int | None = None) -> str | None:
    """Why a frame of ``version`` cannot be read (None: it can). A HELLO or an ERROR is framed at
    the sender's oldest version, which may be older than ours: its body is read all the same (the
    handshake then chooses a version both speak, or says why there is none)."""
    if OLDEST <= version <= VERSION or (op in (Op.HELLO, Op.ERROR) and FRAMED_SINCE <= version <= VERSION):
        return None
    return f"protocol version {version} is not supported (this side speaks {OLDEST} to {VERSION})"


def hello_nonce() -> bytes:
    """A server's HELLO body: a fresh nonce ending in the server's version."""
    return os.urandom(NONCE_BYTES) + bytes([VERSION])


def session_version(hello: bytes | bytearray, peer: str, needs: int = OLDEST) -> int:
    """The version a client speaks with the server that sent ``hello``; ``needs``: the oldest one its
    caller can use (the object operations need ``OBJECTS_SINCE``)."""
    theirs = hello[NONCE_BYTES] if len(hello) > NONCE_BYTES else 3  # version 3 sent a bare nonce
    version = min(VERSION, theirs)
    if version < OLDEST:
        raise AuthenticationError(
            f"{peer} speaks transfer protocol {theirs}; this side speaks {OLDEST} to {VERSION}: upgrade it"
        )
    if version < needs:
        raise AuthenticationError(
            f"{peer} speaks transfer protocol {theirs}, which has no object operations (since {needs}): upgrade it"
        )
    return version


CredentialKind = Literal["cluster", "node", "tenant"]
CLUSTER: CredentialKind = "cluster"
NODE: CredentialKind = "node"
TENANT: CredentialKind = "tenant"


@dataclass(frozen=True, slots=True)
class Credential:
    """What a connection proves at its handshake: ``key`` under the role of its ``kind`` (module
    docstring). The cluster secret's is ``Credential(secret)``."""

    key: bytes
    kind: CredentialKind = CLUSTER

    def role(self, name: str) -> bytes:
        return b"client" if self.kind == CLUSTER else f"{self.kind}:{name}".encode()

    @property
    def server_role(self) -> bytes:
        return b"server" if self.kind == CLUSTER else f"server:{self.kind}".encode()


def credential(secret: bytes | Credential) -> Credential:
    """A cluster secret as the credential it is; a credential as itself."""
    return secret if isinstance(secret, Credential) else Credential(secret)


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who the server's peer proved to be: its credential's kind and the name it proved it under."""

    kind: CredentialKind
    name: str

    def __str__(self) -> str:
        return self.name if self.kind == CLUSTER else f"{self.kind} {self.name}"


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def verify(secret: bytes, role: bytes, first: bytes, second: bytes, claimed: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, first, second), claimed)


@functools.cache  # asked on every same-host transfer; it cannot change while this process runs
def boot_id() -> str:
    """This kernel's boot id: two processes share memory only if theirs are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()
