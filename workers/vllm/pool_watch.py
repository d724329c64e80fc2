"""Design note: the connector's copy of its node's pool index, kept fresh off vLLM's threads.

vLLM's scheduler asks "how much of this prompt does my node hold?" on every request. The node agent's
pool keeps an index in the shared region, so a process on the same host can read it in place
(``PoolIndexReader``) and answer in microseconds. ``PoolWatch`` rereads it on a timer and knows why
it cannot when it cannot: the pool is on another host, the node is not reachable yet, or a restarted
node agent has a new region. It never gives up (a node agent that comes up after vLLM is found a
second later), and its reads cost at most about 5% of a core, counted in CPU time: vLLM's busy
threads stretch the wall clock, and pacing by wall time would make the index stale exactly when the
machine is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tiercake.tiers.pool import PoolIndexReader, PoolRegion

log = logging.getLogger(__name__)

UNMAPPED_RETRY_S = 1.0  # how soon to look again for a pool that cannot be mapped here
CPU_SHARE = 0.05  # of one core, at most, spent rereading the index


class PoolWatch:
    """``node``'s pool index, reread every ``every`` seconds through ``region_of`` (the node's region
    mapped here, or None when it cannot be). ``index`` is None until the first read and whenever the
    pool cannot be read; ``state`` says why."""

    def __init__(self, node: str, every: float, region_of: Callable[[], Awaitable[PoolRegion | None]]) -> None:
        self.node, self.every, self.region_of = node, every, region_of
        self.index: PoolIndexReader | None = None
        self.state = "not read yet"

    def leading(self, tenant: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the pool held for ``tenant`` at the last read (0 when
        there was none): a hint, which the lease confirms."""
        index = self.index
        return 0 if index is None else index.leading(tenant, keys)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(await self.once())

    async def once(self) -> float:
        """Read the index once; how long to wait before the next read."""
        try:
            region = await self.region_of()  # a restarted node agent: its new region
            if region is None:
                self.index, self.state = None, f"{self.node}'s pool is not mapped on this host"
                return max(self.every, UNMAPPED_RETRY_S)
            if self.index is None or self.index.region is not region:
                self.index = PoolIndexReader(region)
            cpu = await asyncio.to_thread(_refresh, self.index)  # about 1 ms at 512 MiB: off the loop
            self.state = "read"
            return max(self.every, cpu / CPU_SHARE)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the index is a hint: without it, the conductor answers
            log.debug("pool index of %s: %s", self.node, exc)
            self.index, self.state = None, f"{self.node}'s pool index: {exc}"
            return max(self.every, UNMAPPED_RETRY_S)


def _refresh(index: PoolIndexReader) -> float:
    """``index.refresh()`` in the calling thread; the CPU seconds it took there."""
    started = time.thread_time()
    index.refresh()
    return time.thread_time() - started
