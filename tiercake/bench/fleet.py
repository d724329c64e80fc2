"""`tiercake bench fleet`: the control plane under a fleet of simulated members, at several fleet sizes.

Real parts: an etcd cluster (three members; one with ``--quick``) started from the installed binary,
two conductor processes on it (the first one elected leader), and load-generator processes
(``fleet_load.py``) whose simulated node agents register, renew their leases and report the blocks
they hold through the real conductor client, and a front process that looks chains up as vLLM's
scheduler side does. No block bytes move: this is the control plane alone. Per fleet size
(figures ``fleet.n<nodes>.<figure>``):

- ``placements_per_s``: blocks whose placement the index took, per second of the fill, against raw
  batched etcd transactions of the same kind (eight in flight) measured on the same etcd just
  before: the ceiling of an index that made every placement durable, as this one did before
  (docs/SCALE.md); ``placements_per_leader_cpu_s``: the same per CPU-second of the leader, against
  the 100,000 per core a fleet of a hundred vLLM instances needs (issue 45), with the follower's CPU
  (it mirrors every change) and the load generators' reported apart;
- ``etcd_writes_per_s``: etcd's revisions per second during the fill (every write it took), against
  the placements per second: placements never reach etcd, so this stays flat in the blocks;
- ``lookup_p50`` / ``lookup_p99``: a 64-block chain over HTTP from the front, against an empty
  request to the same conductor (p50) and 1 ms (p99), at the leader, (``_follower``) at the
  follower, which takes no keep-alives or reports, and (``_client``) where a client given both
  conductors sends them (a follower in step, where there is one);
- ``conductor_rss_per_replica``: the leader's RSS growth per replica, against a flat array of 40
  bytes per replica (a 32-byte key, a node and a tier); the follower's beside it;
- ``etcd_db_bytes``: etcd's database after the fill, against its default 2 GiB quota;
- ``keepalive_p50``: one keep-alive (the leader notes it in memory), against the empty request; the
  conductors' CPU per keep-alive;
- ``dead_node_s``: a node stops renewing: until neither conductor lists its blocks, against its TTL;
- ``failover_s``: the leader SIGKILLed: until the other conductor leads and lists one chain of
  every live node whole, against 10 s.

A fill that cannot finish within the budget (``--budget``, seconds per fleet size) stops there and
says so in its figures' params, with the time the whole fill would take at the rate measured. A
fleet size whose conductors stop answering gets a ``ran_out`` figure saying where, and the next
size runs. ``--plot`` draws each figure against the fleet size.
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

import aiohttp

from tiercake.conductor.etcd_process import EtcdCluster
from tiercake.up import Child

from .fleet_load import CHAIN, TTL_S
from .report import Report, machine, spinners

QUICK_SIZES, FULL_SIZES = (10, 100), (10, 100, 1000)
QUICK_BLOCKS, FULL_BLOCKS = 1024, 100_000
ETCD_QUOTA = 2 << 30  # etcd's default backend quota
FLAT_REPLICA = 40  # bytes: a 32-byte key, a node and a tier in a flat array
PER_CORE_FLOOR = 100_000  # placements per conductor core (issue 45)
FAILOVER_LIMIT_S = 10.0
RAW_OPS = 20_000
NODES_PER_GENERATOR = 250  # a generator's event loop is its nodes' CPU


class FleetReport(Report):
    def plot(self, path: str | Path) -> None:
        """Each figure against the fleet size, its limit dashed."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series: dict[str, list[tuple[int, float, float, str]]] = {}
        for f in self.figures:
            _, size, what = f.name.split(".", 2)
            if size.startswith("n") and what != "ran_out":
                series.setdefault(what, []).append((int(size[1:]), f.value, f.limit, f.unit))
        cols = 3
        rows = -(-len(series) // cols) or 1
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, (what, points) in zip(axes.flat, sorted(series.items()), strict=False):
            points.sort()
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label="measured")
            ax.plot(xs, [p[2] for p in points], linestyle="--", color="black", linewidth=0.8, label="limit")
            ax.set_xscale("log")
            ax.set_title(what, fontsize=9)
            ax.set_xlabel("nodes", fontsize=8)
            ax.set_ylabel(points[0][3], fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(series) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle("tiercake bench fleet: each figure against the fleet size", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


@dataclass
class LoadGenerator:
    """One ``fleet_load`` process and its pipes: a command a line in, an answer a line out."""

    proc: asyncio.subprocess.Process
    commands: asyncio.StreamWriter
    answers: asyncio.StreamReader
    nodes: range  # the indexes of the nodes it simulates (none: the front)

    @classmethod
    def of(cls, proc: asyncio.subprocess.Process, nodes: range) -> LoadGenerator:
        assert proc.stdin is not None and proc.stdout is not None  # started with both piped
        return cls(proc, proc.stdin, proc.stdout, nodes)


@dataclass
class Fleet:
    """One fleet size's processes."""

    etcd: EtcdCluster
    conductors: list[Child]
    generators: list[LoadGenerator]  # the simulated nodes' generators, then the front
    urls: list[str]
    token: str

    @property
    def front(self) -> LoadGenerator:
        return self.generators[-1]

    @property
    def node_generators(self) -> list[LoadGenerator]:
        return self.generators[:-1]

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

    async def nodes(self, command: dict, timeout: float = 600) -> list[dict]:
        return await asyncio.gather(*(self.ask(g, dict(command), timeout) for g in self.node_generators))

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
    load: int = 0,
) -> Report:
    """``load``: that many processes spinning on the CPU meanwhile (a busy machine)."""
    report = FleetReport(bench="fleet", machine={**machine(), "load": load})
    blocks = max(CHAIN, (blocks or (QUICK_BLOCKS if quick else FULL_BLOCKS)) // CHAIN * CHAIN)
    budget = budget_s or (60.0 if quick else 900.0)
    burners = spinners(load)
    try:
        for nodes in sizes or (QUICK_SIZES if quick else FULL_SIZES):
            await _one_size(report, nodes, blocks, budget, quick)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return report


async def _one_size(report: Report, nodes: int, blocks: int, budget: float, quick: bool) -> None:
    """One fleet size, on its own etcd and conductors; what ran out is said as a figure."""
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-fleet-") as tmp:
        fleet = await _start(Path(tmp), nodes, blocks, quick)
        name = f"fleet.n{nodes}"
        try:
            await _measure(report, fleet, nodes, blocks, budget, quick, name)
        except (RuntimeError, TimeoutError) as exc:  # what ran out, said as a figure
            report.add(f"{name}.ran_out", 1.0, "flag", 1.0, error=f"{type(exc).__name__}: {exc}"[:400])
        finally:
            await _stop(fleet)


async def _start(root: Path, nodes: int, blocks: int, quick: bool) -> Fleet:
    token = secrets.token_hex(16)
    env = {**os.environ, "TIERCAKE_TOKEN": token, "TIERCAKE_SECRET": secrets.token_hex(24)}
    etcd = await asyncio.to_thread(lambda: EtcdCluster(root / "etcd", size=1 if quick else 3).start())
    fleet = Fleet(etcd, [], [], [], token)
    try:
        config = root / "conductor.yaml"
        config.write_text(f"conductor: {{member_ttl: {TTL_S}}}\n")
        for i in range(2):
            args = ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--id", f"c{i}"]
            args += ["--config", str(config), "--etcd", ",".join(etcd.endpoints)]  # the default leader TTL
            child = Child(f"c{i}", args, env, root / "logs")
            fleet.conductors.append(child)
            fleet.urls.append((await asyncio.to_thread(child.wait_announce, 60))["url"])
        fleet.generators = await _generators(fleet, env, nodes, blocks)
        await fleet.nodes({"cmd": "stats"})
    except BaseException:
        await _stop(fleet)
        raise
    return fleet


async def _generators(fleet: Fleet, env: dict, nodes: int, blocks: int) -> list[LoadGenerator]:
    """Enough processes that none simulates more than ``NODES_PER_GENERATOR`` nodes, and the front."""
    count = max(1, min(8, -(-nodes // NODES_PER_GENERATOR)), 2 if nodes > 10 else 1)
    per = -(-nodes // count)
    ranges = [range(first, min(nodes, first + per)) for first in range(0, nodes, per)] + [range(0)]
    gens = []
    for part in ranges:
        args = ["--urls", ",".join(fleet.urls), "--first", str(part.start), "--nodes", str(len(part))]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tiercake.bench.fleet_load",
            *args,
            "--blocks",
            str(blocks),
            "--fleet",
            str(nodes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 24,
        )
        gens.append(LoadGenerator.of(proc, part))
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
    pids = [c.proc.pid for c in fleet.conductors]
    raw = await _raw_etcd_rate(fleet.etcd.endpoints)
    rss0, cpu0 = [_rss(p) for p in pids], [_proc_cpu(p) for p in pids]
    db0, rev0 = await _etcd_status(fleet.etcd)
    started = time.perf_counter()
    fills = await fleet.nodes({"cmd": "fill", "seconds": budget}, timeout=budget + 300)
    wall = time.perf_counter() - started
    cpu = [_proc_cpu(p) - c for p, c in zip(pids, cpu0, strict=True)]
    filled = sum(f["filled"] for f in fills)
    db1, rev1 = await _etcd_status(fleet.etcd)
    rss1 = [_rss(p) for p in pids]
    wanted = nodes * blocks
    size = {"nodes": nodes, "blocks_per_node": blocks, "replicas": filled}
    if await _wait_leader(fleet) != leader:
        size["leader_moved_during_fill"] = True
    if filled < wanted:
        size["filled"] = f"{filled}/{wanted} in the {budget:.0f} s budget"
        size["whole_fill_s"] = round(wanted / max(filled / wall, 1e-9))
    rate = filled / wall
    report.add(f"{n}.placements_per_s", rate, "1/s", raw, **size, limit_name="raw batched etcd txns")
    report.add(
        f"{n}.placements_per_leader_cpu_s",
        filled / max(cpu[leader], 1e-9),
        "1/s",
        PER_CORE_FLOOR,
        **size,
        leader_cpu_s=round(cpu[leader], 2),
        follower_cpu_s=round(cpu[1 - leader], 2),
        generators_cpu_s=round(sum(f["cpu_s"] for f in fills), 2),
        fill_s=round(wall, 1),
        limit_name="100k per core (issue 45)",
    )
    report.add(
        f"{n}.etcd_writes_per_s",
        (rev1 - rev0) / wall,
        "1/s",
        rate,
        **size,
        etcd_revisions=rev1 - rev0,
        limit_name="placements per second (each a write, were they in etcd)",
    )
    caught_up = await _mirror_caught_up(fleet, leader)
    lookups_at = {**size, "follower_caught_up_s": round(caught_up, 2)}
    await _lookups(report, fleet, n, lookups_at, 2.0 if quick else 10.0, fleet.urls[leader], fleet.urls[1 - leader])
    grown = [max(0, b - a) / max(filled, 1) for a, b in zip(rss0, rss1, strict=True)]
    report.add(
        f"{n}.conductor_rss_per_replica",
        grown[leader],
        "B",
        FLAT_REPLICA,
        **size,
        leader_rss_mb=round(rss1[leader] / 1e6),
        follower_bytes_per_replica=round(grown[1 - leader], 1),
        limit_name="a flat array, 40 B a replica",
    )
    report.add(
        f"{n}.etcd_db_bytes",
        db1,
        "B",
        ETCD_QUOTA,
        **size,
        grew_bytes=db1 - db0,
        limit_name="etcd's default quota",
    )
    await _keepalives(report, fleet, n, size, 3.0 if quick else 10.0)
    await _dead_node(report, fleet, n, size)
    await _failover(report, fleet, n, size, await _wait_leader(fleet), nodes)


async def _mirror_caught_up(fleet: Fleet, leader: int, timeout: float = 60.0) -> float:
    """Seconds after the fill until the follower's mirror holds as many replicas as the leader's
    index (the lookups measure a steady state: a lookup at a mirror still applying the fill's last
    changes misses, and costs a recompute)."""
    started = time.perf_counter()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {fleet.token}"}) as http:
        while time.perf_counter() - started < timeout:
            held = [
                await _metric(http, url, "tiercake_index_replicas")
                for url in (fleet.urls[leader], fleet.urls[1 - leader])
            ]
            if held[0] == held[1]:
                break
            await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """One unlabelled metric of a conductor's ``/metrics``."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _lookups(
    report: Report, fleet: Fleet, n: str, size: dict, seconds: float, leader: str, follower: str
) -> None:
    """The front's lookups, at the leader (which also takes every keep-alive and report), at the
    follower (which serves lookups from its mirror), and (``_client``) where a client given both
    sends them, taking turns, each beside an empty request to the same one (the follower's for the
    client)."""
    series = (("", leader), ("_follower", follower), ("_client", None))
    targets = [[url, url or follower] for _, url in series]
    answer = await fleet.ask(fleet.front, {"cmd": "lookup", "seconds": 3 * seconds, "targets": targets})
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {fleet.token}"}) as http:
        # the longest turn of each conductor's loop in the last whole 10 s: what a p99 may have waited behind
        lags = [await _metric(http, url, "tiercake_loop_lag_seconds") for url in (leader, follower)]
    for (where, _), run in zip(series, answer["runs"], strict=True):
        lookups = sorted(run["lookup_s"])
        floor = statistics.median(run["floor_s"])
        params = {
            **size,
            "lookups": len(lookups),
            "found_whole": f"{run['whole']}/{len(lookups)}",
            "loop_lag_ms": {"leader": round(lags[0] * 1e3, 1), "follower": round(lags[1] * 1e3, 1)},
        }
        report.add(
            f"{n}.lookup_p50{where}",
            lookups[len(lookups) // 2] * 1e3,
            "ms",
            floor * 1e3,
            **params,
            limit_name="an empty request",
        )
        p99, floor_p99 = _p99(lookups), _p99(sorted(run["floor_s"]))
        report.add(
            f"{n}.lookup_p99{where}",
            p99 * 1e3,
            "ms",
            1.0,
            **params,
            empty_request_p99_ms=round(floor_p99 * 1e3, 3),
            limit_name="1 ms (issue 45)",
        )


async def _keepalives(report: Report, fleet: Fleet, n: str, size: dict, seconds: float) -> None:
    """Renewals alone (nothing else asked of the conductors): their latency and the conductors' CPU."""
    await asyncio.sleep(1.0)
    before, cpu0 = await fleet.nodes({"cmd": "stats"}), _conductors_cpu(fleet)
    await asyncio.sleep(seconds)
    cpu = _conductors_cpu(fleet) - cpu0
    after = await asyncio.gather(
        *(
            fleet.ask(g, {"cmd": "stats", "since": b["keepalives"]})
            for g, b in zip(fleet.node_generators, before, strict=True)
        )
    )
    renewals = sum(a["keepalives"] for a in after) - sum(b["keepalives"] for b in before)
    samples = [s for a in after for s in a["keepalive_s"]] or [float("nan")]
    empty = await fleet.ask(fleet.front, {"cmd": "lookup", "seconds": 0.5, "targets": [[None, fleet.urls[0]]]})
    floor = statistics.median(empty["runs"][0]["floor_s"])
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


async def _dead_node(report: Report, fleet: Fleet, n: str, size: dict) -> None:
    """Node 0 stops renewing its lease: until a lookup of its chain, on either conductor, no longer lists it."""
    first = fleet.node_generators[0]
    await fleet.ask(first, {"cmd": "crash", "index": 0})
    started = time.monotonic()
    while time.monotonic() - started < 60:
        held = [await fleet.ask(first, {"cmd": "holders", "url": url, "nodes": [0]}) for url in fleet.urls]
        if not any(h["whole"] for h in held):
            break
        await asyncio.sleep(0.1)
    gone = time.monotonic() - started
    report.add(f"{n}.dead_node_s", gone, "s", TTL_S, **size, limit_name="the node's lease TTL")


async def _failover(report: Report, fleet: Fleet, n: str, size: dict, leader: int, nodes: int) -> None:
    """SIGKILL the leader: until the other conductor leads and lists one chain of every live node whole."""
    other = 1 - leader
    live = list(range(1, nodes))  # node 0 crashed above
    before = sum(s["rereported_chains"] for s in await fleet.nodes({"cmd": "stats"}))
    os.kill(fleet.conductors[leader].proc.pid, signal.SIGKILL)
    started = time.monotonic()
    url, missing = fleet.urls[other], live
    while time.monotonic() - started < 120:
        if await fleet.leader(url) == other:
            answers = await asyncio.gather(
                *(
                    fleet.ask(g, {"cmd": "holders", "url": url, "nodes": [i for i in live if i in g.nodes]})
                    for g in fleet.node_generators
                )
            )
            missing = sorted(set(live) - {i for a in answers for i in a["whole"]})
            if not missing:
                break
        await asyncio.sleep(0.1)
    lasted = time.monotonic() - started
    await asyncio.sleep(TTL_S / 3 + 1)  # every member has seen the new term by now
    rereported = sum(s["rereported_chains"] for s in await fleet.nodes({"cmd": "stats"})) - before
    report.add(
        f"{n}.failover_s",
        lasted,
        "s",
        FAILOVER_LIMIT_S,
        **size,
        missing_after=len(missing),
        rereported_blocks=rereported * CHAIN,
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
        await meta.commit(ops, concurrency=8)  # as many in flight as a group commit of placements kept
        rate = RAW_OPS / (time.perf_counter() - started)
        await meta.commit([Delete(op.key) for op in ops], concurrency=8)
    finally:
        await meta.close()
    return rate


async def _etcd_status(etcd: EtcdCluster) -> tuple[int, int]:
    """Bytes of etcd's database (its first member's; every member holds the same) and its revision."""
    status = await asyncio.to_thread(etcd.members[0].status)
    return int(status["dbSize"]), int(status["header"]["revision"])


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
