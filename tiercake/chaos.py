"""``tiercake chaos``: a cluster under load while its processes die, stall and restart, its SSD blocks
rot and its etcd leader goes; every answer checked against a full recompute.

It starts its own cluster (``tiercake up`` on a three-member etcd when the etcd binary is installed,
else on the embedded backend), replays a synthetic conversation trace against it with greedy decoding
(a few requests in flight at all times), and injects one fault after another:

- ``kill_prefill`` / ``kill_decode`` / ``kill_node`` / ``kill_conductor``: SIGKILL (``up`` restarts it)
- ``stall_node``: the node agent stopped for 20 s (4 with ``--quick``: what a hung disk or machine
  looks like from the others), then resumed; the requests served meanwhile against the rate just
  before (``throughput_during``: workers fence a node out of their path at its first timeout)
- ``partition_node``: the node agent's network cut for a few seconds, then healed: it runs in a
  network namespace of its own behind a veth pair (``tiercake.netns``; needs root, else the fault is
  left out and the run says so) and the link goes down: its connections black-hole, it leaves the
  members, and once healed it registers again
- ``corrupt_ssd``: bytes flipped inside block files of the node's SSD tier, after the caches above it
  were flushed so that the next requests read them
- ``kill_etcd_leader``: SIGKILL of the etcd member that leads, restarted a few seconds later
- ``rolling_restart``: every process in turn stopped as a rolling update stops it (SIGTERM) and
  started again by ``up``, the next once the one before serves (``hit_ratio_during`` beside the
  ratio just before)
- ``upgrade``: a node agent of the previous release (``--previous DIR``; else the fault is left out
  and the run says so) joins beside the current one, serves blocks over the previous protocol, and is
  upgraded in place (``tiercake.chaos_upgrade``)

Beside the requests, a key-value workload (``tiercake.chaos_kv``: clients of the cluster's store
putting, upserting, removing and reading checksummed values) runs throughout; after each fault every
key is read back, and at the end each key's history is checked for linearizability: an acknowledged
object gone (``kv.lost``), a read not whole (``kv.torn``) or a history no order explains
(``kv.violations``) fails the run. Requests are retried as OpenAI's client retries them (``RETRIES``
on 408, 429, 5xx and lost connections, backing off): ``failed`` counts those that failed after that.

Every answer is compared with the same prompt computed here from scratch by the reference model (no
cache anywhere): a different answer is ``wrong``. After the faults, every placement the index still
lists is read back from its node: one that cannot be served, other than a corrupted block the read
detects (the node's checksum counter says so), is an acknowledged placement ``lost``.
Recovery is the time from a fault to the first request served after it with every member back,
beside the time the whole cluster took to start in the same run. The run fails (exit 1) if any
answer is wrong or any placement lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tiercake.bench.report import Report, machine
from tiercake.blocks import is_object_tenant
from tiercake.chaos_kv import KvLoad, KvVerdict
from tiercake.chaos_upgrade import BLOCKS as UPGRADE_BLOCKS
from tiercake.chaos_upgrade import NAME as UPGRADED_NODE
from tiercake.chaos_upgrade import UpgradedNode
from tiercake.conductor.client import Client, ConductorError
from tiercake.kvstore import AsyncStore, Durability
from tiercake.messages import MemberInfo
from tiercake.netns import Partition, PartitionUnavailable
from tiercake.replay import TokenMap
from tiercake.tiers.pool import remove_pool
from tiercake.tiers.ssd.log import block_payloads
from tiercake.traces import synthetic_trace
from tiercake.up import UpProcess

CONFIG = """node_id: chaos-node
store:
  tiers:
    - {{kind: pool, capacity: 2MiB, path: {pool}}}
    - {{kind: ssd, capacity: 256MiB, path: {ssd}}}
conductor: {{member_ttl: 2}}
serving: {{gpu_blocks: 96, max_context: 320}}
"""
MAX_TOKENS = 4
RECOVERY_TIMEOUT_S = 90.0
CORRUPTED_FILES = 8  # a fault not recovered from by then fails the run
RATE_WINDOW_S = 4.0  # how long the load's rate is measured before each fault

FAULTS = (
    "kill_prefill",
    "kill_decode",
    "stall_node",
    "partition_node",
    "kill_node",
    "corrupt_ssd",
    "fill_ssd",
    "kill_conductor",
    "kill_etcd_leader",
    "rolling_restart",
    "upgrade",
)
KV_CLIENTS = 2  # the key-value workload beside the serving one
# its puts ask to be on disk, synced, before they are acknowledged: what may not be lost then is every
# acknowledged object (a memory-level object is a cache entry the store may evict under pressure, as
# Mooncake's may, and the 2 MiB pool here is under pressure all the time)
KV_DURABILITY = Durability(persist=True)
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


class Oracle:
    """Greedy answers computed from scratch, in this process: the reference model over a gpu tier of
    its own, nothing cached, no conductor, no node."""

    def __init__(self, config) -> None:
        self.config = config
        self._engine = None
        self._answers: dict[tuple[int, ...], str] = {}
        self._lock = asyncio.Lock()  # one sequence at a time: the engine's tier is small
        self._computed = 0

    async def answer(self, prompt: list[int], max_tokens: int) -> str:
        key = (*prompt, -max_tokens)
        if key not in self._answers:
            async with self._lock:
                if key not in self._answers:
                    self._answers[key] = await self._compute(prompt, max_tokens)
        return self._answers[key]

    async def _compute(self, prompt: list[int], max_tokens: int) -> str:
        from tiercake.workers.reference.model import decode
        from tiercake.workers.reference.runner import next_token

        engine = await self._engine_once()
        self._computed += 1  # a tenant of its own each time: nothing computed before is reused
        seq = await engine.prefill(prompt, tenant=f"oracle-{self._computed}", max_new_tokens=max_tokens)
        out: list[int] = []
        try:
            while len(out) < max_tokens:
                out.append(next_token(seq.logits))
                if len(out) < max_tokens:
                    await engine.decode([seq], [out[-1]])
        finally:
            engine.free(seq)
        assert seq.stats.cached_tokens == 0
        return decode(out)

    async def _engine_once(self):
        if self._engine is None:
            import torch

            from tiercake.tiers import GpuBackend, GpuBlockPool, Tier, TieredStore
            from tiercake.workers.reference.model import ReferenceModel
            from tiercake.workers.reference.runner import ModelRunner

            serving = self.config.serving
            layout = serving.layout()
            pool = GpuBlockPool(64, layout.shape, getattr(torch, layout.dtype), "cpu")
            store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=layout.nbytes).open()
            self._engine = ModelRunner(
                ReferenceModel(serving.model),
                store,
                self.config.serving_namespace(),
                worker_id="oracle",
                max_context=serving.max_context,
            )
        return self._engine


@dataclass
class Tally:
    ok: int = 0
    wrong: int = 0
    failed: int = 0  # after the retries a client makes (RETRIES)
    retried: int = 0
    errors: list[str] = field(default_factory=list)
    last_ok: float = 0.0  # monotonic time of the latest correct answer
    served: list[tuple[float, int, int]] = field(default_factory=list)  # (when, prompt tokens, cached tokens)

    def hit_ratio(self, since: float, until: float) -> float | None:
        """Cached prompt tokens over prompt tokens of the requests answered in [since, until)."""
        window = [(p, c) for at, p, c in self.served if since <= at < until]
        prompt = sum(p for p, _ in window)
        return sum(c for _, c in window) / prompt if prompt else None


RETRIES = 5  # a request's tries after its first, as OpenAI's client makes them (on 408, 429, 5xx, a lost connection)
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


class Load:
    """Requests from the trace, ``concurrency`` in flight, each answer checked by the oracle."""

    def __init__(self, url: str, oracle: Oracle, prompts: list[tuple[list[int], str]], concurrency: int = 2) -> None:
        self.url, self.oracle, self.prompts, self.concurrency = url, oracle, prompts, concurrency
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._busy = 0
        self._tasks: list[asyncio.Task] = []

    async def pause(self) -> None:
        """No new requests until ``resume``; returns once those in flight are done."""
        self._running.clear()
        while self._busy:
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        self._running.set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(i)) for i in range(self.concurrency)]

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    async def stop(self) -> None:
        self._stop.set()
        self._running.set()
        await asyncio.gather(*self._tasks)

    async def _run(self, lane: int) -> None:
        rng = random.Random(lane)
        async with Client([self.url], timeout=60, retries=1) as client:
            while not self._stop.is_set():
                await self._running.wait()
                prompt, tenant = self.prompts[rng.randrange(len(self.prompts))]
                self._busy += 1
                try:
                    await self.one(client, prompt, tenant)
                finally:
                    self._busy -= 1

    async def one(self, client: Client, prompt: list[int], tenant: str) -> bool:
        tally = self.tally
        answer = await self._asked(client, prompt, tenant)
        if answer is None:
            return False
        if answer["choices"][0]["text"] != await self.oracle.answer(prompt, MAX_TOKENS):
            tally.wrong += 1
            tally.errors.append(f"WRONG answer for a {len(prompt)}-token prompt of {tenant}")
            return False
        tally.ok += 1
        tally.last_ok = time.monotonic()
        usage = answer["usage"]
        tally.served.append(
            (
                tally.last_ok,
                usage["prompt_tokens"],
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            )
        )
        return True

    async def _asked(self, client: Client, prompt: list[int], tenant: str) -> dict | None:
        """The answer, after as many retries as a client makes, backing off (None: it failed)."""
        tally = self.tally
        for attempt in range(RETRIES + 1):
            try:
                return await client.complete(prompt, max_tokens=MAX_TOKENS, tenant=tenant)
            except ConductorError as exc:
                error: Exception = exc
                if exc.status not in RETRYABLE:
                    break
            except (TimeoutError, aiohttp.ClientError) as exc:
                error = exc
            if attempt < RETRIES:
                tally.retried += 1
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
        tally.failed += 1
        tally.errors.append(str(error)[:160])
        await asyncio.sleep(0.2)  # a failing cluster is not hammered
        return None


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

    async def _member(self, role: str) -> MemberInfo:
        member = next((m for m in await self._members() if m.role == role), None)
        if member is None:
            raise LookupError(f"no {role} member")
        return member

    async def _worker_pid(self, role: str) -> int:
        member = await self._member(role)
        async with aiohttp.ClientSession() as http, http.get(member.url + "/health") as resp:
            return (await resp.json())["pid"]

    async def _node_pid(self) -> int:
        netns = self.partition.ns if self.partition is not None else None
        return await asyncio.to_thread(pid_listening, (await self._member("node")).port, netns)

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
        pid = await self._node_pid()
        os.kill(pid, signal.SIGKILL)
        return lambda: _replaced(self._node_pid(), pid)

    async def kill_conductor(self):
        pid = self._conductor_pid()
        os.kill(pid, signal.SIGKILL)
        return lambda: _replaced(asyncio.to_thread(self._conductor_pid), pid)

    async def stall_node(self):
        pid = await self._node_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.stall_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return lambda: _replaced(self._node_pid(), -1)

    async def rolling_restart(self):
        """Every process in turn stopped as a rolling update stops it (SIGTERM; ``up`` starts it again):
        node agent, prefill worker, decode worker, conductor with the front; the next only once the one
        before is back and a request was answered after it. Back: every one came back in time."""
        steps = (
            ("node", self._node_pid),
            ("prefill", lambda: self._worker_pid("prefill")),
            ("decode", lambda: self._worker_pid("decode")),
            ("conductor", lambda: asyncio.to_thread(self._conductor_pid)),
        )
        slow = []
        for role, pid_of in steps:
            pid, at = await pid_of(), time.monotonic()
            os.kill(pid, signal.SIGTERM)
            if (
                await _recovered(
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
        """A node agent of the previous release joins, serves, and is upgraded in place (chaos_upgrade)."""
        return await self.upgraded.inject()

    async def partition_node(self, seconds: float = 4.0):
        """Longer than the member lease: the node agent leaves the members while cut off; back once
        the same process registered again (a new lease)."""
        lease, pid = (await self._member("node")).lease, await self._node_pid()
        await asyncio.to_thread(self.partition.cut)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(self.partition.heal)

        async def rejoined() -> bool:
            try:
                return (await self._member("node")).lease != lease and await self._node_pid() == pid
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
        return lambda: _replaced(self._node_pid(), -1)

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
        return lambda: _replaced(self._node_pid(), -1)

    async def kill_etcd_leader(self, down_s: float = 3.0):
        leader = await asyncio.to_thread(self._etcd_leader)
        leader.stop(kill=True)
        await asyncio.sleep(down_s)
        leader.start()
        return lambda: _replaced(asyncio.to_thread(self._etcd_leader), None)  # every member answers again

    def _etcd_leader(self):
        """The member that leads; a ``LookupError`` unless every member answers."""
        import json
        import urllib.request

        statuses = {}
        for member in self.etcd.members:
            request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}")
            with urllib.request.urlopen(request, timeout=5) as resp:
                statuses[member.name] = json.loads(resp.read())
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


async def _recovered(back, load: Load, since: float, timeout: float) -> float | None:
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


async def _unservable(up: UpProcess, secret: bytes) -> tuple[int, int]:
    """(placements the index lists on node agents, those the node cannot serve)."""
    import torch

    from tiercake.transfer import TransferEngine

    async with Client([up.control_url], token=up.token, timeout=10) as control:
        nodes = [m for m in await control.members() if m.role == "node"]
        engine = TransferEngine("chaos-checker", secret, transports=("tcp",))
        listed = lost = 0
        try:
            for node in nodes:
                engine.add_peer(node.node_id, node.host, node.port)
                blocks = await control.node_blocks(node.node_id)
                listed += len(blocks)
                for i in range(0, len(blocks), 64):
                    batch = blocks[i : i + 64]
                    dsts = [torch.empty(b.size, dtype=torch.uint8) for b in batch]
                    results = await engine.read_blocks(
                        node.node_id, [bytes.fromhex(b.key) for b in batch], dsts, timeout=30
                    )
                    lost += sum(not r.ok for r in results)
        finally:
            await engine.close()
    return listed, lost


async def run(
    quick: bool = False,
    faults: tuple[str, ...] = FAULTS,
    progress=print,
    stage: Callable[[int, int, str], None] | None = None,
    previous: Path | None = None,
) -> Report:
    """The fault-injection run; ``progress(message)`` tells what happened, ``stage(done, total, name)``
    where the run is: the cluster starting, each fault, the final check. ``previous``: the folder the
    previous release is installed in (the ``upgrade`` fault; left out without it)."""

    def reached(done: int, name: str) -> None:
        if stage is not None:
            stage(done, len(faults) + 2, name)

    from tiercake.conductor.etcd_process import EtcdCluster, etcd_binary, free_port
    from tiercake.config import load_config

    report = Report(bench="chaos", machine=machine())
    settle = 2.0 if quick else 15.0
    with tempfile.TemporaryDirectory(prefix="tiercake-chaos-") as tmp, ssd_filesystem(Path(tmp)) as ssd_fs:
        root = Path(tmp)
        pool = Path(f"/dev/shm/tiercake-chaos-{os.getpid()}")
        ssd = (ssd_fs or root) / "ssd"
        if ssd_fs is None and "fill_ssd" in faults:
            progress("cannot mount a file system for the SSD tier (needs root): no fill_ssd fault")
            faults = tuple(f for f in faults if f != "fill_ssd")
        config_path = root / "chaos.yaml"
        config_path.write_text(CONFIG.format(pool=pool, ssd=ssd))
        config = load_config(config_path)
        etcd = None
        try:
            etcd_binary()
            etcd = EtcdCluster(root / "etcd", size=3).start()
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            progress(f"no etcd cluster ({exc}): the embedded backend, and no etcd fault")
            faults = tuple(f for f in faults if f != "kill_etcd_leader")
        if previous is None and "upgrade" in faults:
            progress("no previous release given (--previous DIR): no upgrade fault")
            faults = tuple(f for f in faults if f != "upgrade")
        partition = None
        if "partition_node" in faults:
            try:
                partition = Partition()
            except PartitionUnavailable as exc:
                progress(f"{exc}: no partition_node fault")
                faults = tuple(f for f in faults if f != "partition_node")
        reached(0, "starting the cluster")
        secret = secrets.token_hex(24)  # the cluster's, given here so the checker can read the nodes back
        started = time.monotonic()
        args, host = ["--etcd", ",".join(etcd.endpoints)] if etcd else [], "127.0.0.1"
        if partition is not None:  # the node agent behind the link; the APIs where it reaches them
            host = partition.host_ip
            args += ["--host", host, "--node-netns", f"{partition.ns}:{partition.ns_ip}"]
        up = UpProcess(
            config_path, root / "data", free_port(), args, env={**os.environ, "TIERCAKE_SECRET": secret}, host=host
        )
        load = kv = upgraded = None
        try:
            await asyncio.to_thread(up.wait_ready, 2)
            cold_start = time.monotonic() - started
            records = synthetic_trace(
                40 if quick else 400, tenants=2, system_prompts=2, system_blocks=4, turn_blocks=(1, 3), seed=11
            )
            tokens = TokenMap(16)
            prompts = [(tokens.prompt(r, 320 - MAX_TOKENS), r.tenant) for r in records]
            load = Load(up.url, Oracle(config), prompts)
            load.start()
            kv = KvLoad(
                lambda: AsyncStore(
                    [up.control_url], secret=secret, token=up.token, ssl=up.ssl, retry_s=20.0, timeout_s=3.0
                ),
                clients=KV_CLIENTS,
                durability=KV_DURABILITY,
                large=16 << 10,
                pause_s=0.02,
            )
            await kv.start()
            await asyncio.sleep(settle)
            recovery: dict[str, float | None] = {}
            during: dict[str, tuple[float, float, float]] = {}  # fault -> (requests/s during, before, seconds)
            hits: dict[str, tuple[float | None, float | None]] = {}  # fault -> (hit ratio during, before)
            if "upgrade" in faults:
                upgraded = UpgradedNode(root, up.control_url, up.token, secret, previous, progress)
            injector = Faults(
                up, ssd, etcd, load, partition, stall_s=4.0 if quick else 20.0, progress=progress, upgraded=upgraded
            )
            for i, fault in enumerate(faults):
                reached(1 + i, fault)
                before = (load.tally.ok, load.tally.failed, load.tally.wrong)
                await asyncio.sleep(RATE_WINDOW_S)  # the rate just before, to hold the rate during it against
                rate_before = (load.tally.ok - before[0]) / RATE_WINDOW_S
                await injector.sample_corrupt()  # before a fault that may restart the node agent
                progress(f"{fault} ... (at {time.monotonic():.1f} s on the monotonic clock)")
                at, ok_at = time.monotonic(), load.tally.ok
                back = await getattr(injector, fault)()
                lasted = time.monotonic() - at
                if lasted >= 1.0:  # a fault that lasts (a stall, a partition): what the cluster served meanwhile
                    during[fault] = ((load.tally.ok - ok_at) / lasted, rate_before, lasted)
                    hits[fault] = (load.tally.hit_ratio(at, at + lasted), load.tally.hit_ratio(at - RATE_WINDOW_S, at))
                recovery[fault] = await _recovered(back, load, at, timeout=RECOVERY_TIMEOUT_S)
                await injector.sample_corrupt()
                await kv.read_back()  # every object once more: one a fault lost shows in its history
                await asyncio.sleep(settle)
                t = load.tally
                progress(
                    f"{fault}: recovered in {recovery[fault]} s; {t.ok - before[0]} ok, "
                    f"{t.failed - before[1]} failed, {t.wrong - before[2]} wrong"
                )
            reached(1 + len(faults), "checking every placement")
            await load.stop()
            await kv.stop()
            await asyncio.sleep(3)  # reports of the last changes and the statistics reach the conductor
            detected_before = await injector.corrupt_detected()
            listed, unservable = await _unservable(up, secret.encode())
            await asyncio.sleep(3)
            detected = await injector.corrupt_detected()
            # a rotten block the load never read again is found by the check itself: detected, not lost
            lost = max(0, unservable - (detected - detected_before))
            progress(
                f"the index lists {listed} placements on node agents; {unservable} of them cannot be served, "
                f"{detected - detected_before} of those found corrupt by the check"
            )
        finally:
            if load is not None and not load.stopped:
                await load.stop()
            if kv is not None:
                await kv.stop()
            if upgraded is not None:
                upgraded.close()
            output = up.stop()
            if etcd is not None:
                etcd.stop()
            if partition is not None:
                partition.close()
            remove_pool(pool)
        t = load.tally
        answered = t.ok + t.wrong
        report.add(
            "requests.ok",
            t.ok,
            "requests",
            t.ok + t.wrong + t.failed,
            limit_name="requests sent",
            failed=t.failed,
            retried=t.retried,
            faults=list(faults),
            errors=t.errors[:8],
        )
        report.add("requests.wrong", t.wrong, "requests", max(answered, 1), limit_name="requests answered")
        report.add("placements.lost", lost, "placements", max(listed, 1), limit_name="placements the index lists")
        if "corrupt_ssd" in faults:
            report.add(
                "ssd.corrupt_detected",
                detected,
                "blocks",
                CORRUPTED_FILES,
                limit_name="block files corrupted (only those read again can be detected)",
            )
        for fault, (rate, rate_before, lasted) in during.items():
            report.add(
                f"throughput_during.{fault}",
                rate,
                "requests/s",
                max(rate_before, 1e-9),
                limit_name="requests/s just before the fault",
                seconds=round(lasted, 1),
            )
        for fault, (ratio, ratio_before) in hits.items():
            if ratio is not None and ratio_before:
                report.add(
                    f"hit_ratio_during.{fault}",
                    ratio,
                    "cached/prompt tokens",
                    ratio_before,
                    limit_name="hit ratio just before the fault",
                )
        _kv_figures(report, kv.verdict())
        if upgraded is not None:
            report.add(
                "upgrade.read_back",
                upgraded.read_back,
                "blocks",
                UPGRADE_BLOCKS,
                limit_name="blocks written to the previous release's node agent",
            )
        for fault, seconds in recovery.items():
            report.add(
                f"recovery_s.{fault}",
                seconds if seconds is not None else RECOVERY_TIMEOUT_S,
                "s",
                cold_start,
                limit_name="the cluster's cold start, same run",
                recovered=seconds is not None,
            )
        if "restarting" not in output and any(f.startswith("kill_") and f != "kill_etcd_leader" for f in faults):
            progress("note: tiercake up never said it restarted anything")
    reached(len(faults) + 2, "done")
    return report


def _kv_figures(report: Report, verdict: KvVerdict) -> None:
    report.add(
        "kv.ops",
        verdict.ops,
        "operations",
        verdict.ops,
        limit_name="operations in the histories",
        unknown_outcome=verdict.unknown,
    )
    report.add(
        "kv.lost",
        verdict.lost,
        "reads",
        max(verdict.ops, 1),
        limit_name="operations (a read of an object put and never removed that found nothing)",
    )
    report.add(
        "kv.violations",
        len(verdict.violations),
        "keys",
        6,
        limit_name="keys (a history no order explains)",
        first=verdict.violations[:1],
    )
    report.add("kv.torn", verdict.torn, "reads", max(verdict.ops, 1), limit_name="operations (a read not whole)")


def failed(report: Report) -> list[str]:
    """What makes a chaos run fail: a wrong answer, a lost placement, a lost, torn or unexplained
    object, a fault never recovered from."""
    figures = {f.name: f for f in report.figures}
    reasons = []
    for name, what in (
        ("requests.wrong", "wrong answers"),
        ("placements.lost", "placements lost"),
        ("kv.lost", "reads that found an acknowledged object gone"),
        ("kv.torn", "torn reads"),
        ("kv.violations", "keys whose history is not linearizable"),
    ):
        if figures[name].value:
            reasons.append(f"{figures[name].value:.0f} {what}")
    if "upgrade.read_back" in figures and figures["upgrade.read_back"].ratio < 1:
        reasons.append("blocks written to the previous release's node agent did not read back")
    reasons += [
        f"never recovered from {name.split('.', 1)[1]}"
        for name, f in figures.items()
        if name.startswith("recovery_s.") and not f.params["recovered"]
    ]
    return reasons


__all__ = ["FAULTS", "Oracle", "failed", "pid_listening", "run"]
