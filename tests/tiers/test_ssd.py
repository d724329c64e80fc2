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

from tiercake.tiers import DiskFullError, ObjectNotFoundError, SsdFilesBackend, Tier, TieredStore, TierFullError
from tiercake.tiers.buffers import round_up
from tiercake.tiers.ssd import HEADER_SIZE, SsdLockedError, shuffle16, unshuffle16
from tiercake.tiers.ssd.log import SsdLogBackend, block_payloads, segment_records
from tiercake.tiers.store import MANY_IN_FLIGHT, MANY_IN_FLIGHT_BYTES, in_flight

LAYOUTS = pytest.mark.parametrize("layout", ["files", "log"])


def same(data, i):
    """Whether ``data`` (the store's bytes: an array, or a tensor) are block ``i``'s."""
    return torch.equal(torch.as_tensor(data).view(torch.float16).view(LAYOUT.shape), block(i))


def ssd_tier(path, layout="files", **kw) -> SsdFilesBackend:
    return (SsdLogBackend if layout == "log" else SsdFilesBackend)(path, **kw)


def record_bytes(layout: str, payload_nbytes: int) -> int:
    """Disk bytes of one block: a header and the payload (the log pads both to pages)."""
    return 4096 + round_up(payload_nbytes) if layout == "log" else HEADER_SIZE + payload_nbytes


async def ssd_store(path, capacity_blocks=64, payload_nbytes=LAYOUT.nbytes, layout="files", **kw) -> TieredStore:
    backend = ssd_tier(path, layout, capacity_bytes=capacity_blocks * record_bytes(layout, payload_nbytes), **kw)
    return await TieredStore([Tier(backend)], payload_nbytes=payload_nbytes).open()


def damage(store: TieredStore, k: bytes, at: int, tier: int = 0) -> Path:
    """Flip the byte ``at`` bytes into block ``k``'s record on disk (negative: from its end)."""
    backend = store.tiers[tier].backend
    path, offset, length = backend.extent(store._entries[k].copies[tier].slot)
    with open(path, "r+b") as f:
        f.seek(offset + (at if at >= 0 else length + at))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    return path


@LAYOUTS
async def test_restart_keeps_every_block(tmp_path, layout):
    store = await ssd_store(tmp_path, layout=layout)
    for i in range(20):
        await store.put(key(i), block(i), parent=key(i - 1) if i else None)
    used = store.tier("ssd").backend.used_bytes
    await store.remove(key(19))
    await store.put(key(19), block(19))  # its first record is dead now: not listed, not recovered
    await store.close()
    payloads = block_payloads(tmp_path)  # what a tool outside the process sees: every payload, in order
    assert len(payloads) == 20 and all(length == LAYOUT.nbytes for _, _, length in payloads)
    with open(payloads[3][0], "rb") as f:
        f.seek(payloads[3][1])
        assert same(torch.frombuffer(bytearray(f.read(LAYOUT.nbytes)), dtype=torch.uint8), 3)

    store = await ssd_store(tmp_path, layout=layout)
    assert sorted(store.keys()) == sorted(key(i) for i in range(20))
    assert store.tier("ssd").backend.used_bytes == used
    assert store._entries[key(5)].meta.parent == key(4)  # the chain survives too
    for i in range(20):
        assert same(await store.get(key(i)), i)
    await store.close()


async def test_a_blocks_seal_survives_a_restart_and_blocks_from_before_seals_still_read(tmp_path):
    import xxhash

    from tiercake.tiers.ssd import record as ssd

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
    raw[: len(old)] = old
    raw[len(old) : len(old) + 8] = ssd._HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(old))
    path.write_bytes(bytes(raw))
    store = await ssd_store(tmp_path)
    assert store.seal_of(key(1)) == b"s" * 16 and store.seal_of(key(2)) == b""
    assert same(await store.get(key(2)), 2) and store.tier("ssd").backend.corrupt_dropped == 0
    await store.close()


async def test_second_owner_is_refused(tmp_path):
    store = await ssd_store(tmp_path)
    with pytest.raises(SsdLockedError):
        SsdFilesBackend(tmp_path)
    await store.close()
    SsdFilesBackend(tmp_path).close()  # free again once the owner closed


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
    assert torch.equal(torch.from_numpy(await store.get(key(1))).view(torch.float16), smooth_kv())
    await store.close()
    return sizes


async def test_compression_and_the_byte_shuffle(tmp_path):
    plain, random_plain = await stored_size(tmp_path / "plain", shuffle=False)
    shuffled, random_shuffled = await stored_size(tmp_path / "shuffled", shuffle=True)
    assert random_plain == random_shuffled == BIG  # did not shrink: stored raw
    assert shuffled < 0.95 * plain < BIG  # the shuffle pays on fp16
    # reading needs no setting: the flags are in each file
    store = await ssd_store(tmp_path / "shuffled", payload_nbytes=BIG, compression=False)
    assert torch.equal(torch.from_numpy(await store.get(key(1))).view(torch.float16), smooth_kv())
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


@LAYOUTS
async def test_corrupt_payload_is_a_miss_never_data(tmp_path, layout):
    store = await ssd_store(tmp_path, layout=layout)
    await store.put(key(1), block(1))
    await store.put(key(2), block(2))
    path = damage(store, key(1), -100)
    with pytest.raises(ObjectNotFoundError):
        await store.get(key(1))
    assert store.tier("ssd").stats.corrupt == 1 and store.misses == 1
    assert not store.contains(key(1))
    assert same(await store.get(key(2)), 2)
    if layout == "files":
        assert not path.exists()  # dropped
    await store.close()
    store = await ssd_store(tmp_path, layout=layout)  # and it does not come back after a restart
    assert store.keys() == [key(2)]
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


def _on_disk(path: Path, layout: str) -> int:
    """Blocks a restart would find."""
    if layout == "files":
        return len(_files(path))
    return sum(not dead for seg in sorted((path / "segments").glob("*.seg")) for _, _, dead in segment_records(seg))


@LAYOUTS
async def test_capacity_limit_drops_oldest_and_refuses_when_all_pinned(tmp_path, layout):
    store = await ssd_store(tmp_path, capacity_blocks=4, layout=layout)
    store.tier("ssd").high_watermark = 1.0
    for i in range(6):
        await store.put(key(i), block(i))
    assert [store.contains(key(i)) for i in range(6)] == [False, False, True, True, True, True]
    assert _on_disk(tmp_path, layout) == 4
    for i in range(2, 6):
        store.pin(key(i), hard=True)
    with pytest.raises(TierFullError):
        await store.put(key(9), block(9))
    assert not store.contains(key(9)) and _on_disk(tmp_path, layout) == 4
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


@pytest.mark.cluster
@LAYOUTS
async def test_full_disk_is_a_clear_error(tiny_fs, layout):
    # the tier believes it has 1 MiB, the file system has 256 KiB: the disk fills first
    backend = ssd_tier(tiny_fs / "ssd", layout, capacity_bytes=1 << 20)
    store = await TieredStore([Tier(backend, high_watermark=1.0)], payload_nbytes=LAYOUT.nbytes).open()
    stored = 0
    with pytest.raises(DiskFullError, match="No space left"):
        for i in range(100):
            await store.put(key(i), block(i))
            stored += 1
    assert 20 < stored < 64  # 256 KiB of 4.5 KiB files (8 KiB records), less the file system's own rounding
    assert not store.contains(key(stored))  # the failed put left nothing behind
    assert not list((tiny_fs / "ssd" / "blocks").rglob("*.tmp-*"))
    for i in range(stored):
        assert same(await store.get(key(i)), i)
    # room again: a removed block's file goes, or its record's payload is punched out of the segment
    # (the record's header page stays until compaction: two 4 KiB payloads make room for one record)
    for i in range(2 if layout == "log" else 1):
        await store.remove(key(i))
    await store.put(key(stored), block(stored))
    await store.close()


@pytest.mark.cluster
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
    from tiercake.tiers import SsdFilesBackend, Tier, TieredStore
    from tiercake.tiers.ssd.log import SsdLogBackend

    async def put(store, i):
        g = torch.Generator().manual_seed(i)
        data = torch.randint(0, 256, (int(sys.argv[3]),), dtype=torch.uint8, generator=g)
        await store.put(i.to_bytes(8, "big"), data)
        print(i, flush=True)

    async def main():
        tier = (SsdLogBackend if sys.argv[2] == "log" else SsdFilesBackend)(sys.argv[1], capacity_bytes=1 << 34)
        store = await TieredStore([Tier(tier)]).open()
        i = 0
        while True:  # eight puts in flight: the log writes them in batches
            await asyncio.gather(*(put(store, i + j) for j in range(8)))
            i += 8

    asyncio.run(main())
    """
)


@pytest.mark.cluster
@pytest.mark.parametrize("layout,nbytes", [("files", 4 << 20), ("log", 4 << 20), ("log", 64 << 10)])
async def test_process_killed_mid_write_never_serves_half_a_block(tmp_path, layout, nbytes):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_WRITER, str(tmp_path), layout, str(nbytes), stdout=asyncio.subprocess.PIPE
    )
    written = []
    deadline = time.monotonic() + 60
    while len(written) < 5 and time.monotonic() < deadline:
        written.append(int(await asyncio.wait_for(proc.stdout.readline(), 30)))
    await asyncio.sleep(0.013)  # land somewhere inside a write
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    store = await TieredStore([Tier(ssd_tier(tmp_path, layout, capacity_bytes=1 << 34))]).open()
    keys = sorted(int.from_bytes(k, "big") for k in store.keys())
    assert set(written) <= set(keys)  # every acknowledged block survived
    for i in keys:
        g = torch.Generator().manual_seed(i)
        expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        try:
            got = await store.get(i.to_bytes(8, "big"))
        except ObjectNotFoundError:
            assert i not in written  # a torn block that was never acknowledged: a miss
            continue
        assert torch.equal(torch.from_numpy(got), expected)
    assert not list((tmp_path / "blocks").rglob("*.tmp-*"))
    await store.close()


def _aligned(nbytes: int, offset: int = 0) -> torch.Tensor:
    from tiercake.tiers.buffers import aligned_buffer

    _mem, view = aligned_buffer(nbytes + offset)
    return torch.frombuffer(view, dtype=torch.uint8)[offset : offset + nbytes]


@pytest.mark.parametrize("nbytes", [3 * 4096, 3 * 4096 + 100, 5000])
@pytest.mark.parametrize("src_offset", [0, 64])  # page-aligned (zero-copy) and not (staged)
@pytest.mark.parametrize("compression", [False, True])
@LAYOUTS
async def test_direct_io_paths(tmp_path, nbytes, src_offset, compression, layout):
    backend = ssd_tier(tmp_path, layout, capacity_bytes=1 << 24, direct_min=0, compression=compression)
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
    path, _, length = backend.extent(store._entries[b"k"].copies[0].slot)
    assert path.stat().st_size % 4096 == 0 and length % 4096 == 0
    # a damaged last byte is caught on the zero-copy read path too
    damage(store, b"k", 4096 if compression else 4096 + nbytes - 1)
    await store.close()
    store = await TieredStore([Tier(ssd_tier(tmp_path, layout, capacity_bytes=1 << 24, direct_min=0))]).open()
    with pytest.raises(ObjectNotFoundError):
        await store.get_into(b"k", _aligned(nbytes))
    await store.close()


# The log layout ------------------------------------------------------------------------------------


async def test_the_log_writes_concurrent_puts_in_a_few_batches(tmp_path):
    store = await ssd_store(tmp_path, capacity_blocks=256, layout="log")
    backend = store.tier("ssd").backend
    calls, write = [], backend._write_records
    backend._write_records = lambda seg, records: (calls.append(len(records)), write(seg, records))[1]
    await asyncio.gather(*(store.put(key(i), block(i)) for i in range(64)))
    assert sum(calls) == 64 and len(calls) <= 8  # one pwritev per batch, not a file per block
    assert [p.name for p in (tmp_path / "segments").iterdir()] == ["0000000001.seg"]
    assert not list((tmp_path / "blocks").rglob("*.blk"))
    for i in range(64):
        assert same(await store.get(key(i)), i)
    await store.close()


async def test_a_put_many_of_small_blocks_goes_out_in_one_write_and_large_blocks_a_few_at_a_time(tmp_path):
    """put_many keeps as many puts in flight as its bytes allow, so the log writes a batch of small
    blocks together (with 16 in flight, 32 blocks went out in two writes, one after the other)."""
    store = await ssd_store(tmp_path, capacity_blocks=256, layout="log")
    backend = store.tier("ssd").backend
    calls, write = [], backend._write_records
    backend._write_records = lambda seg, records: (calls.append(len(records)), write(seg, records))[1]
    done = await store.put_many([(key(i), block(i)) for i in range(32)])
    assert done == ["ssd"] * 32 and calls == [32]
    got = [torch.empty_like(block(0)) for _ in range(32)]
    assert await store.get_many([(key(i), got[i]) for i in range(32)]) == ["ssd"] * 32
    assert all(same(got[i], i) for i in range(32))
    await store.close()
    assert in_flight([bytes(64 << 10)] * 100) == MANY_IN_FLIGHT
    assert in_flight([bytes(1 << 20), bytes(16 << 20)]) == MANY_IN_FLIGHT_BYTES // (16 << 20)
    assert in_flight([torch.empty(MANY_IN_FLIGHT_BYTES + 1, dtype=torch.uint8)]) == 1


async def test_removed_and_evicted_blocks_stay_gone_after_a_restart(tmp_path):
    store = await ssd_store(tmp_path, capacity_blocks=8, layout="log")
    store.tier("ssd").high_watermark = 1.0
    for i in range(10):  # 0 and 1 are evicted
        await store.put(key(i), block(i))
    await store.remove(key(5))
    backend = store.tier("ssd").backend
    # the payloads of the three dead records were punched out of the file: it holds live bytes and headers
    assert backend.disk_bytes < 10 * 8192  # ext4 may add a block of extent tree over 7 * 8192 + 3 * 4096
    await store.close()
    store = await ssd_store(tmp_path, capacity_blocks=8, layout="log")
    assert sorted(store.keys()) == sorted(key(i) for i in range(2, 10) if i != 5)
    for i in range(2, 10):
        if i != 5:
            assert same(await store.get(key(i)), i)
    await store.close()


async def test_compaction_keeps_the_disk_near_the_capacity_and_every_block_readable(tmp_path):
    capacity = 64
    store = await ssd_store(tmp_path, capacity_blocks=capacity, layout="log", segment_bytes=64 << 10, compact_dead=0.25)
    backend = store.tier("ssd").backend
    for i in range(600):  # churn: blocks are removed after 40 puts, every fifth after 100
        await store.put(key(i), block(i))
        for old in (i - 40, i - 100):
            if old >= 0 and (old % 5 != 0 or old == i - 100) and store.contains(key(old)):
                await store.remove(key(old))
    await store.drain()
    alive = {i for i in range(600) if store.contains(key(i))}
    assert len(alive) > 40
    while backend._compactor is not None and not backend._compactor.done():
        await asyncio.sleep(0.01)
    assert backend.compactions > 0 and backend.compacted_bytes > 0
    # dead records never span more than the limit (a quarter of the capacity) plus the active segment
    assert backend.dead_bytes <= 0.25 * backend.capacity_bytes + backend.segment_bytes
    assert len(list((tmp_path / "segments").glob("*.seg"))) <= capacity * 8192 * 1.25 // (64 << 10) + 2
    for i in alive:
        assert same(await store.get(key(i)), i)
    await store.close()
    store = await ssd_store(tmp_path, capacity_blocks=capacity, layout="log", segment_bytes=64 << 10)
    assert sorted(store.keys()) == sorted(key(i) for i in alive)
    for i in alive:
        assert same(await store.get(key(i)), i)
    await store.close()


async def test_a_block_removed_while_compaction_copies_it_does_not_come_back(tmp_path):
    store = await ssd_store(tmp_path, capacity_blocks=64, layout="log", segment_bytes=64 << 10)
    backend = store.tier("ssd").backend
    for i in range(16):  # two segments of eight records
        await store.put(key(i), block(i))
    victim = backend.segments[1]
    read_raw = backend._read_raw

    def slow_read(segment, offset, length):
        time.sleep(0.05)  # the removals below land while the copy is in flight
        return read_raw(segment, offset, length)

    backend._read_raw = slow_read
    calls, write = [], backend._write_records
    backend._write_records = lambda seg, records: (calls.append(len(records)), write(seg, records))[1]
    compacting = asyncio.create_task(backend._evacuate(victim))
    await asyncio.sleep(0.02)
    for i in range(0, 8, 2):
        await store.remove(key(i))
    await compacting
    assert calls == [8]  # the eight copies went out together, in one write
    assert 1 not in backend.segments and not victim.path.exists()
    moved_to = {backend.extent(store._entries[key(i)].copies[0].slot)[0].name for i in range(1, 8, 2)}
    assert moved_to == {"0000000003.seg"}  # the tail (segment 2 was full)
    await store.close()
    store = await ssd_store(tmp_path, capacity_blocks=64, layout="log")
    assert sorted(store.keys()) == sorted(key(i) for i in range(16) if i >= 8 or i % 2)
    for i in (1, 3, 9):
        assert same(await store.get(key(i)), i)
    await store.close()


@pytest.mark.parametrize("removed", ["after the copy", "while it was copied"])
async def test_a_crash_between_a_compactions_copy_and_the_old_segments_deletion_brings_back_nothing_removed(
    tmp_path, removed
):
    """The compaction's crash points: its copies written, the victim still on disk with its records
    live (never marked: it is deleted whole). A block removed meanwhile (its copy marked dead, either
    after the move or by the move itself when the remove landed while it copied) must stay removed
    after the restart; the others come back from their copies, once."""
    store = await ssd_store(tmp_path, capacity_blocks=64, layout="log", segment_bytes=64 << 10)
    backend = store.tier("ssd").backend
    backend._maybe_compact = lambda: None  # this test moves the records itself, and stops before the delete
    for i in range(16):  # two segments of eight records
        await store.put(key(i), block(i))
    victim = backend.segments[1]
    chunk = sorted(victim.live.items())
    if removed == "while it was copied":
        read_raw = backend._read_raw

        def slow_read(segment, offset, length):
            time.sleep(0.05)
            return read_raw(segment, offset, length)

        backend._read_raw = slow_read
        moving = asyncio.create_task(backend._move(victim, chunk))
        await asyncio.sleep(0.02)
        for i in (0, 2):
            await store.remove(key(i))
        await moving
    else:
        await backend._move(victim, chunk)
        for i in (0, 2):
            await store.remove(key(i))
    assert victim.path.exists()  # the crash: the victim was never deleted
    backend._close_if_retired = lambda segment: None
    await store.close()
    store = await ssd_store(tmp_path, capacity_blocks=64, layout="log")
    assert sorted(store.keys()) == sorted(key(i) for i in range(16) if i not in (0, 2))
    for i in (1, 3, 9):
        assert same(await store.get(key(i)), i)
    await store.close()


async def test_of_two_records_of_a_key_the_newer_is_recovered(tmp_path):
    backend = SsdLogBackend(tmp_path, capacity_bytes=1 << 20)
    for i in (1, 2):  # as a crash between a compaction's copy and the segment's deletion leaves them
        slot = backend.allocate(LAYOUT.nbytes)
        await backend.persist(slot, key(0), None, block(i).view(torch.uint8).reshape(-1))
    backend.close()
    store = await TieredStore([Tier(SsdLogBackend(tmp_path, capacity_bytes=1 << 20))]).open()
    assert store.keys() == [key(0)] and same(await store.get(key(0)), 2)
    assert store.tier("ssd").backend.used_bytes == 8192
    await store.close()


async def test_the_layout_is_a_setting_and_switching_it_drops_the_other_layouts_blocks(tmp_path, caplog):
    from tiercake.config import TierConfig
    from tiercake.tiers.build import backend_class

    cfg = TierConfig(kind="ssd", capacity="1MiB", path=str(tmp_path), layout="log", segment_bytes="256KiB")
    backend = backend_class("ssd").from_config(cfg, None)
    assert isinstance(backend, SsdLogBackend) and backend.segment_bytes == 256 << 10
    store = await TieredStore([Tier(backend)]).open()
    await store.put(key(1), block(1))
    await store.close()
    store = await ssd_store(tmp_path)  # the files layout now
    assert store.keys() == [] and not list((tmp_path / "segments").glob("*.seg"))
    await store.put(key(2), block(2))
    await store.close()
    with caplog.at_level("WARNING"):
        store = await ssd_store(tmp_path, layout="log")
    assert store.keys() == [] and not _files(tmp_path)
    assert "other layout" in caplog.text
    await store.close()


async def test_a_batch_of_adjacent_blocks_is_read_in_a_few_large_reads_and_a_bad_one_fails_alone(tmp_path):
    nbytes = 16 << 10
    backend = SsdLogBackend(tmp_path, capacity_bytes=8 << 20)
    if not backend.direct_io:
        backend.close()
        pytest.skip("this file system refuses O_DIRECT: reads go one at a time through the page cache")
    store = await TieredStore([Tier(backend)]).open()
    src = _aligned(32 * nbytes).view(32, nbytes)
    src.copy_(torch.arange(32 * nbytes, dtype=torch.int64).remainder(241).to(torch.uint8).view(32, nbytes))
    done = await store.put_many([(key(i), src[i]) for i in range(32)])
    assert done == ["ssd"] * 32
    runs, read_run = [], backend._read_run
    backend._read_run = lambda run: (runs.append(len(run)), read_run(run))[1]
    dst = _aligned(32 * nbytes).view(32, nbytes)
    got = await store.get_many([(key(i), dst[i]) for i in range(32)], concurrency=32)
    assert got == ["ssd"] * 32 and torch.equal(dst, src)
    assert sum(runs) == 32 and len(runs) <= 3  # appended together, read together
    damage(store, key(7), 4096 + 100)
    dst.zero_()
    got = await store.get_many([(key(i), dst[i]) for i in range(32)], concurrency=32)
    assert isinstance(got[7], ObjectNotFoundError) and got[:7] + got[8:] == ["ssd"] * 31
    assert torch.equal(dst[8:], src[8:]) and torch.equal(dst[:7], src[:7])
    assert store.tier("ssd").stats.corrupt == 1
    await store.close()


async def test_closing_the_log_fails_queued_appends_and_finishes_the_one_being_written(tmp_path):
    from tiercake.tiers import StoreError

    backend = SsdLogBackend(tmp_path, capacity_bytes=1 << 20)
    write = backend._write_records
    backend._write_records = lambda seg, records: (time.sleep(0.2), write(seg, records))[1]

    async def put(i):
        slot = backend.allocate(LAYOUT.nbytes)
        await backend.persist(slot, key(i), None, block(i).view(torch.uint8).reshape(-1))

    first = asyncio.create_task(put(0))
    await asyncio.sleep(0.05)  # in the writer now
    queued = [asyncio.create_task(put(i)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    backend.close()
    await asyncio.wait_for(first, 5)  # written whole
    for task in queued:
        with pytest.raises(StoreError, match="closed"):
            await asyncio.wait_for(task, 5)  # a clear error, not a hang
    store = await TieredStore([Tier(SsdLogBackend(tmp_path, capacity_bytes=1 << 20))]).open()
    assert store.keys() == [key(0)] and same(await store.get(key(0)), 0)
    await store.close()


async def test_a_put_cancelled_while_its_record_is_written_leaves_no_live_orphan(tmp_path):
    store = await ssd_store(tmp_path, layout="log")
    backend = store.tier("ssd").backend
    write = backend._write_records
    backend._write_records = lambda seg, records: (time.sleep(0.2), write(seg, records))[1]
    put = asyncio.create_task(store.put(key(1), block(1)))
    await asyncio.sleep(0.05)  # in the writer now
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await asyncio.sleep(0.5)  # the write lands, then its dead mark
    assert not store.contains(key(1)) and backend.used_bytes == 0
    assert backend.dead_bytes == record_bytes("log", LAYOUT.nbytes)  # counted dead, compacted in time
    await store.close()
    store = await ssd_store(tmp_path, layout="log")
    assert store.keys() == []  # not revived by a restart
    await store.close()
