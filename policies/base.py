"""The policy interfaces. A plug-in author implements one of these and nothing else of ours.

Keys are opaque hashables: the live store passes ``BlockKey`` bytes, the trace simulator passes the
trace's integer hash ids; the same policy object serves both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass
from enum import StrEnum
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


class SessionState(StrEnum):
    """Where a conversation stands. Active: a turn is being computed. Paused: between turns (a tool call
    running, the user typing). Closed: it will not come back (closed by its client, or its retention
    expired)."""

    ACTIVE = "active"
    PAUSED = "paused"
    CLOSED = "closed"


DEFAULT_RETAIN_S = 1800.0  # how long a paused session is kept when it announces no retention


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """A session's state changed, at time ``at`` (seconds, on the caller's clock: the trace's in the
    simulator, the conductor's monotonic clock live).

    ``keys`` are the blocks the session's next turn will read (its whole conversation so far, in chain
    order), given with every ACTIVE and PAUSED event; a CLOSED event may leave them empty. ``resume_in``
    is the pause its client announced (seconds; None: not announced). ``retain_s`` bounds how long a
    paused session's blocks are kept for it (None: the policy's default). ``priority`` orders sessions
    in a tier before their expected resume does (higher is kept longer).
    """

    session: Hashable
    state: SessionState
    at: float
    keys: tuple[Key, ...] = ()
    resume_in: float | None = None
    retain_s: float | None = None
    priority: int = 0
    tenant: str = ""  # whose session: quotas and floors are per tenant


class EvictionPolicy(ABC):
    """Decides which resident blocks of one tier leave first.

    Contract:
    - ``on_insert(key, meta)``: ``key`` became resident in the tier.
    - ``on_access(key)``: a resident ``key`` was read (a hit).
    - ``on_remove(key)``: ``key`` left for a reason other than eviction (removed, revoked). It must be
      idempotent and accept keys the policy no longer tracks.
    - ``on_session(event)``: optional; what a session-aware policy learns of conversations.
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

    def on_session(self, event: SessionEvent) -> None:
        """A session's state changed (optional: a session-blind policy ignores it). Its keys may or
        may not be resident in this tier; it must not evict or insert anything."""

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
