"""How a chaos run breaks the cluster: each fault, and what it needs of the machine (a file system
of its own for the SSD tier, the pid behind a port)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from tiercake.blocks import is_object_tenant
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import MemberInfo
from tiercake.netns import Partition
from tiercake.started import started
from tiercake.tiers.ssd.log import block_payloads
from tiercake.up import UpProcess

from .load import Load
from .upgrade import NAME as UPGRADED_NODE
from .upgrade import UpgradedNode

RECOVERY_TIMEOUT_S = 90.0
CORRUPTED_FILES = 8  # a fault not recovered from by then fails the run
SSD_FS_BYTES = 300 << 20  # the SSD tier's own file system (when one can be mounted): its 256 MiB and some


@contextlib.contextmanager
def ssd_filesystem(root: Path):
    """A file system of its own for the SSD tier (a tmpfs of ``SSD_FS_BYTES``, as root), so that
    ``fill_ssd`` fills a disk for real without touching the machine's; yields its path, or None
    where none can be mounted (fill_ssd is then left out)."""
    mount = root / "ssd-fs"
    mount.mkdir()
    done = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SSD_FS_BYTES}", "tmpfs", str(mount)], capture_output=True)
        if os.geteuid() == 0
        else None
    )
    if done is None or done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(ballast: Path, fs_path: Path) -> None:
    """Take what is free on ``fs_path``'s file system with ``ballast``. The node agent writes to the
    same file system meanwhile, so what was free a moment ago may no longer be (ENOSPC): ask again."""
    with open(ballast, "wb") as f:
        for _ in range(20):
            fs = os.statvfs(fs_path)
            free = fs.f_bavail * fs.f_frsize
            if free == 0:
                return
            try:
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, free)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def pid_listening(port: int, netns: str | None = None) -> int:
    """The pid of the process listening on ``port`` on this host (from /proc), or inside network
    namespace ``netns``."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if netns is None:
            with open(table) as f:
                lines = f.readlines()
        else:  # the namespace's own table (socket inodes are unique across namespaces)
            lines = subprocess.run(
                ["ip", "netns", "exec", netns, "cat", table], capture_output=True, text=True, timeout=10
            ).stdout.splitlines()
        if lines:
            for line in lines[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inode = fields[9]
    if inode is None:
        raise LookupError(f"nothing listens on {port}")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
        except OSError:
            continue
    raise LookupError(f"no process owns the socket on {port}")


NODE_ID = "chaos-node"  # the cluster's own node agent (chaos.yaml names it)


class Faults:
    """How each fault is injected into the cluster ``up`` runs. Each returns a check that is true once
    what it broke is back (a new process serving in the killed one's place, the stalled one resumed)."""

    def __init__(
        self,
        up: UpProcess,
        ssd: Path,
        etcd,
        load: Load,
        partition: Partition | None = None,
        stall_s: float = 4.0,
        progress: Callable[[str], None] = print,
        upgraded: UpgradedNode | None = None,
    ) -> None:
        self.up, self.ssd, self.etcd, self.load, self.partition = up, ssd, etcd, load, partition
        self.stall_s, self.progress, self.upgraded = stall_s, progress, upgraded
        self._corrupt_total = self._corrupt_last = 0

    async def _members(self) -> list:
        return [MemberInfo.model_validate(m) for m in await asyncio.to_thread(self.up.members)]

    async def _member(self, role: str, node_id: str | None = None) -> MemberInfo:
        """A member of ``role`` (the one named ``node_id``, if given)."""
        member = next((m for m in await self._members() if m.role == role and node_id in (None, m.node_id)), None)
        if member is None:
            raise LookupError(f"no {role} member" + (f" {node_id}" if node_id else ""))
        return member

    async def _worker_pid(self, role: str) -> int:
        member = await self._member(role)
        async with aiohttp.ClientSession() as http, http.get(member.url + "/health") as resp:
            return (await resp.json())["pid"]

    async def node_pid(self) -> int:
        """The pid of the cluster's own node agent (not the upgraded one, which stays a member too)."""
        netns = self.partition.ns if self.partition is not None else None
        return await asyncio.to_thread(pid_listening, (await self._member("node", NODE_ID)).port, netns)

    def _conductor_pid(self) -> int:
        return pid_listening(int(self.up.control_url.rsplit(":", 1)[1]))

    async def _kill_worker(self, role: str):
        pid = await self._worker_pid(role)
        os.kill(pid, signal.SIGKILL)
        return lambda: _replaced(self._worker_pid(role), pid)

    async def kill_prefill(self):
        return await self._kill_worker("prefill")

    async def kill_decode(self):
        return await self._kill_worker("decode")

    async def kill_node(self):
        pid = await self.node_pid()
        os.kill(pid, signal.SIGKILL)
        return lambda: _replaced(self.node_pid(), pid)

    async def kill_conductor(self):
        pid = self._conductor_pid()
        os.kill(pid, signal.SIGKILL)
        return lambda: _replaced(asyncio.to_thread(self._conductor_pid), pid)

    async def stall_node(self):
        pid = await self.node_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.stall_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return lambda: _replaced(self.node_pid(), -1)

    async def rolling_restart(self):
        """Every process in turn stopped as a rolling update stops it (SIGTERM; ``up`` starts it again):
        node agent, prefill worker, decode worker, conductor with the front; the next only once the one
        before is back and a request was answered after it. Back: every one came back in time."""
        steps = (
            ("node", self.node_pid),
            ("prefill", lambda: self._worker_pid("prefill")),
            ("decode", lambda: self._worker_pid("decode")),
            ("conductor", lambda: asyncio.to_thread(self._conductor_pid)),
        )
        slow = []
        for role, pid_of in steps:
            pid, at = await pid_of(), time.monotonic()
            os.kill(pid, signal.SIGTERM)
            if (
                await recovered(
                    lambda: _replaced(pid_of(), pid),  # noqa: B023 (awaited within this turn)
                    self.load,
                    at,
                    RECOVERY_TIMEOUT_S,
                )
                is None
            ):
                slow.append(role)
            ratio = self.load.tally.hit_ratio(at, time.monotonic())
            self.progress(
                f"  {role} restarted in {time.monotonic() - at:.1f} s; hit ratio meanwhile "
                f"{'-' if ratio is None else f'{ratio:.3f}'}"
            )

        async def all_back() -> bool:
            return not slow

        return all_back

    async def upgrade(self):
        """A node agent of the previous release joins, serves, and is upgraded in place (upgrade.py)."""
        return await started(self.upgraded, "the upgrade fault (no previous release was found)").inject()

    async def partition_node(self, seconds: float = 4.0):
        """Longer than the member lease: the node agent leaves the members while cut off; back once
        the same process registered again (a new lease)."""
        partition = self.partition
        if partition is None:
            raise RuntimeError("no network namespace for the node agent: the run leaves this fault out")
        lease, pid = (await self._member("node", NODE_ID)).lease, await self.node_pid()
        await asyncio.to_thread(partition.cut)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(partition.heal)

        async def rejoined() -> bool:
            try:
                return (await self._member("node", NODE_ID)).lease != lease and await self.node_pid() == pid
            except (LookupError, OSError, aiohttp.ClientError, ValueError):
                return False

        return rejoined

    async def fill_ssd(self, seconds: float = 4.0):
        """The SSD's file system full (a ballast file takes what is free) while the pool is flushed down
        onto it and the load goes on: spills fail, answers stay right, and the index lists no copy
        that was not written (the final check); then the ballast goes."""
        ballast = self.ssd.parent / "ballast"
        _fill(ballast, self.ssd)
        try:
            async with Client([self.up.control_url], token=self.up.token, timeout=10) as control:
                await control.flush(["pool"], wait=True, timeout_s=30)  # down onto a full disk
            await asyncio.sleep(seconds)
        finally:
            ballast.unlink()
        return lambda: _replaced(self.node_pid(), -1)

    async def corrupt_detected(self) -> int:
        """Copies the node agents' tiers found corrupt (checksums) and dropped, so far in this run: the
        counts are each process's, so what a node agent found before it was restarted is kept here
        (``sample_corrupt`` is called around every fault)."""
        await self.sample_corrupt()
        return self._corrupt_total

    async def sample_corrupt(self) -> None:
        try:
            async with Client([self.up.control_url], token=self.up.token, timeout=10) as control:
                view = await control.cluster()
        except (TimeoutError, ConductorError, aiohttp.ClientError) as exc:
            self.progress(f"  could not read the nodes' corruption counts: {exc}")
            return
        now = sum(
            t.corrupt
            for m in view.members
            if m.role == "node" and m.id != UPGRADED_NODE  # up's node
            for t in m.tiers.values()
        )
        # a count lower than the last one is a new process's, counting from 0
        self._corrupt_total += now - self._corrupt_last if now >= self._corrupt_last else now
        self._corrupt_last = now

    async def corrupt_ssd(self, files: int = CORRUPTED_FILES):
        await self.load.pause()  # requests write blocks into the pool again at once: a quiet moment
        async with Client([self.up.control_url], token=self.up.token, timeout=10) as control:
            await control.flush(["gpu", "pool"], wait=True, timeout_s=30)  # the next requests read the SSD
        blocks = block_payloads(self.ssd, tenants=lambda tenant: not is_object_tenant(tenant))  # KV blocks only:
        # an object is the store's to keep (a corrupted object would be a loss chaos made, not the store)
        for path, offset, length in random.Random(3).sample(blocks, min(files, len(blocks))):
            at = offset + max(0, length - 100)  # 16 bytes near the end of the payload
            with open(path, "r+b") as f:
                f.seek(at)
                data = bytearray(f.read(16))
                f.seek(at)
                f.write(bytes(b ^ 0x5A for b in data))
        self.load.resume()
        return lambda: _replaced(self.node_pid(), -1)

    async def kill_etcd_leader(self, down_s: float = 3.0):
        leader = await asyncio.to_thread(self._etcd_leader)
        leader.stop(kill=True)
        await asyncio.sleep(down_s)
        leader.start()
        return lambda: _replaced(asyncio.to_thread(self._etcd_leader), None)  # every member answers again

    def _etcd_leader(self):
        """The member that leads; a ``LookupError`` unless every member answers."""
        statuses = {member.name: member.status() for member in self.etcd.members}
        for member in self.etcd.members:
            status = statuses[member.name]
            if status["leader"] == status["header"]["member_id"]:
                return member
        raise LookupError("no etcd member leads")


async def _replaced(current, old) -> bool:
    """``current`` (an awaitable: what now serves) answers, and is not ``old``."""
    try:
        return await current != old
    except (LookupError, OSError, aiohttp.ClientError, ValueError):
        return False


async def recovered(back, load: Load, since: float, timeout: float) -> float | None:
    """Seconds from ``since`` until ``back()`` holds and a request sent after that was answered right."""
    deadline = since + timeout
    came_back = None
    while time.monotonic() < deadline:
        if came_back is None:
            if await back():
                came_back = time.monotonic()
        elif load.tally.last_ok > came_back:
            return load.tally.last_ok - since
        await asyncio.sleep(0.2)
    return None
