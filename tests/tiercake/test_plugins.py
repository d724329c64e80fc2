"""Tier backends and transports from outside the package: a distribution with entry points (as a
third-party package would ship them) is found by name, validated in the configuration, built into a
store and chosen by the transfer engine, with no change to tiercake."""

import pytest
import torch
from paths import TESTS
from pydantic import ValidationError
from transfer_helpers import SECRET, payload, start_node, stop_node

from tiercake.config import StoreConfig, TierConfig, TransferConfig
from tiercake.plugins import TIER_BACKENDS, TRANSPORTS
from tiercake.tiers.build import build_store
from tiercake.transfer import ProtocolError, TransferEngine
from tiercake.transfer.protocol import Op, encode_read
from tiercake.transfer.sockio import send_frame

DEMO = TESTS / "plugin_demo"


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


def test_a_built_in_kind_is_checked_by_its_light_spec_which_its_backend_inherits_and_a_replacement_by_itself(
    monkeypatch,
):
    from tiercake.tiers.kinds import TierKind

    for name in ("gpu", "pool", "ssd"):
        spec, backend = TIER_BACKENDS.spec(name), TIER_BACKENDS.resolve(name)
        assert spec.kind == name and spec is not backend and issubclass(backend, spec)
    assert issubclass(TIER_BACKENDS.resolve("gpu"), TierKind)

    class Refusing(TierKind):
        kind, rank, in_memory = "gpu", 0, True

        @classmethod
        def validate_config(cls, cfg) -> None:
            raise ValueError("this gpu tier takes no settings")

    for table in ("_paths", "_specs", "_loaded"):  # the registry as it was, after the test
        monkeypatch.setattr(TIER_BACKENDS, table, dict(getattr(TIER_BACKENDS, table)))
    TierConfig(kind="gpu", capacity="1MiB")
    TIER_BACKENDS.register("gpu", Refusing)
    assert TIER_BACKENDS.spec("gpu") is Refusing
    with pytest.raises(ValidationError, match="takes no settings"):
        TierConfig(kind="gpu", capacity="1MiB")


async def test_a_plug_in_memory_tier_serves_and_spills_to_ssd(installed, tmp_path):
    config = StoreConfig(
        layout=None,
        tiers=[
            TierConfig(kind="slots", capacity="256KiB", options={"slot_bytes": 64 << 10}),
            TierConfig(kind="ssd", capacity="16MiB", path=str(tmp_path / "ssd")),
        ],
    )
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
            assert torch.equal(torch.from_numpy(await store.get(key)), data)
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


async def test_a_plug_in_transport_brings_its_own_server_data_path(installed, tmp_path):
    """A transport whose bytes travel outside the stream (files in a spool directory) declares its
    server half; a transfer server started after the plug-in is installed serves it, with no change
    to tiercake: blocks written and read back through it, nothing left in the spool."""
    cls = TRANSPORTS.resolve("spool")
    cls.spool = tmp_path
    store, server = await start_node("node-s")
    try:
        engine = TransferEngine("client", SECRET, transports=("spool",))
        engine.add_peer("node-s", *server.address)
        keys, srcs = [bytes([i]) * 32 for i in range(3)], [payload(i, 8192 + i) for i in range(3)]
        wrote = await engine.write_blocks("node-s", keys, srcs)
        assert all(r.ok and r.transport == "spool" for r in wrote)
        for key, src in zip(keys, srcs):
            assert torch.equal(torch.from_numpy(await store.get(key)), src)
        dsts = [torch.zeros(s.numel(), dtype=torch.uint8) for s in srcs]
        read = await engine.read_blocks("node-s", keys + [b"x" * 32], dsts + [torch.empty(4, dtype=torch.uint8)])
        assert [r.ok for r in read] == [True, True, True, False]
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        assert cls.server_path.served == 6 and not list(tmp_path.iterdir())
        await engine.close()
    finally:
        await stop_node(store, server)


async def test_a_server_refuses_a_data_path_it_does_not_have():
    """A request flag that no registered transport declares is refused whole, with its name."""
    store, server = await start_node("node-r")
    try:
        engine = TransferEngine("client", SECRET, transports=("tcp",))
        engine.add_peer("node-r", *server.address)
        peer = await engine._peer("node-r")
        async with peer.channel.connection() as conn:
            with pytest.raises(ProtocolError, match="no data path for request flags 0x40"):
                async with conn._request() as request:
                    await send_frame(conn.sock, Op.READ, request, encode_read([(b"k" * 32, 4)]), 0x40)
                    await conn._reply(request, Op.READ_REPLY)
        await engine.close()
    finally:
        await stop_node(store, server)


async def test_a_plug_in_eviction_policy_and_router_by_name(installed, tmp_path):
    from tiercake.policies import RouteRequest, WorkerState, create_router

    config = StoreConfig(
        layout=None,
        tiers=[
            TierConfig(
                kind="pool", capacity="256KiB", path=str(tmp_path / "pool"), eviction="newest_first", high_watermark=1.0
            ),
        ],
    )
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
