"""A store's blocking connections to its nodes: the one way a request goes out on the blocking door,
whether the synchronous client's fast path sends it or ``AsyncStore`` in blocking mode does.

Design note. Both doors send the same request the same way: a connection of the calling thread to
the node (kept between calls), the same-host read leases' note ahead of the request on that
connection (a remove that follows the reads then finds their leases), and, when the exchange fails,
every connection to that node closed (the node or the path to it is suspect). What the caller makes
of a failure differs and stays with it: ``LinkNotOpened`` means nothing was sent; any other
``TransferError`` or ``OSError`` means the request may have reached the node.
"""

from __future__ import annotations

from collections import defaultdict

from tiercake.transfer.connection import BlockingConnection, Channels, PeerAddress
from tiercake.transfer.protocol import FLAG_NO_REPLY, OBJECTS_SINCE, Op, TransferError
from tiercake.transfer.spin import SpinWait

from .same_host import SameHost


class LinkNotOpened(TransferError):
    """No connection to the node could be made: the request was not sent."""


class BlockingLinks:
    """Idle blocking connections per node, opened on demand, for one store of one thread."""

    def __init__(
        self, channels: Channels, identity: str, same_host: SameHost, timeout_s: float, spin: SpinWait | None
    ) -> None:
        self._channels, self._identity, self._same_host = channels, identity, same_host
        self._timeout_s, self._spin = timeout_s, spin
        self._idle: dict[str, list[BlockingConnection]] = defaultdict(list)

    def exchange(
        self,
        node: str,
        address: tuple[str, int],
        epoch: int,
        op: Op,
        answer: Op,
        body: bytes,
        flags: int = 0,
        data=(),
        receive=None,
        timeout: float | None = None,
    ) -> bytearray:
        """One request to ``node`` (at ``address``) and its reply, within ``timeout`` (default the
        store's), the node's pending lease note sent ahead of it."""
        conn = self._take(node, address)
        try:
            note = self._same_host.take_note(node, epoch)
            if note is not None:
                conn.send_only(Op.OBJ_QUERY, note, FLAG_NO_REPLY)
            reply = conn.exchange(op, answer, body, flags, data, receive, timeout=timeout or self._timeout_s)
        except BaseException:
            conn.close()
            self.forget(node)
            raise
        self._idle[node].append(conn)
        return reply

    def send_note(self, node: str, epoch: int) -> bool:
        """The node's pending lease note on an idle connection, with no reply; whether there was one
        to send it on (without, it goes ahead of the next request). A failure forgets the node's
        connections and raises."""
        if not self._idle.get(node):
            return False
        note = self._same_host.take_note(node, epoch)
        return note is None or self.send_only(node, Op.OBJ_QUERY, note, FLAG_NO_REPLY)

    def send_only(self, node: str, op: Op, body: bytes, flags: int) -> bool:
        """``body`` on an idle connection to ``node``, no reply awaited; whether there was one."""
        idle = self._idle.get(node)
        if not idle:
            return False
        try:
            idle[-1].send_only(op, body, flags)
        except (TransferError, OSError):
            self.forget(node)
            raise
        return True

    def forget(self, node: str) -> None:
        for conn in self._idle.pop(node, []):
            conn.close()

    def close(self) -> None:
        for node in list(self._idle):
            self.forget(node)

    def _take(self, node: str, address: tuple[str, int]) -> BlockingConnection:
        idle = self._idle[node]
        if idle:
            return idle.pop()
        conn = BlockingConnection(
            PeerAddress(node, *address),
            self._channels.secret,
            self._identity,
            self._channels.tls,
            connect_timeout=self._timeout_s / 2,  # not made in time: not sent, the caller may try again
            spin=self._spin,
            needs=OBJECTS_SINCE,
        )
        try:
            return conn.open()
        except (TransferError, OSError) as exc:
            raise LinkNotOpened(f"no connection to {node}: {exc}") from exc
