"""The policy interfaces. A plug-in author implements one of these and nothing else of ours.

Keys are opaque hashables: the live store passes ``BlockKey`` bytes, the trace simulator passes the
trace's integer hash ids; the same policy object serves both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

Key = Hashable
CanEvict = Callable[[Key], bool]


def _always(_key: Key) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a policy may know about a block when it enters a tier."""

    parent: Key | None = None  # the previous block of the chain; None for a chain's first block
    size: int = 1  # bytes (or 1 in the block-count simulator)
    cost: float = 1.0  # relative cost of recomputing the block (cost-aware policies)
    tenant: str = ""  # the namespace the block belongs to (the conductor indexes blocks per tenant)


class EvictionPolicy(ABC):
    """Decides which resident blocks of one tier leave first.

    Contract:
    - ``on_insert(key, meta)``: ``key`` became resident in the tier.
    - ``on_access(key)``: a resident ``key`` was read (a hit).
    - ``on_remove(key)``: ``key`` left for a reason other than eviction (removed, revoked). It must be
      idempotent and accept keys the policy no longer tracks.
    - ``victims(n, can_evict)``: choose up to ``n`` resident keys to evict, best first, skipping keys
      for which ``can_evict(key)`` is false (leased, pinned, in use). The returned keys are no longer
      resident for the policy (it may remember them as ghosts); the caller evicts them. A caller that
      could not evict one after all calls ``on_insert`` for it again.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None: ...

    @abstractmethod
    def on_access(self, key: Key) -> None: ...

    @abstractmethod
    def on_remove(self, key: Key) -> None: ...

    @abstractmethod
    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]: ...

    @abstractmethod
    def __len__(self) -> int:
        """How many resident keys the policy tracks."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def describe(self) -> dict[str, Any]:
        """State worth showing an operator (queue sizes, adaptive targets)."""
        return {"policy": self.name, "resident": len(self)}


class PolicyContractError(ValueError):
    """A policy answered against its contract (a plug-in's bug, named with what it returned)."""


def one_victim(policy: EvictionPolicy, resident: Container) -> Key:
    """``policy.victims(1)`` where the caller evicts exactly one key it holds: the key, checked."""
    got = policy.victims(1)
    if not isinstance(got, list | tuple) or len(got) != 1 or got[0] not in resident:
        name = policy.name or type(policy).__name__
        raise PolicyContractError(
            f"eviction policy {name!r}: victims(1) returned {got!r:.200}; it must return a list of one key that "
            "was given to on_insert and is still resident (the contract in tiercake.policies.EvictionPolicy)"
        )
    return got[0]


class AdmissionPolicy(ABC):
    """Decides whether a block enters a tier at all (on put, spill or promotion)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def admit(self, key: Key, meta: BlockMeta = BlockMeta()) -> bool:
        """Called once per offer of ``key`` to the tier; may count offers."""

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name}
