"""The CLI as a user runs it: real subprocesses."""

import json
import os
import subprocess
import sys


def tiercake(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "tiercake.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_help_reads_well():
    done = tiercake("--help")
    assert done.returncode == 0
    for command in ("up", "ask", "demo", "bench", "policy", "config", "simulate", "replay", "trace"):
        assert command in done.stdout
    assert "bench store" in tiercake("bench", "store", "--help").stdout.replace("usage: tiercake ", "bench store ")


def test_every_command_and_subcommand_has_a_help_that_renders():
    """argparse renders a help only when asked: a stray % in one crashes `--help` (it did, for bench).
    Rendered in this process through the parser itself, every level of every command."""
    import argparse

    from tiercake.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += walk(sub, path + [name])
        return found

    parser = build_parser()
    paths = walk(parser, [])
    assert ["bench", "vllm"] in paths and ["up"] in paths and len(paths) > 20
    for path in paths:
        node = parser
        for name in path:
            node = next(a for a in node._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        assert node.format_help(), path  # raises on a help string that does not format


def test_demo_twice_finds_its_ssd_blocks(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "store:\n  tiers:\n"
        "    - {kind: gpu, capacity: 512KiB, device: cpu}\n"
        f"    - {{kind: pool, capacity: 1MiB, path: /dev/shm/tiercake-cli-test-{os.getpid()}}}\n"
        f"    - {{kind: ssd, capacity: 64MiB, path: {tmp_path / 'ssd'}}}\n"
    )
    first = tiercake("demo", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert "blocks reused" in first.stdout and "from ssd" in first.stdout
    second = tiercake("demo", "--config", str(config))
    assert second.returncode == 0, second.stderr
    assert "the ssd tier still holds" in second.stdout


def test_bench_store_json(tmp_path):
    out = tmp_path / "store.json"
    done = tiercake("bench", "store", "--quick", "--sizes", "1048576", "--json", str(out), "--ssd-dir", str(tmp_path),
                    timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["bench"] == "store"
    names = {f["name"] for f in report["figures"]}
    assert {"pool.put", "pool.get", "gpu.put", "gpu.get", "ssd.put", "ssd.get", "ssd.zstd.ratio"} <= names
    for f in report["figures"]:
        assert set(f) >= {"name", "value", "unit", "limit", "ratio", "params"}
        assert f["value"] > 0 and f["limit"] > 0
        assert abs(f["ratio"] - f["value"] / f["limit"]) < 1e-9
    assert "ratio" in done.stdout


def test_policy_list_and_config_show():
    done = tiercake("policy", "list")
    assert done.returncode == 0 and "s3fifo" in done.stdout and "leaf_lru" in done.stdout
    shown = tiercake("config", "show")
    assert shown.returncode == 0 and "tiers:" in shown.stdout


def test_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("store:\n  tiers:\n    - {kind: ssd, capacity: 1MiB}\n")
    done = tiercake("config", "show", "--config", str(config))
    assert done.returncode == 2
    assert "needs a 'path'" in done.stdout
    missing = tiercake("config", "show", "--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "error" in missing.stdout
