"""`tiercake bench transfer`: the transfer engine between two processes, against limits measured in
the same run between the same two processes.

- tcp: batches of blocks read from and written to a node agent in another process, over loopback,
  against a plain blocking-socket stream of the same bytes in the same block-sized calls;
- shm: the same through the shared pool (same host), against memcpy of the same bytes;
- tls (where the ``cryptography`` package can make a throwaway certificate): tcp inside TLS
  (``transfer.tls``) to a second, TLS, transfer port of the same peer, against the same raw stream;
- ucx (where ucxx is installed): the same with the bytes over UCX endpoints made from exchanged worker
  addresses without peer-failure handling, so UCX uses shared memory; against memcpy.

Figures: throughput per block size and batch size; per-batch latency (median) against the raw
stream's time for the same bytes; and at 64 KiB, the per-block overhead of a batch of 64 over the raw
stream's time per block; and ``seal.rate``, what sealing (or checking) a block costs against memcpy
of the same bytes (a KV writer seals every block it writes, a KV reader checks every one it loads).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from tiercake.blocks import seal_material, sealer_for
from tiercake.config import TlsConfig
from tiercake.devtls import self_signed
from tiercake.transfer import TransferEngine
from tiercake.transfer.ucx import available as ucx_available

from .report import Report, machine
from .store import KiB, MiB, _memcpy_seconds, _raise_first, _warm
from .transfer_peer import RAW_REQUEST

PEER = "bench-peer"


def _raw_seconds(port: int, op: bytes, total: int, rows: torch.Tensor) -> float:
    """A plain blocking-socket stream of ``total`` bytes, one ``recv_into``/``sendall`` per block,
    cycling over the same rows of warm memory the engine uses (b"R": the peer sends to us)."""
    chunk = rows.shape[1]
    views = [memoryview(row.numpy()) for row in rows]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(RAW_REQUEST.pack(op, total, chunk))
        left, i = total, 0
        while left > 0:
            view = views[i % len(views)][: min(left, chunk)]
            if op == b"R":
                sock.recv_into(view, len(view), socket.MSG_WAITALL)
            else:
                sock.sendall(view)
            left -= len(view)
            i += 1
        if op == b"W":
            sock.recv(1)
        return time.perf_counter() - start


class Peer:
    """A node agent and a raw socket server in another process (``conductor``: the agent joins it)."""

    def __init__(
        self,
        pool_bytes: int,
        conductor: str | None = None,
        token: str | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        """``tls``: (certificate, key): the peer also serves a TLS transfer port (``address["tls_port"]``)."""
        self.secret = secrets.token_hex(16).encode()
        self.pool_path = f"/dev/shm/tiercake-bench-peer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercake.bench.transfer_peer",
                "--pool-bytes",
                str(pool_bytes),
                "--pool-path",
                self.pool_path,
                *(["--conductor", conductor] if conductor else []),
                *(["--tls", str(tls[0]), str(tls[1])] if tls else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={
                **os.environ,
                "TIERCAKE_SECRET": self.secret.decode(),
                "TIERCAKE_NODE_SECRET": secrets.token_hex(24),  # its node agent's, for the replication plane
                **({"TIERCAKE_TOKEN": token} if token else {}),
            },
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None  # both piped above
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the bench peer process did not start")
        self.address = json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _measure(
    engine: TransferEngine,
    size: int,
    batch: int,
    nblocks: int,
    reps: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    tag: str,
) -> tuple[float, float, list[float]]:
    """(best write seconds, best read seconds, read latencies per batch) for nblocks blocks."""
    k = src.shape[0]
    best_write = best_read = float("inf")
    latencies: list[float] = []
    keys: list[bytes] = []
    for rep in range(reps):
        keys = [f"{tag}-{size}-{batch}-{rep}-{i}".encode() for i in range(nblocks)]
        start = time.perf_counter()
        for lo in range(0, nblocks, batch):
            chunk = range(lo, min(nblocks, lo + batch))
            done = await engine.write_blocks(PEER, [keys[i] for i in chunk], [src[i % k] for i in chunk])
            _raise_first([r.error for r in done if r.error is not None])
        best_write = min(best_write, time.perf_counter() - start)
        rep_latencies = []
        start = time.perf_counter()
        for lo in range(0, nblocks, batch):
            chunk = range(lo, min(nblocks, lo + batch))
            t0 = time.perf_counter()
            done = await engine.read_blocks(PEER, [keys[i] for i in chunk], [dst[i % k] for i in chunk])
            rep_latencies.append(time.perf_counter() - t0)
            _raise_first([r.error for r in done if r.error is not None])
        read_s = time.perf_counter() - start
        if read_s < best_read:
            best_read, latencies = read_s, rep_latencies
    if not torch.equal(dst[(nblocks - 1) % k], src[(nblocks - 1) % k]):
        raise RuntimeError("the bench read back other bytes than it wrote")
    return best_write, best_read, latencies


def _seal_seconds(src: torch.Tensor, nblocks: int) -> float:
    """Sealing ``nblocks`` blocks (a KV writer seals each, a KV reader checks each: the same work)."""
    sealer = sealer_for(seal_material(b"bench seal secret 0123"), "bench")
    rows = [row.numpy() for row in src]
    start = time.perf_counter()
    for i in range(nblocks):
        sealer.seal(i.to_bytes(8, "little"), rows[i % len(rows)])
    return time.perf_counter() - start


async def run(
    quick: bool = False, sizes: list[int] | None = None, batches: list[int] | None = None, streams: int = 2
) -> Report:
    report = Report(bench="transfer", machine=machine())
    sizes = sizes or (
        [64 * KiB, 1 * MiB, 16 * MiB] if quick else [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    )
    batches = batches or ([1, 64] if quick else [1, 4, 16, 64])
    total = (64 if quick else 256) * MiB
    reps = 2 if quick else 3
    certs = tempfile.TemporaryDirectory()
    tls = _certificate(Path(certs.name))
    peer = Peer(pool_bytes=3 * total + 64 * MiB, tls=tls)
    engines = _engines(peer, tls, streams)
    try:
        for size in sizes:
            nblocks = max(1, total // size)
            k = min(nblocks, max(2, (64 * MiB) // size))
            src, dst = _warm(k, size), _warm(k, size)
            nbytes = nblocks * size
            raw_read = min(
                [
                    await asyncio.to_thread(_raw_seconds, peer.address["raw_port"], b"R", nbytes, dst)
                    for _ in range(reps)
                ]
            )
            raw_write = min(
                [
                    await asyncio.to_thread(_raw_seconds, peer.address["raw_port"], b"W", nbytes, src)
                    for _ in range(reps)
                ]
            )
            area = _warm(min(nblocks, max(2, (256 * MiB) // size)), size)
            memcpy = min(_memcpy_seconds(src, area, area.shape[0]) for _ in range(reps)) * nblocks / area.shape[0]
            del area
            seal_s = min(_seal_seconds(src, nblocks) for _ in range(reps))
            report.add(
                "seal.rate",
                nbytes / seal_s / 1e9,
                "GB/s",
                nbytes / memcpy / 1e9,
                block_bytes=size,
                blocks=nblocks,
                limit_name="memcpy",
            )
            for name, engine in engines.items():
                for batch in batches:
                    if batch > nblocks or (name != "tcp" and batch not in (1, max(b for b in batches if b <= nblocks))):
                        continue
                    write_s, read_s, lat = await _measure(engine, size, batch, nblocks, reps, src, dst, name)
                    over_socket = name in ("tcp", "tls")
                    limits = (raw_write, raw_read) if over_socket else (memcpy, memcpy)
                    params = {"block_bytes": size, "batch": batch, "blocks": nblocks, "streams": streams}
                    _engine_figures(report, name, nbytes, (write_s, read_s, lat), limits, over_socket, params)
                    if name == "tcp" and size == 64 * KiB and batch == max(batches):
                        per_block = read_s / nblocks * 1e6
                        raw_block = raw_read / nblocks * 1e6
                        report.add(
                            "tcp.read.per_block",
                            per_block,
                            "us",
                            raw_block,
                            **params,
                            overhead_us=round(per_block - raw_block, 2),
                            limit_name="raw socket time",
                        )
    finally:
        for engine in engines.values():
            await engine.close()
        peer.close()
        certs.cleanup()
    return report


def _engines(peer: Peer, tls, streams: int) -> dict[str, TransferEngine]:
    """One engine per way to the peer: TCP, the shared pool, UCX where installed, TLS where it can be."""
    engines = {
        "tcp": TransferEngine("bench", peer.secret, transports=("tcp",), streams=streams),
        "shm": TransferEngine("bench", peer.secret, transports=("shm", "tcp"), streams=streams),
    }
    if ucx_available():  # same host: UCX's shared-memory transports, so memcpy is its limit
        engines["ucx"] = TransferEngine("bench", peer.secret, transports=("ucx",), streams=streams)
    if tls is not None:  # transfer.tls: TCP inside TLS, to the same store
        context = TlsConfig(ca_file=str(tls[0])).transfer_client_context()
        engines["tls"] = TransferEngine("bench", peer.secret, transports=("tcp",), streams=streams, tls=context)
    for name, engine in engines.items():
        engine.add_peer(PEER, peer.address["host"], peer.address["tls_port" if name == "tls" else "port"])
    return engines


def _engine_figures(report: Report, name: str, nbytes: int, measured, limits, over_socket: bool, params) -> None:
    """Write and read rates against the raw socket's (memcpy's, in place), and a batch's read latency."""
    write_s, read_s, lat = measured
    limit_name = "raw socket" if over_socket else "memcpy"
    report.add(
        f"{name}.write", nbytes / write_s / 1e9, "GB/s", nbytes / limits[0] / 1e9, **params, limit_name=limit_name
    )
    report.add(f"{name}.read", nbytes / read_s / 1e9, "GB/s", nbytes / limits[1] / 1e9, **params, limit_name=limit_name)
    raw_batch_us = limits[1] / params["blocks"] * min(params["batch"], params["blocks"]) * 1e6
    report.add(
        f"{name}.read.batch_latency_p50",
        statistics.median(lat) * 1e6,
        "us",
        raw_batch_us,
        **params,
        limit_name=f"{limit_name} time",
    )


def _certificate(directory: Path) -> tuple[Path, Path] | None:
    """A throwaway certificate for the TLS figures (None without the ``cryptography`` package)."""
    try:
        return self_signed(directory)
    except ImportError:  # cryptography is a dev dependency
        return None
