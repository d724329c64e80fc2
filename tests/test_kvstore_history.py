"""The key-value store's contract proved by histories: concurrent clients put, upsert, remove and get
a few keys while node agents are SIGKILLed and restarted, stopped, or lost for good; every value is
checksummed, and each key's history is checked for linearizability (``linearizability.py``).

A write whose answer is a transfer failure has an unknown outcome (it may have landed, late, or
never): the checker may place it anywhere after its call. A refusal (a full node, a bad argument)
did not happen and is left out. Reads of keys that always hold a value must never find nothing."""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
import time
from collections import defaultdict

import pytest
from kvstore_helpers import KB, KvCluster, ready
from linearizability import Op, check, explain

from tiercake.kvstore import Durability, ObjectNotFound, StoreApiError, TransferFailed

CLIENTS = 8
STEADY = ["s0", "s1", "s2"]  # put once at the start, then only upserted and read: never absent
CHURN = ["c0", "c1", "c2"]  # put, upserted, removed and read


def value(client: int, seq: int, rng: random.Random) -> bytes:
    size = 256 * KB if rng.random() < 0.05 else rng.randrange(16, 3000)
    body = f"{client}-{seq}-".encode() + rng.randbytes(size)
    return hashlib.sha256(body).digest() + body  # a read checks it whole: never torn, never mixed


def whole(raw: bytes) -> bool:
    return hashlib.sha256(raw[32:]).digest() == raw[:32]


async def client_run(store, client: int, ops_each: int, history: dict, durability: Durability, stop: asyncio.Event):
    rng = random.Random(client)
    for seq in range(ops_each):
        key = rng.choice(STEADY + CHURN)
        kinds = ["upsert", "get", "get"] if key in STEADY else ["put", "upsert", "remove", "get", "get"]
        kind = rng.choice(kinds)
        v = value(client, seq, rng) if kind in ("put", "upsert") else None
        called = time.monotonic()
        try:
            if kind == "get":
                try:
                    got = await store.get(key)
                except ObjectNotFound:
                    got = None
                assert got is None or whole(got), f"a torn or mixed read of {key}"
                result = got
            elif kind == "remove":
                try:
                    await store.remove(key, force=True)
                    result = "ok"
                except ObjectNotFound:
                    result = "not_found"
            else:
                await store.put(key, v, replace=kind == "upsert", durability=durability)
                result = "ok"
            history[key].append(Op(kind, v, result, called, time.monotonic()))
        except TransferFailed:
            if kind != "get":  # its outcome is unknown; a failed read says nothing
                history[key].append(Op(kind, v, "ok" if kind != "remove" else "ok", called, None))
        except StoreApiError:
            pass  # refused: it did not happen
        if stop.is_set():
            return
        await asyncio.sleep(0)


async def run_history(cluster: KvCluster, nodes: int, durability: Durability, faults, ops_each: int = 700):
    stores = [cluster.store(retry_s=20.0, timeout_s=3.0) for _ in range(CLIENTS)]
    for s in stores:
        await s.open()
    try:
        await ready(stores[0], nodes)
        history: dict[str, list[Op]] = defaultdict(list)
        for key in STEADY:
            v = value(99, 0, random.Random(key))
            called = time.monotonic()
            await stores[0].put(key, v, durability=durability)
            history[key].append(Op("put", v, "ok", called, time.monotonic()))
        stop = asyncio.Event()
        clients = [asyncio.create_task(client_run(s, i, ops_each, history, durability, stop))
                   for i, s in enumerate(stores)]
        await faults()
        await asyncio.gather(*clients)
        return history
    finally:
        for s in stores:
            await s.close()


def verify(history: dict[str, list[Op]]) -> int:
    total = sum(len(ops) for ops in history.values())
    for key, ops in history.items():
        assert check(ops), f"{key}: {explain(ops)}"
        if key in STEADY:
            nothing = [o for o in ops if o.kind == "get" and o.result is None]
            assert not nothing, f"{key} always holds a value, yet {len(nothing)} reads found nothing"
    return total


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
        history = await run_history(cluster, 2, Durability(), faults)
        total = verify(history)
        unknown = sum(o.returned is None for ops in history.values() for o in ops)
        print(f"history with restarts: {total} operations over {len(history)} keys, {unknown} of unknown outcome")
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
        history = await run_history(cluster, 3, Durability(replicas=2), faults, ops_each=650)
        total = verify(history)
        print(f"replicated history through a failover: {total} operations")
        assert total >= 5000
    finally:
        cluster.close()
