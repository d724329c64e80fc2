"""`tiercake bench vllm-kv`: the TiercakeConnector's loads and saves against paged KV shaped as vLLM
lays it out, without vLLM (so it runs on a GPU machine that has only torch and tiercake).

It starts a conductor and a node agent with a pool tier, builds one tensor per layer of
``(blocks, 2, block tokens, KV heads, head size)`` on the device, and drives the connector's worker
side as vLLM's model runner would: one step saves a prefix's blocks (gathered from every layer and
written to the node agent's pool in the background), then each timed step loads them into other
blocks of the KV, waiting for each layer as attention would. Every load is checked byte for byte
against the blocks it came from.

The limit of a load is a plain copy of the same bytes measured in the same run, repetitions
interleaved: on the CPU, memcpy between two warm buffers; on a GPU, one copy from pinned host memory
(``cudaMemcpy``'s speed). Also reported: the seal check's share of a load (on: a block that does not
verify is recomputed), the copy into the layers alone from a warm host buffer (the loader's own copy
speed, no lease, no seal), and a save's time inside the step (the gather) against memcpy.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tiercake.blocks import Namespace, SealKeys, chain_key, cluster_seal_material
from tiercake.config import TiercakeConfig
from tiercake.up import NodeCluster

from .report import Report, machine

NODE = "bench-node"


class Shape:
    """vLLM's paged KV of one model: per layer ``(blocks, 2, tokens, heads, head size)``."""

    def __init__(self, layers: int, tokens: int, heads: int, head_size: int, dtype: torch.dtype = torch.bfloat16):
        self.layers, self.tokens, self.heads, self.head_size, self.dtype = layers, tokens, heads, head_size, dtype

    @property
    def layer_bytes(self) -> int:
        return 2 * self.tokens * self.heads * self.head_size * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def params(self) -> dict:
        return {"layers": self.layers, "block_tokens": self.tokens, "kv_heads": self.heads, "head_size": self.head_size}


# the vllm bench's model (8 layers, 2 KV heads of 64, 32-token blocks), and a 7-8B model's (32 layers,
# 8 KV heads of 128, 16-token blocks)
SMALL, LARGE = Shape(8, 32, 2, 64), Shape(32, 16, 8, 128)


def _kv(shape: Shape, blocks: int, device: str) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn": torch.randn(
            (blocks, 2, shape.tokens, shape.heads, shape.head_size), device=device
        ).to(shape.dtype)
        for i in range(shape.layers)
    }


def _plain_copy_seconds(nbytes: int, device: str) -> float:
    """One copy of ``nbytes``: host to host on the CPU, pinned host to device on a GPU (best of 5)."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        started = time.perf_counter()
        dst.copy_(src, non_blocking=device != "cpu")
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _cluster(root: Path, pool_bytes: int, env: dict) -> NodeCluster:
    config = TiercakeConfig.model_validate(
        {
            "node_id": NODE,
            "store": {
                "layout": None,
                "tiers": [
                    {"kind": "pool", "capacity": pool_bytes, "path": f"/dev/shm/tiercake-bench-kv-{os.getpid()}"}
                ],
            },
        }
    )
    return NodeCluster(config, root, env)


class _Driver:
    """The connector's worker side over ``kv``, driven as vLLM's model runner drives it."""

    def __init__(self, cluster: NodeCluster, env: dict, kv: dict[str, torch.Tensor]) -> None:
        from tiercake.workers.vllm.link import TiercakeLink
        from tiercake.workers.vllm.metadata import ConnectorSettings
        from tiercake.workers.vllm.worker_side import ConnectorWorker

        secret = env["TIERCAKE_SECRET"].encode()
        self.link = TiercakeLink([cluster.url], env["TIERCAKE_TOKEN"], secret, "bench-vllm-kv")
        settings = ConnectorSettings(conductor=cluster.url, node=NODE)
        keys = SealKeys(cluster_seal_material(secret))
        blocks = next(iter(kv.values())).shape[0]
        self.names = list(kv)
        self.worker = ConnectorWorker(settings, self.link, keys, self.names, blocks)
        self.worker.register_kv_caches(kv)
        self.link.watch_pool(NODE, 0.05)  # as the scheduler side does: loads then name the index entries
        self.warm: torch.Tensor | None = None  # a warm host buffer for the copy-only figure

    def save(self, keys: Sequence[bytes], first: int) -> float:
        """Blocks ``first``.. saved under ``keys``; seconds inside the step (the gather)."""
        from tiercake.workers.vllm.metadata import BlockSave, TiercakeMetadata

        saves = [BlockSave(k, keys[i - 1] if i else None, first + i, "default", "") for i, k in enumerate(keys)]
        before = self.worker.stats["saved_blocks"]
        started = time.perf_counter()
        self.worker.wait_for_save(TiercakeMetadata(saves=saves))
        in_step = time.perf_counter() - started
        deadline = time.monotonic() + 60
        while self.worker.stats["saved_blocks"] < before + len(keys):
            if time.monotonic() > deadline or self.worker.stats["failed_saves"] or self.worker.stats["dropped_saves"]:
                raise RuntimeError(f"the saves did not land: {self.worker.stats}")
            time.sleep(0.005)
        return in_step

    def load(self, keys: Sequence[bytes], first: int):
        """``keys`` loaded into blocks ``first``..; (seconds until the last layer landed, the report)."""
        from tiercake.workers.vllm.metadata import BlockLoad, RequestLoad, TiercakeMetadata

        pool, entries = self._entries(list(keys))
        blocks = [BlockLoad(k, first + i, entries[i]) for i, k in enumerate(keys)]
        load = RequestLoad("bench", NODE, blocks, "", pool)
        started = time.perf_counter()
        self.worker.start_load_kv(TiercakeMetadata(loads=[load]))
        for name in self.names:
            self.worker.wait_for_layer_load(name)
        seconds = time.perf_counter() - started
        meta = self.worker.build_connector_worker_meta()
        if meta is None or "bench" not in meta.loads:
            raise RuntimeError(f"the load reported nothing: {self.worker.stats}")
        report = meta.loads["bench"]
        if report.loaded != len(keys):
            raise RuntimeError(f"only {report.loaded} of {len(keys)} blocks loaded: {self.worker.stats}")
        return seconds, report

    def _entries(self, keys: list[bytes]) -> tuple[str, list[int]]:
        """The keys' pool index entries, as the scheduler side finds them (once the watch has read them)."""
        deadline = time.monotonic() + 10
        pool, entries = self.link.pool_entries("default", keys)
        while len(entries) < len(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pool index shows {len(entries)} of {len(keys)} saved blocks")
            time.sleep(0.01)
            pool, entries = self.link.pool_entries("default", keys)
        return pool, entries

    def close(self) -> None:
        self.worker.close()
        self.link.close()


def _warm_copy_seconds(driver: _Driver, kv: dict[str, torch.Tensor], count: int, first: int) -> float:
    """The loader's copy into every layer alone, from a warm host buffer (no lease, no seal)."""
    from tiercake.workers.vllm.loading import Segment

    loader = driver.worker._loader
    assert loader is not None, "register_kv_caches made it"
    copier = loader.copier
    staging = driver.warm
    if staging is None or staging.shape[0] != count:
        staging = driver.warm = torch.ones((count, copier.block_bytes), dtype=torch.uint8)
    parts = [
        (
            Segment(staging.numpy().reshape(-1), [i * copier.block_bytes for i in range(count)]),
            list(range(first, first + count)),
        )
    ]
    if copier.device:
        copier.synchronize()
        copier.staging(count)
    started = time.perf_counter()
    offset = 0
    for layer, size in enumerate(copier.layer_bytes):
        copier.copy(layer, offset, parts)
        offset += size
    copier.synchronize()
    return time.perf_counter() - started


def _check(kv: dict[str, torch.Tensor], count: int, first: int) -> None:
    for name, layer in kv.items():
        if not torch.equal(layer[first : first + count].view(torch.uint8), layer[:count].view(torch.uint8)):
            raise RuntimeError(f"{name}: the loaded blocks differ from the blocks saved")


def _measure(report: Report, shape: Shape, count: int, reps: int, device: str, cluster: NodeCluster, env: dict):
    kv = _kv(shape, 2 * count + 1, device)
    driver = _Driver(cluster, env, kv)
    try:
        root = Namespace(model_id="bench", kv_layout=f"bench-{shape.block_bytes}", block_size=shape.tokens).root()
        keys, parent = [], root
        for _ in range(count):
            parent = chain_key(parent, [secrets.randbelow(30000) for _ in range(shape.tokens)])
            keys.append(parent)
        nbytes = count * shape.block_bytes
        gathers = [driver.save(keys, 0)]
        driver.load(keys, count)  # untimed: first-use costs
        # the first second or two after the link starts, copies here ran 3-4x slower (measured: 1.6 ms
        # against 0.4-0.5 ms after, in the same process): measure after that
        time.sleep(2.0)
        loads, seals, fetches, copies, plain, warm = [], [], [], [], [], []
        for rep in range(reps):  # interleaved: a quiet or busy moment touches both
            for layer in kv.values():
                layer[count : 2 * count].zero_()
            _sync(device)
            seconds, got = driver.load(keys, count)
            _sync(device)
            if rep == 0:
                _check(kv, count, count)
            loads.append(seconds)
            seals.append(got.seal_s)
            fetches.append(got.fetch_s)
            copies.append(got.copy_s)
            plain.append(_plain_copy_seconds(nbytes, device))
            warm.append(_warm_copy_seconds(driver, kv, count, count))
        memcpy = nbytes / statistics.median(plain) / 1e9
        common = dict(shape.params(), blocks=count, bytes=nbytes, device=device, reps=reps)
        limit_name = "memcpy" if device == "cpu" else "copy from pinned host memory"
        load = report.add(
            "load.throughput", nbytes / statistics.median(loads) / 1e9, "GB/s", memcpy, limit_name=limit_name, **common
        )
        load.params["load_ms"] = round(statistics.median(loads) * 1e3, 3)
        stats = driver.worker.stats
        load.params["in_place_share"] = stats["in_place_blocks"] / stats["loaded_blocks"]
        load.params["unleased_share"] = stats["unleased_blocks"] / stats["loaded_blocks"]
        # where the load's time goes, each against the whole (until the pass may read every layer):
        # finding the blocks (the entries' read, or a lease), copying them in (the helper's seal check
        # beside it); the rest is thread wake-ups. What the seal check takes after the copy runs behind
        # the pass, outside the load's time (a ratio over 1 is still no wait of the pass's)
        for stage, values, what in (
            ("fetch", fetches, "share: finding the blocks"),
            ("copy", copies, "share: copying into the layers, the seal check beside it"),
            ("seal", seals, "the seal check after the copy, behind the pass"),
        ):
            report.add(
                f"load.{stage}",
                statistics.median(values) * 1e3,
                "ms",
                statistics.median(loads) * 1e3,
                limit_name=f"the whole load ({what})",
                **common,
            )
        report.add(
            "load.copy_only",
            nbytes / statistics.median(warm) / 1e9,
            "GB/s",
            memcpy,
            limit_name=limit_name,
            **common,
        )
        for _ in range(reps - 1):
            gathers.append(driver.save(keys, 0))
        report.add(
            "save.in_step",
            statistics.median(gathers) * 1e3,
            "ms",
            statistics.median(plain) * 1e3,
            limit_name=limit_name,
            **common,
        )
    finally:
        driver.close()


async def run(quick: bool = False, device: str = "cpu") -> Report:
    if device != "cpu" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: torch sees no GPU here")
    report = Report(bench="vllm-kv", machine=machine())
    shapes = [(SMALL, 28)] if quick else [(SMALL, 28), (SMALL, 58), (LARGE, 28)]
    reps = 5 if quick else 9
    pool = max(s.block_bytes * n for s, n in shapes) * 4
    env = {**os.environ, "TIERCAKE_SECRET": secrets.token_hex(24), "TIERCAKE_TOKEN": secrets.token_hex(16)}
    env.pop("TIERCAKE_SEAL_SECRET", None)
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-vllm-kv-") as tmp:
        cluster = await asyncio.to_thread(_cluster, Path(tmp), pool, env)
        try:
            for shape, count in shapes:
                await asyncio.to_thread(_measure, report, shape, count, reps, device, cluster, env)
        finally:
            await asyncio.to_thread(cluster.close)
    return report
