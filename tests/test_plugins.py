"""Tier backends and transports from outside the package: a distribution with entry points (as a
third-party package would ship them) is found by name, validated in the configuration, built into a
store and chosen by the transfer engine, with no change to tiercake."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transfer_helpers import SECRET, payload, start_node, stop_node

from tiercake.config import StoreConfig, TierConfig, TransferConfig
from tiercake.plugins import TIER_BACKENDS, TRANSPORTS
from tiercake.tiers.build import build_store
from tiercake.transfer import TransferEngine

DEMO = Path(__file__).parent / "plugin_demo"


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.syspath_prepend(str(DEMO))  # the dist-info and its module, as site-packages holds them
    yield


def test_names_come_from_entry_points_and_unknown_ones_are_refused(installed):
    assert "slots" in TIER_BACKENDS and "slots" in TIER_BACKENDS.names()
    assert "counting" in TRANSPORTS.names()
    with pytest.raises(ValidationError, match="unknown tier backend 'tape'.*slots"):
        TierConfig(kind="tape", capacity="1MiB")
    with pytest.raises(ValidationError, match="needs options.slot_bytes"):  # the plug-in's own check
        TierConfig(kind="slots", capacity="1MiB")
    with pytest.raises(ValidationError, match="unknown transports"):
        TransferConfig(transports=["carrier-pigeon"])
    assert TransferConfig(transports=["counting", "tcp"]).transports == ["counting", "tcp"]


async def test_a_plug_in_memory_tier_serves_and_spills_to_ssd(installed, tmp_path):
    config = StoreConfig(layout=None, tiers=[
        TierConfig(kind="slots", capacity="256KiB", options={"slot_bytes": 64 << 10}),
        TierConfig(kind="ssd", capacity="16MiB", path=str(tmp_path / "ssd")),
    ])
    with pytest.raises(ValidationError, match="fastest first"):  # ranked by the plug-in's ``rank``
        StoreConfig(layout=None, tiers=list(reversed(config.tiers)))
    store = await build_store(config).open()
    try:
        blocks = {bytes([i]) * 32: payload(i, 64 << 10) for i in range(6)}  # 6 blocks, 4 slots
        for key, data in blocks.items():
            await store.put(key, data)
        await store.drain()
        stats = store.stats()["tiers"]
        assert stats["slots"]["kind"] == "slots" and stats["slots"]["blocks"] <= 4
        assert stats["ssd"]["blocks"] >= 2  # evicted from the plug-in tier, spilled below
        for key, data in blocks.items():
            assert torch.equal(await store.get(key), data)
    finally:
        await store.close()


async def test_a_plug_in_transport_is_chosen_by_name(installed):
    cls = TRANSPORTS.resolve("counting")
    store, server = await start_node("node-p")
    try:
        await store.put(b"k" * 32, payload(1, 4096))
        engine = TransferEngine("reader", SECRET, transports=("counting",))
        engine.add_peer("node-p", *server.address)
        before = cls.reads
        (result,) = await engine.read_blocks("node-p", [b"k" * 32], [torch.empty(4096, dtype=torch.uint8)])
        assert result.ok and result.transport == "counting" and cls.reads == before + 1
        await engine.close()
    finally:
        await stop_node(store, server)


async def test_a_plug_in_eviction_policy_and_router_by_name(installed, tmp_path):
    from tiercake.policies import RouteRequest, WorkerState, create_router

    config = StoreConfig(layout=None, tiers=[
        TierConfig(kind="pool", capacity="256KiB", path=str(tmp_path / "pool"), eviction="newest_first",
                   high_watermark=1.0),
    ])
    store = await build_store(config).open()
    try:
        for i in range(5):  # four fit: the fifth evicts the newest (the fourth), as the plug-in says
            await store.put(bytes([i]) * 32, payload(i, 64 << 10))
        assert [store.contains(bytes([i]) * 32) for i in range(5)] == [True, True, True, False, True]
        assert store.stats()["tiers"]["pool"]["eviction"]["policy"] == "newest_first"
    finally:
        await store.close()
    router = create_router("alphabetical")
    workers = [WorkerState("w-b"), WorkerState("w-a", running=30)]
    request = RouteRequest(64, 16, 1024)
    assert router.choose(workers, request).worker == "w-a"
    assert router.choose_decode(workers, request).worker == "w-a"  # overridden: not by load
    assert create_router("ttft").choose_decode(workers, request).worker == "w-b"  # the default: by load
