"""The store's planes apart, with real node agents: what a slot's backups take comes only from the
slot's primary node itself (the node secret, proved under its own name: no client holds it), and a
tenant's key reaches that tenant's objects and nothing else."""

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
from kvstore_helpers import SECRET, TOKEN, KvCluster, blob, ready

from tiercake.blocks import object_id, object_slot
from tiercake.credentials import tenant_key
from tiercake.kvstore import AsyncStore, Durability, MooncakeDistributedStore
from tiercake.kvstore.errors import StoreApiError
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import PeerAddress, PeerConnection
from tiercake.transfer.protocol import FLAG_EAGER, NODE, Credential, Op, Status

pytestmark = pytest.mark.cluster  # every test here starts processes


async def _replicate(address: PeerAddress, credential, name: str, requests) -> list[set[Status]]:
    """Send ``requests`` (request, payloads) on one connection proved with ``credential`` as ``name``."""
    conn = await PeerConnection(address, credential, name).open()
    try:
        answers = []
        for request, data in requests:
            body = await conn.exchange(Op.OBJ_REPLICATE, Op.OBJ_REPLICATE_REPLY, w.encode(request), FLAG_EAGER, data)
            answers.append({r.status for r in w.decode(w.ReplicateReply, body).results})
        return answers
    finally:
        conn.close()


async def test_forged_replication_is_refused_counted_and_every_acknowledged_object_survives_its_primary(tmp_path):
    """A client (the cluster secret, as every key-value client holds it) and a node that is not the
    slot's primary each send a backup a SYNC_BEGIN (which would drop the slot) and a version of 10^15
    naming the primary: refused, FORBIDDEN, and counted on the backup's /metrics. Then the primary is
    SIGKILLed: its backup takes over with every acknowledged replicated object as it was written."""
    cluster = KvCluster(tmp_path, nodes=("kv-a", "kv-b", "kv-c"), replicas_max=2, failover_s=1.5, metrics=True)
    try:
        async with cluster.store() as store:
            await ready(store, 3, replicas_max=2)
            written = {f"rep-{i}": blob(i, 4096) for i in range(20)}
            for name, value in written.items():
                await store.put(name, value, durability=Durability(replicas=2))
            oid = object_id(b"rep-0", "default")
            slot = object_slot(oid, store.map.slots)
            primary, backup = store.map.chains[slot][:2]
            (outsider,) = {"kv-a", "kv-b", "kv-c"} - {primary, backup}
            address = PeerAddress(backup, *store.members[backup])
            forged = w.Replica("default", b"rep-0", 10**15, 5, 2, False, False, w.NO_SOFT_PIN)
            requests = [
                (w.ReplicateRequest(slot, store.map.epoch, primary, w.SYNC_BEGIN), []),
                (
                    w.ReplicateRequest(slot, store.map.epoch, primary, w.ITEMS, [forged]),
                    [np.frombuffer(b"forge", np.uint8)],
                ),
            ]
            node_secret = os.environ["TIERCAKE_NODE_SECRET"].encode()
            for credential, name in ((SECRET.encode(), "kvstore-forger"), (Credential(node_secret, NODE), outsider)):
                assert await _replicate(address, credential, name, requests) == [{Status.FORBIDDEN}] * 2
            assert cluster.metric(backup, "tiercake_replication_forged") == 4
            cluster.kill(primary)  # its slots go to their backups
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                got = await store.get_many(list(written))
                if all(isinstance(g, np.ndarray) for g in got) or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert [bytes(g) if isinstance(g, np.ndarray) else g for g in got] == list(written.values())
    finally:
        cluster.close()


async def test_a_tenants_key_reaches_its_objects_and_nothing_else(tmp_path):
    """A client given only ``tiercake secret tenant alice``'s key (no cluster secret, no control
    token): it finds the nodes and puts, gets and removes alice's objects; bob's, with the same key,
    are FORBIDDEN (Mooncake's -601, ILLEGAL_CLIENT), and so are blocks; a wrong key is refused at the
    handshake, and on the control API it reads the object map but registers nothing."""
    import aiohttp

    cluster = KvCluster(tmp_path, nodes=("kv-a",))
    try:
        async with cluster.store(tenant="bob") as bob:
            await ready(bob, 1)
            await bob.put("bobs", b"not alice's")
        printed = subprocess.run(
            [sys.executable, "-m", "tiercake.cli", "secret", "tenant", "alice"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TIERCAKE_SECRET": SECRET},
        )
        key = printed.stdout.strip()
        assert printed.returncode == 0 and key == tenant_key(SECRET.encode(), "alice").decode()
        async with AsyncStore(cluster.urls, tenant_key=key, tenant="alice") as alice:
            await alice.put("mine", b"alice's own")
            assert await alice.get("mine") == b"alice's own"
            await alice.remove("mine", force=True)  # past the read lease its get took
            assert not await alice.exists("mine")
        with pytest.raises(StoreApiError, match="401"):  # alice's key under bob's name: not even the map
            async with AsyncStore(cluster.urls, tenant_key=key, tenant="bob"):
                pass
        sync = MooncakeDistributedStore()
        assert sync.setup(cluster.url, tenant_key=key, tenant="alice") == 0
        try:
            assert sync.put("sync", b"alice's too") == 0 and sync.get("sync") == b"alice's too"
        finally:
            sync.close()
        async with aiohttp.ClientSession() as http:
            auth = {"Authorization": f"Bearer tenant.alice.{key}"}
            async with http.get(cluster.url + "/v1/objects/map", headers=auth) as resp:
                assert resp.status == 200
            async with http.post(cluster.url + "/v1/flush", json={}, headers=auth) as resp:
                assert resp.status == 401
            async with http.get(
                cluster.url + "/v1/objects/map", headers={"Authorization": "Bearer tenant.alice.x"}
            ) as r:
                assert r.status == 401
        async with AsyncStore(cluster.urls, secret=SECRET, token=TOKEN, tenant="bob") as admin:
            assert await admin.get("bobs") == b"not alice's"  # the cluster's own clients see every tenant
    finally:
        cluster.close()


async def test_a_tenants_key_asking_for_another_tenants_objects_or_for_blocks_is_forbidden(tmp_path):
    """On the wire: alice's key with bob's tenant in the request is answered FORBIDDEN item by item
    (counted), a block READ with it closes the connection, and a key for no tenant is refused."""
    from tiercake.transfer import TransferEngine
    from tiercake.transfer.protocol import TENANT, AuthenticationError

    cluster = KvCluster(tmp_path, nodes=("kv-a",), metrics=True)
    try:
        async with cluster.store(tenant="bob") as bob:
            await ready(bob, 1)
            await bob.put("bobs", b"b")
            address = PeerAddress("kv-a", *bob.members["kv-a"])
            epoch = bob.map.epoch
        key = tenant_key(SECRET.encode(), "alice")
        conn = await PeerConnection(address, Credential(key, TENANT), "alice").open()
        try:
            body = await conn.exchange(
                Op.OBJ_GET, Op.OBJ_GET_REPLY, w.encode(w.GetRequest("bob", epoch, [w.GetItem(b"bobs")]))
            )
            assert [g.status for g in w.decode(w.GetReply, body).items] == [Status.FORBIDDEN]
        finally:
            conn.close()
        assert cluster.metric("kv-a", "tiercake_transfer_forbidden_requests") >= 1
        engine = TransferEngine("alice", Credential(key, TENANT), transports=("tcp",))
        engine.add_peer("kv-a", address.host, address.port)
        try:
            read = await engine.read_blocks("kv-a", [b"k" * 32], [np.empty(16, np.uint8)])
            assert not read[0].ok
        finally:
            await engine.close()
        with pytest.raises(AuthenticationError):
            await PeerConnection(address, Credential(key, TENANT), "mallory").open()  # alice's key, another name
    finally:
        cluster.close()


async def test_a_node_agent_of_a_cluster_without_a_node_secret_refuses_to_start(tmp_path):
    cluster = KvCluster(tmp_path, nodes=())
    try:
        env = {k: v for k, v in os.environ.items() if k != "TIERCAKE_NODE_SECRET"}
        done = subprocess.run(
            [sys.executable, "-m", "tiercake.cli", "node", "--config", str(cluster.config("kv-x"))],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN},
        )
        assert done.returncode == 2 and "no node secret" in done.stderr and "TIERCAKE_NODE_SECRET" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    finally:
        cluster.close()
