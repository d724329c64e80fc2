"""A third-party package's plug-ins, as the docs tell an author to write them: a memory tier backend
(fixed-size slots in one host buffer) and a transport (TCP that counts its reads). Installed for the
tests as a distribution with entry points (``tiercake_plugin_demo-0.1.dist-info``), so tiercake finds
them the way it finds any package's."""

import torch

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
