"""`tiercake bench store`: put and get throughput per tier, against limits measured in the same run.

- gpu and pool tiers: against a plain ``Tensor.copy_`` of the same bytes between warm buffers of the
  same working-set size (memcpy);
- ssd tier: against a raw sequential O_DIRECT write and read of the same bytes to one file on the
  same file system (buffered where the file system refuses O_DIRECT);
- ssd with zstd: compression ratio and throughput on KV computed by the reference model.

Every buffer is pre-faulted before timing: untouched memory fills at well under 1 GB/s here and
would hide everything else.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from tiercake.tiers import GpuBackend, GpuBlockPool, PoolBackend, PoolRegion, SsdFilesBackend, Tier, TieredStore
from tiercake.tiers.backend import TierBackend
from tiercake.tiers.buffers import aligned_buffer
from tiercake.tiers.ssd.log import SsdLogBackend

from .report import Report, machine

KiB, MiB = 1 << 10, 1 << 20


def _key(i: int) -> bytes:
    return b"bench-" + i.to_bytes(8, "big")


def _warm(n: int, size: int) -> torch.Tensor:
    """``n`` rows of ``size`` bytes, page-aligned as pool slots are, every page touched."""
    _mem, view = aligned_buffer(n * size)
    t = torch.frombuffer(view, dtype=torch.uint8)[: n * size].view(n, size)
    t.random_(0, 256)
    return t


async def _best(reps: int, once: Callable[[], Awaitable[float]]) -> float:
    """Best seconds of ``reps`` runs (the machines are noisy; the best run is the least disturbed)."""
    return min([await once() for _ in range(reps)])


def _memcpy_seconds(src: torch.Tensor, dst: torch.Tensor, n: int) -> float:
    k = src.shape[0]
    start = time.perf_counter()
    for i in range(n):
        dst[i].copy_(src[i % k])
    return time.perf_counter() - start


async def _store_rates(
    store: TieredStore, src: torch.Tensor, dst: torch.Tensor, n: int, reps: int, batch: int = 1
) -> tuple[float, float]:
    """Seconds for n puts and for n gets of blocks of src's row size (best of reps). With ``batch``
    above 1, the calls go through ``put_many``/``get_many`` that many at a time."""
    k = src.shape[0]

    async def puts() -> float:
        for i in range(n):
            if store.contains(_key(i)):
                await store.remove(_key(i))
        start = time.perf_counter()
        if batch == 1:
            for i in range(n):
                await store.put(_key(i), src[i % k])
        else:
            for lo in range(0, n, batch):
                done = await store.put_many([(_key(i), src[i % k]) for i in range(lo, min(n, lo + batch))])
                _raise_first(done)
        return time.perf_counter() - start

    async def gets() -> float:
        start = time.perf_counter()
        if batch == 1:
            for i in range(n):
                await store.get_into(_key(i), dst[i % k])
        else:
            for lo in range(0, n, batch):
                done = await store.get_many([(_key(i), dst[i % k]) for i in range(lo, min(n, lo + batch))])
                _raise_first(done)
        return time.perf_counter() - start

    put_s = await _best(reps, puts)
    get_s = await _best(reps, gets)
    return put_s, get_s


def _raise_first(results: list) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def bench_memory_tiers(report: Report, sizes: list[int], working_set: int, reps: int) -> None:
    for size in sizes:
        n = max(8, working_set // size)
        k = min(n, max(4, (64 * MiB) // size))
        src, dst = _warm(k, size), _warm(k, size)
        area = _warm(n, size)
        limit_s = min(_memcpy_seconds(src, area, n) for _ in range(reps))
        del area
        limit = n * size / limit_s / 1e9
        for kind in ("pool", "gpu"):
            backend: TierBackend
            if kind == "pool":
                region = PoolRegion.create(f"/dev/shm/tiercake-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}", n * size)
                backend = PoolBackend(region)
            else:
                backend = GpuBackend(GpuBlockPool(n, (size,), torch.uint8, "cpu"))
            store = TieredStore([Tier(backend, high_watermark=1.0)])
            try:
                put_s, get_s = await _store_rates(store, src, dst, n, reps)
            finally:
                await store.close()
            params = {"tier": kind, "block_bytes": size, "blocks": n, "device": "cpu", "limit_name": "memcpy"}
            report.add(f"{kind}.put", n * size / put_s / 1e9, "GB/s", limit, **params)
            report.add(f"{kind}.get", n * size / get_s / 1e9, "GB/s", limit, **params)


def _raw_file_rates(directory: Path, size: int, n: int) -> tuple[float, float, bool]:
    """Seconds to write and read n*size bytes sequentially to one file; whether O_DIRECT was used."""
    mem, view = aligned_buffer(size)
    path = directory / "raw-limit.bin"
    try:
        for direct in (True, False):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
            except OSError:
                continue
            try:
                start = time.perf_counter()
                for _ in range(n):
                    os.write(fd, view[:size])
                write_s = time.perf_counter() - start
            except OSError:
                os.close(fd)
                continue
            os.close(fd)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            start = time.perf_counter()
            for i in range(n):
                os.preadv(fd, [view[:size]], i * size)
            read_s = time.perf_counter() - start
            os.close(fd)
            return write_s, read_s, direct
        raise OSError(f"cannot write to {directory}")
    finally:
        path.unlink(missing_ok=True)
        view.release()
        mem.close()


async def bench_ssd(report: Report, sizes: list[int], working_set: int, reps: int, root: Path) -> None:
    for size in sizes:
        n = max(8, working_set // size)
        k = min(n, max(4, (64 * MiB) // size))
        src, dst = _warm(k, size), _warm(k, size)
        raw = [await asyncio.to_thread(_raw_file_rates, root, size, n) for _ in range(reps)]
        write_limit = n * size / min(r[0] for r in raw) / 1e9
        read_limit = n * size / min(r[1] for r in raw) / 1e9
        direct = raw[0][2]
        for layout, batch in itertools.product(("files", "log"), (1, 32)):
            tier_dir = root / f"ssd-{layout}-{size}-{batch}"
            # direct_min=0: every size goes to the device, as the raw limit does (no page cache)
            tier_cls = SsdLogBackend if layout == "log" else SsdFilesBackend
            backend = tier_cls(tier_dir, capacity_bytes=4 * n * size, direct_io=direct, direct_min=0)
            store = TieredStore([Tier(backend, high_watermark=1.0)])
            try:
                put_s, get_s = await _store_rates(store, src, dst, n, reps, batch)
            finally:
                await store.close()
                shutil.rmtree(tier_dir, ignore_errors=True)
            params = {
                "tier": "ssd",
                "layout": layout,
                "block_bytes": size,
                "blocks": n,
                "batch": batch,
                "direct_io": direct,
            }
            name = "ssd" if layout == "files" else "ssd.log"
            report.add(f"{name}.put", n * size / put_s / 1e9, "GB/s", write_limit, **params, limit_name="raw write")
            report.add(f"{name}.get", n * size / get_s / 1e9, "GB/s", read_limit, **params, limit_name="raw read")


def real_kv_blocks(n_tokens: int, block_tokens: int) -> tuple[torch.Tensor, dict]:
    """KV blocks computed by the reference model on real text: ``[blocks, block_bytes]`` uint8."""
    from tiercake.workers.reference.model import ModelConfig, ReferenceModel, encode

    config = ModelConfig(dim=256, layers=4, heads=8, kv_heads=4, ffn_dim=512)
    import tiercake.tiers.store as source_text

    text = inspect.getsource(source_text)
    tokens = (encode(text) * (1 + n_tokens // max(1, len(text))))[:n_tokens]
    _, kv = ReferenceModel(config).prefill_kv(tokens)  # [layers, 2, T, kv_heads, head_dim]
    blocks = kv.view(config.layers, 2, -1, block_tokens, config.kv_heads, config.head_dim)
    blocks = blocks.permute(2, 0, 1, 3, 4, 5).contiguous()  # one block: [layers, 2, block, kv_heads, head_dim]
    flat = blocks.view(blocks.shape[0], -1).view(torch.uint8)
    return flat, {
        "model": "reference",
        "layers": config.layers,
        "kv_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "block_tokens": block_tokens,
        "dtype": config.dtype,
    }


async def bench_compression(report: Report, root: Path, quick: bool, reps: int) -> None:
    blocks, model_params = real_kv_blocks(2048 if quick else 4096, 256)
    n, size = blocks.shape
    raw = [await asyncio.to_thread(_raw_file_rates, root, size, n) for _ in range(reps)]
    write_limit = n * size / min(r[0] for r in raw) / 1e9
    read_limit = n * size / min(r[1] for r in raw) / 1e9
    for shuffle in (False, True):
        tier_dir = root / f"zstd-{int(shuffle)}"
        backend = SsdFilesBackend(
            tier_dir, capacity_bytes=4 * n * size, compression=True, shuffle=shuffle, direct_min=0
        )
        store = TieredStore([Tier(backend, high_watermark=1.0)])
        try:
            put_s, get_s = await _store_rates(store, blocks, torch.empty_like(blocks), n, reps, batch=8)
            ratio = backend.compression_ratio
        finally:
            await store.close()
            shutil.rmtree(tier_dir, ignore_errors=True)
        params = {
            "tier": "ssd",
            "zstd": True,
            "shuffle16": shuffle,
            "block_bytes": size,
            "blocks": n,
            "batch": 8,
            **model_params,
        }
        report.add("ssd.zstd.ratio", ratio, "x", 1.0, **params, limit_name="uncompressed")
        report.add("ssd.zstd.put", n * size / put_s / 1e9, "GB/s", write_limit, **params, limit_name="raw write")
        report.add("ssd.zstd.get", n * size / get_s / 1e9, "GB/s", read_limit, **params, limit_name="raw read")


async def run(quick: bool = False, ssd_dir: str | Path | None = None, sizes: list[int] | None = None) -> Report:
    report = Report(bench="store", machine=machine())
    sizes = sizes or ([64 * KiB, 1 * MiB, 16 * MiB] if quick else [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB])
    reps = 2 if quick else 3
    await bench_memory_tiers(report, sizes, (64 if quick else 256) * MiB, reps)
    root = Path(tempfile.mkdtemp(prefix="tiercake-bench-", dir=ssd_dir))
    try:
        await bench_ssd(report, sizes, (64 if quick else 512) * MiB, reps, root)
        await bench_compression(report, root, quick, reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report
