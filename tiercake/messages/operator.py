"""The operator's endpoints on the control API: prompts, flushes, policies, sessions, the cluster view."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Name, Reply, Request
from .members import TierStats
from .settings import ClusterSettings, EvictionSpec, RouterSpec


class PromptRequest(Request):
    """A prompt whose cached prefix to look up, pin or unpin."""

    prompt: str | list[int]
    tenant: Name = "default"
    ttl: int | None = Field(default=None, ge=1, description="pin: seconds; default until unpinned")


class PrefixHolder(Reply):
    tokens: int
    blocks: int
    tiers: dict[str, int]


class PrefixReply(Reply):
    blocks: int
    block_size: int
    holders: dict[str, PrefixHolder]


class PinPrefixReply(Reply):
    pinned_blocks: int = 0
    unpinned_blocks: int = 0


class FlushRequest(Request):
    tiers: list[str] | None = Field(default=None, description="only these tiers, pushed down; default: all")
    wait: bool = Field(
        default=False,
        description="answer once every member has applied it and reported what "
        "it dropped (else: once it is durable; members apply it at their next keep-alive)",
    )
    timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="with wait: how long; then a 504 naming the members that have not applied it",
    )


class FlushReply(Reply):
    flush_epoch: int
    applied: bool = Field(default=False, description="every member has applied it (a flush that waited)")


class FlushAppliedRequest(Request):
    """A member has applied a flush epoch and reported what it removed."""

    node_id: Name
    epoch: int = Field(ge=0)


class PolicyRequest(Request):
    """Switch policies at run time, cluster-wide (durable: a new leader keeps them)."""

    router: str | None = None
    router_params: dict[str, Any] = Field(default_factory=dict)
    eviction: dict[str, EvictionSpec] | None = Field(default=None, description="tier name -> policy")


class PolicyReply(Reply):
    router: RouterSpec
    eviction: dict[str, EvictionSpec]
    warnings: list[str] = Field(
        default_factory=list,
        description="what the switch costs (a router that never loads from the nodes' pool and SSD)",
    )


class CountedLoad(Reply):
    """A worker's load as the front counts it (routed and not yet prefilled, sequences it serves)."""

    queued_tokens: int = 0
    running: int = 0


class ClusterMember(Reply):
    id: str
    role: str
    address: str
    url: str
    tiers: dict[str, TierStats]
    indexed_bytes: dict[str, int]
    load: CountedLoad | None = None


class ServingFigures(Reply):
    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    cached_tokens_by_source: dict[str, int]


class MetadataCosts(Reply):
    """The control plane's work over the front's life: index lookups and placement changes (their
    keys and sizes on the wire), and the writes the conductor made to its metadata backend (etcd:
    membership, pins, settings, the object map; never a placement), per request and per KV byte."""

    lookups: int
    placement_changes: int = 0  # replicas the index added or removed
    change_batches: int = 0  # the reports, removals and commits that carried them
    changes: dict[str, int] = Field(default_factory=dict)  # by tier and kind: "pool+", "ssd-", ...
    change_bytes: int = 0  # of block keys and sizes those batches carried
    backend_writes: int = 0  # keys this conductor put in or deleted from etcd (or the embedded backend)
    ops_per_request: float
    bytes_per_request: float
    kv_bytes_moved: int
    block_bytes: int
    metadata_bytes_per_kv_byte: float
    load_overhead_s: float


class IndexFigures(Reply):
    replicas: int
    pins: int


class ClusterView(Reply):
    """``GET /v1/cluster``: members with their tiers and loads, the serving figures, metadata costs."""

    members: list[ClusterMember]
    router: RouterSpec
    settings: ClusterSettings
    serving: ServingFigures
    index: IndexFigures
    metadata: MetadataCosts
    reuse: dict[str, Any] | None = None
