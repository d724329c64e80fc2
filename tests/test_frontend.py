"""The front's routing decisions and refusals, on a real conductor and its HTTP app (workers are
registered members; no request reaches them when the front refuses)."""

import aiohttp
import pytest
from aiohttp import web

from tiercake.conductor.api import build_app
from tiercake.conductor.embedded import EmbeddedBackend
from tiercake.conductor.frontend import Frontend
from tiercake.conductor.membership import MemberInfo, Registration
from tiercake.conductor.service import Conductor
from tiercake.config import ServingConfig, TiercakeConfig, default_config

SLOW = {"prefill_a": 0.01, "prefill_b": 0.002, "prefill_q": 0.0, "decode_step_s": 0.01}


async def _front(serving: ServingConfig, members: list[MemberInfo]):
    meta = await EmbeddedBackend().start()
    conductor = await Conductor(meta, "c", ttl=1).start()
    config: TiercakeConfig = default_config().model_copy(update={"serving": serving})
    front = Frontend(conductor, config)
    runner = web.AppRunner(build_app(conductor, None, front))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    regs = [await Registration(meta, m, ttl=5).start() for m in members]
    await conductor.members.wait_for(lambda ms: len(ms.alive()) == len(members), 5)
    url = "http://%s:%d" % runner.addresses[0][:2]

    async def close():
        for reg in regs:
            await reg.stop()
        await runner.cleanup()
        await conductor.close()
        await meta.close()

    return url, front, close


def worker(name: str, role: str = "worker") -> MemberInfo:
    return MemberInfo(node_id=name, role=role, url="http://127.0.0.1:9", tiers={"gpu": 1 << 20}, perf=SLOW)


async def test_predicted_ttft_over_the_slo_is_a_429_with_the_reason():
    url, front, close = await _front(ServingConfig(slo_ttft_s=0.05), [worker("w1")])
    try:
        async with aiohttp.ClientSession() as http:
            # 200 tokens at 2 ms each: 0.41 s predicted, over the 0.05 s SLO
            body = {"model": "tiercake-reference", "prompt": "x" * 200, "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                assert resp.status == 429 and resp.headers["Retry-After"] == "1"
                assert data["error"]["code"] == "slo_ttft" and "exceeds the SLO" in data["error"]["message"]
            assert front.rejected == 1
            async with http.get(url + "/metrics") as resp:
                assert 'tiercake_completions_total{outcome="429"} 1.0' in await resp.text()
    finally:
        await close()


async def test_predicted_tbt_over_the_slo_is_a_429():
    url, _, close = await _front(ServingConfig(slo_tbt_s=0.001), [worker("w1")])
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiercake-reference", "prompt": "short", "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 429 and (await resp.json())["error"]["code"] == "slo_tbt"
    finally:
        await close()


async def test_no_live_worker_is_a_503_and_a_dead_one_is_skipped():
    url, front, close = await _front(ServingConfig(), [])
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_worker"
    finally:
        await close()
    # a registered worker that does not answer: tried, marked failed, and the request refused cleanly
    url, front, close = await _front(ServingConfig(), [worker("w-dead")])
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status in (502, 503), await resp.text()
        assert front.loads["w-dead"].failed_until > 0 and front.loads["w-dead"].running == 0
    finally:
        await close()


async def test_routing_sees_each_workers_own_prefix():
    from tiercake.blocks import block_keys

    url, front, close = await _front(ServingConfig(), [worker("w-a"), worker("w-b")])
    try:
        tokens = list(b"a shared system prompt, long enough for a few blocks of sixteen tokens")
        keys = block_keys(front.config.serving_namespace("default"), tokens)
        await front.conductor.report("default", keys, "w-b", "gpu", [1] * len(keys))
        chosen, decision = front.route(tokens, "default", ("worker",))
        assert chosen.node_id == "w-b" and decision.reused_blocks == len(keys) == 4
        assert not decision.pull  # its own gpu tier has it all: nothing to pull
    finally:
        await close()
