"""Placements: lookups, puts, reports and removals, pins, heat, and the leader's change feed to followers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from ..blocks import KEY_BYTES
from .base import MAX_KEYS, BlockSizeValue, KeyHex, Name, PackedKeys, Reply, Request, packed_from_hex
from .members import MemberInfo


class LookupRequest(Request):
    tenant: Name
    keys: PackedKeys = Field(description="the block keys of one chain, in order (base64 of 32-byte keys)")
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


# The header of a lookup's answer saying what lookups at that conductor are worth: "leader",
# "follower" (in step with the leader: as good), "behind" (a follower that is not)
READ_ROLE_HEADER = "X-Tiercake-Read-Role"


class LookupReply(Reply):
    nodes: dict[str, PrefixHolding]


class LookupManyRequest(Request):
    """Many chains' lookups in one request (the key-value store's batches: one chain per object)."""

    tenant: Name
    chains: list[PackedKeys] = Field(max_length=MAX_KEYS, description="chains of block keys, each in order")
    sizes: bool = False

    @model_validator(mode="after")
    def _bounded(self) -> LookupManyRequest:
        if sum(len(c) for c in self.chains) > MAX_KEYS * KEY_BYTES:
            raise ValueError(f"at most {MAX_KEYS} keys in all chains of one lookup")
        return self


class LookupManyReply(Reply):
    found: list[dict[str, PrefixHolding]] = Field(description="per chain, in order: node -> what it holds")


class BlockSize(Request):
    key: KeyHex
    size: BlockSizeValue


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


class BlockBatch(Request):
    """Blocks of one tenant that ``node`` holds in ``tier`` (a report, a commit: ``sizes`` gives each
    one's size) or no longer holds (a removal, a revoke: no sizes). ``blocks`` is the previous
    release's form of a report, taken during a rolling upgrade."""

    tenant: Name
    node: Name
    tier: Name
    keys: PackedKeys = Field(default=b"", description="32-byte block keys back to back, base64")
    sizes: list[BlockSizeValue] = Field(default_factory=list, max_length=MAX_KEYS)
    blocks: list[BlockSize] | None = Field(default=None, max_length=MAX_KEYS)

    @model_validator(mode="after")
    def _packed(self) -> BlockBatch:
        if self.blocks is not None:
            if self.keys or self.sizes:
                raise ValueError("either keys (and sizes) or blocks, not both")
            self.keys, self.sizes = packed_from_hex([b.key for b in self.blocks]), [b.size for b in self.blocks]
            self.blocks = None
        if not self.keys:
            raise ValueError("keys: at least one block key")
        if self.sizes and len(self.sizes) * KEY_BYTES != len(self.keys):
            raise ValueError(f"{len(self.keys) // KEY_BYTES} keys for {len(self.sizes)} sizes")
        return self

    def key_list(self) -> list[bytes]:
        raw = bytes(self.keys)
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


class PinRequest(Request):
    tenant: Name
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)
    ttl: int | None = Field(default=None, ge=1, description="seconds; default: until unpinned")


class HeatHit(Request):
    tenant: Name
    key: str
    count: int = Field(ge=1, le=1_000_000)


class HeatCounts(Request):
    """One tenant's counted blocks, packed: the keys back to back, and each one's count."""

    tenant: Name
    keys: PackedKeys
    counts: list[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(min_length=1, max_length=MAX_KEYS)

    @model_validator(mode="after")
    def _one_count_a_key(self) -> HeatCounts:
        if len(self.counts) * KEY_BYTES != len(self.keys):
            raise ValueError(f"{len(self.keys) // KEY_BYTES} keys but {len(self.counts)} counts")
        return self


class HeatRequest(Request):
    """Accesses a follower conductor counted in its lookups (the leader decides replication): packed
    by tenant, or (a follower of the release before) one ``HeatHit`` a block, a model each, which
    cost the leader 2 us a block to parse where a packed block costs a tenth of it."""

    hits: list[HeatHit] = Field(default=[], max_length=MAX_KEYS)
    packed: list[HeatCounts] = Field(default=[], max_length=MAX_KEYS)

    @classmethod
    def packing(cls, hits: list[tuple[str, bytes, int]]) -> HeatRequest:
        """(tenant, key, count) of each counted block, packed by tenant."""
        by_tenant: dict[str, tuple[list[bytes], list[int]]] = {}
        for tenant, key, n in hits:
            keys, counts = by_tenant.setdefault(tenant, ([], []))
            keys.append(key)
            counts.append(n)
        return cls(packed=[HeatCounts(tenant=t, keys=b"".join(k), counts=c) for t, (k, c) in by_tenant.items()])

    @model_validator(mode="after")
    def _some_within_bounds(self) -> HeatRequest:
        blocks = len(self.hits) + sum(len(c.counts) for c in self.packed)
        if not 1 <= blocks <= MAX_KEYS:
            raise ValueError(f"1 to {MAX_KEYS} counted blocks, got {blocks}")
        return self


class PlacementChange(Reply):
    """One batch of placement changes as the leader applied it (``conductor.placement.Change``):
    blocks of one tenant ``node`` now holds in ``tier`` (``add``, with their sizes) or no longer
    holds (``remove``), or every replica of ``node`` gone (``drop``)."""

    kind: Literal["add", "remove", "drop"]
    tenant: str = ""
    node: str = ""
    tier: str = ""
    keys: bytes = Field(default=b"", description="32-byte block keys back to back")
    sizes: bytes = Field(default=b"", description="each block's size, a little-endian uint32 (additions)")


class FeedRequest(Request):
    """A follower asks the leader for the placement changes after ``after`` of ``term`` (0: none yet),
    or for the snapshot page at ``snapshot_row`` of one it is reading."""

    term: int = Field(ge=0)
    after: int = Field(ge=0)
    snapshot_row: int | None = Field(default=None, ge=0)
    wait_s: float = Field(default=0.0, ge=0, le=10, description="wait up to this long for a change")


class FeedReply(Reply):
    """The leader's placement changes for a follower: those after its ``after``, or (``reset``: it is
    in another term or too far behind) a snapshot's first page, replacing what it had, and then the
    next pages (``next_row``, until None); after the last page it asks for the changes after ``seq``,
    the sequence number the snapshot began at."""

    term: int
    seq: int = Field(description="the sequence number of the last change included, or the snapshot's")
    reset: bool
    changes: list[PlacementChange]
    next_row: int | None = Field(default=None, description="a snapshot's next page, if it has more")
    more: bool = Field(default=False, description="the log has changes past these: ask again at once")
    rereport_s: float | None = Field(default=None, ge=0, description="what the leader tells members of its term")


class CommitReply(Reply):
    committed: int


class ReportReply(Reply):
    reported: int
    new: int


class RevokeReply(Reply):
    revoked: int


class PlacementRemoveReply(Reply):
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
