"""A node's answer to a put of many objects (workers/node/objects/put.py), on a real pool store and
a socket pair: what the reader callback takes at once, and the loop's turns in a put the coroutine
takes."""

import asyncio
import contextlib
import socket
import time
import uuid

import numpy as np
import pytest
from paths import shm_file

from tiercake.blocks import object_id
from tiercake.config import StoreConfig, TierConfig
from tiercake.messages import ObjectMap
from tiercake.tiers.build import build_store
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import FLAG_EAGER, Op, Status
from tiercake.transfer.sockio import recv_frame
from tiercake.workers.node.objects import NodeObjects
from tiercake.workers.node.objects.batches import RUN

TENANT = "puts"


@pytest.fixture
async def node():
    path = shm_file(f"puts-{uuid.uuid4().hex[:8]}")
    store = await build_store(
        StoreConfig(layout=None, tiers=[TierConfig(kind="pool", capacity=64 << 20, path=str(path), adopt=False)])
    ).open()
    objects = NodeObjects("n1", store, b"s" * 32, None, ttl=5.0, pool_tier=store.tiers[0].name)
    objects.ownership.map = ObjectMap(epoch=1, chains=[["n1"] for _ in range(16)], ready=[1] * 16)
    objects.ownership.known_epoch = 1
    objects.ownership.lease_until = time.monotonic() + 3600  # the lease a keep-alive would give
    try:
        yield objects
    finally:
        await objects.close()
        await store.close()
        path.unlink(missing_ok=True)


def _no_deadline(nbytes: int):
    return contextlib.nullcontext()


def _request(n: int, size: int) -> w.PutRequest:
    return w.PutRequest(TENANT, 1, [w.PutItem(f"obj-{i}".encode(), size) for i in range(n)])


async def test_a_put_of_more_than_a_run_of_items_gives_the_loop_turns_and_stores_each(node):
    """Over ``RUN`` items, the reader callback declines the put before it changes anything, and the
    coroutine finishes it a run at a time, the loop getting its turn between runs (a keep-alive on
    the same loop must not wait for thousands of items); every item is stored and readable."""
    n, size = 3 * RUN + 5, 64
    req = _request(n, size)
    payload = np.arange(n * size, dtype=np.uint8)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    try:
        assert node.server.puts.now(ours, FLAG_EAGER, 7, req, _no_deadline) is False
        assert len(node.table) == 0  # declined before anything was staged
        turns = 0
        running = True

        async def ticker() -> None:
            nonlocal turns
            while running:
                turns += 1
                await asyncio.sleep(0)

        theirs.sendall(payload.tobytes())
        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = turns
        await node.server.puts.serve(ours, FLAG_EAGER, 7, req, _no_deadline)
        running = False
        await ticking
        assert turns - before >= 3  # a turn between runs (and the staging's own)
        op, _, request, body = await recv_frame(theirs, expect=[Op.OBJ_PUT_REPLY])
        reply = w.decode(w.PutReply, body)
        assert request == 7 and [r.status for r in reply.results] == [Status.OK] * n
        for i in (0, RUN, n - 1):
            stored = node.table.get(object_id(f"obj-{i}".encode(), TENANT))
            assert stored is not None and stored.size == size
    finally:
        ours.close()
        theirs.close()


async def test_a_run_of_items_is_answered_within_the_reader_callback(node):
    """Up to ``RUN`` items with their bytes on the stream: answered at once (no coroutine), each stored."""
    req = _request(RUN, 32)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    try:
        theirs.sendall(bytes(RUN * 32))
        assert node.server.puts.now(ours, FLAG_EAGER, 9, req, _no_deadline) is True
        _, _, request, body = await recv_frame(theirs, expect=[Op.OBJ_PUT_REPLY])
        assert request == 9 and all(r.status == Status.OK for r in w.decode(w.PutReply, body).results)
        assert len(node.table) == RUN
    finally:
        ours.close()
        theirs.close()
