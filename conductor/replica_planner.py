"""Hot-block replication: which node copies or drops which block now, under the replication policy
and the access rates the conductor's lookups saw (the leader's)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

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


class ReplicaPlanner:
    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self._issued: dict[tuple[str, bytes, str], float] = {}  # tasks handed out -> deadline

    def tasks(self, node: str, limit: int = 64) -> list[ReplicaMove]:
        """What ``node`` should copy or drop now, under the replication policy and the access rates
        seen in lookups. Each block's targets are chosen once by the placement strategy, so nodes
        asking at the same time do not all copy the same block; a task handed out is not handed out
        again until it is done (the index changes) or its deadline passes."""
        now = time.monotonic()
        self._issued = {k: v for k, v in self._issued.items() if v > now}
        tasks: list[ReplicaMove] = []
        for block, rate in self.conductor.heat.items():
            tenant, key = cast(tuple[str, bytes], block)  # the conductor counts (tenant, key) pairs
            holders = {
                r: size
                for r, size in self.conductor.index.holders(tenant, key).items()
                if getattr(self.conductor.members.members.get(r.node), "role", None) == "node"
            }  # not workers
            if not holders:
                self.conductor.heat.forget((tenant, key))
                continue
            nodes = sorted({r.node for r in holders})
            wanted = self.conductor.replication.replicas((tenant, key), rate)
            if (tenant, key, node) in self._issued:
                continue
            replica, size = min(holders.items(), key=lambda item: (item[0].node, item[0].tier))
            tier = "pool"
            if wanted > len(nodes) and node not in nodes:
                chosen = self.conductor.placement.choose(
                    self.conductor._loads(tier, exclude=set(nodes)), size, wanted - len(nodes)
                )
                if node in chosen:
                    tasks.append(ReplicaMove(tenant, key, tier, size, replica.node))
            elif wanted < len(nodes) and node in nodes and (tenant, key) not in self.conductor.pins:
                # drop from the most used holders first, keeping ``wanted`` of them
                by_use = sorted(nodes, key=lambda n: -self.conductor.index.used.get((n, tier), 0))
                if node in by_use[: len(nodes) - wanted]:
                    for r in holders:
                        if r.node == node:
                            tasks.append(ReplicaMove(tenant, key, r.tier, size, None))
            else:
                continue
            if tasks and tasks[-1].key == key:
                self._issued[(tenant, key, node)] = now + ISSUED_S
            if len(tasks) >= limit:
                break
        return tasks
