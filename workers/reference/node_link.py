"""A worker's way to the node agents: the transfer engine, the members it learns their addresses
from (a pull or write retried only where an agent moved), and the fence around agents whose
transfers timed out (skipped until they answer a probe)."""

from __future__ import annotations

import logging

from tiercake.conductor.client import Client, ConductorError, NodeDirectory
from tiercake.transfer import Transfer, TransferEngine, TransferResult

from ..fence import NodeFence

log = logging.getLogger(__name__)


class NodeLink:
    def __init__(self, worker_id: str, transfer: TransferEngine | None, conductor: Client | None) -> None:
        self.worker_id = worker_id
        self._transfer = transfer
        self.nodes = None
        if conductor is not None and transfer is not None:
            self.nodes = NodeDirectory(conductor, transfer, moved_only=True)
        self.fence = NodeFence(worker_id, self.answers)

    @property
    def transfer(self) -> TransferEngine:
        """The worker's transfer engine; its callers have made sure there is one."""
        if self._transfer is None:
            raise RuntimeError(f"worker {self.worker_id} has no transfer engine")
        return self._transfer

    async def reachable(self, node: str, force: bool = False) -> bool:
        """A node agent the transfer engine can reach (workers hold blocks too, but serve none).
        Unknown ids are looked up among the members (at most twice a second unless ``force``)."""
        if node == self.worker_id or not self.fence.open(node):
            return False
        if node not in self.transfer.peers and self.nodes is not None:
            try:
                await self.nodes.refresh(force)
            except ConductorError as exc:
                log.warning("worker %s: cannot list members: %s", self.worker_id, exc)
        return node in self.transfer.peers

    async def send(self, node: str, batch: list[Transfer], verify=None) -> list[TransferResult]:
        """The batch to or from ``node``, given up at the deadline its size calls for (a node that
        stalls costs about a second, then the caller recomputes); when the node could not be reached
        and the members list it at another address (its agent restarted), once more there."""
        deadline = self.transfer.deadline_for(sum(t.length for t in batch))

        async def attempt() -> list[TransferResult]:
            return self.heard(node, await self.transfer.transfer(batch, timeout=deadline, verify=verify))

        if self.nodes is None:
            return await attempt()
        try:
            return await self.nodes.to_node(node, attempt)
        except ConductorError as exc:  # the members could not be read: what the attempt gave stands
            log.warning("worker %s: cannot list members: %s", self.worker_id, exc)
            return [TransferResult(False, error=exc) for _ in batch]

    async def answers(self, node: str) -> bool:
        return self._transfer is None or await self._transfer.answers(node)

    def heard(self, node: str, results: list[TransferResult]) -> list[TransferResult]:
        """A batch that got nothing but timeouts fences its node."""
        if results and all(isinstance(r.error, TimeoutError) for r in results):
            self.fence.timed_out(node)
        return results
