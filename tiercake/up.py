"""``tiercake up``: a whole local cluster from one command.

It starts a conductor (embedded backend unless etcd endpoints are given) serving the control API and
the OpenAI-compatible API on ``--port``, one node agent (pool and SSD tiers), and the workers (one
prefill and one decode by default), each a process of its own. It prints where it listens and how
to send a request, and stops everything, in reverse order, on Ctrl-C or SIGTERM. Each process's
log is in ``<data dir>/logs/``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from tiercake.conductor.front.tenants import SHARED_CACHE_NOTE
from tiercake.tiers.pool_files import DIRECTORY_SUFFIX, OBJECT_MAP_SUFFIX, remove_pool

from .config import TiercakeConfig
from .up_state import DataDirLock, ShmLeftovers, write_private


class StartError(RuntimeError):
    """A process of the cluster did not start; the message says why (the tail of its log)."""


def last_error(log_text: str) -> str:
    """The line of a child's output that says why it stopped: its last ``error:`` line (what the CLI
    prints for a refused start), else its last line (a traceback's exception)."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.lower().startswith("error:")), None)
    return (said or (lines[-1] if lines else "it printed nothing")).removeprefix("error: ")


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) while the cluster was starting."""


STOP_GRACE_S = 3.0  # how long a child may take to stop after SIGTERM, before SIGKILL (Ctrl-C: all down in 5 s)


def on_stop_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set from now on (start-up waits watch it too)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _die_with_parent(parent: int):
    """For ``preexec_fn``: the child gets SIGTERM when the process that started it dies (Linux's
    parent-death signal), so a killed ``tiercake up`` leaves nothing serving behind."""

    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return  # not Linux: children outlive a killed parent, as before
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


SPARE_ENV = "TIERCAKE_SPARE"  # set in a warm spare's environment (cli.main waits for its go)


class Child:
    """One process of the cluster (``tiercake <args>``, whose first stdout line announces where it
    listens; or, given ``argv``, any command, all of whose output goes to the log), its log in
    ``logs/<name>.log`` (appended to across restarts), dying with the process that started it.
    ``prefix``: what runs the command (``ip netns exec NS``: inside a network namespace)."""

    SPARE_AFTER_S = 5.0  # a spare is made this long after a start, not beside it: both would import at once

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict,
        logs: Path,
        argv: list[str] | None = None,
        prefix: Sequence[str] = (),
        spare: bool = False,
    ) -> None:
        self.name, self.args, self.env, self.argv, self.prefix = name, args, env, argv, list(prefix)
        self.spare: subprocess.Popen | None = None
        self.wants_spare, self._spare_made = spare, 0.0
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{name}.log"
        self.log_path.write_bytes(b"")
        self.restarts = 0
        self.started_at = 0.0
        self.announce: dict = {}
        self.start()

    def start(self) -> None:
        self.proc = self._spawn(spare=False)
        self.started_at = time.monotonic()

    def _spawn(self, spare: bool) -> subprocess.Popen:
        command = self.prefix + (self.argv or [sys.executable, "-m", "tiercake.cli", *self.args])
        with open(self.log_path, "ab") as log:  # the child holds its own descriptor
            return subprocess.Popen(
                command,
                stdin=subprocess.PIPE if spare else None,
                stdout=log if self.argv else subprocess.PIPE,
                stderr=log,
                env={**self.env, SPARE_ENV: "1"} if spare else self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()),
            )

    def keep_spare(self) -> None:
        """Make a warm spare (a process that has imported what this one runs and waits to be told to
        go) once this one has run ``SPARE_AFTER_S``; a restart then swaps it in. A spare that died is
        made again no sooner than ``SPARE_AFTER_S`` after the last (one that cannot start costs a
        start every few seconds, not a busy loop)."""
        settled = time.monotonic() - max(self.started_at, self._spare_made) > self.SPARE_AFTER_S
        if self.wants_spare and settled and (self.spare is None or self.spare.poll() is not None):
            self.spare, self._spare_made = self._spawn(spare=True), time.monotonic()

    def _swap_in_spare(self) -> bool:
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:  # (a spare has a stdin pipe)
            return False
        try:
            spare.stdin.write(b"go\n")
            spare.stdin.close()
        except OSError:
            _kill(spare)
            return False
        self.proc, self.started_at = spare, time.monotonic()
        return True

    def drop_spare(self) -> None:
        if self.spare is not None:
            _kill(self.spare)
            self.spare = None

    def restart(self) -> None:
        """Start it again (after it exited); its announcement is read in the background."""
        self.restarts += 1
        with contextlib.suppress(ProcessLookupError):  # what it started and left behind (vLLM's engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with open(self.log_path, "ab") as log:
            log.write(f"--- restarted by tiercake up (restart {self.restarts}) ---\n".encode())
        if not self._swap_in_spare():
            self.start()
        if self.proc.stdout is not None:
            threading.Thread(target=self.proc.stdout.readline, daemon=True).start()

    def wait_announce(self, timeout: float, stop: threading.Event | None = None) -> dict:
        """The child's first stdout line (JSON: where it listens); ``Interrupted`` once ``stop`` is set."""
        result: list[bytes] = []
        stdout = self.proc.stdout
        assert stdout is not None  # spawned with a pipe
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while reader.is_alive() and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                self.stop()
                raise Interrupted()
            reader.join(min(0.1, max(0.0, deadline - time.monotonic())))
        try:
            if not result or not result[0]:
                raise ValueError("no announcement")
            self.announce = json.loads(result[0])
        except ValueError:
            self.stop()
            said = result[0].decode(errors="replace").strip() if result and result[0] else ""
            log_text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            raise StartError(
                f"the {self.name} did not start: {last_error(said + chr(10) + log_text)} (its log: {self.log_path})"
            ) from None
        return self.announce

    def terminate(self) -> None:
        """SIGTERM to its process group: a child's own children (vLLM's engine core) stop with it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        stop_all([self], timeout)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def stop_all(children: list[Child], timeout: float = STOP_GRACE_S) -> None:
    """SIGTERM to all at once, then SIGKILL to whoever is still running after ``timeout`` (a spare,
    which holds nothing yet, at once)."""
    for child in children:
        child.drop_spare()
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        if child.proc.stdout is not None:
            child.proc.stdout.close()


class Supervisor:
    """Keeps the children running: one that exits is restarted at once the first time, then after a
    backoff (0.5 s, doubling to 10 s; reset once it has run a minute); one that exits ``MAX_RESTARTS`` times within ``WINDOW_S``
    is given up on, and ``watch`` returns False. Members re-register and re-report by themselves."""

    MAX_RESTARTS = 5
    WINDOW_S = 60.0

    def __init__(self, children: list[Child], print_fn, on_restart=None) -> None:
        """``on_restart(child)``: after a child was started again (what the dead one left is cleaned)."""
        self.children, self.print_fn, self.on_restart = children, print_fn, on_restart
        self._due: dict[str, float] = {}  # name -> when to restart it
        self._exits: dict[str, list[float]] = {}

    def watch(self, stop: threading.Event) -> bool:
        while not stop.is_set():
            now = time.monotonic()
            for child in self.children:
                if child.proc.poll() is None or stop.is_set():
                    child.keep_spare()
                    continue
                due = self._due.get(child.name)
                if due is None:
                    exits = [t for t in self._exits.get(child.name, []) if now - t < self.WINDOW_S] + [now]
                    self._exits[child.name] = exits
                    if len(exits) > self.MAX_RESTARTS:
                        self.print_fn(
                            f"{child.name} exited {len(exits)} times in {self.WINDOW_S:.0f} s (see "
                            f"{child.log_path}); giving up"
                        )
                        return False
                    ran = now - child.started_at
                    # the first exit in a window (a rolling restart's SIGTERM, a one-off crash) is
                    # restarted at once: its spare, if it has one, is already waiting
                    first = ran > self.WINDOW_S or len(exits) == 1
                    backoff = 0.0 if first else min(0.5 * 2 ** (len(exits) - 2), 10.0)
                    self._due[child.name] = now + backoff
                    self.print_fn(
                        f"{child.name} exited with {child.proc.returncode} (see {child.log_path}); "
                        f"restarting in {backoff:.1f} s"
                    )
                elif now >= due:
                    del self._due[child.name]
                    child.restart()
                    if self.on_restart is not None:
                        self.on_restart(child)
            stop.wait(0.2)
        return True


def credentials(config: TiercakeConfig, data_dir: Path, env: dict[str, str]) -> str | None:
    """The environment of the cluster's processes: the transfer secret and the seal secret (each made
    up when none is configured: only this cluster's processes need them; a made-up transfer secret is
    written to ``<data dir>/cluster-secret`` for the key-value store's clients) and the control token
    (made up when none is configured and the config does not say insecure, and written to
    ``<data dir>/control-token``); both files readable by their owner only. Returns where the token
    is, for the printout."""
    from .config import ENV_PREFIX

    for name in [n for n in env if n.startswith(ENV_PREFIX)]:
        del env[name]  # already in the config written for the children: they must not apply them over it
    data_dir.mkdir(parents=True, exist_ok=True)
    if not env.get(config.transfer.secret_env) and not config.transfer.secret_file:
        env[config.transfer.secret_env] = secrets.token_hex(24)
        write_private(data_dir / "cluster-secret", env[config.transfer.secret_env])
    if not env.get(config.transfer.seal_secret_env) and not config.transfer.seal_secret_file:
        env[config.transfer.seal_secret_env] = secrets.token_hex(24)
    if not env.get(config.transfer.node_secret_env) and not config.transfer.node_secret_file:
        env[config.transfer.node_secret_env] = secrets.token_hex(24)  # the node agents' own: never written out
    conductor = config.conductor
    if conductor.insecure:
        return None
    if env.get(conductor.token_env):
        return f"${conductor.token_env}"
    if conductor.token_file:
        return conductor.token_file
    token = secrets.token_urlsafe(24)
    path = data_dir / "control-token"
    write_private(path, token)
    env[conductor.token_env] = token
    return str(path)


def env_for(role: str, config: TiercakeConfig, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process of ``role`` with only the secrets its job needs, so that one taken over
    gives away no more: the seal secret only to what writes and reads KV (workers, vLLM), the node
    secret only to node agents (the replication plane), neither to the conductor."""
    drop = {
        "node": {config.transfer.seal_secret_env},
        "conductor": {config.transfer.seal_secret_env, config.transfer.node_secret_env},
        "worker": {config.transfer.node_secret_env},
    }[role]
    return {k: v for k, v in env.items() if k not in drop}


class NodeCluster:
    """A conductor and one node agent as processes, without workers: the tiers under engines that run
    beside them (vLLM instances with the TiercakeConnector). ``env`` must carry the cluster secret and
    the control token (or the config says insecure)."""

    def __init__(
        self,
        config: TiercakeConfig,
        root: Path,
        env: dict[str, str],
        port: int = 0,
        serving_port: int | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """``port``: the control API's; ``serving_port``: the front's (None: no front, the engines serve
        the OpenAI API themselves); ``stop``: set, it ends the waits for the processes to start."""
        self.root, self.env, self.logs, self.stop_event = root, dict(env), root / "logs", stop
        if not self.env.get(config.transfer.node_secret_env) and not config.transfer.node_secret_file:
            self.env[config.transfer.node_secret_env] = secrets.token_hex(24)  # its node agent's own
        root.mkdir(parents=True, exist_ok=True)
        cfg = supervised(config)
        cfg.conductor.port = port
        cfg.serving.port = serving_port
        (root / "up-conductor.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.conductor = Child(
            "conductor",
            ["conductor", "--config", str(root / "up-conductor.yaml"), "--id", "conductor-0"],
            env_for("conductor", config, env),
            self.logs,
        )
        try:
            announced = self.conductor.wait_announce(60, stop)
            self.url = announced["url"]
            self.front_url = announced.get("api_url") if serving_port is not None else None
            cfg.conductor.urls = [self.url]
            self.config = cfg
            (root / "up-node.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            self.node = self.start_node()
        except BaseException:
            self.conductor.stop()
            raise

    def start_node(self) -> Child:
        node = Child(
            "node",
            ["node", "--config", str(self.root / "up-node.yaml")],
            env_for("node", self.config, self.env),
            self.logs,
        )
        node.wait_announce(120, self.stop_event)
        return node

    def restart_node(self) -> None:
        self.node.stop()
        self.node = self.start_node()

    def close(self) -> None:
        """Stop both, and retire the node's pool files (kept through its restarts)."""
        self.node.stop()
        self.conductor.stop()
        for path in _shm_pools(self.config):
            remove_pool(path)


def up(
    config: TiercakeConfig,
    data_dir: Path,
    host: str,
    port: int,
    prefill: int,
    decode: int,
    workers: int,
    etcd: list[str],
    print_fn=print,
    ready_file: Path | None = None,
    control_port: int | None = None,
    node_netns: tuple[str, str] | None = None,
    engine: bool = True,
) -> int:
    """The OpenAI-compatible API on ``host:port``, the control API on ``control_port`` (default
    ``port + 1``) behind a token; each process supervised (restarted when it exits). ``node_netns``
    (namespace, address): the node agent runs inside that network namespace, its transfer port at
    that address (fault injection: ``tiercake chaos`` cuts its link; ``host`` must be reachable from
    there). ``engine`` False: the storage side alone (conductor and node agent, no workers) for
    engines started by hand (``storage_only``)."""
    if engine and prefill + decode + workers and importlib.util.find_spec("torch") is None:
        raise StartError(
            "tiercake up's workers run the reference engine, which needs torch (pip install 'tiercake[reference]', "
            "the CPU build of torch first); tiercake up --no-engine starts the storage side alone"
        )
    stop = on_stop_signals()
    lock = DataDirLock(data_dir).acquire()
    shm = ShmLeftovers()
    env = dict(os.environ)
    token_at = credentials(config, data_dir, env)
    logs = data_dir / "logs"
    children: list[Child] = []
    cfg = supervised(config if engine else storage_only(config))
    try:
        cfg.conductor.host, cfg.conductor.port = host, port + 1 if control_port is None else control_port
        cfg.serving.host, cfg.serving.port = host, port
        if etcd:
            cfg.conductor.etcd = etcd
        control, url = _start_conductor(cfg, data_dir, env, children, stop)
        cfg.conductor.urls = [control]
        node_cfg = data_dir / "up-node.yaml"
        node_cfg.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        node = _node_child(cfg, data_dir, env, logs, node_netns)
        children.append(node)
        node.wait_announce(120, stop)
        for role, count in (("prefill", prefill), ("decode", decode), ("worker", workers)):
            children += [_worker_child(cfg, node_cfg, f"{role}-{i}", role, data_dir, env) for i in range(count)]
        for child in children[2:]:
            child.wait_announce(300, stop)  # a worker calibrates its timings first (persisted for next time)
        if not engine:
            _print_storage(print_fn, cfg, control, token_at, env, data_dir)
        else:
            _print_up(
                print_fn,
                cfg.model_id,
                url,
                control,
                token_at,
                len(children) - 2,
                logs,
                data_dir,
                bool(cfg.serving.all_api_keys()),
            )
        if ready_file is not None:
            ready_file.write_text(json.dumps({"url": url, "control_url": control, "token": token_at}))
        lock.record(pid=os.getpid(), url=url)
        return 0 if Supervisor(children, print_fn, on_restart=lambda _: shm.clean(pool_names(cfg))).watch(stop) else 1
    except Interrupted:
        return 130
    finally:
        stop_all([c for c in children if c.name != "conductor"])  # members leave while the conductor answers
        stop_all([c for c in children if c.name == "conductor"])
        give_back(cfg, shm)
        lock.release()
        print_fn("tiercake is down")


def _start_conductor(
    cfg: TiercakeConfig, data_dir: Path, env: dict, children: list[Child], stop: threading.Event
) -> tuple[str, str]:
    """The conductor with the front, from the config written for it (one of ``children`` from now on,
    so that a failed start stops it too); where its control API and its OpenAI API answer."""
    path = data_dir / "up-conductor.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    argv = ["conductor", "--config", str(path), "--id", "conductor-0"]
    conductor = Child("conductor", argv, env_for("conductor", cfg, env), data_dir / "logs")
    children.append(conductor)
    announced = conductor.wait_announce(60, stop)
    return announced["url"], announced.get("api_url", announced["url"])


def _node_child(
    cfg: TiercakeConfig, data_dir: Path, env: dict, logs: Path, node_netns: tuple[str, str] | None
) -> Child:
    """The node agent, with a warm spare; inside ``node_netns`` (namespace, its transfer address) if given."""
    agent_cfg, prefix = data_dir / "up-node.yaml", []
    if node_netns is not None:
        namespace, address = node_netns
        inside = cfg.model_copy(deep=True)
        inside.transfer.host = address
        agent_cfg = data_dir / "up-node-netns.yaml"
        agent_cfg.write_text(yaml.safe_dump(inside.model_dump(mode="json")))
        prefix = ["ip", "netns", "exec", namespace]
    argv = ["node", "--config", str(agent_cfg)]
    return Child("node", argv, env_for("node", cfg, env), logs, prefix=prefix, spare=True)


def _worker_child(cfg: TiercakeConfig, node_cfg: Path, name: str, role: str, data_dir: Path, env: dict) -> Child:
    argv = ["worker", "--config", str(node_cfg), "--role", role, "--id", f"{cfg.node_id}-{name}"]
    return Child(name, [*argv, "--data-dir", str(data_dir)], env_for("worker", cfg, env), data_dir / "logs")


def supervised(config: TiercakeConfig) -> TiercakeConfig:
    """A copy of ``config`` for a node agent that a supervisor restarts: its pool file stays through
    a clean stop too (a restarted agent adopts what it held), and the supervisor removes it at the end."""
    cfg = config.model_copy(deep=True)
    for tier in cfg.store.tiers:
        if tier.kind == "pool":
            tier.keep_on_stop = True
    return cfg


def storage_only(config: TiercakeConfig) -> TiercakeConfig:
    """The config of a cluster whose engines keep their own KV on their devices (vLLM): the pool holds
    blocks of any size (``layout: null``), and there is no gpu tier."""
    cfg = config.model_copy(deep=True)
    cfg.store.layout = None
    cfg.store.tiers = [t for t in cfg.store.tiers if t.kind != "gpu"]
    return cfg


CONNECTOR_ENV = "connector.env"  # what a vLLM server started by hand sources: the cluster's secrets
CONNECTOR_CONFIG = "kv-transfer-config.json"  # and the --kv-transfer-config that points it here


def _print_storage(
    print_fn, cfg: TiercakeConfig, control: str, token_at: str | None, env: dict[str, str], data_dir: Path
) -> None:
    """``up --no-engine``'s banner, and the two files an engine started by hand needs: the secrets, as
    an environment file (mode 0600), and vLLM's ``--kv-transfer-config`` for this conductor and node."""
    from tiercake.workers.vllm.process import kv_transfer_config

    names = (cfg.transfer.secret_env, cfg.transfer.seal_secret_env, cfg.conductor.token_env)
    write_private(data_dir / CONNECTOR_ENV, "\n".join(f"{n}={env[n]}" for n in names if env.get(n)))
    (data_dir / CONNECTOR_CONFIG).write_text(json.dumps(kv_transfer_config(control, cfg.node_id)) + "\n")
    print_fn(f"tiercake is up (no engine): conductor {control}, node agent {cfg.node_id}; logs in {data_dir / 'logs'}")
    print_fn(f"control API: {control}  " + (f"(bearer token: {token_at})" if token_at else "(INSECURE: no token)"))
    print_fn(
        f"a vLLM server with the TiercakeConnector: its secrets in {data_dir / CONNECTOR_ENV} (set -a; . that file), "
        f"its --kv-transfer-config in {data_dir / CONNECTOR_CONFIG}"
    )
    print_fn("Ctrl-C stops everything.")


def _shm_pools(cfg: TiercakeConfig) -> list[Path]:
    """The node's pool files that lie in /dev/shm (a file or DAX device elsewhere is the operator's)."""
    return [t.region_path for t in cfg.store.tiers if t.kind == "pool" and t.region_path.parent == Path("/dev/shm")]


def pool_names(cfg: TiercakeConfig) -> set[str]:
    """The names in /dev/shm of the node's pool and what lies beside it (kept while up runs)."""
    return {f"{path.name}{suffix}" for path in _shm_pools(cfg) for suffix in ("", DIRECTORY_SUFFIX, OBJECT_MAP_SUFFIX)}


def give_back(cfg: TiercakeConfig, shm: ShmLeftovers) -> None:
    """A stopped cluster gives its memory back: the node's pool file under /dev/shm (what it held at
    the memory level goes with it; what was persisted stays on SSD), and what its children left."""
    for path in _shm_pools(cfg):
        remove_pool(path)
    shm.clean()


def _print_up(
    print_fn,
    model: str,
    url: str,
    control: str,
    token_at: str | None,
    workers: int,
    logs: Path,
    data_dir: Path,
    shared_keys: bool,
) -> None:
    print_fn(f"tiercake is up: {url}  (conductor, node agent, {workers} workers; logs in {logs})")
    if token_at:
        print_fn(f"control API: {control}  (bearer token: {token_at})")
    else:
        print_fn(f"control API: {control}  (INSECURE: no token, as configured)")
    if (data_dir / "cluster-secret").exists():
        print_fn(f"key-value store clients: the conductor {control}, the secret in {data_dir / 'cluster-secret'}")
    if not shared_keys:
        print_fn(f"note: {SHARED_CACHE_NOTE}")
    print_fn("send a request:")
    print_fn(
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "prompt": "Hello, tiers! Which of you holds my cached prefix?", "max_tokens": 16, '
        f'"temperature": 0}}\''
    )
    print_fn(
        f"  tiercake ask 'Hello, tiers! Which of you holds my cached prefix?' --url {url}     (twice: the second reuses the cached prefix)"
    )
    print_fn("Ctrl-C stops everything.")


class UpProcess:
    """``tiercake up`` as a child process (benchmarks and tests drive a real cluster through it): the
    OpenAI-compatible API at ``url``, the control API at ``control_url`` with ``token`` (one made up
    here; None: ``up`` makes its own, read from the data directory once it is ready)."""

    def __init__(
        self,
        config_path: Path,
        data_dir: Path,
        port: int,
        args: Sequence[str] = (),
        token: str | None = "",
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """``host``: where its APIs are reached (pass ``--host`` in ``args`` to match)."""
        from tiercake.conductor.etcd_process import free_port
        from tiercake.config import load_config

        tls = load_config(config_path).tls
        self.ssl = tls.client_context()  # what to verify the cluster's https with (None: the system's CAs)
        control_port = free_port()
        self.url = f"{tls.scheme}://{host}:{port}"
        self.control_url = f"{tls.scheme}://{host}:{control_port}"
        self.data_dir = data_dir
        env = dict(os.environ if env is None else env)
        env.pop("TIERCAKE_TOKEN", None)
        self.token = secrets.token_urlsafe(16) if token == "" else token
        if self.token:
            env["TIERCAKE_TOKEN"] = self.token
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercake.cli",
                "up",
                "--config",
                str(config_path),
                "--data-dir",
                str(data_dir),
                "--port",
                str(port),
                "--control-port",
                str(control_port),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            preexec_fn=_die_with_parent(os.getpid()),  # a test or bench that dies takes its cluster along
        )

    def members(self) -> list[dict]:

        if self.token is None and (self.data_dir / "control-token").exists():
            self.token = (self.data_dir / "control-token").read_text().strip()
        request = urllib.request.Request(
            self.control_url + "/v1/members", headers={"Authorization": f"Bearer {self.token}"} if self.token else {}
        )
        with urllib.request.urlopen(request, timeout=2, context=self.ssl) as resp:
            return json.loads(resp.read())["members"]

    def wait_ready(self, workers: int, timeout: float = 180.0) -> None:
        """Until a node agent and ``workers`` workers are members."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tiercake up exited:\n" + self._output()[-3000:])
            try:
                members = self.members()
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
        return self._output()

    def _output(self) -> str:
        """What the process printed (stdout and stderr), to its end: call once it has exited."""
        stdout = self.proc.stdout
        assert stdout is not None  # spawned with a pipe
        return stdout.read().decode()
