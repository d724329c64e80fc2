"""Members (node agents, workers) <-> conductor: registration, keep-alives and what they carry."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ..blocks import Namespace
from .base import Name, Reply, Request


class WorkerPerf(Reply):
    """A worker's timings, fitted on its machine at start, that the router predicts with."""

    prefill_a: float = 0.005  # prefill seconds: a + b*t + q*t*(t + 2c) (t computed, c cached tokens)
    prefill_b: float = 1e-4
    prefill_q: float = 0.0
    decode_step_s: float = 0.005
    copy_bytes_per_s: float | None = Field(
        default=None, description="warm copies into its gpu tier (the floor of loading a block)"
    )


class KVSpace(Reply):
    """How a worker's engine keys and sizes its KV blocks, when not as the serving config says (a
    vLLM instance: its own block size and layout). The front keys a prompt in it to see what the
    worker and the nodes it saves to hold."""

    namespace: Namespace = Field(description="without a tenant salt: the front adds the request's")
    block_bytes: int = Field(ge=0, description="bytes of one block")


class MemberInfo(Request):
    """A member as it registers. Fields added after the first release are in ``ADDED`` (field ->
    the control API version that added it): a member sends them to an older conductor no more (it
    refuses fields it does not know), and a member of an older release does not send them (their
    defaults say what such a member is)."""

    ADDED: ClassVar[dict[str, int]] = {"transfer_version": 2}

    node_id: Name
    role: Literal["node", "prefill", "decode", "worker", "conductor"] = "node"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    tiers: dict[str, int] = Field(default_factory=dict, description="tier name -> capacity in bytes")
    lease: int = Field(default=0, ge=0, description="the lease the member is registered under (set on registration)")
    url: str = Field(default="", description="a worker's HTTP API")
    engine: str = Field(default="reference", description="the inference engine behind a worker")
    perf: WorkerPerf = Field(default_factory=WorkerPerf, description="a worker's fitted timings (routing)")
    kv_space: KVSpace | None = Field(default=None, description="a worker's block keys, when not the serving config's")
    transfer_version: int = Field(
        default=3,
        ge=1,
        le=255,
        description="the transfer protocol the member speaks (3: a member from before members said it)",
    )


# the upper bounds (s) of TierStats.residency's buckets: how long evicted copies had stayed
RESIDENCY_BUCKETS = (1.0, 10.0, 60.0, 300.0, 1800.0, 7200.0)


class TierStats(Reply):
    kind: str = ""
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    evictions: int = 0
    corrupt: int = 0  # copies that failed their checksum on a read: dropped, never served
    residency: list[int] = Field(default_factory=list, description="evicted blocks by residency bucket")
    residency_sum_s: float = 0.0
    eviction: str | None = None
    sessions: dict[str, int] = Field(
        default_factory=dict, description="a session-aware policy's sessions by state (active, paused)"
    )
    session_blocks: int = Field(default=0, description="of its blocks, those an open session holds")


class MemberStats(Reply):
    """What a member's store reports with each keep-alive (the cluster view and /metrics)."""

    misses: int = 0
    tiers: dict[str, TierStats] = Field(default_factory=dict)


# the longest a member may stay silent and still be a member: the leader keeps liveness under one
# etcd lease of 60 s that must outlive every member's TTL by its renewal period (conductor/liveness.py)
MAX_MEMBER_TTL = 40


class RegisterRequest(Request):
    member: MemberInfo
    ttl: int = Field(default=5, ge=1, le=MAX_MEMBER_TTL, description="seconds without a keep-alive before it is dead")


class RegisterReply(Reply):
    lease: int


class LeaseRequest(Request):
    node_id: Name
    lease: int = Field(gt=0)
    stats: MemberStats | None = Field(default=None, description="the member's store statistics (cluster view)")


class LeaveReply(Reply):
    left: str
