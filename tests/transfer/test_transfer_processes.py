"""The transfer engine against node agents in other processes: real processes, real kills."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from node_helpers import pool_node_config as node_config
from node_helpers import pool_path
from transfer_helpers import SECRET, payload

from tiercake.tiers.pool import remove_pool
from tiercake.transfer import PeerClosedError, TransferEngine

pytestmark = pytest.mark.cluster  # every test here starts processes

MB = 1 << 20


@pytest.fixture
def node_process(tmp_path):
    procs = []

    names = []

    def start(name: str = "node-b", secret: bytes = SECRET, pool: str = "256MiB"):
        names.append(name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiercake.cli", "node", "--config", node_config(tmp_path, name, pool)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "TIERCAKE_SECRET": secret.decode()},
        )
        procs.append(proc)
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()
        return proc, json.loads(line)

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
    for name in names:  # a killed node agent leaves its pool behind (a restart would take it over)
        remove_pool(pool_path(name))


async def test_node_agent_serves_and_stops_cleanly(node_process):
    proc, address = node_process()
    engine = TransferEngine("client", SECRET, transports=("tcp",))
    engine.add_peer(address["node_id"], address["host"], address["port"])
    srcs = [payload(i, 2 * MB) for i in range(4)]
    keys = [f"k{i}".encode() for i in range(4)]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, srcs))
    dsts = [torch.empty(2 * MB, dtype=torch.uint8) for _ in range(4)]
    assert all(r.ok for r in await engine.read_blocks("node-b", keys, dsts))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    await engine.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_node_agent_without_a_secret_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TIERCAKE_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", "node", "--config", node_config(tmp_path, "n")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2 and "no cluster secret" in done.stderr  # errors go to stderr


async def test_peer_killed_during_a_batch(node_process):
    proc, address = node_process()
    engine = TransferEngine("client", SECRET, transports=("tcp",), streams=1)
    engine.add_peer("node-b", address["host"], address["port"])
    keys = [f"big{i}".encode() for i in range(24)]
    srcs = [payload(i, 8 * MB) for i in range(24)]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, srcs))
    dsts = [torch.zeros(8 * MB, dtype=torch.uint8) for _ in keys]
    reading = asyncio.create_task(engine.read_blocks("node-b", keys, dsts))
    await asyncio.sleep(0.02)  # the batch is on the wire
    proc.kill()
    results = await asyncio.wait_for(reading, 30)
    failed = [r for r in results if not r.ok]
    assert failed, "the kill landed after the batch finished; make the batch larger"
    assert all(isinstance(r.error, PeerClosedError) for r in failed)
    for r, d, s in zip(results, dsts, srcs):  # nothing reported as read is wrong
        if r.ok:
            assert torch.equal(d, s)
    # and the next call fails fast and clearly instead of hanging (once the process is gone: until the
    # kernel has closed a killed process's files, its listening socket may still take a connection)
    await asyncio.to_thread(proc.wait, 10)
    t0 = time.monotonic()
    (again,) = await engine.read_blocks("node-b", keys[:1], dsts[:1], timeout=10)
    assert isinstance(again.error, PeerClosedError) and "cannot reach" in str(again.error)
    assert time.monotonic() - t0 < 5
    await engine.close()


async def test_a_paused_peer_times_out_and_recovers(node_process):
    proc, address = node_process()
    engine = TransferEngine("client", SECRET, transports=("tcp",))
    engine.add_peer("node-b", address["host"], address["port"])
    assert (await engine.write_blocks("node-b", [b"k"], [payload(1, MB)]))[0].ok
    os.kill(proc.pid, signal.SIGSTOP)  # the peer stalls, as under a long GC pause or a partition
    results = await engine.read_blocks("node-b", [b"k"], [torch.empty(MB, dtype=torch.uint8)], timeout=0.5)
    assert isinstance(results[0].error, TimeoutError)
    os.kill(proc.pid, signal.SIGCONT)
    out = torch.empty(MB, dtype=torch.uint8)
    (res,) = await engine.read_blocks("node-b", [b"k"], [out], timeout=10)
    assert res.ok and torch.equal(out, payload(1, MB))
    await engine.close()


async def test_client_process_killed_mid_write(node_process, tmp_path):
    """A writer dies with its batch half sent: the node serves none of that batch's blocks."""
    proc, address = node_process(pool="320MiB")  # room for the whole batch: no item is refused
    script = (
        "import asyncio, torch, sys\n"
        "from tiercake.transfer import TransferEngine\n"
        "async def main():\n"
        f"    e = TransferEngine('dying', {SECRET!r}, transports=('tcp',), streams=1)\n"
        f"    e.add_peer('node-b', {address['host']!r}, {address['port']})\n"
        "    srcs = [torch.full((16 << 20,), i, dtype=torch.uint8) for i in range(16)]\n"
        "    print('ready', flush=True)\n"
        "    await e.write_blocks('node-b', [b'w%d' % i for i in range(16)], srcs)\n"
        "asyncio.run(main())\n"
    )
    writer = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    assert (await writer.stdout.readline()).strip() == b"ready"
    await asyncio.sleep(0.04)  # 256 MiB take about 0.1 s to send: land in the middle
    writer.kill()
    await writer.wait()
    engine = TransferEngine("client", SECRET, transports=("tcp",))
    engine.add_peer("node-b", address["host"], address["port"])
    await asyncio.sleep(0.2)
    results = await engine.read_blocks(
        "node-b", [b"w%d" % i for i in range(16)], [torch.empty(16 << 20, dtype=torch.uint8) for _ in range(16)]
    )
    served = [r for r in results if r.ok]
    assert not served or len(served) == 16  # all of the batch committed before the kill, or none of it
    await engine.close()
