"""Hot-block replication: which node copies or drops which block now, under the replication policy
and the access rates the conductor's lookups saw (the leader's)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from .placement import Replica
from .puts import node_loads

if TYPE_CHECKING:
    from .service import Conductor


@dataclass(frozen=True, slots=True)
class ReplicaMove:
    """Ask ``node`` to copy a hot block from ``source`` (``source`` set) or drop its copy (None); sent as
    ``messages.ReplicationTask``."""

    tenant: str
    key: bytes
    tier: str
    size: int
    source: str | None


ISSUED_S = 10.0  # a task handed out is not handed out again for this long, unless done before
# The plan is made again at most this often, for every node in one pass over the hot blocks. It was
# made per keep-alive, for the asking node alone: a pass over every tracked block (up to 200,000)
# in each of them, 36 ms of the leader's CPU per renewal at ten nodes in `bench fleet`, which a
# thousand nodes renewing every 1.7 s would need hundreds of cores for.
PLAN_S = 1.0
PLAN_SLICE = 2048  # blocks looked at per turn of the loop


class ReplicaPlanner:
    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self._issued: dict[tuple[str, bytes, str], float] = {}  # tasks handed out -> deadline
        self._plan: dict[str, list[ReplicaMove]] = {}
        self._planned_at = -math.inf
        self._watched: set[tuple[str, bytes]] = set()  # blocks above one replica or with moves planned
        self._planning: asyncio.Task | None = None

    def tasks(self, node: str, limit: int = 64) -> list[ReplicaMove]:
        """What ``node`` should copy or drop now, under the replication policy and the access rates
        seen in lookups: its part of the last plan, less what it was handed already (until that is
        done or its deadline passes) and what the index says is done. A plan older than ``PLAN_S``
        starts the next one in the background, a slice of blocks per turn of the loop (a plan made
        in the keep-alive that asked once held the leader's loop for half a second)."""
        now = time.monotonic()
        if now - self._planned_at >= PLAN_S and (self._planning is None or self._planning.done()):
            self._planned_at = now
            self._planning = asyncio.get_running_loop().create_task(self.plan())
        tasks: list[ReplicaMove] = []
        for move in self._plan.get(node, ()):
            issued = (move.tenant, move.key, node)
            if issued in self._issued or not self._still_wanted(node, move):
                continue
            tasks.append(move)
            self._issued[issued] = now + ISSUED_S
            if len(tasks) >= limit:
                break
        return tasks

    async def plan(self) -> None:
        """Make the plan every node's tasks come from."""
        self._plan = await self._make_plan()
        now = time.monotonic()
        self._issued = {k: v for k, v in self._issued.items() if v > now}

    async def _make_plan(self) -> dict[str, list[ReplicaMove]]:
        """Every node's moves. Each block's targets are chosen once by the placement strategy, so nodes
        asking at the same time do not all copy the same block; copies are dropped from the most used
        holders first, keeping what the policy wants. Only blocks read since the last plan, or held
        by more than one node or with moves planned then, are looked at: any other block only
        cooled, and one replica is the least any policy wants (a pass over every tracked block took
        0.2-0.5 s of the leader's loop a second at 200,000 of them, and renewals waited behind it);
        of those read, only the ones read often enough for the policy to want more than one replica
        (``ReplicationPolicy.one_replica_below``). The index is asked a slice at a time, once a tenant
        a slice (a find a block cost 30-40 us: 2.5 s of a busy second)."""
        c = self.conductor
        plan: dict[str, list[ReplicaMove]] = defaultdict(list)
        now = time.monotonic()
        floor = c.replication.one_replica_below
        watched, self._watched = self._watched, set()
        by_tenant: dict[str, list[bytes]] = defaultdict(list)
        for tenant, key in cast(set[tuple[str, bytes]], c.heat.take_touched()) | watched:
            if (tenant, key) in watched or c.heat.rate((tenant, key), now) >= floor:
                by_tenant[tenant].append(key)
        for tenant, keys in by_tenant.items():
            for first in range(0, len(keys), PLAN_SLICE):
                part = keys[first : first + PLAN_SLICE]
                for key, found in zip(part, c.index.holders_many(tenant, part), strict=True):
                    self._plan_block(plan, tenant, key, found, now)
                await asyncio.sleep(0)  # the rest of the loop's work goes between slices
        return plan

    def _plan_block(
        self, plan: dict[str, list[ReplicaMove]], tenant: str, key: bytes, found: dict[Replica, int], now: float
    ) -> None:
        """One block's moves: copies to more nodes, or drops from the most used holders."""
        c, tier = self.conductor, "pool"
        rate = c.heat.rate((tenant, key), now)
        holders = {
            r: size for r, size in found.items() if getattr(c.members.members.get(r.node), "role", None) == "node"
        }  # not workers
        if not holders:
            c.heat.forget((tenant, key))
            return
        nodes = sorted({r.node for r in holders})
        wanted = c.replication.replicas((tenant, key), rate)
        if max(wanted, len(nodes)) > 1:
            self._watched.add((tenant, key))
        replica, size = min(holders.items(), key=lambda item: (item[0].node, item[0].tier))
        if wanted > len(nodes):
            for target in c.placement.choose(
                node_loads(c.members, c.index, tier, exclude=set(nodes)), size, wanted - len(nodes)
            ):
                plan[target].append(ReplicaMove(tenant, key, tier, size, replica.node))
        elif wanted < len(nodes) and (tenant, key) not in c.pins:
            by_use = sorted(nodes, key=lambda n: -c.index.used_bytes(n, tier))
            for node in by_use[: len(nodes) - wanted]:
                plan[node] += [ReplicaMove(tenant, key, r.tier, size, None) for r in holders if r.node == node]

    def _still_wanted(self, node: str, move: ReplicaMove) -> bool:
        """Whether the index still says the move is to be made (a copy not there yet, a drop still held)."""
        held = {r.tier for r in self.conductor.index.holders(move.tenant, move.key) if r.node == node}
        return not held if move.source is not None else move.tier in held
