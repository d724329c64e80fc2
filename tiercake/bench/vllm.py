"""`tiercake bench vllm`: time to first token on vLLM with part of the prompt held in tiercake,
beside the same prompts recomputed by the same instance in the same run.

For each held fraction (50% and 90% of the prompt's blocks), fresh prompts are made; the held prefix is
sent alone first (vLLM computes it, the TiercakeConnector saves it to the node agent's pool), vLLM's
own prefix cache is reset, and the full prompt is timed: its missing blocks come from tiercake. The
limit is the same full prompt under another ``cache_salt`` (nothing held anywhere: all of it computed),
timed right after, with vLLM's prefix cache reset again. With loads for free the ratio would be the
uncached fraction (0.5 and 0.1). Load throughput is what the connector reports per request (reading
the blocks from the pool and scattering them into every layer's paged KV), against copying 32 of
the model's blocks one by one between warm buffers (about one request's load) in this process,
measured before vLLM starts.

It starts a conductor, a node agent and one vLLM server (a locally made 8-layer Llama), and stops them.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from tiercake.conductor.etcd_process import free_port
from tiercake.config import TiercakeConfig
from tiercake.up import NodeCluster, VllmServer
from tiercake.workers.vllm.process import serve_command
from tiercake.workers.vllm.tiny_model import make_tiny_llama

from .report import Report, machine
from .store import _memcpy_seconds

MODEL = "tiercake-bench-llama"
BLOCK = 32
FRACTIONS = (0.5, 0.9)


async def _complete(http: aiohttp.ClientSession, url: str, tokens: list[int], salt: str | None = None) -> tuple[float, dict]:
    """Seconds to the end of a two-token completion (the first token and one decode step: the
    connector's load report reaches vLLM's scheduler one step after the load) and the response."""
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {data}")
    return time.perf_counter() - started, data


async def _reset(http: aiohttp.ClientSession, url: str) -> None:
    async with http.post(url + "/reset_prefix_cache") as resp:
        if resp.status != 200:
            raise RuntimeError(f"cannot reset vLLM's prefix cache: {resp.status} (VLLM_SERVER_DEV_MODE=1 is needed)")


def _memcpy_rate(blocks: int, block_bytes: int) -> float:
    """Bytes per second of copying ``blocks`` blocks one by one between two warm buffers (best of 20,
    the store bench's measure): what moving one request's prefix costs at memory speed."""
    src = torch.ones((blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return src.numel() / min(_memcpy_seconds(src, dst, blocks) for _ in range(20))


async def _measure(url: str, prompt_tokens: int, rounds: int, memcpy: float, report: Report) -> None:
    rates, loaded_bytes = [], []
    async with aiohttp.ClientSession() as http:
        await _complete(http, url, [5] * 64)  # warm up: the first request pays one-time costs
        for fraction in FRACTIONS:
            held, recomputed = [], []
            for r in range(rounds):
                seed = int(fraction * 1000) + r
                tokens = [(seed * 7919 + i * 131) % 500 + 3 for i in range(prompt_tokens)]
                prefix = tokens[: int(prompt_tokens * fraction) // BLOCK * BLOCK]
                await _complete(http, url, prefix + [1])  # computed, saved to tiercake
                await asyncio.sleep(0.3)  # the saves are asynchronous: let them land and be indexed
                await _reset(http, url)
                seconds, data = await _complete(http, url, tokens)
                stats = (data.get("kv_transfer_params") or {}).get("tiercake") or {}
                if stats.get("loaded_tokens", 0) < len(prefix) - BLOCK:
                    raise RuntimeError(f"only {stats.get('loaded_tokens', 0)} of {len(prefix)} held tokens were "
                                       f"loaded from tiercake: {stats}")
                held.append(seconds)
                if stats.get("load_s"):
                    rates.append(stats["load_bytes"] / stats["load_s"])
                    loaded_bytes.append(stats["load_bytes"])
                await _reset(http, url)
                recomputed.append((await _complete(http, url, tokens, salt=secrets.token_hex(8)))[0])
            report.add(f"ttft.held{int(fraction * 100)}", statistics.median(held), "s", statistics.median(recomputed),
                       limit_name="same prompts recomputed", includes="one decode step", ideal=round(1 - fraction, 2), prompt_tokens=prompt_tokens,
                       rounds=rounds)
    if rates:
        nbytes = int(statistics.median(loaded_bytes))
        report.add("load.throughput", statistics.median(rates) / 1e9, "GB/s", memcpy / 1e9,
                   limit_name="memcpy", bytes=nbytes)


async def run(quick: bool = False) -> Report:
    report = Report(bench="vllm", machine=machine())
    prompt_tokens = 1024 if quick else 2048
    rounds = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-vllm-") as tmp:
        root = Path(tmp)
        model = await asyncio.to_thread(make_tiny_llama, root / "model", layers=8, hidden=512, heads=8, kv_heads=2,
                                        vocab=512)
        config = TiercakeConfig.model_validate({
            "node_id": "bench-node", "model_id": MODEL,
            "store": {"layout": None, "tiers": [
                {"kind": "pool", "capacity": "512MiB", "path": f"/dev/shm/tiercake-bench-vllm-{os.getpid()}"}]},
        })
        env = {**os.environ, "TIERCAKE_SECRET": secrets.token_hex(24), "VLLM_SERVER_DEV_MODE": "1"}
        # before vLLM starts: its CPU workers keep cores busy while idle, which would slow the limit too
        memcpy = _memcpy_rate(32, 8 * 2 * BLOCK * 2 * 64 * 2)  # 32 blocks of this model (8 layers, 2x64 KV, bf16)
        cluster = await asyncio.to_thread(NodeCluster, config, root, env)
        server = None
        try:
            port = free_port()
            server = VllmServer(serve_command(model, MODEL, port, cluster.url, "bench-node", block_size=BLOCK),
                                env, root / "vllm.log", port)
            await asyncio.to_thread(server.wait_ready)
            await _measure(server.url, prompt_tokens, rounds, memcpy, report)
        finally:
            if server is not None:
                await asyncio.to_thread(server.stop)
            await asyncio.to_thread(cluster.close)
    return report
