"""`tiercake bench hosts`: KV reuse across hosts, on a three-host lab (``tiercake lab up``).

**TTFT of a prefix pulled from another host, against recompute.** Per repetition, through the front:
a 928-token prefix computed on a worker of host A (its blocks written through to A's node), then the
1024-token prompt that extends it (90% held), routed to the worker of host B, which pulls the prefix
from A's node over the lab's link; then a fresh 1024-token prompt on that same worker B, computed
whole. The front routes round robin for this bench (``serving.router``), so B is picked by turn
while the router's cost model still decides whether B pulls or computes. The front's TTFT of each
(``usage.tiercake.ttft_s``), at 0.2, 1 and 5 ms round trips (set between phases, repetitions
interleaved): ``hosts.ttft_rtt<R>ms``, the pulled request's median over the recomputed one's.

**A slow link.** Every host's link limited to 20 Mbit/s: after two pulls per pair have measured it,
the router has B compute the prompt instead (``hosts.slow_link_recomputed``: the share of the later
requests computed, limit 1; ``hosts.ttft_slow_link``: their TTFT over recompute's).

**A pull's bytes/s.** 1 MiB objects owned by A's node read with ``get_many_into`` by a client on
host B, against a raw TCP stream of the same bytes from A to B, in the same run, alternating
(``hosts.pull_1mib``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tiercake.lab import links
from tiercake.lab.hosts import Host
from tiercake.lab.process import LabProcess

from .report import Report, machine

RTTS_MS = (0.2, 1.0, 5.0)
PREFIX_TOKENS, PROMPT_TOKENS = 928, 1024  # 58 blocks of 16 held: 90.6% of the prompt
SLOW_GBIT = 0.02
LEARN = 6  # requests over the slow link before it counts: two per pair of hosts (round robin over three)
RAW_PORT = 7611
OBJECT = 1 << 20
PROBE = [sys.executable, "-m", "tiercake.bench.hosts_probe"]


@dataclass
class Answer:
    ttft_s: float
    cached: int
    worker: str
    sources: dict[str, int]


async def run(quick: bool = False) -> Report:
    report = Report(bench="hosts", machine=machine())
    reps = 3 if quick else 9
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-hosts-") as tmp:
        config = Path(tmp) / "lab.yaml"
        config.write_text("serving:\n  router: round_robin\n")
        lab = LabProcess(Path(tmp) / "lab", ["--hosts", "3", "--config", str(config)])
        try:
            await asyncio.to_thread(lab.wait_ready)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                bench = _Reuse(lab, http, random.Random(11))
                await bench.align()
                await _ttft_figures(report, lab, bench, reps)
                await _slow_link(report, lab, bench, reps)
            await _pull_figure(report, lab, 16 if quick else 64, reps)
        finally:
            await asyncio.to_thread(lab.stop)
    return report


class _Reuse:
    """Requests through the lab's front, round robin over its three workers."""

    def __init__(self, lab: LabProcess, http: aiohttp.ClientSession, rng: random.Random) -> None:
        self.lab, self.http, self.rng = lab, http, rng
        self.workers = len(lab.hosts)

    def text(self, n: int) -> str:
        return "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))

    async def ask(self, prompt: str) -> Answer:
        body = {"model": "tiercake-reference", "prompt": prompt, "max_tokens": 1}
        async with self.http.post(self.lab.url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"the front answered {resp.status}: {data}")
        usage = data["usage"]
        mine = usage["tiercake"]
        return Answer(
            mine["ttft_s"], usage["prompt_tokens_details"]["cached_tokens"], mine["prefilled_on"][0], mine["sources"]
        )

    async def align(self) -> None:
        """Warm every worker (its first request pays for imports and allocation)."""
        for _ in range(2 * self.workers):
            await self.ask(self.text(PROMPT_TOKENS))

    async def one(self) -> tuple[Answer, Answer, Answer] | None:
        """(the prefix on A, the prompt on B, a fresh prompt on B); None when a turn went astray."""
        prefix = self.text(PREFIX_TOKENS)
        on_a = await self.ask(prefix)
        await asyncio.sleep(0.3)  # A's node reports the new blocks to the index
        on_b = await self.ask(prefix + self.text(PROMPT_TOKENS - PREFIX_TOKENS))
        for _ in range(self.workers - 1):  # the turn back to B
            await self.ask(self.text(8))
        fresh = await self.ask(self.text(PROMPT_TOKENS))
        if on_b.worker == on_a.worker or fresh.worker != on_b.worker:
            return None
        return on_a, on_b, fresh


def _node_of(worker: str) -> str:
    return worker.split("-", 1)[0]  # the lab's workers are <host>-worker-<i>, beside node <host>


async def _ttft_figures(report: Report, lab: LabProcess, bench: _Reuse, reps: int) -> None:
    pulled: dict[float, list[float]] = {r: [] for r in RTTS_MS}
    computed: dict[float, list[float]] = {r: [] for r in RTTS_MS}
    held: dict[float, int] = dict.fromkeys(RTTS_MS, 0)
    missed: dict[float, list[str]] = {r: [] for r in RTTS_MS}  # what the pulled request did instead
    measured: dict[float, list[float]] = {r: [] for r in RTTS_MS}
    for _ in range(reps):
        for rtt in RTTS_MS:  # interleaved
            measured[rtt].append(await asyncio.to_thread(links.set_rtt, lab.made, rtt / 1e3))
            got = await bench.one()
            if got is None:
                continue
            on_a, on_b, fresh = got
            remote = {s.rsplit(":", 1)[0] for s in on_b.sources} - {_node_of(on_b.worker)}
            if on_b.cached >= PREFIX_TOKENS and _node_of(on_a.worker) in remote:
                held[rtt] += 1
            else:
                missed[rtt].append(f"{on_a.worker}->{on_b.worker} cached {on_b.cached} from {on_b.sources}")
            pulled[rtt].append(on_b.ttft_s)
            computed[rtt].append(fresh.ttft_s)
    for rtt in RTTS_MS:
        name = f"hosts.ttft_rtt{rtt:g}ms"
        if not pulled[rtt]:
            raise RuntimeError(f"{name}: no repetition kept its turns (the front retried elsewhere)")
        report.add(
            name,
            statistics.median(pulled[rtt]),
            "s",
            statistics.median(computed[rtt]),
            limit_name="recompute of the same length on the same worker",
            rtt_ms_measured=round(statistics.median(measured[rtt]) * 1e3, 3),
            pulled_across_hosts=f"{held[rtt]}/{len(pulled[rtt])}",
            not_pulled=missed[rtt][:3],
            prompt_tokens=PROMPT_TOKENS,
            held_tokens=PREFIX_TOKENS,
        )
    await asyncio.to_thread(links.set_rtt, lab.made, 0.2e-3)


async def _slow_link(report: Report, lab: LabProcess, bench: _Reuse, reps: int) -> None:
    await asyncio.to_thread(links.set_rtt, lab.made, 1e-3)
    for host in lab.hosts:
        await asyncio.to_thread(links.set_rate, host, SLOW_GBIT)
    try:
        seen: list[tuple[bool, float, float]] = []  # (pulled, its ttft, recompute's)
        for _ in range(reps + LEARN):
            got = await bench.one()
            if got is not None:
                _, on_b, fresh = got
                seen.append((on_b.cached >= PREFIX_TOKENS, on_b.ttft_s, fresh.ttft_s))
    finally:
        for host in lab.hosts:
            await asyncio.to_thread(links.set_rate, host, None)
        await asyncio.to_thread(links.set_rtt, lab.made, 0.2e-3)
    later = seen[LEARN:]  # after each pair's first pulls have measured the link
    if not later:
        raise RuntimeError("hosts.slow_link: no repetition kept its turns")
    recomputed = sum(not pulled for pulled, _, _ in later)
    report.add(
        "hosts.slow_link_recomputed",
        recomputed / len(later),
        "share",
        1.0,
        limit_name="every request computed once the link is known slow",
        rate_mbit=SLOW_GBIT * 1e3,
        first_pulls=f"{sum(pulled for pulled, _, _ in seen[:LEARN])}/{LEARN}",
    )
    report.add(
        "hosts.ttft_slow_link",
        statistics.median(t for _, t, _ in later),
        "s",
        statistics.median(r for _, _, r in later),
        limit_name="recompute on the same worker",
    )


async def _pull_figure(report: Report, lab: LabProcess, objects: int, reps: int) -> None:
    from tiercake.blocks import object_id, object_slot
    from tiercake.kvstore import AsyncStore

    a, b = lab.hosts[0], lab.hosts[1]
    async with AsyncStore(lab.control_urls, secret=lab.secret, token=lab.token) as store:
        await store.refresh()
        names: list[str] = []
        i = 0
        while len(names) < objects:  # objects whose owner is A's node
            name = f"bench-hosts-{i}"
            if store.map.primary(object_slot(object_id(name.encode(), store.tenant), store.map.slots)) == a.name:
                names.append(name)
            i += 1
        value = os.urandom(OBJECT)
        for name in names:
            await store.put(name, value, replace=True)
    listing = Path(tempfile.mkdtemp(prefix="tiercake-bench-hosts-names-")) / "names"
    listing.write_text("\n".join(names))
    server = subprocess.Popen([*a.prefix(), *PROBE, "raw-serve", str(RAW_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()  # listening
        env = {**os.environ, "TIERCAKE_BENCH_URLS": ",".join(lab.control_urls)}
        env.update(TIERCAKE_SECRET=lab.secret, TIERCAKE_TOKEN=lab.token)
        raw, pulled = [], []
        for _ in range(reps):  # alternating
            raw.append(_probe(b, ["raw-read", a.address, str(RAW_PORT), str(objects * OBJECT)], env))
            pulled.append(_probe(b, ["pull", str(listing)], env))
    finally:
        server.kill()
        server.wait()
        listing.unlink(missing_ok=True)
        listing.parent.rmdir()
    report.add(
        "hosts.pull_1mib",
        statistics.median(pulled),
        "B/s",
        statistics.median(raw),
        limit_name=f"raw TCP stream {a.name} -> {b.name}, same run",
        objects=objects,
        rtt_ms=0.2,
    )


def _probe(host: Host, args: list[str], env: dict[str, str]) -> float:
    done = subprocess.run([*host.prefix(), *PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{host.name}: hosts_probe {args[0]} failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["bytes"] / out["seconds"]
