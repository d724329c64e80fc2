"""How a tensor lies in an object: a small header (dtype, shape, and for a part of a larger tensor its
place in it), then the tensor's bytes, C-contiguous.

    magic "TCTN" | format u8 | dtype u8 | ndim u8 | kind u8 (0 whole, 1 part) | shape i64 x ndim
    | (a part) the whole tensor's shape i64 x ndim, this part's start in it i64 x ndim | padding to 16

A part records where it lies in the whole, so the whole can be put together from any set of parts
that covers it, whatever split made them (``assemble``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidParams

_MAGIC = b"TCTN"
_FORMAT = 1
_HEAD = struct.Struct("<4sBBBB")
WHOLE, PART = 0, 1
MAX_DIMS = 16

DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


@dataclass(frozen=True, slots=True)
class TensorHeader:
    dtype: torch.dtype
    shape: tuple[int, ...]
    whole: tuple[int, ...] | None = None  # a part: the whole tensor's shape
    start: tuple[int, ...] | None = None  # and where this part starts in it

    @property
    def nbytes(self) -> int:
        """The header's own size."""
        dims = len(self.shape) * (3 if self.whole is not None else 1)
        return -(-(_HEAD.size + 8 * dims) // 16) * 16

    @property
    def data_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()

    def encode(self) -> bytes:
        kind = WHOLE if self.whole is None else PART
        head = _HEAD.pack(_MAGIC, _FORMAT, _CODE[self.dtype], len(self.shape), kind)
        dims = list(self.shape) + (list(self.whole) + list(self.start) if kind == PART else [])
        return (head + struct.pack(f"<{len(dims)}q", *dims)).ljust(self.nbytes, b"\0")

    @classmethod
    def decode(cls, raw: bytes | np.ndarray) -> TensorHeader:
        raw = bytes(raw[: _HEAD.size + 8 * 3 * MAX_DIMS]) if not isinstance(raw, bytes) else raw
        if len(raw) < _HEAD.size:
            raise InvalidParams("not a tensor object (too short)")
        magic, fmt, code, ndim, kind = _HEAD.unpack_from(raw)
        if magic != _MAGIC or fmt != _FORMAT or code >= len(DTYPES) or ndim > MAX_DIMS or kind not in (WHOLE, PART):
            raise InvalidParams("not a tensor object")
        count = ndim * (3 if kind == PART else 1)
        if len(raw) < _HEAD.size + 8 * count:
            raise InvalidParams("not a tensor object (truncated header)")
        dims = struct.unpack_from(f"<{count}q", raw, _HEAD.size)
        if any(d < 0 for d in dims):
            raise InvalidParams("not a tensor object (a negative dimension)")
        shape = tuple(dims[:ndim])
        if kind == WHOLE:
            return cls(DTYPES[code], shape)
        return cls(DTYPES[code], shape, tuple(dims[ndim : 2 * ndim]), tuple(dims[2 * ndim :]))


def header_of(tensor, whole: tuple[int, ...] | None = None, start: tuple[int, ...] | None = None) -> TensorHeader:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidParams(f"a tensor is a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _CODE:
        raise InvalidParams(f"tensors of {tensor.dtype} are not supported")
    if tensor.dim() > MAX_DIMS:
        raise InvalidParams(f"tensors have at most {MAX_DIMS} dimensions")
    return TensorHeader(tensor.dtype, tuple(tensor.shape), whole, start)


def pack(tensor: torch.Tensor, whole: tuple[int, ...] | None = None, start: tuple[int, ...] | None = None) -> np.ndarray:
    """A tensor as an object's bytes (a copy: the header and the contiguous data in one buffer)."""
    header = header_of(tensor, whole, start)
    data = tensor.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    out = np.empty(header.nbytes + header.data_bytes, dtype=np.uint8)
    out[: header.nbytes] = np.frombuffer(header.encode(), dtype=np.uint8)
    if header.data_bytes:
        out[header.nbytes :] = data.reshape(-1).view(torch.uint8).numpy()
    return out


def unpack(raw: np.ndarray) -> tuple[TensorHeader, torch.Tensor]:
    """The tensor an object holds (a view of ``raw``); ``InvalidParams`` when it holds none."""
    header = TensorHeader.decode(raw)
    if raw.size != header.nbytes + header.data_bytes:
        raise InvalidParams(f"a tensor object of {raw.size} bytes, its header says {header.nbytes + header.data_bytes}")
    data = torch.from_numpy(raw[header.nbytes :]) if header.data_bytes else torch.empty(0, dtype=torch.uint8)
    return header, data.view(header.dtype).reshape(header.shape)


def split(tensor: torch.Tensor, parts: int, dim: int) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``tensor`` in ``parts`` pieces along ``dim`` (the first ones one longer when it does not divide),
    each with where it starts in ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidParams(f"a tensor is a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(parts, int) or parts < 1:
        raise InvalidParams(f"a tensor is split in at least one part, got {parts!r}")
    if not isinstance(dim, int) or not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise InvalidParams(f"split_dim {dim!r} is not a dimension of a {tensor.dim()}-dimensional tensor")
    dim = dim % max(tensor.dim(), 1)
    if tensor.dim() == 0:
        raise InvalidParams("a 0-dimensional tensor cannot be split")
    out, at = [], 0
    for piece in torch.tensor_split(tensor, parts, dim):
        start = [0] * tensor.dim()
        start[dim] = at
        out.append((piece, tuple(start)))
        at += piece.shape[dim]
    return out


def assemble(header: TensorHeader, parts: list[tuple[TensorHeader, torch.Tensor]], out: torch.Tensor | None = None,
             start: tuple[int, ...] | None = None) -> torch.Tensor:
    """The region of the whole tensor (shape ``header.shape``, starting at ``start``: all of it by
    default) put together from ``parts``; ``InvalidParams`` when they do not cover it."""
    start = start or tuple(0 for _ in header.shape)
    target = out if out is not None else torch.empty(header.shape, dtype=header.dtype)
    covered = torch.zeros(header.shape, dtype=torch.bool)
    for part, data in parts:
        pstart = part.start or tuple(0 for _ in part.shape)
        lo = [max(s, ps) for s, ps in zip(start, pstart)]
        hi = [min(s + n, ps + pn) for s, n, ps, pn in zip(start, header.shape, pstart, part.shape)]
        if any(a >= b for a, b in zip(lo, hi)) and header.shape:
            continue
        dst = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        src = tuple(slice(a - ps, b - ps) for a, b, ps in zip(lo, hi, pstart))
        target[dst] = data[src]
        covered[dst] = True
    if covered.numel() and not bool(covered.all()):
        raise InvalidParams("the stored parts do not cover the tensor asked for")
    return target
