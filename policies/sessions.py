"""The session-aware eviction policy: a block that an open conversation will read again is kept until
its conversation is expected back, and the blocks of conversations that come back last go first.

Design note. Block streams say what was read, never whether a conversation goes on. Sessions say it:
a paused session will read its whole conversation again when it resumes (its next prompt extends the
last one), at about the time its client announced, and a closed one never will. So a tier's residents
split in two:

- **held** blocks, listed by at least one open session (active or paused): they leave in the order of
  Belady's rule applied to sessions, the lowest priority first, then the session expected back last,
  its deepest blocks first (a chain is only usable with its whole prefix). A block shared with
  another open session stays while that one holds it.
- **free** blocks, listed by none (closed or expired sessions, requests outside any session, a shared
  system prompt between conversations): a session-blind policy (``fallback``, by default ``reuse``)
  orders them, and they leave before any held block.

An announced pause is read as the announcements so far say to read it: the policy learns how far the
real pauses fall from the announced ones (the mean of log(real / announced)), so that clients that
always announce half the pause are believed at twice what they say.

A paused session without an announced pause is expected to stay quiet as long again as it has been
(at least the mean pause seen), divided by how likely a session paused after as many turns is to come
back at all (learned online: most one-turn conversations never do). A paused session expires ``retain_s`` after its
pause (its own ``retain_s`` or the policy's): its blocks become free. Time comes only from the events
(``SessionEvent.at``), so the simulator and the live conductor drive it the same way.

What clients tell may be worth less than a blind ordering's guess (sessions that never announce a
pause, or are abandoned without a close): the policy keeps a shadow of the tier under its own
ordering and under each of ``blind`` (LRU, ARC, S3-FIFO and ``reuse`` by default), and evicts in the
order of whichever has hit most lately (``learned.Shadows``), so that it is never much below the best
of them. While a blind ordering leads, tenant quotas still let go of sessions, but the blind order
picks the victims.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import DEFAULT_RETAIN_S, BlockMeta, CanEvict, EvictionPolicy, Key, SessionEvent, SessionState, _always
from .eviction import ARC, LRU, S3FIFO, ReuseAware
from .learned import Shadows

# the blind orderings a session policy learns against unless told otherwise: the best of them is
# its floor (issue 48)
BLIND: tuple[Callable[[], EvictionPolicy], ...] = (LRU, ARC, S3FIFO, ReuseAware)


@dataclass(slots=True)
class _Session:
    keys: tuple[Key, ...] = ()
    state: SessionState = SessionState.ACTIVE
    resume_at: float = 0.0
    paused_at: float = 0.0
    announced: bool = False
    told: float = 0.0  # the pause its client announced, when it did
    priority: int = 0
    tenant: str = ""
    turns: int = 0  # pauses so far: turns it has finished
    version: int = 0
    cursor: int = 0  # how many of its keys, deepest first, were looked at for eviction in this version
    passed: bool = False  # looked at to its root: every other open session is expected back sooner


class SessionAware(EvictionPolicy):
    """Evicts blocks of no open session first (by ``fallback``), then blocks of the paused session
    expected back last (lowest ``priority`` first), deepest first; blocks of active sessions last of
    all. See the module's design note."""

    name = "session"
    TURN_BUCKETS = 4  # sessions paused after 1, 2, 3, 4+ turns learn apart how often they come back

    def __init__(
        self,
        fallback: EvictionPolicy | None = None,
        retain_s: float = DEFAULT_RETAIN_S,
        initial_pause_s: float = 60.0,
        tenant_quota: float | None = None,
        tenant_floor: float = 0.0,
        max_sessions: int = 1_000_000,
        max_tenant_sessions: int = 10_000,
        blind: Sequence[Callable[[], EvictionPolicy]] | None = None,
        half_life: float = 8.0,
        margin: float = 0.05,
    ) -> None:
        """``tenant_quota``: the most a tenant's paused sessions retain in this tier (in the unit of
        ``BlockMeta.size``: bytes in a store, blocks in the simulator); past it, its sessions expected
        back last are let go (their blocks are then like any other). ``tenant_floor``: what a tenant's
        sessions keep while another tenant's held blocks can go instead. ``max_sessions``: the most
        sessions tracked, and ``max_tenant_sessions`` of one tenant's: past them, the paused sessions
        whose retention ends first are let go early, of the newcomer's own tenant (past the total: of
        the tenant that holds the most), so that a client opening sessions without end costs bounded
        memory and another tenant's sessions nothing; a session there is no room for is not tracked
        (its blocks are like any other's). ``blind``: factories of the session-blind orderings it
        learns against (None: ``BLIND``; empty: it follows its own ordering always); ``half_life``
        and ``margin`` as ``learned.Shadows`` takes them."""
        if max_sessions < 1 or max_tenant_sessions < 1:
            raise ValueError("max_sessions and max_tenant_sessions must be at least 1")
        if not (0 < retain_s < math.inf and 0 < initial_pause_s < math.inf):
            raise ValueError("retain_s and initial_pause_s must be positive, finite seconds")
        if tenant_quota is not None and not 0 < tenant_quota < math.inf:
            raise ValueError("tenant_quota must be positive and finite (or None: no quota)")
        if not 0 <= tenant_floor < math.inf:
            raise ValueError("tenant_floor must be finite and not negative")
        if isinstance(fallback, SessionAware):
            raise ValueError("the fallback of the session policy must be a session-blind policy")
        self.retain_s, self.tenant_quota, self.tenant_floor = retain_s, tenant_quota, tenant_floor
        self.max_sessions, self.max_tenant_sessions = max_sessions, max_tenant_sessions
        self._per_tenant: Counter[str] = Counter()  # sessions tracked, by tenant
        self._tenant_expiry: dict[str, list[tuple[float, int, Any]]] = {}  # the same as _expiry, by tenant
        self._free = fallback if fallback is not None else ReuseAware()
        self._held: dict[Key, None] = {}  # resident keys that an open session lists, oldest first
        self._metas: dict[Key, BlockMeta] = {}  # every resident key's, for the fallback when it is freed
        self._holders: dict[Key, int] = {}  # key -> how many open sessions list it
        # key -> how many of those are not passed yet; a held key with none is expected back after
        # everything else held, and waits in _ready
        self._unpassed: dict[Key, int] = {}
        self._ready: deque[Key] = deque()
        self._sessions: dict[Any, _Session] = {}
        # per tenant, its paused sessions, lazily valid: (priority, -resume_at, version, session) for
        # announced pauses, (priority, paused_at, version, session) for the others
        self._announced: dict[Any, list[tuple[int, float, int, Any]]] = {}  # by tenant
        self._unannounced: dict[Any, list[tuple[int, float, int, Any]]] = {}  # by (tenant, turns bucket)
        # per turns bucket: [resumed, paused]: how often a session paused after that many turns came back
        self._resumed: dict[int, list[float]] = {}
        self._owner: dict[Key, str] = {}  # a listed key's tenant (its first holder's)
        self._held_size: dict[str, float] = {}  # per tenant: the sizes of its resident held blocks
        self._expiry: list[tuple[float, int, Any]] = []  # (expires at, version, session), lazy
        self._now = 0.0
        self._pause_mean = initial_pause_s
        self._pauses_seen = 0
        # how announcements compare with what happened: the running mean of log(real pause /
        # announced) over the last thousand or so, so that a client that always says half is
        # believed at twice
        self._told_n = 0
        self._told_mean = 0.0
        self._size = 0  # of every resident key, in the unit of BlockMeta.size
        blind = BLIND if blind is None else tuple(blind)
        self._blind = [make() for make in blind]  # each ordering over the real residents
        self._shadows: Shadows | None = None
        if self._blind:
            twin = SessionAware(
                copy.deepcopy(self._free), retain_s, initial_pause_s, tenant_quota, tenant_floor,
                max_sessions, max_tenant_sessions, blind=(),
            )  # fmt: skip
            self._shadows = Shadows([twin, *(make() for make in blind)], self._metas, half_life, margin)

    @classmethod
    def from_params(cls, params: dict[str, Any], create: Callable[..., EvictionPolicy]) -> SessionAware:
        """From the registry: ``fallback`` (a policy's name, default "reuse") and ``fallback_params``
        name the session-blind policy; the rest are this one's."""
        params = dict(params)
        fallback = params.pop("fallback", "reuse")
        if fallback == cls.name:
            raise ValueError("the fallback of the session policy must be a session-blind policy")
        blind = params.pop("blind", None)
        if blind is not None:
            if not isinstance(blind, list | tuple) or not all(isinstance(b, str) for b in blind):
                raise ValueError("blind must be a list of session-blind policies' names")
            if cls.name in blind:
                raise ValueError("the session policy cannot learn against itself")
            params["blind"] = [lambda name=name: create(name, None) for name in blind]
        return cls(create(fallback, params.pop("fallback_params", None)), **params)

    # --- blocks -----------------------------------------------------------------------------------

    def on_insert(self, key: Key, meta: BlockMeta = BlockMeta()) -> None:
        if key in self._held or key in self._free:
            self.on_access(key)
            return
        self._metas[key] = meta
        self._size += meta.size
        if self._shadows is not None:
            self._shadows.read(key, meta)
        for ordering in self._blind:
            ordering.on_insert(key, meta)
        if self._holders.get(key):
            self._hold(key)
            self._enforce_quota(self._owner[key])
        else:
            self._free.on_insert(key, meta)

    def on_access(self, key: Key) -> None:
        if key not in self._held:
            self._free.on_access(key)
        if self._shadows is not None and key in self._metas:
            self._shadows.read(key, self._metas[key])
        for ordering in self._blind:
            ordering.on_access(key)

    def on_remove(self, key: Key) -> None:
        self._forget(key)
        if self._shadows is not None:
            self._shadows.remove(key)

    def _forget(self, key: Key, chooser: EvictionPolicy | None = None) -> None:
        """``key`` is no longer resident, in every ordering but ``chooser``, which evicted it and
        may remember it as a ghost (the shadows are told apart)."""
        if key in self._held:
            self._unhold(key)
        meta = self._metas.pop(key, None)
        if meta is not None:
            self._size -= meta.size
        for ordering in (self._free, *self._blind):
            if ordering is not chooser:
                ordering.on_remove(key)
        if self._shadows is not None:
            self._shadows.evicted(key)

    def victims(self, n: int, can_evict: CanEvict = _always) -> list[Key]:
        leader, chosen = 0, []
        if self._shadows is not None:
            self._shadows.full(self._size, len(self._metas))
            leader = self._shadows.leader
            chosen = self._shadows.not_kept(n, can_evict)  # first what the leader would not hold
            for key in chosen:
                self._forget(key)
        if len(chosen) < n:
            chooser = self._free if leader == 0 else self._blind[leader - 1]
            more = (
                self._ordered_victims(n - len(chosen), can_evict)
                if leader == 0
                else chooser.victims(n - len(chosen), can_evict)
            )
            for key in more:
                self._forget(key, chooser)
            chosen += more
        return chosen

    def _ordered_victims(self, n: int, can_evict: CanEvict) -> list[Key]:
        """Up to ``n`` victims in this policy's own order: free blocks first, then held ones."""
        chosen = self._free.victims(n, can_evict)
        while len(chosen) < n:
            victim = self._ready_victim(can_evict)
            if victim is None:
                victim = self._paused_victim(can_evict)
            if victim is None:
                victim = self._any_held(can_evict)
            if victim is None:
                break
            self._unhold(victim)
            chosen.append(victim)
        return chosen

    def _ready_victim(self, can_evict: CanEvict) -> Key | None:
        """A held block whose every open session has been passed (shared blocks of passed sessions)."""
        skipped = []
        found = None
        while self._ready:
            key = self._ready.popleft()
            if key not in self._held or self._unpassed.get(key, 0):
                continue  # freed, evicted or listed again since
            if can_evict(key):
                found = key
                break
            skipped.append(key)
        self._ready.extendleft(reversed(skipped))
        return found

    def _paused_victim(self, can_evict: CanEvict) -> Key | None:
        """The deepest block of the paused session expected back last that no session expected back
        sooner lists; a session looked at to its root is passed. Tenants at or below their floor are
        left for last."""
        while True:
            latest = self._latest_back(protect=True)
            if latest is None:
                return None
            sid, heap = latest
            session = self._sessions[sid]
            keys = session.keys
            while session.cursor < len(keys):
                key = keys[len(keys) - 1 - session.cursor]
                session.cursor += 1
                if key in self._held and self._unpassed.get(key) == 1 and can_evict(key):
                    return key
            heapq.heappop(heap)
            self._pass(session)

    def _latest_back(self, protect: bool, tenant: str | None = None) -> tuple[Any, list] | None:
        """The paused session expected back last (of ``tenant``, or of any tenant, those above their
        floor first when ``protect``), lowest priority first, with the heap it tops."""
        best: tuple[bool, int, float, float] | None = None
        found = None
        lanes = [(t, self._announced) for t in self._announced] + [(t, self._unannounced) for t in self._unannounced]
        for lane, heaps in lanes:
            t = lane if heaps is self._announced else lane[0]
            if tenant is not None and t != tenant:
                continue
            floor_kept = protect and 0 < self.tenant_floor >= self._held_size.get(t, 0)
            heap = self._valid_top(heaps, lane)
            if heap is None:
                continue
            session = self._sessions[heap[0][3]]
            # ties (pauses shorter than the mean) go to the longest quiet, as one heap would order them
            rank = (floor_kept, session.priority, -self._remaining(session), session.paused_at)
            if best is None or rank < best:
                best, found = rank, (heap[0][3], heap)
        return found

    def _valid_top(self, heaps: dict[Any, list], lane: Any) -> list | None:
        heap = heaps.get(lane)
        while heap:
            _, _, version, sid = heap[0]
            session = self._sessions.get(sid)
            if session is not None and session.version == version and session.state is SessionState.PAUSED:
                return heap
            heapq.heappop(heap)
        heaps.pop(lane, None)
        return None

    def _remaining(self, session: _Session) -> float:
        """How long until it is back: an announced pause ends when announced; an unannounced one is
        expected to last as long again as it has lasted so far, and at least the mean pause (the
        longer a conversation has been quiet, the longer it stays so)."""
        if session.announced:
            return session.resume_at - self._now
        return max(self._pause_mean, self._now - session.paused_at) / self._p_resume(session.turns)

    def _bucket(self, turns: int) -> int:
        return min(turns, self.TURN_BUCKETS)

    def _p_resume(self, turns: int) -> float:
        """How likely a session paused after ``turns`` turns is to come back, as seen so far (sessions
        of one turn rarely do: most of a chat trace's sessions are one question)."""
        resumed, paused = self._resumed.get(self._bucket(turns), (1.0, 2.0))
        return max(resumed / paused, 0.01)

    def _enforce_quota(self, tenant: str) -> None:
        """A tenant past its quota lets go of its sessions expected back last until it is within it."""
        if self.tenant_quota is None:
            return
        while self._held_size.get(tenant, 0) > self.tenant_quota:
            latest = self._latest_back(protect=False, tenant=tenant)
            if latest is None:
                return  # only active sessions: they hold what they are computing
            sid, _ = latest
            self._close(sid, self._sessions[sid])

    def _any_held(self, can_evict: CanEvict) -> Key | None:
        """The last resort, when only blocks of active sessions or shared ones are left: the oldest."""
        return next((key for key in self._held if can_evict(key)), None)

    # --- sessions ---------------------------------------------------------------------------------

    def on_session(self, event: SessionEvent) -> None:
        if self._shadows is not None:
            self._shadows.on_session(event)
        self._advance(event.at)
        session = self._sessions.get(event.session)
        if event.state is SessionState.CLOSED:
            if session is not None:
                self._close(event.session, session)
            return
        if session is None:
            if not self._make_room(event.tenant):
                return  # no room that its own tenant can give: not tracked
            session = self._sessions[event.session] = _Session(tenant=event.tenant)
            self._per_tenant[event.tenant] += 1
        self._unpass(session)
        self._relist(session, event.keys)
        session.version += 1
        session.cursor = 0
        session.priority = event.priority
        if event.state is SessionState.ACTIVE:
            if session.state is SessionState.PAUSED:
                self._resumed.setdefault(self._bucket(session.turns), [1.0, 2.0])[0] += 1
                if not session.announced:
                    self._learn_pause(self._now - session.paused_at)
                else:
                    self._learn_told(self._now - session.paused_at, session.told)
            session.state, session.resume_at = SessionState.ACTIVE, self._now
            return
        session.state, session.paused_at = SessionState.PAUSED, self._now
        session.turns += 1
        self._resumed.setdefault(self._bucket(session.turns), [1.0, 2.0])[1] += 1
        session.announced = event.resume_in is not None
        session.told = event.resume_in if event.resume_in is not None else 0.0
        pause = self._believe(event.resume_in) if event.resume_in is not None else self._pause_mean
        session.resume_at = self._now + max(0.0, pause)
        if session.announced:
            entry = (session.priority, -session.resume_at, session.version, event.session)
            heapq.heappush(self._announced.setdefault(session.tenant, []), entry)
        else:
            entry = (session.priority, session.paused_at, session.version, event.session)
            lane = (session.tenant, self._bucket(session.turns))
            heapq.heappush(self._unannounced.setdefault(lane, []), entry)
        retain = event.retain_s if event.retain_s is not None else self.retain_s
        heapq.heappush(self._expiry, (self._now + retain, session.version, event.session))
        heapq.heappush(
            self._tenant_expiry.setdefault(session.tenant, []), (self._now + retain, session.version, event.session)
        )
        self._enforce_quota(session.tenant)

    def _advance(self, at: float) -> None:
        self._now = max(self._now, at)
        while self._expiry and self._expiry[0][0] <= self._now:
            _, version, sid = heapq.heappop(self._expiry)
            session = self._sessions.get(sid)
            if session is not None and session.version == version and session.state is SessionState.PAUSED:
                self._close(sid, session)

    def _make_room(self, tenant: str) -> bool:
        """Room for one more of ``tenant``'s sessions (whether there is): past its own bound, its
        paused sessions go in the order their retention would end; past the total, those of the
        tenant that holds the most."""
        if self._per_tenant[tenant] >= self.max_tenant_sessions and not self._let_go(tenant):
            return False
        while len(self._sessions) >= self.max_sessions:
            if not self._let_go(max(self._per_tenant, key=self._per_tenant.__getitem__)):
                return False
        return True

    def _let_go(self, tenant: str) -> bool:
        """Close ``tenant``'s paused session whose retention ends first; whether there was one."""
        heap = self._tenant_expiry.get(tenant, [])
        while heap:
            _, version, sid = heapq.heappop(heap)
            session = self._sessions.get(sid)
            if session is not None and session.version == version and session.state is SessionState.PAUSED:
                self._close(sid, session)
                return True
        return False

    def _learn_told(self, real: float, told: float) -> None:
        ratio = math.log(max(real, 1e-3) / max(told, 1e-3))
        self._told_n = min(self._told_n + 1, 1000)
        self._told_mean += (ratio - self._told_mean) / self._told_n

    def _believe(self, told: float) -> float:
        """An announced pause as the announcements so far say to read it."""
        if self._told_n < 8:  # too few to judge: taken as said
            return told
        return told * math.exp(self._told_mean)

    def _learn_pause(self, pause: float) -> None:
        self._pauses_seen += 1
        self._pause_mean += (pause - self._pause_mean) / min(self._pauses_seen, 1000)

    def _close(self, sid: Any, session: _Session) -> None:
        self._pass(session)
        self._relist(session, ())
        del self._sessions[sid]
        self._per_tenant[session.tenant] -= 1
        if not self._per_tenant[session.tenant]:
            del self._per_tenant[session.tenant]
            self._tenant_expiry.pop(session.tenant, None)

    def _pass(self, session: _Session) -> None:
        if session.passed:
            return
        session.passed = True
        for key in reversed(session.keys):
            left = self._unpassed[key] - 1
            self._unpassed[key] = left
            if not left and key in self._held:
                self._ready.append(key)

    def _unpass(self, session: _Session) -> None:
        if not session.passed:
            return
        session.passed = False
        for key in session.keys:
            self._unpassed[key] += 1

    def _relist(self, session: _Session, keys: tuple[Key, ...]) -> None:
        """The session lists ``keys`` now: holders counted up and down, blocks moved between the sets.
        A passed session's keys are not counted in ``_unpassed``."""
        old, new = set(session.keys), set(keys)
        unpassed = 0 if session.passed else 1
        for key in dict.fromkeys(k for k in keys if k not in old):
            count = self._holders.get(key, 0)
            self._holders[key] = count + 1
            self._unpassed[key] = self._unpassed.get(key, 0) + unpassed
            if count == 0:
                self._owner[key] = session.tenant
                if key in self._free:
                    self._free.on_remove(key)
                    self._hold(key)
        for key in dict.fromkeys(k for k in reversed(session.keys) if k not in new):  # deepest freed first
            count = self._holders[key] - 1
            self._unpassed[key] -= unpassed
            if count:
                self._holders[key] = count
                if not self._unpassed[key] and key in self._held:
                    self._ready.append(key)
                continue
            del self._holders[key]
            del self._unpassed[key]
            if key in self._held:
                self._unhold(key)
                self._free.on_insert(key, self._metas[key])
            del self._owner[key]
        session.keys = tuple(keys)

    def _hold(self, key: Key) -> None:
        self._held[key] = None
        tenant = self._owner[key]
        self._held_size[tenant] = self._held_size.get(tenant, 0) + self._metas[key].size
        if not self._unpassed.get(key):  # every session listing it was passed before it arrived here
            self._ready.append(key)

    def _unhold(self, key: Key) -> None:
        del self._held[key]
        tenant = self._owner[key]
        left = self._held_size[tenant] - self._metas[key].size
        if left > 0:
            self._held_size[tenant] = left
        else:
            del self._held_size[tenant]

    # --- introspection ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held) + len(self._free)

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._free

    def describe(self) -> dict[str, Any]:
        states = [s.state.value for s in self._sessions.values()]
        return {
            **super().describe(),
            "held": len(self._held),
            "free": self._free.describe(),
            "sessions": {state.value: states.count(state.value) for state in SessionState if state.value in states},
            "mean_pause_s": round(self._pause_mean, 3),
            "announced_read_as": round(math.exp(self._told_mean), 3) if self._told_n >= 8 else 1.0,
            "held_by_tenant": dict(self._held_size),
            **({"learned": self._shadows.describe()} if self._shadows is not None else {}),
        }
