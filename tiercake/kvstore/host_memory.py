"""Host memory for buffers a caller registers with the store (Mooncake's ``MooncakeHostMemAllocator``,
which SGLang's HiCache uses for its host KV pool): page-aligned anonymous mappings, touched once so
the first transfer into them does not pay for page faults (untouched memory fills at under 1 GB/s)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

log = logging.getLogger(__name__)


class MooncakeHostMemAllocator:
    """``alloc(size)`` an address of ``size`` fresh bytes (0 when it cannot), ``free(address)``
    them again (0, or -1 for an address this allocator did not give)."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            log.error("kvstore: alloc of %r bytes: a size is a positive integer", size)
            return 0
        try:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, OverflowError) as exc:
            log.error("kvstore: alloc of %d bytes: %s", size, exc)
            return 0
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        with self._lock:
            self._maps[address] = region
        return address

    def free(self, address: int) -> int:
        with self._lock:
            region = self._maps.pop(address, None)
        if region is None:
            log.error("kvstore: free of %r: not an address this allocator gave", address)
            return -1
        try:
            region.close()
        except BufferError:  # something still exports a view of it (a tensor over it): keep it mapped
            with self._lock:
                self._maps[address] = region
            log.error("kvstore: free of %#x: the memory is still in use", address)
            return -1
        return 0


def bind_to_numa_node(node: int) -> None:
    """Mooncake's NUMA binding of the calling thread. tiercake leaves placement to the OS: a check
    of the argument, then nothing."""
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"a NUMA node is a non-negative integer, got {node!r}")
