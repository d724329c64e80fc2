"""The synchronous client's plain case, with no event loop at all: each node's share of a call is one
request on a blocking connection of the calling thread, or, on the same host, a read straight out
of the node's pool through its directory (``tiers/directory.py``).

It takes only what needs no decision: the map known, the node's connection (or directory) at
hand, a request that went and came back. Everything else (a node not reached, an answer to ask
again, a pool to map, a large object through the pool) is left to ``AsyncStore``, whose rules decide
it: the same requests and the same meaning of every answer (``requests.py``), so the two cannot
disagree. A write whose request reached a node that then failed is not left to it: its outcome is
unknown (TRANSFER_FAIL), as on the asyncio path. An asyncio round of the calling thread's own loop
costs 50-80 us here, about what a whole same-host get through the directory takes.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tiercake.blocks import object_slot
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import FLAG_EAGER, Op, TransferError

from .aio import AsyncStore
from .errors import TransferFailed
from .links import LinkNotOpened
from .requests import (
    Item,
    Retry,
    deadline_s,
    get_request,
    get_results,
    get_targets,
    put_request,
    put_results,
    query_results,
    remove_results,
)


class FastPath:
    def __init__(self, store: AsyncStore) -> None:
        self.store = store  # this thread's: its map, members, directories and blocking links

    # What the synchronous client asks ---------------------------------------------------------

    def put(self, items: list[Item], like: w.PutItem) -> tuple[dict[int, object], list[Item]]:
        """(outcomes of the items done here, the items left to the asyncio path)."""

        def send(node: str, group: list[Item]) -> dict[int, object]:
            if any(it.data.size >= self.store.SHM_PUT_MIN_BYTES for it in group) and self.store.shm:
                return {it.index: Retry("through the pool", refresh=False) for it in group}
            data = [it.data for it in group if it.data.size]
            body = self._exchange(
                node,
                Op.OBJ_PUT,
                Op.OBJ_PUT_REPLY,
                w.encode(put_request(self.store.tenant, self.store.map.epoch, group, like)),
                FLAG_EAGER,
                data,
                timeout=deadline_s(self.store.timeout_s, group),
                write=True,
            )
            reply = w.decode(w.PutReply, body)
            self._seen(reply.epoch)
            return put_results(reply, group)

        return self._each_node(items, send)

    def get(self, items: list[Item]) -> tuple[dict[int, object], list[Item]]:
        def send(node: str, group: list[Item]) -> dict[int, object]:
            done: dict[int, object] = {}
            reader = self.store.same_host.directory(node)
            if reader is not None:
                rest = []
                for it in group:
                    got = reader.read(it.oid, it.out) if it.device is None else None
                    if isinstance(got, np.ndarray):
                        done[it.index] = got
                    else:
                        rest.append(it)
                if done and self.store.same_host.note_reads(node, [it.name for it in group if it.index in done]):
                    self._flush_notes(node)
                group = rest
            if not group:
                return done
            if self.store.shm and (
                not self.store.same_host.mapped(node)
                or any(it.out is not None and it.out.size >= self.store.SHM_MIN_BYTES for it in group)
            ):
                done.update({it.index: Retry("through the pool", refresh=False) for it in group})
                return done  # a pool to map, or large objects to copy out of it: the asyncio path
            decoded: list[w.GetReply] = []

            def targets(body: bytearray) -> list:
                decoded.append(w.decode(w.GetReply, body))
                return get_targets(decoded[0], group, node)

            self._exchange(
                node,
                Op.OBJ_GET,
                Op.OBJ_GET_REPLY,
                w.encode(get_request(self.store.tenant, self.store.map.epoch, group)),
                receive=targets,
                timeout=deadline_s(self.store.timeout_s, group),
            )
            self._seen(decoded[0].epoch)
            done.update(get_results(decoded[0], group))
            return done

        return self._each_node(items, send)

    def query(self, items: list[Item], lease: bool) -> tuple[dict[int, object], list[Item]]:
        def send(node: str, group: list[Item]) -> dict[int, object]:
            request = w.QueryRequest(self.store.tenant, self.store.map.epoch, [it.name for it in group], lease)
            body = self._exchange(node, Op.OBJ_QUERY, Op.OBJ_QUERY_REPLY, w.encode(request))
            reply = w.decode(w.QueryReply, body)
            self._seen(reply.epoch)
            return query_results(reply, group)

        return self._each_node(items, send)

    def remove(self, items: list[Item], force: bool) -> tuple[dict[int, object], list[Item]]:
        def send(node: str, group: list[Item]) -> dict[int, object]:
            request = w.RemoveRequest(self.store.tenant, self.store.map.epoch, [it.name for it in group], force)
            body = self._exchange(node, Op.OBJ_REMOVE, Op.OBJ_REMOVE_REPLY, w.encode(request), write=True)
            reply = w.decode(w.RemoveReply, body)
            self._seen(reply.epoch)
            return remove_results(reply, group)

        return self._each_node(items, send)

    # Plumbing -------------------------------------------------------------------------------------

    def _each_node(self, items: list[Item], send) -> tuple[dict[int, object], list[Item]]:
        store = self.store
        if not items or not store.map.chains:
            return {}, items
        groups: dict[str | None, list[Item]] = defaultdict(list)
        for it in items:
            groups[store.map.primary(object_slot(it.oid, store.map.slots))].append(it)
        done: dict[int, object] = {}
        left: list[Item] = []
        for node, group in groups.items():
            if node is None or node not in store.members or len(group) > 4096:
                left += group
                continue
            try:
                answers = send(node, group)
            except _Unsent:
                left += group
                continue
            except _Failed as exc:
                done.update({it.index: exc.outcome for it in group})
                continue
            for it in group:
                answer = answers[it.index]
                if isinstance(answer, Retry):
                    left.append(it)
                else:
                    done[it.index] = answer
        return done, left

    def _exchange(
        self,
        node: str,
        op: Op,
        answer: Op,
        body: bytes,
        flags: int = 0,
        data=(),
        receive=None,
        timeout: float | None = None,
        write: bool = False,
    ) -> bytearray:
        """One request on the store's blocking links, within ``timeout`` (``deadline_s``; default the store's)."""
        store = self.store
        try:
            return store.links.exchange(
                node, store.members[node], store.map.epoch, op, answer, body, flags, data, receive, timeout
            )
        except LinkNotOpened as exc:
            raise _Unsent() from exc
        except (TransferError, OSError, TimeoutError) as exc:
            if write:  # it may have been applied: its outcome is unknown, and it is not sent again
                raise _Failed(TransferFailed(f"{node} failed mid-request: {exc or 'timed out'}")) from None
            raise _Unsent() from exc  # a read: the asyncio path asks again

    def _seen(self, epoch: int) -> None:
        if epoch > self.store.map.epoch:
            self.store.stale = True  # the caller fetches the map before its next call

    def _flush_notes(self, node: str) -> None:
        """The node's lease note now, on an idle connection if there is one (else ahead of the next
        request); a failure is the asyncio path's to meet on the next call."""
        try:
            self.store.links.send_note(node, self.store.map.epoch)
        except (TransferError, OSError):
            pass  # its connections are forgotten: the leases are not granted, as when a note is lost


class _Unsent(Exception):
    """Nothing reached the node (or a read failed): the asyncio path takes the items."""


class _Failed(Exception):
    def __init__(self, outcome: TransferFailed) -> None:
        super().__init__(str(outcome))
        self.outcome = outcome
