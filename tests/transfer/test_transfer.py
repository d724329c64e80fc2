"""The transfer engine and server over real loopback sockets (both ends in this process)."""

import asyncio
import contextlib
import socket
import struct
import time

import numpy as np
import pytest
import torch
from paths import shm_file
from transfer_helpers import (
    SECRET,
    authenticated_socket,
    closed,
    payload,
    raw_frame,
    read_frame,
    start_node,
    stop_node,
)

from tiercake.tiers import SsdFilesBackend, Tier, TieredStore
from tiercake.transfer import (
    TRANSPORTS,
    AuthenticationError,
    BlockLoc,
    BufferLoc,
    ItemError,
    Status,
    Transfer,
    TransferEngine,
)
from tiercake.transfer import connection as transfer_connection
from tiercake.transfer import protocol as p
from tiercake.transfer.server import MIN_RATE
from tiercake.transfer.sockio import BULK_THREAD_BYTES
from tiercake.transfer.transports import ShmTransport, TcpTransport

KB = 1024


@pytest.fixture
async def node():
    store, server = await start_node("node-b")
    yield store, server
    await stop_node(store, server)


@pytest.fixture
def frames_sent(monkeypatch) -> list[tuple[p.Op, int]]:
    """(op, flags) of every frame the client side sends, in order."""
    sent = []
    original = transfer_connection.send_frame

    async def recording(sock, op, request, body=b"", flags=0, data=()):
        sent.append((op, flags))
        return await original(sock, op, request, body, flags, data)

    monkeypatch.setattr(transfer_connection, "send_frame", recording)
    return sent


@contextlib.contextmanager
def stalling(server, handler: str):
    """The server's ``handler`` waits until the block ends (a stalled peer), then goes on as before."""
    gate = asyncio.Event()
    original = getattr(server, handler)

    async def stalled(*args):
        await gate.wait()
        return await original(*args)

    setattr(server, handler, stalled)
    try:
        yield
    finally:
        gate.set()
        setattr(server, handler, original)


def engine_for(server, transports=("tcp",), **kw) -> TransferEngine:
    engine = TransferEngine("node-a", SECRET, transports=transports, **kw)
    engine.add_peer("node-b", *server.address)
    return engine


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
@pytest.mark.parametrize("checksum", [False, True])
async def test_write_then_read_back(node, transports, checksum):
    store, server = node
    engine = engine_for(server, transports, checksum=checksum)
    sizes = [4 * KB, 64 * KB, 1 << 20, 3 * 1000 + 7]
    keys = [f"blk-{i}".encode() for i in range(len(sizes))]
    srcs = [payload(i, n) for i, n in enumerate(sizes)]
    written = await engine.write_blocks("node-b", keys, srcs, chain=True)
    assert [r.ok for r in written] == [True] * 4
    assert {r.transport for r in written} == {transports[0]}
    assert store._entries[keys[2]].meta.parent == keys[1]  # the chain travelled with the blocks
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    read = await engine.read_blocks("node-b", keys, dsts)
    assert all(r.ok for r in read)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert engine.bytes_moved[transports[0]] == 2 * sum(sizes)
    await engine.close()


async def test_per_item_errors_leave_the_rest_alone(node):
    store, server = node
    await store.put(b"exists", payload(1, 4 * KB))
    engine = engine_for(server)
    got = await engine.transfer(
        [
            Transfer(BlockLoc("node-b", b"exists"), BufferLoc(torch.empty(4 * KB, dtype=torch.uint8)), 4 * KB),
            Transfer(BlockLoc("node-b", b"missing"), BufferLoc(torch.empty(4 * KB, dtype=torch.uint8)), 4 * KB),
            Transfer(BlockLoc("node-b", b"exists"), BufferLoc(torch.empty(100, dtype=torch.uint8)), 100),
            Transfer(BufferLoc(payload(2, 4 * KB)), BlockLoc("node-b", b"exists"), 4 * KB),
            Transfer(BufferLoc(payload(3, 4 * KB)), BlockLoc("node-b", b"new"), 4 * KB),
            Transfer(BlockLoc("node-x", b"exists"), BufferLoc(torch.empty(4 * KB, dtype=torch.uint8)), 4 * KB),
            Transfer(BufferLoc(torch.empty(10, dtype=torch.uint8)), BlockLoc("node-b", b"neg"), -5),
            Transfer(BufferLoc(torch.empty(10, dtype=torch.uint8)), BlockLoc("node-b", b"big"), 11),
        ]
    )
    assert got[0].ok and got[4].ok
    assert isinstance(got[1].error, ItemError) and got[1].error.status is Status.NOT_FOUND
    assert got[2].error.status is Status.LENGTH_MISMATCH and "100 were asked" in str(got[2].error)
    assert got[3].error.status is Status.EXISTS
    assert isinstance(got[5].error, ItemError) and "unknown node" in str(got[5].error)
    assert isinstance(got[6].error, ValueError) and "positive" in str(got[6].error)
    assert isinstance(got[7].error, ValueError) and "has no" in str(got[7].error)
    assert torch.equal(
        torch.from_numpy(await store.get(b"exists")), payload(1, 4 * KB)
    )  # the refused write changed nothing
    await engine.close()


async def test_pull_into_local_store_and_local_transport(node, make_store):
    store_b, server = node
    local = await make_store(gpu=None, pool=64, ssd=None)
    local.payload_nbytes = None
    engine = TransferEngine("node-a", SECRET, local, transports=("local", "tcp"))
    engine.add_peer("node-b", *server.address)
    await store_b.put(b"hot", payload(7, 64 * KB))
    (pulled,) = await engine.transfer([Transfer(BlockLoc("node-b", b"hot"), BlockLoc("node-a", b"hot"), 64 * KB)])
    assert pulled.ok and pulled.transport == "tcp"
    assert torch.equal(torch.from_numpy(await local.get(b"hot")), payload(7, 64 * KB))  # replicated here
    out = torch.empty(64 * KB, dtype=torch.uint8)
    (res,) = await engine.read_blocks("node-a", [b"hot"], [out])
    assert res.ok and res.transport == "local" and torch.equal(out, payload(7, 64 * KB))
    # a failed pull leaves nothing behind in the local store
    (bad,) = await engine.transfer([Transfer(BlockLoc("node-b", b"nope"), BlockLoc("node-a", b"nope"), 64 * KB)])
    assert not bad.ok and not local.contains(b"nope") and b"nope" not in local._entries
    # memory to memory in this process
    dst = torch.zeros(10, dtype=torch.uint8)
    (copy,) = await engine.transfer([Transfer(BufferLoc(torch.arange(20, dtype=torch.uint8), 5), BufferLoc(dst), 10)])
    assert copy.ok and dst.tolist() == list(range(5, 15))
    await engine.close()


async def test_reads_from_the_peers_ssd_tier(tmp_path):
    store, server = await start_node("node-b", pool_bytes=256 * KB, ssd_dir=tmp_path)
    await store.put(b"cold", payload(9, 128 * KB), tier="ssd")
    for transports in (("tcp",), ("shm", "tcp")):
        engine = engine_for(server, transports)
        out = torch.empty(128 * KB, dtype=torch.uint8)
        (res,) = await engine.read_blocks("node-b", [b"cold"], [out])
        assert res.ok and torch.equal(out, payload(9, 128 * KB))
        await engine.close()
    await stop_node(store, server)


async def test_wrong_secret_is_refused_and_disconnected(node):
    store, server = node
    await store.put(b"k", payload(1, 4 * KB))
    engine = TransferEngine("intruder", b"not-the-cluster-secret!!", transports=("tcp",))
    engine.add_peer("node-b", *server.address)
    (res,) = await engine.read_blocks("node-b", [b"k"], [torch.empty(4 * KB, dtype=torch.uint8)])
    assert isinstance(res.error, AuthenticationError)
    assert server.refused == 1

    def by_hand():
        # a client that skips authentication and asks for data straight away
        import socket

        sock = socket.create_connection(server.address, timeout=5)
        op, _nonce = read_frame(sock)
        assert op == p.Op.HELLO
        sock.sendall(raw_frame(p.Op.READ, p.encode_read([(b"k", 4 * KB)])))
        op, body = read_frame(sock)
        return op, body, closed(sock)

    op, body, was_closed = await asyncio.to_thread(by_hand)
    assert op == p.Op.ERROR and b"authentication failed" in body and was_closed
    assert server.refused == 2
    await engine.close()


async def test_server_checks_that_the_client_knows_the_secret_too(node):
    """Mutual: a client is told if the server it reached cannot prove the secret."""
    store, server = node
    server.secret = b"some-other-secret-of-the-imposter"
    engine = engine_for(server)
    (res,) = await engine.read_blocks("node-b", [b"k"], [torch.empty(4, dtype=torch.uint8)])
    assert isinstance(res.error, AuthenticationError)
    await engine.close()


@pytest.mark.parametrize(
    "frame, expect",
    [
        (raw_frame(p.Op.READ, magic=b"HTTP"), b"not a tiercake transfer stream"),
        (raw_frame(p.Op.READ, version=9), b"version 9"),
        (raw_frame(p.Op.READ, length=p.MAX_BODY + 1), b"over the limit"),
        (raw_frame(99, b""), b"unknown operation"),
        (raw_frame(p.Op.WELCOME, b""), b"not a request"),
        (raw_frame(p.Op.READ, struct.pack("<I", 5) + b"\x01"), b"truncated table"),
        (raw_frame(p.Op.READ, struct.pack("<I", 10**6)), b"over the limit"),
        (raw_frame(p.Op.READ, p.encode_read([(b"k", 4)]) + b"junk"), b"do not match"),
        # a lease for NaN or infinite seconds once held a block past any remove, for good
        (raw_frame(p.Op.LEASE, p.encode_lease([(b"still", 100, float("nan"))])), b"ttl: not a finite number"),
        (raw_frame(p.Op.LEASE, p.encode_lease([(b"still", 100, float("inf"))])), b"ttl: not a finite number"),
    ],
)
async def test_malformed_frames_get_an_error_and_a_closed_connection(node, frame, expect):
    store, server = node

    def by_hand():
        sock = authenticated_socket(server.address)
        sock.sendall(frame)
        op, body = read_frame(sock)
        return op, body, closed(sock)

    op, body, was_closed = await asyncio.to_thread(by_hand)
    assert op == p.Op.ERROR and expect in body, body
    assert was_closed
    # and the server goes on serving everyone else
    engine = engine_for(server)
    await store.put(b"still", payload(3, 100))
    (res,) = await engine.read_blocks("node-b", [b"still"], [torch.empty(100, dtype=torch.uint8)])
    assert res.ok
    await engine.close()


async def test_truncated_frames_and_oversized_writes(node):
    store, server = node

    def cut_off():
        sock = authenticated_socket(server.address)
        sock.sendall(raw_frame(p.Op.READ, p.encode_read([(b"k", 4)]))[:13])  # half a header, then gone
        sock.close()
        sock = authenticated_socket(server.address)
        frame = raw_frame(p.Op.READ, p.encode_read([(b"k", 4)] * 3))
        sock.sendall(frame[: len(frame) - 3])  # header whole, table cut
        sock.close()

    await asyncio.to_thread(cut_off)

    def oversized():
        sock = authenticated_socket(server.address)
        table = p.encode_write([p.WriteItem(b"huge", 2**63), p.WriteItem(b"fine", 10)])
        sock.sendall(raw_frame(p.Op.WRITE, table))
        op, body = read_frame(sock)
        ready = p.decode_lease_reply(body)
        sock.sendall(b"0123456789")  # data only for the accepted item
        op2, body2 = read_frame(sock)
        return ready, p.decode_statuses(body2)

    ready, done = await asyncio.to_thread(oversized)
    assert ready[0].status is Status.LENGTH_MISMATCH and "over this node's limit" in ready[0].message
    assert ready[1].status is Status.OK and done[1].status is Status.OK
    assert bytes(await store.get(b"fine")) == b"0123456789"
    assert not store.contains(b"huge")
    with pytest.raises(ValueError, match="negative"):
        p.encode_read([(b"k", -1)])


async def test_a_small_write_is_one_round_trip_and_a_refused_item_keeps_the_rest_in_step(node, frames_sent):
    """An eager write (FLAG_EAGER, up to MAX_EAGER_BYTES): the table and every item's bytes go at once,
    the peer answers WRITE_DONE only. A refused item in the middle has its bytes read and dropped, so
    the items after it land intact."""
    store, server = node
    await store.put(b"taken", payload(9, 3000))
    engine = engine_for(server, ("tcp",))
    keys, srcs = [b"e1", b"taken", b"e3"], [payload(1, 1000), payload(2, 3000), payload(3, 5000)]
    results = await engine.write_blocks("node-b", keys, srcs)
    assert frames_sent[-1] == (p.Op.WRITE, p.FLAG_EAGER)
    assert results[0].ok and results[2].ok
    assert results[1].error.status is Status.EXISTS
    assert torch.equal(torch.from_numpy(await store.get(b"e1")).view(-1), srcs[0])
    assert torch.equal(torch.from_numpy(await store.get(b"e3")).view(-1), srcs[2])
    assert torch.equal(torch.from_numpy(await store.get(b"taken")).view(-1), payload(9, 3000))  # untouched

    def by_hand():  # the peer sends nothing before WRITE_DONE
        sock = authenticated_socket(server.address)
        table = p.encode_write([p.WriteItem(b"hand", 4)])
        sock.sendall(raw_frame(p.Op.WRITE, table, flags=p.FLAG_EAGER) + b"abcd")
        return read_frame(sock)

    op, body = await asyncio.to_thread(by_hand)
    assert op == p.Op.WRITE_DONE and p.decode_statuses(body)[0].status is Status.OK
    assert bytes(await store.get(b"hand")) == b"abcd"
    await engine.close()


@pytest.mark.parametrize(
    "flags, items, expect",
    [
        (p.FLAG_EAGER, [p.WriteItem(b"big", p.MAX_EAGER_BYTES + 1)], b"over the limit"),
        (p.FLAG_EAGER | p.FLAG_SHM, [p.WriteItem(b"small", 10)], b"over the stream only"),
    ],
)
async def test_an_eager_write_too_large_or_off_the_stream_is_refused(node, flags, items, expect):
    store, server = node

    def by_hand():
        sock = authenticated_socket(server.address)
        sock.sendall(raw_frame(p.Op.WRITE, p.encode_write(items), flags=flags))
        op, body = read_frame(sock)
        return op, body, closed(sock)

    op, body, was_closed = await asyncio.to_thread(by_hand)
    assert op == p.Op.ERROR and expect in body, body
    assert was_closed and not store.contains(items[0].key)


@pytest.mark.parametrize("eager", [False, True])
async def test_client_gone_mid_write_leaves_nothing_visible(node, eager):
    store, server = node
    used = store.tier("pool").backend.used_bytes

    def half_write():
        sock = authenticated_socket(server.address)
        table = p.encode_write([p.WriteItem(b"a", 64 * KB), p.WriteItem(b"b", 64 * KB)])
        sock.sendall(raw_frame(p.Op.WRITE, table, flags=p.FLAG_EAGER if eager else 0))
        if not eager:
            read_frame(sock)  # WRITE_READY: both reserved
        sock.sendall(bytes(64 * KB + 100))  # all of a, a little of b, then the client dies
        sock.close()

    await asyncio.to_thread(half_write)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if store.tier("pool").backend.used_bytes == used:
            break
    assert not store.contains(b"a") and not store.contains(b"b")  # a was whole, but its batch was not
    assert store.tier("pool").backend.used_bytes == used
    assert b"a" not in store._entries


async def test_a_stalled_writer_or_reader_is_dropped_and_what_it_held_given_back():
    """A peer that reserved slots and sends nothing, or that stops reading a reply while the server
    holds the blocks' leases, is dropped after ``stall_timeout`` plus its bytes at MIN_RATE: the
    reservations and leases are given back, and everyone else is served meanwhile."""
    store, server = await start_node("node-b", pool_bytes=64 << 20, stall_timeout=0.3)
    try:
        pool = store.tier("pool").backend
        used = pool.used_bytes

        def stalled_writer():
            sock = authenticated_socket(server.address)
            sock.sendall(raw_frame(p.Op.WRITE, p.encode_write([p.WriteItem(b"stalled", 64 * KB)])))
            op, _ = read_frame(sock)  # WRITE_READY: reserved; then silence
            assert op == p.Op.WRITE_READY
            return sock, closed(sock)

        sock, was_closed = await asyncio.to_thread(stalled_writer)
        sock.close()
        assert was_closed and not store.contains(b"stalled") and pool.used_bytes == used

        big = 32 << 20  # more than the socket buffers take: the server's send blocks
        await store.put(b"big", payload(7, big))

        def stalled_reader():
            sock = authenticated_socket(server.address)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KB)
            sock.sendall(raw_frame(p.Op.READ, p.encode_read([(b"big", big)])))
            return sock  # and never reads the reply

        sock = await asyncio.to_thread(stalled_reader)
        await asyncio.sleep(0.2)
        with pytest.raises(Exception, match="leased"):
            await store.remove(b"big")  # the reply is going out: its lease is held
        engine = engine_for(server)  # another peer is served meanwhile
        await store.put(b"small", payload(8, 4 * KB))
        (res,) = await engine.read_blocks("node-b", [b"small"], [torch.empty(4 * KB, dtype=torch.uint8)])
        assert res.ok
        await engine.close()
        deadline = 0.3 + big / MIN_RATE + 5
        for _ in range(int(deadline / 0.1)):
            await asyncio.sleep(0.1)
            try:
                await store.remove(b"big")
                break
            except Exception:  # noqa: BLE001 - still leased
                continue
        assert not store.contains(b"big")  # the stalled reader was dropped and its lease given back
        sock.close()
    finally:
        await stop_node(store, server)


async def test_checksum_catches_corruption_in_transit(node):
    store, server = node

    def corrupt_write():
        sock = authenticated_socket(server.address)
        good = payload(1, 4 * KB).numpy().tobytes()
        import xxhash

        item = p.WriteItem(b"c", len(good), None, xxhash.xxh3_64_intdigest(good))
        sock.sendall(raw_frame(p.Op.WRITE, p.encode_write([item]), flags=p.FLAG_CHECKSUM))
        read_frame(sock)
        sock.sendall(b"\xff" + good[1:])  # one byte flipped on the way
        _, body = read_frame(sock)
        return p.decode_statuses(body)

    (done,) = await asyncio.to_thread(corrupt_write)
    assert done.status is Status.CHECKSUM
    assert not store.contains(b"c")


async def test_removed_after_lookup_is_a_clear_miss(node):
    store, server = node
    await store.put(b"gone", payload(1, 4 * KB))
    engine = engine_for(server, ("shm", "tcp"))
    assert store.contains(b"gone")  # the lookup
    await store.remove(b"gone")  # evicted or removed before the read arrives
    (res,) = await engine.read_blocks("node-b", [b"gone"], [torch.empty(4 * KB, dtype=torch.uint8)])
    assert res.error.status is Status.NOT_FOUND
    await engine.close()


async def test_shm_leases_hold_blocks_until_released(node):
    store, server = node
    store.tier("pool").high_watermark = 1.0
    await store.put(b"leased", payload(1, 1 << 20))
    engine = engine_for(server, ("shm", "tcp"))
    peer = await engine._peer("node-b")
    async with peer.channel.connection() as conn:
        (reply,) = await conn.lease([(b"leased", 1 << 20, 30.0)])
        assert reply.status is Status.OK
        # fill the pool: the leased block must survive, whatever the eviction policy wants
        for i in range(12):
            await store.put(f"filler-{i}".encode(), payload(100 + i, 1 << 20))
        assert store.contains(b"leased")
        with pytest.raises(Exception, match="leased"):
            await store.remove(b"leased")
        await conn.release([(b"leased", reply.lease)], wait=True)
    await store.remove(b"leased")


async def test_a_pool_read_releases_its_leases_without_an_answer(node, frames_sent):
    """A read through the shared pool leases, copies and releases; the release asks for no answer
    (FLAG_NO_REPLY), so the read costs one round trip and one reply, and the peer still frees the
    lease as soon as the frame arrives. A release that waits gets its answer."""
    store, server = node
    BIG = ShmTransport.stream_below_bytes  # smaller reads go over the stream (the next test)
    await store.put(b"pooled", payload(2, BIG))
    engine = engine_for(server, ("shm", "tcp"))
    dst = torch.empty(BIG, dtype=torch.uint8)
    (result,) = await engine.read_blocks("node-b", [b"pooled"], [dst])
    assert result.ok and result.transport == "shm" and torch.equal(dst, payload(2, BIG))
    assert frames_sent[-2:] == [(p.Op.LEASE, 0), (p.Op.RELEASE, p.FLAG_NO_REPLY)]  # after the handshake
    for _ in range(100):  # the peer frees the lease when the frame arrives, with nobody waiting
        try:
            await store.remove(b"pooled")
            break
        except Exception:  # noqa: BLE001 - still leased: the frame is on its way
            await asyncio.sleep(0.01)
    assert not store.contains(b"pooled")
    await store.put(b"again", payload(3, BIG))
    (result,) = await engine.read_blocks("node-b", [b"again"], [dst])  # no stray answer in the stream
    assert result.ok and torch.equal(dst, payload(3, BIG))
    peer = await engine._peer("node-b")
    async with peer.channel.connection() as conn:
        (reply,) = await conn.lease([(b"again", BIG, 30.0)])
        await conn.release([(b"again", reply.lease)], wait=True)  # answered: freed by now
        await store.remove(b"again")
        (reply,) = await conn.lease([(b"again", BIG, 30.0)])
        assert reply.status is Status.NOT_FOUND  # the connection is still in step
    await engine.close()


async def test_a_small_read_from_a_same_host_peer_goes_over_the_stream(node, frames_sent):
    """Below ``stream_below_bytes`` a lease, a copy and a release cost more than the bytes through
    the socket: the shm transport reads such a batch with one READ, and a larger one through the pool."""
    store, server = node
    small, big = 64 << 10, ShmTransport.stream_below_bytes
    await store.put(b"small", payload(4, small))
    await store.put(b"big", payload(5, big))
    engine = engine_for(server, ("shm", "tcp"))
    dsts = [torch.empty(small, dtype=torch.uint8) for _ in range(2)]
    results = await engine.read_blocks("node-b", [b"small", b"small"], dsts)
    assert all(r.ok and r.transport == "shm" for r in results)
    assert all(torch.equal(d, payload(4, small)) for d in dsts)
    ops = [op for op, _ in frames_sent]
    assert ops[-1] is p.Op.READ and p.Op.LEASE not in ops
    frames_sent.clear()
    dst = torch.empty(big, dtype=torch.uint8)
    (result,) = await engine.read_blocks("node-b", [b"big"], [dst])
    assert result.ok and torch.equal(dst, payload(5, big))
    assert [op for op, _ in frames_sent] == [p.Op.LEASE, p.Op.RELEASE]
    await engine.close()


async def test_many_concurrent_batches_from_several_peers(node):
    store, server = node
    engines = [TransferEngine(f"client-{n}", SECRET, transports=("tcp",), streams=2) for n in range(4)]
    for engine in engines:
        engine.add_peer("node-b", *server.address)

    async def worker(n: int, engine: TransferEngine):
        for round_ in range(5):
            keys = [f"c{n}-r{round_}-{i}".encode() for i in range(8)]
            srcs = [payload(n * 1000 + round_ * 10 + i, (i + 1) * 3 * KB) for i in range(8)]
            assert all(r.ok for r in await engine.write_blocks("node-b", keys, srcs))
            dsts = [torch.empty_like(s) for s in srcs]
            assert all(r.ok for r in await engine.read_blocks("node-b", keys, dsts))
            assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))  # no reply went to the wrong caller

    # two workers per engine: several batches in flight on each engine's connections at once
    await asyncio.wait_for(asyncio.gather(*(worker(2 * n + j, e) for n, e in enumerate(engines) for j in range(2))), 60)
    for engine in engines:
        await engine.close()


async def test_timeout_reports_every_unfinished_item(node):
    store, server = node
    await store.put(b"k", payload(1, 4 * KB))
    engine = engine_for(server)
    with stalling(server, "_read"):
        results = await engine.read_blocks(
            "node-b", [b"k", b"k"], [torch.empty(4 * KB, dtype=torch.uint8)] * 2, timeout=0.3
        )
    assert all(isinstance(r.error, TimeoutError) for r in results)
    (res,) = await engine.read_blocks("node-b", [b"k"], [torch.empty(4 * KB, dtype=torch.uint8)])
    assert res.ok  # the stalled connection was dropped; a fresh one works
    await engine.close()


async def test_a_new_transport_plugs_in_without_touching_callers(node):
    store, server = node
    await store.put(b"k", payload(1, 4 * KB))
    calls = []

    class CountingTcp(TcpTransport):
        name = "counting"

        async def read(self, peer, items):
            calls.append(len(items))
            return await super().read(peer, items)

    TRANSPORTS.register("counting", CountingTcp)
    try:
        engine = engine_for(server, ("counting",))
        (res,) = await engine.read_blocks("node-b", [b"k"], [torch.empty(4 * KB, dtype=torch.uint8)])
        assert res.ok and res.transport == "counting" and calls == [1]
        await engine.close()
    finally:
        TRANSPORTS.unregister("counting")
    with pytest.raises(ValueError, match="unknown transports"):
        TransferEngine("x", SECRET, transports=("carrier-pigeon",))


async def test_server_rejects_a_short_secret(node):
    store, _ = node
    from tiercake.transfer import TransferServer

    with pytest.raises(ValueError, match="16 bytes"):
        TransferServer(store, b"short", "n")


async def test_shm_follows_a_node_agent_that_restarted_with_a_new_pool_at_the_same_path():
    """A restarted node agent creates a new pool region, maybe at the same path. A client that mapped
    the old one must not copy into (or out of) that stale mapping: it would write blocks nobody can
    see and read bytes that are not the block."""
    import os
    import uuid

    from tiercake.tiers import PoolBackend, PoolRegion, Tier, TieredStore
    from tiercake.transfer import TransferServer

    path = str(shm_file(f"test-restart-{os.getpid()}-{uuid.uuid4().hex[:6]}"))

    async def node(port: int = 0):
        store = await TieredStore([Tier(PoolBackend(PoolRegion.create(path, 4 << 20)))]).open()
        return store, await TransferServer(store, SECRET, "node-r", port=port).start()

    store, server = await node()
    port = server.address[1]
    engine = TransferEngine("client", SECRET, transports=("shm",))
    engine.add_peer("node-r", "127.0.0.1", port)
    try:
        assert (await engine.write_blocks("node-r", [b"a" * 32], [payload(1, 8192)]))[0].ok
        await stop_node(store, server)  # the pool file goes with it
        store, server = await node(port)  # the same path, the same port, a new region
        for _attempt in range(2):  # the first use may find the old connection broken
            (wrote,) = await engine.write_blocks("node-r", [b"b" * 32], [payload(2, 8192)])
            if wrote.ok:
                break
        assert wrote.ok and wrote.transport == "shm"
        assert torch.equal(torch.from_numpy(await store.get(b"b" * 32)), payload(2, 8192))  # landed in the live pool
        dst = torch.zeros(8192, dtype=torch.uint8)
        (read,) = await engine.read_blocks("node-r", [b"b" * 32], [dst])
        assert read.ok and torch.equal(dst, payload(2, 8192))
    finally:
        await engine.close()
        await stop_node(store, server)


async def test_a_stranger_cannot_make_the_server_allocate_before_it_authenticates(node):
    """Before AUTH is verified, a frame may be only as large as a handshake needs: announcing 16 MiB
    (as 48 idle connections once did, for ~770 MB of a node agent's memory) is refused at once, before
    any of it is allocated or read; so is any frame other than AUTH."""
    store, server = node

    def announce(op, length):
        sock = socket.create_connection(server.address, timeout=5)
        try:
            read_frame(sock)  # HELLO
            started = time.monotonic()
            sock.sendall(raw_frame(op, b"", length=length))  # the header only: the body never comes
            reply = read_frame(sock)
            return reply, time.monotonic() - started
        finally:
            sock.close()

    (op, body), took = await asyncio.to_thread(announce, p.Op.AUTH, p.MAX_BODY)
    assert op == p.Op.ERROR and b"over the limit of 4096" in body and took < 2  # not after the 10 s timeout
    (op, body), took = await asyncio.to_thread(announce, p.Op.READ, 1000)
    assert op == p.Op.ERROR and b"expected AUTH, got READ" in body and took < 2
    assert server.refused >= 2


async def test_delete_removes_every_copy_and_refuses_a_block_being_read(node):
    store, server = node
    engine = engine_for(server)
    keys = [b"del-0", b"del-1", b"del-2"]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, [payload(i, 8 * KB) for i in range(3)]))
    store.pin(keys[2], hard=True)
    lease = store.acquire_lease(keys[1])  # a reader holds it
    deleted = await engine.delete_blocks("node-b", keys + [b"never-written"])
    assert [r.ok for r in deleted] == [True, False, False, False]
    assert [r.error.status for r in deleted[1:]] == [Status.LEASED, Status.PINNED, Status.NOT_FOUND]
    assert not store.contains(keys[0]) and store.contains(keys[1]) and store.contains(keys[2])
    await store.release_lease(keys[1], lease.id)
    (again,) = await engine.delete_blocks("node-b", [keys[1]])
    assert again.ok and not store.contains(keys[1])
    (gone,) = await engine.read_blocks("node-b", [keys[0]], [torch.empty(8 * KB, dtype=torch.uint8)])
    assert gone.error.status is Status.NOT_FOUND
    await engine.close()


async def test_stage_brings_disk_only_blocks_into_the_pool_within_a_bound(tmp_path):
    """A prefetch: blocks the node holds only on SSD are copied up into its pool ahead of a read; the
    bound (a quarter of the memory tiers per call) keeps one call from flushing the pool."""
    store, server = await start_node("node-b", pool_bytes=64 * KB * 4, ssd_dir=tmp_path / "ssd")
    engine = engine_for(server)
    try:
        keys = [f"stage-{i}".encode() for i in range(4)]
        assert all(r.ok for r in await engine.write_blocks("node-b", keys, [payload(i, 32 * KB) for i in range(4)]))
        await store.flush(["pool"])  # pushed down: only the SSD tier holds them now
        assert all(store.where(k) == ["ssd"] for k in keys)
        staged = await engine.stage_blocks("node-b", keys + [b"never-written"])
        # 64 KiB of a 256 KiB pool per call: the first two come up, the rest stay on disk
        assert [r.ok for r in staged] == [True, True, False, False, False]
        assert [r.error.status for r in staged[2:]] == [Status.FULL, Status.FULL, Status.NOT_FOUND]
        assert store.where(keys[0]) == ["pool", "ssd"] and store.where(keys[2]) == ["ssd"]
        again = await engine.stage_blocks("node-b", keys[:3])  # in memory already: nothing to bring
        assert [r.ok for r in again] == [True, True, True]
        out = torch.empty(32 * KB, dtype=torch.uint8)
        (read,) = await engine.read_blocks("node-b", [keys[1]], [out])
        assert read.ok and torch.equal(out, payload(1, 32 * KB))
    finally:
        await engine.close()
        await stop_node(store, server)


async def test_delete_on_a_dead_peer_fails_every_item_in_time(node):
    _, server = node
    engine = TransferEngine("node-a", SECRET, transports=("tcp",), connect_timeout=0.5)
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        engine.add_peer("node-x", *spare.getsockname())  # nothing listens there
        results = await engine.delete_blocks("node-x", [b"a", b"b"], timeout=2.0)
    assert [r.ok for r in results] == [False, False] and all(r.error is not None for r in results)
    await engine.close()


async def test_answers_tells_a_live_peer_from_a_stalled_or_dead_one(node):
    """The fence's probe (workers/fence.py): a round trip that moves nothing, bounded by its timeout."""
    store, server = node
    engine = engine_for(server)
    assert await engine.answers("node-b")
    with stalling(server, "_stage"):
        started = time.monotonic()
        assert not await engine.answers("node-b", timeout=0.3)
        assert time.monotonic() - started < 1.0
    assert await engine.answers("node-b")
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        engine.add_peer("node-x", *spare.getsockname())  # nothing listens there
        assert not await engine.answers("node-x", timeout=0.5)
    assert await engine.answers("node-unknown")  # not this question: membership decides
    await engine.close()


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
async def test_a_block_keeps_its_seal_on_every_path_and_across_a_restart(tmp_path, make_store, transports):
    store, server = await start_node("node-b", pool_bytes=256 * KB, ssd_dir=tmp_path / "ssd")
    engine = engine_for(server, transports)
    keys, srcs = [b"sealed-0", b"sealed-1"], [payload(i, 64 * KB) for i in range(2)]
    seals = [bytes([i + 1]) * 16 for i in range(2)]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, srcs, seals=seals))
    await store.flush(["pool"])  # the first read finds both on SSD (the stream), then in the pool again
    for _ in range(2):
        dsts = [torch.empty(64 * KB, dtype=torch.uint8) for _ in keys]
        read = await engine.read_blocks("node-b", keys, dsts)
        assert [r.seal for r in read] == seals and all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    # a pull keeps the source's seal; one that ``verify`` refuses is not stored and fails typed
    local = await make_store(gpu=None, pool=64, ssd=None)
    local.payload_nbytes = None
    puller = TransferEngine("node-a", SECRET, local, transports=transports)
    puller.add_peer("node-b", *server.address)
    checked = []

    def verify(key, data, seal):
        checked.append((key, bytes(data[:8]), seal))
        return key == keys[0]

    pulled = await puller.transfer(
        [Transfer(BlockLoc("node-b", k), BlockLoc("node-a", k), 64 * KB) for k in keys], verify=verify
    )
    assert checked == [(k, bytes(s[:8].numpy()), seal) for k, s, seal in zip(keys, srcs, seals)]
    assert pulled[0].ok and pulled[0].seal == seals[0] and local.seal_of(keys[0]) == seals[0]
    assert isinstance(pulled[1].error, p.SealError) and pulled[1].error.status is Status.CHECKSUM
    assert not local.contains(keys[1])
    # the seal is in the block's file on SSD: a restarted node still hands it out
    await store.flush(["pool"])
    await stop_node(store, server)
    reopened = await TieredStore([Tier(SsdFilesBackend(tmp_path / "ssd", capacity_bytes=64 << 20))]).open()
    assert [reopened.seal_of(k) for k in keys] == seals
    await reopened.close()
    await engine.close()
    await puller.close()


def test_the_wire_tables_carry_seals_and_refuse_oversized_ones():
    item = p.WriteItem(b"k", 10, b"parent", tenant="alice", seal=b"s" * 16)
    assert p.decode_write(p.encode_write([item])) == [item]
    reply = p.ReplyItem(Status.OK, 10, 0, "", seal=b"x" * 16)
    assert p.decode_read_reply(p.encode_read_reply([reply]))[0].seal == reply.seal
    assert p.decode_lease_reply(p.encode_lease_reply([reply]))[0].seal == reply.seal
    with pytest.raises(ValueError, match="seals are at most"):
        p.encode_write([p.WriteItem(b"k", 10, seal=b"s" * (p.MAX_SEAL + 1))])


def test_small_and_large_tables_are_the_same_bytes():
    """Up to SMALL_TABLE items a table is packed with struct, beyond with numpy: one format."""
    items = [
        p.WriteItem(f"k{i}".encode(), i * 4096 + 1, b"p" if i % 2 else None, i, f"t{i}", bytes([i]) * (i % 3))
        for i in range(3 * p.SMALL_TABLE)
    ]
    for n in (1, p.SMALL_TABLE, p.SMALL_TABLE + 1, len(items)):
        body = p.encode_write(items[:n])
        fixed = 4 + n * p.WRITE_DT.itemsize
        rows = [
            (len(it.key), len(it.parent or b""), len(it.tenant), len(it.seal), it.length, it.checksum)
            for it in items[:n]
        ]
        assert body[4:fixed] == np.array(rows, dtype=p.WRITE_DT).tobytes()
        assert p.decode_write(body) == items[:n]
    with pytest.raises(ValueError):
        p.encode_read([(b"k", 1 << 64)])


async def test_a_tls_transfer_port_carries_blocks_and_refuses_plain_or_untrusting_clients(tmp_path):
    """With TLS the port speaks TLS only: blocks of every size (the event loop's and the bulk threads'
    paths) go both ways inside it, the secret's challenge still runs inside, a plain client gets
    nothing it can read, and a client that does not trust the certificate is refused."""
    import ssl

    from tiercake.devtls import self_signed

    cert, key = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    client_ctx.check_hostname = False
    store, server = await start_node("node-b", pool_bytes=32 << 20, tls=server_ctx)
    assert not server.info().ucx
    engine = engine_for(server, ("tcp",), tls=client_ctx)
    sizes = [4 * KB, 64 * KB, BULK_THREAD_BYTES + (1 << 20)]  # the last through a bulk thread
    keys = [f"tls-{n}".encode() for n in sizes]
    srcs = [payload(i, n) for i, n in enumerate(sizes)]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, srcs))
    dsts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    assert all(r.ok for r in await engine.read_blocks("node-b", keys, dsts))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    await engine.close()

    # nothing in the clear: a plain server greets with its HELLO at once, a TLS one waits for a ClientHello
    with socket.create_connection(server.address, timeout=5) as raw:
        raw.settimeout(0.5)
        with pytest.raises(TimeoutError):
            raw.recv(64)
    plain = engine_for(server, ("tcp",))
    (res,) = await plain.read_blocks("node-b", keys[:1], dsts[:1], timeout=1)  # waits for a HELLO that never comes
    assert isinstance(res.error, TimeoutError)
    await plain.close()
    # a client that does not trust the certificate
    stranger = engine_for(server, ("tcp",), tls=ssl.create_default_context())
    (res,) = await stranger.read_blocks("node-b", keys[:1], dsts[:1], timeout=5)
    assert isinstance(res.error, p.AuthenticationError) and "TLS handshake failed" in str(res.error)
    await stranger.close()
    assert server.refused >= 2
    await stop_node(store, server)
