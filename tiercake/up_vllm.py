"""``tiercake up --engine vllm``: the front, a conductor and a node agent (``up.NodeCluster``) over
vLLM servers that run tiercake's KV connector, a tiercake worker beside each; every process
supervised as under ``tiercake up``."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tiercake.conductor.front.tenants import SHARED_CACHE_NOTE

from .config import TiercakeConfig
from .up import (
    STOP_GRACE_S,
    Child,
    Interrupted,
    NodeCluster,
    StartError,
    Supervisor,
    credentials,
    env_for,
    give_back,
    last_error,
    on_stop_signals,
    pool_names,
    stop_all,
    storage_only,
)
from .up_state import DataDirLock, ShmLeftovers


def vllm_worker(
    cluster: NodeCluster, vllm_url: str, role: str, name: str, stop: threading.Event | None = None
) -> Child:
    """``tiercake worker --engine vllm`` for the vLLM server at ``vllm_url``, registered with the cluster's
    conductor, whose front then routes to it; returns once it is serving."""
    # --vllm-wait: restarted while its vLLM server restarts too, it waits for it instead of exiting again
    child = Child(
        name,
        [
            "worker",
            "--config",
            str(cluster.root / "up-node.yaml"),
            "--engine",
            "vllm",
            "--vllm-url",
            vllm_url,
            "--vllm-wait",
            "600",
            "--role",
            role,
            "--id",
            name,
        ],
        env_for("worker", cluster.config, cluster.env),
        cluster.logs,
    )
    try:
        child.wait_announce(120, stop)
    except BaseException:
        child.stop()
        raise
    return child


class VllmServer:
    """One vLLM server process (a ``Child`` of ``tiercake up``: it dies with its parent and can be
    supervised); its output goes to ``log_path``."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.child = Child(log_path.stem, [], {"VLLM_CPU_KVCACHE_SPACE": "1", **env}, log_path.parent, argv=command)

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.proc

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(
        self,
        timeout: float = 300,
        stop: threading.Event | None = None,
        progress: Callable[[str], None] | None = None,
        every_s: float = 10.0,
    ) -> None:
        """Until its /health answers; ``StartError`` (with its log's last error) if it exits first,
        ``Interrupted`` once ``stop`` is set. ``progress`` hears a line every ``every_s`` meanwhile
        (vLLM takes minutes to start on a CPU: a silent terminal looks hung)."""
        started = time.monotonic()
        deadline, said = started + timeout, started
        while time.monotonic() < deadline:
            if progress is not None and time.monotonic() - said >= every_s:
                said = time.monotonic()
                progress(f"  waiting for vLLM at {self.url} ({said - started:.0f} s; its log: {self.log_path})")
            if stop is not None and stop.is_set():
                raise Interrupted()
            if self.proc.poll() is not None:
                raise StartError(
                    f"vLLM exited with {self.proc.returncode}: {last_error(self.log_tail())} (its log: {self.log_path})"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            (stop or threading.Event()).wait(0.5)
        raise StartError(f"vLLM did not answer /health within {timeout} s (its log: {self.log_path})")

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        self.child.stop(timeout)


def up_vllm(
    config: TiercakeConfig,
    data_dir: Path,
    model: Path,
    roles: list[str],
    port: int,
    host: str = "127.0.0.1",
    print_fn=print,
    ready_file: Path | None = None,
    vllm_args: tuple[str, ...] | list[str] = (),
) -> int:
    """``tiercake up --engine vllm``: a conductor serving the front (tiercake's OpenAI API, routing by
    what each instance and the tiers hold) on ``host:port``, a node agent, and one vLLM server per
    entry of ``roles`` with the TiercakeConnector on loopback ports of their own, each with a tiercake
    worker beside it (``--engine vllm``) in that role that the front routes to: ``worker`` (prefill and
    decode), or ``prefill`` and ``decode`` (disaggregated: a prefill instance computes the prompt and
    saves its blocks, the decode instance loads them through tiercake and generates). Every process is
    supervised, as under ``up``: one that exits is restarted (a restarted vLLM server loads what its
    predecessor saved back from the pool). ``vllm_args``: more flags for every vLLM server."""
    from tiercake.conductor.etcd_process import free_port
    from tiercake.workers.vllm.process import serve_command

    _check_vllm_setup(config, model, roles)
    stop = on_stop_signals()
    lock = DataDirLock(data_dir).acquire()
    shm = ShmLeftovers()
    env = dict(os.environ)
    token_at = credentials(config, data_dir, env)
    cfg = _under_vllm(config, model, host)
    cluster = None
    servers: list[VllmServer] = []
    workers: list[Child] = []
    try:
        cluster = NodeCluster(cfg, data_dir, env, port=free_port(), serving_port=port, stop=stop)
        for i in range(len(roles)):
            vllm_port = free_port()
            command = serve_command(
                model,
                model.name,
                vllm_port,
                cluster.url,
                cfg.node_id,
                kv_events=(free_port(), free_port()),
                extra=list(vllm_args),
            )
            servers.append(
                VllmServer(command, env_for("worker", cfg, env), data_dir / "logs" / f"vllm-{i}.log", vllm_port)
            )
        print_fn(
            f"starting {len(servers)} vLLM server(s) beside the conductor and node agent (a minute or more on "
            f"a CPU; logs in {data_dir / 'logs'})"
        )
        for server in servers:
            server.wait_ready(stop=stop, progress=print_fn)
        workers = [
            vllm_worker(cluster, server.url, role, f"vllm-{role}-{i}", stop)
            for i, (server, role) in enumerate(zip(servers, roles))
        ]
        urls = [server.url for server in servers]
        _print_up_vllm(print_fn, cfg, cluster, urls, roles, token_at, data_dir)
        if ready_file is not None:
            ready_file.write_text(
                json.dumps({"url": cluster.front_url, "vllm": urls, "roles": roles, "conductor": cluster.url})
            )
        lock.record(pid=os.getpid(), url=cluster.front_url)
        children = [cluster.conductor, cluster.node, *(server.child for server in servers), *workers]
        return 0 if Supervisor(children, print_fn, on_restart=lambda _: shm.clean(pool_names(cfg))).watch(stop) else 1
    except Interrupted:
        return 130
    finally:
        # every process at once, so a Ctrl-C costs one grace period, not one per kind of process (staged,
        # a worker's last calls to a node agent or conductor already going away waited out the grace)
        stop_all(
            workers
            + [server.child for server in servers]
            + ([cluster.node, cluster.conductor] if cluster is not None else [])
        )
        give_back(cfg, shm)
        lock.release()
        print_fn("tiercake is down")


def _check_vllm_setup(config: TiercakeConfig, model: Path, roles: list[str]) -> None:
    if not (model / "config.json").exists():
        raise ValueError(f"{model} is not a Hugging Face model directory (no config.json)")
    if not roles or not set(roles) <= {"worker", "prefill", "decode"} or (("prefill" in roles) != ("decode" in roles)):
        raise ValueError(f"vLLM roles must be workers, or prefill and decode instances together; got {roles}")
    if "prefill" in roles and not config.serving.disaggregated:
        raise ValueError("prefill and decode instances need serving.disaggregated: true")


def _under_vllm(config: TiercakeConfig, model: Path, host: str) -> TiercakeConfig:
    """The cluster's config beside vLLM servers."""
    cfg = storage_only(config)  # vLLM keeps its own KV on the device; the pool holds its blocks
    cfg.model_id = model.name  # the name vLLM serves it under
    cfg.serving.host = host
    cfg.serving.tokenizer = cfg.serving.tokenizer or str(model)  # the front tokenizes as vLLM does
    return cfg


def _print_up_vllm(print_fn, cfg: TiercakeConfig, cluster, urls: list[str], roles, token_at, data_dir: Path) -> None:
    kinds = ", ".join(f"{roles.count(r)} {r}" for r in ("worker", "prefill", "decode") if r in roles)
    print_fn(
        f"tiercake is up under vLLM: {cluster.front_url}  (the front over {len(roles)} vLLM servers ({kinds}) "
        f"with the TiercakeConnector: {', '.join(urls)}; conductor {cluster.url}, node agent {cfg.node_id}; "
        f"logs in {data_dir / 'logs'})"
    )
    if token_at:
        print_fn(f"  control token: {token_at}")
    if not cfg.serving.all_api_keys():
        print_fn(f"  note: {SHARED_CACHE_NOTE}")
    print_fn(
        f"  curl -s {cluster.front_url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{cfg.model_id}", "prompt": "...", "max_tokens": 16}}\''
    )
    print_fn("Ctrl-C stops everything.")
