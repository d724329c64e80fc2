"""The reference engine's calibration (workers/reference/engine.py): the prefill-time fit that the
router's predictions rest on."""

import asyncio

import torch

from tiercake.blocks import Namespace
from tiercake.tiers import GpuBackend, GpuBlockPool, Tier, TieredStore
from tiercake.workers.reference import engine
from tiercake.workers.reference.model import ModelConfig, ReferenceModel
from tiercake.workers.reference.runner import ModelRunner

MODEL = ModelConfig()
LAYOUT = MODEL.layout(16)
NS = Namespace(model_id="tiercake-reference", kv_layout=LAYOUT.tag, block_size=16)


async def test_workers_of_one_data_folder_share_one_calibration(tmp_path, monkeypatch):
    """Two workers starting together over one data folder (``up --workers 2``): one measures, the
    other waits and reads its fit, so the router sees two equal workers as equal (measured each
    beside the other, their fits differed by the machine's noise). A later start reads it too."""
    measured = []
    measure = engine._measure
    monkeypatch.setattr(engine, "_measure", lambda runner: measured.append(runner) or measure(runner))
    model, stores = ReferenceModel(MODEL), []
    try:
        runners = []
        for i in range(3):
            pool = GpuBlockPool(64, LAYOUT.shape, torch.float16, "cpu")
            stores.append(await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open())
            runners.append(ModelRunner(model, stores[-1], NS, worker_id=f"w{i}"))
        together = await asyncio.gather(*(asyncio.to_thread(engine.calibrate, r, tmp_path) for r in runners[:2]))
        assert together[0] == together[1] and len(measured) == 1
        assert engine.calibrate(runners[2], tmp_path) == together[0] and len(measured) == 1
        assert engine.calibrate(runners[2], None) != together[0] and len(measured) == 2  # no folder: measured
    finally:
        for store in stores:
            await store.close()


async def test_a_folder_that_refuses_locks_still_calibrates(tmp_path, monkeypatch, caplog):
    """Some network file systems answer ``flock`` with ENOLCK: the worker must still start (measuring
    without the lock, saying so), and its fit is still saved for the next start."""
    import errno
    import fcntl

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    measured = []
    measure = engine._measure
    monkeypatch.setattr(engine, "_measure", lambda runner: measured.append(runner) or measure(runner))
    pool = GpuBlockPool(64, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    try:
        runner = ModelRunner(ReferenceModel(MODEL), store, NS, worker_id="w0")
        first = engine.calibrate(runner, tmp_path)
        assert "not shared" in caplog.text and len(measured) == 1
        assert engine.calibrate(runner, tmp_path) == first and len(measured) == 1
        assert not list(tmp_path.glob("*.part"))
    finally:
        await store.close()
