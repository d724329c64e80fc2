"""A connection whose peer stops acknowledging is aborted in seconds (``tiercake.dead_peer``): in a
network namespace of its own, the server's packets to the client are dropped after it accepted, as
in a one-way partition; the client's read fails with ETIMEDOUT instead of waiting for the kernel's
retransmissions (minutes)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and iptables need root (CI runs as root)"),
]

PROBE = textwrap.dedent(
    """
    import socket, subprocess, sys, time
    from tiercake import dead_peer
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.socket()
    if sys.argv[1] == "watched":
        dead_peer.watch(client)
    client.connect(("127.0.0.1", port))
    peer, _ = server.accept()
    drop = ["iptables", "-A", "OUTPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"]
    subprocess.run(drop, check=True)
    client.settimeout(9)
    started = time.monotonic()
    client.sendall(b"a request no answer comes to")
    try:
        client.recv(1)
        print("answered")
    except OSError as exc:
        print(type(exc).__name__, exc.errno, round(time.monotonic() - started, 1))
    """
)


def _probe(mode: str) -> list[str]:
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_peer_that_stops_acknowledging_is_dropped_in_seconds():
    name, errno, seconds = _probe("watched")
    assert name == "TimeoutError" and int(errno) == 110, (name, errno)  # ETIMEDOUT: the kernel gave up
    assert float(seconds) < 7, seconds
    # unwatched, the same socket is still waiting when the test's own 9 s timeout ends it
    name, errno, seconds = _probe("plain")
    assert name == "TimeoutError" and errno == "None" and float(seconds) >= 8.5, (name, errno, seconds)
