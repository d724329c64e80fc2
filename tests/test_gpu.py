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
