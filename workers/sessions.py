"""A worker's side of sessions: it tells its own tiers and its node agent's what each request's
conversation is doing (``SESSION``), so that their eviction policies keep a paused conversation's KV
until it is expected back and free a closed one's at once.

A request with a session is ACTIVE while it runs (with its prompt's blocks); when it ends the session
is PAUSED (with the blocks of prompt and answer: what the next turn's prompt starts with), or CLOSED
when its client said the conversation ends. Notices to the node go in order, one at a time, off the
request's path: a node that is slow or gone costs the request nothing (the policies then act on what
they knew).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

from tiercake.conductor.client import ConductorError, NodeDirectory
from tiercake.messages import SessionDirective
from tiercake.tiers import TieredStore
from tiercake.transfer import TransferEngine, TransferResult
from tiercake.transfer.protocol import SessionNotice
from tiercake.transfer.server import session_event

log = logging.getLogger(__name__)

MAX_QUEUED = 1024  # notices waiting for a slow node at most; older ones are dropped first
MAX_REMEMBERED = 10_000  # sessions whose last blocks are kept, for the control API's changes


def started_notice(session: SessionDirective, tenant: str) -> SessionNotice:
    """The notice of a request of ``session`` starting (sent with its prompt's blocks)."""
    return SessionNotice(session=session.id, state="active", priority=session.priority, tenant=tenant)


def ended_notice(session: SessionDirective, tenant: str) -> SessionNotice:
    """The notice of its end: paused (sent with the blocks its next turn reads), or closed."""
    if session.close:
        return SessionNotice(session=session.id, state="closed", tenant=tenant)
    return SessionNotice(
        session=session.id,
        state="paused",
        resume_in=session.pause_s,
        retain_s=session.retain_s,
        priority=session.priority,
        tenant=tenant,
    )


class SessionNotifier:
    def __init__(
        self,
        store: TieredStore | None,
        transfer: TransferEngine | None,
        node: str | None,
        nodes: NodeDirectory | None = None,
    ) -> None:
        """``nodes``: where ``transfer`` learns the node's address (and a restarted node's new one);
        None when its owner keeps ``transfer``'s peers itself."""
        self.store, self.transfer, self.node, self.nodes = store, transfer, node, nodes
        self._queue: asyncio.Queue[tuple[SessionNotice, Sequence[bytes]]] = asyncio.Queue(MAX_QUEUED)
        self._sender: asyncio.Task | None = None
        self._last: OrderedDict[str, Sequence[bytes]] = OrderedDict()  # session -> the blocks it was paused with
        self.sent = self.failed = self.dropped = 0

    def started(self, session: SessionDirective, tenant: str, keys: Sequence[bytes]) -> None:
        self._tell(started_notice(session, tenant), keys)

    def ended(self, session: SessionDirective, tenant: str, keys: Sequence[bytes]) -> None:
        """After the request: paused (its next turn reads ``keys``), or closed."""
        self.remember(session, keys)
        self._tell(ended_notice(session, tenant), [] if session.close else keys)

    def remember(self, session: SessionDirective, keys: Sequence[bytes]) -> None:
        """What ``ended`` keeps for a later change, without telling anyone (under vLLM the connector
        told the node already)."""
        self._last.pop(session.id, None)
        if session.close:
            return
        self._last[session.id] = keys
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)

    def changed(self, session: SessionDirective, tenant: str) -> None:
        """The control API's change of a paused session: closed, or paused again with its new
        retention and priority over the blocks it was paused with. ``LookupError``: this worker
        does not remember it (another ran its last turn, or it was forgotten)."""
        keys = self._last.get(session.id)
        if keys is None and not session.close:
            raise LookupError(f"session {session.id} is not one this worker paused")
        self.ended(session, tenant, keys or [])

    def _tell(self, notice: SessionNotice, keys: Sequence[bytes]) -> None:
        if self.store is not None:
            self.store.on_session(session_event(notice, keys))
        if self.transfer is None or self.node is None or self.node == self.transfer.node_id:
            return
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait((notice, keys))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        assert self.transfer is not None and self.node is not None
        while not self._queue.empty():
            notice, keys = self._queue.get_nowait()
            result = await self._deliver(notice, keys)
            if result.ok:
                self.sent += 1
            else:
                self.failed += 1
                log.info("session notice to %s failed: %s", self.node, result.error)

    async def _deliver(self, notice: SessionNotice, keys: Sequence[bytes]) -> TransferResult:
        assert self.transfer is not None and self.node is not None
        transfer, node = self.transfer, self.node
        if self.nodes is None:
            return await transfer.session_event(node, notice, keys)

        async def attempt() -> list[TransferResult]:
            return [await transfer.session_event(node, notice, keys)]

        try:
            return (await self.nodes.to_node(node, attempt))[0]
        except ConductorError as exc:  # the node's address could not be learned
            return TransferResult(False, transport="control", error=exc)

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
