"""The CLI as a user runs it: real subprocesses."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import yaml
from paths import shm_file
from up_helpers import left_in_shm

from tiercake.tiers.pool import remove_pool


def tiercake(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "tiercake.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.cluster
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
        helpless = [a.dest for a in node._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
        assert not helpless, (path, helpless)  # every argument says what it is


@pytest.mark.cluster
def test_version():
    done = tiercake("--version")
    assert done.returncode == 0 and done.stdout.startswith("tiercake ") and done.stdout.split()[1][0].isdigit()


@pytest.mark.cluster
def test_demo_twice_finds_its_ssd_blocks(tmp_path):
    config, pool = tmp_path / "c.yaml", shm_file(f"cli-test-{os.getpid()}")
    config.write_text(
        "store:\n  tiers:\n"
        "    - {kind: gpu, capacity: 512KiB, device: cpu}\n"
        f"    - {{kind: pool, capacity: 1MiB, path: {pool}}}\n"
        f"    - {{kind: ssd, capacity: 64MiB, path: {tmp_path / 'ssd'}}}\n"
    )
    try:
        first = tiercake("demo", "--config", str(config))
        assert first.returncode == 0, first.stderr
        assert "blocks reused" in first.stdout and "from ssd" in first.stdout
        second = tiercake("demo", "--config", str(config))
        assert second.returncode == 0, second.stderr
        assert "the ssd tier still holds" in second.stdout
    finally:
        remove_pool(pool)


@pytest.mark.cluster
def test_bench_store_json(tmp_path, monkeypatch):
    """The JSON every bench writes, its plot, and the figure count kept for the next run's ETA."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out, png = tmp_path / "store.json", tmp_path / "store.png"
    done = tiercake(
        "bench",
        "store",
        "--quick",
        "--sizes",
        "1048576",
        "--json",
        str(out),
        "--ssd-dir",
        str(tmp_path),
        "--plot",
        str(png),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (memory,) = (tmp_path / "cache" / "tiercake" / "bench").glob("store-*.json")
    assert json.loads(memory.read_text())["figures"] == len(json.loads(out.read_text())["figures"])
    report = json.loads(out.read_text())
    assert report["bench"] == "store"
    names = {f["name"] for f in report["figures"]}
    assert {"pool.put", "pool.get", "gpu.put", "gpu.get", "ssd.put", "ssd.get", "ssd.zstd.ratio"} <= names
    for f in report["figures"]:
        assert set(f) >= {"name", "value", "unit", "limit", "ratio", "params"}
        assert f["value"] > 0 and f["limit"] > 0
        assert abs(f["ratio"] - f["value"] / f["limit"]) < 1e-9
    assert "ratio" in done.stdout


@pytest.mark.cluster
def test_bench_vllm_kv_loads_from_the_pool_in_place_what_it_saved_byte_for_byte(tmp_path):
    """The connector's loader on vLLM-shaped KV without vLLM (the GPU check's command, on the CPU):
    a real node agent's pool, every block leased and copied in place, the bytes checked by the bench."""
    out = tmp_path / "kv.json"
    done = tiercake("bench", "vllm-kv", "--quick", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert {"load.throughput", "load.fetch", "load.copy", "load.seal", "load.copy_only", "save.in_step"} <= set(figures)
    # the stages are parts of the load (their medians, each a share of the load's median)
    assert 0 < figures["load.fetch"]["ratio"] + figures["load.copy"]["ratio"] + figures["load.seal"]["ratio"] < 1.5
    load = figures["load.throughput"]
    assert load["params"]["in_place_share"] == 1.0 and load["params"]["device"] == "cpu"
    assert load["params"]["unleased_share"] == 1.0  # by the pool index's entries: no lease round trip
    assert 0 < figures["load.seal"]["ratio"] < 1  # the seal check is part of the load, and on


@pytest.mark.cluster
def test_policy_list_and_config_show():
    done = tiercake("policy", "list")
    assert done.returncode == 0 and "s3fifo" in done.stdout and "leaf_lru" in done.stdout
    shown = tiercake("config", "show")
    assert shown.returncode == 0 and "tiers:" in shown.stdout


@pytest.mark.cluster
def test_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("store:\n  tiers:\n    - {kind: ssd, capacity: 1MiB}\n")
    done = tiercake("config", "show", "--config", str(config))
    assert done.returncode == 2
    assert "needs a 'path'" in done.stderr  # errors go to stderr
    missing = tiercake("config", "show", "--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "error" in missing.stderr


@pytest.mark.cluster
def test_replay_counts_broken_streams_as_failures_and_still_reports(tmp_path):
    """A load tool must survive the server it loads: against an OpenAI server that cuts every other
    stream after its first event (and ends one without [DONE]), `tiercake replay` finishes, counts
    those requests as failed and writes its report."""
    import asyncio
    import threading

    from aiohttp import web

    from tiercake.traces import synthetic_trace, write_trace

    served = {"n": 0}

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    async def completions(request):
        served["n"] += 1
        n = served["n"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a", "index": 0}]}\n\n')
        if n % 3 == 1:
            request.transport.close()  # cut mid-stream
            return resp
        if n % 3 == 2:
            await resp.write_eof()  # ends cleanly, but without usage or [DONE]
            return resp
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        trace = tmp_path / "syn.jsonl"
        write_trace(trace, synthetic_trace(9, tenants=1, system_blocks=1, turn_blocks=(1, 2), rate_per_s=100, seed=1))
        out = tmp_path / "replay.json"
        done = tiercake(
            "replay",
            str(trace),
            "--target",
            f"http://127.0.0.1:{port}",
            "--max-output",
            "2",
            "--json",
            str(out),
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        figures = {f["name"]: f["value"] for f in json.loads(out.read_text())["figures"]}
        assert figures["requests.ok"] == 3 and figures["requests.failed"] == 6
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "text, said",
    [
        (
            "store:\n  tiers:\n    - {kind: pool, capacity: 1MiB, eviction: lruu}\n",
            "store.tiers.0.eviction: unknown eviction policy 'lruu': not a built-in (arc, fifo, leaf_lru, lfu, lru",
        ),
        ("serving: {router: fifo}\n", "serving.router: policy 'fifo' resolves to"),
        (
            "store:\n  tiers:\n    - {kind: pool, capacity: lots}\n",
            "store.tiers.0.capacity: a size is a number of bytes, or a number and a unit: 512MiB",
        ),
        ("serving:\n\tport: 9000\n", "not valid YAML: while scanning for the next token found character '\\t'"),
        ("serving: {port: 70000}\n", "serving.port: Input should be less than or equal to 65535 (got 70000)"),
    ],
)
def test_a_config_error_is_one_line_naming_the_field_and_what_is_accepted(tmp_path, text, said):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    for command in (["config", "show"], ["up", "--data-dir", str(tmp_path / "d")]):
        done = tiercake(*command, "--config", str(config), timeout=60)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "d").exists()  # up refused before it wrote anything


@pytest.mark.cluster
def test_a_partial_config_merges_over_the_defaults_and_show_prints_sizes_it_reads_back(tmp_path):
    config = tmp_path / "part.yaml"
    config.write_text("serving: {port: 9000}\n")
    done = tiercake("config", "show", "--config", str(config))
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    assert shown["serving"]["port"] == 9000 and [t["kind"] for t in shown["store"]["tiers"]] == ["gpu", "pool", "ssd"]
    assert shown["store"]["tiers"][1]["capacity"] == "16MiB"  # as a person writes it, not 16777216
    (tmp_path / "again.yaml").write_text(done.stdout)
    again = tiercake("config", "show", "--config", str(tmp_path / "again.yaml"))
    assert again.stdout == done.stdout  # what it prints, it reads back the same


@pytest.mark.cluster
def test_up_refuses_a_size_it_cannot_read_and_a_data_dir_another_up_holds(tmp_path):
    from tiercake.up_state import DataDirLock

    done = tiercake("up", "--pool", "lots", "--data-dir", str(tmp_path / "d"))
    assert done.returncode == 2 and "--pool: a size is a number of bytes" in done.stderr
    data = tmp_path / "held"
    lock = DataDirLock(data).acquire()
    lock.record(pid=os.getpid(), url="http://127.0.0.1:1")
    (data / "control-token").write_text("the running cluster's\n")
    (data / "logs").mkdir()
    (data / "logs" / "conductor.log").write_text("the running cluster's log\n")
    try:
        done = tiercake("up", "--data-dir", str(data), "--port", "0")
    finally:
        lock.release()
    assert done.returncode == 2 and "another tiercake up runs in" in done.stderr, done.stderr
    assert f"pid {os.getpid()}, url http://127.0.0.1:1" in done.stderr
    assert (data / "control-token").read_text() == "the running cluster's\n"  # nothing of it touched
    assert (data / "logs" / "conductor.log").read_text() == "the running cluster's log\n"


@pytest.mark.cluster
def test_ctrl_c_while_up_starts_stops_everything_at_once_and_leaves_no_shared_memory(tmp_path):
    import signal
    import time

    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "up",
            "--data-dir",
            str(tmp_path / "d"),
            "--port",
            "0",
            "--control-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # Ctrl-C once the node agent is starting (the workers not yet ready): a fixed sleep under CI's load
    # sometimes landed while the command was still importing torch, before it handles signals at all
    started = time.monotonic()
    while not (tmp_path / "d" / "logs" / "node.log").exists() and time.monotonic() - started < 60:
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 5 and proc.returncode == 130, proc.stderr.read()
    assert not running_with(str(tmp_path / "d"))  # no child left (each has a session of its own)
    assert (
        secret_mode(tmp_path / "d" / "cluster-secret") == 0o600
        and secret_mode(tmp_path / "d" / "control-token") == 0o600
    )
    assert left_in_shm(before) == set()


def running_with(text: str) -> list[str]:
    """The command lines of live processes that mention ``text``."""
    found = []
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            with contextlib.suppress(OSError):
                line = open(f"/proc/{proc}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                if text in line and "pytest" not in line:
                    found.append(line)
    return found


def secret_mode(path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.cluster
def test_up_on_a_busy_port_says_so(tmp_path):
    """The conductor's bind error reaches the user as what it is, not as a JSON parse error."""
    import socket

    from tiercake.conductor.etcd_process import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a free control port of its own: port + 1 (the default) may be a busy machine's ephemeral port
        args = ["--port", str(port), "--control-port", str(free_port()), "--data-dir", str(tmp_path / "data")]
        done = tiercake("up", *args, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr, done.stderr
    assert "Expecting value" not in done.stdout + done.stderr


def test_long_commands_show_a_bar_with_the_time_left(monkeypatch):
    """The one progress bar of every long command (policy eval, simulate, replay, bench): done of
    total, time elapsed and the ETA."""
    import time

    from rich.console import Console

    import tiercake.cli.common as common

    screen = Console(record=True, force_terminal=True, width=150)
    monkeypatch.setattr(common, "console", screen)
    with common.progress_bar("simulating 10 requests", 10) as update:
        update(4)
        time.sleep(0.3)
        update(6, description="global_cache_aware")
    shown = screen.export_text()
    assert "6/10" in shown and "global_cache_aware" in shown and "ETA" in shown and "0:00:0" in shown


@pytest.mark.cluster
def test_simulate_prints_its_tables_and_plots(tmp_path):
    from tiercake.traces import synthetic_trace, write_trace

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, synthetic_trace(300, tenants=2, seed=3))
    png = tmp_path / "sim.png"
    done = tiercake("simulate", str(trace), "--ablation", "--plot", str(png), "--json", str(tmp_path / "sim.json"))
    assert done.returncode == 0, done.stderr
    assert "global_cache_aware" in done.stdout and f"plot: {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = json.loads((tmp_path / "sim.json").read_text())["figures"]
    assert {f["name"] for f in figures} == {
        f"ttft_mean.{n}" for n in ("random", "load_balancing", "local_cache_aware", "global_cache_aware")
    }


@pytest.mark.cluster
def test_a_child_of_up_is_a_process_group_stopped_and_restarted_whole(tmp_path):
    """What a child starts (vLLM's engine core under its API server) ends with it: on a stop, and
    when the supervisor restarts a child whose leader died and left its own children running."""
    import signal
    import time

    from tiercake.up import Child

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
            return f.read().split(")")[-1].split()[0] != "Z"

    def grandchild(child: Child) -> int:
        for _ in range(100):
            text = child.log_path.read_text()
            pids = [int(line.split()[1]) for line in text.splitlines() if line.startswith("grandchild ")]
            if pids:
                return pids[-1]
            time.sleep(0.05)
        raise AssertionError(child.log_path.read_text())

    argv = ["sh", "-c", "sleep 600 & echo grandchild $!; wait"]
    child = Child("engine", [], dict(os.environ), tmp_path / "logs", argv=argv)
    first = grandchild(child)
    child.stop(5)
    for _ in range(100):  # SIGTERM reached the whole group; under load the grandchild takes a moment to go
        if not alive(first):
            break
        time.sleep(0.05)
    assert not alive(first)  # stopped with its parent

    child = Child("engine", [], dict(os.environ), tmp_path / "logs", argv=argv)
    orphan = grandchild(child)
    os.kill(child.proc.pid, signal.SIGKILL)  # the leader dies; its child lives on in the group
    child.proc.wait(5)
    assert alive(orphan)
    child.restart()
    for _ in range(100):
        if not alive(orphan):
            break
        time.sleep(0.05)
    assert not alive(orphan)  # the restart ended what the dead one left behind
    child.stop(5)


def test_the_replay_report_counts_pulled_blocks_read_from_memory_and_from_disk():
    """What prefetching moves: the share of the blocks pulled from nodes that the node read from
    memory (pool) rather than disk, and the share pulled before the prefill began, over every
    answered request; absent when nothing was pulled."""
    from tiercake.replay import Outcome, ReplayRun, report
    from tiercake.traces import synthetic_trace

    records = synthetic_trace(3, tenants=1, system_blocks=1, turn_blocks=(1, 1), rate_per_s=10, seed=1)
    outcomes = [
        Outcome(0, 0.0, prompt_tokens=64, cached_tokens=48, sources={"gpu": 1, "node-a:pool": 2}, prefetched_blocks=2),
        Outcome(1, 0.0, prompt_tokens=64, cached_tokens=32, sources={"node-a:ssd": 1, "node-a:pool": 1}),
        Outcome(2, 0.0, status="failed", sources={"node-a:ssd": 9}),
    ]
    figures = {f.name: f for f in report(ReplayRun(outcomes, None, None), records, "t").figures}
    memory = figures["load.from_memory"]
    assert memory.value == 3 / 4 and memory.limit == 1.0 and memory.params["disk_blocks"] == 1
    assert figures["load.prefetched"].value == 2 / 4  # pulled while they waited, before their prefill
    none_pulled = report(ReplayRun([Outcome(0, 0.0, prompt_tokens=64, sources={"gpu": 2})], None, None), records, "t")
    assert "load.from_memory" not in {f.name for f in none_pulled.figures}


@pytest.mark.cluster
def test_up_under_vllm_refuses_half_a_disaggregated_setup(tmp_path):
    done = tiercake(
        "up", "--engine", "vllm", "--model", str(tmp_path), "--vllm-prefill", "1", "--data-dir", str(tmp_path / "data")
    )
    assert done.returncode == 2 and "--vllm-prefill and --vllm-decode go together" in done.stderr


@pytest.mark.cluster
def test_a_spare_that_cannot_start_is_made_again_at_a_pace_not_in_a_loop(tmp_path):
    """``up`` keeps a warm spare beside the node agent; one that dies at once (here: any spare of this
    command exits 1) is made again every ``SPARE_AFTER_S``, not on every turn of the supervisor."""
    import time

    from tiercake.up import Child

    script = 'if [ -n "$TIERCAKE_SPARE" ]; then exit 1; fi; sleep 30'
    child = Child("x", [], dict(os.environ), tmp_path, argv=["sh", "-c", script], spare=True)
    child.SPARE_AFTER_S = 0.2
    made = []
    spawn = child._spawn
    child._spawn = lambda spare: made.append(spare) or spawn(spare)
    try:
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            child.keep_spare()
            time.sleep(0.01)
        assert 3 <= len(made) <= 11 and all(made)  # about every 0.2 s over 2 s, where 200 turns ran
    finally:
        child.stop(1)


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


def _descendants(pid: int) -> dict[int, str]:
    """Every live process under ``pid`` (its children have sessions of their own), by command line."""
    found: dict[int, str] = {}
    parents = {pid}
    for _ in range(3):  # up -> node agent -> what it starts
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in found:
                with contextlib.suppress(OSError):
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    if ppid in parents:
                        with open(f"/proc/{entry}/cmdline", "rb") as f:
                            found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        parents |= set(found)
    return found


@pytest.mark.cluster
def test_up_and_its_conductor_load_no_torch_and_a_ctrl_c_takes_everything_down_within_3_s(tmp_path):
    """Reading a config (every tier kind is checked against ``tiers.kinds``) imports no tier backend,
    so the processes that touch no tier, ``up`` and its conductor, never load torch (2.5 s to import,
    about 200 MB each). The processes that do skip the exit's last collections (``cli.run``): a Ctrl-C
    of ``up`` took 4.5 s on a quiet machine and 5.7 s under CI's load, mostly torch's teardown."""
    import signal
    import time

    from tiercake.conductor.etcd_process import free_port
    from tiercake.up import UpProcess

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model_id": "tiercake-reference"}))  # the defaults: gpu, pool and ssd tiers
    cluster = UpProcess(config, tmp_path / "d", free_port())
    try:
        cluster.wait_ready(workers=2)
        children = _descendants(cluster.proc.pid)
        (conductor,) = [pid for pid, line in children.items() if " conductor " in line]
        nodes = [pid for pid, line in children.items() if " node " in line]
        assert not _maps_torch(cluster.proc.pid) and not _maps_torch(conductor)
        assert any(map(_maps_torch, nodes))  # the check sees torch where it is loaded (a spare may be importing)
        sent = time.monotonic()
        cluster.proc.send_signal(signal.SIGINT)
        cluster.proc.wait(30)
        took = time.monotonic() - sent
    finally:
        cluster.stop()
    assert took < 3, took
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)


def _default_pool(data_dir) -> str:
    from tiercake.config import default_config

    (pool,) = [t.region_path for t in default_config(data_dir).store.tiers if t.kind == "pool"]
    return str(pool)


@pytest.mark.cluster
def test_demo_gives_its_pool_back_and_a_busy_data_dir_is_one_line(tmp_path):
    """``tiercake demo`` ends with its pool file removed (its SSD keeps the blocks for the next run);
    run where another command holds the data directory (``make run``'s up, say), it says so in one
    line, exit 2, and touches nothing."""
    from tiercake.up_state import DataDirLock

    data = tmp_path / "d"
    done = tiercake("demo", "--data-dir", str(data), timeout=300)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(_default_pool(data)) and list((data / "ssd").iterdir())
    lock = DataDirLock(data).acquire()
    lock.record(pid=os.getpid(), url="http://127.0.0.1:8080")
    try:
        busy = tiercake("demo", "--data-dir", str(data), timeout=120)
    finally:
        lock.release()
    assert busy.returncode == 2 and "Traceback" not in busy.stderr, busy.stderr
    assert busy.stderr.strip().splitlines() == [
        f"error: another tiercake up runs in {data} (pid {os.getpid()}, url http://127.0.0.1:8080); stop it "
        "first, or give this one its own --data-dir"
    ]


@pytest.mark.cluster
def test_a_pool_another_process_owns_is_named_in_one_line(tmp_path, shm_path):
    """A pool path that another process owns (two configs naming one file): who owns it, exit 2."""
    from tiercake.tiers.pool import PoolRegion

    config = tmp_path / "node.yaml"
    config.write_text(f"store:\n  tiers:\n    - {{kind: pool, capacity: 4MiB, path: {shm_path}}}\n")
    region = PoolRegion.create(shm_path, 4 << 20)
    try:
        done = tiercake("demo", "--config", str(config), "--data-dir", str(tmp_path / "d"), timeout=120)
    finally:
        region.close()
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"pool region {shm_path} is owned by another live process (pid {os.getpid()}: " in done.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_standalone_node_agent_removes_its_pool_when_stopped(tmp_path, shm_path, how):
    """A node agent on its own (no supervisor to retire the file): a clean stop takes its pool file and
    what lies beside it out of /dev/shm; with ``keep_on_stop`` it stays for the next agent to adopt."""
    import signal

    for keep in (False, True):
        config = tmp_path / "node.yaml"
        config.write_text(
            "store:\n  tiers:\n"
            f"    - {{kind: pool, capacity: 4MiB, path: {shm_path}, keep_on_stop: {str(keep).lower()}}}\n"
            f"    - {{kind: ssd, capacity: 16MiB, path: {tmp_path / 'ssd'}}}\n"
            "transfer: {host: 127.0.0.1, port: 0}\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiercake.cli", "node", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "TIERCAKE_SECRET": "a-test-secret-of-32-bytes-length"},
        )
        try:
            assert json.loads(proc.stdout.readline())["port"] > 0, proc.stderr.read()
            assert shm_path.exists()
            proc.send_signal(getattr(signal, how))
            assert proc.wait(30) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
        siblings = [p.name for p in shm_path.parent.iterdir() if p.name.startswith(shm_path.name + ".")]
        assert (shm_path.exists(), bool(siblings)) == ((True, True) if keep else (False, False)), siblings
        remove_pool(shm_path)


@pytest.mark.cluster
def test_lab_down_takes_an_exited_but_unreaped_lab_up_for_stopped():
    """A `lab up` that has stopped but that whoever started it has not reaped (a zombie) is not
    running: `lab down` once waited its whole 30-s deadline for one (every lab test's teardown did)."""
    import time
    from pathlib import Path

    from tiercake.cli.lab import _alive

    exited = subprocess.Popen(["true"])
    try:
        while Path(f"/proc/{exited.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        assert not _alive(exited.pid)
    finally:
        exited.wait()
    assert _alive(os.getpid()) and not _alive(exited.pid)  # reaped: gone from /proc
