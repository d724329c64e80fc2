"""The node's side of the key-value store: the objects of the slots the object map gives this node.

``ownership.py`` decides which slots it serves (its map, its lease), ``serve.py`` routes the object
operations on the transfer port to a module each (``put.py``, ``get.py``, ``query.py``, ``remove.py``,
``replicate.py``), ``replication.py`` keeps each slot's backups in step, and the state
itself is ``tiercake.tiers.objects.ObjectTable``. ``NodeObjects`` puts them together for the node
agent; the contract they keep is in docs/ARCHITECTURE.md ("The key-value store").
"""

from __future__ import annotations

import logging
from pathlib import Path

from tiercake.conductor.client import Client
from tiercake.messages import KeepAliveReply
from tiercake.tiers import TieredStore
from tiercake.tiers.directory import ObjectDirectory, ordered_memory
from tiercake.tiers.objects import ObjectTable
from tiercake.tiers.pool import DIRECTORY_SUFFIX, PoolBackend, beside
from tiercake.transfer.connection import Channels
from tiercake.transfer.protocol import NODE, Credential

from .ownership import Ownership
from .replication import Replicator
from .serve import OBJECT_OPS, ObjectServer

log = logging.getLogger(__name__)

__all__ = ["NodeObjects", "OBJECT_OPS", "ObjectServer", "Ownership", "Replicator"]


class NodeObjects:
    """Everything of the key-value store on one node agent."""

    def __init__(
        self,
        node_id: str,
        store: TieredStore,
        secret: bytes,
        client: Client | None,
        *,
        ttl: float,
        lease_ttl: float = 5.0,
        pool_tier: str | None = None,
        disk_tier: str | None = None,
        tls=None,
        map_path: Path | None = None,
        node_secret: bytes | None = None,
    ) -> None:
        """``map_path``: where the node keeps its last object map (beside its pool or SSD);
        ``node_secret``: what this node proves to the others when it replicates (None: a standalone
        node, which has no backups)."""
        self.client = client
        self.directory = _directory(store, pool_tier)
        self._pool_backend = store.tier(pool_tier).backend if pool_tier is not None else None
        self.table = ObjectTable(
            store, lease_ttl=lease_ttl, disk_tier=disk_tier, directory=self.directory, pool_tier=pool_tier
        )
        self.ownership = Ownership(node_id, client, ttl, map_path)
        self.table.publishes = self._serves_object
        self.ownership.listeners.append(lambda old, new: self._map_changed())
        # a slot's replication goes to the other nodes as a node: they take it from nobody else
        plane = secret if node_secret is None else Credential(node_secret, NODE)
        self.channels = Channels(node_id, plane, self._address, tls=tls)
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

    def _serves_object(self, oid: bytes) -> bool:
        slot = self.ownership.slot_of(oid)
        return self.ownership.is_primary(slot) and slot not in self.ownership.frozen

    def _map_changed(self) -> None:
        self.table.republish()
        self._lease_changed()

    def _lease_changed(self) -> None:
        """Same-host readers trust the directory while this node's lease is surely alive, no longer."""
        if self.directory is not None:
            current = self.ownership.map.epoch >= self.ownership.known_epoch
            self.directory.set_valid_until(self.ownership.lease_until if current else 0.0)

    def on_keepalive(self, sent_at: float, answer: KeepAliveReply) -> None:
        self.ownership.note_keepalive(sent_at, answer)
        self._lease_changed()

    def on_registered(self) -> None:
        self.ownership.note_registered()
        self._lease_changed()

    async def close(self) -> None:
        await self.replicator.close()
        await self.ownership.close()
        self.channels.close()
        self.table.close()
        if self.directory is not None:
            self.directory.close(unlink=not getattr(self._pool_backend, "keep", True))


def _directory(store: TieredStore, pool_tier: str | None) -> ObjectDirectory | None:
    """The same-host readers' directory, beside the node's pool file (none without a pool, or where
    memory order needs fences a Python reader cannot issue)."""
    if pool_tier is None or not ordered_memory():
        return None
    backend = store.tier(pool_tier).backend
    assert isinstance(backend, PoolBackend)  # the node's tier of kind pool
    path = beside(backend.region.path, DIRECTORY_SUFFIX)
    return ObjectDirectory(path, 2 * len(backend.index), bytes.fromhex(backend.region.instance))
