"""``tiercake up``: a whole local cluster from one command.

It starts a conductor (embedded backend unless etcd endpoints are given) serving the control API and
the OpenAI-compatible API on ``--port``, one node agent (pool and SSD tiers), and the workers (one
prefill and one decode by default), each a process of its own. It prints where it listens and how
to send a request, and stops everything, in reverse order, on Ctrl-C or SIGTERM. Each process's
log is in ``<data dir>/logs/``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from .config import TiercakeConfig


class StartError(RuntimeError):
    """A process of the cluster did not start; the message says why (the tail of its log)."""


class Child:
    def __init__(self, name: str, args: list[str], env: dict, logs: Path) -> None:
        self.name = name
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen([sys.executable, "-m", "tiercake.cli", *args], stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, start_new_session=True)
        self.announce: dict = {}

    def wait_announce(self, timeout: float) -> dict:
        """The child's first stdout line (JSON: where it listens)."""
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        try:
            if not result or not result[0]:
                raise ValueError("no announcement")
            self.announce = json.loads(result[0])
        except ValueError:
            self.stop()
            tail = self.log_path.read_text(errors="replace").strip()[-2000:]
            said = result[0].decode(errors="replace").strip() if result and result[0] else ""
            raise StartError(f"the {self.name} did not start (its log: {self.log_path}):\n{said}\n{tail}".rstrip()) from None
        return self.announce

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class NodeCluster:
    """A conductor and one node agent as processes, without workers: the tiers under engines that run
    beside them (vLLM instances with the TiercakeConnector). ``env`` must carry the cluster secret."""

    def __init__(self, config: TiercakeConfig, root: Path, env: dict[str, str], port: int = 0) -> None:
        self.root, self.env, self.logs = root, env, root / "logs"
        root.mkdir(parents=True, exist_ok=True)
        cfg = config.model_copy(deep=True)
        cfg.conductor.port = port
        (root / "up-conductor.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.conductor = Child("conductor", ["conductor", "--config", str(root / "up-conductor.yaml"),
                                             "--id", "conductor-0"], env, self.logs)
        try:
            self.url = self.conductor.wait_announce(60)["url"]
            cfg.conductor.urls = [self.url]
            self.config = cfg
            (root / "up-node.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            self.node = self.start_node()
        except BaseException:
            self.conductor.stop()
            raise

    def start_node(self) -> Child:
        node = Child("node", ["node", "--config", str(self.root / "up-node.yaml")], self.env, self.logs)
        node.wait_announce(120)
        return node

    def restart_node(self) -> None:
        self.node.stop()
        self.node = self.start_node()

    def close(self) -> None:
        self.node.stop()
        self.conductor.stop()


def up_vllm(config: TiercakeConfig, data_dir: Path, model: Path, instances: int, port: int,
            print_fn=print, ready_file: Path | None = None) -> int:
    """``tiercake up --engine vllm``: a conductor and a node agent, and ``instances`` vLLM servers with
    the TiercakeConnector on ports ``port``, ``port + 1``, ... (vLLM serves the OpenAI API itself; the
    front does not route to vLLM yet)."""
    from tiercake.conductor.etcd_process import free_port
    from tiercake.workers.vllm.process import VllmServer, serve_command

    if not (model / "config.json").exists():
        raise ValueError(f"{model} is not a Hugging Face model directory (no config.json)")
    env = dict(os.environ)
    if not env.get(config.transfer.secret_env) and not config.transfer.secret_file:
        env[config.transfer.secret_env] = secrets.token_hex(24)
    cfg = config.model_copy(deep=True)
    cfg.store.layout = None  # the pool holds vLLM's blocks, whatever their size
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = NodeCluster(cfg, data_dir, env, port=free_port())
    servers: list[VllmServer] = []
    try:
        for i in range(instances):
            command = serve_command(model, model.name, port + i, cluster.url, cfg.node_id)
            servers.append(VllmServer(command, env, data_dir / "logs" / f"vllm-{i}.log", port + i))
        for server in servers:
            server.wait_ready()
        urls = [server.url for server in servers]
        print_fn(f"tiercake is up under vLLM: {', '.join(urls)}  (conductor {cluster.url}, node agent "
                 f"{cfg.node_id}, {instances} vLLM servers with the TiercakeConnector; logs in {data_dir / 'logs'})")
        print_fn(f"  curl -s {urls[0]}/v1/completions -H 'Content-Type: application/json' \\\n"
                 f"    -d '{{\"model\": \"{model.name}\", \"prompt\": \"...\", \"max_tokens\": 16}}'")
        print_fn("Ctrl-C stops everything.")
        if ready_file is not None:
            ready_file.write_text(json.dumps({"urls": urls, "conductor": cluster.url}))
        while not stop.is_set():
            if any(server.proc.poll() is not None for server in servers):
                print_fn("a vLLM server exited (see its log); stopping")
                break
            stop.wait(0.5)
        return 0
    finally:
        for server in servers:
            server.stop()
        cluster.close()
        print_fn("tiercake is down")


def up(config: TiercakeConfig, data_dir: Path, host: str, port: int, prefill: int, decode: int, workers: int,
       etcd: list[str], print_fn=print, ready_file: Path | None = None) -> int:
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if not env.get(config.transfer.secret_env) and not config.transfer.secret_file:
        env[config.transfer.secret_env] = secrets.token_hex(24)  # this cluster's secret, for its processes only
    logs = data_dir / "logs"
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cfg = config.model_copy(deep=True)
        cfg.conductor.host, cfg.conductor.port = host, port
        if etcd:
            cfg.conductor.etcd = etcd
        conductor_cfg = data_dir / "up-conductor.yaml"
        conductor_cfg.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        conductor = Child("conductor", ["conductor", "--config", str(conductor_cfg), "--id", "conductor-0"], env, logs)
        children.append(conductor)
        url = conductor.wait_announce(60)["url"]
        cfg.conductor.urls = [url]
        node_cfg = data_dir / "up-node.yaml"
        node_cfg.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        node = Child("node", ["node", "--config", str(node_cfg)], env, logs)
        children.append(node)
        node.wait_announce(120)
        roles = [("prefill", prefill), ("decode", decode), ("worker", workers)]
        for role, count in roles:
            for i in range(count):
                name = f"{role}-{i}"
                child = Child(name, ["worker", "--config", str(node_cfg), "--role", role,
                                     "--id", f"{cfg.node_id}-{name}", "--data-dir", str(data_dir)], env, logs)
                children.append(child)
        for child in children[2:]:
            child.wait_announce(300)  # a worker calibrates its timings first (persisted for next time)
        model = cfg.model_id
        print_fn(f"tiercake is up: {url}  (conductor, node agent, {len(children) - 2} workers; logs in {logs})")
        print_fn("send a request:")
        print_fn(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
                 f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello, tiers!\", \"max_tokens\": 16, "
                 f"\"temperature\": 0}}'")
        print_fn(f"  tiercake ask 'Hello, tiers!' --url {url}     (twice: the second reuses the cached prefix)")
        print_fn("Ctrl-C stops everything.")
        if ready_file is not None:
            ready_file.write_text(json.dumps({"url": url}))
        while not stop.is_set():
            for child in children:
                if child.proc.poll() is not None:
                    print_fn(f"{child.name} exited with {child.proc.returncode} (see {child.log_path}); stopping")
                    stop.set()
                    break
            stop.wait(0.5)
        return 0
    finally:
        for child in reversed(children):
            child.stop()
        print_fn("tiercake is down")


class UpProcess:
    """``tiercake up`` as a child process (benchmarks and tests drive a real cluster through it)."""

    def __init__(self, config_path: Path, data_dir: Path, port: int, args: list[str] = ()) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercake.cli", "up", "--config", str(config_path), "--data-dir", str(data_dir),
             "--port", str(port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, workers: int, timeout: float = 180.0) -> None:
        """Until a node agent and ``workers`` workers are members."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tiercake up exited:\n" + self.proc.stdout.read().decode()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/v1/members", timeout=2) as resp:
                    members = json.loads(resp.read())["members"]
                if any(m["role"] == "node" for m in members) and sum(m["role"] != "node" for m in members) >= workers:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the cluster did not come up in time")

    def stop(self) -> str:
        """Ctrl-C, as a user would; returns what it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.stdout.read().decode()
