"""Cluster settings (durable, followed by every conductor, handed to members) and the keep-alive's answer."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import KeyHex, Name, Reply, Request


class RouterSpec(Request):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class EvictionSpec(Request):
    policy: str
    params: dict[str, Any] = Field(default_factory=dict)


class FlushSetting(Request):
    epoch: int = 0
    tiers: list[str] | None = Field(default=None, description="only these tiers, pushed down; None: all")


class ClusterSettings(Reply):
    """The run-time settings under ``/tiercake/settings/<field>``, one etcd key per field."""

    router: RouterSpec | None = None
    eviction: dict[str, EvictionSpec] = Field(default_factory=dict)
    flush: FlushSetting = Field(default_factory=FlushSetting)


class ReplicationTask(Reply):
    """Copy a hot block from ``source`` (set) or drop this node's copy (None)."""

    tenant: str
    key: KeyHex
    tier: str
    size: int
    source: str | None


class ObjectMap(Reply):
    """Who owns each slot of the key-value store's objects (``tiercake.blocks.object_slot``): per slot a
    chain of nodes, the primary first, then its backups. The primary is the slot's one owner: every
    write of its objects goes through it, in order, and to as many of the backups as each object's
    replicas ask, before it is acknowledged. ``ready[s]`` of a chain's members, from the start, hold
    every replicated object of the slot (a member after them is still being copied); ``handoff[s]``
    names a ready backup the primary is to hand the slot to (a rebalance); ``pinned[s]`` names the
    primary that holds objects of the slot persisted there alone (``replicas`` 1): the slot does not
    move while that node is away, however long (its objects answer "not ready" meanwhile, never
    "not found"), unless an operator releases it. Only the leading conductor writes it, each change
    with a new ``epoch``."""

    epoch: int = 0
    chains: list[list[str]] = Field(default_factory=list)
    ready: list[int] = Field(default_factory=list)
    handoff: dict[int, str] = Field(default_factory=dict)
    pinned: dict[int, str] = Field(default_factory=dict)

    @property
    def slots(self) -> int:
        return len(self.chains)

    def primary(self, slot: int) -> str | None:
        chain = self.chains[slot] if 0 <= slot < len(self.chains) else []
        return chain[0] if chain else None


class SlotReady(Request):
    """A primary's word that a backup now holds the whole slot, that it does no more (``lagging``), or
    that the primary handed the slot to it."""

    slot: int = Field(ge=0)
    epoch: int = Field(ge=0, description="the map epoch the primary synced (or handed off) under")
    node: Name = Field(description="the backup synced (a handoff: the new primary)")
    primary: Name
    handed_off: bool = Field(default=False, description="the primary stopped serving the slot for ``node`` to take it")
    lagging: bool = Field(
        default=False,
        description="``node`` failed a write: it holds the slot whole no more, and "
        "is copied it again before it may be promoted",
    )
    pinned: bool = Field(
        default=False,
        description="the primary (``node`` itself) is about to acknowledge an object of the "
        "slot persisted on it alone: the slot stays with it (``ObjectMap.pinned``)",
    )


class SlotReports(Request):
    """A primary's reports of several slots at once (one map change for all of them)."""

    reports: list[SlotReady] = Field(min_length=1, max_length=65536)


class NodeRelease(Request):
    """An operator's word that a node is gone for good, with what it alone persisted."""

    node: Name


class NodeReleaseReply(Reply):
    released: list[int] = Field(default_factory=list, description="the slots that may move now")


class SlotReportsReply(Reply):
    map: ObjectMap
    refused: list[str] = Field(default_factory=list, description="per report: why it was refused ('' when applied)")


class KeepAliveReply(Reply):
    pins_version: int
    objects_epoch: int = Field(default=0, description="the object map's epoch: a member with an older map fetches it")
    settings: ClusterSettings = Field(default_factory=ClusterSettings)
    tasks: list[ReplicationTask] = Field(default_factory=list)
    term: int = Field(
        default=0,
        description="the leader's term; when it changes, a member re-reports what the new leader may "
        "lack of its placements (rereport_s)",
    )
    volatile_tiers: list[str] = Field(
        default_factory=list,
        description="the member's tiers, whose placements it re-reports to a new term (every tier's "
        "placements live in the conductors' memory; members of this release re-report every tier and "
        "read rereport_s, this list is for those of the release before)",
    )
    rereport_s: float | None = Field(
        default=None,
        ge=0,
        description="with a new term: the new leader kept its mirror of the old one's index, so a "
        "member re-reports only the changes acknowledged in the last this many seconds; None: it has "
        "none, and a member re-reports everything it holds",
    )
