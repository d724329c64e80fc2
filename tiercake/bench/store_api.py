"""`tiercake bench store-api`: the key-value store API (``tiercake.kvstore``) between two processes,
against a raw socket and, where its package is installed, Mooncake Store, all in the same run.

The same code (``measure``, written against Mooncake's API) drives both stores: put_from and get_into
of one object at a time, and batch_put_from and batch_get_into, at 64 KiB, 1 MiB and 16 MiB, from
and into one registered buffer. tiercake's side is a conductor and a node agent (each a process of
its own) and this process as the client, over TCP and over the shared pool; Mooncake's is its master,
a client process that contributes the memory, and a client that only reads and writes, all in a
network namespace of their own (its master binds every address), over TCP. The limit of every figure
is a plain blocking-socket stream of the same bytes in the same object-sized calls, to the node
agent's process, measured in this run; ``vs_mooncake`` figures are tiercake over Mooncake.
``get_cold`` is the same reads by a second client that never saw the objects (against Mooncake's
``get``): with the object map, a client needs no lookup either way.
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

from .report import Report, machine
from .store import KiB, MiB, _warm
from .transfer import Peer, _raw_seconds

OPS = ("put", "get", "get_cold", "batch_put", "batch_get")
BATCH = {64 * KiB: 32, 1 * MiB: 8, 16 * MiB: 2}


def plan(quick: bool) -> list[tuple[int, int, int]]:
    """(object bytes, objects, objects per batch) per size."""
    total = (16 if quick else 64) * MiB
    return [(size, max(2, total // size), BATCH[size]) for size in (64 * KiB, 1 * MiB, 16 * MiB)]


def measure(store, sizes: list[tuple[int, int, int]], reps: int, cold=None) -> dict[str, float]:
    """Best seconds of each operation at each size, through Mooncake's API (``store`` is Mooncake's
    ``MooncakeDistributedStore`` or tiercake's ``DistributedStore``, set up). ``cold``: another client
    of the same store, which also reads every object one at a time (``get_cold``): a reader that
    never saw the objects, where ``store`` may remember where it put them."""
    span = max(size * count for size, count, _ in sizes)
    buf = (ctypes.c_ubyte * (2 * span))()
    ctypes.memmove(buf, os.urandom(span), span)  # touched: no page faults in the timed part
    ctypes.memset(ctypes.addressof(buf) + span, 0, span)
    src, dst = ctypes.addressof(buf), ctypes.addressof(buf) + span
    _check(store.register_buffer(src, 2 * span), "register_buffer")
    if cold is not None:
        _check(cold.register_buffer(src, 2 * span), "register_buffer (cold)")
    best: dict[str, float] = {}
    try:
        for size, count, batch in sizes:
            for rep in range(reps):
                keys = [f"o{size}-{rep}-{i}" for i in range(count)]
                ptrs = [src + i * size for i in range(count)]
                outs = [dst + i * size for i in range(count)]
                timed = {
                    "put": lambda: [_check(store.put_from(k, p, size), "put_from") for k, p in zip(keys, ptrs)],
                    "get": lambda: [_check(store.get_into(k, o, size) - size, "get_into") for k, o in zip(keys, outs)],
                }
                if cold is not None:
                    timed["get_cold"] = lambda: [_check(cold.get_into(k, o, size) - size, "get_into (cold)")
                                                 for k, o in zip(keys, outs)]
                for op, run in timed.items():
                    best[f"{op}.{size}"] = min(best.get(f"{op}.{size}", float("inf")), _seconds(run))
                    if op == "put":
                        continue
                    _check(int(ctypes.string_at(dst, size) != ctypes.string_at(src, size)), "read back other bytes")
                _check(store.remove_all(True) < 0, "remove_all")
                keys = [f"b{size}-{rep}-{i}" for i in range(count)]
                groups = [range(lo, min(count, lo + batch)) for lo in range(0, count, batch)]
                best[f"batch_put.{size}"] = min(best.get(f"batch_put.{size}", float("inf")), _seconds(lambda: [
                    _check(any(store.batch_put_from([keys[i] for i in g], [ptrs[i] for i in g], [size] * len(g))),
                           "batch_put_from") for g in groups]))
                best[f"batch_get.{size}"] = min(best.get(f"batch_get.{size}", float("inf")), _seconds(lambda: [
                    _check(sum(store.batch_get_into([keys[i] for i in g], [outs[i] for i in g], [size] * len(g)))
                           - size * len(g), "batch_get_into") for g in groups]))
                _check(store.remove_all(True) < 0, "remove_all")
    finally:
        store.unregister_buffer(src)
        if cold is not None:
            cold.unregister_buffer(src)
    return best


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _check(failed, what: str) -> None:
    if failed:
        raise RuntimeError(f"{what} failed ({failed})")


# Mooncake's side ----------------------------------------------------------------------------------

MOONCAKE_PORT = 50091


def mooncake_master() -> Path | None:
    master = Path(sys.executable).with_name("mooncake_master")
    return master if master.exists() and shutil.which("unshare") else None


def run_mooncake(sizes: list[tuple[int, int, int]], reps: int) -> dict[str, float] | None:
    """``measure`` on Mooncake Store, in a network namespace of its own; None if it cannot run here."""
    master = mooncake_master()
    if master is None:
        return None
    segment = 2 * max(size * count for size, count, _ in sizes) + 64 * MiB
    args = json.dumps({"sizes": sizes, "reps": reps, "segment": segment})
    inner = (f"ip link set lo up 2>/dev/null; {master} --rpc_port {MOONCAKE_PORT} --enable_http_metadata_server=false "
             f">/dev/null 2>&1 & sleep 1.5; {sys.executable} -m tiercake.bench.store_api mooncake '{args}'; "
             "rc=$?; kill %1; exit $rc")
    try:
        done = subprocess.run(["unshare", "-n", "bash", "-c", inner], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if done.returncode == 0 and lines else None


def _mooncake_main(args: dict) -> None:
    """Inside the namespace: a client contributing the memory (another process), then the measuring
    client, which contributes none, so every byte crosses between the two processes."""
    from mooncake.store import MooncakeDistributedStore

    master = f"127.0.0.1:{MOONCAKE_PORT}"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from mooncake.store import MooncakeDistributedStore as S; s = S(); "
         f"print(s.setup('127.0.0.1', 'P2PHANDSHAKE', {args['segment']}, 16 << 20, 'tcp', '', '{master}'), flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        if holder.stdout.readline().strip() != b"0":
            raise SystemExit("the Mooncake segment holder did not start")
        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) != 0:
            raise SystemExit("the Mooncake client did not start")
        print(json.dumps(measure(store, [tuple(s) for s in args["sizes"]], args["reps"])), flush=True)
        store.close()
    finally:
        holder.stdin.close()
        holder.wait(30)


# tiercake's side, and the figures -----------------------------------------------------------------

def _tiercake(url: str, secret: bytes, token: str, transports: tuple[str, ...], sizes, reps: int) -> dict[str, float]:
    from tiercake.kvstore import DistributedStore

    store, cold = DistributedStore(), DistributedStore()
    for client in (store, cold):
        if client.setup(url, secret=secret, token=token, transports=transports) != 0:
            raise RuntimeError("the kvstore client could not connect")
    try:
        deadline = time.monotonic() + 15
        while not all(c._store.members and c._store.map.chains for c in (store, cold)):  # the agent registers
            if time.monotonic() > deadline:  # after it prints its address, and owns the slots after that
                raise RuntimeError("the node agent did not join the bench's conductor")
            time.sleep(0.1)
            for client in (store, cold):
                client._run(lambda s: s.refresh())
        return measure(store, sizes, reps, cold=cold)
    finally:
        store.close()
        cold.close()


async def run(quick: bool = False) -> Report:
    report = Report(bench="store-api", machine=machine())
    sizes = plan(quick)
    reps = 1 if quick else 3
    token = secrets.token_hex(16)
    logs = Path(tempfile.mkdtemp(prefix="tiercake-bench-store-api-"))
    conductor = Child("conductor", ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"],
                      {**os.environ, "TIERCAKE_TOKEN": token}, logs)
    url = conductor.wait_announce(60)["url"]
    peer = Peer(pool_bytes=2 * max(s * n for s, n, _ in sizes) + 64 * MiB, conductor=url, token=token)
    try:
        runs = {
            name: await asyncio.to_thread(_tiercake, url, peer.secret, token, transports, sizes, reps)
            for name, transports in (("tiercake.tcp", ("tcp",)), ("tiercake.shm", ("shm", "tcp")))
        }
        limits = {}
        for size, count, _ in sizes:
            rows = _warm(min(count, max(2, (64 * MiB) // size)), size)
            nbytes = size * count
            limits[("get", size)] = min([await asyncio.to_thread(_raw_seconds, peer.address["raw_port"], b"R",
                                                                  nbytes, rows) for _ in range(max(2, reps))])
            limits[("put", size)] = min([await asyncio.to_thread(_raw_seconds, peer.address["raw_port"], b"W",
                                                                  nbytes, rows) for _ in range(max(2, reps))])
    finally:
        peer.close()
        conductor.stop()
        shutil.rmtree(logs, ignore_errors=True)
    mooncake = await asyncio.to_thread(run_mooncake, sizes, reps)
    if mooncake is not None:
        runs["mooncake.tcp"] = mooncake
    for size, count, batch in sizes:
        nbytes = size * count
        for op in OPS:
            limit = nbytes / limits[("put" if "put" in op else "get", size)] / 1e9
            params = {"object_bytes": size, "objects": count, "batch": batch if op.startswith("batch") else 1,
                      "limit_name": "raw socket"}
            for name, seconds in runs.items():
                if f"{op}.{size}" in seconds:
                    report.add(f"{name}.{op}", nbytes / seconds[f"{op}.{size}"] / 1e9, "GB/s", limit, **params)
            if mooncake is not None:
                # get_cold (a reader that never saw the objects) against Mooncake's get, which never knows
                theirs = mooncake[f"{'get' if op == 'get_cold' else op}.{size}"]
                for name in ("tiercake.tcp", "tiercake.shm"):
                    report.add(f"vs_mooncake.{name.split('.')[1]}.{op}", nbytes / runs[name][f"{op}.{size}"] / 1e9,
                               "GB/s", nbytes / theirs / 1e9, **{**params, "limit_name": "Mooncake Store, same run"})
    report.machine["mooncake"] = "measured" if mooncake is not None else "absent (no package, or no unshare)"
    return report


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "mooncake":
    _mooncake_main(json.loads(sys.argv[2]))
