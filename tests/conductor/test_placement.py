"""The placement index in a conductor's memory: its answers, its change log and its snapshots."""

import asyncio
import random

import numpy as np
import pytest

from tiercake.conductor import placement
from tiercake.conductor.placement import Change, PlacementIndex, Replica


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
async def index():
    built = await PlacementIndex().start()
    yield built
    await built.close()


async def test_longest_prefix_per_node_and_tenants_apart(index):
    chain = [k(i) for i in range(6)]
    index.add_many("t", chain[:4], "node-a", "pool", [1] * 4)
    index.add_many("t", chain[:2], "node-b", "gpu", [1] * 2)
    index.add_many("t", chain[:2], "node-b", "ssd", [1] * 2)
    index.add_many("t", chain[5:], "node-c", "pool", [1])  # a deep block without its prefix: useless
    found = index.lookup("t", chain)
    assert {n: p.length for n, p in found.items()} == {"node-a": 4, "node-b": 2}
    assert found["node-b"].tiers == {"gpu": 2, "ssd": 2}
    assert found["node-b"].runs() == [("gpu", 2)]  # each block read from its fastest tier
    index.add_many("t", [chain[4], chain[5], chain[1]], "node-a", "ssd", [1] * 3)
    held = index.lookup("t", chain)["node-a"]
    assert held.length == 6 and held.runs() == [("pool", 4), ("ssd", 2)] and held.tiers == {"pool": 4, "ssd": 3}
    from tiercake.messages import PrefixHolding

    holding = PrefixHolding(length=6, tiers=held.tiers, runs=held.runs())
    assert holding.served_from(2, 4) == {"pool": 2, "ssd": 2}  # what a worker holding 2 blocks loads
    assert index.lookup("other-tenant", chain) == {}
    assert index.lookup("t", []) == {}
    with pytest.raises(ValueError):
        index.add_many("bad/tenant", [k(1)], "n", "pool", [1])
    with pytest.raises(ValueError, match="32 bytes"):
        index.lookup("t", [b"short"])


async def test_a_report_says_what_is_new_and_sizes_count_per_node_and_tier(index):
    assert index.add_many("t", [k(1), k(2), k(1)], "node-a", "pool", [10, 20, 10]) == 2  # a key twice counts once
    assert index.add_many("t", [k(1), k(2)], "node-a", "pool", [10, 20]) == 0  # nothing new
    assert index.add_many("t", [k(1)], "node-a", "ssd", [10]) == 1
    assert index.used_bytes("node-a", "pool") == 30 and index.used_bytes("node-a", "ssd") == 10
    assert index.add_many("t", [k(2)], "node-a", "pool", [25]) == 1  # a new size is news too
    assert index.used_bytes("node-a", "pool") == 35
    assert index.holders("t", k(1)) == {Replica("node-a", "pool"): 10, Replica("node-a", "ssd"): 10}
    assert index.remove_many("t", [k(1), k(9)], "node-a", "pool") == 1  # k(9) was never there
    assert index.used_bytes("node-a", "pool") == 25 and len(index) == 2
    for bad in ([-1], [1 << 32], [1, 2]):
        with pytest.raises(ValueError):
            index.add_many("t", [k(3)], "node-a", "pool", bad)
    assert index.stats.changes["pool+"] == 3 and index.stats.changes["pool-"] == 1


async def test_a_hot_block_held_by_many_nodes_keeps_every_holder(index):
    """Two holders of a block live in its row, the rest beside it; every one is found and kept in
    order as holders come and go."""
    chain = [k(i) for i in range(3)]
    for n in range(5):
        index.add_many("t", chain, f"node-{n}", "pool", [4] * 3)
    assert set(index.lookup("t", chain)) == {f"node-{n}" for n in range(5)}
    assert all(p.length == 3 for p in index.lookup("t", chain).values())
    index.remove_many("t", chain[1:], "node-0", "pool")
    index.remove_many("t", chain, "node-3", "pool")
    found = index.lookup("t", chain)
    assert {n: p.length for n, p in found.items()} == {"node-0": 1, "node-1": 3, "node-2": 3, "node-4": 3}
    assert index.drop_node("node-1") == 3 and len(index) == 1 + 3 + 3
    assert index.used_bytes("node-1", "pool") == 0 and index.node_blocks("node-1") == []
    assert sorted(index.node_blocks("node-4")) == sorted(("t", key, "pool", 4) for key in chain)


async def test_the_log_answers_changes_in_order_or_asks_for_a_snapshot():
    """What a follower conductor reads from the leader: each change after its last one, in order, or
    None once it fell further behind than the log keeps; a node that leaves is one change."""
    leader = await PlacementIndex(log_keys=8).start()
    follower = await PlacementIndex().start()
    try:
        leader.add_many("t", [k(1), k(2)], "w", "gpu", [10, 20])
        leader.add_many("t", [k(1)], "w", "gpu", [10])  # nothing new: nothing logged
        changes = leader.changes_after(0)
        assert [(c.kind, len(c.keys), c.sizes.tolist()) for c in changes] == [("add", 2, [10, 20])]
        assert leader.changes_after(1) == []
        follower.apply(changes)
        leader.remove_many("t", [k(1)], "w", "gpu")
        follower.apply(leader.changes_after(1))
        assert follower.holders("t", k(1)) == {} and follower.holders("t", k(2)) == {Replica("w", "gpu"): 20}
        leader.add_many("t", [k(i) for i in range(3, 10)], "w", "gpu", [1] * 7)
        assert leader.changes_after(1) is None and leader.changes_after(99) is None  # behind the log, or ahead
        assert leader.drop_node("w") == 8 and leader.changes_after(leader.seq - 1)[0].kind == "drop"
        waiting = asyncio.create_task(leader.wait_change(leader.seq, 5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        leader.add_many("t", [k(1)], "w", "gpu", [1])
        await asyncio.wait_for(waiting, 1)  # woken by the change
    finally:
        await leader.close()
        await follower.close()


async def test_a_snapshot_read_page_by_page_while_changes_go_on_ends_exact(monkeypatch):
    """A follower that starts late reads the table a page at a time while the leader keeps taking
    changes (adds, removals, a node leaving and coming back); the pages and then the changes logged
    since the first page leave it exactly where the leader is."""
    monkeypatch.setattr(placement, "SNAPSHOT_ROWS", 16)
    rng = random.Random(7)
    leader, follower = PlacementIndex(), PlacementIndex()
    nodes, tiers = [f"n{i}" for i in range(4)], ["gpu", "pool", "ssd"]

    def churn(steps: int) -> None:
        for _ in range(steps):
            keys = [k(rng.randrange(300)) for _ in range(rng.randrange(1, 8))]
            node, tier = rng.choice(nodes), rng.choice(tiers)
            what = rng.random()
            if what < 0.6:
                leader.add_many(rng.choice("ab"), keys, node, tier, [7] * len(keys))
            elif what < 0.95:
                leader.remove_many(rng.choice("ab"), keys, node, tier)
            else:
                leader.drop_node(node)

    churn(400)
    start = leader.seq
    page, row = leader.snapshot(0)
    follower.apply(page, reset=True)
    while row is not None:
        churn(5)
        page, row = leader.snapshot(row)
        follower.apply(page)
    churn(20)
    follower.apply(leader.changes_after(start, max_keys=1 << 30))
    for node in nodes:
        assert sorted(follower.node_blocks(node)) == sorted(leader.node_blocks(node))
    assert len(follower) == len(leader)


async def test_a_winning_follower_keeps_its_mirror_of_members_only(index):
    index.add_many("t", [k(1), k(2)], "stays", "pool", [1, 1])
    index.add_many("t", [k(1)], "left", "gpu", [1])
    assert index.keep_mirror(["stays"]) == 2
    assert set(index.lookup("t", [k(1)])) == {"stays"} and index.changes_after(index.seq) == []
    assert index.clear() == 2 and len(index) == 0 and index.lookup("t", [k(1)]) == {}


async def test_a_follower_applies_what_the_leader_sends_as_arrays():
    """The feed's changes carry keys as one array and sizes as another, as they go on the wire."""
    follower = PlacementIndex()
    keys = np.frombuffer(k(1) + k(2), dtype="<u8").reshape(-1, 4)
    follower.apply([Change("add", "t", "n", "pool", keys, np.array([5, 6], dtype=np.uint32))])
    assert follower.lookup("t", [k(1), k(2)])["n"].sizes() == [5, 6]
    follower.apply([Change("drop", node="n")])
    assert len(follower) == 0
