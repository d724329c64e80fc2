"""Byte views over payloads, without copies: every tier moves ``torch.uint8`` 1-D tensors."""

from __future__ import annotations

import asyncio
import mmap
import warnings
from typing import Any

import numpy as np
import torch

from .errors import PayloadError

PAGE = 4096

Payload = torch.Tensor | np.ndarray | bytes | bytearray | memoryview


def as_bytes(payload: Any) -> torch.Tensor:
    """A flat uint8 tensor sharing memory with ``payload`` (tensor, ndarray or buffer)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous():
            return payload  # already flat bytes: the hot path of every transfer
        if not payload.is_contiguous():
            raise PayloadError("payload tensor must be contiguous")
        flat = payload.reshape(-1)
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise PayloadError("payload array must be C-contiguous")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only arrays are only copied from
            return torch.from_numpy(payload.reshape(-1).view(np.uint8))
    if isinstance(payload, bytes | bytearray | memoryview | mmap.mmap):
        view = memoryview(payload)
        if view.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # a read-only source (bytes) is only ever copied from, never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)
    raise PayloadError(f"unsupported payload type {type(payload).__name__}: use a tensor, ndarray or buffer")


def host_bytes(payload: Any) -> np.ndarray:
    """The payload's bytes as a flat host numpy array: a view of host memory, a copy of device memory
    (to hash, checksum or hand to a socket)."""
    flat = as_bytes(payload)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


INLINE_COPY_MAX = 4 << 20


async def copy_async(dst: torch.Tensor, src: torch.Tensor, inline_max: int = INLINE_COPY_MAX) -> None:
    """``dst.copy_(src)``, in a thread when it is large: a multi-millisecond memcpy must not stall
    the event loop, and a small one is cheaper than the thread hand-off."""
    if src.numel() <= inline_max:
        dst.copy_(src)
    else:
        await asyncio.to_thread(dst.copy_, src)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned, pre-faulted anonymous memory (for O_DIRECT and staging), rounded up to a page."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mem)
    np.frombuffer(view, dtype=np.uint8)[:] = 0  # touch every page once, here, not on the hot path
    return mem, view


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align
