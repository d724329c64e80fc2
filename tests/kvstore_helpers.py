"""A key-value store cluster of real processes for the tests: a conductor (embedded backend, or
several on etcd) and node agents, each with its own shared-memory pool and SSD directory, talking over
loopback; node agents can be killed, restarted (same pool and SSD: adopted), or replaced."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import numpy as np
from conftest import Processes
from paths import shm_file

from tiercake.kvstore import AsyncStore
from tiercake.tiers.pool import remove_pool

SECRET = "kvstore-test-secret-0123456789"
TOKEN = "kvstore-test-token"
KB, MB = 1 << 10, 1 << 20


def blob(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class KvCluster:
    def __init__(
        self,
        tmp: Path,
        nodes: tuple[str, ...] = ("kv-a", "kv-b"),
        *,
        etcd=None,
        conductors: int = 1,
        pool: str = "96MiB",
        ssd: str | None = "256MiB",
        failover_s: float = 2.0,
        lease_ttl_s: float = 1.0,
        replicas_max: int = 3,
        pool_extra: str = "",
        start: bool = True,
        metrics: bool = False,
        member_ttl: float = 1.0,
        slots: int | None = None,
    ) -> None:
        """``metrics``: each node agent serves /metrics (its URL in ``announced[name]``); ``member_ttl``:
        the node agents' lease (short: the faults' tests wait less for a node to be gone)."""
        self.tmp = tmp
        self.group = Processes()
        self.env = {"TIERCAKE_SECRET": SECRET, "TIERCAKE_TOKEN": TOKEN}
        self.pool, self.ssd, self.pool_extra = pool, ssd, pool_extra
        self.lease_ttl_s = lease_ttl_s
        self.member_ttl = member_ttl
        self.objects = (
            f"{{failover_s: {failover_s}, lease_ttl_s: {lease_ttl_s}, bootstrap_s: 0.5, replicas_max: {replicas_max}"
            + (f", slots: {slots}}}" if slots else "}")
        )
        self.etcd = etcd
        self.conductors = []
        self.pools: dict[str, str] = {}
        (tmp / "conductor.yaml").write_text(
            f"store: {{tiers: [{{kind: pool, capacity: 1MiB}}]}}\nobjects: {self.objects}\n"
        )
        self.nodes: dict = {}
        self.metrics = metrics
        self.announced: dict[str, dict] = {}
        try:  # a process that fails to start leaves none of the others running (a module fixture's
            # teardown never runs when its setup raised)
            for i in range(conductors):
                self.conductors.append(self.start_conductor(i))
                if i == 0 and conductors > 1:
                    time.sleep(1.0)  # the first one wins the election
            self.urls = [url for _, url in self.conductors]
            self.url = self.urls[0]
            for name in nodes if start else ():
                self.start_node(name)
        except BaseException:
            self.close()
            raise

    def start_conductor(self, i: int):
        args = [
            "conductor",
            "--listen",
            "127.0.0.1:0",
            "--api-listen",
            "127.0.0.1:0",
            "--id",
            f"c{i}",
            "--config",
            str(self.tmp / "conductor.yaml"),
        ]
        if self.etcd is not None:
            args += ["--etcd", ",".join(self.etcd.endpoints), "--ttl", "1"]
        proc, info = self.group.start(args, self.env)
        return proc, info["url"]

    def config(self, name: str) -> Path:
        path = self.tmp / f"{name}.yaml"
        if not path.exists():
            pool = self.pools.setdefault(name, str(shm_file(f"kv-{uuid.uuid4().hex[:12]}")))
            ssd = f"    - {{kind: ssd, capacity: {self.ssd}, path: {self.tmp / name / 'ssd'}}}\n" if self.ssd else ""
            path.write_text(
                f"node_id: {name}\n"
                "store:\n  layout: null\n  tiers:\n"
                f"    - {{kind: pool, capacity: {self.pool}, path: {pool}{self.pool_extra}}}\n{ssd}"
                f"conductor: {{urls: {json.dumps(self.urls)}, member_ttl: {self.member_ttl}}}\n"
                f"objects: {self.objects}\n"
                "transfer: {host: 127.0.0.1" + (", metrics_port: 0" if self.metrics else "") + "}\n"
            )
        return path

    def start_node(self, name: str):
        proc, self.announced[name] = self.group.start(["node", "--config", str(self.config(name))], self.env)
        self.nodes[name] = proc
        return proc

    def metric(self, name: str, family: str) -> float:
        """One counter of a node agent's /metrics (``metrics=True``)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.announced[name]["metrics_url"], timeout=10) as resp:
            text = resp.read().decode()
        for parsed in text_string_to_metric_families(text):
            if parsed.name == family:
                return sum(sample.value for sample in parsed.samples if sample.name.endswith("_total"))
        raise KeyError(family)

    def kill(self, name: str) -> None:
        proc = self.nodes.pop(name)
        proc.kill()
        proc.wait(10)

    def restart(self, name: str) -> None:
        """SIGKILL the node agent and start it again on the same pool file and SSD directory."""
        self.kill(name)
        self.start_node(name)

    def store(self, **kw) -> AsyncStore:
        return AsyncStore(self.urls, secret=SECRET, token=TOKEN, **kw)

    def close(self) -> None:
        self.group.close()
        for pool in self.pools.values():
            remove_pool(pool)


async def ready(store: AsyncStore, nodes: int, timeout: float = 20.0, replicas_max: int = 3) -> None:
    """Until ``nodes`` node agents are members, every slot's chain is as long as it can be and made of
    them, every backup holds its slot whole, and every slot has its best node as primary (the
    rebalance is over)."""
    from tiercake.conductor.objects import rendezvous

    deadline = asyncio.get_running_loop().time() + timeout
    length = min(nodes, replicas_max)
    while True:
        await store.refresh()
        m = store.map
        members = set(store.members)
        if (
            len(members) >= nodes
            and m.chains
            and not m.handoff
            and all(len(c) == length and r == length and set(c) <= members for r, c in zip(m.ready, m.chains))
            and all(c[0] == rendezvous(slot, sorted(members))[0] for slot, c in enumerate(m.chains))
        ):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"cluster not ready: {len(store.members)} of {nodes} nodes, map epoch {m.epoch}, "
                f"ready {sorted(set(m.ready))}, handoffs {len(m.handoff)}"
            )
        await asyncio.sleep(0.1)
