"""The tier backend interface: what the store needs of a tier's storage. A backend is dumb storage;
policies, object state, leases and pins stay in the store (``store.py``).

Two kinds, and the store treats them by kind, never by name:

- ``MemoryTierBackend``: bytes addressable in place (gpu memory, a shared pool, a CXL device): the
  store copies into and out of ``view``s, and serves in-process readers from them directly.
- ``DiskTierBackend``: bytes behind I/O (files, a raw device, an object store): a put is written
  from a staging buffer at commit (``persist``), a get read into the caller's buffer (``read_into``),
  and what survived a restart is handed back by ``recover``.

A new kind is one module with a subclass plus one registration in ``tiercake.plugins.TIER_BACKENDS``
(or an entry point in the group ``tiercake.tiers``); a ``TierConfig`` of that ``kind`` then builds it
through ``from_config``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .kinds import TierKind

if TYPE_CHECKING:
    from tiercake.blocks import BlockLayout
    from tiercake.config import TierConfig


@dataclass(slots=True)
class RecoveredBlock:
    """A block a disk tier found after a restart."""

    key: bytes
    parent: bytes | None
    nbytes: int
    slot: Any
    mtime: float
    tenant: str = ""
    seal: bytes = b""


class TierBackend(TierKind, ABC):
    """A kind (``kinds.TierKind``: its name, rank and config checks) and its storage."""

    name: str  # this tier's name in its store

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: TierConfig, layout: BlockLayout | None) -> TierBackend:
        """Build the backend for one configured tier (``layout``: the store's block layout, if fixed)."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def accepts(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` could ever be held (size limits, exact block sizes)."""

    @abstractmethod
    def allocate(self, nbytes: int) -> Any | None:
        """A slot for ``nbytes`` (opaque to the store), or None when full (the store then evicts)."""

    @abstractmethod
    def in_use(self, slot: Any) -> bool:
        """Held by someone besides the store (a running sequence's block): never evicted."""

    @abstractmethod
    async def release(self, slot: Any) -> None:
        """Give the slot back; its bytes are gone."""

    async def recover(self) -> list[RecoveredBlock]:
        """What the tier still holds after a restart (a disk tier's files; a pool region adopted from
        its previous owner; most memory tiers: nothing)."""
        return []

    @abstractmethod
    def close(self) -> None: ...


class MemoryTierBackend(TierBackend):
    in_memory = True

    @abstractmethod
    def view(self, slot: Any, nbytes: int) -> Any:
        """The slot's bytes in place, flat uint8 (``buffers.as_bytes``' kinds): a numpy array in host
        memory, a torch tensor on a device."""

    @abstractmethod
    def host_array(self, slot: Any, nbytes: int) -> np.ndarray | None:
        """The slot's bytes as host memory for sockets, or None when they live on a device."""

    def adopt(self, slot: Any) -> None:
        """Take a reference to a slot filled outside the store (a gpu block a sequence computed)."""
        raise TypeError(f"tier {self.name!r} ({self.kind}) cannot adopt blocks")

    def on_commit(self, slot: Any, key: bytes, parent: bytes | None, tenant: str, seal: bytes) -> None:
        """The block in ``slot`` became visible. A tier whose memory outlives its owner (the pool)
        records it, so that ``recover`` can hand it back to the next owner; others do nothing."""


class DiskTierBackend(TierBackend):
    in_memory = False

    @abstractmethod
    def staging(self, slot: Any) -> np.ndarray:
        """Host memory a put is written into before ``persist`` (flat uint8, the slot's size)."""

    @abstractmethod
    async def persist(
        self,
        slot: Any,
        key: bytes,
        parent: bytes | None,
        src: Any = None,
        *,
        tenant: str = "",
        seal: bytes = b"",
        sync: bool = False,
    ) -> None:
        """Write the block (from ``src``, else the slot's staging buffer) durably enough to recover
        after the process dies, with its tenant and seal (``recover`` hands both back); with ``sync``,
        durably enough to recover after the machine does (on the device before this returns)."""

    @abstractmethod
    async def read_into(self, slot: Any, key: bytes, dst: Any) -> None:
        """Read the block into ``dst``; ``CorruptBlockError`` when it fails its checksum."""

    async def read_head(self, slot: Any, key: bytes, nbytes: int, want: int) -> bytes:
        """The first ``want`` bytes of the block of ``nbytes``, for a record that describes itself (a
        key-value object's header, read at recovery): no more than needed is read where the backend
        can, and they are not checked against the whole payload's checksum (a full read still is).
        The default reads it all."""
        from .buffers import empty

        out = empty(nbytes)
        await self.read_into(slot, key, out)
        return bytes(out[:want])
