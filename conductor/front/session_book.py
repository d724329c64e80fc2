"""The front's book of sessions: each one it has served (by tenant and hashed id), its state, its
last directives and the worker that ran its last turn, for the control API (list, close, retain).

The book is the front's view, not the tiers': a session whose KV a tier dropped is still listed until
it closes or ages out; one front's book knows only the sessions it served. At most ``max_sessions``
(the least recently used go), and closed sessions are kept ``closed_kept_s`` so that a list shows
what just ended.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from tiercake.messages import SessionDirective, SessionInfo


@dataclass(slots=True)
class SessionRecord:
    tenant: str
    directive: SessionDirective
    state: str = "active"
    turns: int = 0
    since: float = 0.0  # monotonic: the last turn's start or end
    worker: str | None = None


class SessionBook:
    def __init__(self, max_sessions: int = 100_000, closed_kept_s: float = 300.0) -> None:
        self.max_sessions, self.closed_kept_s = max_sessions, closed_kept_s
        self._records: OrderedDict[tuple[str, str], SessionRecord] = OrderedDict()

    def began(self, tenant: str, session: SessionDirective) -> None:
        record = self._records.get((tenant, session.id))
        if record is None:
            record = self._records[(tenant, session.id)] = SessionRecord(tenant, session)
            while len(self._records) > self.max_sessions:
                self._records.popitem(last=False)
        self._records.move_to_end((tenant, session.id))
        record.directive, record.state, record.since = session, "active", time.monotonic()

    def ended(self, tenant: str, session: SessionDirective, worker: str | None) -> None:
        record = self._records.get((tenant, session.id))
        if record is None:
            return
        record.turns += 1
        record.state = "closed" if session.close else "paused"
        record.since, record.worker = time.monotonic(), worker or record.worker

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
