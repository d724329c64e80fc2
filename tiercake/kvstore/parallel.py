"""Tensors stored in shards (Mooncake's unified ``*_with_parallelism`` calls): what a shard is
called, what a write stores, and which shards a read needs.

A shard's identity is a list of axes: ``tp`` (a tensor-parallel slice along ``split_dim``), and
``dp``, ``pp`` and ``ep``, which only scope it (a data-parallel replica, a pipeline stage, an
expert) and do not change its bytes. The axes are validated once (``layout_of``), put in one order
(``dp, pp, ep, tp``, so the order a caller lists them in does not matter) and named:

    no axes                   -> <key>
    tp only                   -> <key>_tp_<rank>          (the names of the ``*_with_tp`` calls)
    scope axes (and tp)       -> <key>__dp_1of2__pp_0of2_sid7[__tp_<rank>]

A tp shard's name leaves out the tp size, so a reader that asks for another split (4 written, 2
read) still finds the stored shards: each one's header (``tensors.Part``) says the whole tensor's
shape, where the shard starts in it and how many shards its split made, and a read cuts what it
wants from the shards that overlap it (``ShardRead``). Reads run in rounds over a whole batch:
the shard of the reader's own rank first (the common case: the split matches and one round is
all), then the shards its layout says overlap.

What a write takes:

- tp only: the shard itself (the caller split the tensor), as Mooncake's plain-tp calls do;
- tp with scope axes, or a ``writer_partition`` (rank, size, split_dim): the full tensor, from
  which the write cuts its rank's shard; the split must be uniform (the dimension divisible by
  the size), or the write is refused;
- scope axes only: the tensor, whole, under the scoped name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidParams
from .tensors import Part, TensorHeader, assemble, bounds, unpack

_ORDER = {"dp": 0, "pp": 1, "ep": 2, "tp": 3}
MAX_AXES = 4


@dataclass(frozen=True, slots=True)
class Axis:
    kind: str
    rank: int
    size: int
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None

    @property
    def dim(self) -> int:
        """A tp axis's split dimension (``axis_of`` and ``writer_layout`` give every tp axis one)."""
        if self.split_dim is None:
            raise InvalidParams(f"a {self.kind} axis has no split_dim")
        return self.split_dim

    def suffix(self) -> str:
        out = f"{self.kind}_{self.rank}of{self.size}"
        if self.expert_id is not None:
            out += f"_eid{self.expert_id}"
        if self.stage_id is not None:
            out += f"_sid{self.stage_id}"
        return out


@dataclass(frozen=True, slots=True)
class Layout:
    """A validated shard identity: the scope axes (canonical order) and the tp axis, if any."""

    scope: tuple[Axis, ...] = ()
    tp: Axis | None = None

    def name(self, key: str, rank: int | None = None) -> str:
        """The object holding this layout's shard (of tp rank ``rank``: this one's by default)."""
        if self.tp is None:
            return key + "".join("__" + a.suffix() for a in self.scope)
        rank = self.tp.rank if rank is None else rank
        if not self.scope:
            return f"{key}_tp_{rank}"
        return key + "".join("__" + a.suffix() for a in self.scope) + f"__tp_{rank}"


def _optional_int(value, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidParams(f"{what} is an integer, got {value!r}")
    return int(value)


def axis_of(raw) -> Axis:
    kind = getattr(raw, "kind", None)
    if kind not in _ORDER:
        raise InvalidParams(f"an axis kind is one of {sorted(_ORDER)}, got {kind!r}")
    rank, size = _int(getattr(raw, "rank", None), "rank"), _int(getattr(raw, "size", None), "size")
    if not 0 <= rank < size:
        raise InvalidParams(f"a {kind} axis has 0 <= rank < size, got rank {rank} of {size}")
    split_dim = _optional_int(getattr(raw, "split_dim", None), "split_dim")
    expert_id = _optional_int(getattr(raw, "expert_id", None), "expert_id")
    stage_id = _optional_int(getattr(raw, "stage_id", None), "stage_id")
    if (kind == "tp") != (split_dim is not None):
        raise InvalidParams("a tp axis needs a split_dim" if kind == "tp" else f"a {kind} axis takes no split_dim")
    if kind == "ep" and expert_id is None:
        raise InvalidParams("an ep axis needs an expert_id")
    if kind == "pp" and stage_id is None:
        raise InvalidParams("a pp axis needs a stage_id")
    if kind != "ep" and expert_id is not None or kind != "pp" and stage_id is not None:
        raise InvalidParams(f"a {kind} axis takes no expert_id or stage_id")
    return Axis(kind, rank, size, split_dim, expert_id, stage_id)


def layout_of(parallelism) -> Layout:
    """A ``TensorParallelism`` (or None) checked and put in canonical order; ``InvalidParams`` for
    a bad one."""
    axes = list(getattr(parallelism, "axes", None) or []) if parallelism is not None else []
    if len(axes) > MAX_AXES:
        raise InvalidParams(f"at most {MAX_AXES} axes, got {len(axes)}")
    checked = sorted((axis_of(a) for a in axes), key=lambda a: _ORDER[a.kind])
    kinds = [a.kind for a in checked]
    if len(set(kinds)) != len(kinds):
        raise InvalidParams(f"each axis kind appears once, got {kinds}")
    tp = checked[-1] if checked and checked[-1].kind == "tp" else None
    return Layout(tuple(a for a in checked if a.kind != "tp"), tp)


def writer_layout(partition) -> Layout:
    """A writer partition (any object with rank, size and split_dim) as a tp-only layout."""
    rank, size = _int(getattr(partition, "rank", None), "rank"), _int(getattr(partition, "size", None), "size")
    split_dim = _int(getattr(partition, "split_dim", None), "split_dim")
    if not 0 <= rank < size:
        raise InvalidParams(f"a writer partition has 0 <= rank < size, got rank {rank} of {size}")
    return Layout((), Axis("tp", rank, size, split_dim))


def _dim(split_dim: int, ndim: int) -> int:
    if ndim == 0 or not -ndim <= split_dim < ndim:
        raise InvalidParams(f"split_dim {split_dim} is not a dimension of a {ndim}-dimensional tensor")
    return split_dim % ndim


def shard_to_write(tensor: torch.Tensor, layout: Layout, *, full: bool) -> tuple[torch.Tensor, Part | None]:
    """What a write of ``tensor`` under ``layout`` stores: the tensor and, for a tp shard, its
    place in the whole. ``full``: the caller gave the whole tensor (cut this rank's shard from it);
    otherwise it gave the shard."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidParams(f"a tensor is a torch.Tensor, got {type(tensor).__name__}")
    tp = layout.tp
    if tp is None:
        return tensor, None
    dim = _dim(tp.dim, tensor.dim())
    if full:
        length = tensor.shape[dim]
        if length % tp.size:
            raise InvalidParams(f"dimension {dim} ({length}) does not split evenly in {tp.size}")
        step = length // tp.size
        whole = tuple(tensor.shape)
        shard = tensor.narrow(dim, tp.rank * step, step)
    else:
        step = tensor.shape[dim]
        whole = tuple(n * tp.size if i == dim else n for i, n in enumerate(tensor.shape))
        shard = tensor
    start = tuple(tp.rank * step if i == dim else 0 for i in range(tensor.dim()))
    return shard, Part(whole, start, tp.size, dim)


# Reads ---------------------------------------------------------------------------------------------

MODES = ("as_stored", "shard", "full")


@dataclass(frozen=True, slots=True)
class Region:
    """A box of the whole tensor: where it starts and its shape."""

    start: tuple[int, ...]
    shape: tuple[int, ...]


class ShardRead:
    """One key's read, in rounds: ``wants()`` names the objects it needs next (none: finished),
    ``feed`` hands it what they held, ``result`` is the tensor (None: nothing to answer)."""

    def __init__(self, key: str, target) -> None:
        self.result: torch.Tensor | None = None
        self.done = False
        self._got: dict[str, tuple[TensorHeader, torch.Tensor]] = {}
        self._asked: set[str] = set()
        mode = getattr(target, "mode", "as_stored") if target is not None else "as_stored"
        if mode not in MODES:
            raise InvalidParams(f"a read target's mode is one of {MODES}, got {mode!r}")
        self.key, self.mode = key, mode
        self.layout = layout_of(getattr(target, "parallelism", None) if target is not None else None)
        if mode == "shard" and not (self.layout.scope or self.layout.tp):
            raise InvalidParams("a shard read names its shard's axes")
        self._next = self._first()

    # the rounds ---------------------------------------------------------------------------------

    @property
    def _shards(self) -> Layout:
        """The layout whose tp shards this read looks for (a full read without a tp axis looks for
        shards of any split, starting from rank 0)."""
        lay = self.layout
        return lay if lay.tp is not None else Layout(lay.scope, Axis("tp", 0, 1, 0))

    def _direct(self) -> bool:
        """The read is of one object, as stored."""
        return self.mode == "as_stored" or self.mode == "shard" and self.layout.tp is None

    def _first(self) -> list[str]:
        if self._direct():
            return [self.layout.name(self.key)]
        if self.mode == "shard":
            return [self.layout.name(self.key)]  # this rank's shard: all there is when the split matches
        # full: learn the stored split from shard 0; a tensor stored whole under the name as a fallback
        return [self._shards.name(self.key, 0)] + ([self.layout.name(self.key)] if self.layout.tp is None else [])

    def wants(self) -> list[str]:
        return [] if self.done else self._next

    def feed(self, found: dict[str, tuple[TensorHeader, torch.Tensor] | None]) -> None:
        for name in self._next:
            self._asked.add(name)
            got = found.get(name)
            if got is not None:
                self._got[name] = got
        self._next = []
        self._step()

    def _step(self) -> None:
        first = self._first()
        if self._direct():
            return self._finish(self._tensor(first[0]))
        shards = self._shards
        # any stored shard: its header and where it lies
        known, split = next(((h, h.part) for h, _ in self._got.values() if h.part is not None), (None, None))
        if known is None or split is None:
            zero = shards.name(self.key, 0)
            if self.mode == "shard" and zero not in self._asked:
                self._next = [zero]  # this rank's shard is missing: learn the split from shard 0
                return None
            if self.mode == "full" and len(first) > 1:
                return self._finish(self._tensor(first[1]))  # not sharded: the tensor as stored, if any
            return self._finish(None)
        region = self._region(split)
        if region is None:
            return self._finish(None)
        if self.mode == "shard" and known.shape == region.shape and split.start == region.start:
            mine = self._got.get(shards.name(self.key))
            if mine is not None and mine[0] == known:
                return self._finish(mine[1])  # the stored split is the one asked for
        need = [shards.name(self.key, r) for r in overlapping(split, region)]
        missing = [n for n in need if n not in self._asked]
        if missing:
            self._next = missing
            return None
        parts = [self._got[n] for n in need if n in self._got]
        if len(parts) < len(need) or any(not _same_split(h, known) for h, _ in parts):
            return self._finish(None)  # a shard is missing, or was written by another split
        try:
            return self._finish(assemble(TensorHeader(known.dtype, region.shape), parts, start=region.start))
        except InvalidParams:
            return self._finish(None)

    def _region(self, split: Part) -> Region | None:
        whole = split.whole
        if self.mode == "full":
            return Region(tuple(0 for _ in whole), whole)
        tp = self.layout.tp
        if tp is None:  # a read without a tp axis is direct or full
            return None
        if not -len(whole) <= tp.dim < len(whole) or whole[tp.dim % len(whole)] % tp.size:
            return None  # the asked-for split is not uniform on this tensor
        dim = tp.dim % len(whole)
        step = whole[dim] // tp.size
        start = tuple(tp.rank * step if i == dim else 0 for i in range(len(whole)))
        return Region(start, tuple(step if i == dim else n for i, n in enumerate(whole)))

    def _tensor(self, name: str) -> torch.Tensor | None:
        got = self._got.get(name)
        return None if got is None else got[1]

    def _finish(self, tensor: torch.Tensor | None) -> None:
        self.result, self.done, self._next = tensor, True, []


def overlapping(split: Part, region: Region) -> list[int]:
    """The ranks of the stored split (``split`` is one of its shards) that overlap ``region``."""
    dim = split.split_dim
    lo, hi = region.start[dim], region.start[dim] + region.shape[dim]
    return [r for r, (a, b) in enumerate(bounds(split.whole[dim], split.parts)) if a < hi and lo < b]


def _same_split(header: TensorHeader, known: TensorHeader) -> bool:
    mine, theirs = header.part, known.part
    return (
        mine is not None
        and theirs is not None
        and (mine.whole, mine.parts, mine.split_dim) == (theirs.whole, theirs.parts, theirs.split_dim)
        and header.dtype == known.dtype
    )


def decode(raw) -> tuple[TensorHeader, torch.Tensor] | None:
    if not isinstance(raw, np.ndarray):
        return None
    try:
        return unpack(raw)
    except InvalidParams:
        return None


def nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()
