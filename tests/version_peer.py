"""A transfer client or server for the version tests, written against the API both releases share.

``version_peer.py serve SECRET``: a node with a 16 MiB pool behind a transfer server; prints
``{"port", "version"}`` and serves until stdin closes.
``version_peer.py client SECRET PORT N TRANSPORTS``: writes N blocks of 64 KiB to that server over
TRANSPORTS (``tcp``, ``shm,tcp``), reads them back and prints ``{"version", "written", "read_back",
"errors"}`` (read_back: blocks whose bytes came back equal).
``version_peer.py version``: the protocol version this release speaks.
"""

import asyncio
import json
import os
import sys
import uuid

import torch

from tiercake.tiers import PoolTier, Tier, TieredStore
from tiercake.tiers.pool import PoolRegion
from tiercake.transfer import TransferEngine, TransferServer
from tiercake.transfer import protocol as p

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


async def serve(secret: bytes) -> None:
    suite = os.environ.get("TIERCAKE_TEST_SUITE", "peer")  # the suite's mark (tests/paths.py), inherited
    path = f"/dev/shm/tiercake-{suite}-version-peer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = await TieredStore([Tier(PoolTier(PoolRegion.create(path, 16 << 20)))]).open()
    server = await TransferServer(store, secret, "peer-node").start()
    print(json.dumps({"port": server.address[1], "version": p.VERSION}), flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
    finally:
        await server.close()
        await store.close()
        if os.path.exists(path):
            os.unlink(path)


async def client(secret: bytes, port: int, n: int, transports: tuple[str, ...]) -> None:
    engine = TransferEngine("peer-client", secret, transports=transports)
    engine.add_peer("node", "127.0.0.1", port)
    keys = [f"version-peer-{i}".encode().ljust(32, b".") for i in range(n)]
    written = await engine.write_blocks("node", keys, [block(i) for i in range(n)])
    dsts = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(n)]
    read = await engine.read_blocks("node", keys, dsts)
    back = sum(r.ok and torch.equal(d, block(i)) for i, (r, d) in enumerate(zip(read, dsts)))
    errors = sorted({str(r.error) for r in written + read if r.error is not None})
    print(
        json.dumps({"version": p.VERSION, "written": sum(r.ok for r in written), "read_back": back, "errors": errors}),
        flush=True,
    )
    await engine.close()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "version":
        print(p.VERSION)
    elif role == "serve":
        asyncio.run(serve(sys.argv[2].encode()))
    else:
        asyncio.run(client(sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4]), tuple(sys.argv[5].split(","))))
