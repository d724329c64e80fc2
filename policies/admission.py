"""Built-in admission policies: always admit, and admit on the Nth offer."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .base import AdmissionPolicy, BlockMeta, Key


class AlwaysAdmit(AdmissionPolicy):
    """Every block offered to the tier enters it."""

    name = "always"

    def admit(self, key: Key, meta: BlockMeta = BlockMeta()) -> bool:
        return True


class AdmitOnNth(AdmissionPolicy):
    """A block enters on its ``n``-th offer; keeps the tier free of one-hit wonders.

    Offer counts are remembered for the ``memory`` most recently offered keys only, so the policy's
    own footprint is bounded.
    """

    name = "nth"

    def __init__(self, n: int = 2, memory: int = 1_000_000) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        if memory < 1:
            raise ValueError("memory must be >= 1")
        self.n = n
        self.memory = memory
        self._offers: OrderedDict[Key, int] = OrderedDict()

    def admit(self, key: Key, meta: BlockMeta = BlockMeta()) -> bool:
        count = min(self._offers.pop(key, 0) + 1, self.n)
        self._offers[key] = count
        if len(self._offers) > self.memory:
            self._offers.popitem(last=False)
        return count >= self.n

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "n": self.n, "remembered": len(self._offers)}
