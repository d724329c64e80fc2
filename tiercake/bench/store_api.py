"""`tiercake bench store-api`: the key-value store API (``tiercake.kvstore``) between two processes,
against a raw socket and, where its package is installed, Mooncake Store, all in the same run.

The same code (``measure``, written against Mooncake's API) drives both stores: put_from and get_into
of one object at a time, and batch_put_from and batch_get_into, at 64 KiB, 1 MiB and 16 MiB, from
and into one registered buffer. tiercake's side is a conductor and a node agent (each a process of
its own) and this process as the client, over TCP and over the shared pool; Mooncake's is its master,
a client process that contributes the memory, and a client that only reads and writes, over TCP.
Where Mooncake runs, everything runs in one network namespace of its own (its master binds every
address), and the repetitions interleave: tiercake's, then Mooncake's, then tiercake's again in the
other order, so a slow moment of the machine falls on both; each figure is the best repetition.
The limit of every figure is a plain blocking-socket stream of the same bytes in the same
object-sized calls, to the node agent's process, measured in this run; ``vs_mooncake`` figures are
tiercake over Mooncake. ``get_cold`` is the same reads by a second client that never saw the
objects (against Mooncake's ``get``): with the object map, a client needs no lookup either way.
``load``: that many processes spinning on the CPU meanwhile (a busy machine; 0: none).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiercake.up import Child

from .report import Report, machine, spinners
from .store import KiB, MiB, _warm
from .transfer import Peer, _raw_seconds

OPS = ("put", "get", "get_cold", "batch_put", "batch_get")
BATCH = {4 * KiB: 128, 64 * KiB: 32, 1 * MiB: 8, 16 * MiB: 2}
INSIDE = "TIERCAKE_BENCH_STORE_API_NETNS"  # set in the namespace's process
MOONCAKE_PORT = 50091


def plan(quick: bool) -> list[tuple[int, int, int]]:
    """(object bytes, objects, objects per batch) per size."""
    total = (16 if quick else 64) * MiB
    small = (1024 if quick else 4096) * 4 * KiB  # 4 KiB objects: what Python costs per object, not bytes
    return [(4 * KiB, small // (4 * KiB), BATCH[4 * KiB])] + [
        (size, max(2, total // size), BATCH[size]) for size in (64 * KiB, 1 * MiB, 16 * MiB)
    ]


class Buffers:
    """One registered buffer of warm memory a store's calls read from and write into."""

    def __init__(self, sizes: list[tuple[int, int, int]]) -> None:
        self.span = max(size * count for size, count, _ in sizes)
        self.buf = (ctypes.c_ubyte * (2 * self.span))()
        ctypes.memmove(self.buf, os.urandom(self.span), self.span)  # touched: no page faults in the timed part
        ctypes.memset(ctypes.addressof(self.buf) + self.span, 0, self.span)
        self.src = ctypes.addressof(self.buf)
        self.dst = self.src + self.span

    def register(self, *stores) -> None:
        for store in stores:
            _check(store.register_buffer(self.src, 2 * self.span), "register_buffer")

    def unregister(self, *stores) -> None:
        for store in stores:
            store.unregister_buffer(self.src)


def measure(
    store, sizes: list[tuple[int, int, int]], rep: int, buffers: Buffers, best: dict[str, float], cold=None
) -> None:
    """One repetition of each operation at each size, through Mooncake's API (``store`` is Mooncake's
    ``MooncakeDistributedStore`` or tiercake's ``DistributedStore``, set up, with ``buffers``
    registered); the best seconds so far in ``best``. ``cold``: another client of the same store,
    which also reads every object one at a time (``get_cold``): a reader that never saw the objects,
    where ``store`` may remember where it put them."""
    for size, count, batch in sizes:
        _measure_size(store, size, count, batch, rep, buffers, best, cold)


def _measure_size(
    store, size: int, count: int, batch: int, rep: int, buffers: Buffers, best: dict[str, float], cold
) -> None:
    """``measure`` at one size: singles, then batches of ``batch``, each read checked against what was put."""
    src, dst = buffers.src, buffers.dst
    keys = [f"o{size}-{rep}-{i}" for i in range(count)]
    ptrs = [src + i * size for i in range(count)]
    outs = [dst + i * size for i in range(count)]

    def put() -> None:
        for k, p in zip(keys, ptrs):
            _check(store.put_from(k, p, size), "put_from")

    def get(reader, what: str) -> None:
        for k, o in zip(keys, outs):
            _check(reader.get_into(k, o, size) - size, what)

    timed = {"put": put, "get": lambda: get(store, "get_into")}
    if cold is not None:
        timed["get_cold"] = lambda: get(cold, "get_into (cold)")
    for op, run in timed.items():
        if op != "put":  # each read proves itself: nothing left from the last one
            ctypes.memset(dst, 0, size * count)
        _keep(best, f"{op}.{size}", _seconds(run))
        if op != "put":
            _check(
                int(ctypes.string_at(dst, size * count) != ctypes.string_at(src, size * count)), "read back other bytes"
            )
    _check(store.remove_all(True) < 0, "remove_all")
    keys = [f"b{size}-{rep}-{i}" for i in range(count)]
    groups = [range(lo, min(count, lo + batch)) for lo in range(0, count, batch)]

    def batch_put() -> None:
        for g in groups:
            _check(
                any(store.batch_put_from([keys[i] for i in g], [ptrs[i] for i in g], [size] * len(g))), "batch_put_from"
            )

    def batch_get() -> None:
        for g in groups:
            got = store.batch_get_into([keys[i] for i in g], [outs[i] for i in g], [size] * len(g))
            _check(sum(got) - size * len(g), "batch_get_into")

    _keep(best, f"batch_put.{size}", _seconds(batch_put))
    ctypes.memset(dst, 0, size * count)
    _keep(best, f"batch_get.{size}", _seconds(batch_get))
    _check(
        int(ctypes.string_at(dst, size * count) != ctypes.string_at(src, size * count)), "read back other bytes (batch)"
    )
    _check(store.remove_all(True) < 0, "remove_all")


def _keep(best: dict[str, float], name: str, seconds: float) -> None:
    best[name] = min(best.get(name, float("inf")), seconds)


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _check(failed, what: str) -> None:
    if failed:
        raise RuntimeError(f"{what} failed ({failed})")


# The stores under test -----------------------------------------------------------------------------


def mooncake_master() -> Path | None:
    master = Path(sys.executable).with_name("mooncake_master")
    return master if master.exists() and shutil.which("unshare") and shutil.which("ip") else None


class MooncakeSide:
    """Mooncake Store here (inside the namespace): its master, a client process contributing the
    memory, and this process's client, which contributes none, so every byte crosses between the two
    processes."""

    def __init__(self, segment: int, logs: Path) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master = subprocess.Popen(
            [str(mooncake_master()), "--rpc_port", str(MOONCAKE_PORT), "--enable_http_metadata_server=false"],
            stdout=open(logs / "mooncake-master.log", "w"),
            stderr=subprocess.STDOUT,
        )
        address = f"127.0.0.1:{MOONCAKE_PORT}"
        self.holder = None
        try:
            time.sleep(1.5)
            self.holder = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from mooncake.store import MooncakeDistributedStore as S; "
                    f"s = S(); print(s.setup('127.0.0.1', 'P2PHANDSHAKE', {segment}, 16 << 20, 'tcp', '', '{address}'), "
                    "flush=True); sys.stdin.read()",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            if self.holder.stdout is None or self.holder.stdout.readline().strip() != b"0":
                raise RuntimeError("the Mooncake segment holder did not start")
            self.store = MooncakeDistributedStore()
            if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", address) != 0:
                raise RuntimeError("the Mooncake client did not start")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()
        if self.holder is not None:
            if self.holder.stdin is not None:
                self.holder.stdin.close()
            self.holder.wait(30)
        self.master.kill()
        self.master.wait(30)


class TiercakeSide:
    """A conductor and a node agent (``Peer``, which also serves the raw socket), and two clients of
    ``transports`` each (the second for ``get_cold``)."""

    def __init__(self, pool_bytes: int, logs: Path) -> None:
        self.token = secrets.token_hex(16)
        self.conductor = Child(
            "conductor",
            ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"],
            {**os.environ, "TIERCAKE_TOKEN": self.token},
            logs,
        )
        try:
            self.url = self.conductor.wait_announce(60)["url"]
            self.peer = Peer(pool_bytes=pool_bytes, conductor=self.url, token=self.token)
        except BaseException:
            self.conductor.stop()
            raise
        self.clients: dict[str, tuple] = {}

    def connect(self, name: str, transports: tuple[str, ...]) -> tuple:
        from tiercake.kvstore import DistributedStore

        store, cold = DistributedStore(), DistributedStore()
        for client in (store, cold):
            if client.setup(self.url, secret=self.peer.secret, token=self.token, transports=transports) != 0:
                raise RuntimeError("the kvstore client could not connect")
        deadline = time.monotonic() + 15
        while not all(c.ready() for c in (store, cold)):  # the agent registers after it prints its
            if time.monotonic() > deadline:  # address, and owns the slots after that
                raise RuntimeError("the node agent did not join the bench's conductor")
            time.sleep(0.1)
        self.clients[name] = (store, cold)
        return store, cold

    def close(self) -> None:
        for store, cold in self.clients.values():
            store.close()
            cold.close()
        self.peer.close()
        self.conductor.stop()


def warm_up(store, buffers: Buffers, cold=None) -> None:
    """A put and a get of each client before timing: connections made, the pool mapped."""
    _check(store.put_from("warm-up", buffers.src, 1 << 20), "put_from (warm-up)")
    for client in (store, cold) if cold is not None else (store,):
        _check(client.get_into("warm-up", buffers.dst, 1 << 20) < 0, "get_into (warm-up)")
    _check(store.remove_all(True) < 0, "remove_all")


def raw_limits(peer: Peer, sizes: list[tuple[int, int, int]], limits: dict) -> None:
    """The raw socket's best seconds for each size's bytes, both ways, into ``limits``."""
    for size, count, _ in sizes:
        rows = _warm(min(count, max(2, (64 * MiB) // size)), size)
        for op, way in (("get", b"R"), ("put", b"W")):
            _keep(limits, f"{op}.{size}", _raw_seconds(peer.address["raw_port"], way, size * count, rows))


# The run -----------------------------------------------------------------------------------------


def measure_all(quick: bool, load: int, with_mooncake: bool) -> dict:
    """Every store's best seconds, interleaved repetition by repetition, and the raw limits."""
    sizes = plan(quick)
    reps = 2 if quick else 4
    logs = Path(tempfile.mkdtemp(prefix="tiercake-bench-store-api-"))
    segment = 2 * max(s * n for s, n, _ in sizes) + 64 * MiB
    buffers = Buffers(sizes)
    tiercake = TiercakeSide(segment, logs)
    mooncake = None
    spinning: list[subprocess.Popen] = []
    runs: dict[str, dict[str, float]] = {}
    limits: dict[str, float] = {}
    try:
        sides = {
            name: tiercake.connect(name, transports)
            for name, transports in (("tiercake.tcp", ("tcp",)), ("tiercake.shm", ("shm", "tcp")))
        }
        if with_mooncake:
            mooncake = MooncakeSide(segment, logs)
            sides["mooncake.tcp"] = (mooncake.store, None)
        for store, cold in sides.values():
            buffers.register(*(c for c in (store, cold) if c is not None))
            warm_up(store, buffers, cold)
        spinning = spinners(load)
        order = list(sides)
        for rep in range(reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                store, cold = sides[name]
                measure(store, sizes, rep, buffers, runs.setdefault(name, {}), cold=cold)
            raw_limits(tiercake.peer, sizes, limits)
    finally:
        for proc in spinning:
            proc.kill()
            proc.wait()
        if mooncake is not None:
            mooncake.close()
        tiercake.close()
        shutil.rmtree(logs, ignore_errors=True)
    return {"sizes": sizes, "runs": runs, "limits": limits, "load": load, "reps": reps}


def _in_namespace(quick: bool, load: int) -> dict | None:
    """``measure_all`` with Mooncake, in a network namespace of its own; None if it cannot run."""
    return in_namespace("tiercake.bench.store_api inner", {"quick": quick, "load": load}, INSIDE)


def in_namespace(module: str, args: dict, inside_env: str, timeout: float = 1800) -> dict | None:
    """``python -m module 'ARGS'`` (``args`` as JSON) in a network namespace of its own, loopback up
    (Mooncake's master binds every address; nothing of it reaches the network), with ``inside_env``
    set; its last line of output read as JSON. None when it cannot run (its stderr's tail printed)."""
    inner = f"ip link set lo up && exec {sys.executable} -m {module} '{json.dumps(args)}'"
    try:
        done = subprocess.run(
            ["unshare", "-n", "bash", "-c", inner],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, inside_env: "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        sys.stderr.write(f"{module}: the run in a network namespace did not finish: {exc}\n")
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        return None
    return json.loads(lines[-1])


async def run(quick: bool = False, load: int = 0) -> Report:
    if load < 0:
        raise ValueError("load is a number of spinning processes, 0 or more")
    got = await asyncio.to_thread(_in_namespace, quick, load) if mooncake_master() is not None else None
    with_mooncake = got is not None
    if got is None:  # no Mooncake here: tiercake alone
        got = await asyncio.to_thread(measure_all, quick, load, False)
    return report_of(got, with_mooncake)


def report_of(got: dict, with_mooncake: bool) -> Report:
    report = Report(bench="store-api", machine=machine())
    runs, limits = got["runs"], got["limits"]
    for size, count, batch in got["sizes"]:
        nbytes = size * count
        for op in OPS:
            limit = nbytes / limits[f"{'put' if 'put' in op else 'get'}.{size}"] / 1e9
            params = {
                "object_bytes": size,
                "objects": count,
                "batch": batch if op.startswith("batch") else 1,
                "load": got["load"],
                "limit_name": "raw socket",
            }
            for name, seconds in runs.items():
                if f"{op}.{size}" in seconds:
                    report.add(f"{name}.{op}", nbytes / seconds[f"{op}.{size}"] / 1e9, "GB/s", limit, **params)
            if with_mooncake:
                # get_cold (a reader that never saw the objects) against Mooncake's get, which never knows
                theirs = runs["mooncake.tcp"][f"{'get' if op == 'get_cold' else op}.{size}"]
                for name in ("tiercake.tcp", "tiercake.shm"):
                    report.add(
                        f"vs_mooncake.{name.split('.')[1]}.{op}",
                        nbytes / runs[name][f"{op}.{size}"] / 1e9,
                        "GB/s",
                        nbytes / theirs / 1e9,
                        **{**params, "limit_name": "Mooncake Store, same run"},
                    )
    report.machine["mooncake"] = "measured, interleaved" if with_mooncake else "absent (no package, or no unshare)"
    report.machine["load"] = got["load"]
    report.machine["repetitions"] = got["reps"]
    report.machine["loadavg"] = list(os.getloadavg())
    return report


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "inner":
    args = json.loads(sys.argv[2])
    print(json.dumps(measure_all(args["quick"], args["load"], True)), flush=True)
