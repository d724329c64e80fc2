"""The tiered store's object semantics, spill and promotion, and its refusals."""

import asyncio
import time

import numpy as np
import pytest
import torch
from conftest import LAYOUT, block, key

from tiercake.policies import AdmitOnNth, LeafFirstLRU
from tiercake.tiers import (
    InvalidStateError,
    ObjectExistsError,
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPinnedError,
    PayloadError,
    PutInProgressError,
    TierFullError,
)


def same(data, i: int) -> bool:
    """Whether ``data`` (the store's bytes: an array, or a tensor) are block ``i``'s."""
    return torch.equal(torch.as_tensor(data).view(torch.float16).view(LAYOUT.shape), block(i))


async def test_put_get_roundtrip_each_tier(make_store):
    store = await make_store()
    for i, tier in enumerate(["gpu", "pool", "ssd"]):
        assert await store.put(key(i), block(i), tier=tier) == tier
        assert store.where(key(i)) == [tier]
    for i in range(3):
        assert same(await store.get(key(i)), i)


async def test_payload_kinds(make_store):
    store = await make_store(gpu=None)
    raw = block(1).numpy().tobytes()
    await store.put(key(1), raw)
    await store.put(key(2), np.frombuffer(raw, dtype=np.uint8))
    await store.put(key(3), bytearray(raw))
    out = bytearray(LAYOUT.nbytes)
    await store.get_into(key(2), out)
    assert bytes(out) == raw and same(await store.get(key(3)), 1)


async def test_two_phase_put(make_store):
    store = await make_store()
    handle = await store.put_start(key(1), LAYOUT.nbytes, tier="pool")
    assert not store.contains(key(1))  # invisible until commit
    with pytest.raises(ObjectNotFoundError):
        await store.get(key(1))
    with pytest.raises(PutInProgressError):
        await store.put_start(key(1), LAYOUT.nbytes)
    handle.write(block(1).view(-1)[: LAYOUT.nbytes // 4], offset=0)
    with pytest.raises(PayloadError, match="written"):
        await store.commit(handle)  # only a quarter written
    handle.write(block(1).view(torch.uint8).view(-1)[LAYOUT.nbytes // 2 :], offset=LAYOUT.nbytes // 2)
    handle.write(
        block(1).view(torch.uint8).view(-1)[LAYOUT.nbytes // 4 : LAYOUT.nbytes // 2], offset=LAYOUT.nbytes // 4
    )
    await store.commit(handle)
    assert same(await store.get(key(1)), 1)
    with pytest.raises(InvalidStateError):
        await store.commit(handle)  # double commit
    with pytest.raises(InvalidStateError):
        handle.write(b"x")
    with pytest.raises(ObjectExistsError):
        await store.put(key(1), block(2))  # immutable
    assert same(await store.get(key(1)), 1)


async def test_revoke_frees_space_and_the_key(make_store):
    store = await make_store(gpu=None, ssd=None, pool=2)
    pool = store.tier("pool").backend
    handle = await store.put_start(key(1), LAYOUT.nbytes)
    assert pool.used_bytes == LAYOUT.nbytes
    await store.revoke(handle)
    await store.revoke(handle)  # revoking twice is a no-op
    assert pool.used_bytes == 0 and not store.contains(key(1))
    with pytest.raises(InvalidStateError):
        handle.write(block(1))  # put after revoke
    with pytest.raises(InvalidStateError):
        await store.commit(handle)
    await store.put(key(1), block(5))  # the key is free again
    assert same(await store.get(key(1)), 5)


async def test_two_phase_put_into_ssd(make_store):
    store = await make_store()
    handle = await store.put_start(key(9), LAYOUT.nbytes, tier="ssd")
    handle.write(block(9))
    await store.commit(handle)
    assert store.where(key(9)) == ["ssd"]
    assert same(await store.get(key(9)), 9)


async def test_bad_input(make_store):
    store = await make_store()
    with pytest.raises(PayloadError, match="bytes"):
        await store.put(key(1), torch.zeros(10, dtype=torch.float16))
    with pytest.raises(PayloadError, match="dtype"):
        await store.put(key(1), block(1).to(torch.bfloat16))
    with pytest.raises(PayloadError, match="empty"):
        await store.put(key(1), b"")
    with pytest.raises(TypeError):
        await store.put("a string key", block(1))
    with pytest.raises(ValueError):
        await store.put(b"", block(1))
    with pytest.raises(ValueError):
        await store.put(b"x" * 65, block(1))
    with pytest.raises(KeyError, match="no tier named"):
        await store.put(key(1), block(1), tier="nvme")
    with pytest.raises(ObjectNotFoundError):
        await store.get(key(42))
    with pytest.raises(ObjectNotFoundError):
        await store.remove(key(42))
    with pytest.raises(TypeError, match="not a memory tier"):  # a slot on disk is not adopted
        store.adopt(key(3), "ssd", 0, block(3).numel())
    await store.put(key(1), block(1))
    with pytest.raises(PayloadError, match="destination"):
        await store.get_into(key(1), bytearray(10))
    with pytest.raises(PayloadError, match="contiguous"):
        await store.put(key(2), block(2).transpose(0, 1))
    assert not store.contains(key(2))


async def test_gpu_tier_takes_exact_blocks_only(make_store):
    store = await make_store(gpu=4, pool=None, ssd=None)
    store.payload_nbytes = None  # a generic store: the gpu tier itself must refuse
    with pytest.raises(PayloadError, match="cannot hold"):
        await store.put(key(1), b"x" * 100, tier="gpu")


async def test_spill_down_instead_of_drop(make_store):
    store = await make_store(gpu=2, pool=2, ssd=64)
    for i in range(10):
        await store.put(key(i), block(i))
    await store.drain()
    assert all(store.contains(key(i)) for i in range(10))  # nothing lost: spilled down to ssd
    assert store.tier("ssd").stats.spills_in > 0 and store.tier("pool").stats.spills_in > 0
    assert store.where(key(9)) == ["gpu"]
    assert store.where(key(0)) == ["ssd"]
    for i in range(10):
        assert same(await store.get(key(i)), i)


async def test_drop_only_from_last_tier(make_store):
    store = await make_store(gpu=None, pool=2, ssd=3)
    for i in range(8):
        await store.put(key(i), block(i))
    await store.drain()
    held = [i for i in range(8) if store.contains(key(i))]
    assert len(held) <= 5 and held[-1] == 7
    assert store.tier("ssd").stats.drops > 0 and store.tier("pool").stats.drops == 0


async def test_promotion_on_hit_and_inclusive_copies(make_store):
    store = await make_store(gpu=None, pool=4, ssd=16)
    await store.put(key(1), block(1), tier="ssd")
    assert await store.get_into(key(1), torch.empty(LAYOUT.nbytes, dtype=torch.uint8)) == "ssd"
    assert store.where(key(1)) == ["pool", "ssd"]  # promoted, and the disk copy is kept
    assert await store.get_into(key(1), torch.empty(LAYOUT.nbytes, dtype=torch.uint8)) == "pool"
    assert store.tier("pool").stats.promotions_in == 1
    # evicting the pool copy again needs no write: the ssd copy is still there
    writes_before = store.tier("ssd").stats.spills_in
    for i in range(2, 8):
        await store.put(key(i), block(i), tier="pool")
    await store.drain()
    assert "pool" not in store.where(key(1)) and store.where(key(1)) == ["ssd"]
    assert store.tier("ssd").stats.spills_in > writes_before  # others spilled, key 1 did not rewrite
    assert same(await store.get(key(1)), 1)


async def test_a_promotion_never_costs_another_blocks_last_copy(make_store):
    """A read from the SSD promotes its block into the pool only at no block's cost: with the pool full
    of blocks that have no copy below and the SSD full too (nowhere to spill them), the read is served
    from the SSD and nothing is dropped (a read of a persisted object on a full SSD once evicted, and
    lost, memory-level objects); once the pool has a block with a copy below, that one makes room."""
    store = await make_store(gpu=None, pool=4, ssd=4)
    for tier in store.tiers:
        tier.high_watermark = 1.0  # no background round: the tiers stay full
    for i in range(4):
        await store.put(key(10 + i), block(10 + i), tier="ssd")
    for i in range(4):
        await store.put(key(i), block(i), tier="pool")
    await store.drain()
    assert [len(store.keys(t)) for t in ("pool", "ssd")] == [4, 4]
    out = torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
    assert await store.get_into(key(10), out) == "ssd" and same(out, 10)
    assert sorted(store.keys()) == sorted(key(i) for i in (0, 1, 2, 3, 10, 11, 12, 13))  # none dropped
    assert store.tier("pool").stats.drops == 0 and "pool" not in store.where(key(10))


async def test_admission_gates_promotion(make_store):
    store = await make_store(gpu=None, pool=4, ssd=16, admission={"pool": AdmitOnNth(n=3)})
    await store.put(key(1), block(1), tier="ssd")
    out = torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
    assert await store.get_into(key(1), out) == "ssd"
    assert await store.get_into(key(1), out) == "ssd"
    assert store.tier("pool").stats.admission_refusals == 2
    assert await store.get_into(key(1), out) == "ssd"  # the third offer is admitted
    assert await store.get_into(key(1), out) == "pool"


async def test_admission_refusal_passes_put_down(make_store):
    store = await make_store(gpu=None, pool=4, ssd=16, admission={"pool": AdmitOnNth(n=2)})
    assert await store.put(key(1), block(1)) == "ssd"


async def test_full_tier_with_everything_pinned_fails_at_once(make_store):
    store = await make_store(gpu=None, pool=3, ssd=None)
    for i in range(2):
        await store.put(key(i), block(i))
        store.pin(key(i), hard=True)
    await store.put(key(2), block(2))
    store.pin(key(2), hard=True)
    with pytest.raises(TierFullError, match="nothing in it may be evicted"):
        await asyncio.wait_for(store.put(key(3), block(3)), timeout=5)
    assert not store.contains(key(3))
    assert store.tier("pool").stats.full_refusals >= 1
    # a failed put leaves no trace: the key can be put once there is room
    store.unpin(key(0))
    await store.put(key(3), block(3))
    assert store.contains(key(3)) and not store.contains(key(0))


async def test_full_tier_with_everything_leased_fails_at_once(make_store):
    store = await make_store(gpu=None, pool=2, ssd=None, lease_ttl=30)
    store.tier("pool").high_watermark = 1.0  # no background round: the put itself must find room
    await store.put(key(0), block(0))
    await store.put(key(1), block(1))
    await store.drain()
    async with store.read(key(0)):
        async with store.read(key(1)) as view1:
            with pytest.raises(TierFullError):
                await asyncio.wait_for(store.put(key(2), block(2)), timeout=5)
            assert same(np.array(view1.data, copy=True), 1)
    await store.put(key(2), block(2))


async def test_leases_block_removal_and_eviction(make_store):
    store = await make_store(gpu=None, pool=2, ssd=None)
    await store.put(key(0), block(0))
    async with store.read(key(0)) as view:
        assert view.tier == "pool"
        with pytest.raises(ObjectLeasedError):
            await store.remove(key(0))
        await store.put(key(1), block(1))
        await store.put(key(2), block(2))  # evicts key 1, not the leased key 0
        await store.drain()
        assert store.contains(key(0))
        assert same(view.data, 0)  # read in place, intact
    await store.remove(key(0))
    assert not store.contains(key(0))


async def test_remote_lease_expires(make_store):
    store = await make_store(gpu=None, pool=2, ssd=None)
    await store.put(key(0), block(0))
    lease = store.acquire_lease(key(0), ttl=0.05)
    assert lease.tier == "pool" and same(lease.data, 0)
    with pytest.raises(ObjectLeasedError):
        await store.remove(key(0))
    await asyncio.sleep(0.1)  # the reader died: its lease runs out
    await store.remove(key(0))
    await store.put(key(1), block(1))
    lease = store.acquire_lease(key(1), ttl=30)
    await store.release_lease(key(1), lease.id)
    await store.remove(key(1))


async def test_hard_pin_never_evicted_soft_pin_last(make_store):
    store = await make_store(gpu=None, pool=4, ssd=None)
    store.tier("pool").high_watermark = 1.0  # evict on demand only, so the order is exact
    for i in range(4):
        await store.put(key(i), block(i))
    held = [0, 1]
    store.pin(key(held[0]), hard=True)
    store.pin(key(held[1]), ttl=60)
    for i in range(10, 20):
        await store.put(key(i), block(i))
    await store.drain()
    assert store.contains(key(held[0]))  # hard pin: never evicted
    assert store.contains(key(held[1]))  # soft pin: outlived ten newer blocks
    with pytest.raises(ObjectPinnedError):
        await store.remove(key(held[0]))
    # when only pinned blocks are left, the soft-pinned one goes before a put fails
    store.pin(key(19), hard=True)
    store.pin(key(18), hard=True)
    await store.put(key(30), block(30))
    await store.drain()
    assert not store.contains(key(held[1])) and store.contains(key(held[0]))


async def test_soft_pin_expires(make_store):
    store = await make_store(gpu=None, pool=2, ssd=None)
    await store.put(key(0), block(0))
    store.pin(key(0), ttl=0.01)
    await asyncio.sleep(0.05)
    await store.put(key(1), block(1))
    await store.put(key(2), block(2))
    await store.drain()
    assert not store.contains(key(0))  # expired: evicted in plain LRU order


async def test_high_watermark_round(make_store):
    store = await make_store(gpu=None, pool=40, ssd=200)
    pool = store.tier("pool")
    for i in range(36):  # exactly 90%: no round yet
        await store.put(key(i), block(i))
    await store.drain()
    assert pool.stats.evictions == 0
    await store.put(key(36), block(36))  # past 90%
    await store.drain()
    assert pool.usage <= 0.85 + 1e-9
    assert pool.stats.evictions == 37 - 34
    assert all(store.contains(key(i)) for i in range(37))  # spilled, not lost


async def test_remove_everywhere(make_store):
    store = await make_store()
    await store.put(key(1), block(1), tier="ssd")
    await store.get(key(1))  # promoted: now in pool and ssd
    assert len(store.where(key(1))) == 2
    used = {t.name: t.backend.used_bytes for t in store.tiers}
    await store.remove(key(1))
    assert store.where(key(1)) == []
    assert store.tier("pool").backend.used_bytes < used["pool"]
    assert store.tier("ssd").backend.used_bytes < used["ssd"]
    assert not list((store.tier("ssd").backend.blocks_dir).rglob("*.blk"))


async def test_block_shared_with_a_sequence_is_not_evicted(make_store):
    store = await make_store(gpu=2, pool=8, ssd=None)
    await store.put(key(0), block(0))
    gpu = store.tier("gpu").backend
    slot = store._entries[key(0)].copies[0].slot
    gpu.pool.add_sequence("req-1", [slot])  # a running sequence uses the cached block
    for i in range(1, 6):
        await store.put(key(i), block(i))
    await store.drain()
    assert "gpu" in store.where(key(0))
    gpu.pool.free_sequence("req-1")
    for i in range(6, 9):
        await store.put(key(i), block(i))
    await store.drain()
    assert "gpu" not in store.where(key(0))


async def test_leaf_first_in_the_store_keeps_prefixes_whole(make_store):
    store = await make_store(gpu=None, pool=6, ssd=None, policies={"pool": LeafFirstLRU()})
    chain = [key(i) for i in range(4)]
    for i, k in enumerate(chain):
        await store.put(k, block(i), parent=chain[i - 1] if i else None)
    for i in range(10, 13):
        await store.put(key(i), block(i))
    await store.drain()
    # whatever was evicted, what is held of the chain is a prefix of it
    held = [store.contains(k) for k in chain]
    assert held == sorted(held, reverse=True)
    assert store.prefix_length(chain) == sum(held)


async def test_concurrent_readers_and_writers(make_store):
    """Many tasks put, get and remove at once over a small store: every read is whole and right."""
    # inline_copy_max=0: every memory copy runs in a thread, so tasks interleave at every copy
    store = await make_store(gpu=4, pool=6, ssd=40, inline_copy_max=0)
    errors = []

    async def writer(base):
        for i in range(base, base + 15):
            try:
                await store.put(key(i), block(i))
            except TierFullError:
                pass

    async def reader(base):
        for _ in range(3):
            for i in range(base, base + 15):
                try:
                    data = await store.get(key(i))
                except ObjectNotFoundError:
                    continue
                if not same(data, i):
                    errors.append(i)

    async def leaser(base):
        for i in range(base, base + 15):
            try:
                async with store.read(key(i)) as view:
                    snapshot = np.array(view.data, copy=True)  # the gpu tier's is a tensor, the pool's an array
                    await asyncio.sleep(0)
                    if not np.array_equal(snapshot, np.asarray(view.data)) or not same(snapshot, i):
                        errors.append(("torn", i))
            except ObjectNotFoundError:
                continue

    async def remover(base):
        for i in range(base, base + 15, 3):
            try:
                await store.remove(key(i))
            except (ObjectNotFoundError, ObjectLeasedError, PutInProgressError):
                pass

    tasks = []
    for b in range(0, 60, 15):
        tasks += [writer(b), reader(b), leaser(b), remover(b), reader(b)]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    await store.drain()
    assert errors == []
    # accounting is consistent: every tier's used bytes match the copies the store believes it has
    for tier in store.tiers:
        copies = sum(1 for e in store._entries.values() if tier.index in e.copies)
        assert len(tier.eviction) == copies
        if tier.name == "pool":
            assert tier.backend.used_bytes == copies * LAYOUT.nbytes
        if tier.name == "gpu":
            assert tier.backend.used_bytes == copies * LAYOUT.nbytes
    store.promote_on_hit = False  # a promotion could evict (drop) a key this loop has yet to read
    for k in store.keys():
        i = int.from_bytes(k[:8], "big")
        assert same(await store.get(k), i)


async def test_batches_report_per_item(make_store):
    store = await make_store(gpu=None, pool=4, ssd=40)
    items = [(key(i), block(i)) for i in range(12)]
    items.append((key(99), torch.zeros(3, dtype=torch.float16)))  # wrong size: refused alone
    done = await store.put_many(items, chain=True)
    assert all(isinstance(d, str) for d in done[:12]) and isinstance(done[12], PayloadError)
    await store.drain()
    assert store._entries[key(5)].meta.parent == key(4)
    outs = [torch.empty(LAYOUT.nbytes, dtype=torch.uint8) for _ in range(13)]
    got = await store.get_many([(key(i), outs[i]) for i in range(12)] + [(key(77), outs[12])])
    assert isinstance(got[12], ObjectNotFoundError)
    assert {g for g in got[:12]} <= {"pool", "ssd"}
    assert all(same(outs[i], i) for i in range(12))


async def test_reader_arriving_during_a_spill_keeps_the_copy_until_done(make_store):
    """A spill to disk takes time; a reader that leases the copy meanwhile must never see it freed."""
    store = await make_store(gpu=None, pool=2, ssd=16)
    pool = store.tier("pool")
    pool.high_watermark = 1.0
    ssd = store.tier("ssd").backend
    gate = asyncio.Event()
    original_persist = ssd.persist

    async def slow_persist(*args, **kwargs):
        await gate.wait()  # the spill is in flight until the test opens the gate
        return await original_persist(*args, **kwargs)

    ssd.persist = slow_persist
    await store.put(key(0), block(0))
    await store.put(key(1), block(1))
    put = asyncio.create_task(store.put(key(2), block(2)))  # must evict key 0 (LRU) to the ssd
    for _ in range(100):
        await asyncio.sleep(0)
        if store._entries[key(0)].copies[pool.index].evicting:
            break
    assert store._entries[key(0)].copies[pool.index].evicting
    async with store.read(key(0)) as view:  # a reader arrives during the spill
        gate.set()
        await put  # the spill finishes and the new block is placed...
        assert store.where(key(0)) == ["ssd"] and store.where(key(2)) == ["pool"]
        # ...but the leased pool copy was not freed under the reader: key 1 had to go instead
        assert same(view.data, 0)
        assert store.where(key(1)) == ["ssd"]
        assert pool.backend.used_bytes == 2 * LAYOUT.nbytes
    assert pool.backend.used_bytes == 1 * LAYOUT.nbytes  # freed when the lease ended
    assert same(await store.get(key(0)), 0)


async def test_copy_evicted_under_a_remote_lease_is_freed_when_the_lease_ends(make_store):
    store = await make_store(gpu=None, pool=2, ssd=16)
    pool = store.tier("pool")
    pool.high_watermark = 1.0
    await store.put(key(0), block(0))
    lease = store.acquire_lease(key(0), ttl=30)
    await store._demote(pool, key(0))  # evicted (spilled to ssd) while a remote reader holds it
    assert store.where(key(0)) == ["ssd"]
    assert pool.backend.used_bytes == LAYOUT.nbytes  # the leased copy is still there for the reader
    assert same(lease.data, 0)
    await store.release_lease(key(0), lease.id)
    assert pool.backend.used_bytes == 0


async def test_expired_remote_leases_are_swept_and_their_copies_freed(make_store):
    store = await make_store(gpu=None, pool=2, ssd=16)
    pool = store.tier("pool")
    await store.put(key(0), block(0))
    store.acquire_lease(key(0), ttl=30)  # a reader that dies without releasing
    await store._demote(pool, key(0))
    assert pool.backend.used_bytes == LAYOUT.nbytes  # held for it: not freed with its copy's demotion
    store._sweep_leases()
    assert pool.backend.used_bytes == LAYOUT.nbytes  # not expired yet
    store._sweep_leases(now=time.monotonic() + 31)  # its TTL has passed (no wall-clock wait: a busy
    # machine once let a 10 ms lease run out before the demotion looked at it)
    for _ in range(10):
        await asyncio.sleep(0)
    assert pool.backend.used_bytes == 0 and not store._leases


async def test_listeners_see_every_copy_come_and_go_with_its_tenant(make_store, tmp_path):
    store = await make_store(gpu=2, pool=None, ssd=8, ssd_dir=tmp_path / "d")
    seen = []
    store.listeners.append(lambda c: seen.append((c.key, c.tier, c.tenant, c.added)))
    for i in range(3):
        await store.put(key(i), block(i), tenant="acme")
    # the third put pushed the least recent block down to ssd: it left gpu and arrived on ssd
    assert (key(0), "ssd", "acme", True) in seen and (key(0), "gpu", "acme", False) in seen
    await store.remove(key(2))
    assert seen[-1] == (key(2), "gpu", "acme", False)
    await store.drain()
    for tier in store.tiers:
        tier.backend.close()
    store._closed = True
    # after a restart the ssd tier still knows each block's tenant
    reopened = await make_store(gpu=None, pool=None, ssd=8, ssd_dir=tmp_path / "d")
    held = {(c.key, c.tier, c.tenant) for c in reopened.holdings()}
    assert held == {(key(0), "ssd", "acme")}  # key(1) was only ever on the gpu tier


async def test_switch_eviction_policy_at_run_time_keeps_recency(make_store):
    from tiercake.policies import FIFO

    store = await make_store(gpu=None, pool=4, ssd=None)
    for i in range(4):
        await store.put(key(i), block(i))
    await store.get(key(0))  # most recent now: LRU order is 1, 2, 3, 0
    store.set_eviction("pool", FIFO())
    assert store.stats()["tiers"]["pool"]["eviction"] == {"policy": "fifo", "resident": 4}
    await store.put(key(9), block(9))  # the pool is full: the carried-over order decides the victim
    await store.drain()
    assert not store.contains(key(1)) and store.contains(key(0))


async def test_flush_removes_all_but_pinned_and_leased(make_store):
    store = await make_store(gpu=None, pool=8, ssd=None)
    for i in range(5):
        await store.put(key(i), block(i))
    store.pin(key(0), hard=True)
    lease = store.acquire_lease(key(1))
    assert await store.flush() == 3
    assert store.contains(key(0)) and store.contains(key(1)) and not store.contains(key(2))
    await store.release_lease(key(1), lease.id)


async def test_flushing_one_tier_pushes_its_blocks_down(make_store):
    store = await make_store(gpu=None, pool=8, ssd=16)
    for i in range(3):
        await store.put(key(i), block(i))
    assert await store.flush(tiers=["pool"]) == 3
    assert all(store.where(key(i)) == ["ssd"] for i in range(3))
    assert same(await store.get(key(1)), 1)  # still whole, now from ssd


async def test_residency_of_evicted_copies_is_counted_per_tier(make_store):
    from tiercake.messages import RESIDENCY_BUCKETS

    store = await make_store(gpu=None, pool=2, ssd=8)
    for i in range(4):
        await store.put(key(i), block(i))
    await store.drain()
    pool = store.stats()["tiers"]["pool"]
    assert len(pool["residency"]) == len(RESIDENCY_BUCKETS) + 1
    assert sum(pool["residency"]) == pool["evictions"] >= 2 and pool["residency"][0] == pool["evictions"]


async def test_a_tenant_over_its_quota_evicts_its_own_blocks_not_anothers(make_store, tmp_path):
    """pool: 8 blocks, each tenant at most 4. bob caches 4; alice then writes 10: she keeps her newest
    4 in the pool (the rest go down to the SSD) and bob's 4 stay. Without the quota her writes evict
    bob's (LRU), which is how one tenant empties the cache of the others."""
    from tiercake.tiers import PoolBackend, Tier

    for quota, bob_kept in ((4 * LAYOUT.nbytes, 4), (None, 0)):
        store = await make_store(gpu=None, pool=8, ssd=64, ssd_dir=tmp_path / f"ssd-{quota}")
        pool: Tier = store.tier("pool")
        pool.tenant_quota_bytes = quota
        pool.high_watermark = 1.0  # only room-making evicts here, not the background watermark round
        assert isinstance(pool.backend, PoolBackend)
        for i in range(4):
            await store.put(key(100 + i), block(100 + i), tenant="bob", tier="pool")
        for i in range(10):
            await store.put(key(i), block(i), tenant="alice", tier="pool")
        bob_in_pool = sum("pool" in store.where(key(100 + i)) for i in range(4))
        alice_in_pool = sum("pool" in store.where(key(i)) for i in range(10))
        assert bob_in_pool == bob_kept, (quota, bob_in_pool)
        if quota is not None:
            assert alice_in_pool == 4 and pool.tenant_bytes["alice"] == 4 * LAYOUT.nbytes
            assert all("pool" in store.where(key(i)) for i in range(6, 10))  # her newest, by the pool's LRU
        assert all(store.where(key(i)) for i in range(10))  # nothing lost: what left the pool is on the SSD
        assert same(await store.get(key(0)), 0)
        await store.close()
