"""Mooncake's unified parallel tensor calls (``*_with_parallelism``), on ``TensorCalls``: a write
stores one shard (``parallel.shard_to_write``), a read gathers what its ``ReadTarget`` asks for
(``parallel.ShardRead``), a batch in as few rounds as its reads need.

Signatures are Mooncake's: ``parallelism`` a ``TensorParallelism``, ``writer_partition`` any
object with ``rank``, ``size`` and ``split_dim`` (never both), ``config`` a ``ReplicateConfig``.
A write that is refused answers a negative code (a bad axis, a split that is not uniform, a
parallelism and a writer partition at once); a read with nothing to answer gives None.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ErrorCode, InvalidParams
from .types import ReplicateConfig

if TYPE_CHECKING:  # the layout modules need torch: they load at the first tensor call
    import torch

    from .parallel import Layout, ShardRead

log = logging.getLogger(__name__)
MAX_ROUNDS = 4  # a read needs at most three (its shard, shard 0, the overlapping ones)


class ParallelCalls:
    if TYPE_CHECKING:  # what the calls stand on, given by the store below them (``sync.DistributedStore``:
        # registered memory, puts and gets)

        def _memory(self, ptr: int, size: int) -> np.ndarray: ...

        def _memories(
            self, keys: list[str], ptrs: list[int], sizes: list[int]
        ) -> tuple[list[np.ndarray | None], list[int]]: ...

        def _gets(self, keys: list[str], buffers: list | None = None, sizes: bool = False) -> Any: ...

        def _put_views(
            self, keys: list[str], memories, config: ReplicateConfig | None, *, upsert: bool, groups: bool = True
        ) -> list[int]: ...

        def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...

    # Writes -------------------------------------------------------------------------------------

    def put_tensor_with_parallelism(
        self, key: str, tensor, parallelism=None, config: ReplicateConfig | None = None, writer_partition=None
    ) -> int:
        return self._write_parallel([key], [tensor], [parallelism], config, [writer_partition], upsert=False)[0]

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms=None,
        config: ReplicateConfig | None = None,
        writer_partitions=None,
    ) -> list[int]:
        return self._write_parallel(keys, tensors_list, parallelisms, config, writer_partitions, upsert=False)

    def upsert_tensor_with_parallelism(
        self, key: str, tensor, parallelism=None, config: ReplicateConfig | None = None, writer_partition=None
    ) -> int:
        return self._write_parallel([key], [tensor], [parallelism], config, [writer_partition], upsert=True)[0]

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms=None,
        config: ReplicateConfig | None = None,
        writer_partitions=None,
    ) -> list[int]:
        return self._write_parallel(keys, tensors_list, parallelisms, config, writer_partitions, upsert=True)

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism=None,
        config: ReplicateConfig | None = None,
        writer_partition=None,
    ) -> int:
        return self._write_parallel_from(
            [key], [buffer_ptr], [size], [parallelism], config, [writer_partition], upsert=False
        )[0]

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms=None,
        config: ReplicateConfig | None = None,
        writer_partitions=None,
    ) -> list[int]:
        return self._write_parallel_from(
            keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, upsert=False
        )

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism=None,
        config: ReplicateConfig | None = None,
        writer_partition=None,
    ) -> int:
        return self._write_parallel_from(
            [key], [buffer_ptr], [size], [parallelism], config, [writer_partition], upsert=True
        )[0]

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms=None,
        config: ReplicateConfig | None = None,
        writer_partitions=None,
    ) -> list[int]:
        return self._write_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, upsert=True)

    # Reads --------------------------------------------------------------------------------------

    def get_tensor_with_parallelism(self, key: str, target=None):
        return self.batch_get_tensor_with_parallelism([key], [target])[0]

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets=None) -> list:
        return self._read_parallel(keys, targets)

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int, target=None):
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size], [target])[0]

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets=None
    ) -> list:
        """Each tensor asked for, written (header and data) into its registered buffer: the tensor
        (a view of the buffer), or None (nothing found, or the buffer is too small)."""
        views, codes = self._memories(keys, buffer_ptrs, sizes)
        tensors = self._read_parallel(keys, targets)
        out = []
        for key, view, code, tensor in zip(keys, views, codes, tensors):
            out.append(None if code or tensor is None or view is None else _into(key, view, tensor))
        return out

    # Plumbing -----------------------------------------------------------------------------------

    def _put_packed(
        self,
        keys: list[str],
        tensors: list,
        config: ReplicateConfig | None,
        *,
        upsert: bool,
        parts: list | None = None,
        groups: bool = True,
    ) -> list[int]:
        from .tensors import pack

        if len(keys) != len(tensors):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        packed: list[np.ndarray | None] = []
        codes: list[int] = []
        for i, tensor in enumerate(tensors):
            try:
                packed.append(pack(tensor, parts[i] if parts is not None else None))
                codes.append(0)
            except (InvalidParams, RuntimeError, TypeError) as exc:
                log.warning("kvstore: %r: %s", keys[i], exc)
                packed.append(None)
                codes.append(int(ErrorCode.INVALID_PARAMS))
        views = ([p for p in packed], codes)
        return self._put_views(keys, views, config, upsert=upsert, groups=groups)

    def _tensors_in(self, keys, buffer_ptrs, sizes) -> tuple[list, list[int]]:
        from .tensors import unpack

        views, codes = self._memories(keys, buffer_ptrs, sizes)
        tensors = []
        for i, view in enumerate(views):
            tensor = None
            if view is not None:
                try:
                    tensor = unpack(view)[1]
                except InvalidParams as exc:
                    log.warning("kvstore: %r: the buffer holds no packed tensor: %s", keys[i], exc)
                    codes[i] = int(ErrorCode.INVALID_PARAMS)
            tensors.append(tensor)
        return tensors, codes

    def _write_parallel(
        self, keys, tensors, parallelisms, config, partitions, *, upsert: bool, codes: list[int] | None = None
    ) -> list[int]:
        count = len(keys) if isinstance(keys, (list, tuple)) else 0
        parallelisms = [None] * count if parallelisms is None else list(parallelisms)
        partitions = [None] * count if partitions is None else list(partitions)
        codes = list(codes) if codes is not None else [0] * count
        if not count or not len(tensors) == len(parallelisms) == len(partitions) == count:
            log.warning(
                "kvstore: %d keys, %d tensors, %d parallelisms, %d writer partitions",
                count,
                len(tensors),
                len(parallelisms),
                len(partitions),
            )
            return [int(ErrorCode.INVALID_PARAMS)] * max(count, 1)
        if config is not None and config.group_ids is not None and len(config.group_ids) != count:
            log.warning("kvstore: group_ids has %d entries for %d tensors", len(config.group_ids), count)
            return [int(ErrorCode.INVALID_PARAMS)] * count
        from .parallel import shard_to_write

        names, shards, places, owners = [], [], [], []
        for i, (key, tensor) in enumerate(zip(keys, tensors)):
            if codes[i]:
                continue
            try:
                layout, full = _write_layout(parallelisms[i], partitions[i])
                shard, place = shard_to_write(tensor, layout, full=full)
            except InvalidParams as exc:
                log.warning("kvstore: %r: %s", key, exc)
                codes[i] = int(ErrorCode.INVALID_PARAMS)
                continue
            names.append(layout.name(key))
            shards.append(shard)
            places.append(place)
            owners.append(i)
        if names:
            for i, code in zip(
                owners, self._put_packed(names, shards, config, upsert=upsert, parts=places, groups=False)
            ):
                codes[i] = code
        return codes

    def _write_parallel_from(
        self, keys, buffer_ptrs, sizes, parallelisms, config, partitions, *, upsert: bool
    ) -> list[int]:
        tensors, codes = self._tensors_in(keys, buffer_ptrs, sizes)
        return self._write_parallel(keys, tensors, parallelisms, config, partitions, upsert=upsert, codes=codes)

    def _read_parallel(self, keys, targets) -> list:
        from .parallel import ShardRead, decode

        count = len(keys) if isinstance(keys, (list, tuple)) else 0
        targets = [None] * count if targets is None else list(targets)
        if len(targets) != count:
            log.warning("kvstore: %d keys and %d read targets", count, len(targets))
            return [None] * count
        reads: list[ShardRead | None] = []
        for key, target in zip(keys, targets):
            try:
                reads.append(ShardRead(key, target))
            except InvalidParams as exc:
                log.warning("kvstore: %r: %s", key, exc)
                reads.append(None)
        live = [r for r in reads if r is not None]
        for _ in range(MAX_ROUNDS):
            names = list(dict.fromkeys(n for r in live for n in r.wants()))
            if not names:
                break
            got = self._gets(names)
            found = {n: decode(g) for n, g in zip(names, got)} if not isinstance(got, int) else {}
            for read in live:
                if read.wants():
                    read.feed(found)
        return [r.result if r is not None and r.done else None for r in reads]


def _write_layout(parallelism, partition) -> tuple[Layout, bool]:
    """The layout a write stores under, and whether its tensor is the whole one (cut the shard)."""
    from .parallel import layout_of, writer_layout

    if partition is not None:
        if parallelism is not None and getattr(parallelism, "axes", None):
            raise InvalidParams("a write takes a parallelism or a writer partition, not both")
        return writer_layout(partition), True
    layout = layout_of(parallelism)
    return layout, layout.tp is not None and bool(layout.scope)


def _into(key: str, view: np.ndarray, tensor: torch.Tensor) -> torch.Tensor | None:
    import torch

    from .tensors import TensorHeader, pack_into

    header = TensorHeader(tensor.dtype, tuple(tensor.shape))
    size = header.nbytes + header.data_bytes
    if size > view.size:
        log.warning("kvstore: %r: %d bytes do not fit a buffer of %d", key, size, view.size)
        return None
    pack_into(view[:size], tensor, header)
    data = torch.from_numpy(view[header.nbytes : size])
    return data.view(header.dtype).reshape(header.shape) if header.data_bytes else tensor.new_empty(tensor.shape)
