"""One chaos run: its cluster, the faults in turn, the final check and the report (the package's
docstring says what each fault is)."""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiercake.bench.report import Report, machine
from tiercake.conductor.client import Client
from tiercake.kvstore import AsyncStore, Durability
from tiercake.netns import Partition, PartitionUnavailable
from tiercake.replay import TokenMap
from tiercake.tiers.pool import remove_pool
from tiercake.traces import synthetic_trace
from tiercake.up import UpProcess

from .faults import CORRUPTED_FILES, NODE_ID, RECOVERY_TIMEOUT_S, Faults, recovered, ssd_filesystem
from .kv import KvLoad, KvVerdict
from .load import MAX_TOKENS, Load, Oracle
from .store_faults import BATCH_ITEMS, StoreFaults, StoreFindings
from .upgrade import BLOCKS as UPGRADE_BLOCKS
from .upgrade import UpgradedNode

CONFIG = """node_id: {node_id}
store:
  tiers:
    - {{kind: pool, capacity: 2MiB, path: {pool}}}
    - {{kind: ssd, capacity: 256MiB, path: {ssd}}}
conductor: {{member_ttl: 2}}
serving: {{gpu_blocks: 96, max_context: 320}}
"""
RATE_WINDOW_S = 4.0  # how long the load's rate is measured before each fault
# The quick run's is the same: at 2 s (some 80 requests) two of four runs on 2026-12-08 found a removed
# persisted object back after a later restart (a remove answered while a reader still held its block)
QUICK_RATE_WINDOW_S = RATE_WINDOW_S

FAULTS = (
    "kill_prefill",
    "kill_decode",
    "stall_node",
    "partition_node",
    "kill_node",
    "corrupt_ssd",
    "fill_ssd",
    "kill_conductor",
    "kill_etcd_leader",
    "rolling_restart",
    "upgrade",
    "forge_replication",
    "regex_stall",
    "big_batch",
    "kill_node_without_pool",
)
KV_CLIENTS = 2  # the key-value workload beside the serving one
# its puts ask to be on disk, synced, before they are acknowledged: what may not be lost then is every
# acknowledged object (a memory-level object is a cache entry the store may evict under pressure, as
# Mooncake's may, and the 2 MiB pool here is under pressure all the time)
KV_DURABILITY = Durability(persist=True)


async def _unservable(up: UpProcess, secret: bytes) -> tuple[int, int]:
    """(placements the index lists on node agents, those the node cannot serve)."""
    import torch

    from tiercake.transfer import TransferEngine

    async with Client([up.control_url], token=up.token, timeout=10) as control:
        nodes = [m for m in await control.members() if m.role == "node"]
        engine = TransferEngine("chaos-checker", secret, transports=("tcp",))
        listed = lost = 0
        try:
            for node in nodes:
                engine.add_peer(node.node_id, node.host, node.port)
                blocks = await control.node_blocks(node.node_id)
                listed += len(blocks)
                for i in range(0, len(blocks), 64):
                    batch = blocks[i : i + 64]
                    dsts = [torch.empty(b.size, dtype=torch.uint8) for b in batch]
                    results = await engine.read_blocks(
                        node.node_id, [bytes.fromhex(b.key) for b in batch], dsts, timeout=30
                    )
                    lost += sum(not r.ok for r in results)
        finally:
            await engine.close()
    return listed, lost


@dataclass(frozen=True)
class _Pace:
    settle: float  # at least this long after a fault was read back before the next one
    window: float  # the load's rate (and hit ratio) measured over this long just before a fault


@dataclass
class _Findings:
    """What a run measured, for its report."""

    faults: tuple[str, ...]
    cold_start: float = 0.0
    recovery: dict[str, float | None] = field(default_factory=dict)
    during: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # (requests/s during, before, s)
    hits: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # (hit ratio during, before)
    listed: int = 0
    lost: int = 0
    detected: int = 0
    store_faults: StoreFaults | None = None  # the store's faults, and what they saw


def _without(faults: tuple[str, ...], fault: str) -> tuple[str, ...]:
    return tuple(f for f in faults if f != fault)


def _machine_allows(root: Path, faults: tuple[str, ...], ssd_fs, previous, progress):
    """(the faults this machine can inject, an etcd cluster or None, a partition or None)."""
    from tiercake.conductor.etcd_process import EtcdCluster, etcd_binary

    if ssd_fs is None and "fill_ssd" in faults:
        progress("cannot mount a file system for the SSD tier (needs root): no fill_ssd fault")
        faults = _without(faults, "fill_ssd")
    etcd = partition = None
    try:
        etcd_binary()
        etcd = EtcdCluster(root / "etcd", size=3).start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        progress(f"no etcd cluster ({exc}): the embedded backend, and no etcd fault")
        faults = _without(faults, "kill_etcd_leader")
    if previous is None and "upgrade" in faults:
        progress("no previous release given (--previous DIR): no upgrade fault")
        faults = _without(faults, "upgrade")
    if "partition_node" in faults:
        try:
            partition = Partition()
        except PartitionUnavailable as exc:
            progress(f"{exc}: no partition_node fault")
            faults = _without(faults, "partition_node")
    return faults, etcd, partition


def _start_cluster(root: Path, config_path: Path, etcd, partition, secret: str) -> UpProcess:
    from tiercake.conductor.etcd_process import free_port

    args, host = ["--etcd", ",".join(etcd.endpoints)] if etcd else [], "127.0.0.1"
    if partition is not None:  # the node agent behind the link; the APIs where it reaches them
        host = partition.host_ip
        args += ["--host", host, "--node-netns", f"{partition.ns}:{partition.ns_ip}"]
    env = {**os.environ, "TIERCAKE_SECRET": secret}
    return UpProcess(config_path, root / "data", free_port(), args, env=env, host=host)


def _workloads(up: UpProcess, config, secret: str, quick: bool) -> tuple[Load, KvLoad]:
    records = synthetic_trace(
        40 if quick else 400, tenants=2, system_prompts=2, system_blocks=4, turn_blocks=(1, 3), seed=11
    )
    tokens = TokenMap(16)
    prompts = [(tokens.prompt(r, 320 - MAX_TOKENS), r.tenant) for r in records]
    kv = KvLoad(
        lambda: AsyncStore([up.control_url], secret=secret, token=up.token, ssl=up.ssl, retry_s=20.0, timeout_s=3.0),
        clients=KV_CLIENTS,
        durability=KV_DURABILITY,
        large=16 << 10,
        pause_s=0.02,
    )
    return Load(up.url, Oracle(config), prompts), kv


async def _inject(
    fault: str, injector: Faults, load: Load, kv: KvLoad, found: _Findings, quiet_since: float, pace: _Pace, progress
) -> float:
    """One fault (a serving one, ``Faults``, or the store's, ``StoreFaults``): the rate just before
    it, the fault, what was served meanwhile, how long until the cluster served again, and every
    object read back. It begins ``pace.settle`` s (at least the rate's window) after ``quiet_since``, when
    the fault before had been read back; it returns when this one has been."""
    await asyncio.sleep(max(0.0, quiet_since + max(pace.settle, pace.window) - time.monotonic()))
    before = (load.tally.ok, load.tally.failed, load.tally.wrong)
    await injector.sample_corrupt()  # before a fault that may restart the node agent
    progress(f"{fault} ... (at {time.monotonic():.1f} s on the monotonic clock)")
    at, ok_at = time.monotonic(), load.tally.ok
    rate_before = load.tally.rate(at - pace.window, at)  # to hold the rate during it against
    back = await (getattr(injector, fault, None) or getattr(found.store_faults, fault))()
    lasted = time.monotonic() - at
    if lasted >= 1.0:  # a fault that lasts (a stall, a partition): what the cluster served meanwhile
        found.during[fault] = ((load.tally.ok - ok_at) / lasted, rate_before, lasted)
        found.hits[fault] = (load.tally.hit_ratio(at, at + lasted), load.tally.hit_ratio(at - pace.window, at))
    found.recovery[fault] = await recovered(back, load, at, timeout=RECOVERY_TIMEOUT_S)
    await injector.sample_corrupt()
    await kv.read_back()  # every object once more: one a fault lost shows in its history
    t = load.tally
    progress(
        f"{fault}: recovered in {found.recovery[fault]} s; {t.ok - before[0]} ok, "
        f"{t.failed - before[1]} failed, {t.wrong - before[2]} wrong"
    )
    return time.monotonic()


async def _check_placements(up: UpProcess, injector: Faults, secret: str, found: _Findings, progress) -> None:
    """Every placement the index lists, read back from its node; a rotten block the load never read
    again is found by this check itself: detected, not lost."""
    await asyncio.sleep(3)  # reports of the last changes and the statistics reach the conductor
    detected_before = await injector.corrupt_detected()
    found.listed, unservable = await _unservable(up, secret.encode())
    await asyncio.sleep(3)
    found.detected = await injector.corrupt_detected()
    found.lost = max(0, unservable - (found.detected - detected_before))
    progress(
        f"the index lists {found.listed} placements on node agents; {unservable} of them cannot be served, "
        f"{found.detected - detected_before} of those found corrupt by the check"
    )


async def run(
    quick: bool = False,
    faults: tuple[str, ...] = FAULTS,
    progress=print,
    stage: Callable[[int, int, str], None] | None = None,
    previous: Path | None = None,
) -> Report:
    """The fault-injection run; ``progress(message)`` tells what happened, ``stage(done, total, name)``
    where the run is: the cluster starting, each fault, the final check. ``previous``: the folder the
    previous release is installed in (the ``upgrade`` fault; left out without it)."""

    def reached(done: int, name: str) -> None:
        if stage is not None:
            stage(done, len(faults) + 2, name)

    from tiercake.config import load_config

    report = Report(bench="chaos", machine=machine())
    pace = _Pace(2.0, QUICK_RATE_WINDOW_S) if quick else _Pace(15.0, RATE_WINDOW_S)
    with tempfile.TemporaryDirectory(prefix="tiercake-chaos-") as tmp, ssd_filesystem(Path(tmp)) as ssd_fs:
        root = Path(tmp)
        pool = Path(f"/dev/shm/tiercake-chaos-{os.getpid()}")
        ssd = (ssd_fs or root) / "ssd"
        config_path = root / "chaos.yaml"
        config_path.write_text(CONFIG.format(node_id=NODE_ID, pool=pool, ssd=ssd))
        faults, etcd, partition = _machine_allows(root, faults, ssd_fs, previous, progress)
        found = _Findings(faults)
        reached(0, "starting the cluster")
        secret = secrets.token_hex(24)  # the cluster's, given here so the checker can read the nodes back
        started = time.monotonic()
        up = _start_cluster(root, config_path, etcd, partition, secret)
        load = kv = upgraded = None
        try:
            await asyncio.to_thread(up.wait_ready, 2)
            found.cold_start = time.monotonic() - started
            load, kv = _workloads(up, load_config(config_path), secret, quick)
            load.start()
            await kv.start()
            if "upgrade" in faults and previous is not None:  # (left out without a previous release)
                upgraded = UpgradedNode(root, up.control_url, up.token or "", secret, previous, progress)
            stall_s = 4.0 if quick else 20.0
            injector = Faults(up, ssd, etcd, load, partition, stall_s=stall_s, progress=progress, upgraded=upgraded)
            found.store_faults = StoreFaults(up, secret, pool, injector.node_pid)
            quiet_since = time.monotonic()
            for i, fault in enumerate(faults):
                reached(1 + i, fault)
                quiet_since = await _inject(fault, injector, load, kv, found, quiet_since, pace, progress)
            reached(1 + len(faults), "checking every placement")
            await load.stop()
            await kv.stop()
            await _check_placements(up, injector, secret, found, progress)
        finally:
            if load is not None and not load.stopped:
                await load.stop()
            if kv is not None:
                await kv.stop()
            if upgraded is not None:
                upgraded.close()
            output = up.stop()
            if etcd is not None:
                etcd.stop()
            if partition is not None:
                partition.close()
            remove_pool(pool)
        _figures(report, found, load, kv, upgraded)
        if "restarting" not in output and any(f.startswith("kill_") and f != "kill_etcd_leader" for f in faults):
            progress("note: tiercake up never said it restarted anything")
    reached(len(faults) + 2, "done")
    return report


def _figures(report: Report, found: _Findings, load: Load, kv: KvLoad, upgraded: UpgradedNode | None) -> None:
    t = load.tally
    report.add(
        "requests.ok",
        t.ok,
        "requests",
        t.ok + t.wrong + t.failed,
        limit_name="requests sent",
        failed=t.failed,
        retried=t.retried,
        faults=list(found.faults),
        errors=t.errors[:8],
    )
    report.add("requests.wrong", t.wrong, "requests", max(t.ok + t.wrong, 1), limit_name="requests answered")
    report.add(
        "placements.lost", found.lost, "placements", max(found.listed, 1), limit_name="placements the index lists"
    )
    if "corrupt_ssd" in found.faults:
        report.add(
            "ssd.corrupt_detected",
            found.detected,
            "blocks",
            CORRUPTED_FILES,
            limit_name="block files corrupted (only those read again can be detected)",
        )
    for fault, (rate, rate_before, lasted) in found.during.items():
        report.add(
            f"throughput_during.{fault}",
            rate,
            "requests/s",
            max(rate_before, 1e-9),
            limit_name="requests/s just before the fault",
            seconds=round(lasted, 1),
        )
    for fault, (ratio, ratio_before) in found.hits.items():
        if ratio is not None and ratio_before:
            report.add(
                f"hit_ratio_during.{fault}",
                ratio,
                "cached/prompt tokens",
                ratio_before,
                limit_name="hit ratio just before the fault",
            )
    _kv_figures(report, kv.verdict())
    if found.store_faults is not None:
        _store_figures(report, found.store_faults.found)
    if upgraded is not None:
        report.add(
            "upgrade.read_back",
            upgraded.read_back,
            "blocks",
            UPGRADE_BLOCKS,
            limit_name="blocks written to the previous release's node agent",
        )
    for fault, seconds in found.recovery.items():
        report.add(
            f"recovery_s.{fault}",
            seconds if seconds is not None else RECOVERY_TIMEOUT_S,
            "s",
            found.cold_start,
            limit_name="the cluster's cold start, same run",
            recovered=seconds is not None,
        )


def _store_figures(report: Report, seen: StoreFindings) -> None:
    if "forge_replication" in seen.seen:
        report.add(
            "forge_replication.refused",
            seen.forged_refused,
            "requests",
            seen.forged_sent,
            limit_name="forged replications sent (a client's credential naming the slot's primary)",
        )
    if "big_batch" in seen.seen:
        report.add(
            "big_batch.stored", seen.batch_answered, "objects", BATCH_ITEMS, limit_name="objects in one put_many"
        )
    if "regex_stall" in seen.seen:
        report.add(
            "regex_stall.removal_s", seen.regex_s, "s", 1.0, limit_name="a second (Python's re took 15 s per name)"
        )


def _kv_figures(report: Report, verdict: KvVerdict) -> None:
    report.add(
        "kv.ops",
        verdict.ops,
        "operations",
        verdict.ops,
        limit_name="operations in the histories",
        unknown_outcome=verdict.unknown,
    )
    report.add(
        "kv.lost",
        verdict.lost,
        "reads",
        max(verdict.ops, 1),
        limit_name="operations (a read of an object put and never removed that found nothing)",
    )
    report.add(
        "kv.violations",
        len(verdict.violations),
        "keys",
        6,
        limit_name="keys (a history no order explains)",
        first=verdict.violations[:1],
    )
    report.add("kv.torn", verdict.torn, "reads", max(verdict.ops, 1), limit_name="operations (a read not whole)")


def failed(report: Report) -> list[str]:
    """What makes a chaos run fail: a wrong answer, a lost placement, a lost, torn or unexplained
    object, a fault never recovered from."""
    figures = {f.name: f for f in report.figures}
    reasons = []
    for name, what in (
        ("requests.wrong", "wrong answers"),
        ("placements.lost", "placements lost"),
        ("kv.lost", "reads that found an acknowledged object gone"),
        ("kv.torn", "torn reads"),
        ("kv.violations", "keys whose history is not linearizable"),
    ):
        if figures[name].value:
            reasons.append(f"{figures[name].value:.0f} {what}")
    if "upgrade.read_back" in figures and figures["upgrade.read_back"].ratio < 1:
        reasons.append("blocks written to the previous release's node agent did not read back")
    reasons += [
        f"never recovered from {name.split('.', 1)[1]}"
        for name, f in figures.items()
        if name.startswith("recovery_s.") and not f.params["recovered"]
    ]
    return reasons
