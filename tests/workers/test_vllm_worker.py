"""The vLLM worker's parts that need no vLLM: its account of vLLM's prefix cache, and the clear errors
when the server it stands for is missing or is not running the TiercakeConnector. (Everything it does
with a real vLLM is in test_vllm.py.)"""

import asyncio
import os
import subprocess
import sys
import time

import pytest
from aiohttp import web

from tiercake.conductor.etcd_process import free_port
from tiercake.workers.vllm.engine import PrefixMirror, VllmEngine, VllmUnavailable, cache_salt


def test_the_mirror_reports_prompts_least_recently_used_out_first_within_vllms_blocks():
    mirror = PrefixMirror(capacity=3, block_bytes=64)
    changes = []
    mirror.listeners.append(lambda c: changes.append((c.key, c.added, c.tenant, c.tier, c.nbytes)))
    mirror.touch("t", [b"a", b"b"])
    mirror.touch("t", [b"a"])  # used again: now the newest
    mirror.touch("t", [b"c", b"d"])  # one over: the least recently used (b) leaves
    assert [(k, added) for k, added, *_ in changes] == [
        (b"a", True),
        (b"b", True),
        (b"c", True),
        (b"d", True),
        (b"b", False),
    ]
    assert all(c[2:] == ("t", "gpu", 64) for c in changes)
    assert sorted(c.key for c in mirror.holdings()) == [b"a", b"c", b"d"]
    mirror.touch("u", [b"a"])  # another tenant's block of the same key is another copy: (t, a) leaves
    assert sorted((c.tenant, c.key) for c in mirror.holdings()) == [("t", b"c"), ("t", b"d"), ("u", b"a")]


def test_the_cache_salt_given_to_vllm_is_valid_for_it_and_distinct_per_tenant():
    salts = {cache_salt(s) for s in ("alice@example.com", "bob/x", "a" * 500, "default")}
    assert len(salts) == 4 and all(len(s) <= 128 and not set(s) & set("@/\\") for s in salts)
    assert cache_salt("") is None


async def fake_openai_server(figures: dict | None):
    """An OpenAI server that answers every completion with one token and these connector figures."""

    async def models(_):
        return web.json_response({"data": [{"id": "m"}]})

    async def metrics(_):
        return web.Response(text='vllm:cache_config_info{num_gpu_blocks="100"} 1.0\n')

    async def completions(_):
        reply = {"choices": [{"text": "x", "token_ids": [5], "finish_reason": "length"}]}
        return web.json_response(reply | ({"kv_transfer_params": {"tiercake": figures}} if figures else {}))

    app = web.Application()
    app.add_routes(
        [web.get("/v1/models", models), web.get("/metrics", metrics), web.post("/v1/completions", completions)]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_a_server_without_the_connector_is_refused_by_name():
    """An OpenAI server that answers but is not a vLLM with the TiercakeConnector (no tiercake figures)."""
    runner = await fake_openai_server(None)
    try:
        port = runner.addresses[0][1]
        with pytest.raises(ValueError, match="does not run the TiercakeConnector"):
            await VllmEngine(f"http://127.0.0.1:{port}").start()
    finally:
        await runner.cleanup()


async def test_kv_events_that_never_come_are_a_clear_error_at_start(monkeypatch):
    """The connector says vLLM publishes its KV events, but none come (the endpoints are wrong)."""
    monkeypatch.setattr("tiercake.workers.vllm.engine.EVENTS_WAIT_S", 1.0)
    events = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": None, "topic": "tiercake"}
    runner = await fake_openai_server(
        {
            "namespace": {"model_id": "m", "kv_layout": "x", "block_size": 32},
            "block_bytes": 1024,
            "node": None,
            "kv_events": events,
        }
    )
    try:
        engine = VllmEngine(f"http://127.0.0.1:{runner.addresses[0][1]}")
        with pytest.raises(VllmUnavailable, match="publishes KV events at .* but none came within 1 s"):
            await engine.start()
        assert engine._events_task.done()  # the follower stopped with it
    finally:
        await runner.cleanup()


async def test_no_server_at_the_url_is_a_clear_error():
    with pytest.raises(VllmUnavailable, match="no vLLM OpenAI server at http://127.0.0.1:1"):
        await VllmEngine("http://127.0.0.1:1").start()
    started = time.monotonic()  # a sidecar waits for vLLM to come up, for as long as it was told
    with pytest.raises(VllmUnavailable, match="within 2 s"):
        await VllmEngine("http://127.0.0.1:1", wait_s=2).start()
    assert 2 <= time.monotonic() - started < 6


@pytest.mark.cluster
def test_the_worker_command_says_what_is_missing():
    env = {**os.environ, "TIERCAKE_TOKEN": "t", "COLUMNS": "200"}

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "tiercake.cli", "worker", "--engine", "vllm", *a],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    missing = run()
    assert missing.returncode == 2 and "--engine vllm needs --vllm-url" in missing.stderr
    gone = run("--vllm-url", "http://127.0.0.1:1")
    assert gone.returncode == 2 and "no vLLM OpenAI server at http://127.0.0.1:1" in gone.stderr
    assert "Traceback" not in gone.stderr


def test_the_routing_benchs_bound_and_prompts_come_from_the_trace_as_documented():
    from tiercake.bench.vllm import conversation_prompts, seen_before
    from tiercake.traces import TraceRecord

    a, b, c, d = ([i] * 4 for i in range(4))
    # the first prompt has nothing seen before; the second its first two blocks; the third its first
    assert seen_before([a + b, a + b + c, a + d], 4) == (0 + 8 + 4) / (8 + 12 + 8)
    records = [
        TraceRecord(timestamp=0, input_length=512 * n, output_length=1, hash_ids=ids)
        for n, ids in ((2, (0, 1)), (3, (0, 1, 2)), (2, (0, 5)), (1, (7,)))
    ]
    prompts = conversation_prompts(records, block=4)
    # the two turns sharing their first two blocks, each hash id a block of 4, then 3 tokens of its own
    assert [len(p) for p in prompts] == [2 * 4 + 3, 3 * 4 + 3] and prompts[1][:8] == prompts[0][:8]


async def test_a_prefill_hands_off_once_the_index_shows_its_blocks_and_no_later_than_the_bound(monkeypatch):
    """P/D: the prefill's answer names the node and the blocks the decode instance will load. It waits
    for the connector's background saves to be indexed (a real conductor here), and gives up at
    HANDOFF_WAIT_S with what the index shows by then."""
    import asyncio

    from conductor_helpers import running_conductor

    from tiercake.blocks import Namespace
    from tiercake.conductor.client import Client
    from tiercake.messages import GenerateRequest, KVSpace, MemberInfo
    from tiercake.workers.vllm import engine as engine_module

    async with running_conductor() as (url, _), Client([url]) as client:
        await client.register(MemberInfo(node_id="node-v", tiers={"pool": 1 << 30}), ttl=30)
        vllm = VllmEngine("http://127.0.0.1:1", client)  # never started: only its handoff is used
        vllm.node = "node-v"
        vllm.space = KVSpace(namespace=Namespace(model_id="m", kv_layout="L1", block_size=4), block_bytes=64)
        request = GenerateRequest(
            tokens=list(range(3, 3 + 4 * 6 + 2)), max_tokens=1, tenant="t", salt="s", handoff=True
        )
        keys = vllm._keys(request)
        assert len(keys) == 6

        async def saves_land(n: int, after: float) -> None:  # the connector's saves, indexed a bit later
            await asyncio.sleep(after)
            await client.report("t", "node-v", "pool", keys[:n], [64] * n)

        started = time.monotonic()
        _, handoff = await asyncio.gather(saves_land(6, 0.4), vllm._handoff(request))
        assert handoff.node == "node-v" and handoff.blocks == 6 and 0.4 <= time.monotonic() - started < 2

        monkeypatch.setattr(engine_module, "HANDOFF_WAIT_S", 0.5)
        other = request.model_copy(update={"salt": "another"})  # blocks nobody saved but two
        await client.report("t", "node-v", "pool", vllm._keys(other)[:2], [64] * 2)
        started = time.monotonic()
        handoff = await vllm._handoff(other)
        assert handoff.blocks == 2 and 0.5 <= time.monotonic() - started < 2


def test_session_changes_need_the_cluster_secret_and_say_so():
    """Without a transfer engine (no cluster secret) a vLLM worker cannot tell its node of the control
    API's session changes: NotImplementedError, which the worker answers as 501 naming the cause."""
    from tiercake.messages import SessionCommand, SessionDirective

    command = SessionCommand(session=SessionDirective(id="a" * 32, close=True), tenant="t")
    with pytest.raises(NotImplementedError, match="cluster secret"):
        VllmEngine("http://127.0.0.1:1").change_session(command)


def test_the_vllm_worker_gets_a_transfer_engine_only_with_the_secret(monkeypatch, tmp_path):
    from tiercake.cli.cluster import session_transfer
    from tiercake.config import TiercakeConfig

    config = TiercakeConfig.model_validate(
        {"node_id": "n", "store": {"tiers": [{"kind": "pool", "capacity": "1MiB", "path": str(tmp_path / "pool")}]}}
    )
    monkeypatch.delenv(config.transfer.secret_env, raising=False)
    assert session_transfer(config, "w") is None
    monkeypatch.setenv(config.transfer.secret_env, "s" * 32)
    engine = session_transfer(config, "w")
    assert engine is not None and engine.node_id == "w"
    asyncio.run(engine.close())
