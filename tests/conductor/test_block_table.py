"""The placement index's table, checked against a plain model under random batches: every answer,
count and byte total the same, while its hash table grows, is moved a slice at a time and fills with
tombstones."""

import random

import numpy as np
import pytest

from tiercake.conductor import block_table
from tiercake.conductor.block_table import BlockTable, IndexFullError, as_keys, key_bytes


@pytest.fixture
def small(monkeypatch):
    """A table that starts tiny and moves a few slots per batch, so growth and moves happen often."""
    monkeypatch.setattr(block_table, "MIN_SLOTS", 16)
    monkeypatch.setattr(block_table, "MIGRATE_SLOTS", 8)
    monkeypatch.setattr(block_table.NodeRows, "MIN_FILTER", 8)  # and each node's row list is filtered often


@pytest.mark.parametrize("seed", range(4))
def test_the_table_answers_as_a_model_does(small, seed):
    rng = random.Random(seed)
    table = BlockTable(reserve=1 << 14)
    model: dict[tuple[str, bytes], set[tuple[str, str]]] = {}
    sizes: dict[tuple[str, bytes], int] = {}
    keys = [rng.randbytes(32) for _ in range(300)]
    nodes, tiers = [f"n{i}" for i in range(5)], ["gpu", "pool", "ssd", "cxl"]
    for _ in range(1500):
        tenant, node, tier = rng.choice("ab"), rng.choice(nodes), rng.choice(tiers)
        batch = [rng.choice(keys) for _ in range(rng.randrange(1, 12))]
        what = rng.random()
        if what < 0.55:
            chosen: dict[bytes, int] = {}
            for key in batch:  # mostly a block's known size, now and then another
                chosen.setdefault(key, sizes.get((tenant, key), 10) if rng.random() < 0.9 else rng.choice([10, 20]))
            new = table.add(tenant, as_keys(batch), node, tier, np.array([chosen[x] for x in batch], np.uint32))
            expected, seen = [], set()
            for key in batch:
                first = key not in seen
                seen.add(key)
                held = model.setdefault((tenant, key), set())
                expected.append(first and ((node, tier) not in held or sizes.get((tenant, key)) != chosen[key]))
                if first:
                    held.add((node, tier))
                    sizes[(tenant, key)] = chosen[key]
            assert new.tolist() == expected
        elif what < 0.95:
            gone = table.remove(tenant, as_keys(batch), node, tier)
            expected, seen = [], set()
            for key in batch:
                held = model.get((tenant, key), set())
                expected.append(key not in seen and (node, tier) in held)
                seen.add(key)
                held.discard((node, tier))
                if not held:
                    model.pop((tenant, key), None)
                    sizes.pop((tenant, key), None)
            assert gone.tolist() == expected
        else:
            before = sum(len(h) for h in model.values())
            model = {key: {r for r in h if r[0] != node} for key, h in model.items()}
            model = {key: h for key, h in model.items() if h}
            sizes = {key: s for key, s in sizes.items() if key in model}
            assert table.drop_node(node) == before - sum(len(h) for h in model.values())
        assert table.replicas == sum(len(h) for h in model.values()) and table.blocks == len(model)
    for tenant in "ab":
        for key in keys:
            held = table.holders(tenant, as_keys([key]))[0]
            assert sorted((n, t) for n, t, _ in held) == sorted(model.get((tenant, key), ()))
    for node in nodes:
        for tier in tiers:
            assert table.used_bytes(node, tier) == sum(sizes[x] for x, h in model.items() if (node, tier) in h)
        rows, _ = table.node_rows(node)
        held = {(int(table.tenant[r]), bytes(table.keys[r].tobytes())) for r in rows.tolist()}
        tids = {name: table.tenants.id(name, create=False) for name in "ab"}
        assert held == {(tids[t], key) for (t, key), h in model.items() if any(n == node for n, _ in h)}


def test_a_chain_is_found_per_holder_up_to_its_first_gap():
    table = BlockTable(reserve=1 << 12)
    chain = [bytes([i]) * 32 for i in range(8)]
    table.add("t", as_keys(chain[:6]), "a", "pool", np.full(6, 3, np.uint32))
    table.add("t", as_keys(chain[:3]), "b", "gpu", np.full(3, 3, np.uint32))
    table.add("t", as_keys(chain[:8]), "c", "ssd", np.full(8, 3, np.uint32))
    table.remove("t", as_keys(chain[4:5]), "c", "ssd")
    found = {node: len(bits) for node, (bits, _) in table.chain("t", as_keys(chain)).items()}
    assert found == {"a": 6, "b": 3, "c": 4}
    assert table.chain("t", as_keys(chain[1:2] + chain[:1])) != {}  # any held first block starts a walk
    assert table.chain("t", as_keys([b"z" * 32])) == {}
    assert key_bytes(as_keys(chain)) == chain


def test_more_blocks_than_reserved_is_a_clear_error():
    table = BlockTable(reserve=1024)
    table.add("t", as_keys([i.to_bytes(32, "big") for i in range(1024)]), "n", "pool", np.ones(1024, np.uint32))
    with pytest.raises(IndexFullError, match="index_max_blocks"):
        table.add("t", as_keys([b"x" * 32]), "n", "pool", np.ones(1, np.uint32))
    table.remove("t", as_keys([(0).to_bytes(32, "big")]), "n", "pool")  # a removed block's row is reused
    table.add("t", as_keys([b"x" * 32]), "n", "pool", np.ones(1, np.uint32))
    assert table.blocks == 1024


def test_memory_follows_the_blocks_held_not_the_reservation():
    """A table reserving a billion blocks costs what its blocks use: 48 bytes of row each, the
    hash table's slots (8 bytes, at 0.4-0.75 full) and the node's list of its rows (4 bytes, and a
    quarter more of room to grow), near a flat array's 40."""
    table = BlockTable()  # the default reservation: 2^30 blocks of address space
    rng = np.random.default_rng(0)
    for _ in range(100):
        keys = rng.integers(0, 1 << 63, size=(1000, 4), dtype=np.uint64)
        table.add("t", keys, "n", "pool", np.ones(1000, np.uint32))
    assert table.blocks == 100_000
    assert 48 < table.memory() / table.blocks <= 48 + 8 / 0.3 + 4 * 1.25


@pytest.mark.parametrize(
    "make",
    [
        lambda i: i.to_bytes(4, "big") * 8,  # the tests' keys
        lambda i: i.to_bytes(32, "big"),  # a counter in the last bytes
        lambda i: (i % 977).to_bytes(8, "big") + (i // 977).to_bytes(8, "big") + bytes(16),  # node, chain
    ],
)
def test_keys_that_differ_in_a_few_bytes_spread_as_random_ones_do(make):
    """A key's slot is drawn from all its bits: keys that are counters in a few bytes (as tests' and
    benches' are) fill as many buckets as random keys would. A hash that left them in a few bits
    once made each report probe thousands of slots (a 100-node fleet bench starved its leader)."""
    n, buckets = 100_000, 1 << 17
    spread = block_table._hash(as_keys([make(i) for i in range(n)]), np.uint64(7)) & np.uint64(buckets - 1)
    expected = buckets * (1 - np.exp(-n / buckets))
    assert len(np.unique(spread)) > 0.98 * expected
