"""The transfer port under fuzzed frames (hypothesis), before and after authentication: the server
answers with an error or closes the connection, never crashes, never leaks a connection, keeps
serving everyone else, and its memory stays bounded. (The HTTP APIs' fuzz target runs against a
real cluster in test_serving.py.)"""

import asyncio
import os
import resource
import socket
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import SECRET, authenticated_socket, payload, raw_frame, start_node, stop_node

from tiercake.transfer import TransferEngine
from tiercake.transfer import protocol as p

OPS = st.one_of(st.sampled_from(list(p.Op)), st.integers(0, 255))
KEYS = st.binary(min_size=1, max_size=80)  # the encoders refuse empty keys; a raw body can still carry one
LENGTHS = st.one_of(st.integers(0, 1 << 16), st.integers(0, (1 << 63) - 1))


def _tables() -> st.SearchStrategy[bytes]:
    """Bodies the server will parse: well-formed tables with hostile values, and the same cut or padded."""
    reads = st.lists(st.tuples(KEYS, LENGTHS), max_size=6).map(
        lambda items: p.encode_read([(k[: p.MAX_KEY], n) for k, n in items])
    )
    writes = st.lists(
        st.builds(
            p.WriteItem,
            KEYS.map(lambda k: k[: p.MAX_KEY]),
            st.integers(0, 1 << 12),
            st.none(),
            st.integers(0, (1 << 64) - 1),
            st.text(max_size=8),
        ),
        max_size=4,
    ).map(p.encode_write)
    leases = st.lists(st.tuples(KEYS, LENGTHS, st.floats(allow_nan=True)), max_size=4).map(
        lambda items: p.encode_lease([(k[: p.MAX_KEY], n, t) for k, n, t in items])
    )
    counts = st.integers(0, (1 << 32) - 1).map(lambda n: struct.pack("<I", n))
    whole = st.one_of(reads, writes, leases, counts)
    return st.one_of(
        whole,
        st.tuples(whole, st.integers(0, 40), st.binary(max_size=40)).map(
            lambda t: t[0][: max(0, len(t[0]) - t[1])] + t[2]
        ),
    )


FRAMES = st.tuples(OPS, st.integers(0, 255), st.one_of(_tables(), st.binary(max_size=600)), st.binary(max_size=256))


def _exchange(address, frame: bytes, trailing: bytes, authenticate: bool) -> None:
    """Send one frame (and whatever follows it), read what comes back for a moment, hang up."""
    sock = authenticated_socket(address) if authenticate else socket.create_connection(address, timeout=5)
    try:
        sock.sendall(frame + trailing)
        sock.settimeout(0.3)
        try:
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionResetError):
            pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server hung up on it first
    finally:
        sock.close()


async def test_fuzzed_frames_never_crash_wedge_or_leak_the_transfer_server():
    store, server = await start_node("fuzzed")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sent = {"n": 0}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(frame=FRAMES, authenticate=st.booleans())
    def fuzz(frame, authenticate):
        op, flags, body, trailing = frame
        _exchange(server.address, raw_frame(op, body, request=7, flags=flags), trailing, authenticate)
        sent["n"] += 1

    try:
        await asyncio.to_thread(fuzz)
        assert sent["n"] >= 200
        # every fuzzed connection is gone (none left waiting forever), and the server serves as before
        for _ in range(100):
            if not server._connections:
                break
            await asyncio.sleep(0.05)
        assert not server._connections, f"{len(server._connections)} connections still open"
        engine = TransferEngine("honest", SECRET, transports=("tcp",))
        engine.add_peer("fuzzed", *server.address)
        block = payload(5, 4096)
        (wrote,) = await engine.write_blocks("fuzzed", [b"after-the-fuzz"], [block])
        dst = torch.empty(4096, dtype=torch.uint8)
        (read,) = await engine.read_blocks("fuzzed", [b"after-the-fuzz"], [dst])
        assert wrote.ok and read.ok and torch.equal(dst, block)
        await engine.close()
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        assert grown_mb < 200, f"peak memory grew {grown_mb:.0f} MB over the fuzz"
    finally:
        await stop_node(store, server)
    assert os.getpid()  # the process (server and fuzzer in one) is still here: nothing crashed it
