"""What strangers and slow peers may hold of a running cluster (``tiercake up``, every process real):
on every port, 256 connections that send nothing or trickle their head are closed at the head
deadline; strangers announcing large bodies get a 401 before a byte is read; the bodies a front holds
at once stay within its budget (the rest get a retryable 503); unauthenticated transfer connections
go at the handshake deadline and authenticated peers announcing 16 MiB frames hold what they sent;
256 abandoned streams leave no sequence running. Every process's memory is read before and at the
height of it."""

import asyncio
import contextlib
import socket
import time

import aiohttp
import psutil
import pytest
from transfer_helpers import raw_frame
from up_helpers import UpCluster

from tiercake.chaos import pid_listening
from tiercake.errors import BODY_BUDGET_BYTES, BODY_DEADLINE_S, HEAD_DEADLINE_S
from tiercake.transfer import protocol as p
from tiercake.transfer.connection import BlockingConnection, PeerAddress

pytestmark = pytest.mark.cluster  # every test here starts processes

KEY = "key-a"
CONNECTIONS = 256
MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = UpCluster(tmp_path_factory.mktemp("bounds"), serving=f", api_keys: {{{KEY}: alice}}")
    asyncio.run(up.wait_up(workers=2))
    yield up
    up.stop()


def _rss_mib(pids: dict[str, int]) -> dict[str, float]:
    return {name: psutil.Process(pid).memory_info().rss / MIB for name, pid in pids.items()}


async def _ports(up: UpCluster) -> dict[str, tuple[str, int]]:
    """name -> (host, port) of every port the cluster listens on for others."""
    ports = {"public": _host_port(up.url), "control": _host_port(up.control_url)}
    async with aiohttp.ClientSession() as http:
        async with http.get(up.control_url + "/v1/members", headers=up.auth()) as resp:
            members = (await resp.json())["members"]
    for m in members:
        if m["role"] == "node":
            ports["transfer"] = (m["host"], m["port"])
        elif m.get("url"):
            ports[f"worker-{m['role']}"] = _host_port(m["url"])
    return ports


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


async def _closed_by_server(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the far end closes the connection within ``within`` seconds (what it says first is read
    and dropped)."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
    finally:
        writer.close()


async def _idle_or_trickling(host: str, port: int, trickle: bool, within: float) -> bool:
    reader, writer = await asyncio.open_connection(host, port)

    async def drip() -> None:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(int(within) + 5):
            await asyncio.sleep(1)
            writer.write(b"X")  # one byte of a header a second, never its end
            with contextlib.suppress(OSError):
                await writer.drain()

    dripping = asyncio.create_task(drip()) if trickle else None
    try:
        return await _closed_by_server(writer, reader, within)
    finally:
        if dripping is not None:
            dripping.cancel()


async def _body_held(host: str, port: int, key: str | None, announced: int, sent: int) -> tuple[bytes, float]:
    """A POST announcing ``announced`` bytes of body and sending ``sent``: the first line of what the
    server answers meanwhile (b"" if it closed without one) and how long it took."""
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    writer.write(
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {announced}\r\n\r\n"
        ).encode()
    )
    # the answer read as it comes, while the body is sent: a server that answered early and then gave
    # up lingering (LINGER_S) resets the connection, and a reset loses what was not read before it
    answer = asyncio.ensure_future(reader.readline())
    chunk = b" " * MIB
    for start in range(0, sent, MIB):
        if answer.done():
            break
        writer.write(chunk[: min(MIB, sent - start)])
        with contextlib.suppress(OSError):
            await writer.drain()
    started = time.monotonic()
    try:
        async with asyncio.timeout(BODY_DEADLINE_S + 10):
            line = await answer
        return line, time.monotonic() - started
    finally:
        answer.cancel()
        writer.close()


def _announcing_peer(host: str, port: int, secret: bytes) -> socket.socket:
    """An authenticated transfer peer that announces a 16 MiB frame and sends 1 KiB of it."""
    conn = BlockingConnection(PeerAddress("node", host, port), secret, "a-peer").open()
    conn.sock.sendall(raw_frame(p.Op.OBJ_QUERY, b"", length=16 * MIB) + b"x" * 1024)
    return conn.sock


async def test_strangers_and_slow_peers_hold_no_connection_or_memory_past_a_deadline(cluster):
    ports = await _ports(cluster)
    by_pid: dict[int, list[str]] = {}
    for name, (_, port) in ports.items():  # the public and control ports are one process's
        by_pid.setdefault(pid_listening(port), []).append(name)
    pids = {"+".join(names): pid for pid, names in by_pid.items()}
    before = _rss_mib(pids)
    peak = dict(before)
    sampling = True

    async def sample() -> None:
        while sampling:
            for name, rss in _rss_mib(pids).items():
                peak[name] = max(peak[name], rss)
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    host, public = ports["public"]
    secret = (cluster.data_dir / "cluster-secret").read_text().strip().encode()
    peers = [await asyncio.to_thread(_announcing_peer, *ports["transfer"], secret) for _ in range(32)]
    within = HEAD_DEADLINE_S + 5
    idle = [
        _idle_or_trickling(h, port, trickle=i % 2 == 1, within=within)
        for h, port in ports.values()
        for i in range(CONNECTIONS)
    ]
    strangers = [_body_held(host, public, None, 8 * MIB, 8 * MIB - 1) for _ in range(16)]
    holders = [_body_held(host, public, KEY, 8 * MIB, 8 * MIB - 1) for _ in range(16)]
    closed, stranger_answers, holder_answers = await asyncio.gather(
        asyncio.gather(*idle), asyncio.gather(*strangers), asyncio.gather(*holders)
    )
    sampling = False
    await sampler
    for sock in peers:
        sock.close()

    assert all(closed), f"{closed.count(False)} of {len(closed)} idle or trickling connections still open"
    # a stranger is refused on its headers, long before its body would have been read or timed out
    assert all(line.startswith(b"HTTP/1.1 401") and took < 5 for line, took in stranger_answers), stranger_answers
    # key holders: as many bodies as the budget holds are read (and time out: they never end), the
    # rest are refused at once with a retryable 503
    held = [took for line, took in holder_answers if line.startswith(b"HTTP/1.1 408")]
    busy = [took for line, took in holder_answers if line.startswith(b"HTTP/1.1 503")]
    assert len(held) + len(busy) == len(holders), holder_answers
    assert 0 < len(held) <= BODY_BUDGET_BYTES // (8 * MIB) and all(t < 5 for t in busy), holder_answers
    grown = {name: round(peak[name] - before[name]) for name in pids}
    print(f"RSS before {dict((n, round(v)) for n, v in before.items())} MiB; grown at the height {grown} MiB")
    front = next(name for name in grown if "public" in name.split("+"))
    assert grown[front] < BODY_BUDGET_BYTES / MIB + 80, grown  # the front: its body budget and change
    assert all(mib < 80 for name, mib in grown.items() if name != front), grown


async def test_abandoned_streams_leave_nothing_running(cluster):
    host, public = _host_port(cluster.url)
    body = {"model": "tiercake-reference", "prompt": "Abandoned stream. " * 4, "max_tokens": 200, "stream": True}

    async def abandon(http: aiohttp.ClientSession) -> None:
        async with http.post(
            cluster.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            assert resp.status in (200, 429, 503), resp.status
            if resp.status == 200:
                await resp.content.readline()  # the first chunk, then the client goes away

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for _ in range(CONNECTIONS // 32):
            await asyncio.gather(*(abandon(http) for _ in range(32)))
        deadline = time.monotonic() + 20
        async with http.get(cluster.control_url + "/v1/members", headers=cluster.auth()) as resp:
            workers = [m for m in (await resp.json())["members"] if m.get("url")]
        while True:
            running = 0
            for member in workers:
                async with http.get(member["url"] + "/load", headers=cluster.auth()) as resp:
                    running += (await resp.json())["running"]
            if running == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    assert running == 0, f"{running} sequences still running after their clients went away"
