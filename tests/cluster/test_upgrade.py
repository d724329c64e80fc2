"""A cluster upgrades one process at a time: this release beside the previous one (N and N-1), every
process real, the previous release built from this repository's history (tests/previous_release.py).

- transfer protocol 5 and 4 both ways: blocks written and read back byte for byte, over the stream
  and through the shared pool;
- a node agent of the previous release joins a current conductor (its control API), reports what it
  holds, and serves blocks; a worker's session notices are not sent to it (its protocol has no
  SESSION), and it serves on;
- a current node agent joins a conductor of the previous release (registering as that release knew
  members) and serves blocks.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from node_helpers import k, wait_until
from node_helpers import ssd_node_config as node_config
from paths import TESTS
from previous_release import previous_python, previous_site
from transfer_helpers import SECRET, payload

from tiercake.conductor.client import Client
from tiercake.transfer import TransferEngine
from tiercake.transfer import protocol as p
from tiercake.transfer.protocol import SessionNotice

pytestmark = pytest.mark.cluster  # every test here starts processes

PEER = str(TESTS / "version_peer.py")
KB = 1 << 10


@pytest.fixture(scope="module")
def previous() -> Path:
    return previous_site()


def _peer(previous: Path | None, *args: str, **kw) -> subprocess.Popen:
    argv = previous_python(previous, PEER) if previous is not None else [sys.executable, PEER]
    return subprocess.Popen([*argv, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)


def _client(previous: Path | None, port: int, transports: str) -> dict:
    done = _peer(previous, "client", SECRET.decode(), str(port), "24", transports, stderr=subprocess.PIPE)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.parametrize("transports", ["tcp", "shm,tcp"])
def test_transfer_protocol_5_and_4_read_and_write_each_others_blocks(previous, transports):
    for server_release, client_release in ((previous, None), (None, previous)):
        server = _peer(server_release, "serve", SECRET.decode())
        try:
            served = json.loads(server.stdout.readline())
            got = _client(client_release, served["port"], transports)
        finally:
            server.stdin.close()
            server.wait(30)
        assert {served["version"], got["version"]} == {4, 5}
        assert got["written"] == got["read_back"] == 24, got


async def test_a_previous_release_node_agent_joins_a_current_conductor_and_serves_blocks(previous, processes, tmp_path):
    _, conductor = processes(["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--insecure"])
    url = conductor["url"]
    env = {"TIERCAKE_SECRET": SECRET.decode(), "TIERCAKE_ADVERTISE_HOST": "127.0.0.1"}
    processes(
        ["node", "--config", node_config(tmp_path, "node-old", url)],
        env,
        runner=previous_python(previous, "tiercake.cli"),
    )
    processes(["node", "--config", node_config(tmp_path, "node-new", url)], env)
    keys = [k(i) for i in range(6)]
    async with Client([url]) as client:
        members = {m.node_id: m for m in await wait_until(lambda: _two_nodes(client), what="both nodes")}
        assert members["node-old"].transfer_version == 4 and members["node-new"].transfer_version == p.VERSION
        old = members["node-old"]
        # the previous release's link reports to this conductor: the index finds the blocks there
        await _written_found_and_read(client, old, keys)
        # both speak the object operations: the object map gives slots to both
        chains = (await wait_until(lambda: _mapped_to_both(client), what="an object map of both nodes")).chains
        assert {node for chain in chains for node in chain} == {"node-old", "node-new"}
        # a session notice is not sent to a node without SESSION (it would drop the connection), and
        # the node serves on over the same engine
        engine = TransferEngine("worker", SECRET, transports=("tcp",))
        try:
            engine.add_peer(old.node_id, old.host, old.port)
            told = await engine.session_event(old.node_id, SessionNotice(session="s", state="active"), keys)
            assert told.ok
            dsts = [torch.empty(64 * KB, dtype=torch.uint8) for _ in keys]
            assert all(r.ok for r in await engine.read_blocks(old.node_id, keys, dsts))
        finally:
            await engine.close()


async def test_a_current_node_agent_joins_a_previous_release_conductor_and_serves_blocks(previous, processes, tmp_path):
    _, conductor = processes(
        ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--insecure"],
        runner=previous_python(previous, "tiercake.cli"),
    )
    url = conductor["url"]
    env = {"TIERCAKE_SECRET": SECRET.decode(), "TIERCAKE_ADVERTISE_HOST": "127.0.0.1"}
    processes(["node", "--config", node_config(tmp_path, "node-new", url)], env)
    keys = [k(i) for i in range(6)]
    async with Client([url]) as client:
        (member,) = await wait_until(client.members, what="the node's registration")
        await _written_found_and_read(client, member, keys)


async def _written_found_and_read(client: Client, node, keys: list[bytes]) -> None:
    """Blocks written to ``node``, found there by the index (its report reached the conductor), and
    read back byte for byte."""
    engine = TransferEngine("writer", SECRET, transports=("tcp",))
    try:
        engine.add_peer(node.node_id, node.host, node.port)
        blocks = [payload(i, 64 * KB) for i in range(len(keys))]
        written = await engine.write_blocks(node.node_id, keys, blocks, chain=True, tenant="acme")
        assert all(r.ok for r in written), [r.error for r in written]
        found = await wait_until(lambda: client.lookup("acme", keys), what=f"{node.node_id}'s report")
        assert found[node.node_id].length == len(keys)
        dsts = [torch.empty(64 * KB, dtype=torch.uint8) for _ in keys]
        read = await engine.read_blocks(node.node_id, keys, dsts)
        assert all(r.ok for r in read) and all(torch.equal(d, b) for d, b in zip(dsts, blocks))
    finally:
        await engine.close()


async def _two_nodes(client: Client):
    members = [m for m in await client.members() if m.role == "node"]
    return members if len(members) == 2 else None


async def _mapped_to_both(client: Client):
    """The object map once it gives slots to both nodes (the second to register joins it later)."""
    view = await client.object_map()
    return view if {node for chain in view.chains for node in chain} == {"node-old", "node-new"} else None


def test_the_previous_release_is_the_last_of_protocol_4(previous):
    """PREVIOUS pins the release the N-1 tests run against: when VERSION moves on, so must it."""
    assert p.OLDEST == p.VERSION - 1
    spoken = subprocess.run([*previous_python(previous, PEER), "version"], capture_output=True, text=True, timeout=60)
    assert spoken.stdout.strip() == str(p.OLDEST), spoken.stderr[-2000:]
