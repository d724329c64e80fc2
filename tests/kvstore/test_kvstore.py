"""The key-value store API (tiercake.kvstore) against a real cluster: a conductor and two node agents
as processes, with a control token, talking over loopback sockets and shared memory. What Mooncake
Store answers is checked against Mooncake itself where its master can run here."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore_helpers import KB, MB, SECRET, TOKEN, KvCluster, blob, ready
from paths import README, TESTS

from tiercake.kvstore import (
    AsyncStore,
    DistributedStore,
    Durability,
    ErrorCode,
    InvalidParams,
    MooncakeDistributedStoreAsync,
    NoSpace,
    ObjectHasLease,
    ObjectNotFound,
    ReplicateConfig,
    SoftPinAction,
)
from tiercake.kvstore.tensors import pack

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = KvCluster(tmp_path_factory.mktemp("kvstore"))
    yield c
    c.close()


@pytest.fixture(params=["shm", "tcp"])
async def store(cluster, request):
    transports = ("shm", "tcp") if request.param == "shm" else ("tcp",)
    async with cluster.store(tenant=f"t{uuid.uuid4().hex[:8]}", transports=transports) as s:
        await ready(s, 2)
        yield s


@pytest.mark.parametrize("size", [1, 64 * KB, MB - 1, MB + 1, 20 * MB])
async def test_put_get_round_trip_at_every_size(store, size):
    value = blob(size, size)
    await store.put("obj", value)
    assert await store.exists("obj") and await store.get_size("obj") == size
    assert await store.get("obj") == value
    out = bytearray(size + 100)
    assert await store.get_into("obj", out) == size and bytes(out[:size]) == value and out[size:] == bytes(100)


async def test_first_put_wins_upsert_replaces_and_a_remove_is_final(store):
    await store.put("k", b"first")
    await store.put("k", b"second value")  # Mooncake: succeeds and keeps the first value
    assert await store.get("k") == b"first"
    big = blob(7, 3 * MB + 5)
    await store.put("k", big, replace=True)  # upsert
    assert await store.get("k") == big and await store.get_size("k") == len(big)
    await store.put("k", b"small again", replace=True)
    assert await store.get("k") == b"small again"
    await store.remove("k", force=True)  # the gets above hold Mooncake's read lease
    assert not await store.exists("k")
    for call in (store.get("k"), store.remove("k"), store.get_size("k")):
        with pytest.raises(ObjectNotFound):
            await call
    await store.put("k", b"back")  # a new object of the name
    assert await store.get("k") == b"back"


async def test_racing_first_puts_store_one_value_and_it_stays(store):
    values = [blob(i, 1000 + i) for i in range(8)]
    clients = [store] + [
        AsyncStore(store.client.urls, secret=SECRET, token=TOKEN, tenant=store.tenant) for _ in range(3)
    ]
    for c in clients[1:]:
        await c.open()
    try:
        results = await asyncio.gather(*(clients[i % 4].put("race", v) for i, v in enumerate(values)))
        assert results == [None] * 8  # every racing first put succeeds, as Mooncake's do
        winner = await store.get("race")
        assert winner in values
        for _ in range(3):
            assert [await c.get("race") for c in clients] == [winner] * 4
    finally:
        for c in clients[1:]:
            await c.close()


async def test_tenants_do_not_see_each_others_objects(store, cluster):
    await store.put("shared-name", b"mine")
    async with cluster.store(tenant=f"other{uuid.uuid4().hex[:6]}") as other:
        assert not await other.exists("shared-name")
        with pytest.raises(ObjectNotFound):
            await other.get("shared-name")
        await other.put("shared-name", b"theirs")
        assert await other.get("shared-name") == b"theirs"
        assert await other.remove_all(force=True) == 1
    assert await store.get("shared-name") == b"mine"


async def test_batches_answer_per_item(store):
    names = [f"b{i}" for i in range(40)]
    values = [blob(i, 1 + (i * 7919) % (96 * KB)) for i in range(40)]
    values[5] = blob(5, 2 * MB + 1)  # one object through the pool among small ones
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
    assert await store.remove_all(force=True) == 41


async def test_a_batch_larger_than_one_request_is_split(store):
    names = [f"many{i}" for i in range(5000)]  # more than a request's 4096 items
    assert await store.put_many(names, [i.to_bytes(4, "little") for i in range(5000)]) == [None] * 5000
    got = await store.get_many(names)
    assert [int.from_bytes(g.tobytes(), "little") for g in got] == list(range(5000))
    assert await store.remove_matching(r"^many\d+$", force=True) == 5000


@pytest.mark.parametrize("bad", ["", "x" * (64 * KB + 1), 17, None])
async def test_bad_keys_are_clear_errors(store, bad):
    for call in (
        lambda: store.put(bad, b"v"),
        lambda: store.get(bad),
        lambda: store.exists(bad),
        lambda: store.remove(bad),
        lambda: store.get_size(bad),
    ):
        with pytest.raises(InvalidParams):
            await call()


async def test_bad_values_and_buffers_are_clear_errors(store):
    for value in (b"", 12345, object(), np.arange(10)[::2], torch.arange(10)[::2]):  # empty, no buffer, strided
        with pytest.raises(InvalidParams):
            await store.put("v", value)
    await store.put("v", blob(3, 5000))
    for buffer in (bytearray(4999), bytes(6000), object(), np.zeros(20000, dtype=np.uint8)[::2]):
        with pytest.raises(InvalidParams):  # too small, read-only, no buffer, strided: never written into
            await store.get_into("v", buffer)
    assert await store.get("v") == blob(3, 5000)
    with pytest.raises(InvalidParams):
        Durability(replicas=0)
    with pytest.raises(InvalidParams):
        Durability(soft_pin_ms=-5)


async def test_a_get_or_an_exists_grants_mooncakes_read_lease(store, cluster):
    await store.put("leased", b"value")
    assert await store.get("leased") == b"value"
    with pytest.raises(ObjectHasLease):
        await store.remove("leased")  # within the lease a reader was granted
    await store.put("leased", b"upserted", replace=True)  # an upsert is not held back by it
    await asyncio.sleep(cluster.lease_ttl_s + 0.3)
    await store.remove("leased")  # the lease ended
    await store.put("checked", b"v")
    assert await store.exists("checked")
    with pytest.raises(ObjectHasLease):
        await store.remove("checked")
    await store.remove("checked", force=True)
    assert not await store.exists("checked")


async def test_a_same_host_read_holds_its_lease_against_every_other_client(cluster):
    """Mooncake's get is granted its lease by the master, so every other client's remove (without
    force) and ``remove_all`` leave the object be. Ours, read from the node's directory with no round
    trip, is written where the node looks before it removes: another client finds it at once, not
    only once the reader's next request to the node tells of it."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    async with (
        cluster.store(tenant=tenant) as reader,
        cluster.store(tenant=tenant, transports=("tcp",)) as other,
    ):
        await ready(reader, 2)
        await other.put_many(["held", "free"], [b"read here", b"never read"])
        assert bytes(await reader.get("held")) == b"read here"
        assert any(reader.same_host.directory(n) is not None for n in reader.members)  # no round trip
        assert await other.remove_all() == 1  # "free" only
        with pytest.raises(ObjectHasLease):
            await other.remove("held")
        assert bytes(await other.get("held")) == b"read here"
        await asyncio.sleep(cluster.lease_ttl_s + 0.3)
        assert await other.remove_all() == 1  # the lease ran out


async def test_replicated_objects_are_on_the_slots_nodes_and_more_than_there_are_is_refused(store):
    await store.put("one", b"memory level")
    await store.put("two", b"on two nodes", durability=Durability(replicas=2))
    assert len((await store.describe("one")).holders) == 1
    described = await store.describe("two")
    assert described.replicas == 2 and sorted(described.holders) == sorted(store.members)
    with pytest.raises(NoSpace):
        await store.put("three", b"x", durability=Durability(replicas=3))  # two nodes: never quietly fewer
    assert not await store.exists("three")
    await store.put("two", b"now memory level", replace=True)  # the backup's copy goes
    assert len((await store.describe("two")).holders) == 1


async def test_remove_all_and_remove_matching_count_what_went(store):
    assert await store.put_many([f"a{i}" for i in range(6)] + ["b1"], [b"x"] * 7) == [None] * 7
    assert await store.remove_matching(r"^a[0-2]$") == 3
    assert await store.exists_many(["a0", "a3", "b1"]) == [False, True, True]  # read leases on a3 and b1
    assert await store.remove_all() == 2  # a4 and a5: leased objects stay, as Mooncake's remove_all leaves them
    assert await store.remove_all(force=True) == 2
    with pytest.raises(InvalidParams):
        await store.remove_matching(12)


# Mooncake's synchronous API ------------------------------------------------------------------------------

# What Mooncake Store 0.3.13 answers to tests/mooncake_script.py (checked against it below whenever
# its master can run here): the behaviour tiercake's DistributedStore promises.
MOONCAKE_TRANSCRIPT = [
    ["put", 0],
    ["put again", 0],
    ["get", "hello"],
    ["get missing", ""],
    ["get_size", 5],
    ["get_size missing", -704],
    ["is_exist", [1, 0]],
    ["batch_is_exist", [1, 0, 1]],
    ["put empty value", -600],
    ["put empty key", -600],
    ["put big", 0],
    ["get_size big", 20 * MB],
    ["get big equal", True],
    ["upsert", 0],
    ["get after upsert", "replaced"],
    ["register_buffer", 0],
    ["put_from", 0],
    ["get pf", "from a buffer"],
    ["get_into too small", -600],
    ["get_into", 8],
    ["get_into bytes", "replaced"],
    ["get_into missing", -704],
    ["get_into big", 20 * MB],
    ["get_into big equal", True],
    ["batch_put_from", [0] * 8],
    ["batch_get_into", [64 * KB] * 8 + [-704]],
    ["batch_get_into equal", [True] * 8],
    ["get_batch", [True] * 3],
    ["remove missing", -704],
    ["remove", 0],
    ["is_exist removed", 0],
    ["remove_all", 10],
    ["batch_is_exist after remove_all", [0, 0, 0]],
    ["put_batch with an empty value", -600],
    ["put_batch stored none of it", [0, 0, 0]],
    ["put_batch twice one key", 0],
    ["get of it", "one"],
    ["put_batch of nothing", 0],
    ["put_batch of unequal lists", -600],
    ["remove after is_exist", -706],
    ["upsert under a lease", 0],
    ["get after it", "new-k"],
    ["get_buffer", [5, "new-k"]],
    ["get_buffer missing", None],
    ["batch_get_buffer", [5, None, 3]],
    ["put_parts", 0],
    ["get parts", "abcdef"],
    ["upsert_parts", 0],
    ["get parts again", "XYZ"],
    ["upsert_batch", 0],
    ["get u2", "v2"],
    ["replica desc", [[True, False, True]]],
    ["replica desc missing", 0],
    ["batch replica desc", ["k"]],
    ["health_check", 0],
    ["remove_by_regex bad pattern", -600],
    ["multi-buffer put", [0, 0]],
    ["multi-buffer object", "AAAABBBBBB"],
    ["multi-buffer get", [10, -704]],
    ["multi-buffer got", ["AAAAB", "BBBBB"]],
    ["multi-buffer get too small", [-600]],
    ["ranges", [[[2, 2], [3]]]],
    ["ranges got", ["AA", "AA", "BBB"]],
    ["put_from_with_metadata", 0],
    ["its object", "AAAABBBBBB"],
    ["batch_upsert_from", [0]],
    ["upserted from a buffer", "BBBBBB"],
    ["put_tensor", 0],
    ["get_tensor", [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]],
    ["get_tensor missing", None],
    ["put_tensor of a transposed tensor", 0],
    ["its tensor", [[0.0, 4.0, 8.0], [1.0, 5.0, 9.0], [2.0, 6.0, 10.0], [3.0, 7.0, 11.0]]],
    ["put_tensor_with_tp", 0],
    ["its shards", [0, 1, 1]],
    ["get_tensor_with_tp rank 1", [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]],
    ["get_tensor of the base key", None],
    ["put_tensor of bytes", -600],
    ["get_tensor of bytes", None],
    ["put of an empty tensor", 0],
    ["get of an empty tensor", []],
    ["remove_by_regex", 3],
    ["unregister_buffer", 0],
    ["unregister_buffer again", -600],
    ["close", 0],
]
SCRIPT = TESTS / "mooncake_script.py"


def run_script(args: list[str], env: dict | None = None, prefix: list[str] = ()) -> list:
    done = subprocess.run(
        [*prefix, sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_on_mooncake() -> list | None:
    """The script against a Mooncake master in a network namespace of its own (its master binds every
    address); None when Mooncake's package, its master or unshare is not available here."""
    master = Path(sys.executable).with_name("mooncake_master")
    if not master.exists():
        master = (
            Path(sys.executable).parent.parent
            / "lib"
            / f"python{sys.version_info.major}.{sys.version_info.minor}"
            / "site-packages"
            / "mooncake"
            / "mooncake_master"
        )
    if not master.exists() or shutil.which("unshare") is None:
        return None
    inner = (
        f"ip link set lo up 2>/dev/null; export MC_TCP_BIND_ADDRESS=127.0.0.1; {master} --rpc_port 50071 "
        "--enable_http_metadata_server=false --default_kv_lease_ttl=5000 >/dev/null 2>&1 & sleep 1.5; "
        f"{sys.executable} {SCRIPT} mooncake 127.0.0.1:50071; rc=$?; kill %1; exit $rc"
    )
    try:
        done = subprocess.run(["unshare", "-n", "bash", "-c", inner], capture_output=True, text=True, timeout=240)
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


def test_setup_takes_mooncakes_forms(cluster, monkeypatch):
    monkeypatch.setenv("TIERCAKE_SECRET", SECRET)
    monkeypatch.setenv("TIERCAKE_TOKEN", TOKEN)
    address = cluster.url.split("://")[1]  # Mooncake's master address is host:port
    positional = DistributedStore()
    assert positional.setup("localhost", "P2PHANDSHAKE", 512 * MB, 64 * MB, "tcp", "", address) == 0
    as_dict = DistributedStore()
    assert (
        as_dict.setup(
            {
                "local_hostname": "localhost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "16MB",
                "local_buffer_size": "16 MB",
                "protocol": "tcp",
                "master_server_addr": address,
            }
        )
        == 0
    )
    other_tenant = DistributedStore()  # Mooncake's tenant_id keeps tenants apart, as tiercake's tenants do
    assert (
        other_tenant.setup(
            "localhost", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", address, None, False, "", f"tn{uuid.uuid4().hex[:6]}"
        )
        == 0
    )
    try:
        key = f"forms-{uuid.uuid4().hex[:8]}"
        assert positional.put(key, b"from positional") == 0
        assert as_dict.get(key) == b"from positional"
        assert other_tenant.get(key) == b""
        assert positional.get_hostname() == "localhost" and positional.health_check() == 0
        assert positional.ready()  # a node agent is a member and owns the slots
        assert positional.remove(key, force=True) == 0
    finally:
        for s in (positional, as_dict, other_tenant):
            assert s.close() == 0
    assert positional.health_check() == 1 and not positional.ready()  # closed
    bad = DistributedStore()
    assert bad.setup({"local_hostname": "x", "global_segment_size": "50%", "master_server_addr": address}) != 0
    zero = DistributedStore()  # a local buffer of 0 bytes holds no value, as in Mooncake
    assert zero.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", address) == 0
    assert zero.put("zero-buffer", b"v") != 0 and zero.is_exist("zero-buffer") == 0
    zero.close()


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
        assert store.register_buffer(1 << 40, 1 << 70) == ErrorCode.INVALID_PARAMS  # no such range can exist
        assert store.register_buffer(1 << 64, 100) == ErrorCode.INVALID_PARAMS
        ctypes.memmove(ptr, b"payload", 7)
        assert store.put_from("k", ptr, 7) == 0
        assert store.get_into("k", ctypes.addressof(other), 100) == ErrorCode.INVALID_PARAMS  # not registered
        assert store.get_into("k", ptr + (1 << 20) - 3, 7) == ErrorCode.INVALID_PARAMS  # runs past its end
        assert store.put_from("k2", ctypes.addressof(other), 10) == ErrorCode.INVALID_PARAMS  # Mooncake segfaults
        assert store.batch_put_from(["k9"], [12345678], [10]) == [ErrorCode.INVALID_PARAMS]
        assert store.batch_get_into(["k", "k"], [ptr + 64, ctypes.addressof(other)], [7, 7]) == [
            7,
            ErrorCode.INVALID_PARAMS,
        ]
        assert bytes(buf[64:71]) == b"payload"
        assert store.put("k3", 12345) == ErrorCode.INVALID_PARAMS  # no buffer
        assert store.get_size("nope") == ErrorCode.OBJECT_NOT_FOUND and store.get("nope") == b""
        assert store.mount_segment("/x", 10) == {"error": ErrorCode.NOT_SUPPORTED}
        assert store.create_copy_task("k", ["n"])[1] == ErrorCode.NOT_SUPPORTED
        config = ReplicateConfig()
        config.soft_pin_ttl_ms = 1000  # a TTL without ENABLE: Mooncake's INVALID_PARAMS
        assert store.upsert("k", b"v", config) == ErrorCode.INVALID_PARAMS
        config.soft_pin_action = SoftPinAction.ENABLE
        assert store.upsert("k", b"v", config) == 0
        with pytest.raises(TypeError):
            config.soft_pin_ttl_ms = -1
        assert store.unregister_buffer(ptr) == 0
        assert store.get_into("k", ptr, 7) == ErrorCode.INVALID_PARAMS  # unregistered now
    finally:
        assert store.close() == 0
    # or from a tiercake config naming the conductors, with the secret and token from the environment
    config = tmp_path / "client.yaml"
    config.write_text(
        f"store: {{tiers: [{{kind: pool, capacity: 1MiB}}]}}\nconductor: {{urls: {json.dumps(cluster.urls)}}}\n"
    )
    monkeypatch.setenv("TIERCAKE_SECRET", SECRET)
    monkeypatch.setenv("TIERCAKE_TOKEN", TOKEN)
    store = DistributedStore()
    assert store.setup(config=str(config), tenant=f"cfg{uuid.uuid4().hex[:6]}") == 0
    assert store.put("from-config", b"yes") == 0 and store.get("from-config") == b"yes"
    assert store.close() == 0


def test_tensors_keep_their_dtype_shape_and_shards(cluster):
    store = DistributedStore()
    assert store.setup(cluster.urls, secret=SECRET, token=TOKEN, tenant=f"tensor{uuid.uuid4().hex[:6]}") == 0
    try:
        for i, dtype in enumerate(
            [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]
        ):
            t = (
                (torch.arange(24).reshape(2, 3, 4) % 2 == 0)
                if dtype is torch.bool
                else torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
            )
            assert store.put_tensor(f"t{i}", t) == 0
            got = store.get_tensor(f"t{i}")
            assert got.dtype == dtype and got.shape == t.shape and torch.equal(got.float(), t.float())
        assert store.batch_get_tensor(["t0", "missing"])[1] is None
        full = torch.randn(6, 10)
        assert store.batch_put_tensor_with_tp(["w"], [full], tp_size=4, split_dim=1) == [0]
        shards = store.batch_get_tensor_with_tp(["w"] * 1, tp_rank=3, tp_size=4)
        assert torch.equal(shards[0], torch.tensor_split(full, 4, 1)[3])
        assert torch.equal(torch.cat([store.get_tensor_with_tp("w", r, 4, 1) for r in range(4)], 1), full)
        buf = (ctypes.c_ubyte * (1 << 16))()
        ptr = ctypes.addressof(buf)
        assert store.register_buffer(ptr, 1 << 16) == 0
        into = store.get_tensor_into("t0", ptr, 1 << 16)
        assert torch.equal(into, store.get_tensor("t0"))
        packed = pack(into).size  # the buffer holds the packed tensor now: header and data
        assert store.put_tensor_from("t-from", ptr, packed) == 0
        assert torch.equal(store.get_tensor("t-from"), into)
        dst = torch.zeros(2, 3, 4)
        assert store.get_tensor_into_cuda("t0", dst) == 96 and torch.equal(dst, into)  # any device's tensor
        assert store.put_tensor("not-a-tensor", b"bytes") == ErrorCode.INVALID_PARAMS
        assert store.remove_all(True) >= 8
    finally:
        store.close()


def test_the_async_flavour_answers_every_call_as_a_coroutine(cluster):
    async def go():
        store = MooncakeDistributedStoreAsync()
        assert store.setup(cluster.urls, secret=SECRET, token=TOKEN, tenant=f"async{uuid.uuid4().hex[:6]}") == 0
        try:
            assert await store.async_put("a", b"1") == 0
            assert await asyncio.gather(store.async_get("a"), store.async_is_exist("a")) == [b"1", 1]
            t = torch.arange(6.0)
            assert await store.async_put_tensor_with_tp("t", t, tp_size=2) == 0
            assert torch.equal(await store.async_get_tensor_with_tp("t", tp_rank=1, tp_size=2), t[3:])
            with pytest.raises(AttributeError):
                store.async_no_such_call  # noqa: B018
        finally:
            store.close()

    asyncio.run(go())


def test_the_readme_example_runs(cluster, tmp_path):
    readme = README.read_text()
    example = readme.split("## Key-value store", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert '"127.0.0.1:8081"' in example  # make run's conductor (tests/cluster/test_readme.py runs it there too)
    script = tmp_path / "example.py"
    script.write_text(example.replace('"127.0.0.1:8081"', repr(cluster.url)))  # here: this test's cluster
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN},
    )
    assert done.returncode == 0, done.stderr[-3000:]
