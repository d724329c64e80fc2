"""A cluster under ``tiercake up`` for tests: its own pool file, SSD folder and ports."""

import asyncio
import os
import socket
from pathlib import Path

import aiohttp
from paths import shm_file

from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.tiers.pool import remove_pool
from tiercake.up import UpProcess


class UpCluster(UpProcess):
    def __init__(self, tmp, serving: str = "", args: list[str] = (), token: str | None = "", extra: str = ""):
        port = free_port()
        self.pool = shm_file(f"serving-{os.getpid()}-{port}")
        config = tmp / "cluster.yaml"
        config.write_text(
            "node_id: test-node\n"
            "store:\n  tiers:\n"
            f"    - {{kind: pool, capacity: 8MiB, path: {self.pool}}}\n"
            f"    - {{kind: ssd, capacity: 64MiB, path: {tmp / 'ssd'}}}\n"
            "conductor: {member_ttl: 2}\n"
            f"serving: {{gpu_blocks: 128, max_context: 1024{serving}}}\n" + extra
        )
        super().__init__(config, tmp / "data", port, list(args), token=token)

    def stop(self) -> str:
        try:
            return super().stop()
        finally:
            remove_pool(self.pool)  # the node keeps its pool for a restart; a test's goes

    async def wait_up(self, workers: int) -> None:
        await asyncio.to_thread(self.wait_ready, workers)

    def ops(self) -> Client:
        """A client of the control API (the operator's token)."""
        return Client([self.control_url], token=self.token, timeout=60, ssl=self.ssl)

    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    async def member_pid(self, role: str) -> tuple[dict, int]:
        async with aiohttp.ClientSession() as http:
            async with http.get(self.control_url + "/v1/members", headers=self.auth()) as resp:
                members = [m for m in (await resp.json())["members"] if m["role"] == role]
            member = members[0]
            async with http.get(member["url"] + "/health") as resp:
                return member, (await resp.json())["pid"]


def left_in_shm(before: set[str], ours: str | None = None) -> set[str]:
    """What appeared in /dev/shm since ``before`` that a cluster on the default config left: its pool
    (named after the host, ``config.default_config``; or starting with ``ours``) and anything not
    tiercake's (vLLM's, torch's) that no live process has open or mapped. Other tiercake pools, and
    the shared memory of processes that still run, belong to other tests' clusters and servers,
    running beside this one under xdist."""
    from tiercake.up_state import inodes_in_use

    ours = ours or f"tiercake-{socket.gethostname()}-"
    new = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(ours) or not n.startswith("tiercake-")}
    used = inodes_in_use(Path("/dev/shm")) if new else set()
    return {n for n in new if _inode(Path("/dev/shm") / n) not in used}


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None
