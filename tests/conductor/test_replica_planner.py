"""The leader's hot-block replication plan (``conductor/replica_planner.py``), on a stand-in
conductor (the planner reads its index, members, access rates and policies, nothing else)."""

from types import SimpleNamespace

from tiercake.conductor.heat import AccessRates
from tiercake.conductor.placement import Replica
from tiercake.conductor.replica_planner import ReplicaPlanner
from tiercake.messages import MemberInfo
from tiercake.policies.placement import HotReplicas, LeastUsed

NODES = [f"n{i}" for i in range(20)]


class Index:
    """Block -> holders, counting how often the planner asks."""

    def __init__(self, held: dict[bytes, set[str]]) -> None:
        self.held, self.asked = held, 0

    def used_bytes(self, node: str, tier: str) -> int:
        return 0

    def holders(self, tenant: str, key: bytes) -> dict[Replica, int]:
        self.asked += 1
        return {Replica(node, "pool"): 4096 for node in sorted(self.held.get(key, ()))}

    def holders_many(self, tenant: str, keys: list[bytes]) -> list[dict[Replica, int]]:
        return [self.holders(tenant, key) for key in keys]


def conductor(blocks: int, hot: set[int]) -> SimpleNamespace:
    heat = AccessRates(half_life=30)
    for i in range(blocks):
        heat.add([(("t", b"k%d" % i), 10_000.0 if i in hot else 1.0)])
    index = Index({b"k%d" % i: {NODES[i % len(NODES)]} for i in range(blocks)})
    members = {n: MemberInfo(node_id=n, role="node", tiers={"pool": 1 << 30}) for n in NODES}
    return SimpleNamespace(
        heat=heat,
        index=index,
        members=SimpleNamespace(members=members, alive=lambda role=None: list(members.values())),
        replication=HotReplicas(base=1, threshold=10, maximum=3),
        placement=LeastUsed(),
        pins=set(),
    )


async def test_every_node_renewing_costs_one_pass_over_the_hot_blocks_not_one_each():
    c = conductor(blocks=500, hot={3, 7})
    planner = ReplicaPlanner(c)
    assert planner.tasks("n0") == []  # no plan yet: one is made in the background, off the keep-alive
    await planner._planning
    handed = {n: planner.tasks(n) for n in NODES}
    assert c.index.asked < 10 + 100, c.index.asked  # one pass over the hot (and a check per task), not 20
    copies = [(n, m.key) for n, moves in handed.items() for m in moves]
    # each hot block gets its two more replicas once, on nodes that do not hold it, from its holder
    assert sorted(key for _, key in copies) == [b"k3", b"k3", b"k7", b"k7"]
    for node, key in copies:
        assert node not in c.index.held[key]
    assert all({m.source} == c.index.held[m.key] for moves in handed.values() for m in moves)
    assert all(planner.tasks(n) == [] for n in NODES)  # handed out: not again until done or due
    # the next plan looks only at blocks read since, and at those with more than one replica wanted
    c.index.asked = 0
    c.heat.add([(("t", b"k11"), 1000.0)])
    await planner.plan()
    assert c.index.asked <= 3 + 4, c.index.asked  # k3, k7 (watched) and k11 (read, hot), not all 500
    c.index.asked = 0
    c.heat.add([(("t", b"k12"), 1.0)])  # read, but too seldom for a second replica: not asked of
    await planner.plan()
    assert c.index.asked <= 3, c.index.asked


async def test_a_move_the_index_shows_done_is_not_handed_out():
    c = conductor(blocks=10, hot={3})
    planner = ReplicaPlanner(c)
    await planner.plan()
    first = planner.tasks("n19")  # the plan: k3 goes to two nodes that lack it (not n19)
    targets = {n for n, moves in planner._plan.items() for m in moves if m.key == b"k3"}
    assert len(targets) == 2 and not first
    done, other = sorted(targets)
    c.index.held[b"k3"].add(done)  # it copied the block meanwhile (another path, a report)
    assert planner.tasks(done) == []
    assert [m.key for m in planner.tasks(other)] == [b"k3"]


def test_the_blocks_read_since_the_last_plan_stay_within_the_tracked_ones():
    """A follower counts accesses too and never plans: what it read since stays bounded."""
    heat = AccessRates(half_life=30, max_keys=100)
    for i in range(1000):
        heat.add([(("t", b"k%d" % i), 1.0)])
    heat.forget(("t", b"k999"))
    assert len(heat._touched) <= 100  # held between plans: at most what is tracked
    touched = heat.take_touched()
    assert len(touched) <= 100 and ("t", b"k999") not in touched
    assert touched <= {key for key, _ in heat.items()}
