"""Mooncake's tensor calls, on ``DistributedStore``'s own: a tensor is an object laid out as
``tensors.py`` says (a header, then its bytes).

- ``put_tensor`` / ``get_tensor`` and their batch, ``pub`` (with a ``ReplicateConfig``), ``upsert``,
  ``_from`` (a registered buffer already holding a packed tensor) and ``_into`` forms;
- tensor parallelism (``*_with_tp``): a put stores every shard, split along ``split_dim`` in
  ``tp_size`` parts, as ``<key>_tp_<rank>``; a get reads one rank's. Each shard records its place in
  the whole, so ``get_tensor_with_parallelism(key, ReadTarget("full"))`` puts the whole together;
- ``*_with_parallelism`` (``parallel_calls.py``): shards named by axes (tp, dp, pp, ep), read as
  stored, as a shard of any split, or whole;
- safetensors files: ``save_tensor_to_safetensor``, ``load_tensor_from_safetensor``.

A missing tensor reads as None (Mooncake's answer); a put that fails answers the negative code.
The layout modules (``tensors``, ``parallel``) need torch and load at the first tensor call: a
client of plain objects runs without torch.
"""

from __future__ import annotations

import logging

import numpy as np

from tiercake.tiers.buffers import is_tensor

from .errors import ErrorCode, InvalidParams, StoreApiError
from .parallel_calls import ParallelCalls
from .types import ReadTarget, ReplicateConfig, TensorParallelism

log = logging.getLogger(__name__)


def tp_key(key: str, rank: int) -> str:
    return f"{key}_tp_{rank}"


class TensorCalls(ParallelCalls):
    # Whole tensors ------------------------------------------------------------------------------

    def put_tensor(self, key: str, tensor) -> int:
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_packed(keys, tensors_list, None, upsert=False)

    def pub_tensor(self, key: str, tensor, config: ReplicateConfig | None = None) -> int:
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def batch_pub_tensor(self, keys: list[str], tensors_list: list, config: ReplicateConfig | None = None) -> list[int]:
        return self._put_packed(keys, tensors_list, config, upsert=False)

    def upsert_tensor(self, key: str, tensor) -> int:
        return self.batch_upsert_tensor([key], [tensor])[0]

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_packed(keys, tensors_list, None, upsert=True)

    def upsert_pub_tensor(self, key: str, tensor, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list, config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._put_packed(keys, tensors_list, config, upsert=True)

    def get_tensor(self, key: str):
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list:
        got = self._gets(keys)
        if isinstance(got, int):
            return [None] * len(keys)
        return [self._tensor_of(key, g) for key, g in zip(keys, got)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Registered buffers that each hold a packed tensor (``tensors.pack``'s layout)."""
        return self._put_packed_buffers(keys, buffer_ptrs, sizes, upsert=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._put_packed_buffers(keys, buffer_ptrs, sizes, upsert=True)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int):
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list:
        """Each tensor read into its registered buffer (header and data); the tensor (a view of the
        buffer), or None."""
        codes = self.batch_get_into(keys, buffer_ptrs, sizes)
        out: list = []
        for key, ptr, code in zip(keys, buffer_ptrs, codes):
            if code < 0:
                out.append(None)
                continue
            out.append(self._tensor_of(key, self._memory(ptr, code)))
        return out

    def get_tensor_into_cuda(self, key: str, tensor) -> int:
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list) -> list[int]:
        """Each stored tensor copied into the tensor beside it (CUDA memory where torch has a GPU;
        any device's tensor works); its size in bytes, or a negative code."""
        if len(keys) != len(tensors_list):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        got = self._gets(keys)
        if isinstance(got, int):
            return [got] * len(keys)
        codes = []
        for key, raw, dst in zip(keys, got, tensors_list):
            tensor = self._tensor_of(key, raw)
            if tensor is None:
                codes.append(_code(raw))
            elif not is_tensor(dst) or dst.numel() != tensor.numel() or dst.dtype != tensor.dtype:
                log.warning(
                    "kvstore: %r is a %s tensor of %d elements; the destination does not match",
                    key,
                    tensor.dtype,
                    tensor.numel(),
                )
                codes.append(int(ErrorCode.INVALID_PARAMS))
            else:
                dst.view(-1).copy_(tensor.reshape(-1))
                codes.append(tensor.numel() * tensor.element_size())
        return codes

    # Tensor parallelism ---------------------------------------------------------------------------

    def put_tensor_with_tp(self, key: str, tensor, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self.batch_put_tensor_with_tp([key], [tensor], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(
        self, base_keys: list[str], tensors_list: list, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> list[int]:
        return self._put_shards(base_keys, tensors_list, None, tp_size, split_dim, upsert=False)

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)[0]

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        return self._put_shards(base_keys, tensors_list, config, tp_size, split_dim, upsert=False)

    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        tensors, codes = self._tensors_in(base_keys, buffer_ptrs, sizes)
        done = self._put_shards(
            [k for k, c in zip(base_keys, codes) if c == 0],
            [t for t, c in zip(tensors, codes) if c == 0],
            None,
            tp_size,
            split_dim,
            upsert=False,
        )
        it = iter(done)
        return [next(it) if c == 0 else c for c in codes]

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0):
        return self.get_tensor(tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1) -> list:
        return self.batch_get_tensor([tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ):
        return self.get_tensor_into(tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: int = 0, tp_size: int = 1
    ) -> list:
        return self.batch_get_tensor_into([tp_key(k, tp_rank) for k in base_keys], buffer_ptrs, sizes)

    # safetensors files ------------------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: str, file_name=None) -> int:
        from safetensors.torch import save_file

        tensor = self.get_tensor(key)
        if tensor is None:
            return int(ErrorCode.OBJECT_NOT_FOUND)
        try:
            save_file({key: tensor.contiguous()}, str(file_name or key))
        except (OSError, ValueError) as exc:
            log.warning("kvstore: saving %r to %s: %s", key, file_name or key, exc)
            return int(ErrorCode.INTERNAL_ERROR)
        return 0

    def load_tensor_from_safetensor(self, key=None, file_name: str = ""):
        """The tensor ``key`` of the file (its first, if it has no such name), stored under ``key``
        (or the file's name); None when the file cannot be read or the put fails."""
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file_name))
        except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises its own error types too
            log.warning("kvstore: cannot read %s: %s", file_name, exc)
            return None
        if not tensors:
            return None
        name = key if key is not None else str(file_name)
        tensor = tensors.get(name)
        if tensor is None:
            tensor = next(iter(tensors.values()))
            log.warning("kvstore: %s holds no tensor %r: its first is taken", file_name, name)
        return tensor if self.upsert_tensor(name, tensor) == 0 else None

    # Plumbing -------------------------------------------------------------------------------------

    def _tensor_of(self, key: str, raw):
        from .tensors import unpack

        if not isinstance(raw, np.ndarray):
            return None
        try:
            header, tensor = unpack(raw)
        except InvalidParams as exc:
            log.warning("kvstore: %r: %s", key, exc)
            return None
        return tensor

    def _put_shards(
        self, keys: list[str], tensors: list, config: ReplicateConfig | None, parts: int, dim: int, *, upsert: bool
    ) -> list[int]:
        from .tensors import split

        if len(keys) != len(tensors):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if config is not None and config.group_ids is not None and len(config.group_ids) != len(keys):
            log.warning("kvstore: group_ids has %d entries for %d tensors", len(config.group_ids), len(keys))
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        names, pieces, places, owner, codes = [], [], [], [], [0] * len(keys)
        for i, (key, tensor) in enumerate(zip(keys, tensors)):
            try:
                for rank, (piece, place) in enumerate(split(tensor, parts, dim)):
                    names.append(tp_key(key, rank))
                    pieces.append(piece)
                    places.append(place)
                    owner.append(i)
            except InvalidParams as exc:
                log.warning("kvstore: %r: %s", key, exc)
                codes[i] = int(ErrorCode.INVALID_PARAMS)
        for i, code in zip(owner, self._put_packed(names, pieces, config, upsert=upsert, parts=places, groups=False)):
            if code and not codes[i]:
                codes[i] = code
        return codes

    def _put_packed_buffers(self, keys, buffer_ptrs, sizes, *, upsert: bool) -> list[int]:
        from .tensors import unpack

        views, codes = self._memories(keys, buffer_ptrs, sizes)
        for i, view in enumerate(views):
            if view is None:
                continue
            try:
                unpack(view)
            except InvalidParams as exc:
                log.warning("kvstore: %r: the buffer holds no packed tensor: %s", keys[i], exc)
                codes[i] = int(ErrorCode.INVALID_PARAMS)
                views[i] = None
        return self._put_views(keys, (views, codes), None, upsert=upsert)


def _code(outcome) -> int:
    return int(outcome.code) if isinstance(outcome, StoreApiError) else int(ErrorCode.OBJECT_NOT_FOUND)


__all__ = ["ReadTarget", "TensorCalls", "TensorParallelism", "tp_key"]
