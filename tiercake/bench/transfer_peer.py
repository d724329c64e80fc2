"""The far side of `tiercake bench transfer`: a node agent plus a raw blocking-socket stream server,
in one process, so the engine and its limit are measured between the same two processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys
import threading

import numpy as np

from tiercake.config import ConductorConfig, StoreConfig, TiercakeConfig, TierConfig, TransferConfig
from tiercake.heap import freeze_startup_heap
from tiercake.transfer import TransferServer, spin
from tiercake.transfer.ucx import available as ucx_available
from tiercake.workers.node.agent import NodeAgent

RAW_REQUEST = struct.Struct("<cQQ")  # b"R": send n bytes; b"W": receive n bytes; chunk size


def _serve_raw(listener: socket.socket, buffer: np.ndarray) -> None:
    view = buffer.data
    while True:
        conn, _ = listener.accept()
        with conn:
            while True:
                head = conn.recv(RAW_REQUEST.size, socket.MSG_WAITALL)
                if len(head) < RAW_REQUEST.size:
                    break
                op, n, chunk = RAW_REQUEST.unpack(head)
                chunk = min(chunk, len(view))
                slots = len(view) // chunk  # cycle over the whole buffer, as the engine's blocks do
                i = 0
                while n > 0:
                    step = min(n, chunk)
                    at = (i % slots) * chunk
                    if op == b"R":
                        conn.sendall(view[at : at + step])
                    else:
                        conn.recv_into(view[at : at + step], step, socket.MSG_WAITALL)
                    n -= step
                    i += 1
                if op == b"W":
                    conn.sendall(b"k")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool-bytes", type=int, required=True)
    parser.add_argument("--pool-path", required=True)
    parser.add_argument("--raw-buffer", type=int, default=256 << 20)
    parser.add_argument("--conductor", metavar="URL", help="join this conductor's cluster (a node agent of it)")
    parser.add_argument(
        "--tls",
        nargs=2,
        metavar=("CERT", "KEY"),
        help="also serve the same store on a TLS transfer port (announced as tls_port)",
    )
    args = parser.parse_args()
    config = TiercakeConfig(
        node_id="bench-peer",
        conductor=ConductorConfig(urls=[args.conductor] if args.conductor else [], member_ttl=2),
        store=StoreConfig(
            layout=None, tiers=[TierConfig(kind="pool", capacity=args.pool_bytes, path=args.pool_path, adopt=False)]
        ),  # a scratch pool: gone with the bench
        # the bench measures UCX too where it is installed: the agent serves it only when listed
        transfer=TransferConfig(transports=["local", "shm", "tcp", *(["ucx"] if ucx_available() else [])]),
    )
    agent = await NodeAgent(config).start()
    freeze_startup_heap()  # as a node agent's process does once started (``serve_forever``)
    assert agent.server is not None and agent.store is not None  # started
    listener = socket.create_server(("127.0.0.1", 0))
    buffer = np.ones(args.raw_buffer, dtype=np.uint8)  # touched: pre-faulted
    threading.Thread(target=_serve_raw, args=(listener, buffer), daemon=True).start()
    host, port = agent.server.address
    announce = {"host": host, "port": port, "raw_port": listener.getsockname()[1]}
    tls_server = None
    if args.tls:
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*args.tls)
        tls_server = await TransferServer(agent.store, config.transfer.secret(), config.node_id, tls=context).start()
        announce["tls_port"] = tls_server.address[1]
    print(json.dumps(announce), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
    if tls_server is not None:
        await tls_server.close()
    await agent.close()


if __name__ == "__main__":
    spin.run(main(), TransferConfig().spin_us / 1e6)  # the node agent's own loop
