"""What several test modules need of a node agent started as a process: its config, its keys, a wait."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from paths import shm_file


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


async def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def ssd_node_config(tmp_path, name: str, conductor: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"node_id: {name}\n"
        "store:\n  layout: null\n  tiers:\n"
        f"    - {{kind: ssd, capacity: 64MiB, path: {tmp_path / name / 'ssd'}}}\n"
        f"conductor: {{urls: ['{conductor}'], member_ttl: 1}}\n"
        "transfer: {host: 0.0.0.0}\n"
    )
    return str(path)


def pool_path(name: str) -> Path:
    return shm_file(f"proc-test-{name}-{os.getpid()}")


def pool_node_config(tmp_path, name: str, pool: str = "256MiB", transports: str = "") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"node_id: {name}\n"
        "store:\n  layout: null\n  tiers:\n"
        f"    - {{kind: pool, capacity: {pool}, path: {pool_path(name)}}}\n"
        + (f"transfer: {{transports: [{transports}]}}\n" if transports else "")
    )
    return str(path)
