"""The lab's nemesis: partitions and process faults on a running lab (``LabProcess``), each one a
coroutine that injects the fault, holds it, heals it and returns the moment it healed. What each one
found beyond the workloads' own checks (the fencing probe's answers) is in ``Findings``.

- ``isolate_etcd_leader``: the host of etcd's leader cut off from every other host and the machine
  (never the front's host, through which the load comes: a leader there hands its leadership on first);
- ``isolate_node``: a node's host (not the front's) cut off until its member lease has expired and
  its slots have moved; new versions of the moved keys written through the new owners; healed, the
  old owner is asked directly, with the object map it had, to read and to write them: it must refuse
  both (fenced by its lease and the map's epoch), never answer with the version it held;
- ``split_conductors``: the two conductors' hosts cut from each other (the third reaches both);
- ``asymmetric``: the front's host reaches a node's host, whose packets to it are dropped;
- ``loss``: every host drops 5% of what arrives, for ``loss_s``;
- ``flap``: a node's host cut and healed every 2 s, ``flaps`` times;
- ``kill_remote``: a node's host cut off, its node agent SIGKILLed and its worker SIGSTOPped meanwhile;
  healed, the worker resumed (the node agent is started again as its host's supervisor would)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tiercake.blocks import object_id, object_slot
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import ObjectMap
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import PeerAddress, PeerConnection
from tiercake.transfer.protocol import FLAG_EAGER, Op, Status

from . import links
from .cluster import ETCD_CLIENT, NODE_PORT
from .hosts import Host
from .process import LabProcess

FAULTS = ("isolate_etcd_leader", "isolate_node", "split_conductors", "asymmetric", "loss", "flap", "kill_remote")


@dataclass
class Findings:
    fence_asked: int = 0  # requests sent to the old owner after the heal
    fence_refused: int = 0  # of them, refused (WRONG_OWNER, UNAVAILABLE)
    fence_acked: int = 0  # writes the old owner acknowledged: must be 0
    fence_stale: int = 0  # reads it answered with the version it had: must be 0
    statuses: list[str] = field(default_factory=list)  # what it answered, for the report
    moved_slots: int = 0  # slots of the isolated node that moved


class Nemesis:
    def __init__(self, lab: LabProcess, hold_s: float = 6.0, loss_s: float = 30.0, flaps: int = 8) -> None:
        self.lab, self.hold_s, self.loss_s, self.flaps = lab, hold_s, loss_s, flaps
        self.found: dict[str, Findings] = {}
        self.writer: Callable[[str, bytes], Awaitable[None]] | None = None  # a put through the cluster

    async def _run(self, fn, *args) -> None:
        await asyncio.to_thread(fn, *args)

    async def _hold(self, seconds: float | None = None) -> None:
        await asyncio.sleep(self.hold_s if seconds is None else seconds)

    async def heal(self) -> float:
        await self._run(links.heal, self.lab.state)
        return time.monotonic()

    # the faults ---------------------------------------------------------------------------------

    async def isolate_etcd_leader(self) -> float:
        leader = await asyncio.to_thread(self.etcd_leader)
        if leader == self.lab.hosts[0]:  # the load comes in through the front's host: lead elsewhere
            leader = self.lab.hosts[2]
            await asyncio.to_thread(self.move_etcd_leader, leader)
        await self._run(links.isolate, self.lab.state, leader)
        await self._hold()
        return await self.heal()

    async def isolate_node(self) -> float:
        """The node's host cut off until its slots moved (its lease gone), new versions written through
        the new owners, then the heal and the fencing probe."""
        found = self.found.setdefault("isolate_node", Findings())
        victim = self.node_host()
        before = await self._object_map()
        mine = [s for s in range(before.slots) if before.primary(s) == victim.name]
        await self._run(links.isolate, self.lab.state, victim)
        moved = await self._until_moved(victim.name, mine, timeout=60)
        found.moved_slots = len(moved)
        names = self._names_in(moved, before)
        for name in names:
            if self.writer is not None:
                await self.writer(name, f"after-the-move {name}".encode())
        healed = await self.heal()
        await self._fence_probe(victim, before, names, found)
        return healed

    async def split_conductors(self) -> float:
        a, b = self.lab.hosts[:2]
        await self._run(links.cut, a, b)
        await self._hold()
        return await self.heal()

    async def asymmetric(self) -> float:
        await self._run(lambda: links.cut(self.lab.hosts[0], self.node_host(), both=False))
        await self._hold()
        return await self.heal()

    async def loss(self) -> float:
        for host in self.lab.hosts:
            await self._run(links.set_loss, host, 0.05)
        try:
            await asyncio.sleep(self.loss_s)
        finally:
            for host in self.lab.hosts:
                await self._run(links.set_loss, host, 0.0)
        return time.monotonic()

    async def flap(self) -> float:
        victim = self.node_host()
        for _ in range(self.flaps):
            await self._run(links.isolate, self.lab.state, victim)
            await asyncio.sleep(1.0)
            await self.heal()
            await asyncio.sleep(1.0)
        return time.monotonic()

    async def kill_remote(self) -> float:
        victim = self.node_host()
        await self._run(links.isolate, self.lab.state, victim)
        node = await asyncio.to_thread(pid_in, victim, NODE_PORT)
        worker = await asyncio.to_thread(self.worker_pid, victim)
        os.kill(node, signal.SIGKILL)
        if worker:
            os.kill(worker, signal.SIGSTOP)
        try:
            await self._hold()
        finally:
            if worker:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGCONT)
        return await self.heal()

    # where things are ---------------------------------------------------------------------------

    def node_host(self) -> Host:
        """The host the node faults pick: the last (no conductor, no front)."""
        return self.lab.hosts[-1]

    def etcd_leader(self) -> Host:
        """The host whose etcd member leads (asked over etcd's JSON gateway)."""
        for host in self.lab.hosts[:3]:
            with contextlib.suppress(OSError, ValueError, KeyError):
                status = _etcd_call(host, "maintenance/status")
                if status["leader"] == status["header"]["member_id"]:
                    return host
        raise LookupError("no etcd member says it leads")

    def move_etcd_leader(self, to: Host, timeout: float = 15.0) -> None:
        """Have etcd's leader hand its leadership to ``to``'s member, and wait until it leads."""
        leader = self.etcd_leader()
        target = _etcd_call(to, "maintenance/status")["header"]["member_id"]
        _etcd_call(leader, "maintenance/transfer-leadership", {"targetID": target})
        deadline = time.monotonic() + timeout
        while self.etcd_leader() != to:
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd's leadership did not move to {to.name} in {timeout:.0f} s")
            time.sleep(0.2)

    def worker_pid(self, host: Host) -> int | None:
        """A worker's pid on ``host`` (from the lab's state: the process groups it started)."""
        for pid in self.lab.pids:
            with contextlib.suppress(OSError):
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                if b"worker" in cmdline and f"{host.name}-worker-0".encode() in cmdline:
                    return pid
        return None

    async def _object_map(self) -> ObjectMap:
        async with Client(self.lab.control_urls, token=self.lab.token, timeout=5) as client:
            return await client.object_map()

    async def _until_moved(self, node: str, slots: list[int], timeout: float) -> list[int]:
        """The slots of ``slots`` whose primary is no longer ``node``, once all of them moved."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, TimeoutError, ConductorError):
                current = await self._object_map()
                if all(current.primary(s) != node for s in slots):
                    return slots
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{node}'s slots did not move within {timeout:.0f} s")

    @staticmethod
    def _names_in(slots: list[int], omap: ObjectMap, tenant: str = "default", per_slot: int = 1) -> list[str]:
        """Key names that fall in ``slots`` (``per_slot`` each)."""
        wanted, names, i = set(slots), [], 0
        counts: dict[int, int] = {}
        while wanted and i < 200_000:
            name = f"fence-{i}"
            slot = object_slot(object_id(name.encode(), tenant), omap.slots)
            if slot in wanted:
                names.append(name)
                counts[slot] = counts.get(slot, 0) + 1
                if counts[slot] >= per_slot:
                    wanted.discard(slot)
            i += 1
        return names[:8]

    async def _fence_probe(self, victim: Host, old: ObjectMap, names: list[str], found: Findings) -> None:
        """Just healed: ``victim``, asked with the map it served by, must refuse to read or write ``names``."""
        conn = None
        deadline = time.monotonic() + 10
        while conn is None and time.monotonic() < deadline:
            try:
                conn = await PeerConnection(
                    PeerAddress(victim.name, victim.address, NODE_PORT), self.lab.secret.encode(), "lab-fence"
                ).open()
            except OSError:
                await asyncio.sleep(0.1)
        if conn is None:
            found.statuses.append("unreachable")
            return
        try:
            for name in names:
                value = b"from-the-old-map"
                put = w.PutRequest("default", old.epoch, [w.PutItem(name.encode(), len(value), True, 2, True)])
                body = await conn.exchange(Op.OBJ_PUT, Op.OBJ_PUT_REPLY, w.encode(put), FLAG_EAGER, [memoryview(value)])
                self._count(found, "put", w.decode(w.PutReply, body).results[0].status)
                query = w.QueryRequest("default", old.epoch, [name.encode()], lease=False)
                body = await conn.exchange(Op.OBJ_QUERY, Op.OBJ_QUERY_REPLY, w.encode(query))
                self._count(found, "query", w.decode(w.QueryReply, body).items[0].status)
        finally:
            conn.close()

    @staticmethod
    def _count(found: Findings, kind: str, status: int) -> None:
        found.fence_asked += 1
        found.statuses.append(f"{kind}:{Status(status).name if status in Status._value2member_map_ else status}")
        if status in (Status.WRONG_OWNER, Status.UNAVAILABLE):
            found.fence_refused += 1
        elif status == Status.OK:
            if kind == "put":
                found.fence_acked += 1
            else:
                found.fence_stale += 1


def pid_in(host: Host, port: int) -> int:
    """The pid of what listens on ``port`` on ``host``."""
    from tiercake.chaos.faults import pid_listening

    return pid_listening(port, host.netns)


def _etcd_call(host: Host, call: str, body: dict | None = None) -> dict:
    """One call of etcd's JSON gateway on ``host``'s member."""
    request = urllib.request.Request(
        f"http://{host.address}:{ETCD_CLIENT}/v3/{call}", data=json.dumps(body or {}).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=2) as resp:
        return json.loads(resp.read())


def etcd_range(host: Host, prefix: bytes) -> list[tuple[bytes, int]]:
    """Every key under ``prefix`` in ``host``'s etcd member, with the lease it is under."""
    import base64

    from tiercake.conductor.metadata import prefix_end

    end = prefix_end(prefix)
    found = _etcd_call(
        host, "kv/range", {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
    )
    return [(base64.b64decode(kv["key"]), int(kv.get("lease", 0))) for kv in found.get("kvs", [])]
