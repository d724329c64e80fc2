"""Local etcd server processes: started from the installed `etcd` binary (Debian's etcd-server) on
free loopback ports with their own data directories. The tests and `tiercake bench metadata` use it
to run against a real etcd; a one-machine deployment can too."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if path is None:
        raise FileNotFoundError("no etcd binary on PATH: install Debian's etcd-server (`make test` does)")
    return path


def free_port() -> int:
    """A loopback port free now, for a process about to be started to listen on. Drawn below the
    kernel's ephemeral range, from which every outgoing connection takes its source port: a port the
    kernel hands out for binding 0 is such a port, and a connection made before the child bound it
    could take it (seen: vLLM's KV-events port, bound by its worker minutes after it was picked)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(_LISTEN_LOW, low) if low > _LISTEN_LOW + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free loopback port to listen on")


_LISTEN_LOW = 10_000  # above the well-known and registered ports most services default to


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read: any port then)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class EtcdMember:
    def __init__(
        self,
        name: str,
        data_dir: Path,
        client_port: int,
        peer_port: int,
        cluster: str,
        state: str = "new",
        host: str = "127.0.0.1",
    ):
        """``host``: the address it listens on and is reached at (a lab host's, or loopback)."""
        self.name, self.host = name, host
        self.data_dir = data_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.cluster = cluster
        self.state = state
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        """The member's command line (its data directory kept across restarts: the flags of a new
        cluster are ignored once it has one)."""
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.cluster,
            "--initial-cluster-state",
            self.state,
            "--initial-cluster-token",
            "tiercake-test",
            "--grpc-keepalive-min-time",
            "500ms",  # the backend pings each second (conductor/etcd.py's KEEPALIVE_MS): with room to spare
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--log-level",
            "error",
        ]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the member reports itself healthy (it has a leader and serves requests)."""
        deadline = time.monotonic() + timeout
        proc = self.proc
        assert proc is not None, "start() first"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = proc.stderr.read().decode()[-2000:] if proc.stderr is not None else ""
                raise RuntimeError(f"etcd {self.name} exited: {said}")
            try:
                if self.healthy():
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd {self.name} was not healthy within {timeout} s")

    def healthy(self) -> bool:
        """Whether the member says it is healthy (raises OSError when it cannot be reached)."""
        with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as resp:
            return json.loads(resp.read()).get("health") == "true"

    def status(self, timeout: float = 5.0) -> dict:
        """The member's maintenance status (its id, the leader's, ``dbSize``); blocking."""
        request = urllib.request.Request(f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(20)


class EtcdCluster:
    def __init__(self, root: Path, size: int = 1) -> None:
        ports = [(free_port(), free_port()) for _ in range(size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        self.members = [
            EtcdMember(f"m{i}", root / f"m{i}", client, peer, cluster) for i, (client, peer) in enumerate(ports)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self) -> EtcdCluster:
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_ready()
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop(kill=True)
