"""The ``upgrade`` fault of ``tiercake chaos``: a node agent of the previous release (``--previous
DIR``, see ``tiercake.previous``) joins the running cluster beside the current one; blocks are written
to it and read back over the previous protocol, then flushed to its SSD; then it is upgraded in place,
as a rolling update does it: stopped, and this release started on its config (its SSD directory, its
pool path). It is back once it is a member speaking this release's protocol. The blocks it lists
then (its SSD, written by the previous release and recovered by this one) are read back at the end
with every other placement, and the key-value workload goes on through the slots the upgraded node
takes over.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tiercake.conductor.client import Client
from tiercake.previous import previous_python
from tiercake.tiers.pool import remove_pool
from tiercake.transfer import TransferEngine
from tiercake.transfer import protocol as p

NAME = "chaos-upgraded-node"
BLOCKS = 32
BLOCK_BYTES = 64 << 10
START_TIMEOUT_S = 120.0


class UpgradedNode:
    def __init__(
        self,
        root: Path,
        control_url: str,
        token: str,
        secret: str,
        previous: Path,
        progress: Callable[[str], None] = print,
    ) -> None:
        self.root, self.control_url, self.token, self.secret = root, control_url, token, secret
        self.previous, self.progress = previous, progress
        self.pool = Path(f"/dev/shm/tiercake-chaos-upgraded-{os.getpid()}")
        self.proc: subprocess.Popen | None = None
        self.read_back = 0  # blocks written to the previous release's node and read back equal

    def config(self) -> Path:
        path = self.root / "upgraded-node.yaml"
        path.write_text(
            f"node_id: {NAME}\n"
            "store:\n  layout: null\n  tiers:\n"
            f"    - {{kind: pool, capacity: 4MiB, path: {self.pool}}}\n"
            f"    - {{kind: ssd, capacity: 64MiB, path: {self.root / 'upgraded-ssd'}}}\n"
            f"conductor: {{urls: ['{self.control_url}'], member_ttl: 2}}\n"
            "transfer: {host: 127.0.0.1}\n"
        )
        return path

    async def inject(self) -> Callable:
        """The fault: the previous release joins, serves, and is upgraded; returns the check that it is back."""
        self.proc = await asyncio.to_thread(self._start, previous_python(self.previous))
        member = await self._member(lambda m: m.transfer_version < p.VERSION)
        self.progress(f"  the previous release's node agent joined (protocol {member.transfer_version})")
        self.read_back = await self._write_and_read(member)
        async with Client([self.control_url], token=self.token, timeout=10) as control:
            await control.flush(["pool"], wait=True, timeout_s=30)  # onto its SSD, which the upgrade keeps
        await asyncio.to_thread(self._stop)
        self.proc = await asyncio.to_thread(self._start, [sys.executable, "-m", "tiercake.cli"])

        async def upgraded() -> bool:
            try:
                await self._member(lambda m: m.transfer_version == p.VERSION, timeout=0.5)
            except TimeoutError:
                return False
            return True

        return upgraded

    def _start(self, runner: list[str]) -> subprocess.Popen:
        env = {**os.environ, "TIERCAKE_SECRET": self.secret, "TIERCAKE_TOKEN": self.token}
        env.setdefault("TIERCAKE_NODE_SECRET", secrets.token_hex(24))  # a node agent of a cluster needs one
        with open(self.root / "upgraded-node.log", "ab") as log:
            proc = subprocess.Popen(
                [*runner, "node", "--config", str(self.config())],
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        assert proc.stdout is not None  # piped above
        line = proc.stdout.readline()  # the node's address, once it serves
        if not line:
            proc.wait(10)
            raise RuntimeError(f"the node agent exited with {proc.returncode}: see {self.root / 'upgraded-node.log'}")
        json.loads(line)
        return proc

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    async def _member(self, which: Callable, timeout: float = START_TIMEOUT_S):
        async with Client([self.control_url], token=self.token, timeout=10) as control, asyncio.timeout(timeout):
            while True:
                member = next((m for m in await control.members() if m.node_id == NAME), None)
                if member is not None and which(member):
                    return member
                await asyncio.sleep(0.2)

    async def _write_and_read(self, member) -> int:
        """Blocks written to the node and read back with this release's engine: how many came back equal."""
        engine = TransferEngine("chaos-upgrade", self.secret.encode(), transports=("tcp",))
        try:
            engine.add_peer(NAME, member.host, member.port)
            keys = [f"chaos-upgrade-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
            blocks = [
                torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                for i in range(BLOCKS)
            ]
            await engine.write_blocks(NAME, keys, blocks, tenant="chaos-upgrade")
            dsts = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in keys]
            read = await engine.read_blocks(NAME, keys, dsts)
            return sum(r.ok and torch.equal(d, b) for r, d, b in zip(read, dsts, blocks))
        finally:
            await engine.close()

    def close(self) -> None:
        self._stop()
        remove_pool(self.pool)
