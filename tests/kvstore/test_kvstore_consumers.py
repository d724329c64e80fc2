"""Code written for Mooncake Store, unchanged, on tiercake: the ``mooncake`` package tiercake ships
(``PYTHONPATH=$(python -m tiercake.kvstore.as_mooncake)``) against Mooncake's own module, the calls
SGLang HiCache's Mooncake backend makes, and vLLM's own ``MooncakeStoreConnector`` serving a model
with tiercake as its store: a second vLLM instance loads what the first one saved, and answers as
it would have computed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import aiohttp
import pytest
from kvstore_helpers import KvCluster, ready

from tiercake.conductor.etcd_process import free_port
from tiercake.kvstore import DistributedStore
from tiercake.up_vllm import VllmServer
from tiercake.workers.vllm.process import serve_command
from tiercake.workers.vllm.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]  # every test here starts processes
SHIM = subprocess.check_output([sys.executable, "-m", "tiercake.kvstore.as_mooncake"], text=True).strip()
# Mooncake's module has these too; they are not the store's (pools of its own registered buffers, an
# embedding table store, NVMe-oF registration, the addresses of its C allocator for torch)
NOT_PROVIDED = {
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
    "EngramStore",
    "EngramStoreConfig",
    "MooncakeDistributedNoFRegister",
    "get_alloc_func_addr",
    "get_free_func_addr",
}

SHAPE = """
import json, enum, mooncake.store as m
store = m.MooncakeDistributedStore
print(json.dumps({"file": m.__file__,
    "names": sorted(n for n in dir(m) if not n.startswith("_")),
    "methods": sorted(n for n in dir(store) if not n.startswith("_")),
    "values": {n: int(getattr(m, n)) for n in dir(m) if n.isupper() and not n.startswith("_")}}))
"""


def shape(pythonpath: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", SHAPE], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mooncake_package_is_tiercakes_with_mooncakes_names():
    ours, theirs = shape(SHIM), shape(None)
    assert ours["file"].startswith(SHIM) and not theirs["file"].startswith(SHIM)
    assert len(theirs["methods"]) == 97 and set(theirs["methods"]) <= set(ours["methods"])  # all 97
    assert set(theirs["names"]) - set(ours["names"]) == NOT_PROVIDED
    assert {n: ours["values"][n] for n in theirs["values"]} == theirs["values"]  # enum members, same numbers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = KvCluster(tmp_path_factory.mktemp("consumers"), nodes=("kv-a",), pool="256MiB", lease_ttl_s=5.0)

    async def up():
        async with c.store() as s:
            await ready(s, 1)

    asyncio.run(up())
    yield c
    c.close()


def run_as_mooncake(cluster: KvCluster, script: str, **env) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **cluster.env, "PYTHONPATH": SHIM, "MASTER": cluster.url.split("://")[1], **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


SGLANG = """
import ctypes, os, uuid
import torch
from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig

store = MooncakeDistributedStore()
# setup as HiCache calls it: Mooncake's seven positional arguments, its transfer engine (none), and
# the keyword arguments it retries without when a Mooncake lacks them (tenant_id it insists on)
assert store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", os.environ["MASTER"], None,
                   enable_client_http_server=True, client_http_port=0, enable_ssd_offload=False,
                   tenant_id="sglang-test") == 0
warm = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex  # its warmup
assert store.put(warm, bytes(4096)) == 0 and store.is_exist(warm) == 1 and store.get(warm) == bytes(4096)

# the host KV pool, from Mooncake's allocator, registered whole
pages, page = 8, 64 << 10
alloc = MooncakeHostMemAllocator()
ptr = alloc.alloc(2 * pages * page)
pool = torch.frombuffer((ctypes.c_byte * (2 * pages * page)).from_address(ptr), dtype=torch.uint8)
assert store.register_buffer(ptr, 2 * pages * page) == 0
pool[:] = torch.randint(0, 256, pool.shape, dtype=torch.uint8)
saved = pool.clone()

# MHA: a K and a V object per page ("<hash>_<rank>_k"), only the missing ones put (batch_set_v1)
keys = [f"page{i}_0_{kv}" for i in range(pages) for kv in "kv"]
ptrs = [ptr + j * page for j in range(2 * pages)]
assert store.batch_is_exist(keys) == [0] * len(keys)
assert store.batch_put_from(keys[:4], ptrs[:4], [page] * 4) == [0] * 4
missing = [i for i, e in enumerate(store.batch_is_exist(keys)) if e != 1]
assert missing == list(range(4, 2 * pages))
config = ReplicateConfig()
config.group_ids = [f"sglang-hicache:page{i // 2}" for i in missing]  # its group semantics
assert store.batch_put_from([keys[i] for i in missing], [ptrs[i] for i in missing], [page] * len(missing),
                            config) == [0] * len(missing)
config.group_ids = ["one"]  # a group per key, or nothing is put
assert store.batch_put_from(keys[:2], ptrs[:2], [page] * 2, config) == [-600] * 2
pool.zero_()
assert store.batch_get_into(keys, ptrs, [page] * len(keys)) == [page] * len(keys)  # batch_get_v1: bytes read
assert torch.equal(pool, saved)

# MLA: one object per page from several layer buffers (batch_put_from_multi_buffers)
mla = [f"page{i}__k" for i in range(pages)]
parts = [[ptr + i * page, ptr + (pages + i) * page] for i in range(pages)]
sizes = [[page // 2, page // 2] for _ in range(pages)]
assert store.batch_put_from_multi_buffers(mla, parts, sizes, ReplicateConfig()) == [0] * pages
pool.zero_()
assert store.batch_get_into_multi_buffers(mla, parts, sizes) == [page] * pages
for i in range(pages):
    assert torch.equal(pool[i * page : i * page + page // 2], saved[i * page : i * page + page // 2])
assert store.batch_get_into(["page-missing_0_k"], [ptr], [page])[0] < 0  # a miss: a negative code
assert store.remove_all() == 0  # its clear(): every object was just read, and Mooncake's read lease holds
assert store.remove_all(True) == 2 * pages + len(mla) + 1
assert store.unregister_buffer(ptr) == 0
del pool
assert alloc.free(ptr) == 0
print("ok")
"""


def test_sglang_hicache_calls_run_as_sglang_makes_them(cluster):
    assert run_as_mooncake(cluster, SGLANG).strip().endswith("ok")


class MooncakeVllm(VllmServer):
    """``vllm serve`` with vLLM's own MooncakeStoreConnector, its ``mooncake`` being tiercake's."""

    def __init__(self, name: str, model: Path, config: Path, env: dict[str, str], logs: Path, role: str) -> None:
        port = free_port()
        command = serve_command(
            model,
            "tiny",
            port,
            "",
            None,
            block_size=32,
            max_model_len=2048,
            extra=["--enforce-eager"],
            kv_transfer={"kv_connector": "MooncakeStoreConnector", "kv_role": role},
        )
        super().__init__(
            command,
            {
                **env,
                "PYTHONPATH": SHIM,
                "MOONCAKE_CONFIG_PATH": str(config),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_SERVER_DEV_MODE": "1",
            },
            logs / f"{name}.log",
            port,
        )

    async def complete(self, tokens: list[int], max_tokens: int = 16) -> dict:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

    async def reset_prefix_cache(self) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(self.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200


async def test_vllms_mooncake_store_connector_serves_from_tiercake(cluster, tmp_path):
    model = make_tiny_llama(tmp_path / "model")
    tenant = f"vllm{uuid.uuid4().hex[:6]}"
    config = tmp_path / "mooncake.json"  # what a Mooncake user writes, the master being tiercake's conductor
    config.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": cluster.url.split("://")[1],
                "tenant_id": tenant,
                "global_segment_size": "64MB",
                "local_buffer_size": "64MB",
            }
        )
    )
    prompt = [(7 * i) % 500 + 1 for i in range(6 * 32 + 5)]  # six full blocks and a bit
    # a saves (and loads); b only loads: what b finds, a saved
    engines = [
        MooncakeVllm(name, model, config, cluster.env, tmp_path, role)
        for name, role in (("a", "kv_both"), ("b", "kv_consumer"))
    ]
    try:
        for engine in engines:
            engine.wait_ready()
        a, b = engines
        computed = await a.complete(prompt)  # from scratch: nothing is stored yet
        assert computed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        store = DistributedStore()
        assert (
            store.setup(
                cluster.urls, secret=cluster.env["TIERCAKE_SECRET"], token=cluster.env["TIERCAKE_TOKEN"], tenant=tenant
            )
            == 0
        )
        try:
            for _ in range(100):  # the connector saves in the background, after the answer
                loaded = await b.complete(prompt)
                if loaded["usage"]["prompt_tokens_details"]["cached_tokens"]:
                    break
                await b.reset_prefix_cache()  # b computed it: forget that, and ask again
                await asyncio.sleep(0.2)
            assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 32  # all six, from tiercake
            assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
            assert store.remove_all(True) >= 6  # what the connector stored is tiercake's objects
        finally:
            store.close()
    finally:
        for engine in engines:
            engine.stop()
