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
measured before vLLM starts. ``load.waited`` is how long the forward pass waited for the load, against
the load's own time: the connector loads layer by layer, so the rest ran under the pass's layers.

With ``--trace`` (a conversation trace, such as Mooncake's), routing across two vLLM servers behind
tiercake's front: the conversations among the trace's first requests (the requests whose first two
blocks another request shares), scaled down to 32-token blocks, go through the front once per router,
each under a tenant of its own. The figure is the share of prompt tokens the instances' own prefix
caches served (vLLM's ``prefix_cache_hits``/``queries``: loads from tiercake's pool do not count),
against the share in blocks some earlier prompt had (one cache that forgets nothing: the offline bound).

It starts a conductor, a node agent and one vLLM server (a locally made 8-layer Llama; a second one and
a tiercake worker beside each for the routing figures), and stops them.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import aiohttp
import torch

from tiercake.blocks import Namespace, block_keys
from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.config import TiercakeConfig
from tiercake.traces import TraceRecord, read_trace
from tiercake.up import NodeCluster, stop_all
from tiercake.up_vllm import VllmServer, vllm_worker
from tiercake.workers.vllm.process import serve_command

from .report import Report, machine
from .store import _memcpy_seconds
from .store_api import mooncake_master
from .vllm_peers import (
    INSIDE,
    KV_BYTES_PER_TOKEN,
    NULL_CONNECTOR,
    LmcacheServer,
    MooncakePeer,
    bench_model,
    in_own_namespace,
    lmcache_installed,
    lmcache_result,
    peer_result,
    peer_server,
    run_in_namespace,
)
from .vllm_requests import BLOCK, FRACTIONS, MODEL, Instance, interleaved, median_s

ROUTERS = ("round_robin", "cache_aware", "ttft")


def conversation_prompts(records: list[TraceRecord], block: int, max_blocks: int = 16) -> list[list[int]]:
    """The turns of the conversations among ``records`` (the requests whose first two blocks another
    request shares), scaled down: each hash id a block of ``block`` tokens of its own (at most
    ``max_blocks``), then three tokens of the request's own."""

    def tokens(h: int) -> list[int]:
        return [(h * 7919 + i * 104729) % 500 + 3 for i in range(block)]

    requests = [r.hash_ids[:max_blocks] for r in records]
    turns = Counter(ids[:2] for ids in requests)
    return [
        [t for h in ids for t in tokens(h)] + [n % 400 + 3, 7, 11]
        for n, ids in enumerate(requests)
        if len(ids) >= 2 and turns[ids[:2]] >= 2
    ]


def seen_before(prompts: list[list[int]], block: int) -> float:
    """The share of the prompts' tokens in leading blocks that some earlier prompt had: what one cache
    that forgets nothing would serve (the bound of any routing over any number of instances)."""
    namespace = Namespace(model_id="bound", kv_layout="any", block_size=block)
    seen: set[bytes] = set()
    hit = total = 0
    for prompt in prompts:
        keys = block_keys(namespace, prompt)
        hit += next((i for i, k in enumerate(keys) if k not in seen), len(keys)) * block
        total += len(prompt)
        seen.update(keys)
    return hit / total


async def vllm_counter(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """A counter of vLLM's ``/metrics``, summed over its labels."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def own_cache_hits(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """Tokens the servers' own prefix caches served, and tokens they looked up, so far."""
    hits = [await vllm_counter(http, u, "vllm:prefix_cache_hits_total") for u in urls]
    queries = [await vllm_counter(http, u, "vllm:prefix_cache_queries_total") for u in urls]
    return sum(hits), sum(queries)


def _memcpy_rate(blocks: int, block_bytes: int) -> float:
    """Bytes per second of copying ``blocks`` blocks one by one between two warm buffers (best of 20,
    the store bench's measure): what moving one request's prefix costs at memory speed."""
    src = torch.ones((blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return src.numel() / min(_memcpy_seconds(src, dst, blocks) for _ in range(20))


def tiercake_figures(samples: dict, held: str) -> list[dict]:
    """The connector's own figures of the ``held`` samples (what its answers carry)."""
    return [(data.get("kv_transfer_params") or {}).get("tiercake") or {} for _, data in samples[held]]


def _figures(samples: dict, prompt_tokens: int, rounds: int, memcpy: float, report: Report) -> None:
    for fraction in FRACTIONS:
        pct = int(fraction * 100)
        for name, limit_name in (
            ("held", "same prompts recomputed"),
            ("across", "same prompts recomputed (on the first instance)"),  # a second instance loading
        ):
            if f"{name}{pct}" not in samples:
                continue
            report.add(
                f"ttft.{name}{pct}",
                median_s(samples, f"{name}{pct}"),
                "s",
                median_s(samples, f"cold{pct}"),
                limit_name=limit_name,
                includes="one decode step",
                ideal=round(1 - fraction, 2),
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                samples_s=[round(seconds, 4) for seconds, _ in samples[f"{name}{pct}"]],  # an outlier shows
            )
    held = [f for fraction in FRACTIONS for f in tiercake_figures(samples, f"held{int(fraction * 100)}")]
    cold = [f for fraction in FRACTIONS for f in tiercake_figures(samples, f"cold{int(fraction * 100)}")]
    _lookup_figures(report, held, cold)
    loads = [f for f in tiercake_figures(samples, "held90") if f.get("load_s")]
    if loads:
        nbytes = int(statistics.median(f["load_bytes"] for f in loads))
        report.add(
            "load.throughput",
            statistics.median(f["load_bytes"] / f["load_s"] for f in loads) / 1e9,
            "GB/s",
            memcpy / 1e9,
            limit_name="memcpy",
            bytes=nbytes,
            load_ms=round(statistics.median(f["load_s"] for f in loads) * 1e3, 3),
        )
        # layer by layer, the forward pass waits only for what its next layer needs: the rest of the load
        # runs under its computation (1.0: it waited for all of it)
        report.add(
            "load.waited",
            statistics.median(f.get("load_wait_s", f["load_s"]) for f in loads) * 1e3,
            "ms",
            statistics.median(f["load_s"] for f in loads) * 1e3,
            limit_name="the load's own time",
            bytes=nbytes,
        )


def _lookup_figures(report: Report, held: list[dict], cold: list[dict]) -> None:
    """Where the prompt's blocks are, per request: a held prefix is answered from the node's pool index
    read in place; a cold prompt (nothing held) asks the conductor without blocking vLLM's scheduler.
    Each against the conductor's answer to the cold prompts (the round trip the local index saves)."""
    if not held or not cold:
        return
    conductor = statistics.median(c.get("lookup_s", 0.0) for c in cold) or 1e-9
    for name, group, key in (
        ("lookup.held", held, "lookup_s"),
        ("lookup.scheduler_cpu", held + cold, "lookup_cpu_s"),
    ):
        values = sorted(g.get(key, 0.0) for g in group)
        report.add(
            name,
            statistics.median(values) * 1e6,
            "us",
            conductor * 1e6,
            limit_name="the conductor's lookup (cold prompts)",
            worst_us=round(values[-1] * 1e6, 1),
            requests=len(values),
            answered_locally=sum(1 for g in held if g.get("lookup_local")),
        )


async def _routing(
    cluster: NodeCluster, servers: list[VllmServer], prompts: list[list[int]], token: str, report: Report, rows: int
) -> None:
    workers = []
    try:
        for i, server in enumerate(servers):
            workers.append(await asyncio.to_thread(vllm_worker, cluster, server.url, "worker", f"bench-vllm-{i}"))
        bound = seen_before(prompts, BLOCK)
        async with Client([cluster.url], token=token) as client, aiohttp.ClientSession() as http:
            for router in ROUTERS:
                await client.set_policy(router=router)
                tenant = f"bench-{router}-{secrets.token_hex(4)}"  # nothing of the other runs is reused
                hits, queries = await own_cache_hits(http, [s.url for s in servers])
                for tokens in prompts:
                    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0}
                    async with http.post(
                        cluster.url + "/v1/completions", json=body, headers={"X-Tiercake-Tenant": tenant}
                    ) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"the front answered {resp.status}: {await resp.text()}")
                after = await own_cache_hits(http, [s.url for s in servers])
                report.add(
                    f"routing.own_cache_hits.{router}",
                    (after[0] - hits) / (after[1] - queries),
                    "ratio",
                    bound,
                    limit_name="in blocks an earlier prompt had (offline)",
                    requests=len(prompts),
                    trace_rows=rows,
                    instances=len(servers),
                )
    finally:
        await asyncio.to_thread(stop_all, workers)


PEER_NAMES = {"mooncake": "vLLM's MooncakeStoreConnector", "lmcache": "vLLM's LMCacheMPConnector"}


def _peer_figures(report: Report, ours: dict, null: dict | None, peers: dict[str, dict | None]) -> None:
    """tiercake's instance against the peers measured in the same run (``vllm_peers``): each peer's
    samples (seconds per request kind), and its loads' seconds and bytes."""
    for fraction in FRACTIONS:
        pct = int(fraction * 100)
        if null is not None:
            report.add(
                f"peers.cold{pct}.vs_null",
                median_s(ours, f"cold{pct}"),
                "s",
                median_s(null, f"cold{pct}"),
                limit_name="the same cold prompts on vLLM with a do-nothing connector",
            )
    for peer, got in peers.items():
        if got is None:
            continue
        _one_peer(report, ours, peer, got)


def _one_peer(report: Report, ours: dict, peer: str, got: dict) -> None:
    theirs, connector = got["samples"], PEER_NAMES[peer]
    for fraction in FRACTIONS:
        pct = int(fraction * 100)
        for held in ("held", "across"):
            name = f"{held}{pct}"
            if name not in ours or name not in theirs:
                continue
            where = "on the same instance" if held == "held" else "on a second instance"
            report.add(
                f"peers.{name}.vs_{peer}",
                median_s(ours, name),
                "s",
                statistics.median(theirs[name]),
                limit_name=f"the same held prompts {where} on {connector}",
            )
            # each by its own instance's recompute: where the two ran at different moments, the fair one
            report.add(
                f"peers.{name}_of_recompute.vs_{peer}",
                median_s(ours, name) / median_s(ours, f"cold{pct}"),
                "ratio",
                statistics.median(theirs[name]) / statistics.median(theirs[f"cold{pct}"]),
                limit_name=f"the same on {connector}'s instance",
            )
    loads = [f for f in tiercake_figures(ours, "held90") + tiercake_figures(ours, "held50") if f.get("load_s")]
    if loads and got["load_s"] > 0:
        report.add(
            f"peers.load.vs_{peer}",
            sum(f["load_bytes"] for f in loads) / sum(f["load_s"] for f in loads) / 1e9,
            "GB/s",
            got["load_bytes"] / got["load_s"] / 1e9,
            limit_name=f"{connector}'s loads ({got['load_source']})",
            loads=len(loads),
            slowest_ms=round(max(f["load_s"] for f in loads) * 1e3, 2),
            # a load that stopped short (a block that failed, recomputed by vLLM)
            short=sum(1 for f in loads if f.get("loaded_tokens", 0) < f.get("planned_load_tokens", 0)),
        )


async def run(quick: bool = False, trace: str | None = None, peers: bool = False) -> Report:
    if peers and not in_own_namespace():  # where Mooncake is installed, the whole bench beside it there
        got = await asyncio.to_thread(run_in_namespace, {"quick": quick, "trace": trace})
        if got is not None:
            return Report.model_validate(got)
    report = Report(bench="vllm", machine=machine())
    prompt_tokens = 1024 if quick else 2048
    rounds = 2 if quick else 5
    rows = 300 if quick else 600
    prompts = conversation_prompts(read_trace(trace, limit=rows), BLOCK) if trace else []
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-vllm-") as tmp:
        root = Path(tmp)
        model = await asyncio.to_thread(bench_model, root)
        config = TiercakeConfig.model_validate(
            {
                "node_id": "bench-node",
                "model_id": MODEL,
                "serving": {"tokenizer": str(model)},
                "store": {
                    "layout": None,
                    "tiers": [
                        {"kind": "pool", "capacity": "512MiB", "path": f"/dev/shm/tiercake-bench-vllm-{os.getpid()}"}
                    ],
                },
            }
        )
        token = secrets.token_hex(16)
        env = {
            **os.environ,
            "TIERCAKE_SECRET": secrets.token_hex(24),
            "TIERCAKE_TOKEN": token,
            "VLLM_SERVER_DEV_MODE": "1",
        }
        # before vLLM starts: its CPU workers keep cores busy while idle, which would slow the limit too
        memcpy = _memcpy_rate(32, BLOCK * KV_BYTES_PER_TOKEN)  # 32 blocks of this model
        cluster = await asyncio.to_thread(NodeCluster, config, root, env)
        servers: list[VllmServer] = []  # every vLLM process, to stop
        others = Peers()
        try:
            ours = [_server(model, cluster, env, root, "vllm-0")]
            servers += ours
            await asyncio.to_thread(ours[0].wait_ready)
            instances = {"tiercake": Instance(ours[0].url)}
            if peers:  # beside ours, rounds interleaved: a second instance of ours (to load across), the peers
                ours.append(_server(model, cluster, env, root, "vllm-1"))
                instances["tiercake"] = Instance(ours[0].url, other=ours[1].url)
                servers.append(ours[1])
                await others.start(model, env, root, servers, instances)
            mooncake_before = await others.mooncake.loads() if others.mooncake else (0.0, 0.0)
            samples = await interleaved(instances, prompt_tokens, rounds)
            _figures(samples["tiercake"], prompt_tokens, rounds, memcpy, report)
            if peers:
                measured = await others.results(samples, mooncake_before)
                report.machine.update({name: "absent" if got is None else "measured" for name, got in measured.items()})
                if not in_own_namespace() and mooncake_master() is not None:  # run_in_namespace gave nothing
                    report.machine["mooncake"] = "failed in its network namespace (its output's tail on stderr)"
                _peer_figures(report, samples["tiercake"], samples["null"], measured)
            if prompts:  # the second server only now (if not started for --peers): idle, it would slow the above
                if len(ours) == 1:
                    ours.append(_server(model, cluster, env, root, "vllm-1"))
                    servers.append(ours[1])
                    await asyncio.to_thread(ours[1].wait_ready)
                await _routing(cluster, ours, prompts, token, report, rows)
        except Exception:
            for log in [s.log_path for s in servers] + others.logs():  # they go with the temporary directory
                print(f"--- {log.name}:\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            raise
        finally:
            for server in servers:
                await asyncio.to_thread(server.stop)
            await asyncio.to_thread(others.stop)
            await asyncio.to_thread(cluster.close)
    return report


class Peers:
    """The other connectors' instances of a ``--peers`` run: the do-nothing one, and where each is
    installed, LMCache's server and Mooncake's master (inside the bench's own network namespace only)
    with an instance over each."""

    def __init__(self) -> None:
        self.lmcache: LmcacheServer | None = None
        self.mooncake: MooncakePeer | None = None

    async def start(
        self, model: Path, env: dict, root: Path, servers: list[VllmServer], instances: dict[str, Instance]
    ) -> None:
        """Each instance added to ``servers`` and ``instances``, and every server after the first started
        (the second of ours, already added, too)."""
        null = peer_server(model, NULL_CONNECTOR, env, root / "vllm-null.log", MODEL, BLOCK)
        servers.append(null)
        instances["null"] = Instance(null.url, held=False)
        if lmcache_installed():
            self.lmcache = LmcacheServer(root / "lmcache-server.log", BLOCK)
            await asyncio.to_thread(self.lmcache.wait_ready)
            theirs = peer_server(model, self.lmcache.connector(), env, root / "vllm-lmcache.log", MODEL, BLOCK)
            servers.append(theirs)
            instances["lmcache"] = Instance(theirs.url)
        if in_own_namespace() and mooncake_master() is not None:
            self.mooncake = MooncakePeer(model, env, root)
            instances["mooncake"] = Instance(self.mooncake.server.url)
        for server in servers[1:]:
            await asyncio.to_thread(server.wait_ready)
        if self.mooncake is not None:
            await asyncio.to_thread(self.mooncake.server.wait_ready)

    async def results(self, samples: dict[str, dict], mooncake_before: tuple[float, float]) -> dict[str, dict | None]:
        """Each peer's samples and loads (None: not installed here)."""
        lmcache = mooncake = None
        if self.lmcache is not None:
            lmcache = lmcache_result(self.lmcache, samples["lmcache"])
        if self.mooncake is not None:
            seconds, nbytes = await self.mooncake.loads()
            spent = (seconds - mooncake_before[0], nbytes - mooncake_before[1])
            mooncake = peer_result(samples["mooncake"], *spent, "its metrics")
        return {"mooncake": mooncake, "lmcache": lmcache}

    def logs(self) -> list[Path]:
        """Where the peers' own processes wrote (the vLLM instances in ``servers`` aside)."""
        logs = [] if self.lmcache is None else [self.lmcache.log_path]
        if self.mooncake is not None:
            logs += [self.mooncake.server.log_path, self.mooncake.master.log_path]
        return logs

    def stop(self) -> None:
        if self.mooncake is not None:
            self.mooncake.stop()
        if self.lmcache is not None:
            self.lmcache.stop()


def _server(model: Path, cluster: NodeCluster, env: dict, root: Path, name: str) -> VllmServer:
    port = free_port()
    return VllmServer(
        serve_command(
            model, MODEL, port, cluster.url, "bench-node", block_size=BLOCK, kv_events=(free_port(), free_port())
        ),
        env,
        root / f"{name}.log",
        port,
    )


if __name__ == "__main__" and os.environ.get(INSIDE):  # run_in_namespace: the report on the last line
    args = json.loads(sys.argv[1])
    print(asyncio.run(run(args["quick"], args["trace"], peers=True)).model_dump_json(), flush=True)
