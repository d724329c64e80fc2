"""A node agent cut off by a real network partition: it runs in a network namespace of its own,
joined to the host by a veth pair, and the partition takes the link down (established connections
then black-hole, new ones find no route), as a failed switch port would. Needs root (or
CAP_NET_ADMIN) and iproute2; elsewhere the test says so and is skipped. The rest is real: a
conductor and two node agents as processes, the key-value store client over TCP."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import Processes

from tiercake.blocks import object_head_key
from tiercake.kvstore import AsyncStore, ObjectNotFound, TransferFailed
from tiercake.netns import Partition, PartitionUnavailable

SECRET = "partition-test-secret-0123456789"
TOKEN = "partition-test-token"


def node_config(tmp: Path, name: str, conductor: str, host: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"node_id: {name}\n"
        "store:\n  layout: null\n  tiers:\n"
        f"    - {{kind: pool, capacity: 64MiB, path: /dev/shm/tiercake-part-{uuid.uuid4().hex[:12]}}}\n"
        f"conductor: {{urls: [{conductor}], member_ttl: 1}}\n"
        f"transfer: {{host: {host}}}\n")
    return path


def blob(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def members(store: AsyncStore) -> set[str]:
    return {m.node_id for m in await store.client.members() if m.role == "node"}


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


@pytest.mark.timeout(120)
async def test_a_partitioned_node_fails_its_reads_fast_leaves_and_comes_back_whole(tmp_path):
    try:
        part = Partition()
    except PartitionUnavailable as exc:
        pytest.skip(str(exc))
    group = Processes()
    env = {"TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN}
    try:
        # the conductor listens on the host's end of the link, reachable from both sides
        _, info = group.start(["conductor", "--listen", f"{part.host_ip}:0", "--api-listen", f"{part.host_ip}:0"], env)
        url = info["url"]
        group.start(["node", "--config", str(node_config(tmp_path, "near", url, part.host_ip))], env)
        group.start(["node", "--config", str(node_config(tmp_path, "far", url, part.ns_ip))], env, prefix=part.prefix)
        async with AsyncStore([url], secret=SECRET, token=TOKEN, transports=("tcp",)) as store:
            await until(lambda: _both(store), 20, "both node agents registered")
            objects = {f"o{i}": blob(i, 96 << 10) for i in range(16)}
            assert await store.put_many(list(objects), list(objects.values())) == [None] * 16
            on_far = {b.key for b in await store.client.node_blocks("far")}
            far = [name for name in objects if object_head_key(name.encode(), "default").hex() in on_far]
            assert far and len(far) < len(objects), far  # the placement spread them over both nodes

            part.cut()
            started = time.monotonic()
            got = await asyncio.wait_for(store.get_many(list(objects)), 30)
            took = time.monotonic() - started
            for name, value in zip(objects, got):  # the far node's fail, typed, and nothing else does
                if name in far:
                    assert isinstance(value, (TransferFailed, ObjectNotFound)), (name, value)
                else:
                    assert bytes(value.numpy()) == objects[name]
            assert took < 15, f"reads behind a partition took {took:.1f} s"
            print(f"partition: {len(far)} of {len(objects)} objects behind it failed in {took:.1f} s")
            await until(lambda: _only_near(store), 15, "the partitioned node never left the members")
            fresh = {f"n{i}": blob(100 + i, 96 << 10) for i in range(6)}  # new puts go where they can
            assert await store.put_many(list(fresh), list(fresh.values())) == [None] * 6

            part.heal()  # it registers again and re-reports what its pool still holds
            await until(lambda: _both(store), 30, "the node did not come back after the partition healed")

            async def whole():
                back = await store.get_many(list(objects))
                return all(not isinstance(v, Exception) and bytes(v.numpy()) == objects[n] for n, v in zip(objects, back))

            await until(whole, 30, "objects on the healed node did not come back")
    finally:
        group.close()
        part.close()
        for config in tmp_path.glob("*.yaml"):
            pool = config.read_text().split("path: ")[1].split("}")[0]
            Path(pool).unlink(missing_ok=True)


async def _both(store: AsyncStore) -> bool:
    return await members(store) == {"near", "far"}


async def _only_near(store: AsyncStore) -> bool:
    return await members(store) == {"near"}
