"""The gpu tier as an inference engine sees it: one block table per running sequence.

A sequence starts with the leading blocks of its prompt that the tier already caches (shared, not
copied), grows block by block as it computes, hands its full blocks back to the tier's cache
(``adopt``) and gives its own references back when it ends. ``SequenceKV`` is the one owner of the
pool's tables; an engine holds ``BlockTable``s and never touches the block pool, refcounts or free
list. Nothing here awaits between finding a cached block and taking a reference to it, so a block
found cannot be evicted before it is shared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InvalidStateError, TierFullError
from .gpu import GpuBackend, GpuBlockPool
from .store import TieredStore


@dataclass(frozen=True, slots=True)
class BlockTable:
    """One sequence's blocks, in position order: block ``i`` holds positions ``[i*bs, (i+1)*bs)``.
    ``cached`` leading blocks came from the cache (already computed)."""

    seq_id: int
    blocks: list[int]
    cached: int

    def __len__(self) -> int:
        return len(self.blocks)


class SequenceKV:
    """Per-sequence block tables over a store's gpu tier (see the module docstring)."""

    def __init__(self, store: TieredStore, block_tokens: int, tier: str = "gpu") -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        backend = store.tier(tier).backend
        if not isinstance(backend, GpuBackend):
            raise TypeError(f"tier {tier!r} is a {type(backend).__name__}, not a gpu tier")
        self.store = store
        self.block_tokens = block_tokens
        self.tier = tier
        self._pool: GpuBlockPool = backend.pool
        self._ids = itertools.count(1)
        self._open: set[int] = set()

    # What the model computes over -----------------------------------------------------------------

    @property
    def kv(self) -> torch.Tensor:
        """Every block of the tier, ``(num_blocks, *block_shape)``: the paged KV the model reads and
        writes through block tables."""
        return self._pool.kv

    @property
    def block_nbytes(self) -> int:
        return self._pool.block_nbytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self._pool.block_shape

    @property
    def dtype(self) -> torch.dtype:
        return self._pool.dtype

    @property
    def device(self) -> torch.device:
        return self._pool.device

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    # Sequences ------------------------------------------------------------------------------------

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tier holds now."""
        for i, key in enumerate(keys):
            if self.store.slot_of(key, self.tier) is None:
                return i
        return len(keys)

    def open(self, keys: Sequence[bytes]) -> BlockTable:
        """A new sequence sharing the tier's blocks of the leading ``keys`` it holds."""
        slots = []
        for key in keys:
            slot = self.store.slot_of(key, self.tier)
            if slot is None:
                break
            slots.append(slot)
        seq_id = next(self._ids)
        blocks = self._pool.add_sequence(seq_id, slots)
        self._open.add(seq_id)
        return BlockTable(seq_id, blocks, len(slots))

    async def grow(self, table: BlockTable, positions: int) -> None:
        """Blocks for ``positions`` tokens, evicting cached blocks if needed; ``TierFullError`` when
        every block is held by running sequences."""
        self._check(table)
        need = -(-positions // self.block_tokens) - len(table.blocks)
        if need <= 0:
            return
        if self._pool.num_free < need:
            await self.store.reclaim(self.tier, need * self.block_nbytes)
        if table.seq_id not in self._open:  # closed while reclaiming
            raise InvalidStateError(f"sequence {table.seq_id} was closed")
        if self._pool.num_free < need:
            raise TierFullError(f"gpu tier: {need} more blocks needed, {self._pool.num_free} free, the rest in use")
        for _ in range(need):
            self._pool.append_block(table.seq_id)

    def adopt(self, table: BlockTable, index: int, key: bytes, parent: bytes | None, tenant: str) -> bool:
        """Block ``index`` of the sequence, now full, becomes the tier's cached copy of ``key`` (no
        copy). False when the tier already has ``key``."""
        self._check(table)
        return self.store.adopt(key, self.tier, table.blocks[index], self.block_nbytes, parent=parent, tenant=tenant)

    def byte_view(self, table: BlockTable, index: int) -> torch.Tensor:
        """Block ``index`` of the sequence as flat bytes (a view)."""
        self._check(table)
        return self._pool.byte_view(table.blocks[index])

    def close(self, table: BlockTable) -> None:
        """The sequence is over: its references go back (blocks the cache adopted stay cached).
        Closing twice is harmless."""
        if table.seq_id in self._open:
            self._open.discard(table.seq_id)
            self._pool.free_sequence(table.seq_id)

    @property
    def open_sequences(self) -> int:
        return len(self._open)

    def _check(self, table: BlockTable) -> None:
        if table.seq_id not in self._open:
            raise InvalidStateError(f"sequence {table.seq_id} is not open")
