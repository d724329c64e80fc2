"""The node's side of the key-value store: the objects of the slots the object map gives this node.

``ownership.py`` decides which slots it serves (its map, its lease), ``serve.py`` answers the object
operations on the transfer port, ``replication.py`` keeps each slot's backups in step, and the state
itself is ``tiercake.tiers.objects.ObjectTable``. ``NodeObjects`` puts them together for the node
agent; the contract they keep is in docs/ARCHITECTURE.md ("The key-value store").
"""

from __future__ import annotations

import logging
from pathlib import Path

from tiercake.conductor.client import Client
from tiercake.messages import KeepAliveReply
from tiercake.tiers import TieredStore
from tiercake.tiers.objects import ObjectTable
from tiercake.transfer.connection import Channels

from .ownership import Ownership
from .replication import Replicator
from .serve import OBJECT_OPS, ObjectServer

log = logging.getLogger(__name__)

__all__ = ["NodeObjects", "OBJECT_OPS", "ObjectServer", "Ownership", "Replicator"]


class NodeObjects:
    """Everything of the key-value store on one node agent."""

    def __init__(self, node_id: str, store: TieredStore, secret: bytes, client: Client | None, *, ttl: float,
                 lease_ttl: float = 5.0, pool_tier: str | None = None, disk_tier: str | None = None,
                 tls=None, map_path: Path | None = None) -> None:
        """``map_path``: where the node keeps its last object map (beside its pool or SSD)."""
        self.client = client
        self.table = ObjectTable(store, lease_ttl=lease_ttl, disk_tier=disk_tier)
        self.ownership = Ownership(node_id, client, ttl, map_path)
        self.channels = Channels(node_id, secret, self._address, tls=tls)
        self.replicator = Replicator(node_id, self.table, self.ownership, self.channels, client)
        self.server = ObjectServer(node_id, self.table, self.ownership, self.replicator, pool_tier)

    async def recover(self) -> int:
        """Rebuild the table from what the store held at start (an adopted pool, a recovered SSD)."""
        found = await self.table.recover()
        if found:
            log.info("node %s: %d objects recovered", self.ownership.node_id, found)
        return found

    async def _address(self, node: str) -> tuple[str, int] | None:
        if self.client is None:
            return None
        member = next((m for m in await self.client.members() if m.node_id == node and m.role == "node"), None)
        return None if member is None else (member.host, member.port)

    # What the conductor link tells --------------------------------------------------------------

    def on_keepalive(self, sent_at: float, answer: KeepAliveReply) -> None:
        self.ownership.note_keepalive(sent_at, answer)

    def on_registered(self) -> None:
        self.ownership.note_registered()

    async def close(self) -> None:
        await self.replicator.close()
        await self.ownership.close()
        self.channels.close()
        self.table.close()

