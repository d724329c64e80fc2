"""What ``bench hosts`` runs inside a lab host (``python -m tiercake.bench.hosts_probe``), so that
both sides of a measurement cross the same link: a raw TCP stream (``raw-serve`` on one host,
``raw-read`` on the other) and the store's own pull of 1 MiB objects (``pull``). Each prints one JSON
line; buffers are allocated once and reused, as the store's are.

- ``raw-serve PORT``: each connection is sent the byte count it asks for (8 bytes), then closed;
- ``raw-read HOST PORT BYTES``: one stream of BYTES; prints its seconds;
- ``pull NAMES_FILE``: the objects named (one per line) read with ``get_many_into``, 16 at a time;
  the conductors, secret and token from $TIERCAKE_BENCH_URLS, $TIERCAKE_SECRET, $TIERCAKE_TOKEN."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sys
import time

CHUNK = 4 << 20
OBJECT = 1 << 20
BATCH = 16


def raw_serve(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port))  # inside the host's own namespace only
    print(json.dumps({"listening": port}), flush=True)
    data = memoryview(bytearray(CHUNK))
    while True:
        conn, _ = server.accept()
        with conn:
            wanted = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))[0]
            while wanted:
                sent = conn.send(data[: min(CHUNK, wanted)])
                wanted -= sent


def raw_read(host: str, port: int, nbytes: int) -> None:
    buffer = memoryview(bytearray(CHUNK))
    started = time.perf_counter()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(struct.pack("!Q", nbytes))
        got = 0
        while got < nbytes:
            n = sock.recv_into(buffer)
            if not n:
                raise ConnectionError(f"the stream ended after {got} of {nbytes} bytes")
            got += n
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - started}), flush=True)


async def pull(names_file: str) -> None:
    from tiercake.kvstore import AsyncStore

    names = open(names_file).read().split()
    buffers = [bytearray(OBJECT) for _ in range(BATCH)]
    urls = os.environ["TIERCAKE_BENCH_URLS"].split(",")
    async with AsyncStore(urls, secret=os.environ["TIERCAKE_SECRET"], token=os.environ["TIERCAKE_TOKEN"]) as store:
        await store.get_many_into(names[:BATCH], buffers)  # connections made, the map fetched
        started, got = time.perf_counter(), 0
        for i in range(0, len(names), BATCH):
            for n in await store.get_many_into(names[i : i + BATCH], buffers):
                if isinstance(n, Exception):
                    raise n
                got += n
        print(json.dumps({"bytes": got, "seconds": time.perf_counter() - started}), flush=True)


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "raw-serve":
        raw_serve(int(args[0]))
    elif command == "raw-read":
        raw_read(args[0], int(args[1]), int(args[2]))
    elif command == "pull":
        asyncio.run(pull(args[0]))
    else:
        raise SystemExit(f"unknown probe {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
