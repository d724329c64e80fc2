"""The gpu tier: a paged block pool on a torch device, as vLLM's block pool.

One tensor ``kv[num_blocks, *block_shape]`` holds every block. Blocks carry refcounts: the store
holds one reference for a cached block, and each sequence whose block table lists it holds another,
so a block shared by a running sequence is never evicted. Runs on ``cuda`` when present, else ``cpu``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from .backend import MemoryTierBackend
from .errors import InvalidStateError, PayloadError, TierFullError
from .kinds import GpuKind


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class GpuBlockPool:
    """Fixed-shape KV blocks with a free list, refcounts and per-sequence block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype = torch.float16,
        device: str | torch.device | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.device = torch.device(device or default_device())
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        # zeros, not empty: every page is touched now rather than on the first put
        self.kv = torch.zeros((num_blocks, *self.block_shape), dtype=dtype, device=self.device)
        self._bytes = self.kv.view(num_blocks, -1).view(torch.uint8)
        self.block_nbytes = self._bytes.shape[1]
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free block with refcount 1; TierFullError when none is free."""
        if not self._free:
            raise TierFullError(f"gpu pool: all {self.num_blocks} blocks are in use")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise InvalidStateError(f"gpu pool: block {block} is free")
        self._refs[block] += 1

    def decref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise InvalidStateError(f"gpu pool: block {block} is already free")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def block(self, block: int) -> torch.Tensor:
        """The block as a ``block_shape`` tensor of the pool's dtype (a view)."""
        return self.kv[block]

    def byte_view(self, block: int) -> torch.Tensor:
        """The block as flat bytes (a view)."""
        return self._bytes[block]

    # Block tables ---------------------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, shared_prefix: Sequence[int] = ()) -> list[int]:
        """Start a sequence whose table begins with already-filled blocks (a cached prefix)."""
        if seq_id in self.tables:
            raise InvalidStateError(f"gpu pool: sequence {seq_id!r} already exists")
        for block in shared_prefix:
            self.incref(block)
        self.tables[seq_id] = list(shared_prefix)
        return self.tables[seq_id]

    def append_block(self, seq_id: Hashable) -> int:
        table = self._table(seq_id)
        block = self.allocate()
        table.append(block)
        return block

    def free_sequence(self, seq_id: Hashable) -> None:
        for block in self._table(seq_id):
            self.decref(block)
        del self.tables[seq_id]

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise InvalidStateError(f"gpu pool: unknown sequence {seq_id!r}") from None


class GpuBackend(GpuKind, MemoryTierBackend):
    """The store's view of a GpuBlockPool: one object per block, exact block size only."""

    @classmethod
    def from_config(cls, cfg, layout) -> GpuBackend:
        if layout is None:
            raise ValueError("a gpu tier needs the block layout (store.layout)")
        blocks = int(cfg.capacity) // layout.nbytes
        if blocks < 1:
            raise ValueError(f"gpu tier capacity {int(cfg.capacity)} is below one block ({layout.nbytes} bytes)")
        return cls(GpuBlockPool(blocks, layout.shape, layout.torch_dtype(), cfg.device), name=cfg.tier_name)

    def __init__(self, pool: GpuBlockPool, name: str = "gpu") -> None:
        self.pool = pool
        self.name = name
        self._host: np.ndarray | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.pool.num_blocks * self.pool.block_nbytes

    @property
    def used_bytes(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free) * self.pool.block_nbytes

    def accepts(self, nbytes: int) -> bool:
        return nbytes == self.pool.block_nbytes

    def allocate(self, nbytes: int) -> int | None:
        if nbytes != self.pool.block_nbytes:
            raise PayloadError(
                f"tier {self.name!r} holds blocks of exactly {self.pool.block_nbytes} bytes, got {nbytes}"
            )
        if not self.pool.num_free:
            return None
        return self.pool.allocate()

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.pool.byte_view(slot)

    def host_array(self, slot: int, nbytes: int):
        """A numpy view of the block when it lives in host memory; None on a device."""
        if self.pool.device.type != "cpu":
            return None
        if self._host is None:
            self._host = self.pool._bytes.numpy()
        return self._host[slot]

    def adopt(self, slot: int) -> None:
        """The store takes a reference to a block a sequence filled (``TieredStore.adopt``)."""
        self.pool.incref(slot)

    def in_use(self, slot: int) -> bool:
        return self.pool.refcount(slot) > 1

    async def release(self, slot: int) -> None:
        self.pool.decref(slot)

    def close(self) -> None:
        pass


GpuTier = GpuBackend  # the name before 0.2 (a backend, not a store tier); kept for callers
