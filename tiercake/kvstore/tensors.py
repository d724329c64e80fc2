"""How a tensor lies in an object: a fixed 304-byte header (dtype, shape, and for a part of a larger
tensor its place in it and the split that made it), then the tensor's bytes, C-contiguous.

    magic "TCTN" | format u8 | dtype u8 | ndim u8 | kind u8 (0 whole, 1 part) | parts u16 | split_dim i8
    | pad u8 | shape i64 x 8 | (a part) whole shape i64 x 8 | start i64 x 8 | zeros to 304 bytes

The header's size is fixed (Mooncake's tensor objects use the same 304, so a caller sizing a
buffer as ``304 + nbytes`` for ``get_tensor_into`` gets what it expects). A part records where it
lies in the whole and how many parts its split made, so any region of the whole can be cut from
any set of parts that covers it, whatever split made them (``assemble``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidParams

_MAGIC = b"TCTN"
_FORMAT = 2
_HEAD = struct.Struct("<4sBBBBHbx")
MAX_DIMS = 8
_DIMS = struct.Struct(f"<{3 * MAX_DIMS}q")
HEADER_BYTES = 304
WHOLE, PART = 0, 1

DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
_ITEM = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES}


@dataclass(frozen=True, slots=True)
class Part:
    """Where a part lies in its whole tensor, and the split that made it."""

    whole: tuple[int, ...]
    start: tuple[int, ...]
    parts: int
    split_dim: int


@dataclass(frozen=True, slots=True)
class TensorHeader:
    dtype: torch.dtype
    shape: tuple[int, ...]
    part: Part | None = None  # a part of a whole tensor: where it lies in it

    nbytes = HEADER_BYTES  # the header's own size

    @property
    def data_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEM[self.dtype]

    @property
    def start(self) -> tuple[int, ...]:
        """Where these elements start in the whole tensor (at 0 for a whole one)."""
        return self.part.start if self.part is not None else tuple(0 for _ in self.shape)

    def encode(self) -> bytes:
        part = self.part
        pad = [0] * (MAX_DIMS - len(self.shape))
        dims = list(self.shape) + pad
        if part is not None:
            dims += list(part.whole) + pad + list(part.start) + pad
        else:
            dims += [0] * (2 * MAX_DIMS)
        kind, parts, split_dim = (PART, part.parts, part.split_dim) if part is not None else (WHOLE, 0, 0)
        head = _HEAD.pack(_MAGIC, _FORMAT, _CODE[self.dtype], len(self.shape), kind, parts, split_dim)
        return (head + _DIMS.pack(*dims)).ljust(HEADER_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes | np.ndarray) -> TensorHeader:
        if len(raw) < HEADER_BYTES:
            raise InvalidParams("not a tensor object (too short)")
        raw = bytes(raw[: _HEAD.size + _DIMS.size])
        magic, fmt, code, ndim, kind, parts, split_dim = _HEAD.unpack_from(raw)
        if magic != _MAGIC or fmt != _FORMAT or code >= len(DTYPES) or ndim > MAX_DIMS or kind not in (WHOLE, PART):
            raise InvalidParams("not a tensor object")
        dims = _DIMS.unpack_from(raw, _HEAD.size)
        shape = tuple(dims[:ndim])
        if any(d < 0 for d in shape):
            raise InvalidParams("not a tensor object (a negative dimension)")
        if kind == WHOLE:
            return cls(DTYPES[code], shape)
        whole = tuple(dims[MAX_DIMS : MAX_DIMS + ndim])
        start = tuple(dims[2 * MAX_DIMS : 2 * MAX_DIMS + ndim])
        if any(s < 0 or s + n > w for s, n, w in zip(start, shape, whole)) or not 0 <= split_dim < max(ndim, 1):
            raise InvalidParams("not a tensor object (a part that lies outside its whole)")
        return cls(DTYPES[code], shape, Part(whole, start, parts, split_dim))


def header_of(tensor, part: Part | None = None) -> TensorHeader:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidParams(f"a tensor is a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _CODE:
        raise InvalidParams(f"tensors of {tensor.dtype} are not supported")
    if tensor.dim() > MAX_DIMS:
        raise InvalidParams(f"tensors have at most {MAX_DIMS} dimensions")
    return TensorHeader(tensor.dtype, tuple(tensor.shape), part)


def pack(tensor: torch.Tensor, part: Part | None = None) -> np.ndarray:
    """A tensor as an object's bytes (a copy: the header and the contiguous data in one buffer)."""
    header = header_of(tensor, part)
    out = np.empty(header.nbytes + header.data_bytes, dtype=np.uint8)
    pack_into(out, tensor, header)
    return out


def pack_into(out: np.ndarray, tensor: torch.Tensor, header: TensorHeader) -> None:
    """Write ``header`` and ``tensor``'s bytes into ``out`` (exactly their size)."""
    data = tensor.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    out[: header.nbytes] = np.frombuffer(header.encode(), dtype=np.uint8)
    if header.data_bytes:
        out[header.nbytes :] = data.reshape(-1).view(torch.uint8).numpy()


def unpack(raw: np.ndarray) -> tuple[TensorHeader, torch.Tensor]:
    """The tensor an object holds (a view of ``raw``); ``InvalidParams`` when it holds none."""
    header = TensorHeader.decode(raw)
    if raw.size != header.nbytes + header.data_bytes:
        raise InvalidParams(f"a tensor object of {raw.size} bytes, its header says {header.nbytes + header.data_bytes}")
    data = torch.from_numpy(raw[header.nbytes :]) if header.data_bytes else torch.empty(0, dtype=torch.uint8)
    return header, data.view(header.dtype).reshape(header.shape)


def split(tensor: torch.Tensor, parts: int, dim: int) -> list[tuple[torch.Tensor, Part]]:
    """``tensor`` in ``parts`` pieces along ``dim`` (the first ones one longer when it does not divide),
    each with its place in ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidParams(f"a tensor is a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(parts, int) or not 1 <= parts <= 65535:
        raise InvalidParams(f"a tensor is split in 1 to 65535 parts, got {parts!r}")
    if tensor.dim() == 0:
        raise InvalidParams("a 0-dimensional tensor cannot be split")
    if not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
        raise InvalidParams(f"split_dim {dim!r} is not a dimension of a {tensor.dim()}-dimensional tensor")
    dim %= tensor.dim()
    whole = tuple(tensor.shape)
    out = []
    for piece, at in zip(torch.tensor_split(tensor, parts, dim), bounds(whole[dim], parts)):
        start = [0] * tensor.dim()
        start[dim] = at[0]
        out.append((piece, Part(whole, tuple(start), parts, dim)))
    return out


def bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Where each of ``parts`` pieces of ``length`` starts and ends (``torch.tensor_split``'s rule:
    the first ``length % parts`` are one longer)."""
    base, extra = divmod(length, parts)
    out, at = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def assemble(
    header: TensorHeader,
    parts: list[tuple[TensorHeader, torch.Tensor]],
    out: torch.Tensor | None = None,
    start: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The region of the whole tensor (shape ``header.shape``, starting at ``start``: all of it by
    default) put together from ``parts``; ``InvalidParams`` when they do not cover it."""
    start = start or tuple(0 for _ in header.shape)
    target = out if out is not None else torch.empty(header.shape, dtype=header.dtype)
    covered = torch.zeros(header.shape, dtype=torch.bool)
    for part, data in parts:
        pstart = part.start
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
