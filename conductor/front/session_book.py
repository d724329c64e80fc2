"""The front's book of sessions: each one it has served (by tenant and hashed id), its state, its
last directives and the worker that ran its last turn, for the control API (list, close, retain).

The book is the front's view, not the tiers': a session whose KV a tier dropped is still listed until
it closes or ages out; one front's book knows only the sessions it served. At most ``max_sessions``
(the least recently used go), and closed sessions are kept ``closed_kept_s`` so that a list shows
what just ended.
"""

from __future__ import annotations

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

    def __init__(self, max_sessions: int = 100_000, closed_kept_s: float = 300.0) -> None:
        self.max_sessions, self.closed_kept_s = max_sessions, closed_kept_s
        self._records: OrderedDict[tuple[str, str], SessionRecord] = OrderedDict()
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
        record = self._records.get((tenant, session))
        return None if record is None or record.state == "closed" else record.prefilled_on

    def _start(self, tenant: str, session: SessionDirective) -> None:
        record = self._records.get((tenant, session.id))
        if record is None:
            record = self._records[(tenant, session.id)] = SessionRecord(tenant, session)
            while len(self._records) > self.max_sessions:
                self._records.popitem(last=False)
        self._records.move_to_end((tenant, session.id))
        if record.state == "paused" and record.prefilled_on:
            self._held[1][record.prefilled_on] -= 1  # counted until the next recount
        record.directive, record.state, record.since = session, "active", time.monotonic()

    def ended(
        self, tenant: str, session: SessionDirective, worker: str | None, prefilled_on: str | None = None
    ) -> None:
        record = self._records.get((tenant, session.id))
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
                for r in self._records.values()
                if r.state == "paused"
                and r.prefilled_on
                and now - r.since <= (r.directive.retain_s or DEFAULT_RETAIN_S)
            )
            self._held = (now, held)
        return held

    def get(self, tenant: str, session: str) -> SessionRecord | None:
        return self._records.get((tenant, session))

    def changed(self, record: SessionRecord, directive: SessionDirective) -> None:
        record.directive = directive
        if directive.close:
            record.state, record.since = "closed", time.monotonic()

    def list(self, tenant: str | None = None) -> list[SessionInfo]:
        now = time.monotonic()
        for key in [k for k, r in self._records.items() if r.state == "closed" and now - r.since > self.closed_kept_s]:
            del self._records[key]
        return [self.info(r, now) for r in self._records.values() if tenant is None or r.tenant == tenant]

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
