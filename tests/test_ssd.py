"""The ssd tier: persistence across restarts, checksums, compression, and disk faults."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import LAYOUT, block, key

from tiercake.tiers import DiskFullError, ObjectNotFoundError, SsdTier, Tier, TieredStore, TierFullError
from tiercake.tiers.ssd import HEADER_SIZE, SsdLockedError, shuffle16, unshuffle16


def same(data, i):
    return torch.equal(data.view(torch.float16).view(LAYOUT.shape), block(i))


async def ssd_store(path, capacity_blocks=64, payload_nbytes=LAYOUT.nbytes, **kw) -> TieredStore:
    backend = SsdTier(path, capacity_bytes=capacity_blocks * (payload_nbytes + HEADER_SIZE), **kw)
    return await TieredStore([Tier(backend)], payload_nbytes=payload_nbytes).open()


async def test_restart_keeps_every_block(tmp_path):
    store = await ssd_store(tmp_path)
    for i in range(20):
        await store.put(key(i), block(i), parent=key(i - 1) if i else None)
    used = store.tier("ssd").backend.used_bytes
    await store.close()

    store = await ssd_store(tmp_path)
    assert sorted(store.keys()) == sorted(key(i) for i in range(20))
    assert store.tier("ssd").backend.used_bytes == used
    assert store._entries[key(5)].meta.parent == key(4)  # the chain survives too
    for i in range(20):
        assert same(await store.get(key(i)), i)
    await store.close()


async def test_a_blocks_seal_survives_a_restart_and_blocks_from_before_seals_still_read(tmp_path):
    import xxhash

    from tiercake.tiers import ssd

    store = await ssd_store(tmp_path)
    await store.put(key(1), block(1), seal=b"s" * 16)
    await store.put(key(2), block(2), seal=b"t" * 16)
    await store.close()
    # rewrite key(2)'s header as version 2 wrote it (no seal): an upgrade must not drop such blocks
    (path,) = [f for f in tmp_path.rglob("*.blk") if f.name.startswith(key(2).hex())]
    raw = bytearray(path.read_bytes())
    fields = list(ssd._HEAD.unpack_from(raw))
    fields[1] = 2
    old = ssd._HEAD_V2.pack(*fields[:14])
    raw[:HEADER_SIZE] = bytes(HEADER_SIZE)
    raw[:len(old)] = old
    raw[len(old):len(old) + 8] = ssd._HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(old))
    path.write_bytes(bytes(raw))
    store = await ssd_store(tmp_path)
    assert store.seal_of(key(1)) == b"s" * 16 and store.seal_of(key(2)) == b""
    assert same(await store.get(key(2)), 2) and store.tier("ssd").backend.corrupt_dropped == 0
    await store.close()


async def test_second_owner_is_refused(tmp_path):
    store = await ssd_store(tmp_path)
    with pytest.raises(SsdLockedError):
        SsdTier(tmp_path)
    await store.close()
    SsdTier(tmp_path).close()  # free again once the owner closed


BIG = 256 << 10  # zstd needs more than a few KiB to find the byte-plane structure


def smooth_kv() -> torch.Tensor:
    """fp16 values of one scale with noisy mantissas, as KV looks (the bench uses a real model's)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(BIG // 2, generator=g) * 0.05).to(torch.float16)


async def stored_size(path, shuffle: bool) -> tuple[int, int]:
    store = await ssd_store(path, payload_nbytes=BIG, compression=True, shuffle=shuffle)
    await store.put(key(1), smooth_kv())
    await store.put(key(2), torch.randint(0, 256, (BIG,), dtype=torch.uint8))  # incompressible
    sizes = (store._entries[key(1)].copies[0].slot.stored, store._entries[key(2)].copies[0].slot.stored)
    assert torch.equal((await store.get(key(1))).view(torch.float16), smooth_kv())
    await store.close()
    return sizes


async def test_compression_and_the_byte_shuffle(tmp_path):
    plain, random_plain = await stored_size(tmp_path / "plain", shuffle=False)
    shuffled, random_shuffled = await stored_size(tmp_path / "shuffled", shuffle=True)
    assert random_plain == random_shuffled == BIG  # did not shrink: stored raw
    assert shuffled < 0.95 * plain < BIG  # the shuffle pays on fp16
    # reading needs no setting: the flags are in each file
    store = await ssd_store(tmp_path / "shuffled", payload_nbytes=BIG, compression=False)
    assert torch.equal((await store.get(key(1))).view(torch.float16), smooth_kv())
    await store.close()


def test_shuffle_inverse():
    import numpy as np

    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    planes = shuffle16(data)
    assert planes[:500].tolist() == (np.arange(1000) & 0xFF).astype(np.uint8).tolist()[:500]
    out = np.empty_like(data)
    unshuffle16(planes, out)
    assert np.array_equal(out, data)


def _files(path: Path) -> list[Path]:
    return sorted((path / "blocks").rglob("*.blk"))


async def test_corrupt_payload_is_a_miss_never_data(tmp_path):
    store = await ssd_store(tmp_path)
    await store.put(key(1), block(1))
    await store.put(key(2), block(2))
    path = store._entries[key(1)].copies[0].slot.path
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ObjectNotFoundError):
        await store.get(key(1))
    assert not path.exists()  # dropped
    assert store.tier("ssd").stats.corrupt == 1 and store.misses == 1
    assert not store.contains(key(1))
    assert same(await store.get(key(2)), 2)
    await store.close()


async def test_corrupt_and_truncated_files_dropped_at_restart(tmp_path):
    store = await ssd_store(tmp_path)
    for i in range(4):
        await store.put(key(i), block(i))
    paths = {i: store._entries[key(i)].copies[0].slot.path for i in range(4)}
    await store.close()
    with open(paths[0], "r+b") as f:  # truncated mid-payload
        f.truncate(HEADER_SIZE + 10)
    with open(paths[1], "r+b") as f:  # header damaged
        f.seek(20)
        f.write(b"\x00\x01\x02")
    paths[2].write_bytes(b"")  # empty
    (paths[3].parent / (paths[3].name + ".tmp-999-1")).write_bytes(b"half a block")
    store = await ssd_store(tmp_path)
    assert store.keys() == [key(3)]
    assert store.tier("ssd").backend.corrupt_dropped == 3
    assert [p.name for p in _files(tmp_path)] == [paths[3].name]
    assert not list((tmp_path / "blocks").rglob("*.tmp-*"))
    assert same(await store.get(key(3)), 3)
    await store.close()


async def test_truncated_while_running_is_a_miss(tmp_path):
    store = await ssd_store(tmp_path)
    await store.put(key(1), block(1))
    path = store._entries[key(1)].copies[0].slot.path
    os.truncate(path, HEADER_SIZE + 1000)
    with pytest.raises(ObjectNotFoundError):
        await store.get(key(1))
    await store.close()


async def test_io_runs_off_the_event_loop(tmp_path):
    store = await ssd_store(tmp_path)
    backend = store.tier("ssd").backend
    seen = []
    write, read = backend._write_file, backend._read_file
    backend._write_file = lambda *a: (seen.append(threading.current_thread().name), write(*a))[1]
    backend._read_file = lambda *a: (seen.append(threading.current_thread().name), read(*a))[1]
    await store.put(key(1), block(1))
    await store.get(key(1))
    assert len(seen) == 2 and all(name.startswith("tiercake-ssd") for name in seen)
    await store.close()


async def test_capacity_limit_drops_oldest_and_refuses_when_all_pinned(tmp_path):
    store = await ssd_store(tmp_path, capacity_blocks=4)
    store.tier("ssd").high_watermark = 1.0
    for i in range(6):
        await store.put(key(i), block(i))
    assert [store.contains(key(i)) for i in range(6)] == [False, False, True, True, True, True]
    assert len(_files(tmp_path)) == 4
    for i in range(2, 6):
        store.pin(key(i), hard=True)
    with pytest.raises(TierFullError):
        await store.put(key(9), block(9))
    assert not store.contains(key(9)) and len(_files(tmp_path)) == 4
    await store.close()


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 256 KiB file system (tmpfs), to fill up for real."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_full_disk_is_a_clear_error(tiny_fs):
    # the tier believes it has 1 MiB, the file system has 256 KiB: the disk fills first
    backend = SsdTier(tiny_fs / "ssd", capacity_bytes=1 << 20)
    store = await TieredStore([Tier(backend, high_watermark=1.0)], payload_nbytes=LAYOUT.nbytes).open()
    stored = 0
    with pytest.raises(DiskFullError, match="No space left"):
        for i in range(100):
            await store.put(key(i), block(i))
            stored += 1
    assert 20 < stored < 64  # 256 KiB of 4.5 KiB files, less the file system's own rounding
    assert not store.contains(key(stored))  # the failed put left nothing behind
    assert not list((tiny_fs / "ssd" / "blocks").rglob("*.tmp-*"))
    for i in range(stored):
        assert same(await store.get(key(i)), i)
    await store.remove(key(0))
    await store.put(key(stored), block(stored))  # room again
    await store.close()


async def test_a_full_disk_under_spills_logs_a_line_now_and_then_not_one_per_spill(tiny_fs, make_store, caplog):
    """Blocks keep spilling from the pool to an SSD tier whose file system is full: every spill
    fails (the blocks are dropped, as a spill that cannot land is), but the log gets one line with a
    count, not one line per spill (13,337 a minute were seen)."""
    store = await make_store(gpu=None, pool=4, ssd=256, ssd_dir=tiny_fs / "ssd")
    with caplog.at_level("WARNING", logger="tiercake.tiers.store"):
        for i in range(200):  # ~50 fit on the 256 KiB file system; the rest spill into a full disk
            await store.put(key(i), block(i))
    spills = [r for r in caplog.records if "spill of" in r.getMessage()]
    assert store.tiers[1].backend.used_bytes > 0  # the disk took what fitted
    assert len(spills) == 1, [r.getMessage() for r in spills]
    assert "No space left" in spills[0].getMessage()
    await store.close()


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, sys, torch
    from tiercake.tiers import SsdTier, Tier, TieredStore

    async def main():
        store = await TieredStore([Tier(SsdTier(sys.argv[1], capacity_bytes=1 << 34))]).open()
        i = 0
        while True:
            g = torch.Generator().manual_seed(i)
            data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g)
            await store.put(i.to_bytes(8, "big"), data)
            print(i, flush=True)
            i += 1

    asyncio.run(main())
    """
)


async def test_process_killed_mid_write_never_serves_half_a_block(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_WRITER, str(tmp_path), stdout=asyncio.subprocess.PIPE
    )
    written = []
    deadline = time.monotonic() + 60
    while len(written) < 5 and time.monotonic() < deadline:
        written.append(int(await asyncio.wait_for(proc.stdout.readline(), 30)))
    await asyncio.sleep(0.013)  # land somewhere inside a write
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    store = await TieredStore([Tier(SsdTier(tmp_path, capacity_bytes=1 << 34))]).open()
    keys = sorted(int.from_bytes(k, "big") for k in store.keys())
    assert set(written) <= set(keys)  # every acknowledged block survived
    for i in keys:
        g = torch.Generator().manual_seed(i)
        expected = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g)
        assert torch.equal(await store.get(i.to_bytes(8, "big")), expected)
    assert not list((tmp_path / "blocks").rglob("*.tmp-*"))
    await store.close()


def _aligned(nbytes: int, offset: int = 0) -> torch.Tensor:
    from tiercake.tiers.buffers import aligned_buffer

    _mem, view = aligned_buffer(nbytes + offset)
    return torch.frombuffer(view, dtype=torch.uint8)[offset : offset + nbytes]


@pytest.mark.parametrize("nbytes", [3 * 4096, 3 * 4096 + 100, 5000])
@pytest.mark.parametrize("src_offset", [0, 64])  # page-aligned (zero-copy) and not (staged)
@pytest.mark.parametrize("compression", [False, True])
async def test_direct_io_paths(tmp_path, nbytes, src_offset, compression):
    backend = SsdTier(tmp_path, capacity_bytes=1 << 24, direct_min=0, compression=compression)
    if not backend.direct_io:
        pytest.skip("this file system refuses O_DIRECT; the buffered path is tested everywhere else")
    store = await TieredStore([Tier(backend)]).open()
    src = _aligned(nbytes, src_offset)
    src.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    await store.put(b"k", src)
    for dst_offset in (0, 64):
        dst = _aligned(nbytes, dst_offset)
        await store.get_into(b"k", dst)
        assert torch.equal(dst, src)
    path = store._entries[b"k"].copies[0].slot.path
    assert path.stat().st_size % 4096 == 0
    await store.close()
    # a damaged last byte is caught on the zero-copy read path too
    raw = bytearray(path.read_bytes())
    raw[4096 if compression else 4096 + nbytes - 1] ^= 0x5A
    path.write_bytes(bytes(raw))
    store = await TieredStore([Tier(SsdTier(tmp_path, capacity_bytes=1 << 24, direct_min=0))]).open()
    with pytest.raises(ObjectNotFoundError):
        await store.get_into(b"k", _aligned(nbytes))
    await store.close()
