"""`tiercake bench serve`: time to first token with part of the prompt cached, per source tier, beside
the compute-only TTFT of the same prompt measured in the same run.

For each source (the prefill worker's own gpu tier, the node pool, the node's SSD) and each cached
fraction (0, 50%, 90% of the prompt's blocks), a fresh shared prefix is cached by a first request and
moved to the source (a flush of the tiers above it), then the full prompt is timed: client-side TTFT
and the server's breakdown (routing, index lookup, loading the blocks, computing the rest). The limit
is the same prompt under a tenant with nothing cached (compute only). With perfect reuse the ratio
would be ``1 - fraction``; the gap to that is the figure's cost of reuse.

Metadata cost over the same run (from the front's counters in /v1/cluster, before and after): bytes
made durable in the placement index per KV byte moved (pulled into workers or written to nodes),
against the least an index could record (one block key per block moved), and metadata operations
(lookups and durable placement changes) per request, against one lookup per request.

Without ``--target`` it starts its own cluster (``tiercake up`` with a larger reference model, so the
compute is worth saving) and stops it afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Set as AbstractSet
from pathlib import Path

from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.up import UpProcess

from .report import Report, cluster_figures, machine

MODEL = "tiercake-reference"
BENCH_CONFIG = """node_id: bench-node
store:
  layout: null
  tiers:
    - {{kind: pool, capacity: 256MiB, path: /dev/shm/tiercake-bench-serve-{pid}}}
    - {{kind: ssd, capacity: 1GiB, path: {ssd}}}
conductor: {{member_ttl: 3}}
serving:
  model: {{dim: 512, layers: 8, heads: 8, kv_heads: 2, ffn_dim: 1536}}
  gpu_blocks: 768
  max_context: 4096
"""
SOURCES = {"gpu": None, "pool": ["gpu"], "ssd": ["gpu", "pool"]}  # the tiers to flush first


async def _ttft(client: Client, tokens: list[int], tenant: str) -> tuple[float, dict]:
    started = time.perf_counter()
    first: float | None = None
    usage: dict = {}
    async for chunk in client.stream_completion(tokens, model=MODEL, max_tokens=1, tenant=tenant):
        if chunk.get("choices") and first is None:
            first = time.perf_counter() - started
        usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, usage


async def _wait_tiers(
    client: Client,
    tokens: list[int],
    tenant: str,
    blocks: int,
    present: AbstractSet[str],
    absent: AbstractSet[str] = frozenset(),
) -> None:
    """Until the index shows the prefix whole in every tier of ``present`` and in none of ``absent``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        holders = (await client.prefix(tokens, tenant)).holders
        whole = {t for h in holders.values() if h.blocks >= blocks for t in h.tiers}
        anywhere = {t for h in holders.values() for t in h.tiers}
        if present <= whole and not absent & anywhere:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the prefix never settled in {sorted(present)} (and out of {sorted(absent)})")


async def measure(
    url: str, quick: bool, report: Report, control_url: str | None = None, token: str | None = None
) -> None:
    """Completions at ``url``; prefixes, flushes and counters through the control API (``control_url``
    with ``token``; default: the same URL, a cluster serving both on one port)."""
    rng = random.Random(7)
    prompt_tokens = 512 if quick else 2048
    repeats = 2 if quick else 3
    fractions = (0.0, 0.5, 0.9)
    block = 16
    async with (
        Client([url], timeout=300, retries=3) as api,
        Client([control_url or url], token=token, timeout=300, retries=3) as control,
    ):
        await _measure(api, control, rng, prompt_tokens, repeats, fractions, block, report)


async def _measure(
    client: Client,
    control: Client,
    rng: random.Random,
    prompt_tokens: int,
    repeats: int,
    fractions: tuple[float, ...],
    block: int,
    report: Report,
) -> None:
    """Each source and cached fraction: a prefix cached, moved to the source, the prompt timed."""
    await _ttft(client, [rng.randrange(256) for _ in range(64)], "bench-warmup")  # connections, threads
    before = await control.cluster()
    for source, flush in SOURCES.items():
        for fraction in fractions:
            if fraction == 0.0 and source != "gpu":
                continue  # nothing cached: the source does not matter
            runs, limits = [], []
            for r in range(repeats):
                cached_blocks = int(prompt_tokens * fraction) // block
                tokens = [rng.randrange(256) for _ in range(prompt_tokens)]
                tenant = f"bench-{source}-{fraction}-{r}"
                if cached_blocks:
                    await _ttft(client, tokens[: cached_blocks * block + 1], tenant)  # caches the prefix
                    # the worker's gpu copy and the node's pool copy are both in the index first,
                    # so that a flush is seen to have happened, not merely to be pending
                    await _wait_tiers(control, tokens, tenant, cached_blocks, {"gpu", "pool"})
                    if flush:
                        await control.flush(flush)
                        await _wait_tiers(control, tokens, tenant, cached_blocks, {source}, set(flush))
                runs.append(await _ttft(client, tokens, tenant))
                limits.append((await _ttft(client, tokens, f"{tenant}-cold"))[0])  # nothing cached
            ttft = statistics.median(t for t, _ in runs)
            limit = statistics.median(limits)
            usage = runs[len(runs) // 2][1]
            extra = usage.get("tiercake", {})
            ideal = 1 - fraction
            figure = report.add(
                f"ttft.{source if fraction else 'none'}.cached{int(fraction * 100)}",
                ttft,
                "s",
                limit,
                limit_name="compute only",
                prompt_tokens=prompt_tokens,
                cached_fraction=fraction,
                cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                ideal_ratio=round(ideal, 3),
                route_s=round(extra.get("route_s", 0), 5),
                lookup_s=round(extra.get("lookup_s", 0), 5),
                load_s=round(extra.get("load_s", 0), 5),
                compute_s=round(extra.get("compute_s", 0), 5),
                sources=extra.get("sources", {}),
            )
            figure.params["gap"] = round(figure.ratio - ideal, 3)
    cluster_figures(before, await control.cluster(), report)


async def run(quick: bool = False, target: str | None = None, control: str | None = None) -> Report:
    report = Report(bench="serve", machine=machine())
    if target:
        await measure(target, quick, report, control, os.environ.get("TIERCAKE_TOKEN") or None)
        return report
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-serve-") as tmp:
        root = Path(tmp)
        config = root / "bench.yaml"
        config.write_text(BENCH_CONFIG.format(pid=os.getpid(), ssd=root / "ssd"))
        up = UpProcess(config, root / "data", free_port())
        try:
            await asyncio.to_thread(up.wait_ready, 2)
            await measure(up.url, quick, report, up.control_url, up.token)
        finally:
            up.stop()
            Path(f"/dev/shm/tiercake-bench-serve-{os.getpid()}").unlink(missing_ok=True)  # the bench's own pool
    return report
