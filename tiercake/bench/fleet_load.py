"""One load generator of `tiercake bench fleet`: simulated node agents, or a front, control traffic
only (no block bytes), sent through the real conductor client as the real members send it.

Each simulated node registers, renews its lease every third of its TTL (a renewal that finds the
lease gone registers again, as ``ConductorLink`` does), and on ``fill`` reports the chains of 64
blocks it holds as a node agent does after a restart: its changes coalesced, ``REPORT_CHAINS`` chains
a report, one report in flight per node. When a renewal shows a new leader's term it re-reports
the chains acknowledged in the window the term names (or all of them), as ``ConductorLink`` does.
A generator of no nodes is a front: ``lookup`` times 64-block chain lookups of the fleet's chains as
vLLM's scheduler side makes them, closed loop, interleaved with an empty request to the same
conductor (the floor of any lookup over HTTP). The parent (``fleet.py``) drives it with one JSON
command per line on stdin; each answer is one JSON line on stdout.

    python -m tiercake.bench.fleet_load --urls URL,... --first 0 --nodes 50 --blocks 1024 --fleet 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import numpy as np

from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import MemberInfo
from tiercake.workers.conductor_link import RECENT_S

CHAIN = 64
REPORT_CHAINS = 16  # chains a report carries (1,024 blocks)
TENANT = "fleet"
TTL_S = 5
BLOCK_NBYTES = 1 << 20
_TAG = 0x7469657263616B65


def node_id(i: int) -> str:
    return f"fleet-{i:05d}"


def chain_keys(node: int, chains: Iterable[int]) -> list[bytes]:
    """The blocks of ``chains`` of node ``node``, 64 distinct 32-byte keys each (what a BlockKey is on
    the wire), chain after chain."""
    picked = np.asarray(list(chains), dtype=np.uint64)
    words = np.empty((len(picked), CHAIN, 4), dtype=">u8")
    words[:, :, 0] = node
    words[:, :, 1] = picked[:, None]
    words[:, :, 2] = np.arange(CHAIN, dtype=np.uint64)[None, :]
    words[:, :, 3] = _TAG
    raw = words.tobytes()
    return [raw[i : i + 32] for i in range(0, len(raw), 32)]


class SimNode:
    def __init__(self, index: int, urls: list[str], token: str, renewals: list[float]) -> None:
        self.index, self.id = index, node_id(index)
        self.client = Client(urls, token=token, timeout=30)
        self.lease = 0
        self.alive = True
        self.keepalives = 0
        self.renewals = renewals  # every renewal's seconds, the generator's nodes together, in order
        self.errors = 0
        self.chains = 0  # what it holds: reported again whenever it registers again
        self.term = 0  # the leader's, as its last renewal said
        self.acked: dict[int, float] = {}  # chain -> when the conductor last acknowledged its report
        self.rereported = 0  # chains sent again to a new term
        self._filling = self._restart = False  # a fill under way; it starts over (registered again)
        self._task: asyncio.Task | None = None
        self._refill: asyncio.Task | None = None

    def member(self) -> MemberInfo:
        """What it registers as: a node agent with a pool (its port is never dialled: no block moves)."""
        return MemberInfo(node_id=self.id, role="node", host="127.0.0.1", port=1, tiers={"pool": 1 << 40})

    async def register(self) -> None:
        self.lease = await self.client.register(self.member(), ttl=TTL_S)
        self._task = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        # a fleet's nodes start at different moments: renewals spread over the period, not in bursts
        await asyncio.sleep(random.uniform(0, TTL_S / 3))
        while self.alive:
            await asyncio.sleep(TTL_S / 3)
            started = time.perf_counter()
            try:
                answer = await self.client.keep_alive(self.id, self.lease)
            except ConductorError as exc:
                self.errors += 1
                if exc.status == 404:  # the lease is gone (a conductor failover took too long): again
                    with contextlib.suppress(ConductorError):
                        await self.register_again()
                continue
            self.keepalives += 1
            self.renewals.append(time.perf_counter() - started)
            if answer.term != self.term:  # a new leader: it may lack what was acknowledged lately
                if self.term:
                    self._report_again(answer.rereport_s)
                self.term = answer.term

    async def register_again(self) -> None:
        """As a node agent whose lease lapsed: register, then report everything it holds again (its
        placements went with the lease)."""
        self.lease = await self.client.register(self.member(), ttl=TTL_S)
        self._report_again(None)

    def _report_again(self, window: float | None) -> None:
        """What ``ConductorLink`` re-reports: the chains acknowledged in the last ``window`` seconds
        (a new leader that kept its mirror names it), or every chain held; as it coalesces them
        with what is still to be sent, a fill under way starts over instead of a second report
        of everything beside it."""
        if window is not None and window <= RECENT_S:
            since = time.monotonic() - window
            chains = [c for c, at in self.acked.items() if at >= since]
        elif self._filling:
            self._restart = True
            self.rereported += self.chains
            return
        else:
            chains = list(range(self.chains))
        self.rereported += len(chains)
        if chains and (self._refill is None or self._refill.done()):
            self._refill = asyncio.create_task(self._report(chains, float("inf")))

    async def fill(self, chains: int, deadline: float) -> int:
        """Report every chain it holds, or as many as it can before ``deadline`` (monotonic); how
        many blocks the index took."""
        self.chains, self._filling = chains, True
        try:
            return await self._report(range(chains), deadline, restartable=True)
        finally:
            self._filling = False

    async def _report(self, chains: Iterable[int], deadline: float, restartable: bool = False) -> int:
        ordered = list(chains)
        reported, first = 0, 0
        while first < len(ordered):
            if restartable and self._restart:  # registered again: the leader dropped what it had
                self._restart, first, reported = False, 0, 0
            batch = ordered[first : first + REPORT_CHAINS]
            first += REPORT_CHAINS
            keys = chain_keys(self.index, batch)
            attempt = 0
            while time.monotonic() < deadline:  # a report the conductor did not take is sent again
                try:
                    await self.client.report(TENANT, self.id, "pool", keys, [BLOCK_NBYTES] * len(keys))
                except ConductorError:
                    self.errors += 1
                    attempt += 1
                    await asyncio.sleep(min(2.0, 0.2 * attempt))
                    continue
                reported += len(keys)
                now = time.monotonic()
                self.acked.update((c, now) for c in batch)
                break
            else:
                break
        return reported

    def crash(self) -> None:
        """Stops renewing its lease, as a node that lost power would."""
        self.alive = False
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        self.crash()
        if self._refill is not None:
            self._refill.cancel()
        await self.client.close()


class Generator:
    def __init__(self, urls: list[str], token: str, first: int, nodes: int, chains: int, fleet: int) -> None:
        self.urls, self.token, self.chains, self.fleet = urls, token, chains, fleet
        self.renewals: list[float] = []
        self.nodes = [SimNode(first + i, urls, token, self.renewals) for i in range(nodes)]
        self.front = Client(urls, token=token, timeout=30)
        self.rng = random.Random(first)

    async def start(self) -> dict:
        for start in range(0, len(self.nodes), 50):  # registrations in waves, as a fleet's rollout would
            await asyncio.gather(*(n.register() for n in self.nodes[start : start + 50]))
        return {"ready": len(self.nodes)}

    async def fill(self, seconds: float) -> dict:
        cpu, started = _cpu(), time.perf_counter()
        deadline = time.monotonic() + seconds
        counts = await asyncio.gather(*(n.fill(self.chains, deadline) for n in self.nodes))
        return {"filled": sum(counts), "s": time.perf_counter() - started, "cpu_s": _cpu() - cpu}

    async def lookup(self, seconds: float, targets: list[list[str | None]]) -> dict:
        """Closed-loop lookups of a random chain of the fleet, each followed by the empty request,
        taking turns between ``targets`` (each [url, the empty request's url]) so that each is timed
        under the same conditions. A url None: the front's client, given every conductor, picks (as a
        member's does: a follower in step where there is one). Per target, in order."""
        fronts = [self.front if url is None else Client([url], token=self.token, timeout=30) for url, _ in targets]
        runs: list[dict] = [{"lookup_s": [], "floor_s": [], "whole": 0} for _ in targets]
        try:
            async with aiohttp.ClientSession() as http:
                deadline, turn = time.monotonic() + seconds, 0
                while time.monotonic() < deadline:
                    run, front, floor_url = runs[turn], fronts[turn], f"{targets[turn][1]}/health"
                    turn = (turn + 1) % len(targets)
                    node = self.rng.randrange(self.fleet)
                    keys = chain_keys(node, [self.rng.randrange(self.chains)])
                    started = time.perf_counter()
                    found = await front.lookup(TENANT, keys)
                    run["lookup_s"].append(time.perf_counter() - started)
                    held = found.get(node_id(node))
                    run["whole"] += held is not None and held.length == CHAIN
                    started = time.perf_counter()
                    async with http.get(floor_url) as resp:
                        await resp.read()
                    run["floor_s"].append(time.perf_counter() - started)
        finally:
            for front in fronts:
                if front is not self.front:
                    await front.close()
        return {"runs": runs}

    async def holders(self, url: str, nodes: list[int]) -> dict:
        """For one chain of each of ``nodes``: which of them the conductor at ``url`` lists as holding
        it whole (one request of many chains, as the front asks)."""
        client = Client([url], token=self.token, timeout=5)
        try:
            found = await client.lookup_many(TENANT, [chain_keys(i, [0]) for i in nodes])
        finally:
            await client.close()
        return {
            "whole": [
                i for i, f in zip(nodes, found, strict=True) if f.get(node_id(i)) and f[node_id(i)].length == CHAIN
            ]
        }

    def stats(self, since: int = 0) -> dict:
        """Renewals so far, and the seconds of each from the ``since``-th on."""
        return {
            "keepalives": len(self.renewals),
            "keepalive_s": self.renewals[since:],
            "errors": sum(n.errors for n in self.nodes),
            "rereported_chains": sum(n.rereported for n in self.nodes),
            "cpu_s": _cpu(),
        }

    def crash(self, index: int) -> dict:
        for n in self.nodes:
            if n.index == index:
                n.crash()
                return {"crashed": n.id}
        raise ValueError(f"node {index} is not one of this generator's")

    async def close(self) -> None:
        await asyncio.gather(*(n.close() for n in self.nodes), self.front.close())


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve(gen: Generator) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    _say(await gen.start())
    commands: dict[str, Callable[..., Any]] = {
        "fill": gen.fill,
        "lookup": gen.lookup,
        "holders": gen.holders,
        "stats": gen.stats,
        "crash": gen.crash,
    }
    try:
        while line := await reader.readline():
            command = json.loads(line)
            what = command.pop("cmd")
            if what == "stop":
                break
            try:
                answer = commands[what](**command)
                _say(await answer if asyncio.iscoroutine(answer) else answer)
            except (KeyError, TypeError) as exc:
                _say({"error": f"bad command {what!r}: {exc}"})
            except (ConductorError, aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
                _say({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        await gen.close()


def _say(answer: dict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", required=True, help="the conductors' control APIs, comma-separated")
    parser.add_argument("--first", type=int, default=0, help="the index of its first node")
    parser.add_argument("--nodes", type=int, required=True, help="nodes it simulates (0: a front)")
    parser.add_argument("--blocks", type=int, required=True, help="blocks per node (a multiple of 64)")
    parser.add_argument("--fleet", type=int, required=True, help="nodes in the whole fleet (whose chains it looks up)")
    args = parser.parse_args(argv)
    token = os.environ["TIERCAKE_TOKEN"]
    gen = Generator(args.urls.split(","), token, args.first, args.nodes, max(1, args.blocks // CHAIN), args.fleet)
    asyncio.run(_serve(gen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
