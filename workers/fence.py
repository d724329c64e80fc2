"""Node agents that stopped answering, kept out of a worker's path until they answer again.

A node agent that stalls (paused, swapping, partitioned) but whose lease has not run out yet is
still a member: the index names it, and every request that pulls from it or writes through to it
waits out its transfer deadline (about a second) and holds gpu blocks meanwhile. With a stalled node
the cluster once served 3% of its requests for the whole stall. So a worker fences a node the moment
a transfer to it times out: it neither pulls from it (the prefix is computed) nor writes through to
it (the blocks stay in the gpu tier) until the node answers a probe. The probe runs in the
background, twice a second, so no request waits on a node that may still be silent. A node silent
for ``GIVE_UP_S`` is left to the membership (its lease runs out long before): the fence lifts and
the worker's ordinary member checks decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class NodeFence:
    PROBE_EVERY_S = 0.5
    GIVE_UP_S = 120.0

    def __init__(self, owner: str, probe: Callable[[str], Awaitable[bool]]) -> None:
        """``probe(node)``: whether ``node`` answers now (bounded by its own deadline)."""
        self.owner = owner
        self._probe = probe
        self._fenced: dict[str, asyncio.Task] = {}
        self.fenced = 0  # how many times a node was fenced (a figure for the worker's stats)

    def open(self, node: str) -> bool:
        """Whether transfers may go to ``node`` now."""
        return node not in self._fenced

    def timed_out(self, node: str) -> None:
        """A transfer to ``node`` timed out: fence it until it answers a probe."""
        if node in self._fenced:
            return
        self.fenced += 1
        log.warning(
            "worker %s: node %s did not answer in time; out of this worker's path until it answers", self.owner, node
        )
        self._fenced[node] = asyncio.get_running_loop().create_task(self._until_answered(node))

    async def _until_answered(self, node: str) -> None:
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.GIVE_UP_S:
                await asyncio.sleep(self.PROBE_EVERY_S)
                if await self._probe(node):
                    log.info(
                        "worker %s: node %s answers again after %.1f s", self.owner, node, time.monotonic() - started
                    )
                    return
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run lifts the fence, never the worker
            log.warning("worker %s: probing node %s failed: %s", self.owner, node, exc)
        finally:
            self._fenced.pop(node, None)

    async def close(self) -> None:
        tasks = list(self._fenced.values())
        self._fenced.clear()  # a task cancelled before it ran has no finally to do it
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
