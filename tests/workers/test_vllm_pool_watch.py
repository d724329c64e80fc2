"""The connector's watch of its node's pool index: found late, followed across a restart, paced by
CPU time (a real pool region written by a real store)."""

import asyncio
import time

from conftest import block, key

from tiercake.tiers import PoolRegion
from tiercake.workers.vllm import pool_watch
from tiercake.workers.vllm.pool_watch import PoolWatch


def test_a_pool_that_cannot_be_mapped_yet_is_found_when_it_can(shm_path, make_store):
    """vLLM may start before its node agent: the watch keeps asking, says why it has no index, and
    reads the index once the pool can be mapped (it used to stop at the first 'not mapped here')."""

    async def go():
        store = await make_store(gpu=None, pool=8, ssd=None)
        await store.put(key(1), block(1), tenant="t")
        mapped: list[PoolRegion] = []
        watch = PoolWatch("n1", every=0.05, region_of=lambda: asyncio.sleep(0, mapped[0] if mapped else None))
        pause = await watch.once()
        assert watch.index is None and "not mapped" in watch.state and pause >= pool_watch.UNMAPPED_RETRY_S
        assert watch.leading("t", [key(1)]) == 0
        mapped.append(PoolRegion.attach(shm_path))
        pause = await watch.once()
        assert watch.state == "read" and watch.leading("t", [key(1)]) == 1 and watch.leading("u", [key(1)]) == 0
        assert pause >= 0.05

    asyncio.run(go())


def test_a_new_region_gets_a_new_reader_and_a_failed_read_clears_the_index(shm_path, make_store):
    async def go():
        store = await make_store(gpu=None, pool=8, ssd=None)
        await store.put(key(1), block(1), tenant="t")
        regions = [PoolRegion.attach(shm_path)]

        async def region_of():
            if isinstance(regions[-1], Exception):
                raise regions[-1]
            return regions[-1]

        watch = PoolWatch("n1", every=0.05, region_of=region_of)
        await watch.once()
        first = watch.index
        await watch.once()
        assert watch.index is first  # the same region: the same reader, rereading what changed
        regions.append(PoolRegion.attach(shm_path))  # a restarted node agent's region
        await watch.once()
        assert watch.index is not first and watch.leading("t", [key(1)]) == 1
        regions.append(ConnectionRefusedError("node down"))
        await watch.once()
        assert watch.index is None and "node down" in watch.state and watch.leading("t", [key(1)]) == 0

    asyncio.run(go())


def test_rereads_are_paced_by_the_cpu_they_cost_not_by_a_busy_wall_clock(shm_path, make_store, monkeypatch):
    """A read that took 10 ms of CPU waits 0.2 s (5% of a core); a cheap one, the configured period."""

    async def go():
        await make_store(gpu=None, pool=8, ssd=None)
        region = PoolRegion.attach(shm_path)
        watch = PoolWatch("n1", every=0.05, region_of=lambda: asyncio.sleep(0, region))
        monkeypatch.setattr(pool_watch, "_refresh", lambda index: 0.010)
        assert abs(await watch.once() - 0.2) < 1e-9
        monkeypatch.setattr(pool_watch, "_refresh", lambda index: 0.0001)
        assert await watch.once() == 0.05

    asyncio.run(go())


def test_a_reads_cost_is_its_own_threads_cpu_time():
    """Time the read spent waiting (here: asleep, as when other threads hold the core) is not counted."""

    class Slow:
        def refresh(self):
            time.sleep(0.2)

    assert pool_watch._refresh(Slow()) < 0.05
