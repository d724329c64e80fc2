"""`tiercake bench metadata --quick`: the in-memory index against raw etcd, probes and a flat array.

Its numbers are the bench's to report; checked here is what they rest on: every figure measured
against a limit from the same run, and the index's own account of its memory (rows and slots, not a
timing) near a flat array's."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # it starts an etcd


def test_the_metadata_bench_writes_every_figure_against_a_limit(tmp_path):
    out = tmp_path / "metadata.json"
    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", "bench", "metadata", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert set(figures) == {
        "ingest.placements_per_s_per_core",
        "ingest.vs_raw_etcd",
        "lookup.chain64_p50",
        "lookup.chain64_p99",
        "memory.bytes_per_replica",
    }
    for f in figures.values():
        assert math.isfinite(f["value"]) and f["value"] > 0 and f["limit"] > 0, f
        assert f["params"]["blocks"] == 200_000 and f["params"]["replicas"] >= 300_000, f  # pool, and SSD for half
    per_block = figures["memory.bytes_per_replica"]["params"]
    # a row, its hash slots, and each holder's entry in its node's row list (4 bytes, a quarter to grow)
    assert per_block["table_bytes_per_block"] <= 48 + 8 / 0.3 + 4 * 1.25 * per_block["replicas"] / per_block["blocks"]
