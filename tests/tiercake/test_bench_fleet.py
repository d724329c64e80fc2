"""`tiercake bench fleet` on a small fleet: real etcd, two conductor processes, simulated nodes.

What the bench's figures rest on is checked here, not its numbers: every lookup found the chain it
asked for whole, a node that stopped renewing its lease is gone from lookups within about its TTL,
and after the leader is SIGKILLed the other conductor leads and lists every live node's chain."""

import json
import math
import os
import subprocess
import sys

import pytest

from tiercake.bench.fleet_load import TTL_S

pytestmark = pytest.mark.cluster

FIGURES = (
    "placements_per_s",
    "placements_per_conductor_cpu_s",
    "lookup_p50",
    "lookup_p99",
    "conductor_rss_per_mreplica",
    "etcd_db_bytes",
    "keepalive_p50",
    "dead_node_s",
    "failover_s",
)


def test_a_small_fleet_is_served_through_a_dead_node_and_a_failover(tmp_path):
    out = tmp_path / "fleet.json"
    command = ["bench", "fleet", "--quick", "--nodes", "12", "--blocks-per-node", "256", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {f["name"] for f in report["figures"]}
    assert names == {f"fleet.{index}.n12.{name}" for index in ("durable", "memory") for name in FIGURES}, names
    for index in ("durable", "memory"):
        _check({f["name"].removeprefix(f"fleet.{index}.n12."): f for f in report["figures"] if index in f["name"]})


def _check(figures: dict) -> None:
    for f in figures.values():
        assert math.isfinite(f["value"]) and f["value"] >= 0 and f["limit"] > 0, f
        assert f["params"]["replicas"] == 12 * 256, f  # the whole fill, within the budget
    lookups = figures["lookup_p50"]["params"]
    assert lookups["found_whole"] == f"{lookups['lookups']}/{lookups['lookups']}"
    assert figures["dead_node_s"]["value"] < TTL_S + 3
    assert figures["failover_s"]["params"]["missing_after"] == 0
    assert figures["failover_s"]["value"] < 60
    assert figures["keepalive_p50"]["params"]["errors"] == 0
