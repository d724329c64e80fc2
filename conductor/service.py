"""The conductor: one process's share of the control plane, over a metadata backend.

Every conductor loads and follows the placement index and the membership, and serves lookups from
memory; the one that wins the election also accepts placement writes. The HTTP face is ``api.py``.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from tiercake.policies import NodeLoad, create_placement, create_replication

from .election import LeaderElection
from .membership import Membership
from .metadata import MetadataBackend, MetadataUnavailableError
from .placement import PlacementIndex


class NotLeaderError(Exception):
    """A write reached a conductor that does not lead; ``leader`` says who does (if anyone)."""

    def __init__(self, leader: str | None) -> None:
        super().__init__(f"this conductor does not lead; the leader is {leader or 'not known yet'}")
        self.leader = leader


class ConductorInfo(BaseModel):
    """What a conductor publishes about itself, so clients can find the leader's address."""

    model_config = ConfigDict(extra="forbid")

    conductor_id: str
    url: str = Field(description="where its HTTP API listens")


class PlacementError(Exception):
    """A commit or revoke names a put the conductor does not know (never begun, timed out, revoked,
    already committed)."""


class NoRoomError(PlacementError):
    """No live node has room for the block in the asked tier."""


class Conductor:
    def __init__(self, meta: MetadataBackend, conductor_id: str | None = None, url: str = "", ttl: int = 3,
                 placement: str = "least_used", replication: str = "fixed", replication_params: dict | None = None,
                 put_timeout: float = 60.0) -> None:
        self.meta = meta
        self.placement = create_placement(placement)
        self.replication = create_replication(replication, replication_params)
        self.put_timeout = put_timeout
        self._pending: dict[tuple[str, bytes, str], tuple[str, float]] = {}  # (tenant, key, node) -> tier, deadline
        self.conductor_id = conductor_id or f"conductor-{uuid.uuid4().hex[:8]}"
        self.url = url
        self.index = PlacementIndex(meta)
        self.members = Membership(meta)
        self.election = LeaderElection(meta, ConductorInfo(conductor_id=self.conductor_id, url=url).model_dump_json(),
                                       ttl=ttl)

    async def start(self) -> Conductor:
        await self.index.start()
        await self.members.start()
        await self.election.start()
        return self

    async def close(self) -> None:
        await self.election.resign()
        await self.members.close()
        await self.index.close()

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    async def leader(self) -> ConductorInfo | None:
        raw = await self.election.leader()
        return ConductorInfo.model_validate_json(raw) if raw else None

    async def ready(self) -> tuple[bool, str]:
        """Ready to serve: the backend answers and a leader is known."""
        try:
            leader = await self.leader()
        except MetadataUnavailableError as exc:
            return False, f"metadata backend unreachable: {exc}"
        if leader is None:
            return False, "no leader elected yet"
        return True, f"leader {leader.conductor_id}"

    def require_leader(self, leader: ConductorInfo | None) -> None:
        if not self.is_leader:
            raise NotLeaderError(leader.url if leader else None)

    # Puts -----------------------------------------------------------------------------------------

    def _loads(self, tier: str) -> list[NodeLoad]:
        return [
            NodeLoad(m.node_id, m.tiers[tier], self.index.used.get((m.node_id, tier), 0))
            for m in self.members.alive("node") if tier in m.tiers
        ]

    def begin_put(self, tenant: str, keys: list[bytes], sizes: list[int], tier: str = "pool",
                  local: str | None = None) -> dict[bytes, list[str]]:
        """Choose target nodes for each new block (as many as the replication policy wants) and
        remember the put until it is committed, revoked or times out. Blocks already placed keep
        their placement (objects are immutable)."""
        now = time.monotonic()
        self._pending = {k: v for k, v in self._pending.items() if v[1] > now}
        loads = {load.node: load for load in self._loads(tier)}
        targets: dict[bytes, list[str]] = {}
        for key, size in zip(keys, sizes, strict=True):
            held = sorted({r.node for r in self.index.holders(tenant, key)})
            if held:
                targets[key] = held
                continue
            count = self.replication.replicas(key, 0.0)
            chosen = self.placement.choose(list(loads.values()), size, count, local)
            if not chosen:
                raise NoRoomError(f"no node has {size} bytes free in tier {tier!r} "
                                     f"({len(loads)} candidate nodes)")
            for node in chosen:
                self._pending[(tenant, key, node)] = (tier, now + self.put_timeout)
                load = loads[node]
                loads[node] = NodeLoad(node, load.capacity, load.used + size)  # later blocks see it
            targets[key] = chosen
        return targets

    def _take_pending(self, tenant: str, keys: list[bytes], node: str, tier: str) -> None:
        now = time.monotonic()
        missing = [k.hex()[:16] for k in keys
                   if self._pending.get((tenant, k, node), (None, 0.0))[0] != tier
                   or self._pending[(tenant, k, node)][1] <= now]
        if missing:
            raise PlacementError(f"no put in progress on {node}/{tier} for {len(missing)} blocks "
                                 f"(first {missing[0]}…): unknown, timed out, revoked or already committed")
        for key in keys:
            del self._pending[(tenant, key, node)]

    async def commit_put(self, tenant: str, keys: list[bytes], node: str, tier: str, sizes: list[int],
                         lease: int = 0) -> None:
        """The node stored the blocks begun for it: durable placement, then acknowledged."""
        self._take_pending(tenant, keys, node, tier)
        await self.index.add_many(tenant, keys, node, tier, sizes, lease)

    def revoke_put(self, tenant: str, keys: list[bytes], node: str, tier: str) -> None:
        self._take_pending(tenant, keys, node, tier)
