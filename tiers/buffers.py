"""Byte views over payloads, without copies: the one place that knows what a block's bytes can be.

Host memory is a flat ``numpy.uint8`` array everywhere below the engines (the pool, the SSD tier,
the sockets), so the conductor, the node agent and the key-value store's clients run without torch.
Device memory (a gpu tier on CUDA, a buffer an engine hands in) is a flat ``torch.uint8`` tensor;
torch is touched only when such a tensor is given, and it is then imported already. A CPU tensor
given as a payload is seen as the numpy array over its memory (no copy)."""

from __future__ import annotations

import asyncio
import mmap
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import PayloadError

if TYPE_CHECKING:
    import torch

PAGE = 4096

# a flat uint8 view: host memory as numpy, device memory as a torch tensor
Bytes = np.ndarray  # | torch.Tensor (on a device)
Payload = Any  # np.ndarray | torch.Tensor | bytes | bytearray | memoryview


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (False, and no import, where torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_bytes(payload: Any) -> Any:
    """A flat uint8 view sharing memory with ``payload``: a numpy array for host memory (an ndarray, a
    buffer, a CPU tensor), a torch tensor for device memory."""
    if isinstance(payload, np.ndarray):
        if payload.dtype == np.uint8 and payload.ndim == 1:
            return payload  # already flat bytes: the hot path of every transfer
        if not payload.flags.c_contiguous:
            raise PayloadError("payload array must be C-contiguous")
        return payload.reshape(-1).view(np.uint8)
    if isinstance(payload, bytes | bytearray | memoryview | mmap.mmap):
        return np.frombuffer(payload, dtype=np.uint8)  # read-only for bytes: only ever copied from
    if is_tensor(payload):
        return _tensor_bytes(payload)
    raise PayloadError(f"unsupported payload type {type(payload).__name__}: use an ndarray, a tensor or a buffer")


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise PayloadError("payload tensor must be contiguous")
    flat = tensor.reshape(-1)
    flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def size_of(view: Any) -> int:
    """The length in bytes of a flat view (``as_bytes``'s result)."""
    return view.size if isinstance(view, np.ndarray) else view.numel()


def on_host(view: Any) -> bool:
    return isinstance(view, np.ndarray)


def host_bytes(payload: Any) -> np.ndarray:
    """The payload's bytes as a flat host array: a view of host memory, a copy of device memory (to
    hash, checksum or hand to a socket)."""
    flat = as_bytes(payload)
    return flat if isinstance(flat, np.ndarray) else flat.cpu().numpy()


def empty(n: int) -> np.ndarray:
    """``n`` bytes of host memory (not cleared)."""
    return np.empty(n, dtype=np.uint8)


def device_staging(n: int) -> np.ndarray:
    """Host memory that bytes bound for (or coming from) a device pass through: pinned where torch has
    a GPU (a copy from it is asynchronous and twice as fast), plain otherwise. The array keeps the
    memory it views alive."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return empty(n)


def copy_into(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for flat views of equal length: numpy between host arrays, torch where either
    side is on a device."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
        return
    import torch

    target = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    target.copy_(torch.from_numpy(src) if isinstance(src, np.ndarray) else src)


INLINE_COPY_MAX = 4 << 20


async def copy_async(dst: Any, src: Any, inline_max: int = INLINE_COPY_MAX) -> None:
    """``copy_into``, in a thread when it is large: a multi-millisecond memcpy must not stall the
    event loop, and a small one is cheaper than the thread hand-off."""
    if size_of(src) <= inline_max:
        copy_into(dst, src)
    else:
        await asyncio.to_thread(copy_into, dst, src)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned, pre-faulted anonymous memory (for O_DIRECT and staging), rounded up to a page."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mem)
    np.frombuffer(view, dtype=np.uint8)[:] = 0  # touch every page once, here, not on the hot path
    return mem, view


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align
