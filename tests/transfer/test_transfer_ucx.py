"""The UCX transport (the optional `ucx` extra, which `make test` installs)."""

import asyncio
import os
import sys

import pytest
import torch
from transfer_helpers import SECRET, authenticated_socket, payload, raw_frame, read_frame, start_node, stop_node

pytest.importorskip("ucxx", reason="the optional 'ucx' extra (ucxx) is not installed")

from tiercake.tiers.pool import remove_pool
from tiercake.transfer import Status, TransferEngine  # noqa: E402
from tiercake.transfer import protocol as p  # noqa: E402
from tiercake.transfer.ucx import tag  # noqa: E402

MB = 1 << 20


@pytest.fixture
async def node():
    store, server = await start_node("node-b", pool_bytes=64 * MB)
    yield store, server
    await stop_node(store, server)


async def test_ucx_roundtrip_and_item_errors(node):
    store, server = node
    assert server.info().ucx
    engine = TransferEngine("node-a", SECRET, transports=("ucx", "tcp"))
    engine.add_peer("node-b", *server.address)
    sizes = [4096, MB, 3 * MB + 5]
    keys = [f"u{i}".encode() for i in range(3)]
    srcs = [payload(i, n) for i, n in enumerate(sizes)]
    wrote = await engine.write_blocks("node-b", keys + [keys[0]], srcs + [srcs[0]])
    # the same key twice in one batch: the second finds the first still in progress
    assert [r.ok for r in wrote] == [True, True, True, False] and wrote[3].error.status is Status.IN_PROGRESS
    assert {r.transport for r in wrote} == {"ucx"}
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    read = await engine.read_blocks("node-b", keys + [b"missing"], dsts + [torch.empty(8, dtype=torch.uint8)])
    assert [r.ok for r in read] == [True, True, True, False] and read[3].error.status is Status.NOT_FOUND
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    await engine.close()


async def test_ucx_without_hello_is_a_protocol_error(node):
    store, server = node

    def by_hand():
        sock = authenticated_socket(server.address)
        sock.sendall(raw_frame(p.Op.READ, p.encode_read([(b"k", 4)]), flags=p.FLAG_UCX))
        return read_frame(sock)

    op, body = await asyncio.to_thread(by_hand)
    assert op == p.Op.ERROR and b"before UCX_HELLO" in body


async def test_ucx_writer_that_hangs_up_leaves_nothing(node):
    """The client announces a UCX write, then drops the stream without sending: the server cancels
    the receives, revokes the reservations, and frees the space."""
    store, server = node
    engine = TransferEngine("node-a", SECRET, transports=("ucx",))
    engine.add_peer("node-b", *server.address)
    peer = await engine._peer("node-b")
    transport = engine.transport_for(peer)
    used = store.tier("pool").backend.used_bytes
    async with peer.channel.connection() as conn:
        await transport._endpoint(conn, peer)  # UCX_HELLO done
        async with conn._request() as request:
            table = p.encode_write([p.WriteItem(b"w", MB)])
            await p_send(conn, request, table)
            await conn._reply(request, p.Op.WRITE_READY)
        conn.close()  # gone before any byte of data
    for _ in range(200):
        await asyncio.sleep(0.01)
        if store.tier("pool").backend.used_bytes == used:
            break
    assert store.tier("pool").backend.used_bytes == used and not store.contains(b"w")
    await engine.close()


async def p_send(conn, request, table):
    from tiercake.transfer.sockio import send_frame

    await send_frame(conn.sock, p.Op.WRITE, request, table, p.FLAG_UCX)


def test_tags_do_not_collide():
    seen = {tag(c, r, i) for c in (1, 2) for r in (1, 2**32 + 1, 7) for i in (0, 1, 4095)}
    assert len(seen) == 2 * 2 * 3  # request ids wrap at 2**32 (1 and 2**32 + 1 share a tag by design)
    assert tag(1, 1, 0) != tag(2, 1, 0) and tag(1, 1, 0) != tag(1, 2, 0) and tag(1, 1, 0) != tag(1, 1, 1)


@pytest.mark.cluster
async def test_ucx_across_processes(tmp_path):
    """A node agent in another process: same host, so the endpoints skip failure handling and UCX
    moves the bytes through shared memory."""
    from node_helpers import pool_node_config as node_config
    from node_helpers import pool_path

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tiercake.cli",
        "node",
        "--config",
        node_config(tmp_path, "node-u", transports="local, shm, tcp, ucx"),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "TIERCAKE_SECRET": SECRET.decode(), "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )
    import json

    address = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
    engine = TransferEngine("node-a", SECRET, transports=("ucx",))
    engine.add_peer("node-u", address["host"], address["port"])
    srcs = [payload(i, 4 * MB) for i in range(6)]
    keys = [f"x{i}".encode() for i in range(6)]
    assert all(r.ok and r.transport == "ucx" for r in await engine.write_blocks("node-u", keys, srcs))
    dsts = [torch.empty(4 * MB, dtype=torch.uint8) for _ in srcs]
    assert all(r.ok for r in await engine.read_blocks("node-u", keys, dsts))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    await engine.close()
    proc.terminate()
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    remove_pool(pool_path("node-u"))  # a node agent keeps its pool for a restart; a test's goes


@pytest.mark.cluster
async def test_a_node_agent_serves_ucx_only_when_its_transports_list_it(tmp_path):
    """UCX is code a peer can reach: a node agent whose cluster does not use it does not serve it."""
    from node_helpers import pool_node_config as node_config
    from node_helpers import pool_path

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tiercake.cli",
        "node",
        "--config",
        node_config(tmp_path, "node-t"),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "TIERCAKE_SECRET": SECRET.decode()},
    )
    import json

    try:
        address = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        engine = TransferEngine("node-a", SECRET, transports=("ucx",))
        engine.add_peer("node-t", address["host"], address["port"])
        (result,) = await engine.write_blocks("node-t", [b"k"], [payload(1, 1024)])
        assert not result.ok and "no transport reaches node-t" in str(result.error)
        await engine.close()
    finally:
        proc.terminate()
        await proc.wait()
        remove_pool(pool_path("node-t"))


async def test_a_garbage_ucx_address_is_refused_not_handed_to_ucx(node):
    """UCX aborts the process on a malformed worker address (the fuzzer found it): an address that
    is not sealed by a peer holding the cluster secret never reaches it."""
    store, server = node

    def hello(body: bytes):
        sock = authenticated_socket(server.address)
        sock.sendall(raw_frame(p.Op.UCX_HELLO, body))
        return read_frame(sock)

    for body in (b"\x01" + os.urandom(217), b"\x00" + os.urandom(40), b"\x01" + bytes(32) + b"\x20"):
        op, reply = await asyncio.to_thread(hello, body)
        assert op == p.Op.ERROR and b"sealed by a tiercake peer" in reply
    await store.put(b"alive", payload(2, 1024))  # and the server is still here
    engine = TransferEngine("node-a", SECRET, transports=("ucx",))
    engine.add_peer("node-b", *server.address)
    dst = torch.empty(1024, dtype=torch.uint8)
    (read,) = await engine.read_blocks("node-b", [b"alive"], [dst])
    assert read.ok and read.transport == "ucx" and torch.equal(dst, payload(2, 1024))
    await engine.close()


async def test_ucx_reader_that_hangs_up_releases_its_leases(node):
    """The server holds leases while UCX sends; a reader that vanishes must not pin the blocks."""
    store, server = node
    await store.put(b"big", payload(5, 8 * MB))
    engine = TransferEngine("node-a", SECRET, transports=("ucx",))
    engine.add_peer("node-b", *server.address)
    peer = await engine._peer("node-b")
    transport = engine.transport_for(peer)
    async with peer.channel.connection() as conn:
        await transport._endpoint(conn, peer)
        async with conn._request() as request:
            from tiercake.transfer.sockio import send_frame

            await send_frame(conn.sock, p.Op.READ, request, p.encode_read([(b"big", 8 * MB)]), p.FLAG_UCX)
            await conn._reply(request, p.Op.READ_REPLY)  # the server now sends; we never receive
        conn.close()
    for _ in range(500):
        await asyncio.sleep(0.01)
        try:
            await store.remove(b"big")  # refused while a lease is held
            break
        except Exception:
            continue
    assert not store.contains(b"big")
    await engine.close()
