"""The pool tier across real processes: one writes, another reads the same bytes in place."""

import multiprocessing as mp

import pytest
import torch
from conftest import LAYOUT, block, key

from tiercake.tiers import PoolBackend, PoolRegion
from tiercake.tiers.pool import ExtentAllocator, PoolFormatError


def _reader(path, offset, nbytes, conn):
    region = PoolRegion.attach(path)
    try:
        view = region.view(offset, nbytes)
        conn.send(bytes(view))  # what this process sees at that offset
        region.view(offset + nbytes, 4)[:] = 7  # write an answer in place, next to the block
        conn.send(view.ctypes.data != 0)
    except Exception as exc:  # said, not a parent left waiting on the pipe
        conn.send(exc)
    conn.close()


def _received(conn, timeout: float = 60):
    assert conn.poll(timeout), "the reader process said nothing"
    got = conn.recv()
    if isinstance(got, Exception):
        raise got
    return got


@pytest.mark.cluster
def test_two_processes_share_the_region(shm_path):
    region = PoolRegion.create(shm_path, 1 << 20)
    tier = PoolBackend(region)
    slot = tier.allocate(LAYOUT.nbytes)
    payload = block(3).view(torch.uint8).view(-1)
    tier.view(slot, LAYOUT.nbytes)[:] = payload.numpy()
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing inherited but the path
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(str(shm_path), slot[0], LAYOUT.nbytes, child))
    proc.start()
    seen = _received(parent)
    assert _received(parent) is True
    proc.join(30)
    assert proc.exitcode == 0
    assert seen == bytes(payload.numpy())
    # the other process's in-place write is visible here without any copy or message
    assert region.view(slot[0] + LAYOUT.nbytes, 4).tolist() == [7, 7, 7, 7]
    region.close()
    assert not shm_path.exists()


@pytest.mark.cluster
def test_store_block_read_in_place_by_another_process(shm_path, make_store):
    import asyncio

    async def go():
        store = await make_store(gpu=None, pool=8, ssd=None)
        await store.put(key(5), block(5))
        lease = store.acquire_lease(key(5), ttl=30, tier="pool")
        offset = lease.slot[0]
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_reader, args=(str(shm_path), offset, LAYOUT.nbytes, child))
        proc.start()
        seen = await asyncio.to_thread(_received, parent)
        await asyncio.to_thread(_received, parent)
        proc.join(30)
        await store.release_lease(key(5), lease.id)
        assert seen == bytes(block(5).view(torch.uint8).view(-1).numpy())

    asyncio.run(go())


def test_attach_checks_what_it_maps(tmp_path):
    bogus = tmp_path / "not-a-pool"
    bogus.write_bytes(b"hello" * 100)
    with pytest.raises(PoolFormatError):
        PoolRegion.attach(bogus)
    with pytest.raises(FileNotFoundError):
        PoolRegion.attach(tmp_path / "missing")


def test_file_backed_region_for_cxl_style_paths(tmp_path):
    path = tmp_path / "dax-like-file"
    region = PoolRegion.create(path, 64 << 10, prefault=False)
    region.view(0, 3)[:] = [1, 2, 3]
    other = PoolRegion.attach(path)
    assert other.view(0, 3).tolist() == [1, 2, 3]
    other.close()
    assert path.exists()  # an attacher never removes the region
    region.close()
    with pytest.raises(ValueError, match="closed"):
        region.view(0, 1)


def test_view_bounds_and_bad_sizes(shm_path):
    from tiercake.tiers import PayloadError

    with pytest.raises(ValueError):
        PoolRegion.create(shm_path, 0)
    region = PoolRegion.create(shm_path, 8192)
    with pytest.raises(PayloadError, match="outside"):
        region.view(4096, 8192)
    with pytest.raises(PayloadError, match="outside"):
        region.view(-1, 10)
    tier = PoolBackend(region)
    with pytest.raises(PayloadError, match="cannot hold"):
        tier.allocate(1 << 20)
    region.close()


def test_extent_allocator_first_fit_and_coalescing():
    a = ExtentAllocator(10 * 4096)
    x = a.allocate(4096)
    y = a.allocate(3 * 4096)
    z = a.allocate(4096 + 1)  # rounds up to two pages
    assert (x, y, z) == (0, 4096, 4 * 4096)
    assert a.used_pages == 6
    a.free(y, 3 * 4096)
    assert a.allocate(4 * 4096) == 6 * 4096  # the freed hole is too small for four pages
    a.free(x, 4096)
    a.free(z, 4096 + 1)  # frees both of its pages; merges with x's and y's holes
    assert a.free_extents == 1
    assert a.allocate(6 * 4096) == 0
    assert a.allocate(4096) is None  # full
    a.free(6 * 4096, 4 * 4096)
    with pytest.raises(ValueError, match="double free"):
        a.free(6 * 4096, 4 * 4096)
    with pytest.raises(ValueError, match="double free"):
        a.free(7 * 4096, 4096)  # inside a free extent


def test_one_owner_per_region(shm_path):
    from tiercake.tiers.pool import PoolInUseError

    region = PoolRegion.create(shm_path, 1 << 16)
    with pytest.raises(PoolInUseError):
        PoolRegion.create(shm_path, 1 << 16)
    PoolRegion.attach(shm_path).close()  # attaching is always allowed
    region.close()
    PoolRegion.create(shm_path, 1 << 16).close()  # free once the owner is gone


@pytest.mark.cluster
def test_a_pool_larger_than_its_file_system_is_a_clear_error_not_a_sigbus(tmp_path):
    """On a tmpfs smaller than the pool, an unreserved file is a SIGBUS at the first page touched (a
    node agent died that way, leaving its file and an empty log). The space is reserved at creation:
    a clear error, and no file left behind. Runs in a private mount namespace with a 1 MiB tmpfs."""
    import shutil
    import subprocess
    import sys

    assert shutil.which("unshare"), "util-linux's unshare is needed for this test"
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "create.py"
    script.write_text(
        "import os, sys\n"
        "from tiercake.tiers import PoolRegion\n"
        "try:\n"
        f"    PoolRegion.create('{mnt}/pool', 8 << 20)\n"
        "except OSError as exc:\n"
        f"    print(exc)\n    print('left:', os.listdir('{mnt}'))\n    sys.exit(3)\n"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {script}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)  # not -7 (SIGBUS)
    assert "cannot reserve" in done.stdout and "less free space" in done.stdout and "left: []" in done.stdout


_KILLED_OWNER = """
import asyncio, os, signal, sys
import torch
from tiercake.tiers import PoolRegion, PoolBackend, Tier, TieredStore

async def main(path, n):
    store = await TieredStore([Tier(PoolBackend(PoolRegion.create(path, 4 << 20, adopt=True, index_entries=512), keep=True))]).open()
    for i in range(n):
        await store.put(i.to_bytes(8, "big") * 4, torch.full((5000 + i,), i % 251, dtype=torch.uint8),
                        tenant=f"t{i % 3}", parent=b"p" * 32 if i % 2 else None, seal=bytes([i % 256]) * 16)
    await store.remove((0).to_bytes(8, "big") * 4)  # removed before the kill: gone after it too
    handle = await store.put_start(b"pending-".ljust(32, b"x"), 9000)  # reserved, never committed
    handle.buffer.fill(1)
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.cluster
async def test_a_restarted_owner_adopts_every_committed_block_of_a_killed_one(shm_path, tmp_path):
    """An owner SIGKILLed with blocks committed, one removed and a put half done: the next owner at the
    same path finds exactly the committed blocks (bytes, sizes, tenants, parents, seals), and the
    half-done put's space is free again."""
    import subprocess
    import sys

    from tiercake.tiers import Tier, TieredStore

    n = 300
    script = tmp_path / "owner.py"
    script.write_text(_KILLED_OWNER)
    done = subprocess.run(
        [sys.executable, str(script), str(shm_path), str(n)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9 and "ready" in done.stdout, (done.returncode, done.stderr[-2000:])
    tier = PoolBackend(PoolRegion.create(shm_path, 4 << 20, adopt=True, index_entries=512), keep=True)
    store = await TieredStore([Tier(tier)]).open()
    try:
        assert tier.region.adopted
        keys = {i.to_bytes(8, "big") * 4 for i in range(1, n)}
        assert set(store.keys()) == keys
        for i in range(1, n):
            k = i.to_bytes(8, "big") * 4
            got = await store.get(k)
            assert got.size == 5000 + i and bool((got == i % 251).all())
            entry = store._entries[k]
            assert entry.meta.tenant == f"t{i % 3}" and entry.meta.parent == (b"p" * 32 if i % 2 else None)
            assert store.seal_of(k) == bytes([i % 256]) * 16
        pages = sum(-(-(5000 + i) // 4096) for i in range(1, n))
        assert tier.allocator.used_pages == pages  # the pending put's extent and the removed block's are free
        # and the adopted store keeps working: a new block, a removal, both described for the next owner
        await store.put(b"new".ljust(32, b"n"), torch.ones(100, dtype=torch.uint8))
        await store.remove((1).to_bytes(8, "big") * 4)
    finally:
        await store.close()
    again = PoolBackend(PoolRegion.create(shm_path, 4 << 20, adopt=True, index_entries=512))
    try:
        found = {b.key for b in await again.recover()}
        assert b"new".ljust(32, b"n") in found and (1).to_bytes(8, "big") * 4 not in found and len(found) == n - 1
    finally:
        again.close()


def test_a_region_of_another_size_is_formatted_anew_not_misread(shm_path):
    import asyncio

    async def go():
        region = PoolRegion.create(shm_path, 1 << 20, adopt=True)
        tier = PoolBackend(region, keep=True)
        slot = tier.allocate(4096)
        tier.on_commit(slot, b"k" * 32, None, "", b"")
        tier.close()
        bigger = PoolBackend(PoolRegion.create(shm_path, 2 << 20, adopt=True))
        assert not bigger.region.adopted and await bigger.recover() == []
        bigger.close()

    asyncio.run(go())


def test_an_extent_can_be_reserved_only_where_it_is_free():
    a = ExtentAllocator(16 * 4096)
    assert a.reserve(4 * 4096, 8192) and a.used_pages == 2
    assert not a.reserve(5 * 4096, 4096)  # overlaps the reserved one
    assert not a.reserve(15 * 4096, 8192)  # past the end
    assert not a.reserve(100, 10)  # not page-aligned
    assert a.reserve(0, 4096) and a.allocate(4096) == 4096  # first fit goes around what is taken
    a.free(4 * 4096, 8192)
    assert a.allocate(3 * 4096) == 2 * 4096  # freed space coalesced with its neighbours


def test_a_reader_of_the_pools_index_sees_commits_and_removes_per_tenant(shm_path, make_store):
    """What vLLM's connector reads, in place, to answer a lookup without a round trip: the keys the
    owner's index describes as committed, by tenant, updated by each refresh."""
    import asyncio

    from tiercake.tiers.pool import PoolIndexReader

    async def go():
        store = await make_store(gpu=None, pool=8, ssd=None)
        reader = PoolIndexReader(PoolRegion.attach(shm_path))
        reader.refresh()
        assert reader.leading("t", [key(1)]) == 0
        for i in (1, 2, 3):
            await store.put(key(i), block(i), tenant="t")
        await store.put(key(9), block(9), tenant="u")
        assert reader.leading("t", [key(1), key(2)]) == 0  # until it rereads
        reader.refresh()
        assert reader.leading("t", [key(1), key(2), key(3), key(4)]) == 3
        assert reader.leading("u", [key(1)]) == 0 and reader.leading("u", [key(9)]) == 1  # tenants apart
        await store.remove(key(2))
        reader.refresh()
        assert reader.leading("t", [key(1), key(2), key(3)]) == 1
        for i in range(10, 20):  # the pool holds 8 blocks: the oldest are evicted, their entries reused
            await store.put(key(i), block(i), tenant="t")
        reader.refresh()
        held = {i for i in range(1, 20) if reader.leading("t", [key(i)])}
        assert held == {i for i in range(1, 20) if "pool" in store.where(key(i))}

    asyncio.run(go())


def test_pool_places_read_blocks_by_their_entries_and_tell_when_one_moved(shm_path, make_store):
    """What the connector reads without a lease: a block's place and seal from its index entry, checked
    against the key and size it expects; and, after its copy, whether each entry is still what it read
    (the owner clears an entry before it frees the block's extent)."""
    import asyncio

    from tiercake.tiers.pool import PoolIndexReader, PoolPlaces

    async def go():
        store = await make_store(gpu=None, pool=8, ssd=None)
        keys = [key(i) for i in (1, 2, 3)]
        for i, k in enumerate(keys, 1):
            await store.put(k, block(i), tenant="t", seal=bytes([i]) * 16)
        region = PoolRegion.attach(shm_path)
        reader = PoolIndexReader(region)
        reader.refresh()
        entries = reader.entries("t", keys + [key(4)])
        assert len(entries) == 3 and reader.entries("u", keys) == []
        places = PoolPlaces(region)
        nbytes = block(1).numel() * 2
        snapshot, found = places.read(entries, keys, nbytes)
        assert [seal for _, seal in found] == [bytes([i]) * 16 for i in (1, 2, 3)]
        for i, (offset, _) in enumerate(found, 1):  # the bytes there are the block's
            assert bytes(places.data[offset : offset + nbytes]) == bytes(block(i).view(torch.uint8).numpy())
        assert places.unchanged(entries, snapshot) == 3
        # an entry that names another key, a size not asked for, or no entry at all: read stops there
        assert len(places.read([entries[0], entries[2]], keys[:2], nbytes)[1]) == 1
        assert places.read(entries, keys, nbytes + 1)[1] == []
        assert places.read([len(region.index)], keys[:1], nbytes)[1] == []
        assert places.read([-1], keys[:1], nbytes)[1] == []
        await store.remove(key(2))  # freed by its owner after the read
        assert places.unchanged(entries, snapshot) == 1
        for i in range(10, 20):  # and its entry reused
            await store.put(key(i), block(i), tenant="t")
        assert places.unchanged(entries, snapshot) < 3
        assert len(places.read(entries, keys, nbytes)[1]) < 3

    asyncio.run(go())
