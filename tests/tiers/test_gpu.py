import pytest
import torch

from tiercake.tiers import GpuBlockPool, InvalidStateError, TierFullError
from tiercake.tiers.gpu import default_device


def test_paged_pool_refcounts_and_tables():
    pool = GpuBlockPool(4, (2, 2, 4, 1, 8), torch.float16, "cpu")
    assert pool.num_free == 4 and pool.device.type == "cpu"
    seq = pool.add_sequence("a")
    b0 = pool.append_block("a")
    b1 = pool.append_block("a")
    pool.block(b0).fill_(1.5)
    assert seq == [b0, b1] and pool.num_free == 2
    # a second sequence shares the first block (a cached prefix) and adds its own
    pool.add_sequence("b", [b0])
    pool.append_block("b")
    assert pool.refcount(b0) == 2 and pool.num_free == 1
    pool.free_sequence("a")
    assert pool.refcount(b0) == 1 and pool.num_free == 2  # b0 lives on through "b"
    assert torch.all(pool.block(b0) == 1.5)
    pool.free_sequence("b")
    assert pool.num_free == 4


def test_byte_view_aliases_the_block():
    pool = GpuBlockPool(2, (4,), torch.float32, "cpu")
    b = pool.allocate()
    pool.byte_view(b).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]).view(torch.uint8))
    assert pool.block(b).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert pool.block_nbytes == 16


def test_errors():
    pool = GpuBlockPool(1, (4,), torch.float16, "cpu")
    pool.add_sequence("a")
    pool.append_block("a")
    with pytest.raises(TierFullError):
        pool.allocate()
    with pytest.raises(InvalidStateError):
        pool.add_sequence("a")
    with pytest.raises(InvalidStateError):
        pool.append_block("zzz")
    pool.free_sequence("a")
    with pytest.raises(InvalidStateError):
        pool.decref(0)
    with pytest.raises(InvalidStateError):
        pool.free_sequence("a")
    with pytest.raises(ValueError):
        GpuBlockPool(0, (4,))


def test_default_device_matches_hardware():
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert GpuBlockPool(1, (4,)).device.type == default_device()


async def test_sequence_tables_share_cached_blocks_grow_by_evicting_and_give_everything_back():
    from tiercake.tiers import GpuBackend, SequenceKV, Tier, TieredStore

    pool = GpuBlockPool(4, (8,), torch.uint8, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=8).open()
    kv = SequenceKV(store, block_tokens=2)
    keys = [bytes([i]) * 32 for i in range(4)]
    try:
        first = kv.open(keys)
        assert first.cached == 0 and len(first) == 0
        await kv.grow(first, 5)  # 5 tokens: 3 blocks
        assert len(first) == 3 and kv.num_free == 1
        kv.byte_view(first, 0).fill_(7)
        assert kv.adopt(first, 0, keys[0], None, "t") and kv.adopt(first, 1, keys[1], keys[0], "t")
        assert not kv.adopt(first, 1, keys[1], keys[0], "t")  # already cached: the caller keeps its block
        kv.close(first)
        kv.close(first)  # twice: harmless
        assert kv.num_free == 2 and kv.cached_prefix(keys) == 2  # the two adopted blocks stay cached
        second = kv.open(keys)
        assert second.cached == 2 and torch.all(kv.byte_view(second, 0) == 7)
        await kv.grow(second, 8)  # 4 blocks: the 2 free ones
        third = kv.open(keys)  # shares the same 2 cached blocks: no copy, no new block
        assert third.cached == 2 and kv.num_free == 0
        with pytest.raises(TierFullError):  # every block is held by a running sequence
            await kv.grow(third, 6)
        kv.close(second)
        kv.close(third)
        extra = kv.open([])
        await kv.grow(extra, 8)  # all 4 blocks: the cached ones are evicted to make room
        assert kv.cached_prefix(keys) == 0 and kv.num_free == 0
        kv.close(extra)
        assert kv.num_free == 4 and kv.open_sequences == 0
        with pytest.raises(InvalidStateError, match="not open"):
            kv.byte_view(extra, 0)
    finally:
        await store.close()
