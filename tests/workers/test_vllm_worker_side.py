"""The connector's worker side loading blocks of a real node pool by the index entries the scheduler
side found: no lease on the way (a stand-in link that records what it is asked, over a real store's
real pool region), every seal checked, a forged block refused, and a block its owner freed while it
was read recomputed, not used. Through real vLLM and a real node agent: test_vllm.py."""

import asyncio
import concurrent.futures

import pytest
import torch
from conftest import LAYOUT, block, key
from paths import KV_DEVICE

from tiercake.blocks import SealKeys, seal_material
from tiercake.tiers import PoolRegion
from tiercake.tiers.pool import PoolIndexReader, PoolPlaces
from tiercake.transfer import TransferResult

pytestmark = pytest.mark.cluster  # importing vLLM's connector base probes the platform in a process

LAYERS = 2
BLOCKS = 16  # vLLM's blocks per layer
MATERIAL = seal_material(b"worker side test seal secret")


class Link:
    """What the worker side uses of ``TiercakeLink`` to load: the pool by its entries, and the lease
    and read paths it must not need here (recorded)."""

    def __init__(self, places: PoolPlaces) -> None:
        self.places = places
        self.leased: list[list[bytes]] = []
        self.touched: list[list[bytes]] = []
        self.written: list[list[bytes]] = []

    def pool_places(self, node, instance, timeout):
        return self.places if instance == self.places.region.instance else None

    def lease(self, node, keys, length, timeout):
        self.leased.append(list(keys))
        return None

    def read(self, node, keys, dsts, timeout):
        return [TransferResult(False, error=RuntimeError("not here")) for _ in keys]

    def touch(self, node, keys, length):
        self.touched.append(list(keys))

    def write(self, node, items, tenant, sealer, timeout):
        self.written.append([k for k, _, _ in items])
        done = concurrent.futures.Future()
        done.set_result([TransferResult(True) for _ in items])
        return done


def worker(link: Link, device: str = "cpu"):
    from tiercake.workers.vllm.metadata import ConnectorSettings
    from tiercake.workers.vllm.worker_side import ConnectorWorker

    names = [f"layer{i}" for i in range(LAYERS)]
    settings = ConnectorSettings(conductor="http://127.0.0.1:1", node="node")
    w = ConnectorWorker(settings, link, SealKeys(MATERIAL), names, BLOCKS)
    half = LAYOUT.nbytes // LAYERS // 2  # float16 elements of one layer's part of a block
    w.register_kv_caches({name: torch.zeros((BLOCKS, half), dtype=torch.float16, device=device) for name in names})
    assert w.block_nbytes == LAYOUT.nbytes
    return w


async def saved(make_store, count: int, forged: int | None = None):
    """A store whose pool holds blocks 1..count, sealed (block ``forged`` with a wrong seal), and the
    pool as the connector maps it: its region, its index's entries for those blocks."""
    store = await make_store(gpu=None, pool=8, ssd=None)
    sealer = SealKeys(MATERIAL).for_salt("")
    keys = [key(i) for i in range(1, count + 1)]
    for i, k in enumerate(keys, 1):
        data = block(i)
        seal = sealer.seal(k, data.view(torch.uint8).numpy())
        await store.put(k, data, tenant="t", seal=bytes(16) if i == forged else seal)
    return store, keys


def mapped(shm_path, keys):
    region = PoolRegion.attach(shm_path)
    reader = PoolIndexReader(region)
    reader.refresh()
    return region, reader.entries("t", keys)


def load(w, keys, entries, instance, first_id: int = 3):
    from tiercake.workers.vllm.metadata import BlockLoad, RequestLoad, TiercakeMetadata

    blocks = [BlockLoad(k, first_id + i, e) for i, (k, e) in enumerate(zip(keys, entries))]
    w.start_load_kv(TiercakeMetadata(loads=[RequestLoad("r", "node", blocks, "", instance)]))
    for i in range(LAYERS):
        w.wait_for_layer_load(f"layer{i}")
    errors = w.get_block_ids_with_load_errors()
    return w.build_connector_worker_meta().loads["r"], errors


def in_kv(w, block_id: int) -> bytes:
    return b"".join(bytes(layer[block_id].cpu().numpy()) for layer in w._layers)


@pytest.mark.parametrize("device", [False, True])
def test_blocks_are_read_by_their_entries_without_a_lease_and_copied_in_whole(shm_path, make_store, device):
    """``device``: through the GPU path's pinned buffer and copies, into KV on ``KV_DEVICE`` (the CPU
    here, which takes the same path; a GPU where tiercake/gpu_check.py runs it)."""
    from tiercake.workers.vllm.loading import LayerwiseLoader

    async def go():
        store, keys = await saved(make_store, 4)
        region, entries = mapped(shm_path, keys)
        link = Link(PoolPlaces(region))
        w = worker(link, KV_DEVICE if device else "cpu")
        if device:
            w._loader.close()
            w._loader = LayerwiseLoader(w._layers, w._fetch, device=True)
        try:
            report, errors = await asyncio.to_thread(load, w, keys, entries, region.instance)
        finally:
            w.close()
        assert errors == set() and report.loaded == 4 and report.unleased == 4
        assert link.leased == [] and link.touched == [keys]  # no lease; the node told of the reads after
        for i in range(4):
            assert in_kv(w, 3 + i) == bytes(block(i + 1).view(torch.uint8).numpy())
        assert w.stats["unleased_blocks"] == 4 and w.stats["moved_blocks"] == 0

    asyncio.run(go())


def test_a_forged_block_read_by_its_entry_is_refused_with_those_after_it(shm_path, make_store):
    async def go():
        store, keys = await saved(make_store, 4, forged=3)
        region, entries = mapped(shm_path, keys)
        w = worker(Link(PoolPlaces(region)))
        try:
            report, errors = await asyncio.to_thread(load, w, keys, entries, region.instance)
        finally:
            w.close()
        assert report.loaded == 2 and errors == {5, 6}  # vLLM recomputes from the forged one
        assert w.stats["refused_blocks"] == 2 and w.stats["moved_blocks"] == 0

    asyncio.run(go())


def test_a_block_freed_while_it_is_read_is_recomputed_not_used(shm_path, make_store):
    """The owner frees block 2 after the connector read its entry: its bytes still pass their seal
    (nothing overwrote them yet), but its entry changed, so neither it nor those after it are used."""

    async def go():
        store, keys = await saved(make_store, 4)
        region, entries = mapped(shm_path, keys)
        loop = asyncio.get_running_loop()

        class FreedMeanwhile(PoolPlaces):
            def read(self, entries, keys, nbytes):
                got = super().read(entries, keys, nbytes)
                asyncio.run_coroutine_threadsafe(store.remove(key(2)), loop).result(10)
                return got

        w = worker(Link(FreedMeanwhile(region)))
        try:
            report, errors = await asyncio.to_thread(load, w, keys, entries, region.instance)
        finally:
            w.close()
        assert report.loaded == 1 and errors == {4, 5, 6}
        assert w.stats["moved_blocks"] == 3 and w.stats["refused_blocks"] == 0

    asyncio.run(go())


def test_entries_that_no_longer_describe_the_blocks_mean_the_lease_path(shm_path, make_store):
    async def go():
        store, keys = await saved(make_store, 3)
        region, entries = mapped(shm_path, keys)
        link = Link(PoolPlaces(region))
        w = worker(link)
        try:  # the entries of another order: each names another key
            report, errors = await asyncio.to_thread(load, w, keys, entries[::-1], region.instance)
            assert link.leased == [keys] and report.unleased == 0
            # a region the worker side does not map (a restarted node agent's): the lease path too
            await asyncio.to_thread(load, w, keys, entries, "another region")
            assert link.leased == [keys, keys]
        finally:
            w.close()

    asyncio.run(go())


def test_no_block_is_saved_in_a_step_whose_load_failed_nor_in_the_next(shm_path, make_store):
    """The pass of a step whose load failed (block 3 forged) computed the blocks after it over KV it
    did not have: saving them would seal wrong KV under their keys, which later loads would trust.
    That step's saves and the next one's (vLLM scheduled it before it knew) are not made; the step
    after saves again."""
    from tiercake.workers.vllm.metadata import BlockSave, TiercakeMetadata

    async def go():
        store, keys = await saved(make_store, 4, forged=3)
        region, entries = mapped(shm_path, keys)
        link = Link(PoolPlaces(region))
        w = worker(link)
        saves = TiercakeMetadata(saves=[BlockSave(key(9), None, 8, "t", ""), BlockSave(key(10), key(9), 9, "t", "")])
        try:
            _, errors = await asyncio.to_thread(load, w, keys, entries, region.instance)
            assert errors == {5, 6}
            await asyncio.to_thread(w.wait_for_save, saves)  # the failed step
            await asyncio.to_thread(w.wait_for_save, saves)  # the next, scheduled meanwhile
            assert link.written == [] and w.stats["unsafe_saves"] == 4
            await asyncio.to_thread(w.wait_for_save, saves)
            assert link.written == [[key(9), key(10)]] and w.stats["saved_blocks"] == 2
        finally:
            w.close()

    asyncio.run(go())
