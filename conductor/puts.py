"""Puts of blocks through the conductor, as Mooncake's master takes them: begin (the conductor
chooses each new block's nodes and remembers the put), the writer's transfer, then commit (placed)
or revoke; a put neither committed nor revoked within its timeout is forgotten."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from tiercake.messages import MemberInfo
from tiercake.policies import NodeLoad, PlacementStrategy, ReplicationPolicy

from .membership import Membership
from .placement import PlacementIndex


class PlacementError(Exception):
    """A commit or revoke names a put the conductor does not know (never begun, timed out, revoked,
    already committed), or a node that is not a live member."""


class NoRoomError(PlacementError):
    """No live node has room for the block in the asked tier."""


def node_loads(members: Membership, index: PlacementIndex, tier: str, exclude: Collection[str] = ()) -> list[NodeLoad]:
    """Each live node agent with ``tier``: its capacity there and what the index counts as used."""
    return [
        NodeLoad(m.node_id, m.tiers[tier], index.used_bytes(m.node_id, tier))
        for m in members.alive("node")
        if tier in m.tiers and m.node_id not in exclude
    ]


class PutBook:
    def __init__(
        self,
        index: PlacementIndex,
        members: Membership,
        placement: PlacementStrategy,
        replication: ReplicationPolicy,
        timeout: float,
        member: Callable[[str, str], MemberInfo],
    ) -> None:
        """``member(node, tier)``: the live member, or ``PlacementError``."""
        self.index, self.members = index, members
        self.placement, self.replication = placement, replication
        self.timeout = timeout
        self.member = member
        self._pending: dict[tuple[str, bytes, str], tuple[str, float]] = {}  # (tenant, key, node) -> tier, deadline

    def begin(
        self,
        tenant: str,
        keys: list[bytes],
        sizes: list[int],
        tier: str = "pool",
        local: str | None = None,
        evict: bool = False,
    ) -> dict[bytes, list[str]]:
        """Choose target nodes for each new block (as many as the replication policy wants) and
        remember the put until it is committed, revoked or times out. Blocks already placed keep
        their placement (objects are immutable). With ``evict`` (a cache's put: the node's store
        evicts to make room), a block no node has room for by the index's count goes where the
        strategy says among the nodes whose tier is large enough for it."""
        now = time.monotonic()
        self._pending = {k: v for k, v in self._pending.items() if v[1] > now}
        loads = {load.node: load for load in node_loads(self.members, self.index, tier)}
        targets: dict[bytes, list[str]] = {}
        for key, size in zip(keys, sizes, strict=True):
            held = sorted({r.node for r in self.index.holders(tenant, key)})
            if held:
                targets[key] = held
                continue
            count = self.replication.replicas((tenant, key), 0.0)
            chosen = self.placement.choose(list(loads.values()), size, count, local)
            if not chosen and evict:
                room = [
                    NodeLoad(n.node, n.capacity, min(n.used, n.capacity - size))
                    for n in loads.values()
                    if n.capacity >= size
                ]
                chosen = self.placement.choose(room, size, count, local)
            if not chosen:
                raise NoRoomError(f"no node has {size} bytes free in tier {tier!r} ({len(loads)} candidate nodes)")
            for node in chosen:
                self._pending[(tenant, key, node)] = (tier, now + self.timeout)
                load = loads[node]
                loads[node] = NodeLoad(node, load.capacity, load.used + size)  # later blocks see it
            targets[key] = chosen
        return targets

    def _take_pending(self, tenant: str, keys: list[bytes], node: str, tier: str) -> None:
        now = time.monotonic()
        missing = [
            k.hex()[:16]
            for k in keys
            if self._pending.get((tenant, k, node), (None, 0.0))[0] != tier
            or self._pending[(tenant, k, node)][1] <= now
        ]
        if missing:
            raise PlacementError(
                f"no put in progress on {node}/{tier} for {len(missing)} blocks "
                f"(first {missing[0]}…): unknown, timed out, revoked or already committed"
            )
        for key in keys:
            del self._pending[(tenant, key, node)]

    def commit(self, tenant: str, keys: list[bytes], node: str, tier: str, sizes: list[int]) -> None:
        """The node stored the blocks begun for it: placed (they go when the node leaves)."""
        self.member(node, tier)
        self._take_pending(tenant, keys, node, tier)
        self.index.add_many(tenant, keys, node, tier, sizes)

    def revoke(self, tenant: str, keys: list[bytes], node: str, tier: str) -> None:
        self._take_pending(tenant, keys, node, tier)
