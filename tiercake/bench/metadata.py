"""`tiercake bench metadata`: the placement index against limits measured in the same run.

- lookup: the longest cached prefix of a 64-block chain, per node, in an index of N blocks (1M; 100k
  with --quick), against the floor of the same work: 64 dictionary probes of the same keys;
- commit: placements made durable in a real etcd (started here from the installed binary) through
  the index's group commit with many adds in flight, fenced like a leader's (each transaction
  compares the election key), against the same operations sent straight to
  etcd as back-to-back 128-operation transactions (the raw batched figure);
- bytes: metadata bytes per block in etcd (key + value) and in memory (measured with tracemalloc).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from tiercake.conductor.embedded import EmbeddedBackend
from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.etcd_process import EtcdCluster
from tiercake.conductor.metadata import Guard, Put
from tiercake.conductor.placement import PlacementIndex, Replica

from .report import Report, machine

CHAIN = 64


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4  # 32 bytes, as a BlockKey


def _fill(index: PlacementIndex, blocks: int, nodes: int) -> list[list[bytes]]:
    """Chains of 64 blocks, each held whole on one node and its first half on another."""
    chains = []
    for c in range(blocks // CHAIN):
        keys = [_key(c * CHAIN + i) for i in range(CHAIN)]
        home, other = f"node-{c % nodes}", f"node-{(c + 1) % nodes}"
        for i, key in enumerate(keys):
            index._set("tenant", key, Replica(home, "pool"), 1 << 20)
            if i < CHAIN // 2:
                index._set("tenant", key, Replica(other, "ssd"), 1 << 20)
        chains.append(keys)
    return chains


def _allocated(build) -> tuple[object, int]:
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    built = build()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return built, sum(s.size_diff for s in after.compare_to(before, "filename"))


async def bench_lookup(report: Report, blocks: int, probes: int) -> None:
    index = PlacementIndex(EmbeddedBackend())
    chains, memory = _allocated(lambda: _fill(index, blocks, nodes=16))
    replicas = len(index)
    # the floor for a Python index: one dict entry per replica, a key and a (node, tier) tuple
    pairs = [(f"node-{n}", tier) for n in range(16) for tier in ("pool", "ssd")]
    _, floor_memory = _allocated(lambda: {(i, _key(i)): pairs[i % len(pairs)] for i in range(replicas)})
    rng = random.Random(0)
    sample = [rng.choice(chains) for _ in range(probes)]
    table = index._tenants["tenant"]
    times, floor = [], []
    for keys in sample:
        t0 = time.perf_counter()
        index.lookup("tenant", keys)
        t1 = time.perf_counter()
        for key in keys:  # the floor: one dictionary probe per block of the chain
            table.get(key)
        t2 = time.perf_counter()
        times.append(t1 - t0)
        floor.append(t2 - t1)
    params = {"blocks": blocks, "replicas": replicas, "chain": CHAIN, "probes": probes, "limit_name": "64 dict probes"}
    report.add("lookup.chain64_p50", statistics.median(times) * 1e6, "us", statistics.median(floor) * 1e6, **params)
    report.add(
        "memory.bytes_per_replica",
        memory / replicas,
        "B",
        floor_memory / replicas,
        **params | {"limit_name": "a flat dict of the same replicas"},
    )


async def bench_commit(report: Report, placements: int, root: Path) -> None:
    cluster = EtcdCluster(root).start()
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=30).start()
        index = await PlacementIndex(meta, b"/bench/placements/").start(follow=False)
        # fenced as the leader's writes are: every transaction checks the election key
        index.guard = Guard(b"/bench/leader/conductor", b"bench-conductor")
        await meta.put(index.guard.key, index.guard.value)
        # raw: the same kind of operations, straight to etcd as back-to-back 128-op transactions
        ops = [
            Put(index._meta_key("tenant", _key(i), Replica("node-0", "pool")), b'{"size": 1048576}')
            for i in range(placements)
        ]
        t0 = time.perf_counter()
        await meta.commit(ops)
        raw = placements / (time.perf_counter() - t0)
        # ours: requests committing their new blocks (100 each), 50 requests at a time
        per_request, in_flight = 100, 50
        gate = asyncio.Semaphore(in_flight)

        async def request(first: int) -> None:
            async with gate:
                keys = [_key(i) for i in range(first, min(placements, first + per_request))]
                await index.add_many("tenant", keys, "node-1", "pool", [1 << 20] * len(keys))

        t0 = time.perf_counter()
        await asyncio.gather(*(request(i) for i in range(0, placements, per_request)))
        ours = placements / (time.perf_counter() - t0)
        key_bytes = len(ops[0].key) + len(ops[0].value)
        params = {
            "placements": placements,
            "blocks_per_request": per_request,
            "requests_in_flight": in_flight,
            "batches": index.stats.commits,
            "largest_batch": index.stats.largest_batch,
        }
        report.add("commit.placements_per_s", ours, "1/s", raw, **params, limit_name="raw batched etcd txns")
        report.add("etcd.bytes_per_replica", key_bytes, "B", 32, **params, limit_name="the block key alone")
        await index.close()
        await meta.close()
    finally:
        cluster.stop()


async def run(quick: bool = False) -> Report:
    report = Report(bench="metadata", machine=machine())
    await bench_lookup(report, blocks=100_000 if quick else 1_000_000, probes=2_000 if quick else 10_000)
    root = Path(tempfile.mkdtemp(prefix="tiercake-bench-etcd-"))
    try:
        await bench_commit(report, placements=5_000 if quick else 50_000, root=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report
