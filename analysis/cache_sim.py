"""The offline cache simulator: a trace's block accesses through eviction and admission policies (the
same objects the live store runs), over one or several tiers, and the offline optimum.

Accesses are the trace's ``hash_ids`` in file order, each request's blocks in chain order; with a
``tenant`` field, tenants' blocks are apart. A block hits in the tier that holds it; a hit below the
first tier promotes it to the first; a miss enters the first tier that admits it; a tier's victim
spills to the next tier that admits it, and the last tier's victim is dropped.

The optimum is Belady's MIN constrained to the prefix tree: on a miss with a full cache, evict the
cached block used again farthest in the future, among leaves only (a block is only usable with its
whole prefix). Since a request that uses a block also uses its parent just before, a parent's next use
always comes before its children's, so the farthest block is always a leaf (ties, such as blocks never
used again, go to the deepest): the constraint costs MIN nothing, and no policy can beat it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from tiercake.policies.admission import AlwaysAdmit
from tiercake.policies.base import AdmissionPolicy, BlockMeta, EvictionPolicy, SessionEvent, SessionState, one_victim
from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord, oracle_announcements


@dataclass(slots=True)
class Access:
    key: Hashable
    parent: Hashable | None
    depth: int
    tokens: int
    tenant: str | None = None


def accesses(records: Iterable[TraceRecord]) -> list[Access]:
    """The block access stream of a trace."""
    out: list[Access] = []
    for record in records:
        out.extend(_record_accesses(record))
    return out


def _key(record: TraceRecord, block: Hashable) -> Hashable:
    return block if record.tenant is None else (record.tenant, block)


def _record_accesses(record: TraceRecord) -> list[Access]:
    out: list[Access] = []
    parent = None
    for i, h in enumerate(record.hash_ids):
        key = _key(record, h)
        out.append(Access(key, parent, i, record.block_tokens(i), record.tenant))
        parent = key
    return out


# What a session-aware policy is told, from least to most: nothing; that sessions exist (active,
# then paused, expiring by retention); also when they close; also the pause each turn announced (all
# as the trace carries them); and, apart, the oracle: every pause and close from the trace's future.
SESSION_INFO = ("none", "open", "close", "announced", "oracle")
Event = Access | SessionEvent


def session_stream(
    records: Iterable[TraceRecord], info: str = "announced", announce_sigma: float = 0.0, seed: int = 0
) -> list[Event]:
    """The access stream with each record's session events around its accesses: ACTIVE before (the
    turn's prompt), then PAUSED or, with ``info`` "close" or more, CLOSED after its last turn. Records
    need ``session`` (``infer_sessions`` adds it); those without one get no events. Pauses and closes
    are the trace's own, except at "oracle", the one level that reads the future
    (``oracle_announcements``). ``announce_sigma`` puts a log-normal error on each announced pause
    (clients guess a tool call's length)."""
    if info not in SESSION_INFO:
        raise ValueError(f"session info must be one of {', '.join(SESSION_INFO)}, got {info!r}")
    if not (math.isfinite(announce_sigma) and announce_sigma >= 0):
        raise ValueError(f"announce_sigma must be finite and >= 0, got {announce_sigma}")
    rng = random.Random(seed)
    if info == "oracle":
        records = oracle_announcements(records)
    out: list[Event] = []
    for record in records:
        if info == "none" or record.session is None:
            out.extend(_record_accesses(record))
            continue
        sid, at = (record.tenant, record.session), record.timestamp / 1000
        full = len(record.hash_ids) - (record.input_length % TRACE_BLOCK_TOKENS != 0)
        tenant = record.tenant or ""
        reads = _record_accesses(record)
        prompt = tuple(a.key for a in reads)
        keys = prompt[:full]  # a partial block changes next turn
        out.append(SessionEvent(sid, SessionState.ACTIVE, at, prompt, tenant=tenant))
        out.extend(reads)
        if info != "open" and record.closes:
            out.append(SessionEvent(sid, SessionState.CLOSED, at, tenant=tenant))
            continue
        pause = None
        if info in ("announced", "oracle") and record.pause_ms is not None:
            pause = record.pause_ms / 1000 * (math.exp(rng.gauss(0, announce_sigma)) if announce_sigma else 1.0)
        out.append(SessionEvent(sid, SessionState.PAUSED, at, keys, pause, tenant=tenant))
    return out


@dataclass(slots=True)
class TierSpec:
    capacity: float  # blocks; math.inf for an unbounded tier
    eviction: EvictionPolicy
    admission: AdmissionPolicy = field(default_factory=AlwaysAdmit)
    name: str = ""


@dataclass
class SimResult:
    accesses: int = 0
    tokens: int = 0
    hits: list[int] = field(default_factory=list)  # per tier
    token_hits: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    tenant_accesses: dict[str | None, int] = field(default_factory=dict)
    tenant_hits: dict[str | None, int] = field(default_factory=dict)

    def tenant_hit_ratio(self, tenant: str | None) -> float:
        accesses = self.tenant_accesses.get(tenant, 0)
        return self.tenant_hits.get(tenant, 0) / accesses if accesses else 0.0

    @property
    def hit_ratio(self) -> float:
        return sum(self.hits) / self.accesses if self.accesses else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return sum(self.token_hits) / self.tokens if self.tokens else 0.0

    def tier_ratios(self) -> dict[str, float]:
        return {name: hits / self.accesses if self.accesses else 0.0 for name, hits in zip(self.tiers, self.hits)}


def simulate(stream: list[Access] | list[Event], tiers: list[TierSpec]) -> SimResult:
    """Replay ``stream`` through ``tiers`` (fastest first); session events go to every tier's policy."""
    if not tiers:
        raise ValueError("at least one tier")
    where: dict[Hashable, int] = {}  # key -> the tier holding it
    sizes = [0] * len(tiers)
    metas: dict[Hashable, BlockMeta] = {}
    result = SimResult(
        hits=[0] * len(tiers), token_hits=[0] * len(tiers), tiers=[t.name or f"tier{i}" for i, t in enumerate(tiers)]
    )

    def place(key: Hashable, start: int) -> None:
        """Put ``key`` into the first tier from ``start`` that admits it, spilling victims down."""
        meta = metas[key]
        for i in range(start, len(tiers)):
            tier = tiers[i]
            if tier.capacity <= 0 or not tier.admission.admit(key, meta):
                continue
            if sizes[i] >= tier.capacity:
                victim = one_victim(tier.eviction, where)
                del where[victim]
                sizes[i] -= 1
                place(victim, i + 1)
            where[key] = i
            sizes[i] += 1
            tier.eviction.on_insert(key, meta)
            return
        metas.pop(key, None)  # no tier took it: forgotten

    for access in stream:
        if isinstance(access, SessionEvent):
            for tier in tiers:
                tier.eviction.on_session(access)
            continue
        key = access.key
        result.accesses += 1
        result.tokens += access.tokens
        tenant = access.tenant
        result.tenant_accesses[tenant] = result.tenant_accesses.get(tenant, 0) + 1
        tier_index = where.get(key)
        if tier_index is not None:
            result.tenant_hits[tenant] = result.tenant_hits.get(tenant, 0) + 1
            result.hits[tier_index] += 1
            result.token_hits[tier_index] += access.tokens
            tiers[tier_index].eviction.on_access(key)
            if tier_index > 0:  # promote: out of its tier, into the first that admits it
                tiers[tier_index].eviction.on_remove(key)
                del where[key]
                sizes[tier_index] -= 1
                place(key, 0)
            continue
        metas[key] = BlockMeta(parent=access.parent, size=1, tenant=access.tenant or "")
        place(key, 0)
    return result


def optimum(stream: list[Access] | list[Event], capacity: float) -> SimResult:
    """Tree-constrained Belady MIN over one tier of ``capacity`` blocks (session events are ignored:
    it knows the future already)."""
    stream = [a for a in stream if isinstance(a, Access)]
    n = len(stream)
    next_use = [math.inf] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        key = stream[i].key
        next_use[i] = last.get(key, math.inf)
        last[key] = i
    cached: dict[Hashable, float] = {}  # key -> its next use
    heap: list[tuple[float, int, int, Hashable]] = []  # (-next use, -depth, tiebreak, key), lazily valid
    result = SimResult(hits=[0], token_hits=[0], tiers=["optimum"])
    for i, access in enumerate(stream):
        key = access.key
        result.accesses += 1
        result.tokens += access.tokens
        if key in cached:
            result.hits[0] += 1
            result.token_hits[0] += access.tokens
        elif capacity <= 0:
            continue
        elif len(cached) >= capacity:
            while True:
                entry = heapq.heappop(heap)
                neg_next, victim = entry[0], entry[3]
                if cached.get(victim) == -neg_next:
                    break
            if -neg_next < next_use[i]:  # every cached block is needed before this one: bypass
                heapq.heappush(heap, entry)
                continue
            del cached[victim]
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], -access.depth, i, key))
    return result
