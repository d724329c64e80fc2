"""`tiercake bench fleet`: the control plane under a fleet of simulated members, at several fleet sizes.

Real parts: an etcd cluster (three members; one with ``--quick``) started from the installed binary,
two conductor processes on it (the first one elected leader), and load-generator processes
(``fleet_load.py``) whose simulated node agents register, renew their leases and report the blocks
they hold through the real conductor client, and whose front looks chains up as vLLM's scheduler
side does. No block bytes move: this is the control plane alone. Per fleet size:

- ``placements_per_s``: blocks whose placement the index took, per second of the fill, against raw
  batched etcd transactions of the same kind (eight in flight, as the index's group commit keeps)
  measured on the same etcd just before (the ceiling of
  an index that makes every placement durable); ``placements_per_conductor_cpu_s``: the same per
  CPU-second of the two conductor processes together, against the 100,000 per core a fleet of a hundred vLLM
  instances needs (issue 45); the load generators' CPU is reported apart;
- ``lookup_p50`` / ``lookup_p99``: a 64-block chain over HTTP, against an empty request to the same
  conductor (p50) and 1 ms (p99);
- ``conductor_rss_per_mreplica``: the leader's RSS growth per million replicas, against a flat array
  of 40 bytes per replica (a 32-byte key, a node and a tier);
- ``etcd_db_bytes``: etcd's database after the fill, against its default 2 GiB quota, and what it
  would be at 10^8 replicas at the bytes per replica measured;
- ``keepalive_p50``: one lease renewal, against the empty request; the conductors' CPU per renewal;
- ``dead_node_s``: a node stops renewing: until no lookup lists its blocks, against its lease TTL;
- ``failover_s``: the leader SIGKILLed: until the other conductor is leader and lists one chain of
  every node whole, against 10 s.

Each fleet size runs twice, once per place the pool's placements live (``--index``): ``durable``,
each placement an etcd key (today's default), and ``memory``, the conductors' memory only, fed by
the nodes' reports and re-reported to a new leader when its term begins (``conductor.volatile_tiers``
with the pool in it: the design docs/SCALE.md argues for). Figures are named
``fleet.<index>.n<nodes>.<figure>``.

A fill that cannot finish within the budget (``--budget``, seconds per fleet size) stops there and
says so in its figures' params, with the time the whole fill would take at the rate measured. A
fleet size whose conductors stop answering gets a ``ran_out`` figure saying where, and the next
size runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tiercake.conductor.etcd_process import EtcdCluster
from tiercake.up import Child

from .fleet_load import CHAIN, TTL_S
from .report import Report, machine

# where pool placements live: etcd, each one durable (today's default), or the conductors' memory,
# fed by the nodes' reports and re-reported to a new leader (``conductor.volatile_tiers``)
INDEXES = ("durable", "memory")
QUICK_SIZES, FULL_SIZES = {"durable": (10, 100), "memory": (100,)}, (10, 100, 1000)
QUICK_BLOCKS, FULL_BLOCKS = 1024, 100_000
FULL_REPLICAS = 10**8  # what the full run is sized for: 1,000 nodes of 10^5 blocks
ETCD_QUOTA = 2 << 30  # etcd's default backend quota
FLAT_REPLICA = 40  # bytes: a 32-byte key, a node and a tier in a flat array
PER_CORE_FLOOR = 100_000  # placements per conductor core (issue 45)
FAILOVER_LIMIT_S = 10.0
RAW_OPS = 20_000


@dataclass
class LoadGenerator:
    """One ``fleet_load`` process and its pipes: a command a line in, an answer a line out."""

    proc: asyncio.subprocess.Process
    commands: asyncio.StreamWriter
    answers: asyncio.StreamReader
    nodes: range  # the indexes of the nodes it simulates

    @classmethod
    def of(cls, proc: asyncio.subprocess.Process, nodes: range) -> LoadGenerator:
        assert proc.stdin is not None and proc.stdout is not None  # started with both piped
        return cls(proc, proc.stdin, proc.stdout, nodes)


@dataclass
class Fleet:
    """One fleet size's processes."""

    etcd: EtcdCluster
    conductors: list[Child]
    generators: list[LoadGenerator]
    urls: list[str]
    token: str

    async def ask(self, gen: LoadGenerator, command: dict, timeout: float = 600) -> dict:
        gen.commands.write((json.dumps(command) + "\n").encode())
        await gen.commands.drain()
        line = await asyncio.wait_for(gen.answers.readline(), timeout)
        if not line:
            raise RuntimeError(f"a load generator exited (command {command['cmd']!r})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"load generator: {answer['error']}")
        return answer

    async def all(self, command: dict, timeout: float = 600) -> list[dict]:
        return await asyncio.gather(*(self.ask(g, dict(command), timeout) for g in self.generators))

    async def leader(self, url: str | None = None) -> int | None:
        """Which of the conductors is leader, as ``url`` (default: any) says; None: none yet."""
        from tiercake.conductor.client import Client, ConductorError

        client = Client([url] if url else self.urls, token=self.token, timeout=5)
        try:
            info = await client.leader()
        except ConductorError:
            return None
        finally:
            await client.close()
        return None if info is None else int(info.conductor_id.removeprefix("c"))


async def run(
    quick: bool = False,
    sizes: list[int] | None = None,
    blocks: int | None = None,
    budget_s: float | None = None,
    indexes: list[str] | None = None,
) -> Report:
    report = Report(bench="fleet", machine=machine())
    blocks = max(CHAIN, (blocks or (QUICK_BLOCKS if quick else FULL_BLOCKS)) // CHAIN * CHAIN)
    budget = budget_s or (60.0 if quick else 900.0)
    for index in indexes or INDEXES:
        if index not in INDEXES:
            raise ValueError(f"--index takes {', '.join(INDEXES)}, not {index!r}")
        for nodes in sizes or (QUICK_SIZES[index] if quick else FULL_SIZES):
            with tempfile.TemporaryDirectory(prefix="tiercake-bench-fleet-") as tmp:
                fleet = await _start(Path(tmp), nodes, blocks, quick, index)
                name = f"fleet.{index}.n{nodes}"
                try:
                    await _measure(report, fleet, nodes, blocks, budget, quick, name)
                except (RuntimeError, TimeoutError) as exc:  # what ran out, said as a figure
                    report.add(f"{name}.ran_out", 1.0, "flag", 1.0, error=f"{type(exc).__name__}: {exc}"[:400])
                finally:
                    await _stop(fleet)
    return report


async def _start(root: Path, nodes: int, blocks: int, quick: bool, index: str = "durable") -> Fleet:
    token = secrets.token_hex(16)
    env = {**os.environ, "TIERCAKE_TOKEN": token, "TIERCAKE_SECRET": secrets.token_hex(24)}
    etcd = await asyncio.to_thread(lambda: EtcdCluster(root / "etcd", size=1 if quick else 3).start())
    fleet = Fleet(etcd, [], [], [], token)
    try:
        config = root / "conductor.yaml"
        volatile = '["gpu", "pool"]' if index == "memory" else '["gpu"]'
        config.write_text(f"conductor: {{member_ttl: {TTL_S}, volatile_tiers: {volatile}}}\n")
        for i in range(2):
            args = ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--id", f"c{i}"]
            args += ["--config", str(config), "--etcd", ",".join(etcd.endpoints)]  # the default leader TTL
            child = Child(f"c{i}", args, env, root / "logs")
            fleet.conductors.append(child)
            fleet.urls.append((await asyncio.to_thread(child.wait_announce, 60))["url"])
        fleet.generators = await _generators(fleet, env, nodes, blocks)
        await fleet.all({"cmd": "stats"})
    except BaseException:
        await _stop(fleet)
        raise
    return fleet


async def _generators(fleet: Fleet, env: dict, nodes: int, blocks: int) -> list[LoadGenerator]:
    """Enough processes that none simulates more than 250 nodes (its event loop is their CPU)."""
    count = max(1, min(8, -(-nodes // 250)), 2 if nodes > 10 else 1)
    per, gens = -(-nodes // count), []
    for first in range(0, nodes, per):
        n = min(per, nodes - first)
        args = ["--urls", ",".join(fleet.urls), "--first", str(first), "--nodes", str(n), "--blocks", str(blocks)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tiercake.bench.fleet_load",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 24,
        )
        gens.append(LoadGenerator.of(proc, range(first, first + n)))
    fleet.generators = gens
    for gen in gens:
        line = await asyncio.wait_for(gen.answers.readline(), 300)
        if not line or "ready" not in json.loads(line):
            raise RuntimeError(f"a load generator did not register its nodes: {line!r}")
    return gens


async def _stop(fleet: Fleet) -> None:
    for gen in fleet.generators:
        if gen.proc.returncode is None:
            try:
                gen.commands.write(b'{"cmd": "stop"}\n')
                await asyncio.wait_for(gen.proc.wait(), 10)
            except (OSError, TimeoutError, RuntimeError):
                gen.proc.kill()
                await gen.proc.wait()
    for child in fleet.conductors:
        await asyncio.to_thread(child.stop)
    await asyncio.to_thread(fleet.etcd.stop)


async def _measure(report: Report, fleet: Fleet, nodes: int, blocks: int, budget: float, quick: bool, n: str) -> None:
    leader = await _wait_leader(fleet)
    pid = fleet.conductors[leader].proc.pid
    raw = await _raw_etcd_rate(fleet.etcd.endpoints)
    rss0, db0, cpu0 = _rss(pid), await _etcd_db(fleet.etcd), _conductors_cpu(fleet)
    started = time.perf_counter()
    fills = await fleet.all({"cmd": "fill", "seconds": budget}, timeout=budget + 120)
    wall = time.perf_counter() - started
    cpu, filled = _conductors_cpu(fleet) - cpu0, sum(f["filled"] for f in fills)
    wanted = nodes * blocks
    rss1, db1 = _rss(pid), await _etcd_db(fleet.etcd)
    size = {"nodes": nodes, "blocks_per_node": blocks, "replicas": filled}
    if await _wait_leader(fleet) != leader:
        size["leader_moved_during_fill"] = True
    if filled < wanted:
        size["filled"] = f"{filled}/{wanted} in the {budget:.0f} s budget"
        size["whole_fill_s"] = round(wanted / max(filled / wall, 1e-9))
    gen_cpu = sum(f["cpu_s"] for f in fills)
    report.add(f"{n}.placements_per_s", filled / wall, "1/s", raw, **size, limit_name="raw batched etcd txns")
    report.add(
        f"{n}.placements_per_conductor_cpu_s",
        filled / max(cpu, 1e-9),
        "1/s",
        PER_CORE_FLOOR,
        **size,
        conductors_cpu_s=round(cpu, 2),
        generators_cpu_s=round(gen_cpu, 2),
        limit_name="100k per core (issue 45)",
    )
    await _lookups(report, fleet, n, size, 2.0 if quick else 10.0)
    per_replica = max(0, rss1 - rss0) / max(filled, 1)
    report.add(
        f"{n}.conductor_rss_per_mreplica",
        per_replica * 1e6,
        "B",
        FLAT_REPLICA * 1e6,
        **size,
        rss_mb=round(rss1 / 1e6),
        limit_name="a flat array, 40 B a replica",
    )
    etcd_per_replica = max(0, db1 - db0) / max(filled, 1)
    report.add(
        f"{n}.etcd_db_bytes",
        db1,
        "B",
        ETCD_QUOTA,
        **size,
        bytes_per_replica=round(etcd_per_replica, 1),
        at_1e8_replicas_gib=round(etcd_per_replica * FULL_REPLICAS / (1 << 30), 1),
        limit_name="etcd's default quota",
    )
    await _keepalives(report, fleet, n, size, 3.0 if quick else 10.0)
    await _dead_node(report, fleet, n, size, fleet.urls[await _wait_leader(fleet)])
    await _failover(report, fleet, n, size, await _wait_leader(fleet), nodes)


async def _lookups(report: Report, fleet: Fleet, n: str, size: dict, seconds: float) -> None:
    answers = await fleet.all({"cmd": "lookup", "seconds": seconds})
    lookups = sorted(s for a in answers for s in a["lookup_s"])
    floor = statistics.median(s for a in answers for s in a["floor_s"])
    whole = sum(a["whole"] for a in answers)
    params = {**size, "lookups": len(lookups), "found_whole": f"{whole}/{len(lookups)}"}
    report.add(
        f"{n}.lookup_p50", lookups[len(lookups) // 2] * 1e3, "ms", floor * 1e3, **params, limit_name="an empty request"
    )
    p99 = lookups[min(len(lookups) - 1, int(len(lookups) * 0.99))]
    report.add(f"{n}.lookup_p99", p99 * 1e3, "ms", 1.0, **params, limit_name="1 ms (issue 45)")


async def _keepalives(report: Report, fleet: Fleet, n: str, size: dict, seconds: float) -> None:
    """Renewals alone (nothing else asked of the conductors): their latency and the conductors' CPU."""
    await asyncio.sleep(1.0)
    before, cpu0 = await fleet.all({"cmd": "stats"}), _conductors_cpu(fleet)
    await asyncio.sleep(seconds)
    cpu = _conductors_cpu(fleet) - cpu0
    after = await asyncio.gather(
        *(
            fleet.ask(g, {"cmd": "stats", "since": b["keepalives"]})
            for g, b in zip(fleet.generators, before, strict=True)
        )
    )
    renewals = sum(a["keepalives"] for a in after) - sum(b["keepalives"] for b in before)
    samples = [s for a in after for s in a["keepalive_s"]] or [float("nan")]
    floors = await fleet.all({"cmd": "lookup", "seconds": 0.5})
    floor = statistics.median(s for a in floors for s in a["floor_s"])
    report.add(
        f"{n}.keepalive_p50",
        statistics.median(samples) * 1e3,
        "ms",
        floor * 1e3,
        **size,
        renewals_per_s=round(renewals / seconds, 1),
        conductors_cpu_ms_per_renewal=round(cpu / max(renewals, 1) * 1e3, 3),
        conductors_cpu_share=round(cpu / seconds, 3),
        errors=sum(a["errors"] for a in after),
        limit_name="an empty request",
    )


async def _dead_node(report: Report, fleet: Fleet, n: str, size: dict, url: str) -> None:
    """Node 0 stops renewing its lease: until a lookup of its chain no longer lists it."""
    await fleet.ask(fleet.generators[0], {"cmd": "crash", "index": 0})
    started = time.monotonic()
    while time.monotonic() - started < 60:
        held = await fleet.ask(fleet.generators[0], {"cmd": "holders", "url": url, "nodes": [0]})
        if not held["whole"]:
            break
        await asyncio.sleep(0.1)
    gone = time.monotonic() - started
    report.add(f"{n}.dead_node_s", gone, "s", TTL_S, **size, limit_name="the node's lease TTL")


async def _failover(report: Report, fleet: Fleet, n: str, size: dict, leader: int, nodes: int) -> None:
    """SIGKILL the leader: until the other conductor leads and lists one chain of every live node whole."""
    other = 1 - leader
    live = list(range(1, nodes))  # node 0 crashed above
    os.kill(fleet.conductors[leader].proc.pid, signal.SIGKILL)
    started = time.monotonic()
    url, missing = fleet.urls[other], live
    while time.monotonic() - started < 120:
        if await fleet.leader(url) == other:
            answers = await asyncio.gather(
                *(
                    fleet.ask(g, {"cmd": "holders", "url": url, "nodes": [i for i in live if i in g.nodes]})
                    for g in fleet.generators
                )
            )
            missing = sorted(set(live) - {i for a in answers for i in a["whole"]})
            if not missing:
                break
        await asyncio.sleep(0.1)
    lasted = time.monotonic() - started
    report.add(
        f"{n}.failover_s",
        lasted,
        "s",
        FAILOVER_LIMIT_S,
        **size,
        missing_after=len(missing),
        limit_name="10 s (issue 45)",
    )


async def _wait_leader(fleet: Fleet) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = await fleet.leader()
        if found is not None:
            return found
        await asyncio.sleep(0.2)
    raise RuntimeError("no conductor answered as leader within 60 s")


async def _raw_etcd_rate(endpoints: list[str]) -> float:
    """Back-to-back 128-operation put transactions straight to etcd: placements per second."""
    from tiercake.conductor.etcd import EtcdBackend
    from tiercake.conductor.metadata import Delete, Put

    meta = await EtcdBackend(endpoints, timeout=30).start()
    try:
        ops = [Put(b"/bench/raw/%08d/fleet-00000/pool" % i, b'{"size": 1048576}') for i in range(RAW_OPS)]
        started = time.perf_counter()
        await meta.commit(ops, concurrency=8)  # as many in flight as the index's group commit keeps
        rate = RAW_OPS / (time.perf_counter() - started)
        await meta.commit([Delete(op.key) for op in ops], concurrency=8)
    finally:
        await meta.close()
    return rate


async def _etcd_db(etcd: EtcdCluster) -> int:
    """Bytes of etcd's database (its first member's; every member holds the same)."""
    return int((await asyncio.to_thread(etcd.members[0].status))["dbSize"])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _conductors_cpu(fleet: Fleet) -> float:
    """CPU seconds of both conductors so far (the follower follows every change too; and which one
    leads may change under load)."""
    return sum(_proc_cpu(c.proc.pid) for c in fleet.conductors if c.proc.poll() is None)


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
