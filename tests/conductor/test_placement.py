"""The placement index on both metadata backends."""

import asyncio
import uuid

import pytest

from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.placement import PlacementIndex, Replica

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture
def prefix():
    return f"/t/{uuid.uuid4().hex[:10]}/placements/".encode()


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


async def test_add_is_durable_and_a_new_index_rebuilds_it(meta, prefix):
    index = await PlacementIndex(meta, prefix).start()
    await index.add("t1", k(1), "node-a", "pool", 4096)
    await index.add("t1", k(1), "node-b", "ssd", 4096)
    assert index.holders("t1", k(1)) == {Replica("node-a", "pool"): 4096, Replica("node-b", "ssd"): 4096}
    fresh = await PlacementIndex(meta, prefix).start(follow=False)  # a standby taking over
    assert fresh.holders("t1", k(1)) == index.holders("t1", k(1)) and len(fresh) == 2
    await index.remove("t1", k(1), "node-a", "pool")
    again = await PlacementIndex(meta, prefix).start(follow=False)
    assert again.holders("t1", k(1)) == {Replica("node-b", "ssd"): 4096}
    for i in (index, fresh, again):
        await i.close()


async def test_group_commit_batches_concurrent_adds(meta, prefix):
    index = await PlacementIndex(meta, prefix).start(follow=False)
    await asyncio.gather(*(index.add("t", k(i), "node-a", "pool", 1) for i in range(1000)))
    assert len(index) == 1000
    assert index.stats.commits < 50 and index.stats.largest_batch > 20  # far fewer round trips than adds
    fresh = await PlacementIndex(meta, prefix).start(follow=False)
    assert len(fresh) == 1000
    await index.close()
    await fresh.close()


async def test_removing_many_replicas_is_one_item_of_the_group_commit(meta, prefix):
    index = await PlacementIndex(meta, prefix).start(follow=False)
    keys = [k(i) for i in range(300)]
    await index.add_many("t", keys, "node-a", "pool", [1] * 300)
    before = index.stats.txns
    await index.remove_many("t", keys[:290], "node-a", "pool")
    assert index.stats.txns - before == 3 and index.stats.changes["pool-"] == 290  # ceil(290 / 128)
    fresh = await PlacementIndex(meta, prefix).start(follow=False)
    assert len(fresh) == 10
    await index.close()
    await fresh.close()


async def test_longest_prefix_per_node_and_tenants_apart(meta, prefix):
    index = await PlacementIndex(meta, prefix).start(follow=False)
    chain = [k(i) for i in range(6)]
    for key in chain[:4]:
        await index.add("t", key, "node-a", "pool", 1)
    for key in chain[:2]:
        await index.add("t", key, "node-b", "gpu", 1)
        await index.add("t", key, "node-b", "ssd", 1)
    await index.add("t", chain[5], "node-c", "pool", 1)  # a deep block without its prefix: useless
    found = index.lookup("t", chain)
    assert {n: p.length for n, p in found.items()} == {"node-a": 4, "node-b": 2}
    assert found["node-b"].tiers == {"gpu": 2, "ssd": 2}
    assert found["node-b"].runs() == [("gpu", 2)]  # each block read from its fastest tier
    await index.add("t", chain[4], "node-a", "ssd", 1)
    await index.add("t", chain[5], "node-a", "ssd", 1)
    await index.add("t", chain[1], "node-a", "ssd", 1)
    held = index.lookup("t", chain)["node-a"]
    assert held.length == 6 and held.runs() == [("pool", 4), ("ssd", 2)]
    from tiercake.messages import PrefixHolding

    holding = PrefixHolding(length=6, tiers=held.tiers, runs=held.runs())
    assert holding.served_from(2, 4) == {"pool": 2, "ssd": 2}  # what a worker holding 2 blocks loads
    assert index.lookup("other-tenant", chain) == {}
    assert index.lookup("t", []) == {}
    with pytest.raises(ValueError):
        await index.add("bad/tenant", k(1), "n", "pool", 1)
    await index.close()


async def test_a_dead_nodes_placements_vanish_from_followers(meta, prefix):
    leader = await PlacementIndex(meta, prefix).start()
    follower = await PlacementIndex(meta, prefix).start()
    lease = await meta.grant_lease(30)
    await leader.add("t", k(1), "node-a", "pool", 1, lease=lease)
    await leader.add("t", k(1), "node-b", "pool", 1)
    for _ in range(100):  # the follower learns through the watch
        await asyncio.sleep(0.02)
        if len(follower.holders("t", k(1))) == 2:
            break
    assert len(follower.holders("t", k(1))) == 2
    await meta.revoke_lease(lease)  # node-a's lease ends (expiry does the same, just later)
    for _ in range(100):
        await asyncio.sleep(0.02)
        if len(follower.holders("t", k(1))) == 1 and len(leader.holders("t", k(1))) == 1:
            break
    assert follower.holders("t", k(1)) == {Replica("node-b", "pool"): 1}
    assert leader.holders("t", k(1)) == {Replica("node-b", "pool"): 1}
    assert follower.node_blocks("node-a") == []
    await leader.close()
    await follower.close()


async def test_lookups_served_while_etcd_is_down(tmp_path):
    from tiercake.conductor.etcd_process import EtcdCluster
    from tiercake.conductor.metadata import MetadataUnavailableError, retry_unavailable

    cluster = EtcdCluster(tmp_path, size=1).start()
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=1.0, attempts=1).start()
        index = await PlacementIndex(meta, b"/p/").start()
        await index.add("t", k(1), "node-a", "pool", 1)
        cluster.members[0].stop()
        assert index.lookup("t", [k(1)])["node-a"].length == 1  # from memory
        with pytest.raises(MetadataUnavailableError):
            await index.add("t", k(2), "node-a", "pool", 1)  # clear and retryable
        assert index.holders("t", k(2)) == {}  # not durable, so not visible
        cluster.members[0].start()
        cluster.members[0].wait_ready()
        await retry_unavailable(lambda: index.add("t", k(2), "node-a", "pool", 1))
        assert index.lookup("t", [k(1), k(2)])["node-a"].length == 2
        await index.close()
        await meta.close()
    finally:
        cluster.stop()


async def test_add_many_and_last_change_wins_within_a_batch(meta, prefix):
    index = await PlacementIndex(meta, prefix).start(follow=False)
    await index.add_many("t", [k(i) for i in range(300)], "node-a", "pool", [7] * 300)
    assert len(index) == 300 and index.lookup("t", [k(i) for i in range(300)])["node-a"].length == 300
    # an add and a remove of the same replica queued together: the later one decides
    await asyncio.gather(index.add("t", k(999), "node-b", "pool", 1), index.remove("t", k(999), "node-b", "pool"))
    fresh = await PlacementIndex(meta, prefix).start(follow=False)
    assert fresh.holders("t", k(999)) == {} and len(fresh) == 300
    with pytest.raises(ValueError, match="keys for"):
        await index.add_many("t", [k(1)], "node-a", "pool", [])
    await index.close()
    await fresh.close()


async def test_volatile_tiers_stay_in_memory_and_go_with_their_node(meta, prefix):
    """A worker's gpu tier changes with every request: its replicas are served from memory and never
    written to the backend, so a standby rebuilding from the backend has none; a node that leaves
    takes its own along, and a new term starts with none."""
    index = await PlacementIndex(meta, prefix, volatile_tiers=["gpu"]).start()
    chain = [k(i) for i in range(4)]
    await index.add_many("t", chain, "worker-a", "gpu", [1] * 4)
    await index.add_many("t", chain[:2], "worker-b", "gpu", [1] * 2)
    await index.add_many("t", chain[:3], "node-a", "pool", [1] * 3)
    await index.remove("t", chain[3], "worker-a", "gpu")
    found = index.lookup("t", chain)
    assert {n: p.length for n, p in found.items()} == {"worker-a": 3, "worker-b": 2, "node-a": 3}
    assert index.stats.ops == 3 and index.stats.volatile_ops == 7  # only the pool's reached the backend
    kvs, _ = await meta.range(prefix)
    assert len(kvs) == 3 and not any(kv.key.endswith(b"/gpu") for kv in kvs)
    fresh = await PlacementIndex(meta, prefix, volatile_tiers=["gpu"]).start(follow=False)
    assert set(fresh.lookup("t", chain)) == {"node-a"}
    assert index.drop_volatile("worker-a") == 3 and set(index.lookup("t", chain)) == {"worker-b", "node-a"}
    assert index.used[("worker-a", "gpu")] == 0
    assert index.drop_volatile() == 2 and set(index.lookup("t", chain)) == {"node-a"}
    with pytest.raises(ValueError):  # names are checked as for durable replicas
        await index.add("t/x", k(9), "worker-a", "gpu", 1)
    # a gpu replica a conductor that kept gpu durable left in the backend is not loaded
    durable = await PlacementIndex(meta, prefix).start(follow=False)
    await durable.add("t", k(7), "worker-c", "gpu", 1)
    upgraded = await PlacementIndex(meta, prefix, volatile_tiers=["gpu"]).start(follow=False)
    assert upgraded.lookup("t", [k(7)]) == {}
    for i in (index, fresh, durable, upgraded):
        await i.close()


async def test_the_volatile_log_answers_changes_in_order_or_asks_for_a_snapshot(meta, prefix):
    """What a follower conductor reads from the leader: each change after its last one, in order, or
    None once it fell further behind than the log keeps; a snapshot then replaces what it held."""
    leader = await PlacementIndex(meta, prefix, volatile_tiers=["gpu"], volatile_log=4).start(follow=False)
    follower = await PlacementIndex(meta, prefix, volatile_tiers=["gpu"]).start(follow=False)
    await leader.add_many("t", [k(1), k(2)], "w", "gpu", [10, 20])
    changes = leader.volatile_changes(0)
    assert changes == [("t", k(1), "w", "gpu", 10), ("t", k(2), "w", "gpu", 20)] and leader.volatile_changes(2) == []
    follower.apply_volatile(changes, reset=False)
    await leader.remove("t", k(1), "w", "gpu")
    follower.apply_volatile(leader.volatile_changes(2), reset=False)
    assert follower.holders("t", k(1)) == {} and follower.holders("t", k(2)) == {Replica("w", "gpu"): 20}
    await leader.add_many("t", [k(3), k(4), k(5), k(6)], "w", "gpu", [1] * 4)
    assert leader.volatile_changes(2) is None and leader.volatile_changes(99) is None  # behind the log, or ahead
    assert len(leader.volatile_changes(3)) == 4
    follower.apply_volatile([("t", k(9), "gone", "gpu", 1)], reset=False)
    follower.apply_volatile(leader.volatile_snapshot(), reset=True)
    assert sorted(follower.volatile_snapshot()) == sorted(leader.volatile_snapshot())
    assert len(follower.volatile_snapshot()) == 5 and follower.holders("t", k(9)) == {}
    # a node that leaves: its replicas go, and the log tells the followers
    seq = leader.volatile_seq
    assert leader.drop_volatile("w") == 5 and all(size is None for *_, size in leader.volatile_changes(seq + 1))
    waiting = asyncio.create_task(leader.wait_volatile(leader.volatile_seq, 5))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await leader.add("t", k(1), "w", "gpu", 1)
    await asyncio.wait_for(waiting, 1)  # woken by the change
    await leader.close()
    await follower.close()
