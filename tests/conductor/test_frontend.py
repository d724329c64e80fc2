"""The front's routing decisions and refusals, on a real conductor and its HTTP app (workers are
registered members; no request reaches them when the front refuses)."""

import asyncio
import contextlib

import aiohttp
import pytest
from conductor_helpers import running_conductor

from tiercake.conductor.client import Client, ConductorError
from tiercake.conductor.front.frontend import Frontend, Job
from tiercake.conductor.membership import MemberInfo, Registration
from tiercake.config import ServingConfig, TiercakeConfig, default_config
from tiercake.messages import KVHandoff

SLOW = {"prefill_a": 0.01, "prefill_b": 0.002, "prefill_q": 0.0, "decode_step_s": 0.01}


@contextlib.asynccontextmanager
async def _front(serving: ServingConfig, members: list[MemberInfo]):
    config: TiercakeConfig = default_config().model_copy(update={"serving": serving})
    fronts = []

    def make(conductor):
        fronts.append(Frontend(conductor, config))
        return fronts[0]

    async with running_conductor(frontend=make) as (url, conductor):
        regs = [await Registration(conductor.meta, m, ttl=5).start() for m in members]
        await conductor.members.wait_for(lambda ms: len(ms.alive()) == len(members), 5)
        try:
            yield url, fronts[0]
        finally:
            for reg in regs:
                await reg.stop()


def worker(name: str, role: str = "worker") -> MemberInfo:
    return MemberInfo(node_id=name, role=role, url="http://127.0.0.1:9", tiers={"gpu": 1 << 20}, perf=SLOW)


async def fake_worker(generate) -> tuple:
    """A worker's /generate answered by ``generate``, on a real port: (its runner, its URL)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_predicted_ttft_over_the_slo_is_a_429_with_the_reason():
    async with _front(ServingConfig(slo_ttft_s=0.05), [worker("w1")]) as (url, front):
        async with aiohttp.ClientSession() as http:
            # 200 tokens at 2 ms each: 0.41 s predicted, over the 0.05 s SLO
            body = {"model": "tiercake-reference", "prompt": "x" * 200, "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                assert resp.status == 429 and resp.headers["Retry-After"] == "1"
                assert data["error"]["code"] == "slo_ttft" and "exceeds the SLO" in data["error"]["message"]
            assert front.stats.rejected == 1
            async with http.get(url + "/metrics") as resp:
                assert 'tiercake_completions_total{outcome="429"} 1.0' in await resp.text()


async def test_predicted_tbt_over_the_slo_is_a_429():
    async with _front(ServingConfig(slo_tbt_s=0.001), [worker("w1")]) as (url, _):
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiercake-reference", "prompt": "short", "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 429 and (await resp.json())["error"]["code"] == "slo_tbt"


async def test_no_live_worker_is_a_503_and_a_dead_one_is_skipped():
    body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 2}
    async with _front(ServingConfig(), []) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_worker"
    # a registered worker that does not answer: tried, marked failed, and the request refused cleanly
    async with _front(ServingConfig(), [worker("w-dead")]) as (url, front):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status in (502, 503), await resp.text()
        assert front.dispatcher.loads["w-dead"].failed_until > 0 and front.dispatcher.loads["w-dead"].running == 0


async def test_a_request_that_fails_on_live_workers_fails_alone_and_sidelines_none():
    """A worker that answers a request with its own server error is up: the request goes to one more
    worker, then fails with a 500 of its own; neither worker is skipped for the others' requests
    (one client's poisoned request once turned every worker away from everyone for seconds)."""
    from aiohttp import web

    async def failing(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "this request broke me", "type": "server_error"}}, status=500)

    runner, url = await fake_worker(failing)
    live = [worker(name).model_copy(update={"url": url}) for name in ("w-a", "w-b", "w-c")]
    body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 2}
    try:
        async with _front(ServingConfig(), live) as (front_url, front):
            async with aiohttp.ClientSession() as http:
                async with http.post(front_url + "/v1/completions", json=body) as resp:
                    error = (await resp.json())["error"]
            assert (
                resp.status == 500
                and error["code"] == "request_failed"
                and "failed on 2 prefill workers: worker w-a" in error["message"]
            )
            assert all(load.failed_until == 0 for load in front.dispatcher.loads.values())
    finally:
        await runner.cleanup()


async def test_routing_sees_each_workers_own_prefix():
    from tiercake.blocks import block_keys

    node = MemberInfo(node_id="n1", role="node", tiers={"pool": 1 << 20})
    async with _front(ServingConfig(), [worker("w-a"), worker("w-b"), node]) as (_, front):
        tokens = list(b"a shared system prompt, long enough for a few blocks of sixteen tokens")
        keys = block_keys(front.config.serving_namespace("default"), tokens)
        front.conductor.report("default", keys, "w-b", "gpu", [1] * len(keys))
        route = front.dispatcher.route(Job(tokens, keys, "default", "default", 4), ("worker",))
        assert route.member.node_id == "w-b" and route.decision.reused_blocks == len(keys) == 4
        assert not route.decision.pull and route.source is None  # its own gpu tier has it all: nothing to pull
        # a prompt only a node holds: the chosen worker is told to pull it, and from where
        other = list(b"another prompt that only the node's pool holds, long enough for blocks")
        node_keys = block_keys(front.config.serving_namespace("default"), other)
        front.conductor.report("default", node_keys, "n1", "pool", [1] * len(node_keys))
        route = front.dispatcher.route(Job(other, node_keys, "default", "default", 4), ("worker",))
        assert route.decision.pull and route.source == KVHandoff(
            node="n1", blocks=len(node_keys), tier="pool", runs=[("pool", len(node_keys))]
        )


async def test_the_front_keys_a_prompt_once_whatever_the_attempts(monkeypatch):
    """Access statistics, the recorded trace and every routing attempt share one hashing of the
    prompt (two dead workers: two attempts, one hashing)."""
    import tiercake.conductor.front.openai_api as openai_api

    calls = []

    def counting(namespace, tokens):
        calls.append(len(tokens))
        return block_keys(namespace, tokens)

    from tiercake.blocks import block_keys

    monkeypatch.setattr(openai_api, "block_keys", counting)
    body = {"model": "tiercake-reference", "prompt": "x" * 100, "max_tokens": 2}
    async with _front(ServingConfig(), [worker("w-dead-1"), worker("w-dead-2")]) as (url, front):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503, await resp.text()
        assert all(front.dispatcher.loads[w].failed_until > 0 for w in ("w-dead-1", "w-dead-2"))  # both tried
    assert calls == [100]


def test_a_stop_string_is_held_back_until_it_is_one_or_cannot_be():
    from tiercake.conductor.front.openai_models import Stopper
    from tiercake.tokenizer import ByteTokenizer

    text = ByteTokenizer().detokenizer
    stopper = Stopper(["ab", "zzz"], frozenset(), text())
    shown = [stopper.feed(t) for t in b"xaz"]
    assert shown == ["x", "", "a"] and not stopper.stopped  # "a" held until "z" showed it is no "ab"
    assert [stopper.feed(t) for t in b"zz"] == ["", ""] and stopper.stopped  # "z" + "zz": the stop, cut
    cut = Stopper(["ab"], frozenset({ord("!")}), text())
    assert [cut.feed(t) for t in b"ya"] == ["y", ""] and cut.feed(ord("!")) == "a" and cut.stopped
    tail = Stopper(["ab"], frozenset(), text())
    assert [tail.feed(t) for t in b"qa"] == ["q", ""] and tail.rest() == "a"  # the end shows what was held


async def test_a_synchronous_flush_waits_for_every_live_member_and_names_the_late_ones():
    """``flush(wait=True)`` answers once each member live when it was asked has confirmed it; a member
    that never does is named in a 504 after the timeout (the flush stays in force); one that leaves is
    not waited for."""
    from tiercake.conductor.client import Client, ConductorError

    async with _front(ServingConfig(), [worker("silent"), worker("leaver")]) as (url, _):
        async with Client([url], timeout=30) as ops:  # the flushes' own timeouts judge
            with pytest.raises(ConductorError) as late:
                await ops.flush(wait=True, timeout_s=0.5)
            assert late.value.status == 504 and "leaver, silent" in str(late.value)
            epoch = await ops.flush()  # asynchronous: the epoch, at once
            waiting = asyncio.create_task(ops.flush(["gpu"], wait=True, timeout_s=20))
            await asyncio.sleep(0.3)
            await ops.flush_applied("silent", epoch + 1)
            await asyncio.sleep(0.3)
            assert not waiting.done()  # "leaver" has not confirmed yet
            members = {m.node_id: m for m in await ops.members()}
            await ops.leave("leaver", members["leaver"].lease)
            assert await waiting == epoch + 1  # gone: no longer waited for (else a 504 after 20 s)


async def test_a_front_started_with_a_router_that_ignores_the_tiers_says_so(caplog):
    """A config whose router never loads from the nodes (pull: false) is accepted, with a warning
    in the log from the start (the policy switch says it in its reply)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tiercake.conductor.front.dispatch"):
        async with _front(ServingConfig(router="cache_aware", router_params={"pull": False}), []):
            pass
    assert any("never loaded" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiercake.conductor.front.dispatch"):
        async with _front(ServingConfig(router="cache_aware"), []):
            pass
    assert not any("never loaded" in r.getMessage() for r in caplog.records)


async def test_a_run_time_policy_switch_takes_names_only_and_imports_nothing():
    """A control token is not an import primitive: `module:Class` on /v1/policy is refused before any
    module is looked up (it once imported whatever it named); names of the registry still switch."""
    import sys

    sys.modules.pop("this", None)
    async with _front(ServingConfig(), []) as (url, _):
        async with aiohttp.ClientSession() as http:
            for body in ({"router": "this:X"}, {"eviction": {"pool": {"policy": "this:LRU"}}}):
                async with http.post(url + "/v1/policy", json=body) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 400 and "by name" in error["message"], error
            assert "this" not in sys.modules
            async with http.post(url + "/v1/policy", json={"router": "least_loaded"}) as resp:
                assert resp.status == 200, await resp.text()


async def test_a_front_without_api_keys_says_once_that_its_callers_share_a_cache(caplog):
    body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 2}
    async with _front(ServingConfig(), []) as (url, _):
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 503  # no worker: still a caller the note is for
    notes = [r for r in caplog.records if "share the tenant 'default' and its cache" in r.getMessage()]
    assert len(notes) == 1 and "serving.api_keys" in notes[0].getMessage()
    caplog.clear()
    async with _front(ServingConfig(api_keys={"sk-a": "alice"}), []) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"}):
                pass
    assert not [r for r in caplog.records if "share the tenant" in r.getMessage()]


async def test_no_decode_worker_with_room_after_the_prefill_is_a_429_not_a_502():
    """Prefilled, then every decode worker answers that its gpu tier is full: the whole response is
    the front's 429 with Retry-After (it was a 502, as if a worker had failed)."""
    from aiohttp import web

    from tiercake.messages import TokenEvent

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        first = TokenEvent(token=65, index=0, finish_reason="length")
        await response.write(first.model_dump_json(exclude_defaults=True).encode() + b"\n")
        await response.write_eof()
        return response

    async def full(request: web.Request) -> web.Response:
        await request.read()
        error = {"error": {"message": "gpu tier full", "type": "server_error", "code": "worker_busy"}}
        return web.json_response(error, status=503)

    servers, urls = zip(*[await fake_worker(handler) for handler in (prefill, full)])
    members = [
        worker("p1", "prefill").model_copy(update={"url": urls[0]}),
        worker("d1", "decode").model_copy(update={"url": urls[1]}),
    ]
    body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 4}
    try:
        async with _front(ServingConfig(disaggregated=True), members) as (url, _):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 429 and resp.headers["Retry-After"] == "1", error
                    assert error["code"] == "gpu_full" and "decode" in error["message"]
            # streamed, the refusal comes after the first token, as an error event: the Python client
            # raises it as the 429 it is (it raised every error event as a 502, and replay counted
            # these refusals as failures). Once the decode worker's short back-off is over: meanwhile
            # the front would serve the request on the prefill worker alone.
            await asyncio.sleep(0.3)
            async with Client([url], timeout=10) as client:
                with pytest.raises(ConductorError) as refused:
                    async for _ in client.stream_completion("hello", max_tokens=4):
                        pass
                assert refused.value.status == 429 and refused.value.code == "gpu_full"
    finally:
        for runner in servers:
            await runner.cleanup()


async def test_a_policy_for_a_tier_the_cluster_has_not_is_a_400_naming_its_tiers():
    """``/v1/policy`` once stored an eviction policy for a tier no member has (a typo took effect
    nowhere, silently): refused, with the tiers it has."""
    async with _front(ServingConfig(), [worker("w1")]) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/policy", json={"eviction": {"poool": {"policy": "lru"}}}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and "no tier 'poool'" in error["message"] and "'pool'" in error["message"]
            async with http.post(url + "/v1/policy", json={"eviction": {"pool": {"policy": "lru"}}}) as resp:
                assert resp.status == 200, await resp.text()


async def test_a_body_nested_100000_deep_is_a_400_on_every_api():
    """JSON nested 100,000 deep (Python's parser recurses: it once answered 500 with a RecursionError):
    a 400 that says so, on the OpenAI API, the operator's endpoints and the members' control calls."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with _front(ServingConfig(), [worker("w1")]) as (url, _):
        async with aiohttp.ClientSession() as http:
            for path, body in (
                ("/v1/completions", b'{"model": "tiercake-reference", "prompt": ' + deep + b"}"),
                ("/v1/policy", b'{"eviction": ' + deep + b"}"),
                ("/v1/placements/lookup", b'{"tenant": "t", "keys": ' + deep + b"}"),
                ("/v1/objects/reports", b'{"reports": ' + deep + b"}"),
            ):
                async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 400 and "too deeply" in error["message"], (path, resp.status, error)


async def test_a_worker_that_leaves_mid_request_is_not_waited_for():
    """A worker whose lease lapses (cut off, stopped) while it holds a request it has not begun to
    answer: the request goes to another worker at once, not after the read timeout (a minute; the
    lab's isolated host once held the front's requests that long)."""
    from aiohttp import web

    from tiercake.messages import TokenEvent

    started, released = asyncio.Event(), asyncio.Event()

    async def stalled(request: web.Request) -> web.Response:
        await request.read()
        started.set()
        await released.wait()  # never answers while the test runs
        return web.json_response({"error": {"message": "too late", "type": "server_error"}}, status=500)

    async def answers(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for i in range(2):
            event = TokenEvent(token=65 + i, index=i, finish_reason="length" if i == 1 else None)
            await response.write(event.model_dump_json(exclude_defaults=True).encode() + b"\n")
        await response.write_eof()
        return response

    servers, urls = zip(*[await fake_worker(handler) for handler in (stalled, answers)])
    config = default_config()

    def make(conductor):
        return Frontend(conductor, config)

    body = {"model": "tiercake-reference", "prompt": "hello", "max_tokens": 2}
    try:
        async with running_conductor(frontend=make) as (url, conductor):
            member = worker("w-cut").model_copy(update={"url": urls[0]})
            cut = await Registration(conductor.meta, member, ttl=5).start()
            await conductor.members.wait_for(lambda ms: len(ms.alive()) == 1, 5)
            async with aiohttp.ClientSession() as http:
                request = asyncio.ensure_future(http.post(url + "/v1/completions", json=body))
                await asyncio.wait_for(started.wait(), 10)
                other = worker("w-other").model_copy(update={"url": urls[1]})
                spare = await Registration(conductor.meta, other, ttl=5).start()
                await conductor.members.wait_for(lambda ms: len(ms.alive()) == 2, 5)
                await cut.stop()  # its record goes, as when its lease lapses
                async with asyncio.timeout(10):
                    resp = await request
                    data = await resp.json()
                assert resp.status == 200 and data["choices"][0]["text"] == "AB", data
                await spare.stop()
    finally:
        released.set()
        for runner in servers:
            await runner.cleanup()
