"""The key-value store's contract proved by histories: concurrent clients put, upsert, remove and get
a few keys while node agents are SIGKILLed and restarted, stopped, or lost for good; every value is
checksummed, and each key's history is checked for linearizability (``linearizability.py``).

A write whose answer is a transfer failure has an unknown outcome (it may have landed, late, or
never): the checker may place it anywhere after its call. A refusal (a full node, a bad argument)
did not happen and is left out. Reads of keys that always hold a value must never find nothing."""

from __future__ import annotations

import asyncio
import signal

import pytest
from kvstore_helpers import KvCluster, ready

from tiercake.chaos.kv import KvLoad
from tiercake.kvstore import Durability

pytestmark = pytest.mark.cluster  # every test here starts processes

CLIENTS = 8


async def run_history(cluster: KvCluster, nodes: int, durability: Durability, faults, ops_each: int = 700) -> KvLoad:
    """``CLIENTS`` clients of ``tiercake.chaos.kv`` (the workload ``tiercake chaos`` runs), ``ops_each``
    operations each, while ``faults()`` runs."""
    probe = await cluster.store().open()
    try:
        await ready(probe, nodes)
    finally:
        await probe.close()
    load = KvLoad(lambda: cluster.store(retry_s=20.0, timeout_s=3.0), clients=CLIENTS, durability=durability)
    await load.start(ops_each)
    try:
        await faults()
        await load.wait()
        await load.read_back()
    finally:
        await load.stop()
    return load


def verify(load: KvLoad) -> int:
    verdict = load.verdict()
    assert not verdict.violations, verdict.violations[0]
    assert verdict.lost == 0, f"{verdict.lost} reads of a key that always holds a value found nothing"
    assert verdict.torn == 0, f"{verdict.torn} torn or mixed reads"
    return verdict.ops


async def test_histories_stay_linearizable_while_node_agents_restart_and_stall(tmp_path):
    cluster = KvCluster(tmp_path, failover_s=60.0)  # the slots stay where they are: restarts are quicker

    async def faults():
        await asyncio.sleep(1.0)
        cluster.restart("kv-a")  # SIGKILL: its pool is adopted by the next one
        await asyncio.sleep(2.5)
        stalled = cluster.nodes["kv-b"]
        stalled.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.0)
        stalled.send_signal(signal.SIGCONT)

    try:
        load = await run_history(cluster, 2, Durability(), faults)
        total = verify(load)
        print(f"history with restarts: {total} operations, {load.verdict().unknown} of unknown outcome")
        assert total >= 5000
    finally:
        cluster.close()


@pytest.mark.timeout(240)
async def test_replicated_histories_stay_linearizable_through_a_failover(tmp_path):
    cluster = KvCluster(tmp_path, nodes=("kv-a", "kv-b", "kv-c"), failover_s=1.5)

    async def faults():
        await asyncio.sleep(1.5)
        cluster.kill("kv-c")  # for good: its slots go to their backups, which hold every replicated write

    try:
        load = await run_history(cluster, 3, Durability(replicas=2), faults, ops_each=650)
        total = verify(load)
        print(f"replicated history through a failover: {total} operations")
        assert total >= 5000
    finally:
        cluster.close()
