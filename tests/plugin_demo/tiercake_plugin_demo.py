"""A third-party package's plug-ins, as docs/ARCHITECTURE.md tells an author to write them: a memory
tier backend (fixed-size slots in one host buffer), two transports (TCP that counts its reads; one
whose bytes take their own path, files in a spool directory, with its half in the transfer server),
an eviction policy and a router. Installed for the
tests as a distribution with entry points (``tiercake_plugin_demo-0.1.dist-info``), so tiercake finds
them the way it finds any package's."""

from pathlib import Path

import numpy as np

from tiercake.policies import BlockMeta, EvictionPolicy, Router
from tiercake.tiers.backend import MemoryTierBackend
from tiercake.tiers.buffers import copy_into, host_bytes, size_of
from tiercake.transfer import protocol as p
from tiercake.transfer.connection import check_count, item_error, write_results
from tiercake.transfer.paths import DataPath, receive_targets
from tiercake.transfer.sockio import recv_frame, send_frame
from tiercake.transfer.transports import TcpTransport


class SlotTier(MemoryTierBackend):
    kind = "slots"
    rank = 1  # as fast as the pool: between gpu and ssd

    @classmethod
    def validate_config(cls, cfg) -> None:
        if int(cfg.options.get("slot_bytes", 0)) <= 0:
            raise ValueError("a slots tier needs options.slot_bytes")

    @classmethod
    def from_config(cls, cfg, layout):
        return cls(int(cfg.capacity), int(cfg.options["slot_bytes"]), name=cfg.tier_name)

    def __init__(self, capacity: int, slot_bytes: int, name: str = "slots") -> None:
        self.name = name
        self.slot_bytes = slot_bytes
        self.buffer = np.zeros(capacity // slot_bytes * slot_bytes, dtype=np.uint8)
        self.free = list(range(capacity // slot_bytes))

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.size

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - len(self.free) * self.slot_bytes

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.slot_bytes

    def allocate(self, nbytes: int):
        return self.free.pop() if self.free else None

    def view(self, slot, nbytes: int) -> np.ndarray:
        return self.buffer[slot * self.slot_bytes : slot * self.slot_bytes + nbytes]

    def host_array(self, slot, nbytes: int):
        return self.view(slot, nbytes)

    def in_use(self, slot) -> bool:
        return False

    async def release(self, slot) -> None:
        self.free.append(slot)

    def close(self) -> None:
        pass


class CountingTransport(TcpTransport):
    name = "counting"
    reads = 0

    async def read(self, peer, items):
        CountingTransport.reads += len(items)
        return await super().read(peer, items)


FLAG_SPOOL = 8  # the request flag bit this plug-in's data path answers to


def _spooled(request: int, index: int) -> Path:
    return SpoolTransport.spool / f"{request}-{index}"


class SpoolPath(DataPath):
    """The server's half: read bytes are written to spool files before the table goes out; written
    bytes are taken from spool files once the writer says WRITE_COMMIT."""

    flag = FLAG_SPOOL
    served = 0

    async def send(self, request, flags, table, data):
        for index, view in data:
            _spooled(request, index).write_bytes(view.tobytes())
        SpoolPath.served += len(data)
        await send_frame(self.conn, p.Op.READ_REPLY, request, table, flags)

    async def receive(self, request, accepted):
        await recv_frame(self.conn, expect=[p.Op.WRITE_COMMIT])
        targets, staged = receive_targets([handle for _, handle in accepted])
        for (index, _), target in zip(accepted, targets):
            path = _spooled(request, index)
            target[:] = np.frombuffer(path.read_bytes(), dtype=np.uint8)
            path.unlink()
        for handle, host in staged:
            copy_into(handle.buffer, host)
        SpoolPath.served += len(accepted)


class SpoolTransport(TcpTransport):
    """The client's half: tables over the peer's stream, bytes through files in ``spool``."""

    name = "spool"
    server_path = SpoolPath
    spool = Path("/tmp")

    async def read(self, peer, items):
        async with peer.channel.connection() as conn, conn._request() as request:
            table = p.encode_read([(it.key, size_of(it.dst)) for it in items])
            await send_frame(conn.sock, p.Op.READ, request, table, FLAG_SPOOL)
            replies = p.decode_read_reply(await conn._reply(request, p.Op.READ_REPLY))
            check_count(replies, items)
        results = []
        for index, (it, reply) in enumerate(zip(items, replies)):
            if reply.status is not p.Status.OK:
                results.append(item_error(reply, peer.node_id))
                continue
            path = _spooled(request, index)
            copy_into(it.dst, np.frombuffer(path.read_bytes(), dtype=np.uint8))
            path.unlink()
            it.seal = reply.seal  # what the holder keeps with the block: a reader of KV checks it
            results.append(None)
        return results

    async def write(self, peer, items):
        async with peer.channel.connection() as conn, conn._request() as request:
            table = p.encode_write([it.item(size_of(it.src)) for it in items])
            await send_frame(conn.sock, p.Op.WRITE, request, table, FLAG_SPOOL)
            ready = p.decode_lease_reply(await conn._reply(request, p.Op.WRITE_READY))
            check_count(ready, items)
            for index, (it, reply) in enumerate(zip(items, ready)):
                if reply.status is p.Status.OK:
                    _spooled(request, index).write_bytes(host_bytes(it.src).tobytes())
            await send_frame(conn.sock, p.Op.WRITE_COMMIT, request)
            done = p.decode_statuses(await conn._reply(request, p.Op.WRITE_DONE))
        return write_results(ready, done, peer.node_id)


class NewestFirst(EvictionPolicy):
    """Evicts the most recently inserted block first (a stack)."""

    name = "newest_first"

    def __init__(self) -> None:
        self.order: dict = {}  # insertion order

    def on_insert(self, key, meta=BlockMeta()) -> None:
        self.order.pop(key, None)
        self.order[key] = None

    def on_access(self, key) -> None:
        pass

    def on_remove(self, key) -> None:
        self.order.pop(key, None)

    def victims(self, n, can_evict=lambda _: True):
        chosen = [k for k in reversed(self.order) if can_evict(k)][:n]
        for key in chosen:
            del self.order[key]  # the caller evicts them: no longer resident for us
        return chosen

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key) -> bool:
        return key in self.order


class AlphabeticalRouter(Router):
    """Always the first worker by name; decode too (the default ``choose_decode`` would balance)."""

    name = "alphabetical"

    def choose(self, workers, request):
        return self.predict(min(workers, key=lambda w: w.worker), request, pull_ratio=None)

    def choose_decode(self, workers, request):
        return self.choose(workers, request)
