"""The key-value store's durability levels, kept through real faults: node agents SIGKILLed (and
everything at once), a node gone for good, a pool file deleted, a node stopped mid-batch, a full
node. Every acknowledged put is checksummed and read back; the processes are real, on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvstore_helpers import KB, MB, SECRET, TOKEN, KvCluster, blob, ready

from tiercake.kvstore import Durability, ErrorCode, NoSpace, ObjectNotFound
from tiercake.tiers.pool import remove_pool

pytestmark = pytest.mark.cluster  # every test here starts processes

N = 500


def values(prefix: str, n: int = N, size: int = 8 * KB) -> dict[str, bytes]:
    return {f"{prefix}{i}": blob(hash(prefix) % 1000 + i, size + i % 97) for i in range(n)}


async def put_all(store, objects: dict[str, bytes], durability: Durability = Durability()) -> None:
    names = list(objects)
    for lo in range(0, len(names), 64):  # acknowledged batch by batch
        chunk = names[lo : lo + 64]
        assert await store.put_many(chunk, [objects[n] for n in chunk], durability=durability) == [None] * len(chunk)


async def lost(store, objects: dict[str, bytes]) -> list[str]:
    """The names whose bytes do not read back as they were put (checksums compared)."""
    got = await store.get_many(list(objects))
    return [
        n
        for n, g in zip(objects, got)
        if isinstance(g, Exception) or hashlib.sha256(g.tobytes()).digest() != hashlib.sha256(objects[n]).digest()
    ]


async def eventually_none_lost(store, objects, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = await lost(store, objects)
        if not missing:
            return
        assert time.monotonic() < deadline, f"{len(missing)} of {len(objects)} lost: {missing[:5]}"
        await asyncio.sleep(0.3)


async def until_moved(store, owners: set[str], timeout: float = 20.0) -> None:
    """Until every slot's primary is one of ``owners`` (a failover is over)."""
    deadline = time.monotonic() + timeout
    while True:
        await store.refresh()
        if set(primaries(store)) <= owners:
            return
        assert time.monotonic() < deadline, f"the slots did not move to {owners}: {primaries(store)}"
        await asyncio.sleep(0.2)


def primaries(store) -> dict[str, int]:
    counts: dict[str, int] = {}
    for chain in store.map.chains:
        counts[chain[0]] = counts.get(chain[0], 0) + 1
    return counts


async def test_a_sigkilled_node_agent_comes_back_with_everything_it_held(tmp_path):
    """Memory level: the pool region outlives the node agent, and its index with it."""
    cluster = KvCluster(tmp_path, failover_s=30.0)  # back well before its slots could move
    try:
        async with cluster.store() as store:
            await ready(store, 2)
            objects = values("mem")
            await put_all(store, objects)
            cluster.restart("kv-a")  # SIGKILL, then the same config: same pool file, same SSD directory
            await eventually_none_lost(store, objects)
            # and everything at once: the conductor (embedded: it forgets the map) and both node agents
            for proc, _ in cluster.conductors:
                proc.kill()
            for name in list(cluster.nodes):
                cluster.kill(name)
        cluster.conductors = [cluster.start_conductor(0)]
        cluster.urls = [cluster.conductors[0][1]]
        for name in ("kv-a", "kv-b"):
            (tmp_path / f"{name}.yaml").write_text(
                (tmp_path / f"{name}.yaml").read_text().replace(cluster.url, cluster.urls[0])
            )
            cluster.start_node(name)
        cluster.url = cluster.urls[0]
        async with cluster.store() as store:
            await ready(store, 2)
            await eventually_none_lost(store, objects)  # the nodes offered their maps: the slots stayed put
    finally:
        cluster.close()


async def test_a_sigkill_mid_batch_loses_nothing_that_was_acknowledged(tmp_path):
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=30.0)
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import asyncio, sys\n"
        "from tiercake.kvstore import AsyncStore\n"
        "async def main(url):\n"
        f"    async with AsyncStore(url, secret={SECRET!r}, token={TOKEN!r}, retry_s=2) as s:\n"
        "        for b in range(1000):\n"
        "            names = [f'w{b}-{i}' for i in range(16)]\n"
        "            got = await s.put_many(names, [n.encode() * 200 for n in names])\n"
        "            for n, g in zip(names, got):\n"
        "                if g is None:\n"
        "                    print(n, flush=True)\n"
        "            if any(g is not None for g in got):\n"
        "                return  # the node died: what was acknowledged is printed\n"
        "asyncio.run(main(sys.argv[1]))\n"
    )
    procs = []
    try:
        async with cluster.store() as store:
            await ready(store, 1)
        proc = subprocess.Popen([sys.executable, str(writer), cluster.url], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        acked = []
        while len(acked) < 600:  # the node agent dies in the middle of the writer's batches
            acked.append(proc.stdout.readline().strip())
        cluster.kill("kv-a")
        rest, _ = proc.communicate(timeout=120)
        acked += [line for line in rest.splitlines() if line]
        cluster.start_node("kv-a")
        async with cluster.store() as store:
            await ready(store, 1)
            await eventually_none_lost(store, {n: n.encode() * 200 for n in acked})
        print(f"mid-batch kill: {len(acked)} acknowledged, none lost")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        cluster.close()


async def test_a_sigkill_right_after_removes_brings_none_of_them_back(tmp_path):
    """A remove is answered once no block of the object is left for a restarted node to find: the
    node rebuilds its table from the blocks its pool and SSD hold, and a version still waiting to be
    retired came back (chaos's key-value histories caught one)."""
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=30.0)
    remover = tmp_path / "remover.py"
    remover.write_text(
        "import asyncio, sys\n"
        "from tiercake.kvstore import AsyncStore, Durability\n"
        "async def main(url):\n"
        f"    async with AsyncStore(url, secret={SECRET!r}, token={TOKEN!r}, retry_s=2) as s:\n"
        "        for i in range(2000):\n"
        "            try:\n"
        "                await s.remove(f'r{i}', force=True)\n"
        "            except Exception:\n"
        "                return  # the node died: what was acknowledged is printed\n"
        "            print(f'r{i}', flush=True)\n"
        "asyncio.run(main(sys.argv[1]))\n"
    )
    proc = None
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            for start in range(0, 2000, 100):
                names = [f"r{i}" for i in range(start, start + 100)]
                assert all(
                    g is None
                    for g in await store.put_many(
                        names, [n.encode() * 100 for n in names], durability=Durability(persist=True)
                    )
                )
        proc = subprocess.Popen([sys.executable, str(remover), cluster.url], stdout=subprocess.PIPE, text=True)
        removed = [proc.stdout.readline().strip() for _ in range(300)]
        cluster.kill("kv-a")  # right after an acknowledged remove, while the next is in flight
        rest, _ = proc.communicate(timeout=120)
        removed += [line for line in rest.splitlines() if line]
        cluster.start_node("kv-a")
        async with cluster.store() as store:
            await ready(store, 1)
            back = [n for n, present in zip(removed, await store.exists_many(removed)) if present]
        assert not back, f"{len(back)} of {len(removed)} acknowledged removes undone by the restart: {back[:5]}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        cluster.close()


async def test_replicated_objects_outlive_a_node_gone_for_good(tmp_path):
    cluster = KvCluster(tmp_path, failover_s=1.5)
    try:
        async with cluster.store() as store:
            await ready(store, 2)
            objects = values("rep")
            await put_all(store, objects, Durability(replicas=2))
            assert primaries(store).get("kv-b", 0) > 0  # it owned slots, now to be taken over
            cluster.kill("kv-b")  # and never comes back
            await until_moved(store, {"kv-a"})
            await eventually_none_lost(store, objects)
            await store.put("after", b"the failover")  # the slots it left take writes again
            assert await store.get("after") == b"the failover"
            with pytest.raises(NoSpace):  # one node left: two replicas cannot be kept
                await store.put("two", b"x", durability=Durability(replicas=2))
    finally:
        cluster.close()


async def test_persisted_objects_outlive_the_pool_file(tmp_path):
    cluster = KvCluster(tmp_path, failover_s=30.0)
    try:
        async with cluster.store() as store:
            await ready(store, 2)
            objects = values("disk")
            await put_all(store, objects, Durability(persist=True))
            for name in ("kv-a", "kv-b"):  # as a host reboot: the processes and the memory go
                cluster.kill(name)
                Path(cluster.pools[name]).unlink()
                cluster.start_node(name)
            await eventually_none_lost(store, objects)
    finally:
        cluster.close()


async def test_memory_level_objects_are_lost_with_the_pool_file_and_say_so(tmp_path):
    """The contrast the levels promise: without persist, a host reboot loses the memory level."""
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=30.0)
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            await store.put("volatile", b"in memory only")
            await store.put("durable", b"on disk too", durability=Durability(persist=True))
            cluster.kill("kv-a")
            Path(cluster.pools["kv-a"]).unlink()
            cluster.start_node("kv-a")
            await ready(store, 1)
            assert await store.get("durable") == b"on disk too"
            with pytest.raises(ObjectNotFound):
                await store.get("volatile")
    finally:
        cluster.close()


async def test_a_stopped_node_fails_its_share_quickly_and_the_rest_goes_through(tmp_path):
    cluster = KvCluster(tmp_path, failover_s=60.0)
    try:
        async with cluster.store(retry_s=3.0, timeout_s=2.0) as store:
            await ready(store, 2)
            names = [f"s{i}" for i in range(48)]
            stalled = cluster.nodes["kv-b"]
            stalled.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                results = await asyncio.wait_for(store.put_many(names, [n.encode() for n in names]), 30)
                took = time.monotonic() - started
            finally:
                stalled.send_signal(signal.SIGCONT)
            failed = [n for n, r in zip(names, results) if r is not None]
            assert failed and len(failed) < len(names), results  # kv-b's share failed, kv-a's was stored
            assert all(r.code == ErrorCode.TRANSFER_FAIL for r in results if r is not None), results
            assert took < 10, f"a stopped node held the batch {took:.1f} s"
            got = await store.get_many(names)
            for name, result, read in zip(names, results, got):
                if result is None:
                    assert read.tobytes() == name.encode()
    finally:
        cluster.close()


async def test_a_full_node_answers_no_room_and_evicts_only_what_is_a_cache(tmp_path):
    cluster = KvCluster(tmp_path, nodes=("kv-p",), pool="8MiB", ssd=None, pool_extra=", high_watermark: 1.0")
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            cache = {f"c{i}": blob(i, MB) for i in range(12)}  # 12 MiB of cache into 8: the oldest go
            for name, value in cache.items():
                await store.put(name, value)
            kept = await store.describe_many(list(cache), lease=False)
            assert 0 < sum(not isinstance(k, ObjectNotFound) for k in kept) < len(cache)
            for name, k in zip(cache, kept):  # what is there reads whole
                if not isinstance(k, ObjectNotFound):
                    assert await store.get(name) == cache[name]
            await store.remove_all(force=True)
            pinned = Durability(hard_pin=True)
            stored = 0
            with pytest.raises(NoSpace):
                for i in range(12):  # hard-pinned objects cannot be evicted: the node says it is full
                    await store.put(f"p{i}", blob(100 + i, MB), durability=pinned)
                    stored += 1
            assert 4 <= stored < 12
            for i in range(stored):
                assert await store.get(f"p{i}") == blob(100 + i, MB)
    finally:
        cluster.close()


async def test_objects_keep_serving_through_a_conductor_failover(etcd, tmp_path):
    from tiercake.conductor.etcd import EtcdBackend

    meta = await EtcdBackend(etcd.endpoints).start()  # a clean slate on the shared etcd
    for prefix in (b"/tiercake/leader/", b"/tiercake/objects/", b"/tiercake/members/"):
        for kv in (await meta.range(prefix))[0]:
            await meta.delete(kv.key)
    await meta.close()
    cluster = KvCluster(tmp_path, etcd=etcd, conductors=2, failover_s=30.0)
    try:
        async with cluster.store() as store:
            await ready(store, 2)
            objects = values("ha", 64)
            await put_all(store, objects, Durability(replicas=2))
            epoch = store.map.epoch
            leader, _ = cluster.conductors[0]
            leader.kill()
            leader.wait(10)
            assert not await lost(store, objects)  # the conductor is not on an object's path
            await store.put("after", b"the failover")
            await store.refresh()
            assert store.map.epoch >= epoch and await store.get("after") == b"the failover"
    finally:
        cluster.close()


async def test_a_node_that_joins_takes_over_slots_without_losing_any_object(tmp_path):
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=1.5)
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            memory, replicated = values("j", 200), values("jr", 100)
            await put_all(store, memory)
            cluster.start_node("kv-b")
            deadline = time.monotonic() + 20
            while not all(len(c) == 2 for c in store.map.chains):  # in every chain, not yet holding the slots
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
                await store.refresh()
            # replicated writes while the slots are copied to kv-b and then handed to it
            writes = asyncio.create_task(put_all(store, replicated, Durability(replicas=2)))
            await ready(store, 2, timeout=40)
            await writes
            assert primaries(store).get("kv-b", 0) > 0  # handed over
            await eventually_none_lost(store, {**memory, **replicated})
            cluster.kill("kv-a")  # for good: every replicated object is on kv-b as well
            await until_moved(store, {"kv-b"})
            await eventually_none_lost(store, replicated)
    finally:
        cluster.close()


@pytest.mark.timeout(180)
async def test_writes_under_way_as_a_node_joins_are_on_it_when_it_takes_their_slots(tmp_path):
    """Writers keep making new replicated objects while a third node joins: a put that sent its object
    to the slot's backups of before may install it only after the slot's copy to the new node listed
    what the slot holds. The copy waits for such writes and takes their objects, so every acknowledged
    object reads back once the new node serves the slots handed to it. (Without that, those objects
    were neither sent to it nor copied: acknowledged, then not found.)"""
    cluster = KvCluster(tmp_path, nodes=("kv-a", "kv-b"), failover_s=1.5, slots=8)
    acked: dict[str, bytes] = {}
    stop = asyncio.Event()

    async def writer(store, w: int) -> None:
        i = 0
        while not stop.is_set():
            name, value = f"w{w}-{i}", blob(1000 * w + i, 64 * KB + i)
            if await store.put_many([name], [value], durability=Durability(replicas=2)) == [None]:
                acked[name] = value
            i += 1

    try:
        async with cluster.store() as store:
            await ready(store, 2)
            writers = [asyncio.create_task(writer(store, w)) for w in range(8)]
            await asyncio.sleep(0.5)
            cluster.start_node("kv-c")  # chains gain it: slots are copied to it, some handed to it
            await ready(store, 3, timeout=40)
            stop.set()
            await asyncio.gather(*writers)
            assert len(acked) > 100 and primaries(store).get("kv-c", 0) > 0
            await eventually_none_lost(store, acked, timeout=10)
    finally:
        stop.set()
        cluster.close()


def owner(store, name: str) -> str:
    from tiercake.blocks import object_id, object_slot

    return store.map.primary(object_slot(object_id(name.encode(), store.tenant), store.map.slots))


@pytest.mark.timeout(300)
async def test_persisted_objects_of_a_node_away_long_past_its_failover_all_read_back_when_it_returns(tmp_path):
    """Persisted on one node alone (replica_num 1, nof_replica_num 1), then that node SIGKILLed and away
    for 20 s, eight times its member lease and failover (2.5 s here; the store has no longer timer that
    a node's absence starts: only an operator says a node is gone for good): the slots holding them stay its own
    (the map pins them), so its objects answer REPLICA_IS_NOT_READY (-703), never OBJECT_NOT_FOUND,
    while the slots it held nothing persisted in move on and take writes; back with its SSD, it serves
    every one as it was written. (Before, its slots moved to the other node and, on its return, the
    slot copy dropped all it had: 20 of 20 lost.)"""
    from tiercake.kvstore import NotReady

    cluster = KvCluster(tmp_path, failover_s=1.5)
    try:
        async with cluster.store() as store:
            await ready(store, 2)
            objects = values("away", 60)
            await put_all(store, objects, Durability(persist=True))
            on_a = {n: v for n, v in objects.items() if owner(store, n) == "kv-a"}
            assert 0 < len(on_a) < len(objects)
            cluster.kill("kv-a")
            started = time.monotonic()
            while "kv-a" in store.members:  # until its member lease is over (reads before may still find it)
                await asyncio.sleep(0.2)
                await store.refresh()
            await asyncio.sleep(3)  # and past the failover: whatever was to move has moved
            await store.refresh()
            assert {c[0] for c in store.map.chains} == {"kv-a", "kv-b"}  # kv-a's pinned slots stayed its own
            assert all(holder == "kv-a" or holder == "kv-b" for holder in store.map.pinned.values())
            moved_on = [f"meanwhile{i}" for i in range(200) if owner(store, f"meanwhile{i}") == "kv-b"]
            for name in moved_on:
                await store.put(name, b"written while kv-a was away")
            while time.monotonic() - started < 20:
                got = await store.get_many(list(on_a))
                assert all(isinstance(g, NotReady) and g.code == ErrorCode.REPLICA_IS_NOT_READY for g in got), got[:3]
                await asyncio.sleep(5)
            cluster.start_node("kv-a")
            await eventually_none_lost(store, objects)
            assert all([await store.get(n) for n in moved_on])
    finally:
        cluster.close()


@pytest.mark.timeout(400)
async def test_a_full_node_restarts_five_times_reading_only_headers_and_serves_everything(tmp_path):
    """A node filled until it answers no room (its pool and SSD full of persisted and memory-level
    objects), SIGKILLed and restarted five times in a row: every start recovers without a crash, reads
    only each object's header (its tiers count no hit and no eviction before the first client read:
    recovery once read every object whole, promoting it into the full pool, whose eviction dropped
    objects it had just chosen, and crashed), and serves every acknowledged object as it was written.
    How long a restart takes is `tiercake bench restart`'s (docs/BENCHMARKS.md)."""
    cluster = KvCluster(tmp_path, nodes=("kv-a",), pool="24MiB", ssd="96MiB", metrics=True, failover_s=30.0)
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            written: dict[str, bytes] = {}
            for i in range(1000):
                name, value = f"full{i}", blob(i, 256 * KB + i)
                try:
                    await store.put(name, value, durability=Durability(persist=i % 3 != 0))
                except NoSpace:
                    break
                written[name] = value
            assert 200 < len(written) < 1000  # it filled up
            for _ in range(5):
                cluster.restart("kv-a")
                assert cluster.metric("kv-a", "tiercake_tier_hits") == 0
                assert cluster.metric("kv-a", "tiercake_tier_evictions") == 0
                await ready(store, 1)
                persisted = {n: v for i, (n, v) in enumerate(written.items()) if i % 3 != 0}
                assert await lost(store, persisted) == []  # every persisted one; memory-level ones are a cache
    finally:
        cluster.close()


async def test_a_catastrophic_pattern_never_stalls_the_node_for_another_tenant(tmp_path):
    """``remove_by_regex("(a+)+$")`` over names of 30 a's and a '!' (Python's re backtracks 2^30 times
    on each: a node's event loop was blocked 14.9 s by one such name of 27) while another tenant puts:
    the match has RE2's semantics, off the event loop, so the removal answers at once and the other
    tenant's puts beside it take no longer than before it (50 ms at most over the slowest of those).
    A pattern RE2 cannot take is InvalidParams, not a hang."""
    from tiercake.kvstore import InvalidParams

    cluster = KvCluster(tmp_path, nodes=("kv-a",))
    try:
        async with cluster.store(tenant="regex") as attacker, cluster.store(tenant="bystander") as other:
            await ready(attacker, 1)
            names = [f"{'a' * 30}!{i}" for i in range(50)]
            assert await attacker.put_many(names, [b"x"] * len(names)) == [None] * len(names)

            async def put_timed(i: int) -> float:
                started = time.perf_counter()
                await other.put(f"bystander-{i}", b"y" * 4096)
                return time.perf_counter() - started

            before = [await put_timed(i) for i in range(20)]
            removal = asyncio.create_task(attacker.remove_matching("(a+)+$"))
            beside = [await put_timed(100 + i) for i in range(20)]
            assert await asyncio.wait_for(removal, 30) == 0  # every name ends in a digit: none matches
            assert max(beside) < 0.05 + max(before), (max(before), max(beside))
            assert await attacker.remove_matching(r"^a+!1\d$") == 10
            with pytest.raises(InvalidParams, match="RE2"):
                await attacker.remove_matching(r"(a)\1")  # a backreference
    finally:
        cluster.close()


@pytest.mark.timeout(300)
async def test_a_batch_of_16000_small_objects_answers_every_item_on_a_busy_node(tmp_path):
    """One put_many of 16,000 objects of 1 KiB, persisted, while two processes keep both cores busy:
    every item is answered, all stored (a per-request deadline that ignored the item count answered
    -800 with part of the batch stored), and the node stays a member throughout (its keep-alive got
    its turns: its lease ran out twice behind such batches)."""
    # the default member lease (5 s): two busy processes beside it are what is tested, not a 1 s lease
    cluster = KvCluster(tmp_path, nodes=("kv-a",), pool="64MiB", ssd="256MiB", member_ttl=5.0)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL) for _ in range(2)
    ]
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            lease = await node_lease(store)
            names = [f"batch-{i}" for i in range(16_000)]
            values = [blob(i, KB) for i in range(len(names))]
            answers = await store.put_many(names, values, durability=Durability(persist=True))
            assert answers == [None] * len(names), [a for a in answers if a is not None][:3]
            got = await store.get_many(names[::97])
            assert [bytes(g) for g in got] == values[::97]
            assert await node_lease(store) == lease  # registered under the same lease: it never ran out
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)
        cluster.close()


async def node_lease(store) -> int:
    (member,) = [m for m in await store.client.members() if m.role == "node"]
    return member.lease


def same_address(cluster: KvCluster, name: str) -> int:
    """The node agent's next start listens where it listens now; its port."""
    config, port = cluster.config(name), cluster.announced[name]["port"]
    config.write_text(
        config.read_text().replace("transfer: {host: 127.0.0.1", f"transfer: {{host: 127.0.0.1, port: {port}")
    )
    return port


async def test_a_node_back_at_the_same_address_on_a_new_pool_gets_the_bytes_put_through_its_pool(tmp_path):
    """Same host, objects large enough to go through the node's pool: the node SIGKILLed, its pool
    file deleted (a reboot), and started again at the same address on a new pool. A client that had
    mapped the old pool used to copy new puts into that mapping at offsets the new node reserved in
    its own: acknowledged puts of bytes the node never got (read back over TCP: wrong). The client
    checks the pool's instance before each request through it: every object reads back right from a
    client on TCP alone. (Also the restart with the pool file deleted: served again within seconds.)"""
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=30.0, pool="128MiB", ssd="256MiB")
    try:
        async with cluster.store() as store:
            await ready(store, 1)
            big = 8 * MB  # over SHM_PUT_MIN_BYTES: through the pool
            await store.put("before", blob(1, big), durability=Durability(persist=True))
            assert await store.get("before") == blob(1, big)  # the pool is mapped here now
            port = same_address(cluster, "kv-a")
            cluster.kill("kv-a")
            Path(cluster.pools["kv-a"]).unlink()
            cluster.start_node("kv-a")
            assert cluster.announced["kv-a"]["port"] == port
            deadline = time.monotonic() + 30
            written = {}
            for i in range(3):
                while True:
                    try:
                        await store.put(f"after{i}", blob(10 + i, big))
                        break
                    except Exception:  # noqa: BLE001 - the first may meet the dead node's old connection
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.2)
                written[f"after{i}"] = blob(10 + i, big)
        async with cluster.store(transports=("tcp",)) as tcp:
            assert await lost(tcp, {"before": blob(1, big), **written}) == []
    finally:
        cluster.close()


@pytest.mark.parametrize("deleted", ["pool and directory", "pool"])
async def test_a_same_host_reader_never_reads_what_a_node_back_from_a_reboot_removed(tmp_path, deleted):
    """A client on the node's host reads small objects from the node's directory with no round trip,
    while the node's lease runs. The node SIGKILLed and its pool and directory deleted (a reboot, the
    chaos run's ``kill_node_without_pool``), back within its old lease: another client removes one
    object and replaces another. The first client's mapping of the old directory still said both were
    there, as the dead node left them, and it read them (the chaos run's one non-linearizable history).
    It must see the remove and the new value. With the pool alone deleted, the new node takes the old
    directory file over and publishes offsets in its new pool, which the reader read in the old one."""
    cluster = KvCluster(tmp_path, nodes=("kv-a",), failover_s=30.0, member_ttl=30.0)
    persist = Durability(persist=True)
    try:
        async with cluster.store() as reader, cluster.store(transports=("tcp",), retry_s=20.0) as writer:
            await ready(reader, 1)
            same_address(cluster, "kv-a")  # as ``tiercake up`` restarts it: the reader sees no move
            await reader.put("gone", b"removed after the reboot", durability=persist)
            await reader.put("changed", b"the old value", durability=persist)
            got = await reader.get_many(["gone", "changed"])
            assert [bytes(g) for g in got] == [b"removed after the reboot", b"the old value"]
            assert reader.same_host.directory("kv-a") is not None  # read from the directory: no round trip
            cluster.kill("kv-a")
            if deleted == "pool":
                Path(cluster.pools["kv-a"]).unlink()
            else:
                remove_pool(cluster.pools["kv-a"])  # the pool, its directory and object map: a reboot
            cluster.start_node("kv-a")
            await ready(writer, 1)
            await writer.remove("gone", force=True)
            await writer.put("changed", b"the new value", replace=True, durability=persist)
            with pytest.raises(ObjectNotFound):
                await reader.get("gone")
            assert bytes(await reader.get("changed")) == b"the new value"
    finally:
        cluster.close()


# The README's table of what each durability level survives, cell by cell: the tests that show it.
SURVIVES = {
    "memory": {
        "its node agent's crash and restart": test_a_sigkilled_node_agent_comes_back_with_everything_it_held,
        "its node's pool file (a reboot), eviction": test_memory_level_objects_are_lost_with_the_pool_file_and_say_so,
    },
    "replicated": {
        "N-1 of its nodes lost for good; never evicted": test_replicated_objects_outlive_a_node_gone_for_good,
    },
    "persisted": {
        "any outage of its node, of any length (meanwhile -703, never -704), a reboot; never evicted": (
            test_persisted_objects_of_a_node_away_long_past_its_failover_all_read_back_when_it_returns
        ),
    },
}


def test_the_readmes_table_of_what_each_level_survives_is_what_the_tests_show():
    from paths import README

    rows = [
        line for line in README.read_text().splitlines() if line.startswith(("| memory", "| replicated", "| persisted"))
    ]
    table = {cells[0]: cells[2:4] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}
    assert set(table) == set(SURVIVES)
    for level, shown in SURVIVES.items():
        assert set(shown) <= set(table[level]), (level, table[level])
        assert all(callable(test) and test.__name__.startswith("test_") for test in shown.values())
