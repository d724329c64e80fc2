"""`tiercake bench metadata`: the placement index against limits measured in the same run.

- ingest: placements taken into the index (reports of 1,024 blocks, as a node's coalesced report,
  each logged for followers), per second of this one process, against the same placements sent
  straight to a real etcd (started here from the installed binary) as back-to-back 128-operation
  transactions: the ceiling of an index that made each placement durable, as this one did before;
- lookup: the longest cached prefix of a 64-block chain, per node, in an index of N blocks (10M;
  200k with --quick), against the floor of the same work: 64 probes of the same table (one batched
  find of the chain's keys);
- memory: the process's resident memory per replica, against a flat array of 40 bytes a replica
  (a 32-byte key, a node and a tier).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.etcd_process import EtcdCluster
from tiercake.conductor.metadata import Delete, Put
from tiercake.conductor.placement import PlacementIndex

from .report import Report, machine

CHAIN = 64
REPORT = 1024  # blocks per report
FLAT_REPLICA = 40  # bytes: a 32-byte key, a node and a tier in a flat array
PER_CORE_FLOOR = 100_000  # placements per conductor core (issue 45)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _fill(index: PlacementIndex, blocks: int, nodes: int) -> tuple[float, list[np.ndarray]]:
    """Chains of 64 blocks in reports of 1,024, each chain on one node and its first half on another
    node's SSD; returns the seconds the reports took and a sample of the chains."""
    rng = np.random.default_rng(0)
    sizes = np.full(REPORT, 1 << 20, dtype=np.uint32)
    sample: list[np.ndarray] = []
    took = 0.0
    for first in range(0, blocks, REPORT):
        keys = rng.integers(0, 1 << 63, size=(REPORT, 4), dtype=np.uint64)
        node = first // REPORT % nodes
        started = time.perf_counter()
        index.add_many("tenant", keys, f"node-{node}", "pool", sizes)
        halves = keys.reshape(-1, CHAIN, 4)[:, : CHAIN // 2].reshape(-1, 4)
        index.add_many("tenant", halves, f"node-{(node + 1) % nodes}", "ssd", sizes[: len(halves)])
        took += time.perf_counter() - started
        if len(sample) < 1000:
            sample.extend(keys.reshape(-1, CHAIN, 4))
    return took, sample


async def bench_index(report: Report, blocks: int, probes: int) -> None:
    index = PlacementIndex()
    rss0 = _rss()
    took, chains = _fill(index, blocks, nodes=16)
    grown = _rss() - rss0
    replicas = len(index)
    params = {"blocks": blocks, "replicas": replicas, "report_blocks": REPORT}
    report.add(
        "ingest.placements_per_s_per_core",
        replicas / took,
        "1/s",
        PER_CORE_FLOOR,
        **params,
        limit_name="100k per conductor core (issue 45)",
    )
    times, floor = [], []
    rng = np.random.default_rng(1)
    table = index.table
    for i in rng.integers(0, len(chains), size=probes):  # interleaved: the floor under the same conditions
        keys = chains[i]
        t0 = time.perf_counter()
        index.lookup("tenant", keys)
        t1 = time.perf_counter()
        table.find("tenant", keys)
        t2 = time.perf_counter()
        times.append(t1 - t0)
        floor.append(t2 - t1)
    times.sort()
    probe_params = params | {"chain": CHAIN, "lookups": probes, "limit_name": "64 probes of the same table"}
    report.add("lookup.chain64_p50", times[len(times) // 2] * 1e6, "us", statistics.median(floor) * 1e6, **probe_params)
    report.add(
        "lookup.chain64_p99", times[int(len(times) * 0.99)] * 1e6, "us", statistics.median(floor) * 1e6, **probe_params
    )
    report.add(
        "memory.bytes_per_replica",
        grown / replicas,
        "B",
        FLAT_REPLICA,
        **params,
        rss_mb=round(grown / 1e6),
        table_bytes_per_block=round(table.memory() / table.blocks, 1),
        limit_name="a flat array, 40 B a replica",
    )
    report.add(
        "ingest.vs_raw_etcd",
        replicas / took,
        "1/s",
        await _raw_etcd(min(blocks, 20_000)),
        **params,
        limit_name="raw batched etcd txns (each placement durable)",
    )


async def _raw_etcd(placements: int) -> float:
    """The same kind of placements straight to a local etcd: back-to-back 128-operation transactions."""
    root = Path(tempfile.mkdtemp(prefix="tiercake-bench-etcd-"))
    cluster = await asyncio.to_thread(lambda: EtcdCluster(root).start())
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=30).start()
        ops = [Put(b"/bench/placements/tenant/%064x/node-0/pool" % i, b'{"size": 1048576}') for i in range(placements)]
        started = time.perf_counter()
        await meta.commit(ops, concurrency=8)
        rate = placements / (time.perf_counter() - started)
        await meta.commit([Delete(op.key) for op in ops], concurrency=8)
        await meta.close()
        return rate
    finally:
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(root, ignore_errors=True)


async def run(quick: bool = False) -> Report:
    report = Report(bench="metadata", machine=machine())
    await bench_index(report, blocks=200_000 if quick else 10_000_000, probes=2_000 if quick else 10_000)
    return report
