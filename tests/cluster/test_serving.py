"""The serving path end to end: ``tiercake up`` (conductor with the front, node agent, prefill and
decode workers, each its own process) answering the OpenAI-compatible API; bad input; faults."""

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from paths import ROOT
from up_helpers import UpCluster

from tiercake.chaos import pid_listening as _pid_listening
from tiercake.conductor.client import Client, ConductorError, Session
from tiercake.conductor.front.sessions import session_hash
from tiercake.devtls import self_signed

pytestmark = pytest.mark.cluster  # every test here starts processes

MODEL = "tiercake-reference"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "
# The shared cluster's router loads whatever a node holds: whether a pull beats a recompute is priced
# from live timings, and on a busy machine one slow pull priced these small prompts as recomputes
# (the tests here check what a load does, not that pricing; tests/policies/test_routing.py does that)
LOAD_WHAT_IS_HELD = {"reuse_margin": 1000}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = UpCluster(tmp_path_factory.mktemp("serving"), serving=f", router_params: {LOAD_WHAT_IS_HELD}")
    asyncio.run(up.wait_up(workers=2))
    yield up
    started = time.monotonic()
    output = up.stop()
    assert "tiercake is down" in output, output[-2000:]
    assert up.proc.returncode == 0
    assert time.monotonic() - started < 12  # the children stop together (it was one after another, 15 s each)


def completion(text: str = PROMPT, **kw) -> dict:
    return {"model": MODEL, "prompt": text, "max_tokens": 12, "temperature": 0, **kw}


async def test_a_worker_freezes_the_heap_it_started_with(cluster):
    """A full collection of a worker's start (torch, the model: over 200,000 objects) took 100 ms in
    the middle of a pull; a worker that has started leaves it out of the collector's walk."""
    worker, _ = await cluster.member_pid("prefill")
    async with aiohttp.ClientSession() as http:
        async with http.get(worker["url"] + "/health") as resp:
            health = await resp.json()
    assert health["frozen_objects"] > 100_000, health


async def test_second_identical_request_reuses_the_cache_and_answers_the_same(cluster):
    async with Client([cluster.url], timeout=60) as client:
        prompt = PROMPT + "First test."
        first = await client.complete(prompt, max_tokens=12, tenant="reuse")
        second = await client.complete(prompt, max_tokens=12, tenant="reuse")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    full = (len(prompt.encode()) - 1) // 16 * 16
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    async with aiohttp.ClientSession() as http:
        async with http.get(cluster.control_url + "/metrics", headers=cluster.auth()) as resp:
            metrics = await resp.text()
    assert 'tiercake_completions_total{outcome="ok"}' in metrics and "tiercake_ttft_seconds_bucket" in metrics
    assert 'tiercake_cached_prompt_tokens_total{source="gpu"}' in metrics
    async with aiohttp.ClientSession() as http:  # members' tier statistics arrive with their keep-alives
        for _ in range(50):
            async with http.get(cluster.control_url + "/metrics", headers=cluster.auth()) as resp:
                member_metrics = await resp.text()
            if 'tiercake_tier_blocks{member="test-node-prefill-0",tier="gpu"}' in member_metrics:
                break
            await asyncio.sleep(0.1)
    assert 'tiercake_tier_used_bytes{member="test-node",tier="pool"}' in member_metrics
    assert 'tiercake_block_residency_seconds_bucket{le="+Inf",member="test-node",tier="pool"}' in member_metrics
    for phase in ("route", "lookup", "load", "compute", "queue_and_transport"):
        assert f'tiercake_ttft_phase_seconds_count{{phase="{phase}"}} 2.0' in metrics
    assert first["usage"]["completion_tokens"] == 12 and first["choices"][0]["finish_reason"] == "length"
    # the decode worker took the prompt over through the node: every full block pulled, none recomputed
    assert first["usage"]["tiercake"]["decode_cached_tokens"] == (len(prompt.encode())) // 16 * 16
    # ... and keeps those blocks out of the index (nobody is routed by its cache): the prefill worker's
    # gpu tier and the node hold the prefix there, the decode worker does not
    async with cluster.ops() as ops:
        for _ in range(50):
            holders = (await ops.prefix(prompt, tenant="reuse")).holders
            if {"test-node", "test-node-prefill-0"} <= set(holders):
                break
            await asyncio.sleep(0.1)
    assert {"test-node", "test-node-prefill-0"} <= set(holders) and "test-node-decode-0" not in holders


async def test_reuse_distance_and_prefetchability_measured_live(cluster):
    """A follow-up turn re-accesses its conversation's blocks, announced by the turn it extends
    (prefetchable); another conversation on the same opening re-accesses them unannounced."""
    opening = PROMPT * 2  # 188 bytes: 11 full blocks
    full = len(opening.encode()) // 16
    async with Client([cluster.url], timeout=60) as client, cluster.ops() as ops:
        before = (await ops.cluster()).reuse
        await client.complete(opening, max_tokens=2, tenant="reuse-live")
        await client.complete(opening + "And then the dog woke up.", max_tokens=2, tenant="reuse-live")
        middle = (await ops.cluster()).reuse
        await client.complete(opening[:80] + "Something else entirely.", max_tokens=2, tenant="reuse-live")
        after = (await ops.cluster()).reuse
    assert middle["reaccesses"] - before["reaccesses"] == full  # the follow-up re-read every full block
    prefetchable_before = before["prefetchable_share"] * before["reaccesses"]
    prefetchable_middle = middle["prefetchable_share"] * middle["reaccesses"]
    assert round(prefetchable_middle - prefetchable_before) == full  # ... each announced by the first turn
    assert after["reaccesses"] - middle["reaccesses"] == 80 // 16  # the shared opening's full blocks
    assert round(after["prefetchable_share"] * after["reaccesses"]) == round(prefetchable_middle)  # unannounced
    async with aiohttp.ClientSession() as http:
        async with http.get(cluster.control_url + "/metrics", headers=cluster.auth()) as resp:
            text = await resp.text()
    count = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("tiercake_reuse_distance_blocks_count")
    )
    assert count == after["reaccesses"]
    assert "tiercake_prefetch_lead_seconds_bucket" in text and "tiercake_reuse_time_seconds_bucket" in text


async def test_token_id_prompts_and_streaming(cluster):
    tokens = list((PROMPT + "Streaming.").encode())
    async with Client([cluster.url], timeout=60) as client:
        whole = await client.complete(tokens, max_tokens=8)
        chunks = [c async for c in client.stream_completion(tokens, max_tokens=8)]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len(texts) == 8 and "".join(texts) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    async with aiohttp.ClientSession() as http:  # the raw wire: server-sent events ending in [DONE]
        async with http.post(cluster.url + "/v1/completions", json=completion(stream=True, max_tokens=3)) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            body = (await resp.read()).decode()
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 4


async def test_bad_requests_are_clear_errors(cluster):
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
        (json.dumps(completion(max_tokens=0)).encode(), 400, "max_tokens"),
        (json.dumps(completion(model="gpt-9")).encode(), 404, "does not exist"),
        (json.dumps(completion(text="x" * 1020)).encode(), 400, "context length"),
        (json.dumps(completion(text=[1, 2, 999])).encode(), 400, "token ids"),
        (json.dumps(completion(text="")).encode(), 400, "empty"),
        (json.dumps(completion(temperature=-1)).encode(), 400, "temperature"),
        # a parameter the server does not honour is refused by name, never silently ignored
        (json.dumps({**completion(), "n": 17}).encode(), 400, "n"),
        (json.dumps({**completion(), "n": 0}).encode(), 400, "n"),
        (json.dumps({**completion(), "n": 9, "prompt": ["a", "b"]}).encode(), 400, "at most 16"),
        (json.dumps({**completion(), "prompt": []}).encode(), 400, "empty"),
        (json.dumps({**completion(), "prompt": ["ok", ""]}).encode(), 400, "prompt 1 is empty"),
        (json.dumps({**completion(), "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({**completion(), "stop": ["."] * 5}).encode(), 400, "at most 4"),
        (json.dumps({**completion(), "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({**completion(), "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({**completion(), "echo": True}).encode(), 400, "echo:"),
        (json.dumps({**completion(), "best_of_three": 1}).encode(), 400, "best_of_three: Extra inputs"),
        (json.dumps({**completion(), "prompt": ["a", [1, 2]]}).encode(), 400, "prompt"),
        # types are strict: nothing is coerced into what the caller did not send
        (json.dumps(completion(max_tokens="16")).encode(), 400, "max_tokens"),
        (json.dumps(completion(max_tokens=2.0)).encode(), 400, "max_tokens"),
        (json.dumps(completion(max_tokens=True)).encode(), 400, "max_tokens"),
        (json.dumps(completion(text=[True, False])).encode(), 400, "prompt"),
        (json.dumps(completion(stream="yes")).encode(), 400, "stream"),
        # numbers are numbers, in range: a NaN, an infinity or a seed past 64 bits is the request's fault
        (b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(), 400, "temperature"),
        (b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % MODEL.encode(), 400, "top_p"),
        (json.dumps({**completion(), "seed": 2**64}).encode(), 400, "seed"),
        (json.dumps({**completion(), "stop_token_ids": [-5]}).encode(), 400, "stop_token_ids"),
        (json.dumps({**completion(), "stop_token_ids": [10**12]}).encode(), 400, "stop_token_ids"),
        (json.dumps({**completion(), "stop_token_ids": list(range(10_000))}).encode(), 400, "stop_token_ids"),
        # one value per name: a body that says max_tokens twice is ambiguous, not the last one wins
        (b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "max_tokens": 900}' % MODEL.encode(), 400, "max_tokens"),
    ]
    async with aiohttp.ClientSession() as http:
        for body, status, words in cases:
            async with http.post(
                cluster.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                data = await resp.json()
                assert resp.status == status, (body, data)
                assert data["error"]["message"] and (words is None or words in data["error"]["message"]), data
        async with http.post(cluster.url + "/v1/completions", json=completion(temperature=-1)) as resp:
            assert (await resp.json())["error"]["param"] == "temperature"  # OpenAI's field for what was refused
        neutral = {
            "n": 1,
            "top_p": 1,
            "stop": None,
            "logprobs": None,
            "echo": False,
            "user": "u-1",
            "presence_penalty": 0,
            "frequency_penalty": 0,
        }  # what OpenAI clients send by default
        async with http.post(cluster.url + "/v1/completions", json={**completion(), **neutral}) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(cluster.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with http.post(
            cluster.url + "/v1/completions", json=completion(), headers={"X-Tiercake-Tenant": "a/b"}
        ) as resp:
            assert resp.status == 400


async def test_tenants_get_no_hits_from_each_other(cluster):
    prompt = PROMPT + "Tenants."
    async with Client([cluster.url], timeout=60) as client:
        await client.complete(prompt, tenant="alice")
        bob = await client.complete(prompt, tenant="bob")
        alice = await client.complete(prompt, tenant="alice")
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert alice["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_workers_take_work_only_from_who_holds_the_cluster_token(cluster):
    """A worker's /generate names the tenant and salt it runs under: a caller without the cluster's
    token (anyone but the front) is refused, so nobody can read or answer another tenant's request."""
    prefill, _ = await cluster.member_pid("prefill")
    forged = {
        "request_id": "forged",
        "tokens": list(b"hello there, general kenobi"),
        "max_tokens": 2,
        "tenant": "alice",
        "salt": "alice",
    }
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            async with http.post(prefill["url"] + "/generate", json=forged, headers=headers) as resp:
                assert resp.status == 401, await resp.text()
                assert (await resp.json())["error"]["code"] == "invalid_token"
            async with http.get(prefill["url"] + "/load", headers=headers) as resp:
                assert resp.status == 401
        async with http.get(prefill["url"] + "/health") as resp:  # probes need no token
            assert resp.status == 200
        async with http.get(prefill["url"] + "/load", headers=cluster.auth()) as resp:
            assert resp.status == 200
        # the control API is not on the public port, and needs the token on its own
        async with http.get(cluster.url + "/v1/members", headers=cluster.auth()) as resp:
            assert resp.status == 404
        async with http.get(cluster.control_url + "/v1/members") as resp:
            assert resp.status == 401


async def test_one_tenants_bad_seeds_get_400s_and_cost_the_other_tenant_nothing(cluster):
    """A seed past 64 bits once overflowed in the worker, which the front took for a dead worker: it
    sidelined the workers for everyone while one client sent it twice a second. The request's fault is
    the request's 400, at the front and at a worker asked directly."""
    bad = {**completion(), "seed": 2**64, "max_tokens": 4}
    good = {**completion(PROMPT + "Other tenant."), "max_tokens": 4, "temperature": 0}

    async def send(http, body, tenant):
        async with http.post(cluster.url + "/v1/completions", json=body, headers={"X-Tiercake-Tenant": tenant}) as r:
            return r.status

    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(
            *([send(http, bad, "mallory") for _ in range(40)] + [send(http, good, "alice") for _ in range(20)])
        )
        worker, _ = await cluster.member_pid("prefill")
        direct = {"request_id": "r", "tokens": list(b"hello"), "max_tokens": 2, "seed": 2**64}
        async with http.post(worker["url"] + "/generate", json=direct, headers=cluster.auth()) as resp:
            assert resp.status == 400 and "seed" in (await resp.json())["error"]["message"]
    assert statuses[:40] == [400] * 40 and statuses[40:] == [200] * 20, statuses


def test_fuzzed_http_requests_get_clear_4xx_never_a_5xx_a_hang_or_a_leak(cluster):
    """Hypothesis against the real cluster's public and control APIs: JSON of any shape, known fields
    with hostile values, raw bytes, with and without the token. Every answer is in the one error
    format (or a completion), none is a 5xx, none takes long, and the conductor's memory stays put."""
    import urllib.error
    import urllib.request

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
        max_leaves=12,
    )
    # mostly well-formed, each field sometimes hostile: deep into validation, and sometimes served
    completion_fields = st.fixed_dictionaries(
        {
            "model": st.sampled_from([MODEL, MODEL, "", "nope"]) | values,
            "prompt": st.text(min_size=1, max_size=60) | st.lists(st.integers(-3, 300), max_size=30) | values,
        },
        optional={
            "max_tokens": st.integers(-2, 6) | values,
            "temperature": st.floats(-1, 3) | values,
            "stream": st.booleans() | values,
            "seed": st.integers(-5, 5) | values,
            "stream_options": values,
            "n": values,
            "stop": values,
            "logprobs": values,
            "user": values,
        },
    )
    control_fields = st.fixed_dictionaries(
        {},
        optional={
            "tenant": st.text(max_size=12) | values,
            "keys": st.lists(st.text("0123456789abcdef", max_size=70), max_size=4) | values,
            "prompt": st.text(min_size=1, max_size=60) | values,
        },
    )
    chat_fields = st.fixed_dictionaries(
        {
            "model": st.sampled_from([MODEL, MODEL, "nope"]) | values,
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["system", "user", "assistant", "tool"]) | values,
                        "content": st.text(max_size=40) | values,
                    }
                ),
                max_size=3,
            )
            | values,
        },
        optional={
            "max_tokens": st.integers(-2, 6) | values,
            "max_completion_tokens": st.integers(0, 6) | values,
            "stream": st.booleans() | values,
            "tools": values,
            "temperature": st.floats(-1, 3) | values,
        },
    )
    bodies = st.one_of(
        completion_fields.map(json.dumps),
        chat_fields.map(json.dumps),
        control_fields.map(json.dumps),
        values.map(json.dumps),
        st.binary(max_size=200),
    )
    control = cluster.control_url
    targets = [
        (cluster.url, "/v1/completions", None),
        (cluster.url, "/v1/chat/completions", None),
        (control, "/v1/placements/lookup", cluster.token),
        (control, "/v1/prefix", cluster.token),
        (control, "/v1/placements/commit", None),
        (control, "/v1/members/register", None),
        (control, "/v1/policy", None),
    ]
    conductor = _pid_listening(int(control.rsplit(":", 1)[1]))
    rss_before = _rss_mb(conductor)
    seen: dict[int, int] = {}

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies, target=st.sampled_from(targets))
    def fuzz(body, target):
        base, path, token = target
        request = urllib.request.Request(
            base + path,
            data=body if isinstance(body, bytes) else body.encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})},
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        assert time.monotonic() - started < 20, (path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (path, body, raw[:300])
        if status >= 400:
            assert json.loads(raw)["error"]["message"], raw
        if token is None and base == control:
            assert status == 401  # nothing of the control API without the token, whatever the body

    fuzz()
    assert sum(seen.values()) >= 400 and seen.get(200) and seen.get(400) and seen.get(401), seen
    assert _rss_mb(conductor) - rss_before < 150, "the conductor's memory grew over the fuzz"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def test_chat_completions_whole_streamed_and_a_follow_up_turn_reusing_the_conversation(cluster):
    """/v1/chat/completions renders the conversation with the documented template, so its answer is
    the completion of that text; the next turn extends the prompt and reuses the conversation's KV."""
    from tiercake.tokenizer import chat_text

    messages = [
        {"role": "system", "content": "You answer in riddles about caches and tiers."},
        {"role": "user", "content": PROMPT},
    ]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.url + "/v1/chat/completions", json=chat) as resp:
            whole = await resp.json()
            assert resp.status == 200, whole
        assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
        message = whole["choices"][0]["message"]
        assert message["role"] == "assistant" and whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 6
        text = chat_text([(m["role"], m["content"]) for m in messages])
        async with http.post(cluster.url + "/v1/completions", json=completion(text=text, max_tokens=6)) as resp:
            assert (await resp.json())["choices"][0]["text"] == message["content"]  # the template, as documented
        assert whole["usage"]["prompt_tokens"] == len(text.encode())

        async with http.post(
            cluster.url + "/v1/chat/completions",
            json={**chat, "stream": True, "stream_options": {"include_usage": True}},
        ) as resp:
            events = [line[6:] for line in (await resp.read()).decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0]["role"] == "assistant" and "role" not in deltas[1]
        assert "".join(d["content"] for d in deltas) == message["content"]
        assert chunks[-1]["usage"]["completion_tokens"] == 6

        follow_up = {**chat, "messages": [*messages, message, {"role": "user", "content": "And then?"}]}
        async with http.post(cluster.url + "/v1/chat/completions", json=follow_up) as resp:
            second = await resp.json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(text.encode()) // 16 * 16 - 16

        bad = [
            ({**chat, "messages": []}, "messages"),
            ({**chat, "messages": [{"role": "tool", "content": "x"}]}, "role"),
            ({**chat, "n": 17}, "n"),
            ({**chat, "top_logprobs": 2}, "needs logprobs"),
            ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({**chat, "max_completion_tokens": 3}, "not both"),
            ({**chat, "tools": [{"type": "function"}]}, "tools"),
            ({**chat, "max_tokens": "6"}, "max_tokens"),
        ]
        for body, words in bad:
            async with http.post(cluster.url + "/v1/chat/completions", json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and words in error["message"], (body, error)


async def test_usage_credits_each_loaded_block_to_the_tier_it_came_from(cluster):
    """A prefix whose first blocks are in the node's pool and the rest only on its SSD: the usage
    says so block by block (it credited all of them to the tier holding most)."""
    head = "Tiered accounting: the head of this prompt is read from the pool,"  # 4 blocks
    tail = " and its tail from the SSD, and the usage says which is which."
    prompt = head + tail
    head_blocks = len(head.encode()) // 16
    async with Client([cluster.url], timeout=60) as client, cluster.ops() as ops:

        async def settle(what: str, holds) -> None:
            """Until ``holds(holders)`` of the prompt's prefix: each member applies a flush and reports
            what it moved on its own keep-alive, so every step waits for the index to say so."""
            for _ in range(100):
                holders = (await ops.prefix(prompt, tenant="acct")).holders
                if holds(holders):
                    return
                await asyncio.sleep(0.2)
            raise AssertionError(f"never {what}: {holders}")

        await client.complete(prompt, tenant="acct", max_tokens=1)  # every block: gpu and the node's pool
        await settle(
            "in the gpu and the pool",
            lambda h: (
                set(h) == {"test-node", "test-node-prefill-0"} and h["test-node"].tiers.get("pool", 0) >= head_blocks
            ),
        )
        await ops.flush(["gpu", "pool"])  # down to the SSD
        await settle("on the SSD only", lambda h: set(h) == {"test-node"} and "pool" not in h["test-node"].tiers)
        await client.complete(head + " ", tenant="acct", max_tokens=1)  # reads the head: promoted to the pool
        await settle(
            "the head back in the pool",
            lambda h: "test-node-prefill-0" in h and h["test-node"].tiers.get("pool", 0) >= head_blocks,
        )
        await ops.flush(["gpu"])
        await settle(
            "out of the gpu", lambda h: set(h) == {"test-node"} and h["test-node"].tiers.get("pool", 0) >= head_blocks
        )
        answer = await client.complete(prompt + " More.", tenant="acct", max_tokens=1)
    sources = answer["usage"]["tiercake"]["sources"]
    whole = len(prompt.encode()) // 16
    assert sources == {"test-node:pool": head_blocks, "test-node:ssd": whole - head_blocks}, sources
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == whole * 16


async def test_a_client_that_goes_away_mid_stream_frees_its_sequence(cluster):
    decode, _ = await cluster.member_pid("decode")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(cluster.url + "/v1/completions", json=completion(stream=True, max_tokens=400))
        await resp.content.readline()
        resp.close()  # gone
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            async with http.get(decode["url"] + "/load", headers=cluster.auth()) as r:
                load = await r.json()
            if load["running"] == 0 and load["waiting"] == 0:
                break
            await asyncio.sleep(0.2)
        assert load["running"] == 0, load
        assert load["free_blocks"] > 0


async def test_cluster_view_prefix_pins_flush_and_policy_switch(cluster):
    always = LOAD_WHAT_IS_HELD
    prompt = PROMPT + "Control."
    async with Client([cluster.url], timeout=60) as client, cluster.ops() as ops:
        await client.complete(prompt, tenant="ops")
        await client.complete(prompt, tenant="ops")
        view = await ops.cluster()
        roles = sorted(m.role for m in view.members)
        assert roles == ["decode", "node", "prefill"]
        assert view.serving.cached_tokens > 0 and 0 < view.serving.hit_ratio < 1
        meta = view.metadata  # metadata work per request and per KV byte moved
        assert meta.lookups > 0 and meta.placement_changes > 0 and meta.ops_per_request > 1
        assert meta.change_batches < meta.placement_changes  # blocks go to the index in batches
        assert meta.changes["pool+"] > 0 and meta.change_bytes >= 36 * meta.placement_changes
        assert meta.kv_bytes_moved > 0 and 0 < meta.metadata_bytes_per_kv_byte < 1
        node = next(m for m in view.members if m.role == "node")
        for _ in range(50):  # tier statistics arrive with the next keep-alive
            if node.tiers["pool"].used_bytes:
                break
            await asyncio.sleep(0.2)
            node = next(m for m in (await ops.cluster()).members if m.role == "node")
        assert node.tiers["pool"].used_bytes > 0 and node.tiers["pool"].kind == "pool"

        held = await ops.prefix(prompt, tenant="ops")
        full = (len(prompt.encode())) // 16
        assert held.blocks == full
        assert held.holders["test-node"].blocks == full  # written through to the node agent
        assert await ops.pin_prefix(prompt, tenant="ops") == full
        pinned = [b for b in await ops.node_blocks("test-node") if b.pinned]
        assert len(pinned) == full

        # a flush empties every cache but what is pinned
        other = "An unrelated prompt, sharing no block with the pinned one, to be flushed away entirely. "
        await client.complete(other, tenant="ops")
        for _ in range(50):  # written through first: a flush drops what is there when it is applied
            if "test-node" in (await ops.prefix(other, tenant="ops")).holders:
                break
            await asyncio.sleep(0.1)
        await ops.flush(wait=True)  # synchronous: every member applied it and reported what it removed
        assert (await ops.prefix(other, tenant="ops")).holders == {}
        assert (await ops.prefix(prompt, tenant="ops")).holders["test-node"].blocks == full
        assert await ops.unpin_prefix(prompt, tenant="ops") == full

        # flushing only the workers' gpu tiers leaves the node's copies
        third = "Yet another prompt whose blocks stay on the node while the workers forget them. "
        await client.complete(third, tenant="ops")
        await ops.flush(tiers=["gpu"], wait=True)
        assert set((await ops.prefix(third, tenant="ops")).holders) == {"test-node"}

        # policies switched at run time: the router here, the pool's eviction on the node
        with pytest.raises(ConductorError) as err:
            await ops.set_policy(router="no-such-router")
        assert err.value.status == 400
        blind = await ops.set_policy(router="cache_aware", router_params={"pull": False})
        assert "never loaded" in " ".join(blind.warnings)  # said, not silent: pool and SSD reuse is off
        answer = await ops.set_policy(
            router="least_loaded", router_params=always, eviction={"pool": {"policy": "s3fifo"}}
        )
        assert answer.router.name == "least_loaded" and answer.warnings == []
        assert (await ops.cluster()).router.name == "least_loaded"  # at once, before any completion
        # a baseline router still loads what the node holds (it once turned pool and SSD reuse off)
        await ops.flush(tiers=["gpu"])
        for _ in range(60):
            if set((await ops.prefix(third, tenant="ops")).holders) == {"test-node"}:
                break
            await asyncio.sleep(0.2)
        reused = await client.complete(third, tenant="ops")
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, reused["usage"]
        assert any(k.startswith("test-node:") for k in reused["usage"]["tiercake"]["sources"])
        await client.complete(prompt, tenant="ops")
        for _ in range(50):
            node = next(m for m in (await ops.cluster()).members if m.role == "node")
            if node.tiers["pool"].eviction == "s3fifo":
                break
            await asyncio.sleep(0.2)
        assert node.tiers["pool"].eviction == "s3fifo"
        await ops.set_policy(router="ttft", router_params=always)


async def _pool_of(ops, until, what: str):
    for _ in range(75):  # tier statistics arrive with the node's next keep-alive
        node = next(m for m in (await ops.cluster()).members if m.role == "node")
        if until(node.tiers["pool"]):
            return node.tiers["pool"]
        await asyncio.sleep(0.2)
    raise AssertionError(f"the pool never showed {what}: {node.tiers['pool']}")


async def test_sessions_from_the_request_reach_the_nodes_pool_policy_and_a_final_turn_frees_it(cluster):
    """A session named by a header (ours, or an agent's) is told to the node's session-aware pool by
    the worker that ran the request: paused after each turn, per tenant, closed by a final turn;
    bad directives are 400s that name their header."""
    async with cluster.ops() as ops, aiohttp.ClientSession() as http:
        before = next(m for m in (await ops.cluster()).members if m.role == "node").tiers["pool"].eviction
        await ops.set_policy(eviction={"pool": {"policy": "session"}})
        await _pool_of(ops, lambda pool: pool.eviction == "session", "the session policy")
        try:

            async def ask(headers: dict, body: dict | None = None) -> tuple[int, dict]:
                payload = completion(PROMPT + "Sessions. " * 4) | (body or {})
                async with http.post(cluster.url + "/v1/completions", json=payload, headers=headers) as resp:
                    return resp.status, await resp.json()

            for headers, param in [
                ({"X-Tiercake-Session-Pause": "5"}, "x-tiercake-session-pause"),
                ({"X-Tiercake-Session": "c", "X-Tiercake-Session-Pause": "nan"}, "x-tiercake-session-pause"),
                ({"X-Tiercake-Session": "c", "X-Tiercake-Session-Retain": "0"}, "x-tiercake-session-retain"),
                ({"X-Tiercake-Session": "c", "X-Tiercake-Session-Priority": "1e9"}, "x-tiercake-session-priority"),
                ({"X-Tiercake-Session": "c", "X-Tiercake-Session-Final": "maybe"}, "x-tiercake-session-final"),
                ({"X-Tiercake-Session": "c" * 300}, "x-tiercake-session"),
            ]:
                status, answer = await ask(headers)
                assert status == 400 and answer["error"]["param"] == param, (headers, answer)

            status, _ = await ask({"X-Tiercake-Session": "chat-1", "X-Tiercake-Session-Pause": "30"})
            assert status == 200
            pool = await _pool_of(ops, lambda pool: pool.sessions == {"paused": 1}, "one paused session")
            assert pool.session_blocks > 0
            # the same id from another tenant is another session; an agent's own header names one too
            status, _ = await ask({"X-Tiercake-Session": "chat-1", "X-Tiercake-Tenant": "other"})
            assert status == 200
            status, _ = await ask({"X-Dynamo-Session-ID": "agent-7"}, {"max_tokens": 4})
            assert status == 200
            await _pool_of(ops, lambda pool: pool.sessions == {"paused": 3}, "three paused sessions")
            status, _ = await ask({"X-Tiercake-Session": "chat-1", "X-Tiercake-Session-Final": "true"})
            assert status == 200
            await _pool_of(ops, lambda pool: pool.sessions == {"paused": 2}, "the final turn's session closed")
            async with Client([cluster.url], timeout=60) as client:  # the Python client's way
                await client.complete(PROMPT, session=Session("agent-7", final=True))
            await _pool_of(ops, lambda pool: pool.sessions == {"paused": 1}, "the client's final turn")

            # the control API: the front's book, per tenant; changes go through the worker of the last turn
            listed = {(s.tenant, s.state) for s in await ops.sessions()}
            assert {("default", "closed"), ("other", "paused")} <= listed
            (other,) = await ops.sessions("other")
            assert other.turns == 1 and other.worker and other.id == session_hash("other", "chat-1")
            changed = await ops.change_session(other.id, "other", retain_s=600, priority=5)
            assert (changed.retain_s, changed.priority, changed.state) == (600, 5, "paused")
            await _pool_of(ops, lambda pool: pool.sessions == {"paused": 1}, "the session still paused")
            with pytest.raises(ConductorError) as err:
                await ops.change_session(other.id, "default")  # another tenant's: not found
            assert err.value.status == 404
            with pytest.raises(ConductorError) as err:
                await ops.change_session("no-such-session", "other", close=True)
            assert err.value.status == 404
            async with http.post(cluster.control_url + "/v1/sessions/" + other.id, json={"tenant": "other"}) as resp:
                assert resp.status == 401  # the control API's token is needed
            async with http.delete(
                cluster.control_url + f"/v1/sessions/{other.id}?tenant=other",
                headers={"Authorization": f"Bearer {cluster.token}"},
            ) as resp:
                assert resp.status == 200, await resp.text()
            await _pool_of(ops, lambda pool: pool.sessions == {}, "the dropped session freed")
            assert (await ops.sessions("other"))[0].state == "closed"
        finally:
            await ops.set_policy(eviction={"pool": {"policy": before or "lru"}})


async def test_the_session_router_spreads_new_sessions_and_brings_each_turn_back_to_its_worker(tmp_path):
    """With ``session`` routing, the front's book feeds the router: new sessions go to the worker
    holding the fewest paused ones, and a session's next turn goes back to the worker that computed
    its last one even when its prompt shares nothing the caches could find (``ttft`` would send every
    one of these to whichever worker it predicts fastest). Two combined workers, so that there is a
    choice for the prompt."""
    cluster = UpCluster(tmp_path, args=["--workers", "2"])
    try:
        await cluster.wait_up(workers=2)
        async with cluster.ops() as ops, Client([cluster.url], timeout=60) as client:
            await ops.set_policy(router="session", router_params={"margin": 0.9, "affinity": 5})
            names = [f"routed-{i}" for i in range(6)]
            ids = {session_hash("default", name): name for name in names}

            async def workers() -> dict[str, str | None]:
                return {s.id: s.worker for s in await ops.sessions("default") if s.id in ids}

            for i, name in enumerate(names):
                await client.complete(
                    f"Session {i} starts with words of its own, {i * 7919}. " * 3, session=Session(name)
                )
            first = await workers()
            assert len(first) == 6 and len(set(first.values())) == 2, first
            for i, name in enumerate(names):
                # unrelated from its first byte: no block of it is cached anywhere
                await client.complete(f"{i * 104729} is then asked, unrelated. " * 3, session=Session(name))
            assert await workers() == first
    finally:
        cluster.stop()


def test_bench_serve_against_the_cluster(cluster, tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "bench",
            "serve",
            "--quick",
            "--target",
            cluster.url,
            "--control",
            cluster.control_url,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TIERCAKE_TOKEN": cluster.token},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert set(figures) == {
        "ttft.none.cached0",
        *(f"ttft.{s}.cached{p}" for s in ("gpu", "pool", "ssd") for p in (50, 90)),
        "metadata.bytes_per_kv_byte",
        "metadata.ops_per_request",
        "metadata.etcd_writes_per_request",
    }
    meta = figures.pop("metadata.bytes_per_kv_byte")
    assert meta["params"]["kv_bytes_moved"] > 0 and meta["params"]["metadata_bytes"] > 0
    assert meta["ratio"] >= 1  # never below one key per block moved
    ops, writes = figures.pop("metadata.ops_per_request"), figures.pop("metadata.etcd_writes_per_request")
    assert ops["ratio"] >= 1 and ops["params"]["changes"]["gpu+"] > 0  # the workers' gpu tiers changed
    # placements never reach etcd: what is left is membership (a registration during a short run)
    assert writes["value"] < 1
    for name, f in figures.items():
        assert f["value"] > 0 and f["limit"] > 0 and abs(f["ratio"] - f["value"] / f["limit"]) < 1e-9
        if name != "ttft.none.cached0":
            source = name.split(".")[1]
            tiers = {k.rsplit(":", 1)[-1] if ":" in k else k for k in f["params"]["sources"]}
            assert tiers == {source}, (name, f["params"])  # the prefix came from the tier it names
            assert f["params"]["cached_tokens"] == int(512 * f["params"]["cached_fraction"]) // 16 * 16
    # loads from the node were measured against the worker's own memcpy rate (completion overhead)
    import urllib.request

    request = urllib.request.Request(cluster.control_url + "/metrics", headers=cluster.auth())
    with urllib.request.urlopen(request) as resp:
        metrics = resp.read().decode()
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tiercake_load_overhead_seconds_count")
    )
    assert count >= 4  # pool and ssd at two fractions, at least
    for tier in ("pool", "ssd"):  # load time by the tier the prefix came from
        loads = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith(f'tiercake_prefix_load_seconds_count{{tier="{tier}"}}')
        )
        assert loads >= 2, tier


@pytest.fixture
def faulty(tmp_path):
    up = UpCluster(tmp_path, args=["--decode", "2", "--gpu-blocks", "96", "--pool", "6MiB"])
    yield up
    up.stop()


async def test_decode_worker_killed_mid_request_and_node_agent_killed(faulty):
    await faulty.wait_up(workers=3)
    async with faulty.ops() as ops:  # sizes from the flags
        members = {m.role: m for m in await ops.members()}
        assert members["node"].tiers["pool"] == 6 << 20
        assert members["prefill"].tiers["gpu"] == 96 * 16 * 1024
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        resp = await http.post(faulty.url + "/v1/completions", json=completion(stream=True, max_tokens=800))
        await resp.content.readline()  # streaming from one decode worker
        async with http.get(faulty.control_url + "/v1/members", headers=faulty.auth()) as r:
            decoders = [m for m in (await r.json())["members"] if m["role"] == "decode"]
        pids = []
        for _ in range(50):  # the first token comes from the prefill worker; then a decoder takes over
            for member in decoders:
                async with http.get(member["url"] + "/load", headers=faulty.auth()) as r:
                    if (await r.json())["running"]:
                        async with http.get(member["url"] + "/health") as h:
                            pids.append((await h.json())["pid"])
            if pids:
                break
            await asyncio.sleep(0.05)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        body = (await resp.read()).decode()  # ends, with an error, instead of hanging
        assert "error" in body and body.rstrip().endswith("data: [DONE]")
    async with Client([faulty.url], timeout=60, retries=3) as client, faulty.ops() as ops:
        answer = await client.complete(PROMPT + "After the kill.", max_tokens=5)  # the other decode worker
        assert answer["usage"]["completion_tokens"] == 5
        members = await ops.members()
        node_pid = _pid_listening(next(m for m in members if m.role == "node").port)
        # a node agent that stalls (stopped, as a hung disk or a partition would leave it) is given up
        # on at the deadline its transfers should have met: the request recomputes instead of waiting
        # 30 s per transfer (pull, write-through, decode's pull) behind it, and the requests after it
        # do not wait for it at all (tiercake chaos's stall_node measures the rate through a stall)
        os.kill(node_pid, signal.SIGSTOP)
        try:
            took, answers = [], []
            for i in range(5):
                started = time.monotonic()
                answers.append(await client.complete(PROMPT + f"While the node is stopped, {i}.", max_tokens=5))
                took.append(time.monotonic() - started)
        finally:
            os.kill(node_pid, signal.SIGCONT)
        assert all(a["usage"]["completion_tokens"] == 5 for a in answers) and took[0] < 10, took
        assert max(took[2:]) < 1.0, took
        os.kill(node_pid, signal.SIGKILL)
        # its blocks stop being offered, and requests still complete by recomputing
        answer = await client.complete(PROMPT + "After the node died.", max_tokens=5)
        assert answer["usage"]["completion_tokens"] == 5
        with pytest.raises(ConductorError):
            await client.complete(PROMPT, model="nope")


async def test_api_keys_select_tenants_and_a_shared_namespace_shares_hits(tmp_path):
    recorded = tmp_path / "recorded.jsonl"
    keys = tmp_path / "keys.yaml"  # keys from a file too (a mounted Secret in Kubernetes)
    keys.write_text("key-b: bob\n")
    up = UpCluster(
        tmp_path,
        serving=f", shared_namespace: true, api_keys: {{key-a: alice}}, "
        f"api_keys_file: {keys}, record_trace: {recorded}",
        args=["--workers", "1"],
    )
    try:
        await up.wait_up(workers=1)
        prompt = PROMPT + "Shared."
        async with Client([up.url], token="key-a", timeout=60) as alice:
            assert (await alice.complete(prompt))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with Client([up.url], token="key-b", timeout=60) as bob:  # another tenant, one namespace
            assert (await bob.complete(prompt))["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            await bob.complete(prompt + " And on.", session=Session("conversation-1"))
        async with Client([up.url], token="key-x", timeout=60, retries=1) as stranger:
            with pytest.raises(ConductorError) as err:
                await stranger.complete(prompt)
            assert err.value.status == 401
        # the cluster recorded its own traffic in the trace format: the same prompt, the same ids
        from tiercake.traces import read_trace

        lines = read_trace(recorded)
        assert len(lines) == 3 and lines[0].hash_ids == lines[1].hash_ids and lines[0].tenant == "shared"
        assert lines[0].timestamp <= lines[1].timestamp
        # a session is recorded by its hash, scoped by the tenant that sent it (not the shared namespace)
        assert lines[0].session is None and lines[2].session == session_hash("bob", "conversation-1")
    finally:
        assert "tiercake is down" in up.stop()


async def test_up_on_etcd(tmp_path, etcd):
    up = UpCluster(tmp_path, args=["--workers", "1", "--etcd", ",".join(etcd.endpoints)])
    try:
        await up.wait_up(workers=1)
        async with Client([up.url], timeout=60) as client:
            prompt = PROMPT + "On etcd."
            await client.complete(prompt)
            again = await client.complete(prompt)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        from tiercake.conductor.etcd import EtcdBackend

        meta = await EtcdBackend(etcd.endpoints).start()
        placements, _ = await meta.range(b"/tiercake/placements/")
        members, _ = await meta.range(b"/tiercake/members/")
        await meta.close()
        assert not placements and members  # membership lives in etcd, placements in the conductors' memory
    finally:
        assert "tiercake is down" in up.stop()


def test_replay_a_synthetic_trace_against_the_cluster(cluster, tmp_path):
    from tiercake.traces import synthetic_trace, write_trace

    trace = tmp_path / "syn.jsonl"
    write_trace(trace, synthetic_trace(40, tenants=2, system_blocks=3, turn_blocks=(1, 3), rate_per_s=50, seed=3))
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "replay",
            str(trace),
            "--target",
            cluster.url,
            "--control",
            cluster.control_url,
            "--control-token",
            cluster.token,
            "--max-output",
            "4",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert figures["requests.ok"]["value"] == 40
    hit = figures["hit_ratio.tokens"]
    assert 0.2 < hit["value"] <= hit["limit"] + 0.05  # the cluster reuses what the trace reuses, up to its ceiling
    assert figures["ttft.p50"]["value"] > 0 and png.read_bytes()[:4] == b"\x89PNG"
    by_tier = [f["value"] for name, f in figures.items() if name.startswith("hit_ratio.tokens.")]
    assert by_tier and sum(by_tier) == pytest.approx(hit["value"], abs=0.01)  # the hits, split by source tier
    assert figures["metadata.bytes_per_kv_byte"]["ratio"] >= 1 and figures["metadata.ops_per_request"]["value"] >= 1
    live = figures["prefetchable_share.live"]  # the front's live tracker against the same trace offline
    assert 0 < live["value"] and abs(live["value"] - live["limit"]) < 0.1


async def test_a_full_gpu_tier_is_a_429_with_retry_after_not_a_dead_worker(tmp_path):
    """One worker whose gpu tier a running request holds: a second long prompt cannot be placed. It
    is told to retry (429, Retry-After) because the worker is alive and full, not that no worker
    lives (it was a 503 "no live prefill worker" for two seconds); the worker serves it afterwards."""
    up = UpCluster(tmp_path, args=["--workers", "1", "--gpu-blocks", "24"])
    try:
        await up.wait_up(workers=1)
        async with aiohttp.ClientSession() as http:
            holder = await http.post(
                up.url + "/v1/completions",  # 16 blocks at once, 22 by its end
                json=completion(text="a" * 250, max_tokens=100, stream=True),
            )
            assert holder.status == 200
            await holder.content.readline()  # its first token: it holds its blocks now
            async with http.post(up.url + "/v1/completions", json=completion(text="b" * 250, max_tokens=4)) as resp:
                body = await resp.json()
                assert resp.status == 429, body
                assert resp.headers["Retry-After"] == "1" and body["error"]["code"] == "gpu_full"
                assert "gpu tier is full" in body["error"]["message"]
            rest = await holder.read()  # the running request is not disturbed
            assert b"[DONE]" in rest and b'"error"' not in rest
            holder.release()
            await asyncio.sleep(1)  # as Retry-After says
            async with http.post(up.url + "/v1/completions", json=completion(text="b" * 250, max_tokens=4)) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        up.stop()


async def test_up_makes_a_token_restarts_what_dies_and_takes_everything_down_with_it(tmp_path):
    """``tiercake up`` without a configured token makes one (the control API is never open by
    default), restarts a process that dies (later requests succeed), and when it is killed itself
    its processes exit too, instead of serving on as orphans."""
    up = UpCluster(tmp_path, args=["--workers", "1"], token=None)
    try:
        await up.wait_up(workers=1)
        token_file = tmp_path / "data" / "control-token"
        assert up.token == token_file.read_text().strip() and token_file.stat().st_mode & 0o777 == 0o600
        async with aiohttp.ClientSession() as http:
            async with http.get(up.control_url + "/v1/cluster") as resp:
                assert resp.status == 401
        worker, pid = await up.member_pid("worker")
        # it made a seal secret too, and gave it to the worker alone: a taken-over node agent or
        # conductor could not seal a block a worker would use
        async with up.ops() as ops:
            node_port = next(m for m in await ops.members() if m.role == "node").port
        environ = {
            p: Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            for p in (pid, _pid_listening(node_port), _pid_listening(int(up.control_url.rsplit(":", 1)[1])))
        }
        sealed = {p for p, env in environ.items() if any(e.startswith(b"TIERCAKE_SEAL_SECRET=") for e in env)}
        assert sealed == {pid}
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # restarted, registered again
            with contextlib.suppress(IndexError, aiohttp.ClientError, KeyError):
                if (await up.member_pid("worker"))[1] != pid:
                    break
            await asyncio.sleep(0.3)
        worker, new_pid = await up.member_pid("worker")
        assert new_pid != pid
        async with Client([up.url], timeout=60, retries=5) as client:
            answer = await client.complete(PROMPT + "After a restart.", max_tokens=3)
        assert answer["usage"]["completion_tokens"] == 3
        # the node agent too: restarted on another port, and the workers follow it there (they kept
        # writing to its old address, so a restarted node agent never received another block)
        async with up.ops() as ops:
            node = next(m for m in await ops.members() if m.role == "node")
            node_pid = _pid_listening(node.port)
            # beside it waits a warm spare (imported, not started), which a restart swaps in
            spares: list[int] = []
            for _ in range(100):
                spares = [p for p in _children(up.proc.pid, "tiercake.cli node") if p != node_pid]
                if spares:
                    break
                await asyncio.sleep(0.2)
            assert len(spares) == 1
            os.kill(node_pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(ConductorError, LookupError):
                    nodes = [m for m in await ops.members() if m.role == "node"]
                    if nodes and _pid_listening(nodes[0].port) != node_pid:
                        node = nodes[0]
                        break
                await asyncio.sleep(0.3)
            assert _pid_listening(node.port) == spares[0]  # the spare took over
            # its first blocks sit in the worker's gpu tier from before the restart, and go along again
            prompt = PROMPT + "After a restart. Written to the node agent after its restart."
            async with Client([up.url], timeout=60, retries=5) as client:
                await client.complete(prompt, max_tokens=2)
            # the pool region survives the restart (its blocks are recovered), so wait for the new
            # blocks, not just for the node to hold something
            want = len(prompt.encode()) // 16
            for _ in range(50):
                held = (await ops.prefix(prompt)).holders.get("test-node")
                if held is not None and held.blocks == want:
                    break
                await asyncio.sleep(0.2)
            assert (await ops.prefix(prompt)).holders["test-node"].blocks == want
        pids = {new_pid, _pid_listening(node.port), _pid_listening(int(up.control_url.rsplit(":", 1)[1]))}
        pids |= set(_children(up.proc.pid, "tiercake.cli"))  # the next spare, once it is made, too
        up.proc.kill()  # SIGKILL: no chance to stop anything itself
        up.proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
            await asyncio.sleep(0.2)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}") and _alive(p)]
    finally:
        output = up.stop()
    assert "worker-0 exited with -9" in output and "restarting" in output, output[-2000:]


def _children(parent: int, mentioning: str) -> list[int]:
    """The pids of ``parent``'s live children whose command line mentions ``mentioning``."""
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if entry.isdigit() and int(stat[1]) == parent and stat[0] != "Z" and mentioning in line:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent's reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_tenant_quotas_refuse_one_tenant_with_429s_and_leave_the_other_served(tmp_path):
    """alice may have one request in flight; bob 300 tokens (prompt + max_tokens) a minute. While
    alice streams, her second request is a 429 and bob's are served; bob's third request within the
    minute is a 429 with the wait in Retry-After; one larger than a minute's worth is a 400."""
    up = UpCluster(
        tmp_path,
        serving=", api_keys: {key-a: alice, key-b: bob}, quota: {requests_in_flight: 1}, "
        "tenant_quotas: {bob: {tokens_per_minute: 300}}",
        args=["--workers", "1"],
    )
    try:
        await up.wait_up(workers=1)
        alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        async with aiohttp.ClientSession() as http:
            stream = await http.post(
                up.url + "/v1/completions", headers=alice, json=completion(text="a" * 40, max_tokens=200, stream=True)
            )
            assert stream.status == 200
            await stream.content.readline()  # alice's first request is being served
            async with http.post(up.url + "/v1/completions", headers=alice, json=completion(max_tokens=2)) as resp:
                body = await resp.json()
                assert resp.status == 429 and body["error"]["code"] == "tenant_quota", body
                assert "requests in flight" in body["error"]["message"] and resp.headers["Retry-After"] == "1"
            bob_prompt = "b" * 100
            for _ in range(2):  # 150 tokens each, while alice's stream runs: bob is not held back by her
                async with http.post(
                    up.url + "/v1/completions", headers=bob, json=completion(text=bob_prompt, max_tokens=50)
                ) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.post(
                up.url + "/v1/completions", headers=bob, json=completion(text=bob_prompt, max_tokens=50)
            ) as resp:
                body = await resp.json()
                assert resp.status == 429 and body["error"]["code"] == "tenant_quota", body
                assert 20 <= int(resp.headers["Retry-After"]) <= 31  # 150 tokens at 5 a second
            async with http.post(
                up.url + "/v1/completions", headers=bob, json=completion(text="b" * 300, max_tokens=50)
            ) as resp:
                assert resp.status == 400 and "per minute" in (await resp.json())["error"]["message"]
            rest = await stream.read()
            assert b"[DONE]" in rest and b'"error"' not in rest  # alice's stream was never disturbed
            stream.release()
            async with http.post(up.url + "/v1/completions", headers=alice, json=completion(max_tokens=2)) as resp:
                assert resp.status == 200  # her slot is free again
    finally:
        up.stop()


async def test_tls_on_every_http_api_of_the_cluster(tmp_path):
    """With tls configured, the public API, the control API and the workers' API serve https only:
    a completion goes front -> worker over https, a client that does not trust the CA is refused, and
    plain http gets nothing. With transfer.tls the node agent's transfer port speaks TLS too: the
    worker's blocks reach it (and come back) through it, and nothing on it is in the clear."""
    import socket
    import ssl

    cert, key = self_signed(tmp_path)
    up = UpCluster(
        tmp_path,
        args=["--workers", "1"],
        extra=f"tls: {{cert_file: {cert}, key_file: {key}, ca_file: {cert}}}\ntransfer: {{tls: true}}\n",
    )
    try:
        assert up.url.startswith("https://") and up.control_url.startswith("https://")
        await up.wait_up(workers=1)
        async with up.ops() as ops:
            worker = next(m for m in await ops.members() if m.role == "worker")
        assert worker.url.startswith("https://")
        async with Client([up.url], timeout=60, ssl=ssl.create_default_context(cafile=str(cert))) as client:
            answer = await client.complete(PROMPT + "Over TLS.", max_tokens=3)
        assert answer["usage"]["completion_tokens"] == 3
        async with up.ops() as ops:  # the worker wrote its blocks through to the node, over the TLS port
            node = next(m for m in await ops.members() if m.role == "node")
            for _ in range(100):
                view = await ops.cluster()
                if any(m.id == node.node_id and m.indexed_bytes.get("pool", 0) for m in view.members):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the node never reported the worker's blocks")
        with socket.create_connection((node.host, node.port), timeout=5) as raw:
            raw.settimeout(0.5)
            with pytest.raises(TimeoutError):  # no HELLO in the clear: it waits for a TLS ClientHello
                raw.recv(64)
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):  # the system does not trust it
                await http.get(up.url + "/v1/models")
            with pytest.raises(aiohttp.ClientError):
                await http.get(up.url.replace("https://", "http://") + "/v1/models")
            with pytest.raises(aiohttp.ClientError):
                await http.post(worker.url.replace("https://", "http://") + "/generate", json={})
    finally:
        up.stop()


async def test_workers_serve_their_own_metrics(cluster):
    """Each worker's /metrics, scraped as Prometheus does (no token): its queue, its KV blocks, the
    sequences it finished and its gpu tier, read at the scrape; its work endpoints stay closed."""
    from prometheus_client.parser import text_string_to_metric_families

    async with Client([cluster.url], timeout=60) as client:
        await client.complete(PROMPT + "Per-worker metrics.", max_tokens=3)
    async with aiohttp.ClientSession() as http:
        async with http.get(cluster.control_url + "/v1/members", headers=cluster.auth()) as resp:
            workers = [m for m in (await resp.json())["members"] if m.get("url")]
        assert {w["role"] for w in workers} == {"prefill", "decode"}
        for worker in workers:
            async with http.get(worker["url"] + "/metrics") as resp:
                assert resp.status == 200
                samples = {
                    (x.name, x.labels.get("tier")): x.value
                    for f in text_string_to_metric_families(await resp.text())
                    for x in f.samples
                    if x.labels.get("member", x.labels.get("worker")) == worker["node_id"]
                }
            assert samples[("tiercake_worker_kv_blocks", None)] == 128, samples
            assert samples[("tiercake_worker_sequences_completed_total", None)] >= 1
            assert 0 <= samples[("tiercake_worker_kv_free_blocks", None)] <= 128
            assert ("tiercake_tier_used_bytes", "gpu") in samples
            async with http.post(worker["url"] + "/generate", json={"tokens": [1], "max_tokens": 1}) as resp:
                assert resp.status == 401  # /metrics is open, the work is not


def test_the_shipped_dashboard_queries_only_series_the_cluster_exports(cluster):
    """deploy/grafana/tiercake-dashboard.json: every metric a panel queries is one a running cluster
    exports (scraped without a token, as Prometheus does)."""
    import re
    import urllib.request

    dashboard = json.loads((ROOT / "deploy/grafana/tiercake-dashboard.json").read_text())
    wanted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"tiercake_[a-z_]+", target["expr"])
    }
    with urllib.request.urlopen(cluster.control_url + "/metrics") as resp:
        exported = resp.read().decode()
    families = set(re.findall(r"^# TYPE (\S+) ", exported, re.M))
    series = set(re.findall(r"^(tiercake_[a-z_]+)", exported, re.M))

    def known(name: str) -> bool:
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        return name in series or name in families or base in families or f"{base}_total" in families

    assert len(wanted) >= 12 and not [n for n in sorted(wanted) if not known(n)], sorted(
        n for n in wanted if not known(n)
    )


def test_the_official_openai_client_works_against_the_front(cluster):
    """What most users run: OpenAI's own Python client, pointed at the front."""
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    text = client.completions.create(model=MODEL, prompt=PROMPT + "OpenAI client.", max_tokens=4, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 4
    messages = [{"role": "user", "content": PROMPT + "Chatting through the client."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(again)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=2)
    assert "best_of: 2 is not supported" in str(err.value)
    scored = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, n=2, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in scored.choices] == [0, 1]
    for choice in scored.choices:
        entries = choice.logprobs.content
        assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


async def test_n_answers_and_lists_of_prompts(cluster):
    """``n`` answers per prompt and a list of prompts: choice i*n+j is prompt i's j-th answer, whole or
    streamed; with a seed, each answer samples with its own (seed+j), so they differ and repeat."""
    first, second = PROMPT + "Many answers, one.", PROMPT + "Many answers, two!"
    async with aiohttp.ClientSession() as http:

        async def ask(**kw) -> dict:
            async with http.post(cluster.url + "/v1/completions", json=completion(**kw)) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        alone = [(await ask(text=p, max_tokens=5))["choices"][0]["text"] for p in (first, second)]
        both = await ask(text=[first, second], n=2, max_tokens=5)
        assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in both["choices"]] == [alone[0], alone[0], alone[1], alone[1]]  # greedy
        usage = both["usage"]
        assert usage["prompt_tokens"] == len(first.encode()) + len(second.encode())  # each prompt once
        assert usage["completion_tokens"] == 4 * 5

        sampled = await ask(text=first, n=3, max_tokens=8, temperature=1.0, seed=7)
        texts = [c["text"] for c in sampled["choices"]]
        assert len(set(texts)) > 1, texts  # seed+j: not three copies of one sample
        assert [
            c["text"] for c in (await ask(text=first, n=3, max_tokens=8, temperature=1.0, seed=7))["choices"]
        ] == texts  # and reproducible

        async with http.post(
            cluster.url + "/v1/completions",
            json=completion(text=[first, second], max_tokens=5, stream=True, stream_options={"include_usage": True}),
        ) as resp:
            events = [
                json.loads(line[6:]) for line in (await resp.read()).decode().splitlines() if line.startswith("data: {")
            ]
        streamed: dict[int, str] = {}
        finished = set()
        for event in events:
            for c in event["choices"]:
                streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finished.add(c["index"])
        assert streamed == {0: alone[0], 1: alone[1]} and finished == {0, 1}
        assert events[-1]["usage"]["completion_tokens"] == 10


async def test_logprobs_score_each_token_and_do_not_change_with_the_cache(cluster):
    """Each token's log-probability and its most likely alternatives (greedy: the token is the top
    one); a second request served from the cache scores its tokens exactly as the first computed
    them; the stream carries the same figures token by token."""
    prompt = PROMPT + "Scored tokens, twice."
    async with aiohttp.ClientSession() as http:

        async def ask(**kw) -> dict:
            async with http.post(
                cluster.url + "/v1/completions", json=completion(text=prompt, max_tokens=6, logprobs=3, **kw)
            ) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        cold = await ask()
        warm = await ask()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        lp = cold["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
        raw = bytes(int(t[len("bytes:\\x") :], 16) if t.startswith("bytes:") else ord(t) for t in lp["tokens"])
        assert raw.decode("utf-8", errors="replace") == cold["choices"][0]["text"]  # every token, named uniquely
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(top) == 3 and logprob <= 0
            best = max(top.values())
            assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(best)  # greedy: the top one
            assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-9
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert warm["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)

        async with http.post(
            cluster.url + "/v1/completions", json=completion(text=prompt, max_tokens=6, logprobs=3, stream=True)
        ) as resp:
            events = [
                json.loads(line[6:]) for line in (await resp.read()).decode().splitlines() if line.startswith("data: {")
            ]
        streamed = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-4)

        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2,
            "temperature": 0,
            "logprobs": True,
        }
        async with http.post(cluster.url + "/v1/chat/completions", json=chat) as resp:
            content = (await resp.json())["choices"][0]["logprobs"]["content"]
        assert [len(e["bytes"]) for e in content] == [1, 1] and all(e["top_logprobs"] == [] for e in content)


async def test_stop_strings_and_stop_token_ids_end_the_answer_before_them(cluster):
    """The answer ends before the first stop string it would contain (finish_reason "stop"), whole or
    streamed (a stream never shows the start of a stop it then cuts), or before a stop token id."""
    prompt = PROMPT + "Stop sequences."
    async with aiohttp.ClientSession() as http:

        async def ask(**kw) -> dict:
            async with http.post(
                cluster.url + "/v1/completions", json=completion(text=prompt, max_tokens=16, **kw)
            ) as r:
                return await r.json()

        full = (await ask())["choices"][0]["text"]
        # a stop the answer contains: an ASCII character (one byte, one token of the byte tokenizer), the
        # one that first appears deepest in the answer
        firsts = {ch: full.index(ch) for ch in set(full) if ch.isascii() and ch.isprintable()}
        assert firsts, full
        cut, stop = max((at, ch) for ch, at in firsts.items())
        stopped = await ask(stop=[stop, "never-in-this-answer"])
        assert stopped["choices"][0]["text"] == full[:cut] and stopped["choices"][0]["finish_reason"] == "stop"
        async with http.post(
            cluster.url + "/v1/completions", json=completion(text=prompt, max_tokens=16, stop=stop, stream=True)
        ) as resp:
            events = [
                json.loads(line[6:]) for line in (await resp.read()).decode().splitlines() if line.startswith("data: {")
            ]
        assert "".join(e["choices"][0]["text"] for e in events) == full[:cut]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        by_id = await ask(stop_token_ids=[ord(stop)])  # the same character as a token id
        assert by_id["choices"][0] == {**by_id["choices"][0], "text": full[:cut], "finish_reason": "stop"}
        longer = await ask(stop=[full[cut : cut + 2] + "\u2603"])  # a stop that starts in the answer, then differs
        assert longer["choices"][0]["text"] == full and longer["choices"][0]["finish_reason"] == "length"
        for bad in ({"stop": ["a", "b", "c", "d", "e"]}, {"stop": [""]}, {"stop_token_ids": ["x"]}):
            async with http.post(cluster.url + "/v1/completions", json=completion(**bad)) as resp:
                assert resp.status == 400, bad
        async with http.post(
            cluster.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16,
                "temperature": 0,
                "stop": ["\n", "."],
            },
        ) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] in ("stop", "length")


async def test_top_p_reaches_the_sampler(cluster):
    """top_p so small that only the likeliest token is left: sampling at temperature 1 gives the greedy
    answer whatever the seed; at top_p 1 the seeds give different answers."""
    async with Client([cluster.url], timeout=60) as client:
        greedy = (await client.complete(PROMPT + "Nucleus.", max_tokens=8))["choices"][0]["text"]
        narrow = {
            (await client.complete(PROMPT + "Nucleus.", max_tokens=8, temperature=1.0, top_p=1e-6, seed=s))["choices"][
                0
            ]["text"]
            for s in range(4)
        }
        wide = {
            (await client.complete(PROMPT + "Nucleus.", max_tokens=8, temperature=1.0, seed=s))["choices"][0]["text"]
            for s in range(4)
        }
    assert narrow == {greedy} and len(wide) > 1


def test_replay_with_sessions_sends_them_and_reports_the_turns_after_a_pause(cluster, tmp_path):
    """`tiercake replay --sessions` on a trace without sessions: inferred, sent as headers (a bad one
    would be a 400, a failed request here), and the resumed turns' TTFT reported apart."""
    from tiercake.agent_traces import agentic_trace
    from tiercake.traces import write_trace

    records = agentic_trace(sessions=4, seed=2, agent_share=1.0, agent_turns=(2, 3), tool_pause_s=0.3, rate_per_s=5)
    blank = dict(session=None, turn=None, pause_ms=None, closes=None, fork_of=None)
    trace = tmp_path / "agents.jsonl"
    write_trace(trace, [r.model_copy(update=blank) for r in records])
    out = tmp_path / "replay.json"
    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", "replay", str(trace), "--target", cluster.url, "--control",
         cluster.control_url, "--control-token", cluster.token, "--max-output", "4", "--sessions",
         "--tokens-per-block", "16", "--json", str(out), "--plot", str(tmp_path / "r.png")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert figures["requests.ok"]["value"] == len(records)
    resumed = figures["ttft.resumed.p90"]
    assert resumed["params"]["turns"] == sum(1 for r in records if r.turn) and resumed["value"] > 0
