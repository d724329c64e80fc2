"""Shared pieces of the transfer tests: servers on real loopback sockets, raw protocol clients."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch
from paths import shm_file

from tiercake.tiers import PoolBackend, PoolRegion, SsdFilesBackend, Tier, TieredStore
from tiercake.transfer import TransferServer
from tiercake.transfer import protocol as p

SECRET = b"cluster-secret-for-tests-0123456789"


def payload(i: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


async def start_node(node_id: str, pool_bytes: int = 8 << 20, ssd_dir: Path | None = None, **kw):
    path = str(shm_file(f"test-{node_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
    tiers = [Tier(PoolBackend(PoolRegion.create(path, pool_bytes)))]
    if ssd_dir is not None:
        tiers.append(Tier(SsdFilesBackend(ssd_dir, capacity_bytes=64 << 20)))
    store = await TieredStore(tiers).open()
    server = await TransferServer(store, SECRET, node_id, **kw).start()
    return store, server


async def stop_node(store, server) -> None:
    await server.close()
    await store.close()


def raw_frame(
    op: int,
    body: bytes = b"",
    request: int = 1,
    flags: int = 0,
    magic: bytes = p.MAGIC,
    version: int = p.VERSION,
    length: int | None = None,
) -> bytes:
    return p.FRAME.pack(magic, version, op, flags, request, len(body) if length is None else length) + body


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = _exactly(sock, p.FRAME.size)
    _, _, op, _, _, length = p.FRAME.unpack(head)
    return op, _exactly(sock, length)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def closed(sock: socket.socket) -> bool:
    """True when the server has closed the connection (EOF or reset), after any last frames."""
    sock.settimeout(5)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def authenticated_socket(address, secret: bytes = SECRET) -> socket.socket:
    """A blocking socket past the handshake, for speaking the protocol by hand."""
    sock = socket.create_connection(address, timeout=5)
    op, nonce = read_frame(sock)
    assert op == p.Op.HELLO
    mine = os.urandom(p.NONCE_BYTES)
    sock.sendall(raw_frame(p.Op.AUTH, mine + p.proof(secret, b"client", nonce, mine) + b"raw-client"))
    op, body = read_frame(sock)
    assert op == p.Op.WELCOME, body
    return sock
