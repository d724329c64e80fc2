"""Block identity: the one hashing function every part of tiercake uses.

A block is ``block_size`` tokens. Its key is a chained hash ``h_i = H(h_{i-1}, tokens_i)`` whose
root ``h_{-1}`` is derived from the namespace (model, KV layout, block size, tenant salt), so a key
names the block *and its whole prefix*, and two namespaces never share a key. ``H`` is BLAKE2b-256
with a fixed personalisation: stable across processes, machines and Python versions (never
``hash()``).

A block's *seal* binds its bytes to its key and its tenant: a keyed BLAKE3 MAC whose key is derived
from a seal secret that only the cluster's KV writers hold (workers, vLLM connectors; not node
agents, not key-value store clients) and the tenant's hashing salt. The writer stores it beside the
block; a reader that loads KV checks it and recomputes a block whose seal does not verify. Anyone
else who can write blocks (the transfer secret is enough) cannot make a block another tenant's
worker will use, and a block corrupted anywhere on its way (a pool's memory, a disk, the wire) is
caught the same way.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import blake3
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

KEY_BYTES = 32
_PERSON_ROOT = b"tiercake.ns.v1"
_PERSON_BLOCK = b"tiercake.blk.v1"
_MAX_TOKEN = 2**32 - 1
SEAL_BYTES = 16
_SEAL_CONTEXT = "tiercake 2026-12 block seal key v1"


class BlockKey(bytes):
    """A 32-byte block key. Prints as hex; compares and hashes as bytes."""

    __slots__ = ()

    def __new__(cls, value: bytes) -> BlockKey:
        if len(value) != KEY_BYTES:
            raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        try:
            raw = bytes.fromhex(text)
        except ValueError as exc:
            raise ValueError(f"not a hex block key: {text!r}") from exc
        return cls(raw)

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()[:16]}…)"

    def __str__(self) -> str:
        return self.hex()


class Namespace(BaseModel):
    """Everything that makes two identical token blocks hold different KV.

    Two tenants share cache hits only if they are configured with the same ``tenant_salt``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    model_id: str = Field(min_length=1, description="model name and revision")
    kv_layout: str = Field(min_length=1, description="KV layout and dtype, e.g. 'L2.H2.D16.float16'")
    block_size: int = Field(default=16, gt=0, le=1 << 20, description="tokens per block")
    tenant_salt: str = Field(default="", description="per-tenant salt; equal salts share a cache")

    def root(self) -> bytes:
        """h_{-1}: the chain's seed, from a canonical encoding of every field."""
        canonical = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES, person=_PERSON_ROOT).digest()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(parent: bytes, block_tokens: Sequence[int] | np.ndarray) -> BlockKey:
    """h_i = H(h_{i-1} || tokens_i as little-endian uint32)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_BLOCK)
    h.update(parent)
    h.update(_token_bytes(block_tokens))
    return BlockKey(h.digest())


def block_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, known: Sequence[BlockKey] = ()
) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens``; a trailing partial block is never keyed. ``known``:
    the keys of its first blocks, made before (a prompt's, when the answer has grown it): only the
    rest are hashed."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    size = namespace.block_size
    full = arr.shape[0] // size
    keys: list[BlockKey] = list(known[:full])
    parent = keys[-1] if keys else namespace.root()
    for i in range(len(keys), full):
        key = chain_key(parent, arr[i * size : (i + 1) * size])
        keys.append(key)
        parent = key
    return keys


_PERSON_OBJECT = b"tiercake.obj.v1"
_PERSON_VERSION = b"tiercake.ver.v1"


@functools.lru_cache(maxsize=1024)
def _object_root(tenant: str) -> bytes:
    return Namespace(model_id="tiercake.objects", kv_layout="bytes.v1", block_size=1, tenant_salt=tenant).root()


def object_id(name: bytes, tenant: str = "") -> BlockKey:
    """A key-value store object's identity: BLAKE2b-256 of its name in a namespace of its own per
    tenant (personalised apart from KV blocks' chain keys), so an object never shares a key with KV
    blocks, another tenant's objects or another name. It picks the object's slot (``object_slot``),
    and so its owner; every client and node computes it the same way."""
    h = hashlib.blake2b(_object_root(tenant), digest_size=KEY_BYTES, person=_PERSON_OBJECT)
    h.update(name)
    return BlockKey(h.digest())


def object_slot(oid: bytes, slots: int) -> int:
    """Which of the object map's ``slots`` an object lies in (the map says which nodes own each)."""
    return int.from_bytes(oid[:8], "little") % slots


def object_block_key(oid: bytes, nonce: int) -> BlockKey:
    """The store key of one written version of an object: new at every write (``nonce``, 64 bits), so
    an upsert's new bytes never share a block with the version readers may still be reading."""
    if not 0 <= nonce < 1 << 64:
        raise ValueError("an object block nonce is 64 bits")
    return BlockKey(
        hashlib.blake2b(oid + nonce.to_bytes(8, "little"), digest_size=KEY_BYTES, person=_PERSON_VERSION).digest()
    )


OBJECT_TENANT_SUFFIX = "#obj"  # object tenants have no '#': KV tenants never end so


def object_block_tenant(tenant: str) -> str:
    """The store tenant of a key-value store tenant's object blocks (quota, and how a node tells its
    object blocks from KV blocks: only the latter are reported to the placement index)."""
    return tenant + OBJECT_TENANT_SUFFIX


def is_object_tenant(store_tenant: str) -> bool:
    return store_tenant.endswith(OBJECT_TENANT_SUFFIX)


class Sealer:
    """Seals blocks for one hashing salt: ``seal(key, data)`` is a 16-byte MAC of the key and the
    bytes, ``verify`` checks one in constant time. Made by ``sealer_for``; cheap to keep per tenant."""

    __slots__ = ("_key",)

    def __init__(self, mac_key: bytes) -> None:
        if len(mac_key) != 32:
            raise ValueError("a seal key is 32 bytes")
        self._key = mac_key

    def seal(self, key: bytes, data) -> bytes:
        """``data``: anything exposing the buffer protocol (bytes, a numpy array, a host tensor's numpy())."""
        h = blake3.blake3(key=self._key)
        h.update(len(key).to_bytes(1, "little") + key)
        h.update(data)
        return h.digest(SEAL_BYTES)

    def verify(self, key: bytes, data, seal: bytes) -> bool:
        return len(seal) == SEAL_BYTES and hmac.compare_digest(self.seal(key, data), seal)


class SealCheck:
    """The seals of ``items`` (key, bytes, seal), checked by two threads from either end (``from_front``
    on one, ``from_back`` on another: each takes the next unchecked item until they meet). A loader
    copies first and then joins from the front, while a helper starts from the back at once: the copy
    and the check share the two cores instead of following each other. ``prefix`` waits for both
    and says how many items, from the first, verified."""

    def __init__(self, sealer: Sealer, items: Sequence[tuple[bytes, Any, bytes]]) -> None:
        self.sealer, self.items = sealer, items
        self._ok: list[bool | None] = [None] * len(items)
        self._front, self._back = 0, len(items)
        self._lock = threading.Lock()
        self._back_done = threading.Event()
        self._back_state = "waiting"  # -> "running", or "not needed" (the front checked every item first)

    def _next(self, front: bool) -> int | None:
        with self._lock:
            if not front:
                if self._back_state == "not needed":
                    return None
                self._back_state = "running"
            if self._front >= self._back:
                return None
            if front:
                self._front += 1
                return self._front - 1
            self._back -= 1
            return self._back

    def _run(self, front: bool) -> None:
        while (i := self._next(front)) is not None:
            self._ok[i] = self.sealer.verify(*self.items[i])

    def from_front(self) -> None:
        self._run(True)

    def from_back(self) -> None:
        try:
            self._run(False)
        finally:
            self._back_done.set()

    def prefix(self, helped: bool = True) -> int:
        """After ``from_front`` on this thread (run here if not yet): how many items verified, from the
        first; with ``helped``, once ``from_back`` (started elsewhere) has ended too."""
        self.from_front()
        with self._lock:
            if self._back_state == "waiting":  # its thread never got to it: nothing to wait for
                self._back_state = "not needed"
                helped = False
        if helped:
            self._back_done.wait()
        return next((i for i, ok in enumerate(self._ok) if not ok), len(self._ok))


def seal_material(secret: bytes) -> bytes:
    """The 32 bytes every tenant's seal key is derived from, out of the seal secret as configured."""
    if len(secret) < 16:
        raise ValueError("the seal secret must be at least 16 bytes")
    return blake3.blake3(secret, derive_key_context=_SEAL_CONTEXT).digest()


def cluster_seal_material(cluster_secret: bytes) -> bytes:
    """The seal material when no seal secret is configured: derived from the cluster secret (then
    whoever holds that could seal blocks too)."""
    return seal_material(b"cluster secret|" + cluster_secret)


def sealer_for(material: bytes, salt: str) -> Sealer:
    """The sealer of the blocks hashed with ``salt`` (tenants with equal salts share blocks, so their
    seals too)."""
    return Sealer(blake3.blake3(salt.encode(), key=material).digest())


class SealKeys:
    """Every tenant's sealer from one process's seal material, each made once (``for_salt``)."""

    def __init__(self, material: bytes) -> None:
        self.material = material
        self._sealers: dict[str, Sealer] = {}

    def for_salt(self, salt: str) -> Sealer:
        sealer = self._sealers.get(salt)
        if sealer is None:
            sealer = self._sealers[salt] = sealer_for(self.material, salt)
        return sealer


def block_parents(keys: Iterable[BlockKey]) -> list[tuple[BlockKey, BlockKey | None]]:
    """(key, parent key) pairs for a chain: the first block's parent is None (the namespace root)."""
    pairs: list[tuple[BlockKey, BlockKey | None]] = []
    parent: BlockKey | None = None
    for key in keys:
        pairs.append((key, parent))
        parent = key
    return pairs


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}


class BlockLayout(BaseModel):
    """The KV payload of one block: ``[layers, 2 (k, v), block_size, kv_heads, head_dim]``."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    block_size: int = Field(default=16, gt=0)
    dtype: str = Field(default="float16", pattern="^(" + "|".join(_DTYPE_BYTES) + ")$")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * _DTYPE_BYTES[self.dtype]

    @property
    def tag(self) -> str:
        """The layout's part of a namespace (``Namespace.kv_layout``)."""
        return f"L{self.layers}.H{self.kv_heads}.D{self.head_dim}.B{self.block_size}.{self.dtype}"

    def torch_dtype(self):  # torch is imported lazily: block identity must not need it
        import torch

        return getattr(torch, self.dtype)
