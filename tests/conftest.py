from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from paths import shm_file

from tiercake.blocks import BlockLayout
from tiercake.policies import LRU
from tiercake.tiers import GpuBackend, GpuBlockPool, PoolBackend, PoolRegion, SsdFilesBackend, Tier, TieredStore
from tiercake.tiers.pool import remove_pool

pytest_plugins = ["process_guard", "shm_guard"]

# The node agents the tests start prove this to each other (a node agent of a cluster refuses to start
# without a node secret); clients never use it. Tests of what happens without one take it away.
os.environ.setdefault("TIERCAKE_NODE_SECRET", "the-suite-node-secret-" + uuid.uuid4().hex)


def pytest_configure(config):
    import process_guard

    process_guard.install()


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what will not run
def pytest_collection_modifyitems(config, items):
    """Files whose tests start processes first, the largest time budget (the sum of their tests'
    timeouts) first, then the rest in their order: ``make test`` hands whole files to its workers in
    this order (``--no-loadscope-reorder``). Ordered by their number of tests, as xdist does by default,
    the one-test chaos run (three minutes) was handed out late and kept one worker busy alone. Where
    no test that starts processes is selected (``make check``), the order stays as it is."""
    default = float(config.getini("timeout") or 0)
    budget: dict[Path, float] = {}
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            mark = item.get_closest_marker("timeout")
            budget[item.path] = budget.get(item.path, 0.0) + (float(mark.args[0]) if mark else default)
    items.sort(key=lambda item: -budget.get(item.path, 0.0))  # stable: a file's tests keep their order


LAYOUT = BlockLayout(layers=2, kv_heads=2, head_dim=16, block_size=16)  # 4 KiB blocks


@pytest.fixture
def shm_path():
    path = shm_file(f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield path
    remove_pool(path)


def block(i: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    """Deterministic, distinct KV-shaped content for block ``i``."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(layout.shape, generator=g).to(torch.float16)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


@pytest.fixture
def make_store(tmp_path, shm_path):
    """Build a three-tier store with capacities in blocks; closes everything it built."""
    built: list[TieredStore] = []

    async def make(
        gpu: int | None = 4,
        pool: int | None = 8,
        ssd: int | None = 64,
        ssd_dir: Path | None = None,
        policies: dict | None = None,
        admission: dict | None = None,
        **store_kwargs,
    ) -> TieredStore:
        policies = policies or {}
        admission = admission or {}
        nbytes = LAYOUT.nbytes
        tiers = []
        if gpu:
            pool_ = GpuBlockPool(gpu, LAYOUT.shape, torch.float16, "cpu")
            tiers.append(Tier(GpuBackend(pool_), policies.get("gpu", LRU()), admission.get("gpu")))
        if pool:
            region = PoolRegion.create(shm_path, pool * nbytes)
            tiers.append(Tier(PoolBackend(region), policies.get("pool", LRU()), admission.get("pool")))
        if ssd:
            backend = SsdFilesBackend(ssd_dir or tmp_path / "ssd", capacity_bytes=ssd * (nbytes + 512))
            tiers.append(Tier(backend, policies.get("ssd", LRU()), admission.get("ssd")))
        store = TieredStore(tiers, payload_nbytes=nbytes, payload_dtype=torch.float16, **store_kwargs)
        built.append(store)
        return await store.open()

    yield make
    for store in built:
        if not store._closed:
            for tier in store.tiers:
                tier.backend.close()


@pytest.fixture(params=["embedded", "etcd"])
async def meta(request):
    """Each metadata backend in turn: the tests that use it run against both (one conformance)."""
    from tiercake.conductor.embedded import EmbeddedBackend
    from tiercake.conductor.etcd import EtcdBackend

    if request.param == "etcd":
        backend = await EtcdBackend(request.getfixturevalue("etcd").endpoints).start()
    else:
        backend = await EmbeddedBackend().start()
    yield backend
    await backend.close()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One real single-member etcd for the session; tests keep to their own key prefixes."""
    from tiercake.conductor.etcd_process import EtcdCluster

    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield cluster
    cluster.stop()


class Processes:
    """``tiercake <args>`` processes that print their address as one JSON line. Their logs go to
    files (a pipe nobody reads would stall a chatty process); ``close`` kills what still runs."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, object]] = []

    def start(
        self, args: list[str], env: dict | None = None, prefix: list[str] = (), runner: list[str] | None = None
    ) -> tuple[subprocess.Popen, dict]:
        """``prefix``: what runs the command (``ip netns exec NS``, say); ``runner``: the command line of
        a ``tiercake`` other than this checkout's (the previous release, say)."""
        log = tempfile.TemporaryFile()
        runner = runner or [sys.executable, "-m", "tiercake.cli"]
        proc = subprocess.Popen(
            [*prefix, *runner, *args], stdout=subprocess.PIPE, stderr=log, env={**os.environ, **(env or {})}
        )
        self.procs.append((proc, log))
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise AssertionError(self.log_of(proc)[-3000:])
        return proc, json.loads(line)

    def log_of(self, proc: subprocess.Popen) -> str:
        for p, log in self.procs:
            if p is proc:
                log.seek(0)
                return log.read().decode(errors="replace")
        return ""

    def close(self) -> None:
        for proc, log in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            log.close()


@pytest.fixture
def processes():
    """A function that starts a ``Processes`` process: (process, its JSON line); all killed at the end."""
    group = Processes()
    yield group.start
    group.close()
