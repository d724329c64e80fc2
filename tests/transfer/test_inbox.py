"""Requests answered by the event loop's reader callback (``transfer/inbox.py``, and the object
answers it drives, the ``now`` doors of ``workers/node/objects/``): frames that arrive together, or a byte at a
time, are each answered once and in order; what the callback declines reaches the connection's
task; a bad frame or a peer that leaves ends the connection with the reason. Then against a node
agent: a put whose bytes trickle in is finished by the task, and a get whose reply the socket will
not take at once is sent in full."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
import uuid

import numpy as np
import pytest
from kvstore_helpers import SECRET, KvCluster, ready

from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import BlockingConnection, PeerAddress, _recv_frame, _recv_into
from tiercake.transfer.inbox import Inbox
from tiercake.transfer.protocol import FLAG_EAGER, FRAME, MAGIC, VERSION, Op, PeerClosedError, ProtocolError, Status


def frame(op: Op, request: int, body: bytes = b"", flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, VERSION, op, flags, request, len(body)) + body


async def pair():
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, b


async def test_frames_arriving_together_or_in_pieces_are_each_answered_once_in_order():
    a, b = await pair()
    seen = []

    def fast(op, flags, request, body):
        seen.append((op, request, bytes(body)))
        return op is Op.OBJ_QUERY  # queries answered on the spot, gets left to the task

    inbox = Inbox(b, fast)
    a.sendall(frame(Op.OBJ_QUERY, 1, b"one") + frame(Op.OBJ_QUERY, 2, b"") + frame(Op.OBJ_GET, 3, b"three"))
    got = await asyncio.wait_for(inbox.next(), 5)
    assert got == (Op.OBJ_GET, 0, 3, bytearray(b"three")) and [r for _, r, _ in seen] == [1, 2, 3]
    data = frame(Op.OBJ_QUERY, 4, b"four") + frame(Op.OBJ_GET, 5, b"x" * 1000)
    task = asyncio.ensure_future(inbox.next())
    for i in range(len(data)):  # a byte at a time: the callback keeps what came
        a.send(data[i : i + 1])
        await asyncio.sleep(0)
    got = await asyncio.wait_for(task, 5)
    assert got[2] == 5 and len(got[3]) == 1000 and seen[3] == (Op.OBJ_QUERY, 4, b"four")
    assert inbox.fast_served == 3
    a.close()
    with pytest.raises(PeerClosedError):
        await asyncio.wait_for(inbox.next(), 5)
    b.close()


async def test_a_continuation_reaches_the_task_and_a_bad_frame_ends_the_connection():
    a, b = await pair()

    async def rest():
        return "rest"

    inbox = Inbox(b, lambda op, flags, request, body: rest)
    a.sendall(frame(Op.OBJ_GET, 7))
    assert await (await asyncio.wait_for(inbox.next(), 5))() == "rest"
    a.sendall(b"XXXX" + bytes(FRAME.size - 4))  # not our magic
    with pytest.raises(ProtocolError, match="magic"):
        await asyncio.wait_for(inbox.next(), 5)
    a2, b2 = await pair()
    inbox = Inbox(b2, lambda *args: True, max_body=10)
    a2.sendall(FRAME.pack(MAGIC, VERSION, Op.OBJ_GET, 0, 1, 1 << 40))  # a body no one should allocate
    with pytest.raises(ProtocolError, match="over the limit"):
        await asyncio.wait_for(inbox.next(), 5)
    a3, b3 = await pair()
    inbox = Inbox(b3, lambda *args: 1 / 0)
    a3.sendall(frame(Op.OBJ_GET, 1))
    with pytest.raises(ProtocolError, match="ZeroDivisionError"):  # a bug says what it was, and ends it
        await asyncio.wait_for(inbox.next(), 5)
    for s in (a, b, a2, b2, a3, b3):
        s.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    cluster = KvCluster(tmp_path_factory.mktemp("inbox"), nodes=("kv-a",), ssd=None)

    async def address():
        async with cluster.store() as s:
            await ready(s, 1)
            await s.put("warm", b"up")  # answered once the node serves its slots (it retries until then)
            return s.map.epoch, s.members["kv-a"]

    epoch, (host, port) = asyncio.run(address())
    yield cluster, epoch, host, port
    cluster.close()


@pytest.mark.cluster
def test_a_put_whose_bytes_trickle_in_and_a_get_larger_than_the_socket_takes(node):
    cluster, epoch, host, port = node
    conn = BlockingConnection(PeerAddress("kv-a", host, port), SECRET.encode(), "test").open()
    try:
        sock = conn.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the reply cannot all fit at once
        tenant = f"t{uuid.uuid4().hex[:6]}"
        value = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
        body = w.encode(w.PutRequest(tenant, epoch, [w.PutItem(b"slow", value.size)]))
        sock.sendall(frame(Op.OBJ_PUT, 11, body, FLAG_EAGER))
        for lo in range(0, value.size, 1 << 20):  # its bytes in three pieces, a pause between
            time.sleep(0.2)
            sock.sendall(value[lo : lo + (1 << 20)].tobytes())
        _, _, request, reply = _recv_frame(sock, [Op.OBJ_PUT_REPLY], 1 << 20)
        assert request == 11 and w.decode(w.PutReply, reply).results[0].status == Status.OK
        get = w.encode(w.GetRequest(tenant, epoch, [w.GetItem(b"slow", value.size)]))
        sock.sendall(frame(Op.OBJ_GET, 12, get))
        time.sleep(0.3)  # the node has sent what the socket took, and waits to send the rest
        _, _, request, reply = _recv_frame(sock, [Op.OBJ_GET_REPLY], 1 << 20)
        out = np.empty_like(value)
        _recv_into(sock, [out])
        assert request == 12 and w.decode(w.GetReply, reply).items[0].size == value.size
        assert np.array_equal(out, value)
        partial = w.encode(w.PutRequest(tenant, epoch, [w.PutItem(b"partial", 1 << 20)]))
        sock.sendall(frame(Op.OBJ_PUT, 13, partial, FLAG_EAGER) + b"only part of it")
        time.sleep(0.2)
    finally:
        conn.close()  # the node, mid-put, drops what it staged: nothing of it is stored
    fresh = BlockingConnection(PeerAddress("kv-a", host, port), SECRET.encode(), "test").open()
    try:
        get = w.encode(w.GetRequest(tenant, epoch, [w.GetItem(b"partial", 1 << 20)]))
        reply = fresh.exchange(Op.OBJ_GET, Op.OBJ_GET_REPLY, get, timeout=10)
        assert w.decode(w.GetReply, reply).items[0].status == Status.NOT_FOUND
        small = w.encode(w.PutRequest(tenant, epoch, [w.PutItem(b"partial", 3)]))
        reply = fresh.exchange(Op.OBJ_PUT, Op.OBJ_PUT_REPLY, small, FLAG_EAGER, [b"abc"], timeout=10)
        assert w.decode(w.PutReply, reply).results[0].status == Status.OK  # its first put is this one
    finally:
        fresh.close()


def test_a_blocking_caller_polls_for_its_reply_a_while_then_blocks_and_stops_polling_when_it_finds_nothing():
    from tiercake.transfer.spin import SpinWait

    a, b = socket.socketpair()
    spin = SpinWait(0.05)
    spin.CHECK_S = float("inf")  # whatever else this machine runs meanwhile (the contention rule: below)
    patient = SpinWait(0.1)  # the longest budget: a busy machine's timer thread has 90 ms to send
    patient.CHECK_S = float("inf")
    try:
        start = time.perf_counter()  # before the timer starts: its 10 ms then lie inside what is measured
        threading.Timer(0.01, lambda: a.send(b"x")).start()
        patient.wait(b)
        assert time.perf_counter() - start > 0.009
        assert b.recv(1) == b"x" and patient.misses == 0  # returned when the reply came, not at the budget
        for _ in range(SpinWait.MISSES_OFF):  # nothing comes: each poll spends its budget
            start = time.perf_counter()
            spin.wait(b)
            assert time.perf_counter() - start >= 0.05
        start = time.perf_counter()
        spin.wait(b)  # off now: the caller blocks at once
        assert spin.off == SpinWait.OFF_CALLS - 1 and time.perf_counter() - start < 0.05  # no budget spent
        a.close()
        spin.off = 0
        spin.wait(b)  # a peer that left ends the poll (the receive then says so)
        assert spin.misses == 0
    finally:
        a.close()
        b.close()


def test_only_a_blocking_store_on_more_than_one_core_polls_and_the_budget_is_checked(monkeypatch):
    from tiercake.kvstore import AsyncStore

    kw = {"secret": SECRET}
    assert AsyncStore("http://127.0.0.1:1", blocking=True, **kw).spin is not None
    assert AsyncStore("http://127.0.0.1:1", **kw).spin is None
    assert AsyncStore("http://127.0.0.1:1", blocking=True, spin_s=0, **kw).spin is None
    for bad in (float("nan"), -1e-6, 1.0, "1"):
        with pytest.raises(ValueError):
            AsyncStore("http://127.0.0.1:1", blocking=True, spin_s=bad, **kw)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert AsyncStore("http://127.0.0.1:1", blocking=True, **kw).spin is None


def test_a_thread_that_waits_for_a_core_does_not_poll(monkeypatch):
    from tiercake.transfer import spin as spin_module

    queued = iter([0, 2_000_000, 2_300_000])  # run-queue ns: 2 ms of 10 waited, then 0.3 ms of 10
    clock = iter([100.0, 100.01, 100.02])
    monkeypatch.setattr(spin_module, "_queued_ns", lambda: next(queued))
    monkeypatch.setattr(spin_module.time, "monotonic", lambda: next(clock))
    budget = spin_module.SpinWait(0.001)
    budget.CHECK_S = 0.005
    assert budget.polls()  # the first sample: nothing to compare with yet
    assert not budget.polls() and budget.contended  # 20% of the time waiting for a core
    assert budget.polls() and not budget.contended  # 3%: under the line again


def test_a_loop_polls_for_its_next_event_only_just_after_one_and_never_past_its_timeout(monkeypatch):
    from tiercake.transfer.spin import SpinningSelector

    a, b = socket.socketpair()
    selector = SpinningSelector(0.05)
    selector.budget.CHECK_S = float("inf")
    selector.register(b, selectors.EVENT_READ)
    timeouts = []
    real = selectors.EpollSelector.select
    monkeypatch.setattr(selectors.EpollSelector, "select", lambda self, t=None: timeouts.append(t) or real(self, t))
    try:
        assert selector.select(0.02) == [] and len(timeouts) == 1 and timeouts[0] > 0.015  # idle: no poll, a wait
        a.send(b"x")
        assert len(selector.select(None)) == 1  # an event: it polls for the next one from now
        b.recv(1)
        threading.Timer(0.01, lambda: a.send(b"y")).start()
        timeouts.clear()
        assert len(selector.select(None)) == 1
        assert len(timeouts) > 1 and set(timeouts) == {0}  # found by polling, never slept
        b.recv(1)
        start = time.perf_counter()
        assert selector.select(0.01) == [] and time.perf_counter() - start < 0.03  # its timeout bounds the poll
        assert selector.budget.misses == 1
    finally:
        selector.close()
        a.close()
        b.close()


async def test_a_body_announced_large_and_sent_small_holds_what_came_not_what_was_announced():
    from tiercake.transfer.inbox import BODY_CHUNK

    a, b = await pair()
    seen = []
    inbox = Inbox(b, lambda op, flags, request, body: seen.append(bytes(body)) or True)
    a.sendall(frame(Op.OBJ_QUERY, 1, b"x" * (3 * BODY_CHUNK + 5))[: FRAME.size + 100])  # 16 MiB-style: announced,
    await asyncio.sleep(0.05)  # then a trickle
    inbox._pump()
    assert inbox._length == 3 * BODY_CHUNK + 5 and len(inbox._body) == BODY_CHUNK  # not the announced size
    a.sendall(frame(Op.OBJ_QUERY, 1, b"x" * (3 * BODY_CHUNK + 5))[FRAME.size + 100 :] + frame(Op.OBJ_QUERY, 2, b"y"))
    await asyncio.sleep(0.05)
    while len(seen) < 2:
        inbox._pump()
        await asyncio.sleep(0.01)
    assert seen == [b"x" * (3 * BODY_CHUNK + 5), b"y"]  # and every byte in place once it all came
    a.close()
    b.close()
