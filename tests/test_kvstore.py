"""The key-value store API (tiercake.kvstore) against a real cluster: a conductor and two node agents
as processes, with a control token, talking over loopback sockets and shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import Processes

from tiercake.kvstore import (
    AsyncStore,
    DistributedStore,
    ErrorCode,
    InvalidParams,
    ObjectHasLease,
    ObjectNotFound,
)
from tiercake.kvstore.layout import CHUNK, INLINE_MAX

SECRET = "kvstore-test-secret-0123456789"
TOKEN = "kvstore-test-token"
KB, MB = 1 << 10, 1 << 20


def blob(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def node_config(tmp: Path, name: str, conductors: list[str], pool: str = "64MiB", ssd: str = "256MiB") -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"node_id: {name}\n"
        "store:\n  layout: null\n  tiers:\n"
        f"    - {{kind: pool, capacity: {pool}, path: /dev/shm/tiercake-kv-{uuid.uuid4().hex[:12]}}}\n"
        f"    - {{kind: ssd, capacity: {ssd}, path: {tmp / name / 'ssd'}}}\n"
        f"conductor: {{urls: {json.dumps(conductors)}, member_ttl: 1}}\n"
        "transfer: {host: 127.0.0.1}\n"
    )
    return str(path)


class Cluster:
    """A conductor (or several on etcd) and two node agents, as processes, with a control token."""

    def __init__(self, tmp: Path, etcd=None, conductors: int = 1, conductor_yaml: str | None = None) -> None:
        self.tmp = tmp
        self.group = Processes()
        self.env = {"TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN}
        self.conductors = []
        for i in range(conductors):
            args = ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--id", f"c{i}"]
            if etcd is not None:
                args += ["--etcd", ",".join(etcd.endpoints), "--ttl", "1"]
            if conductor_yaml is not None:
                (tmp / "conductor.yml").write_text(conductor_yaml)
                args += ["--config", str(tmp / "conductor.yml")]
            proc, info = self.group.start(args, self.env)
            self.conductors.append((proc, info["url"]))
            if i == 0 and conductors > 1:
                time.sleep(1.0)  # the first one wins the election
        self.urls = [url for _, url in self.conductors]
        self.url = self.urls[0]
        self.nodes = {name: self.start_node(name) for name in ("kv-a", "kv-b")}

    def start_node(self, name: str):
        config = self.tmp / f"{name}.yaml"
        if not config.exists():
            node_config(self.tmp, name, self.urls)
        proc, _ = self.group.start(["node", "--config", str(config)], self.env)
        return proc

    def store(self, **kw) -> AsyncStore:
        return AsyncStore(self.urls, secret=SECRET, token=TOKEN, **kw)

    def close(self) -> None:
        self.group.close()
        for config in self.tmp.glob("*.yaml"):
            pool = config.read_text().split("path: ")[1].split("}")[0]
            if pool.startswith("/dev/shm/"):
                Path(pool).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("kvstore"))
    yield c
    c.close()


@pytest.fixture
async def store(cluster):
    async with cluster.store(tenant=f"t{uuid.uuid4().hex[:8]}") as s:
        await wait_nodes(s, 2)
        yield s


async def wait_nodes(store: AsyncStore, n: int, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await store._refresh()
        if len(store.nodes.members) >= n:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{len(store.nodes.members)} of {n} node agents registered")
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("size", [1, 64 * KB, INLINE_MAX, INLINE_MAX + 1, 2 * CHUNK + 12345])
async def test_put_get_round_trip_at_every_size(store, size):
    value = blob(size, size)
    await store.put("obj", value)
    assert await store.exists("obj") and await store.get_size("obj") == size
    assert await store.get("obj") == value
    out = bytearray(size + 100)
    assert await store.get_into("obj", out) == size and bytes(out[:size]) == value and out[size:] == bytes(100)


async def test_mooncake_semantics_first_put_wins_upsert_replaces_remove(store):
    await store.put("k", b"first")
    await store.put("k", b"second value")  # Mooncake: succeeds and keeps the first value
    assert await store.get("k") == b"first"
    big = blob(7, CHUNK + 5)
    await store.put("k", big, replace=True)  # upsert
    assert await store.get("k") == big and await store.get_size("k") == len(big)
    await store.put("k", b"small again", replace=True)
    assert await store.get("k") == b"small again"
    await store.remove("k")
    assert not await store.exists("k")
    with pytest.raises(ObjectNotFound):
        await store.get("k")
    with pytest.raises(ObjectNotFound):
        await store.remove("k")
    with pytest.raises(ObjectNotFound):
        await store.get_size("k")


async def test_a_removed_object_leaves_nothing_on_the_nodes_or_in_the_index(store, cluster):
    await store.put("gone", blob(1, 3 * CHUNK))  # a head and three chunks
    await store.remove("gone")
    for node in store.nodes.members:
        listed = await store.client.node_blocks(node)
        assert not [b for b in listed if b.tenant.startswith(store.tenant + "#")]
    # and a new put of the name is a new object
    await store.put("gone", b"back")
    assert await store.get("gone") == b"back"


async def test_tenants_do_not_see_each_others_objects(store, cluster):
    await store.put("shared-name", b"mine")
    async with cluster.store(tenant=f"other{uuid.uuid4().hex[:6]}") as other:
        assert not await other.exists("shared-name")
        with pytest.raises(ObjectNotFound):
            await other.get("shared-name")
        await other.put("shared-name", b"theirs")
        assert await other.get("shared-name") == b"theirs"
        assert await other.remove_all() == 1
    assert await store.get("shared-name") == b"mine"


async def test_batches_answer_per_item(store):
    names = [f"b{i}" for i in range(40)]
    values = [blob(i, 1 + (i * 7919) % (96 * KB)) for i in range(40)]
    values[5] = blob(5, CHUNK + 1)  # one chunked object among inline ones
    assert await store.put_many(names, values) == [None] * 40
    outs = [bytearray(len(v)) for v in values]
    outs[3] = bytearray(len(values[3]) - 1)  # one buffer too small
    got = await store.get_many_into(names + ["missing"], outs + [bytearray(10)])
    assert got[3].code is ErrorCode.INVALID_PARAMS and got[40].code is ErrorCode.OBJECT_NOT_FOUND
    for i, v in enumerate(values):
        if i != 3:
            assert got[i] == len(v) and bytes(outs[i]) == v
    assert await store.exists_many(["b0", "nope", "b5"]) == [True, False, True]
    results = await store.put_many(["ok", "", "empty", "x" * (64 * KB + 1)], [b"1", b"2", b"", b"3"])
    assert results[0] is None and all(isinstance(r, InvalidParams) for r in results[1:])
    assert await store.remove_all() == 41


@pytest.mark.parametrize("bad", ["", "x" * (64 * KB + 1), 17, None])
async def test_bad_keys_are_clear_errors(store, bad):
    for call in (lambda: store.put(bad, b"v"), lambda: store.get(bad), lambda: store.exists(bad),
                 lambda: store.remove(bad), lambda: store.get_size(bad)):
        with pytest.raises(InvalidParams):
            await call()


async def test_bad_values_and_buffers_are_clear_errors(store):
    with pytest.raises(InvalidParams):
        await store.put("v", b"")
    with pytest.raises(InvalidParams):
        await store.put("v", 12345)
    await store.put("v", blob(3, 5000))
    with pytest.raises(InvalidParams):
        await store.get_into("v", bytearray(4999))
    with pytest.raises(InvalidParams):
        await store.get_into("v", bytes(6000))  # read-only: never written into
    with pytest.raises(InvalidParams):
        await store.get_into("v", object())
    assert await store.get("v") == blob(3, 5000)


# What Mooncake Store 0.3.13 answers to tests/mooncake_script.py (checked against it below whenever
# its master can run here): the behaviour tiercake's DistributedStore promises.
MOONCAKE_TRANSCRIPT = [
    ["put", 0], ["put again", 0], ["get", "hello"], ["get missing", ""], ["get_size", 5],
    ["get_size missing", -704], ["is_exist", [1, 0]], ["batch_is_exist", [1, 0, 1]], ["put empty value", -600],
    ["put empty key", -600], ["put big", 0], ["get_size big", 20 * MB], ["get big equal", True], ["upsert", 0],
    ["get after upsert", "replaced"], ["register_buffer", 0], ["put_from", 0], ["get pf", "from a buffer"],
    ["get_into too small", -600], ["get_into", 8], ["get_into bytes", "replaced"], ["get_into missing", -704],
    ["get_into big", 20 * MB], ["get_into big equal", True], ["batch_put_from", [0] * 8],
    ["batch_get_into", [64 * KB] * 8 + [-704]], ["batch_get_into equal", [True] * 8], ["get_batch", [True] * 3],
    ["remove missing", -704], ["remove", 0], ["is_exist removed", 0], ["remove_all", 10],
    ["batch_is_exist after remove_all", [0, 0, 0]], ["unregister_buffer", 0], ["unregister_buffer again", -600],
    ["close", 0],
]
SCRIPT = Path(__file__).with_name("mooncake_script.py")


def run_script(args: list[str], env: dict | None = None, prefix: list[str] = ()) -> list:
    done = subprocess.run([*prefix, sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_on_mooncake() -> list | None:
    """The script against a Mooncake master in a network namespace of its own (its master binds every
    address); None when Mooncake's package, its master or unshare is not available here."""
    master = Path(sys.executable).with_name("mooncake_master")
    if not master.exists() or shutil.which("unshare") is None:
        return None
    inner = (f"ip link set lo up 2>/dev/null; {master} --rpc_port 50071 --enable_http_metadata_server=false "
             f">/dev/null 2>&1 & sleep 1.5; {sys.executable} {SCRIPT} mooncake 127.0.0.1:50071; rc=$?; kill %1; exit $rc")
    try:
        done = subprocess.run(["unshare", "-n", "bash", "-c", inner], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None  # not allowed to make a namespace here, or the master did not start
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_code_written_for_mooncake_runs_unchanged_on_tiercake(cluster):
    ours = run_script(["tiercake", cluster.url], cluster.env)
    assert ours == MOONCAKE_TRANSCRIPT
    theirs = run_on_mooncake()
    if theirs is None:
        pytest.skip("the Mooncake half: Mooncake Store cannot run here (tiercake's half passed)")
    assert theirs == MOONCAKE_TRANSCRIPT


async def _lease_head(store: AsyncStore, name: str, ttl: float):
    """Hold a reader's lease on the object's head on its node, as a same-host reader copying it out of
    the pool does (the transfer protocol's LEASE)."""
    from tiercake.blocks import object_head_key

    (found,) = await store._locate([name])
    node, head_bytes = found.holders[0]
    head = object_head_key(name.encode(), store.tenant)
    async with store.engine._channels[node].connection() as conn:
        (reply,) = await conn.lease([(head, head_bytes, ttl)])
    assert reply.status.name == "OK", reply.message
    return node, head, reply.lease


async def test_remove_while_read_is_refused_and_force_waits_for_the_reader(store):
    await store.put("busy", blob(9, 4 * KB))
    node, head, lease = await _lease_head(store, "busy", ttl=30.0)
    with pytest.raises(ObjectHasLease):
        await store.remove("busy")
    assert await store.get("busy") == blob(9, 4 * KB)  # refused: nothing changed

    async def reader_done():
        await asyncio.sleep(0.5)
        async with store.engine._channels[node].connection() as conn:
            await conn.release([(head, lease)], wait=True)

    done = asyncio.create_task(reader_done())
    await store.remove("busy", force=True)  # waits the reader out
    await done
    assert not await store.exists("busy")


async def test_readers_racing_replacements_and_removes_never_see_a_torn_object(store):
    versions = [blob(100 + v, CHUNK + 3 * v * KB + 1) for v in range(3)]
    await store.put("hot", versions[0])
    seen = {"whole": 0, "missing": 0}

    async def reader():
        for _ in range(30):
            try:
                got = await store.get("hot")
            except ObjectNotFound:
                seen["missing"] += 1
                continue
            assert got in versions, "a read mixed two versions or returned a torn object"
            seen["whole"] += 1

    async def writer():
        for i in range(12):
            if i % 4 == 3:
                with contextlib.suppress(ObjectNotFound, ObjectHasLease):
                    await store.remove("hot")
            else:
                with contextlib.suppress(ObjectHasLease):
                    await store.put("hot", versions[i % 3], replace=True)

    await asyncio.gather(reader(), reader(), writer())
    assert seen["whole"] > 0, seen
    print("torn-read race:", seen)


@pytest.fixture
def own_cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


async def test_a_node_stalling_mid_batch_fails_its_objects_cleanly(own_cluster):
    names = [f"s{i}" for i in range(24)]
    values = [blob(i, (i % 3 + 1) * 700 * KB if i % 5 else CHUNK + i) for i in range(24)]
    async with own_cluster.store() as store:
        await wait_nodes(store, 2)
        stalled = own_cluster.nodes["kv-b"]
        stalled.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            results = await asyncio.wait_for(store.put_many(names, values), 30)
            took = time.monotonic() - started
        finally:
            stalled.send_signal(signal.SIGCONT)
        failed = [n for n, r in zip(names, results) if r is not None]
        assert failed and len(failed) < len(names), results  # kv-b's share failed, kv-a's was stored
        assert all(r.code in (ErrorCode.TRANSFER_FAIL, ErrorCode.NO_AVAILABLE_HANDLE) for r in results if r), results
        assert took < 15, f"a stalled node held the batch {took:.1f} s"
        print(f"stalled node: {len(failed)} of {len(names)} failed in {took:.1f} s")
        await asyncio.sleep(2.0)  # kv-b resumes and reads the frames sent to it while stopped
        got = await store.get_many(names)
        for name, value, result, read in zip(names, values, results, got):
            if result is None:
                assert bytes(read.numpy()) == value
            else:  # nothing of a failed put is visible, even after the node came back
                assert isinstance(read, ObjectNotFound), name


async def _put_a_mix(store: AsyncStore) -> dict[str, bytes]:
    objects = {f"m{i}": blob(200 + i, [3 * KB, 200 * KB, CHUNK + 77][i % 3]) for i in range(9)}
    assert await store.put_many(list(objects), list(objects.values())) == [None] * len(objects)
    return objects


async def _all_back(store: AsyncStore, objects: dict[str, bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = await store.get_many(list(objects))
        if all(not isinstance(g, Exception) and bytes(g.numpy()) == v for g, v in zip(got, objects.values())):
            return
        assert time.monotonic() < deadline, [g for g in got if isinstance(g, Exception)]
        await asyncio.sleep(0.2)


async def test_objects_survive_node_agent_restarts_from_their_ssd(own_cluster):
    async with own_cluster.store() as store:
        await wait_nodes(store, 2)
        objects = await _put_a_mix(store)
        await store.client.flush(["pool"], wait=True)  # down to the SSD tier
        for name, proc in list(own_cluster.nodes.items()):
            proc.kill()
            proc.wait(10)
            own_cluster.nodes[name] = own_cluster.start_node(name)  # same SSD directory
        await _all_back(store, objects)
        assert await store.remove_all() == len(objects)


async def test_objects_survive_a_conductor_failover(etcd, tmp_path):
    from tiercake.conductor.etcd import EtcdBackend

    meta = await EtcdBackend(etcd.endpoints).start()  # a clean slate on the shared etcd
    for prefix in (b"/tiercake/leader/", b"/tiercake/placements/", b"/tiercake/members/"):
        for kv in (await meta.range(prefix))[0]:
            await meta.delete(kv.key)
    await meta.close()
    cluster = Cluster(tmp_path, etcd=etcd, conductors=2)
    try:
        async with cluster.store() as store:
            await wait_nodes(store, 2)
            objects = await _put_a_mix(store)
            leader, _ = cluster.conductors[0]
            leader.kill()
            leader.wait(10)
            await _all_back(store, objects)  # every placement was in etcd: the standby serves them
            await store.put("after", b"the failover")
            assert await store.get("after") == b"the failover"
    finally:
        cluster.close()


def test_the_synchronous_client_checks_every_address(cluster, monkeypatch, tmp_path):
    store = DistributedStore()
    assert store.put("k", b"v") == ErrorCode.INVALID_PARAMS  # before setup: a code, not a crash
    assert store.setup("http://127.0.0.1:1", secret=SECRET, token=TOKEN, connect_timeout=2) == ErrorCode.RPC_FAIL
    assert store.setup(config="/nonexistent/tiercake.yaml") == ErrorCode.INVALID_PARAMS
    store = DistributedStore()
    assert store.setup(cluster.urls, secret=SECRET, token=TOKEN, tenant=f"sync{uuid.uuid4().hex[:6]}") == 0
    try:
        buf = (ctypes.c_ubyte * (1 << 20))()
        ptr = ctypes.addressof(buf)
        other = (ctypes.c_ubyte * 4096)()
        assert store.register_buffer(ptr, 1 << 20) == 0
        assert store.register_buffer(ptr + 4096, 100) == ErrorCode.INVALID_PARAMS  # overlaps
        assert store.register_buffer(0, 100) == ErrorCode.INVALID_PARAMS
        ctypes.memmove(ptr, b"payload", 7)
        assert store.put_from("k", ptr, 7) == 0
        assert store.get_into("k", ctypes.addressof(other), 100) == ErrorCode.INVALID_PARAMS  # not registered
        assert store.get_into("k", ptr + (1 << 20) - 3, 7) == ErrorCode.INVALID_PARAMS  # runs past its end
        assert store.put_from("k2", ctypes.addressof(other), 10) == ErrorCode.INVALID_PARAMS
        assert store.batch_get_into(["k", "k"], [ptr + 64, ctypes.addressof(other)], [7, 7]) == [7, ErrorCode.INVALID_PARAMS]
        assert bytes(buf[64:71]) == b"payload"
        assert store.put("k3", 12345) == ErrorCode.INVALID_PARAMS  # no buffer
        assert store.get_size("nope") == ErrorCode.OBJECT_NOT_FOUND and store.get("nope") == b""
        assert store.unregister_buffer(ptr) == 0
        assert store.get_into("k", ptr, 7) == ErrorCode.INVALID_PARAMS  # unregistered now
    finally:
        assert store.close() == 0
    # or from a tiercake config naming the conductors, with the secret and token from the environment
    config = tmp_path / "client.yaml"
    config.write_text(f"store: {{tiers: [{{kind: pool, capacity: 1MiB}}]}}\nconductor: {{urls: {json.dumps(cluster.urls)}}}\n")
    monkeypatch.setenv("TIERCAKE_SECRET", SECRET)
    monkeypatch.setenv("TIERCAKE_TOKEN", TOKEN)
    store = DistributedStore()
    assert store.setup(config=str(config), tenant=f"cfg{uuid.uuid4().hex[:6]}") == 0
    assert store.put("from-config", b"yes") == 0 and store.get("from-config") == b"yes"
    assert store.close() == 0


def test_the_readme_example_runs(cluster, tmp_path):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("## Key-value store API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(f"CONDUCTOR_URL, SECRET, TOKEN = {cluster.url!r}, {SECRET!r}, {TOKEN!r}\n" + example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


async def test_objects_are_replicated_as_the_conductor_says_and_outlive_a_node(tmp_path):
    cluster = Cluster(tmp_path, conductor_yaml="store: {tiers: [{kind: pool, capacity: 1MiB}]}\n"
                      "conductor: {replication: fixed, replication_params: {count: 2}}\n")
    try:
        async with cluster.store() as store:
            await wait_nodes(store, 2)
            objects = await _put_a_mix(store)
            for node in ("kv-a", "kv-b"):  # every head on both nodes
                heads = [b for b in await store.client.node_blocks(node) if b.tenant == "default#objects"]
                assert len(heads) == len(objects), node
            cluster.nodes["kv-a"].kill()  # where this client remembers some of them
            await _all_back(store, objects)
    finally:
        cluster.close()


async def test_under_pressure_what_exists_reads_whole_and_puts_evict_for_room(tmp_path):
    cluster = Cluster.__new__(Cluster)  # one node, a pool of 12 MiB and nothing below it
    cluster.tmp, cluster.group = tmp_path, Processes()
    cluster.env = {"TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN}
    _, info = cluster.group.start(["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"], cluster.env)
    cluster.urls = [info["url"]]
    (tmp_path / "kv-p.yaml").write_text(
        "node_id: kv-p\nstore:\n  layout: null\n  tiers:\n"
        f"    - {{kind: pool, capacity: 12MiB, eviction: leaf_lru, high_watermark: 1.0, path: /dev/shm/tiercake-kv-{uuid.uuid4().hex[:12]}}}\n"
        f"conductor: {{urls: {json.dumps(cluster.urls)}, member_ttl: 1}}\ntransfer: {{host: 127.0.0.1}}\n")
    cluster.nodes = {"kv-p": cluster.start_node("kv-p")}
    try:
        async with cluster.store() as store:
            await wait_nodes(store, 1)
            objects = {f"p{i}": blob(300 + i, CHUNK + MB) for i in range(8)}  # 5 MiB each: 2 fit
            for name, value in objects.items():
                await store.put(name, value)
            await asyncio.sleep(1.5)  # the node's reports of what it evicted reach the index
            alive = await store.exists_many(list(objects))
            got = await store.get_many(list(objects))
            assert 0 < sum(alive) < len(objects), alive
            for name, value, exists, read in zip(objects, objects.values(), alive, got):
                if exists:  # a head it still finds leads to a whole object
                    assert not isinstance(read, Exception) and bytes(read.numpy()) == value, name
                else:
                    assert isinstance(read, ObjectNotFound), name
    finally:
        cluster.close()
