"""The front's book of sessions: each one it has served (by tenant and hashed id), its state, its
last directives and the worker that ran its last turn, for the control API (list, close, retain).

The book is the front's view, not the tiers': a session whose KV a tier dropped is still listed until
it closes or ages out; one front's book knows only the sessions it served. Bounded per tenant: at
most ``max_per_tenant`` of a tenant's sessions (its least recently used go), and ``max_sessions`` in
all, where room is made in the tenant that holds the most: one tenant opening sessions by the
hundred thousand lets go of its own, never of another's. Closed sessions are kept ``closed_kept_s``
so that a list shows what just ended; a list comes in pages.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from tiercake.messages import SessionDirective, SessionInfo
from tiercake.policies.base import DEFAULT_RETAIN_S


@dataclass(slots=True)
class SessionRecord:
    tenant: str
    directive: SessionDirective
    state: str = "active"
    turns: int = 0
    since: float = 0.0  # monotonic: the last turn's start or end
    worker: str | None = None  # the worker its last turn ended on (the decode worker, when split)
    prefilled_on: str | None = None  # the worker that computed its last prompt: its next turn's affinity


class SessionBook:
    HELD_EVERY_S = 1.0  # how stale the count of paused sessions per worker may be

    def __init__(self, max_sessions: int = 100_000, closed_kept_s: float = 300.0, max_per_tenant: int = 10_000) -> None:
        if max_sessions < 1 or max_per_tenant < 1:
            raise ValueError("a session book holds at least one session, of each tenant")
        self.max_sessions, self.max_per_tenant, self.closed_kept_s = max_sessions, max_per_tenant, closed_kept_s
        self._tenants: dict[str, OrderedDict[str, SessionRecord]] = {}  # tenant -> its sessions, LRU first
        self._count = 0
        self._held: tuple[float, Counter[str]] = (-float("inf"), Counter())

    def began(self, tenant: str, session: SessionDirective) -> tuple[str, ...]:
        """A turn of ``session`` starts; the workers a session-aware router prefers for it: the one
        that computed its last turn, then its parent's (a subagent's first turn starts where the
        prefix it shares was computed)."""
        affinity = tuple(
            w
            for w in (
                self._prefilled_on(tenant, session.id),
                session.parent and self._prefilled_on(tenant, session.parent),
            )
            if w
        )
        self._start(tenant, session)
        return affinity

    def _prefilled_on(self, tenant: str, session: str) -> str | None:
        record = self.get(tenant, session)
        return None if record is None or record.state == "closed" else record.prefilled_on

    def _start(self, tenant: str, session: SessionDirective) -> None:
        records = self._tenants.setdefault(tenant, OrderedDict())
        record = records.get(session.id)
        if record is None:
            self._make_room(tenant)
            record = records[session.id] = SessionRecord(tenant, session)
            self._count += 1
        records.move_to_end(session.id)
        if record.state == "paused" and record.prefilled_on:
            self._held[1][record.prefilled_on] -= 1  # counted until the next recount
        record.directive, record.state, record.since = session, "active", time.monotonic()

    def _make_room(self, tenant: str) -> None:
        """Room for one more of ``tenant``'s sessions: past its own bound its least recently used
        goes; past the book's, the least recently used of the tenant that holds the most."""
        if len(self._tenants[tenant]) >= self.max_per_tenant:
            self._drop_oldest(tenant)
        if self._count >= self.max_sessions:
            self._drop_oldest(max(self._tenants, key=lambda t: len(self._tenants[t])))

    def _drop_oldest(self, tenant: str) -> None:
        records = self._tenants[tenant]
        if records:
            records.popitem(last=False)
            self._count -= 1
        if not records:
            del self._tenants[tenant]

    def ended(
        self, tenant: str, session: SessionDirective, worker: str | None, prefilled_on: str | None = None
    ) -> None:
        record = self.get(tenant, session.id)
        if record is None:
            return
        record.turns += 1
        record.state = "closed" if session.close else "paused"
        record.since, record.worker = time.monotonic(), worker or record.worker
        record.prefilled_on = prefilled_on or worker or record.prefilled_on
        if record.state == "paused" and record.prefilled_on:
            self._held[1][record.prefilled_on] += 1

    def held_per_worker(self) -> Counter[str]:
        """How many paused sessions, within their retention, each worker computed last: kept as turns
        start and end, and recounted at most every ``HELD_EVERY_S`` (a router reads it on every
        request) for the sessions whose retention ran out or that the book let go."""
        now = time.monotonic()
        at, held = self._held
        if now - at >= self.HELD_EVERY_S:
            held = Counter(
                r.prefilled_on
                for records in self._tenants.values()
                for r in records.values()
                if r.state == "paused"
                and r.prefilled_on
                and now - r.since <= (r.directive.retain_s or DEFAULT_RETAIN_S)
            )
            self._held = (now, held)
        return held

    def get(self, tenant: str, session: str) -> SessionRecord | None:
        records = self._tenants.get(tenant)
        return None if records is None else records.get(session)

    def changed(self, record: SessionRecord, directive: SessionDirective) -> None:
        record.directive = directive
        if directive.close:
            record.state, record.since = "closed", time.monotonic()

    def list(self, tenant: str | None = None, offset: int = 0, limit: int | None = None) -> list[SessionInfo]:
        """The sessions (one tenant's, or every tenant's by name), least recently used first: from the
        ``offset``-th, at most ``limit`` of them (a page)."""
        now = time.monotonic()
        for name in [tenant] if tenant is not None else list(self._tenants):
            records: OrderedDict[str, SessionRecord] = self._tenants.get(name, OrderedDict())
            for key in [k for k, r in records.items() if r.state == "closed" and now - r.since > self.closed_kept_s]:
                del records[key]
                self._count -= 1
            if not records:
                self._tenants.pop(name, None)
        names = [tenant] if tenant is not None else sorted(self._tenants)
        chosen = itertools.islice(
            (r for name in names for r in self._tenants.get(name, {}).values()),
            offset,
            None if limit is None else offset + limit,
        )
        return [self.info(r, now) for r in chosen]

    @staticmethod
    def info(r: SessionRecord, now: float | None = None) -> SessionInfo:
        """One session as the control API shows it."""
        now = time.monotonic() if now is None else now
        return SessionInfo(
            id=r.directive.id,
            tenant=r.tenant,
            parent=r.directive.parent,
            state=r.state,  # type: ignore[arg-type]
            turns=r.turns,
            idle_s=round(now - r.since, 3),
            retain_s=r.directive.retain_s,
            priority=r.directive.priority,
            pause_s=r.directive.pause_s,
            worker=r.worker,
        )
