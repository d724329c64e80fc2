"""Every message that crosses a process boundary, as one typed model imported by both sides.

Who sends what:

- front -> worker: ``GenerateRequest``; worker -> front: a stream of ``TokenEvent`` lines (NDJSON),
  the first carrying ``PrefillStats``, the last of a prefill the ``KVHandoff`` (where the prompt's
  blocks now are), or one ``ErrorReply`` line when the worker fails mid-stream.
- members (node agents, workers) <-> conductor: ``MemberInfo`` (with ``WorkerPerf``) to register,
  ``LeaseRequest`` with ``MemberStats`` to keep alive, answered by ``KeepAliveReply`` (pins version,
  ``ClusterSettings``, ``ReplicationTask``s); placement reports and lookups.
- operator <-> conductor: the control API's requests and replies (``ClusterView``, ``PrefixReply``...).
- every HTTP API, on any error: ``ErrorReply`` (OpenAI's error shape), nothing else.

Requests forbid unknown fields (a typo is a 400, not a silently ignored setting); replies ignore
them, so an older client keeps working against a newer server.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .blocks import Namespace

MAX_KEYS = 65536  # block keys in one control request

Name = Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]  # tenants, nodes, tiers: parts of etcd keys
KeyHex = Annotated[str, Field(pattern=r"^([0-9a-f]{2}){1,64}$")]


# The control API's version: 2 numbers it (``/health`` says it) and adds ``MemberInfo.ADDED``'s fields.
# A conductor takes members of its release and the one before; a member of this release registers
# with a conductor of the one before too (without the fields it would refuse).
CONTROL_API = 2


class Request(BaseModel):
    """A message a server validates: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Reply(BaseModel):
    """A message a client reads: unknown fields are ignored (newer servers may add some)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# Errors: one format for every HTTP API -----------------------------------------------------------


class ErrorInfo(Reply):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    leader: str | None = Field(default=None, description="a follower's answer to a write: the leader's URL")
    retryable: bool = Field(default=False, description="the same request may succeed if sent again")


class ErrorReply(Reply):
    """OpenAI's error body, used by the front, the control API and the workers alike."""

    error: ErrorInfo


# Members -----------------------------------------------------------------------------------------


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


class RegisterRequest(Request):
    member: MemberInfo
    ttl: int = Field(default=5, ge=1, le=3600, description="seconds without a keep-alive before it is dead")


class RegisterReply(Reply):
    lease: int


class LeaseRequest(Request):
    node_id: Name
    lease: int = Field(gt=0)
    stats: MemberStats | None = Field(default=None, description="the member's store statistics (cluster view)")


class LeaveReply(Reply):
    left: str


# Cluster settings (durable, followed by every conductor, handed to members) ----------------------


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
        description="the leader's term; when it changes, a member re-reports what it "
        "holds in the volatile tiers (the new leader has none of those placements)",
    )
    volatile_tiers: list[str] = Field(
        default_factory=list, description="tiers whose placements the conductors keep in memory only"
    )
    rereport_s: float | None = Field(
        default=None,
        ge=0,
        description="with a new term: the new leader kept its mirror of the old one's volatile "
        "replicas, so a member re-reports only the changes acknowledged in the last this many seconds; "
        "None: it has none, and a member re-reports everything it holds in the volatile tiers",
    )


# Placements --------------------------------------------------------------------------------------


class LookupRequest(Request):
    tenant: Name
    keys: list[str] = Field(max_length=MAX_KEYS, description="block keys of one chain, hex, in order")
    sizes: bool = Field(default=False, description="also answer each held block's size")


class PrefixHolding(Reply):
    """How much of a chain one node holds: ``length`` blocks from the start, by tier."""

    length: int
    tiers: dict[str, int] = Field(default_factory=dict)
    runs: list[tuple[str, int]] = Field(
        default_factory=list, description="the tier each block is served from, run-length encoded in chain order"
    )
    sizes: list[int] | None = Field(
        default=None, description="each held block's bytes, in chain order (only when the lookup asked for them)"
    )

    @property
    def majority_tier(self) -> str:
        return max(self.tiers, key=lambda tier: self.tiers[tier]) if self.tiers else "?"

    def served_from(self, start: int, count: int) -> dict[str, int]:
        """Tier -> blocks among blocks ``start .. start + count`` (by the runs; without them, all
        from the majority tier)."""
        if not self.runs:
            return {self.majority_tier: count} if count else {}
        out: dict[str, int] = {}
        at = 0
        for tier, n in self.runs:
            lo, hi = max(at, start), min(at + n, start + count)
            if hi > lo:
                out[tier] = out.get(tier, 0) + hi - lo
            at += n
        return out


class LookupReply(Reply):
    nodes: dict[str, PrefixHolding]


class LookupManyRequest(Request):
    """Many chains' lookups in one request (the key-value store's batches: one chain per object)."""

    tenant: Name
    chains: list[list[KeyHex]] = Field(max_length=MAX_KEYS, description="chains of block keys, hex, each in order")
    sizes: bool = False

    @model_validator(mode="after")
    def _bounded(self) -> LookupManyRequest:
        if sum(len(c) for c in self.chains) > MAX_KEYS:
            raise ValueError(f"at most {MAX_KEYS} keys in all chains of one lookup")
        return self


class LookupManyReply(Reply):
    found: list[dict[str, PrefixHolding]] = Field(description="per chain, in order: node -> what it holds")


class BlockSize(Request):
    key: KeyHex
    size: int = Field(ge=0)


class BeginRequest(Request):
    tenant: Name
    tier: Name
    blocks: list[BlockSize] = Field(min_length=1, max_length=MAX_KEYS)
    local: str | None = Field(default=None, description="the writer's node, for the local_first strategy")
    evict: bool = Field(
        default=False,
        description="the nodes may evict to make room (a cache's put): placed "
        "even where the index counts the tier full",
    )


class BeginReply(Reply):
    targets: dict[str, list[str]]


class CommitRequest(Request):
    """Replicas of ``node``; they are attached to the node's member lease (they go when it dies)."""

    tenant: Name
    node: Name
    tier: Name
    blocks: list[BlockSize] = Field(min_length=1, max_length=MAX_KEYS)


class RemoveRequest(Request):
    tenant: Name
    node: Name
    tier: Name
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)


class PinRequest(Request):
    tenant: Name
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)
    ttl: int | None = Field(default=None, ge=1, description="seconds; default: until unpinned")


class HeatHit(Request):
    tenant: Name
    key: str
    count: int = Field(ge=1, le=1_000_000)


class HeatRequest(Request):
    """Accesses a follower conductor counted in its lookups (the leader decides replication)."""

    hits: list[HeatHit] = Field(min_length=1, max_length=MAX_KEYS)


class VolatileChange(Reply):
    """One change of a volatile tier's replica, as the leader applied it."""

    tenant: Name
    key: KeyHex
    node: Name
    tier: Name
    size: int | None = Field(ge=0, description="the replica's size; None: it was removed")


class VolatileRequest(Request):
    """A follower asks the leader for the volatile changes after ``after`` of ``term`` (0: none yet)."""

    term: int = Field(ge=0)
    after: int = Field(ge=0)
    wait_s: float = Field(default=0.0, ge=0, le=10, description="wait up to this long for a change")


class VolatileReply(Reply):
    """The leader's volatile replicas for a follower: the changes after the follower's ``after``, or
    (``reset``) every replica it holds, when the follower is in another term or too far behind."""

    term: int
    seq: int = Field(description="the sequence number of the last change included")
    reset: bool
    changes: list[VolatileChange]
    rereport_s: float | None = Field(default=None, ge=0, description="what the leader tells members of its term")


class CommitReply(Reply):
    committed: int


class ReportReply(Reply):
    reported: int
    new: int


class RevokeReply(Reply):
    revoked: int


class RemoveReply(Reply):
    removed: int
    unknown: int


class PinReply(Reply):
    pinned: int


class UnpinReply(Reply):
    unpinned: int


class HeatReply(Reply):
    accepted: int


class NodeBlock(Reply):
    tenant: str
    key: str
    tier: str
    size: int
    pinned: bool


class NodeBlocksReply(Reply):
    blocks: list[NodeBlock]


class NodePin(Reply):
    tenant: str
    key: str


class NodePinsReply(Reply):
    version: int
    pins: list[NodePin]


class MembersReply(Reply):
    members: list[MemberInfo]


class ConductorInfo(Request):
    """What a conductor publishes about itself, so clients can find the leader's address."""

    conductor_id: str
    url: str = Field(description="where its HTTP API listens")


class LeaderReply(Reply):
    leader: ConductorInfo | None
    self_id: str = Field(alias="self")


# The operator's endpoints ------------------------------------------------------------------------


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
    lookups: int
    durable_ops: int
    durable_txns: int = 0  # backend transactions the durable changes went in (group-committed)
    volatile_ops: int = 0  # placement changes kept in the leader's memory only
    durable_changes: dict[str, int] = Field(default_factory=dict)  # by tier and kind: "pool+", "ssd-", ...
    durable_bytes: int
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


# The worker contract: front <-> worker -----------------------------------------------------------


class KVHandoff(Request):
    """Where a prompt's first ``blocks`` full blocks are held: the node a prefill worker wrote them to
    (the decode worker pulls them from there), or the node the router told a worker to pull from."""

    node: Name
    blocks: int = Field(ge=0)
    tier: str = Field(default="handoff", description="the tier the node holds them in (for the statistics)")
    runs: list[tuple[str, int]] = Field(
        default_factory=list,
        description="the tier of each block, run-length encoded (PrefixHolding.runs), when the index said",
    )


MAX_SESSION_S = 7 * 24 * 3600.0  # the longest pause or retention a session may announce


class SessionDirective(Request):
    """The conversation a request belongs to, and what its client asks of its KV. ``id`` and ``parent``
    are the front's hashes of the client's session ids, scoped by tenant: two tenants' equal ids never
    meet, and the client's own string goes no further than the front."""

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    parent: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description="a subagent's parent session")
    retain_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_S, description="keep its KV this long paused")
    priority: int = Field(default=0, ge=-100, le=100, description="kept before lower priorities in every tier")
    pause_s: float | None = Field(default=None, ge=0, le=MAX_SESSION_S, description="the pause expected after it")
    close: bool = Field(default=False, description="the conversation ends with this request")


class SessionCommand(Request):
    """The front asks the worker that ran a session's last turn to tell its tiers again: closed
    (``session.close``), or paused with a new retention and priority."""

    session: SessionDirective
    tenant: Name


class SessionInfo(Reply):
    """A session as the front has seen it (the control API's ``/v1/sessions``)."""

    id: str
    tenant: str
    parent: str | None = None
    state: Literal["active", "paused", "closed"]
    turns: int
    idle_s: float = Field(description="since its last turn began or ended")
    retain_s: float | None = None
    priority: int = 0
    pause_s: float | None = None
    worker: str | None = Field(default=None, description="the worker that ran its last turn")


class SessionsReply(Reply):
    sessions: list[SessionInfo]
    next_offset: int | None = Field(default=None, description="where the next page starts (None: this was the last)")


class SessionChange(Request):
    """``POST /v1/sessions/{id}``: close it now, or keep it longer or at another priority."""

    tenant: Name = "default"
    close: bool = False
    retain_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_S)
    priority: int | None = Field(default=None, ge=-100, le=100)


class GenerateRequest(Request):
    """What the front sends a worker (token ids: the front tokenizes)."""

    tokens: list[int] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling: the smallest set of tokens whose probabilities add up to it",
    )
    tenant: Name = "default"
    salt: str | None = Field(default=None, description="the hashing salt; default: the tenant")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64, description="torch's generator takes 64 bits")
    pull: bool = Field(default=True, description="load what nodes hold beyond the worker's own prefix")
    source: KVHandoff | None = Field(default=None, description="pull the prefix from here without asking the index")
    handoff: bool = Field(
        default=False,
        description="a prefill for a decode worker: its last event carries the "
        "KVHandoff, sent only once the blocks are on the node",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="each token's log-probability and this many most likely alternatives (none: no log-probabilities)",
    )
    session: SessionDirective | None = Field(default=None, description="the conversation it belongs to, if any")


class PrefillStats(Reply):
    """How a worker's prefill went: reuse, and where the time went."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens whose KV was reused, from any source
    sources: dict[str, int] = Field(default_factory=dict, description='"gpu" / "<node>:<tier>" -> blocks')
    block_size: int = Field(
        default=0,
        ge=0,
        description="tokens per block of sources (0: the serving config's; "
        "an engine with its own block size, as vLLM, says)",
    )
    lookup_s: float = 0.0
    load_s: float = 0.0
    load_bytes: int = 0
    load_tier: str | None = None  # the tier of the node that held most of the pulled blocks
    compute_s: float = 0.0
    written_blocks: int = 0  # new full blocks of the prompt written through to the worker's node
    refused_blocks: int = 0  # pulled blocks whose seal did not verify (forged or corrupt): recomputed instead
    prefetched_blocks: int = 0  # of the reused blocks, those pulled into the worker while the request waited
    copy_bytes_per_s: float | None = None  # the worker's memcpy rate, the floor of a load
    final: bool = Field(
        default=True,
        description="false: the engine learns what it reused only at the end "
        "(vLLM streaming); its last event carries the final figures",
    )


class TokenLogprob(Reply):
    token: int
    logprob: float


class TokenEvent(Reply):
    """One generated token; the first carries the prefill stats, the last its finish reason and, from
    a prefill made for a decode worker, the handoff. With ``logprobs`` asked for: the token's
    log-probability under the model (before temperature and top_p, as vLLM reports by default) and the
    most likely alternatives, most likely first."""

    token: int
    index: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stats: PrefillStats | None = None
    handoff: KVHandoff | None = None


class WorkerHealth(Reply):
    status: str
    worker: str
    role: str
    engine: str = "reference"
    pid: int
    frozen_objects: int = 0  # objects its start left that the collector no longer walks (tiercake.heap)


class WorkerLoadReply(Reply):
    waiting: int = 0
    prefilling: int = 0
    running: int = 0
    free_blocks: int = 0
    blocks: int = 0
    completed: int = 0
