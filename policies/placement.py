"""Placement strategies (which nodes take a new block) and replication policies (how many copies).

Like every policy, they know nothing of tiercake's internals: a strategy sees candidate nodes with
their capacity and use in the target tier; a replication policy sees a block's recent access rate.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class NodeLoad:
    node: str
    capacity: int  # bytes of the target tier
    used: int  # bytes the placement index attributes to it there

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def usage(self) -> float:
        return self.used / self.capacity if self.capacity else 1.0


class PlacementStrategy(ABC):
    """Chooses ``count`` distinct nodes (fewer if fewer fit) for a block of ``size`` bytes."""

    name: ClassVar[str] = ""

    @abstractmethod
    def choose(self, candidates: list[NodeLoad], size: int, count: int, local: str | None = None) -> list[str]: ...


def _fitting(candidates: list[NodeLoad], size: int) -> list[NodeLoad]:
    return [c for c in candidates if c.free >= size]


class LeastUsed(PlacementStrategy):
    """The nodes whose tier is least full (by fraction), ties by name."""

    name = "least_used"

    def choose(self, candidates, size, count, local=None):
        return [c.node for c in sorted(_fitting(candidates, size), key=lambda c: (c.usage, c.node))[:count]]


class LocalFirst(PlacementStrategy):
    """The writer's own node first (no transfer at all), then the least used."""

    name = "local_first"

    def choose(self, candidates, size, count, local=None):
        fitting = _fitting(candidates, size)
        first = [c.node for c in fitting if c.node == local]
        rest = [c.node for c in sorted(fitting, key=lambda c: (c.usage, c.node)) if c.node != local]
        return (first + rest)[:count]


class RandomPlacement(PlacementStrategy):
    """Uniformly random among the nodes with room (seedable, for simulations)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates, size, count, local=None):
        fitting = [c.node for c in _fitting(candidates, size)]
        return self._rng.sample(fitting, min(count, len(fitting)))


class ReplicationPolicy(ABC):
    """How many replicas a block should have, given how often it was read recently."""

    name: ClassVar[str] = ""

    @abstractmethod
    def replicas(self, key: Hashable, accesses_per_s: float) -> int: ...

    @property
    def one_replica_below(self) -> float:
        """A rate (accesses per second) below which a block that wanted one replica so far still
        wants one: the conductor's planner asks the policy only of blocks read at least this often
        (or with more replicas), so a fleet's lookups cost it nothing for the cold majority. 0 (the
        default): every block read is asked of."""
        return 0.0


class FixedReplicas(ReplicationPolicy):
    """Every block gets ``count`` replicas."""

    name = "fixed"

    def __init__(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError("a block needs at least one replica")
        self.count = count

    def replicas(self, key, accesses_per_s):
        return self.count

    @property
    def one_replica_below(self) -> float:
        return math.inf if self.count == 1 else 0.0


class HotReplicas(ReplicationPolicy):
    """``base`` replicas; one more for each ``threshold`` accesses per second, up to ``maximum``.
    A block that cools falls back (the hysteresis keeps it from flapping at the threshold)."""

    name = "hot"

    def __init__(self, base: int = 1, threshold: float = 10.0, maximum: int = 3, hysteresis: float = 0.5) -> None:
        if base < 1 or maximum < base or threshold <= 0 or not 0 <= hysteresis < 1:
            raise ValueError("need 1 <= base <= maximum, threshold > 0, 0 <= hysteresis < 1")
        self.base, self.threshold, self.maximum, self.hysteresis = base, threshold, maximum, hysteresis
        self._current: dict[Hashable, int] = {}

    @property
    def one_replica_below(self) -> float:
        return self.threshold if self.base == 1 else 0.0

    def replicas(self, key, accesses_per_s):
        current = self._current.get(key, self.base)
        wanted = min(self.maximum, self.base + int(accesses_per_s // self.threshold))
        # cool down a level only once the rate is clearly below the one that raised it
        while wanted < current and accesses_per_s <= (current - self.base) * self.threshold * (1 - self.hysteresis):
            current -= 1
        wanted = max(wanted, current)
        if wanted == self.base:
            self._current.pop(key, None)
        else:
            self._current[key] = wanted
        return wanted
