"""`tiercake bench fleet` on a small fleet: real etcd, two conductor processes, simulated nodes.

What the bench's figures rest on is checked here, not its numbers: every lookup found the chain it
asked for whole, no placement reached etcd, a node that stopped renewing its lease is gone from both
conductors' lookups within about its TTL, and after the leader is SIGKILLed the other conductor
leads and lists every live node's chain; the plot draws each figure against the fleet size."""

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
    "placements_per_leader_cpu_s",
    "etcd_writes_per_s",
    "lookup_p50",
    "lookup_p99",
    "lookup_p50_follower",
    "lookup_p99_follower",
    "lookup_p50_client",
    "lookup_p99_client",
    "conductor_rss_per_replica",
    "etcd_db_bytes",
    "keepalive_p50",
    "dead_node_s",
    "failover_s",
)


def test_a_small_fleet_is_served_through_a_dead_node_and_a_failover(tmp_path):
    out, plot = tmp_path / "fleet.json", tmp_path / "fleet.png"
    command = ["bench", "fleet", "--quick", "--nodes", "12", "--blocks-per-node", "256", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", *command, "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {f["name"] for f in report["figures"]}
    assert names == {f"fleet.n12.{name}" for name in FIGURES}, names
    _check({f["name"].removeprefix("fleet.n12."): f for f in report["figures"]})
    assert plot.read_bytes().startswith(b"\x89PNG")


def _check(figures: dict) -> None:
    for f in figures.values():
        assert math.isfinite(f["value"]) and f["value"] >= 0 and f["limit"] > 0, f
        assert f["params"]["replicas"] == 12 * 256, f  # the whole fill, within the budget
    for where in ("", "_follower", "_client"):  # the follower's mirror as whole as the leader's index
        lookups = figures[f"lookup_p50{where}"]["params"]
        assert lookups["found_whole"] == f"{lookups['lookups']}/{lookups['lookups']}"
    assert figures["dead_node_s"]["value"] < TTL_S + 3
    assert figures["failover_s"]["params"]["missing_after"] == 0
    assert figures["failover_s"]["value"] < 60
    assert figures["keepalive_p50"]["params"]["errors"] == 0
    writes = figures["etcd_writes_per_s"]
    assert writes["params"]["etcd_revisions"] < 12 * 256 / 64  # not one a placement, nor one a report
