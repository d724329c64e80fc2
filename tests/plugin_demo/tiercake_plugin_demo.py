"""A third-party package's plug-ins, as docs/ARCHITECTURE.md tells an author to write them: a memory
tier backend (fixed-size slots in one host buffer), a transport (TCP that counts its reads), an
eviction policy and a router. Installed for the
tests as a distribution with entry points (``tiercake_plugin_demo-0.1.dist-info``), so tiercake finds
them the way it finds any package's."""

import torch

from tiercake.policies import BlockMeta, EvictionPolicy, Router
from tiercake.tiers.backend import MemoryTierBackend
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
        self.buffer = torch.zeros(capacity // slot_bytes * slot_bytes, dtype=torch.uint8)
        self.free = list(range(capacity // slot_bytes))

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - len(self.free) * self.slot_bytes

    def accepts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.slot_bytes

    def allocate(self, nbytes: int):
        return self.free.pop() if self.free else None

    def view(self, slot, nbytes: int) -> torch.Tensor:
        return self.buffer[slot * self.slot_bytes: slot * self.slot_bytes + nbytes]

    def host_array(self, slot, nbytes: int):
        return self.view(slot, nbytes).numpy()

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
