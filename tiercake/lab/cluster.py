"""``tiercake lab up``'s cluster: hosts (``hosts.py``) whose links delay, drop and limit (``links.py``),
and on them the processes a rack runs, each started by the same ``tiercake`` command a real host runs
and told only its own host's address and, by configuration, the others': a 3-member etcd on the
first three hosts, two conductors (the first host's with the front), and on every host a node agent
and its workers. Nothing in it assumes 127.0.0.1 or a /dev/shm shared between hosts.

Every process is a ``Child`` of ``tiercake up``'s kind, restarted when it exits (as a host's service
manager would), its log in ``<root>/logs/<host>-<name>.log``; its process group is recorded in the lab's
state file as it starts, so that ``tiercake lab down`` takes everything away after a crash too."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ByteSize

from tiercake.config import TiercakeConfig, TierConfig, config_data, default_config, merge

from . import hosts as lab_hosts
from . import links
from .hosts import Host, HostsState

ETCD_CLIENT, ETCD_PEER = 2379, 2380
CONTROL_PORT, NODE_PORT = 8701, 7400
FRONT_PORT = 8080
POOL = "/dev/shm/tiercake-lab-pool"  # in each host's own /dev/shm
STATE = "lab.json"


@dataclass
class LabSpec:
    """What ``lab up`` makes."""

    hosts: int = 3
    rtt_ms: float = 0.4  # each link's round trip: 0.2 ms one way, as a rack's
    loss: float = 0.0
    rate_gbit: float | None = None
    workers: int = 1  # per host, each prefill and decode both
    port: int = FRONT_PORT
    config: Path | None = None  # over the lab's defaults

    def check(self) -> None:
        if not 1 <= self.hosts <= 64:
            raise ValueError(f"a lab has 1 to 64 hosts, got {self.hosts}")
        if not (0 <= self.rtt_ms <= 1000):  # also NaN
            raise ValueError(f"--rtt-ms is 0 to 1000, got {self.rtt_ms}")
        if not (0 <= self.loss < 1):
            raise ValueError(f"--loss is a probability in [0, 1), got {self.loss}")
        if self.rate_gbit is not None and not (0.001 <= self.rate_gbit <= 400):
            raise ValueError(f"--rate is 0.001 to 400 Gbit/s, got {self.rate_gbit}")
        if not 0 <= self.workers <= 8:
            raise ValueError(f"--workers is 0 to 8 per host, got {self.workers}")


LAB_DEFAULTS = {
    "conductor": {"member_ttl": 2},
    "objects": {"failover_s": 3, "lease_ttl_s": 2},
}


@dataclass
class Lab:
    """A lab being made or running; ``start`` makes it, ``close`` takes it all away."""

    root: Path
    spec: LabSpec
    print_fn: object = print
    state: HostsState | None = None
    children: list = field(default_factory=list)
    url: str = ""  # the front's
    control_urls: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    token_at: str | None = None
    measured_rtt_s: float = 0.0
    config: TiercakeConfig | None = None  # what every host's is made from

    @property
    def made(self) -> HostsState:
        """The hosts of a lab that ``start`` has made (an error before)."""
        if self.state is None:
            raise lab_hosts.LabUnavailable("the lab has no hosts yet: start() makes them")
        return self.state

    @property
    def state_path(self) -> Path:
        return self.root / STATE

    def start(self, stop: threading.Event | None = None) -> Lab:
        from tiercake.up import credentials

        self.spec.check()
        lab_hosts.require_root()
        self.root.mkdir(parents=True, exist_ok=True)
        for old in self.root.glob("h[0-9]*"):  # a lab starts afresh: no etcd, map or SSD of the last one
            shutil.rmtree(old)
        self.state = lab_hosts.make_hosts(self.spec.hosts, self.state_path)
        self.state.owner = os.getpid()
        self._save()
        try:
            base = self.config = self._base_config()
            self.env = dict(os.environ)
            self.token_at = credentials(base, self.root, self.env)
            self._links()
            self._etcd(base, stop)
            self._conductors(base, stop)
            self._nodes_and_workers(base, stop)
        except BaseException:
            self.close()
            raise
        return self

    # the parts, in the order they start ------------------------------------------------------

    def _links(self) -> None:
        for host in self.made.hosts:
            links.shape(self.made, host, loss=self.spec.loss, rate_gbit=self.spec.rate_gbit)
            relay = self._child(host, "delay", argv=links.delay_command(host))
            _wait_for(lambda r=relay: b"ready" in r.log_path.read_bytes(), 10, f"{host.name}'s link relay")
        if len(self.made.hosts) > 1:
            self.measured_rtt_s = links.set_rtt(self.made, self.spec.rtt_ms / 1e3)

    def _etcd(self, base: TiercakeConfig, stop) -> None:
        from tiercake.conductor.etcd_process import EtcdMember

        members = self.etcd_hosts()
        cluster = ",".join(f"{h.name}=http://{h.address}:{ETCD_PEER}" for h in members)
        etcd = [
            EtcdMember(h.name, self.root / h.name / "etcd", ETCD_CLIENT, ETCD_PEER, cluster, host=h.address)
            for h in members
        ]
        for host, member in zip(members, etcd, strict=True):
            self._child(host, "etcd", argv=member.command())
        for member in etcd:
            _wait_for(lambda m=member: _healthy(m), 30, f"etcd member {member.name}", stop)
        base.conductor.etcd = [m.endpoint for m in etcd]

    def _conductors(self, base: TiercakeConfig, stop) -> None:
        hosts = self.made.hosts[:2]
        self.control_urls = [f"http://{h.address}:{CONTROL_PORT}" for h in hosts]
        base.conductor.urls = list(self.control_urls)
        for i, host in enumerate(hosts):
            cfg = self._host_config(base, host)
            cfg.serving.port = self.spec.port if i == 0 else None  # the front on the first host only
            path = self._write(host, "conductor", cfg)
            child = self._child(
                host, "conductor", ["conductor", "--config", str(path), "--id", f"conductor-{host.name}"]
            )
            announced = child.wait_announce(60, stop)
            if i == 0:
                self.url = announced.get("api_url", announced["url"])

    def _nodes_and_workers(self, base: TiercakeConfig, stop) -> None:
        nodes = []
        for host in self.made.hosts:
            path = self._write(host, "node", self._host_config(base, host))
            nodes.append(self._child(host, "node", ["node", "--config", str(path)]))
        for node in nodes:
            node.wait_announce(120, stop)
        workers = []
        for i in range(self.spec.workers):
            for host in self.made.hosts:
                argv = ["worker", "--config", str(self.root / host.name / "node.yaml"), "--role", "worker"]
                argv += ["--id", f"{host.name}-worker-{i}", "--listen", f"{host.address}:0"]
                argv += ["--data-dir", str(self.root / "calibration")]  # one machine: one fit of its timings
                workers.append(self._child(host, f"worker-{i}", argv))
                if len(workers) == 1:
                    workers[0].wait_announce(300, stop)  # the first measures; the rest read its fit
        for worker in workers[1:]:
            worker.wait_announce(300, stop)

    # configuration -----------------------------------------------------------------------------

    def _base_config(self) -> TiercakeConfig:
        """The lab's defaults (members and leases short, so that a cut host's slots move within
        seconds), the operator's config (``--config``) over them."""
        data = merge(default_config(self.root).model_dump(mode="json"), LAB_DEFAULTS)
        if self.spec.config is not None:
            data = merge(data, config_data(self.spec.config))
        return TiercakeConfig.model_validate(data)

    def _host_config(self, base: TiercakeConfig, host: Host) -> TiercakeConfig:
        """``base`` for the processes of ``host``: its name, its own address for everything it serves,
        its tiers (the pool in its own /dev/shm, its SSD in its own directory)."""
        cfg = base.model_copy(deep=True)
        cfg.node_id = host.name
        cfg.conductor.host = cfg.transfer.host = host.address
        cfg.conductor.port, cfg.transfer.port = CONTROL_PORT, NODE_PORT
        cfg.serving.host = host.address
        cfg.store.tiers = [
            TierConfig(kind="gpu", capacity=ByteSize(4 << 20)),
            TierConfig(kind="pool", capacity=ByteSize(64 << 20), path=POOL, keep_on_stop=True),
            TierConfig(
                kind="ssd", capacity=ByteSize(256 << 20), path=str(self.root / host.name / "ssd"), compression=True
            ),
        ]
        return cfg

    def _write(self, host: Host, role: str, cfg: TiercakeConfig) -> Path:
        path = self.root / host.name / f"{role}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        return path

    # processes ---------------------------------------------------------------------------------

    def _child(self, host: Host, name: str, args: Sequence[str] = (), argv: list[str] | None = None):
        from tiercake.up import Child, env_for

        if argv is not None:  # a relay or etcd: no secret at all
            env = {k: v for k, v in self.env.items() if not k.startswith("TIERCAKE")}
        else:
            role = name if name in ("node", "conductor") else "worker"
            assert self.config is not None, "a tiercake process starts after the config is made"
            env = env_for(role, self.config, self.env)
        child = Child(f"{host.name}-{name}", list(args), env, self.root / "logs", argv=argv, prefix=host.prefix())
        self.children.append(child)
        self.made.pids.append(child.proc.pid)
        self._save()
        return child

    def restarted(self, child) -> None:
        """After the supervisor started ``child`` again: its new process group recorded."""
        self.made.pids.append(child.proc.pid)
        self._save()

    def etcd_hosts(self) -> list[Host]:
        return self.made.hosts[:3]

    def host(self, name: str) -> Host:
        return next(h for h in self.made.hosts if h.name == name)

    def child(self, name: str):
        return next(c for c in self.children if c.name == name)

    def _save(self) -> None:
        self.made.url = self.url
        self.made.save(self.state_path)

    def close(self) -> list[str]:
        """Every process stopped (SIGTERM, then SIGKILL), then the hosts taken away; what is left, named."""
        from tiercake.up import stop_all

        stop_all([c for c in self.children if not c.name.endswith(("-etcd", "-delay"))])
        stop_all([c for c in self.children if c.name.endswith(("-etcd", "-delay"))])
        left = lab_hosts.remove(self.state) if self.state is not None else []
        if not left:
            self.state_path.unlink(missing_ok=True)
        return left


def _healthy(member) -> bool:
    try:
        return member.healthy()
    except (OSError, ValueError):
        return False


def _wait_for(ready, timeout: float, what: str, stop: threading.Event | None = None) -> None:
    from tiercake.up import Interrupted, StartError

    deadline = time.monotonic() + timeout
    while not ready():
        if stop is not None and stop.is_set():
            raise Interrupted()
        if time.monotonic() > deadline:
            raise StartError(f"{what} did not start within {timeout:.0f} s")
        time.sleep(0.1)
