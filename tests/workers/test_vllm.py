"""tiercake under real vLLM: two `vllm serve` processes with the TiercakeConnector, a conductor and a
node agent as processes, a small Llama made locally. Greedy outputs with KV loaded from tiercake must
equal the outputs computed from scratch, wherever the KV came from, and a block that cannot be
loaded must be recomputed, never served wrong."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
import yaml
from paths import shm_file

from tiercake.bench.vllm import conversation_prompts, own_cache_hits, vllm_counter
from tiercake.bench.vllm_requests import held_and_cold
from tiercake.blocks import Namespace, block_keys, seal_material, sealer_for
from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.conductor.front.sessions import session_hash
from tiercake.config import TiercakeConfig
from tiercake.tiers.pool import remove_pool
from tiercake.tiers.ssd.log import block_payloads
from tiercake.traces import synthetic_trace
from tiercake.transfer import TransferEngine
from tiercake.up import NodeCluster, stop_all
from tiercake.up_vllm import VllmServer, vllm_worker
from tiercake.workers.vllm.process import serve_command
from tiercake.workers.vllm.tiny_model import make_tiny_llama

# the first test starts two vLLM servers for the module (45-60 s, more while the other test process
# runs beside it): more than the suite's default limit of 120 s leaves for the test itself
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]  # every test here starts processes

SECRET = "vllm-test-secret-0123456789abcdef"
SEAL_SECRET = "vllm-test-seal-secret-0123456789"  # the vLLM instances have it; the node agent does not
TOKEN = "vllm-test-control-token"  # the control API asks for it: the connector must present it
MODEL = "tiny-llama"
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
PROMPT_BLOCKS = 8
# /reset_prefix_cache (a dev-mode endpoint), and the engine core in the server's process: on these 2
# cores a server starts in about 30 s instead of 45 (with --enforce-eager, no compilation, instead of 90)
FAST_START = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def tiercake_config(root: Path, model: Path | None = None) -> TiercakeConfig:
    return TiercakeConfig.model_validate(
        {
            "node_id": "vllm-node",
            "model_id": MODEL,
            "serving": {"tokenizer": str(model) if model else None},  # the front tokenizes as vLLM does
            "store": {
                "layout": None,
                "tiers": [
                    {
                        "kind": "pool",
                        "capacity": "64MiB",
                        "path": str(shm_file(f"vllm-test-{uuid.uuid4().hex[:12]}")),
                    },
                    {"kind": "ssd", "capacity": "256MiB", "path": str(root / "ssd")},
                ],
            },
            "conductor": {"member_ttl": 2},
        }
    )


class Vllm(VllmServer):
    """``vllm serve`` with the connector, as a user would start it."""

    def __init__(self, name: str, model: Path, tc: NodeCluster) -> None:
        port = free_port()
        super().__init__(
            serve_command(
                model,
                MODEL,
                port,
                tc.url,
                "vllm-node",
                block_size=BLOCK,
                max_model_len=2048,
                kv_events=(free_port(), free_port()),
                extra=["--enforce-eager"],
            ),  # no compilation: a minute less to start
            {**tc.env, **FAST_START},
            tc.root / f"{name}.log",
            port,
        )

    async def complete(self, tokens: list[int], max_tokens: int = 12) -> dict:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

    async def complete_together(self, prompts: list[list[int]], max_tokens: int = 12) -> list[dict]:
        """One request of several prompts (vLLM hands them to its engine at once): a reply each."""
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                reply = await resp.json()
        return [{**reply, "choices": [c]} for c in sorted(reply["choices"], key=lambda c: c["index"])]

    async def reset_prefix_cache(self) -> None:
        await reset_prefix_cache(self.url)


async def reset_prefix_cache(url: str) -> None:
    """vLLM forgets its own prefix cache (a dev-mode endpoint: VLLM_SERVER_DEV_MODE=1)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/reset_prefix_cache") as resp:
            assert resp.status == 200 and (await resp.json())["success"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def served(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("vllm")
    tc = NodeCluster(
        tiercake_config(root, model),
        root,
        {
            **os.environ,
            "TIERCAKE_SECRET": SECRET,
            "TIERCAKE_SEAL_SECRET": SEAL_SECRET,
            "TIERCAKE_TOKEN": f"{TOKEN} a-second-token",
        },
    )  # as the Secret holds them
    engines = []
    try:
        engines = [Vllm(name, model, tc) for name in ("a", "b")]
        for i, name in enumerate(("a", "b")):
            engines[i] = started(engines[i], lambda name=name: Vllm(name, model, tc))
        yield tc, engines[0], engines[1]
    finally:
        for engine in engines:
            engine.stop()
        tc.close()
        remove_pool(tc.config.store.tiers[0].path)


def started(engine: Vllm, again, tries: int = 3) -> Vllm:
    """``engine`` once it answers; started ``again`` (fresh ports) where one of the loopback ports picked
    for it was taken before vLLM bound it (another process's connection got it meanwhile: vLLM then
    exits with ZMQ's "Address already in use")."""
    for attempt in range(tries):
        try:
            engine.wait_ready()
            return engine
        except RuntimeError:
            engine.stop()
            if "Address already in use" not in engine.log_path.read_text(errors="replace") or attempt == tries - 1:
                raise
            engine = again()
    raise AssertionError("unreachable")


def prompt(seed: int) -> list[int]:
    """Token ids of a prompt nobody sent before: PROMPT_BLOCKS full blocks and a few tokens more."""
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(PROMPT_BLOCKS * BLOCK + 5)]


def answer(reply: dict) -> str:
    return reply["choices"][0]["text"]


def tiercake(reply: dict) -> dict:
    """The connector's figures for the request (its kv_transfer_params)."""
    return (reply.get("kv_transfer_params") or {}).get("tiercake") or {}


def loaded(reply: dict) -> int:
    """Prompt tokens vLLM loaded from tiercake (planned and not failed)."""
    return tiercake(reply).get("loaded_tokens", 0)


def planned(reply: dict) -> int:
    """Prompt tokens vLLM was told it could load (some may then have failed and been recomputed)."""
    return tiercake(reply).get("planned_load_tokens", 0)


def cached(reply: dict) -> int:
    return ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def indexed(tc: NodeCluster, tier: str) -> int:
    """Bytes of the node's blocks the index shows in ``tier`` now."""
    async with Client([tc.url], token=TOKEN) as client:
        node = next((m for m in (await client.cluster()).members if m.id == "vllm-node"), None)
    return 0 if node is None else node.indexed_bytes.get(tier, 0)


async def wait_indexed(
    tc: NodeCluster | str, tier: str, at_least: int, only: bool = False, timeout: float = 30
) -> None:
    """Until the index shows ``at_least`` bytes of the node's blocks in ``tier`` (``only``: and none in
    the node's other tiers)."""
    async with Client([tc if isinstance(tc, str) else tc.url], token=TOKEN) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = await client.cluster()
            node = next((m for m in view.members if m.id == "vllm-node"), None)
            if (
                node is not None
                and node.indexed_bytes.get(tier, 0) >= at_least
                and (not only or all(v == 0 for t, v in node.indexed_bytes.items() if t != tier))
            ):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the node's {tier} tier never held {at_least} indexed bytes")


async def after_reset(engine: Vllm, tokens: list[int], tries: int = 3) -> dict:
    """``tokens`` completed after vLLM forgot its prefix cache, once the connector's index of its
    node's pool shows them (reread every 50 ms, a little less often on a busy machine: a second is
    many rereads, and a few seconds are allowed) or after ``tries`` attempts."""
    for _ in range(tries):
        await engine.reset_prefix_cache()
        await asyncio.sleep(1.0)
        reply = await engine.complete(tokens)
        if tiercake(reply).get("lookup_local"):
            break
    return reply


BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 2  # layers x (K, V) x tokens x kv heads x head size x bf16


async def test_same_instance_loads_its_own_blocks_back_after_its_prefix_cache_is_reset(served):
    tc, a, _ = served
    tokens = prompt(1)
    first = await a.complete(tokens)
    assert loaded(first) == 0 and cached(first) == 0  # computed from scratch
    await wait_indexed(tc, "pool", PROMPT_BLOCKS * BLOCK_BYTES)
    again = await after_reset(a, tokens)
    assert loaded(again) == PROMPT_BLOCKS * BLOCK and cached(again) >= PROMPT_BLOCKS * BLOCK
    # found in the node's pool index read in place, without asking the conductor
    assert tiercake(again)["lookup_local"] is True, tiercake(again)["local_index"]
    assert tiercake(again)["lookup_s"] < 0.05
    # and read by the index entries that lookup found, with no lease round trip
    assert tiercake(again)["load_unleased_tokens"] == PROMPT_BLOCKS * BLOCK
    assert tiercake(again)["load_bytes"] == PROMPT_BLOCKS * BLOCK_BYTES and tiercake(again)["load_s"] > 0
    # loaded layer by layer beside the forward pass: it waited for part of the load at most
    assert 0 <= tiercake(again)["load_wait_s"] <= tiercake(again)["load_s"]
    async with aiohttp.ClientSession() as http:  # the control API is closed: the connector got in with the token
        async with http.get(tc.url + "/v1/members") as resp:
            assert resp.status == 401
    assert answer(again) == answer(first)
    # the comparison is sensitive: the same prompt with another first block answers otherwise, so an
    # answer from wrongly loaded KV would show
    variant = await a.complete([(t + 1) % 500 + 3 for t in tokens[:BLOCK]] + tokens[BLOCK:])
    assert answer(variant) != answer(first)


async def test_the_vllm_benchs_requests_load_each_held_prefix_and_time_the_same_prompt_cold(served):
    """`bench vllm`'s protocol (``held_and_cold``, also what it times on its peers) on a real instance:
    each held prefix is loaded by the connector, as vLLM's cached_tokens say (it raises otherwise),
    after a reset vLLM confirmed; the cold request is the same prompt under another salt, computed."""
    _, a, b = served
    samples = await held_and_cold(a.url, 8 * BLOCK, 1, model=MODEL, pause=1.0, first_round=50, other=b.url)
    assert sorted(samples) == ["across50", "across90", "cold50", "cold90", "held50", "held90"]
    for pct, blocks in (("50", 4), ("90", 7)):
        (seconds, held), (_, cold) = samples[f"held{pct}"][0], samples[f"cold{pct}"][0]
        assert seconds > 0 and loaded(held) == blocks * BLOCK
        assert tiercake(held)["lookup_local"] is True, tiercake(held)["local_index"]
        assert loaded(cold) == 0 and cached(cold) == 0 and answer(cold) == answer(held)
        # the second instance loaded the prefix the first saved (the same prefix, another ending)
        across = samples[f"across{pct}"][0][1]
        assert loaded(across) == blocks * BLOCK and tiercake(across)["lookup_local"] is True


async def test_another_instance_on_the_node_loads_from_the_pool(served):
    tc, a, b = served
    tokens = prompt(2)
    first = await a.complete(tokens)
    await wait_indexed(tc, "pool", 2 * PROMPT_BLOCKS * BLOCK_BYTES)
    await asyncio.sleep(0.2)
    other = await b.complete(tokens)
    assert loaded(other) == PROMPT_BLOCKS * BLOCK and cached(other) >= PROMPT_BLOCKS * BLOCK
    assert tiercake(other)["lookup_local"] is True  # the same node's pool: its index answered
    assert tiercake(other)["load_unleased_tokens"] == PROMPT_BLOCKS * BLOCK
    assert answer(other) == answer(first)


async def test_blocks_come_back_from_ssd_after_the_node_agent_restarts(served):
    tc, a, _ = served
    tokens = prompt(3)
    in_pool, on_ssd = await indexed(tc, "pool"), await indexed(tc, "ssd")  # (the module's earlier tests')
    first = await a.complete(tokens)
    await wait_indexed(tc, "pool", in_pool + PROMPT_BLOCKS * BLOCK_BYTES)
    async with Client([tc.url], token=TOKEN) as client:
        await client.flush(["pool"])  # down to SSD
    held = on_ssd + in_pool + PROMPT_BLOCKS * BLOCK_BYTES
    await wait_indexed(tc, "ssd", held, only=True)
    tc.restart_node()  # a new process: the pool is gone, the SSD index is rebuilt from the files
    await wait_indexed(tc, "ssd", held, only=True)
    await a.reset_prefix_cache()
    again = await a.complete(tokens)
    assert loaded(again) == PROMPT_BLOCKS * BLOCK and cached(again) >= PROMPT_BLOCKS * BLOCK
    assert answer(again) == answer(first)


async def test_a_corrupt_block_is_recomputed(served):
    tc, a, b = served
    tokens = prompt(4)
    on_ssd = await indexed(tc, "ssd")  # (what the module's earlier tests left there)
    first = await a.complete(tokens)
    async with Client([tc.url], token=TOKEN) as client:
        await client.flush(["pool"])
    await wait_indexed(tc, "ssd", on_ssd + PROMPT_BLOCKS * BLOCK_BYTES, only=True)
    for path, offset, length in block_payloads(tc.root / "ssd")[-PROMPT_BLOCKS:]:  # this prompt's blocks
        with open(path, "r+b") as f:  # one flipped byte in the payload
            f.seek(offset + length // 2)
            byte = f.read(1)[0]
            f.seek(offset + length // 2)
            f.write(bytes([byte ^ 0xFF]))
    other = await b.complete(tokens)
    # it was told the blocks were there; from the corrupt one on, loading failed and vLLM recomputed
    assert planned(other) == PROMPT_BLOCKS * BLOCK and loaded(other) < planned(other)
    assert answer(other) == answer(first)


async def test_blocks_forged_with_the_transfer_secret_are_recomputed_never_used(served):
    """The attack a probe made: someone holding the cluster's transfer secret (not the seal secret)
    deletes a prompt's blocks on the node and writes another prompt's real KV under their keys,
    sealed with a key of its own. The next instance to load them refuses every one by its seal, behind
    the pass: vLLM throws away what the pass made of them and recomputes (its log says so), for two
    requests sent together that share the forged blocks too."""
    tc, a, b = served
    victim, decoy = prompt(21), prompt(22)
    longer = victim[: PROMPT_BLOCKS * BLOCK] + prompt(23)[: 2 * BLOCK + 3]  # the same blocks, and more
    reference = await a.complete(victim)  # computed from scratch, saved to the node
    reference_longer = await a.complete(longer)
    ns = Namespace(**tiercake(reference)["namespace"])
    keys = {name: block_keys(ns, tokens)[:PROMPT_BLOCKS] for name, tokens in (("victim", victim), ("decoy", decoy))}
    await a.complete(decoy)
    async with Client([tc.url], token=TOKEN) as client:
        for name in keys:
            await wait_held(client, keys[name])
        node = next(m for m in await client.members() if m.node_id == "vllm-node")
        forger = TransferEngine("forger", SECRET.encode())
        forger.add_peer(node.node_id, node.host, node.port)
        stolen = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(PROMPT_BLOCKS)]
        assert all(r.ok for r in await forger.read_blocks(node.node_id, keys["decoy"], stolen))
        assert all(r.ok for r in await forger.delete_blocks(node.node_id, keys["victim"]))
        await wait_held(client, keys["victim"], held=False)
        own = sealer_for(seal_material(b"the forger's own seal secret"), "")
        written = await forger.write_blocks(
            node.node_id,
            keys["victim"],
            stolen,
            chain=True,
            tenant="default",
            seals=[own.seal(k, s.numpy()) for k, s in zip(keys["victim"], stolen)],
        )
        assert all(r.ok for r in written)
        await forger.close()
        await wait_held(client, keys["victim"])
    logged = b.log_path.stat().st_size
    # one request of both prompts: vLLM's engine takes them in one step (its log below: "2 request(s)
    # rescheduled"), the longer one sharing the blocks the first loads
    other, other_longer = await b.complete_together([victim, longer])
    # told the blocks were there, it read them, refused each by its seal and recomputed
    assert planned(other) == PROMPT_BLOCKS * BLOCK
    assert answer(other) == answer(reference) and answer(other_longer) == answer(reference_longer)
    with open(b.log_path, errors="replace") as log:
        log.seek(logged)
        assert "failed its seal" in (text := log.read())  # the connector refused them
        assert "Recovered from KV load failure" in text  # and vLLM's scheduler threw away and recomputed


async def wait_held(client: Client, keys: list[bytes], held: bool = True, timeout: float = 60) -> None:
    """Until the index shows the node holding the whole chain (``held``), or not its first block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holding = (await client.lookup("default", keys)).get("vllm-node")
        length = 0 if holding is None else holding.length
        if (length == len(keys)) if held else length == 0:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the index never showed the node {'holding' if held else 'without'} the chain")


async def test_a_dead_node_agent_means_recomputing_or_reading_its_pool_in_place(served):
    """Its blocks stay in the conductor's index until its lease runs out. What it held can no longer be
    leased or read from it: recomputed. Its shared pool outlives it, though, with its index: a
    connector that read the blocks' entries before may still read them in place (the seals and the
    entries are checked as ever), which is correct too. Either way the answer is the same, at once."""
    tc, a, b = served
    tokens = prompt(5)
    first = await a.complete(tokens)
    keys = block_keys(Namespace(**tiercake(first)["namespace"]), tokens)[:PROMPT_BLOCKS]
    async with Client([tc.url], token=TOKEN) as client:
        # this prompt's blocks (the pool holds earlier tests' already: its bytes say nothing of these)
        await wait_held(client, keys)
    tc.node.proc.kill()  # SIGKILL
    tc.node.proc.wait()
    killed = time.monotonic()
    try:
        other = await b.complete(tokens)
        if planned(other) == 0:  # the index dropped the dead agent's placements first: its lease (2 s) lapsed
            assert time.monotonic() - killed > 2.0, f"told nothing of blocks still indexed: {tiercake(other)}"
        else:
            assert planned(other) == PROMPT_BLOCKS * BLOCK
        assert loaded(other) in (0, PROMPT_BLOCKS * BLOCK)
        assert tiercake(other)["load_unleased_tokens"] == loaded(other)  # never through the dead agent
        assert answer(other) == answer(first)
    finally:
        tc.node = tc.start_node()  # the module's later tests need it, whatever this one found


async def test_running_instances_ride_through_a_node_agent_restart_and_load_from_its_adopted_pool(served):
    """The node agent killed (SIGKILL) and started again while both vLLM servers keep running: the new
    process adopts the pool its predecessor left (the region carries its index), reports it, and an
    instance that never saw the prompt loads it from there; the connectors reconnect on their own."""
    tc, a, b = served
    tokens = prompt(6)
    first = await a.complete(tokens)
    keys = block_keys(Namespace(**tiercake(first)["namespace"]), tokens)[:PROMPT_BLOCKS]
    async with Client([tc.url], token=TOKEN) as client:
        await wait_held(client, keys)
        os.killpg(tc.node.proc.pid, signal.SIGKILL)
        tc.node.proc.wait()
        tc.node = tc.start_node()
        await wait_held(client, keys)  # re-reported by the new process, from the pool it adopted
        held = (await client.lookup("default", keys))["vllm-node"]
        assert held.tiers == {"pool": PROMPT_BLOCKS}, held.tiers
    other = await b.complete(tokens)
    assert loaded(other) == PROMPT_BLOCKS * BLOCK and answer(other) == answer(first)


@pytest.mark.timeout(400)
async def test_tiercake_up_starts_the_front_the_tiers_and_vllm_with_the_connector(tmp_path, model):
    """The one command: `tiercake up --engine vllm --model DIR --vllm-prefill 1 --vllm-decode 1` serves
    tiercake's front on --port over two vLLM servers with the connector (a tiercake worker beside each):
    the prefill server computes a prompt and saves its blocks, the decode server loads them through
    tiercake and generates; blocks come back from tiercake once vLLM's own caches are reset; the
    prefill server SIGKILLed is restarted by up and answers the same from the pool; Ctrl-C stops it all. (Combined workers, `--vllm N`, are the same code with another role; the routing tests
    run them. up restarts a child that dies with the same supervisor for every kind of child:
    test_serving's up test kills a worker and watches it come back.)"""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(tiercake_config(tmp_path).model_dump(mode="json")))
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercake.cli",
            "up",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--port",
            str(port),
            "--vllm-prefill",
            "1",
            "--vllm-decode",
            "1",
            "--vllm-arg=--enforce-eager",
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        env={**os.environ, **FAST_START, "TIERCAKE_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        lines = []
        while not any("tiercake is up under vLLM" in line for line in lines):
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, "".join(lines)
            lines.append(line)
        front = f"http://127.0.0.1:{port}"
        assert f"up under vLLM: {front} " in lines[-1] and "(1 prefill, 1 decode)" in lines[-1]
        conductor = re.search(r"conductor (http://\S+?),", lines[-1]).group(1)
        vllm, decoder = re.search(r"TiercakeConnector: (http://\S+?), (http://\S+?);", lines[-1]).groups()
        tokens = prompt(9)
        body = {"model": model.name, "prompt": tokens, "max_tokens": 12, "temperature": 0}
        async with aiohttp.ClientSession() as http:
            before = [await vllm_counter(http, url, "vllm:request_success_total") for url in (vllm, decoder)]
            async with http.post(front + "/v1/completions", json=body) as resp:  # through the front
                assert resp.status == 200, await resp.text()
                first = await resp.json()
            # one step on each: the decode server never saw the prompt, it loaded every full block
            assert [
                await vllm_counter(http, url, "vllm:request_success_total") - was
                for url, was in zip((vllm, decoder), before)
            ] == [1, 1]
            assert first["usage"]["tiercake"]["decode_cached_tokens"] == PROMPT_BLOCKS * BLOCK
            await wait_indexed(conductor, "pool", PROMPT_BLOCKS * BLOCK_BYTES)  # saved in the background
            for url in (vllm, decoder):
                await reset_prefix_cache(url)
            async with http.post(front + "/v1/completions", json=body) as resp:
                again = await resp.json()
        # the prefill server's cache was empty: every full block came from tiercake's pool
        assert cached(first) == 0 and cached(again) == PROMPT_BLOCKS * BLOCK and answer(again) == answer(first)
        # the prefill server killed: up restarts it, and the same prompt gets the same answer, its
        # blocks loaded from the pool into the new server's empty cache
        (pid,) = _pids_serving(vllm.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        while not any("restarting" in line for line in lines):
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, "".join(lines)
            lines.append(line)
        after = await _until_answered(front, body)
        assert answer(after) == answer(first) and cached(after) == PROMPT_BLOCKS * BLOCK
    finally:
        proc.send_signal(signal.SIGINT)
        out = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0 and "tiercake is down" in out[0]


def _pids_serving(port: str) -> list[int]:
    """The vLLM server processes listening on ``port`` (by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if "vllm.entrypoints" in line and f"--port {port} " in line + " ":
                    found.append(int(entry.name))
    return found


async def _until_answered(front: str, body: dict, timeout: float = 600) -> dict:
    """The front's answer, asking again while an instance restarts (it says so retryably: 503 or 429)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.post(front + "/v1/completions", json=body) as resp:
                if resp.status == 200:
                    return await resp.json()
                assert resp.status in (429, 502, 503) and time.monotonic() < deadline, (resp.status, await resp.text())
            await asyncio.sleep(2)


# Routing across vLLM instances: each vLLM server has a tiercake worker beside it (`tiercake worker
# --engine vllm`), and the conductor's front serves the OpenAI API over them ------------------------


class Sidecars:
    """`tiercake worker --engine vllm` beside each vLLM server, with the given roles."""

    def __init__(self, tc: NodeCluster, engines: list[Vllm], roles: list[str]) -> None:
        self.children = []
        try:
            for engine, role in zip(engines, roles):
                name = f"vllm-{engine.url.rsplit(':', 1)[1]}-{role}"
                self.children.append(vllm_worker(tc, engine.url, role, name))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_all(self.children)


async def served_requests(engine: Vllm) -> float:
    """Requests the vLLM server finished, by its own metrics."""
    async with aiohttp.ClientSession() as http:
        return await vllm_counter(http, engine.url, "vllm:request_success_total")


async def front(tc: NodeCluster, body: dict, tenant: str = "default", path: str = "/v1/completions") -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            tc.url + path, json={"model": MODEL, "temperature": 0, **body}, headers={"X-Tiercake-Tenant": tenant}
        ) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
            return reply


async def wait_workers(tc: NodeCluster, count: int) -> None:
    async with Client([tc.url], token=TOKEN) as client:
        for _ in range(100):
            members = [m for m in await client.members() if m.engine == "vllm"]
            if len(members) >= count:
                assert all(m.kv_space is not None and m.kv_space.namespace.block_size == BLOCK for m in members)
                return
            await asyncio.sleep(0.2)
    raise TimeoutError("the vLLM workers never registered")


@pytest.fixture
def sidecars(served):
    made = []

    def start(roles: list[str]) -> Sidecars:
        tc, a, b = served
        made.append(Sidecars(tc, [a, b], roles))
        return made[-1]

    yield start
    for s in made:
        s.stop()


async def test_the_front_routes_a_repeated_prompt_to_the_instance_that_computed_it(served, sidecars):
    """Under the cache-aware router (the TTFT router may as well send it to the other instance, which
    loads it from the pool about as fast: the fitted timings of two equal instances then decide)."""
    tc, a, b = served
    sidecars(["worker", "worker"])
    await wait_workers(tc, 2)
    async with Client([tc.url], token=TOKEN) as client:
        await client.set_policy(router="cache_aware")
    try:
        await repeated_prompts_go_where_they_were_computed(tc, a, b)
    finally:
        async with Client([tc.url], token=TOKEN) as client:
            await client.set_policy(router="ttft")


async def repeated_prompts_go_where_they_were_computed(tc: NodeCluster, a: Vllm, b: Vllm) -> None:
    for seed in (21, 22, 23):
        tokens = prompt(seed)
        direct = await a.complete(tokens)  # the answer computed from scratch, for comparison
        await a.reset_prefix_cache()
        before = [await served_requests(e) for e in (a, b)]
        first = await front(tc, {"prompt": tokens, "max_tokens": 12})
        took = [await served_requests(e) - was for e, was in zip((a, b), before)]
        assert sorted(took) == [0, 1]
        computed_by = (a, b)[took.index(1)]
        # its worker reported the prompt's blocks as held in that instance's own cache (PrefixMirror)
        async with Client([tc.url], token=TOKEN) as client:
            worker = next(m for m in await client.members() if m.url and computed_by.url.rsplit(":", 1)[1] in m.node_id)
            space = worker.kv_space.namespace.model_copy(update={"tenant_salt": "default"})
            for _ in range(50):
                found = await client.lookup("default", block_keys(space, tokens))
                if worker.node_id in found:
                    break
                await asyncio.sleep(0.1)
            assert found[worker.node_id].length == PROMPT_BLOCKS and found[worker.node_id].tiers == {
                "gpu": PROMPT_BLOCKS
            }
        before = [await served_requests(e) for e in (a, b)]
        async with Client([tc.url], token=TOKEN) as client:
            by_source = (await client.cluster()).serving.cached_tokens_by_source.get("vllm", 0)
            again = await front(tc, {"prompt": tokens, "max_tokens": 12})
            took = [await served_requests(e) - was for e, was in zip((a, b), before)]
            assert (a, b)[took.index(1)] is computed_by  # where its prefix is, in vLLM's own cache
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= PROMPT_BLOCKS * BLOCK
            # the front counts the reuse vLLM reported at the stream's end, in vLLM's blocks
            assert (await client.cluster()).serving.cached_tokens_by_source["vllm"] - by_source == cached
        assert answer(first) == answer(again) == answer(direct)
        if seed == 21:  # another tenant shares neither vLLM's own cache nor tiercake's blocks
            other = await front(tc, {"prompt": tokens, "max_tokens": 12}, tenant="someone-else")
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and answer(other) == answer(direct)


async def test_the_worker_reports_what_vllm_caches_as_vllms_kv_events_say(served, sidecars):
    """The worker follows the instance's KV events: the index shows the blocks vLLM cached for a request
    (its answer's full blocks too), and none once vLLM's cache is reset. (An estimate from the prompts
    sent showed the prompt's blocks only, and kept them after a reset.)"""
    tc, a, _ = served
    sidecars(["worker"])
    name = f"vllm-{a.url.rsplit(':', 1)[1]}-worker"
    tokens = prompt(41)
    async with Client([tc.url], token=TOKEN) as client, aiohttp.ClientSession() as http:
        for _ in range(100):
            worker = next((m for m in await client.members() if m.node_id == name and m.kv_space), None)
            if worker is not None:
                break
            await asyncio.sleep(0.2)
        space = worker.kv_space.namespace.model_copy(update={"tenant_salt": "default"})
        await front(tc, {"prompt": tokens, "max_tokens": BLOCK + 4})
        body = {"model": MODEL, "prompt": tokens, "max_tokens": BLOCK + 4, "temperature": 0, "return_token_ids": True}
        async with http.post(a.url + "/v1/completions", json=body) as resp:  # the same answer's tokens
            answer_ids = (await resp.json())["choices"][0]["token_ids"]
        # vLLM caches every full block it computed: the prompt's, then the answer's but its last token
        keys = block_keys(space, tokens + answer_ids[:-1])
        assert len(keys) > PROMPT_BLOCKS
        for _ in range(50):
            found = await client.lookup("default", keys)
            if name in found and found[name].length == len(keys):
                break
            await asyncio.sleep(0.1)
        assert found[name].length == len(keys) and found[name].tiers == {"gpu": len(keys)}
        await a.reset_prefix_cache()
        await a.complete(prompt(42)[:8], max_tokens=1)  # vLLM publishes the reset with its next step's events
        for _ in range(50):
            found = await client.lookup("default", keys)
            if name not in found:
                break
            await asyncio.sleep(0.1)
        assert name not in found, found


async def test_text_and_chat_through_the_front_are_tokenized_and_detokenized_as_vllm_does(served, sidecars):
    tc, a, _ = served
    sidecars(["worker", "worker"])
    await wait_workers(tc, 2)
    text = "Conversations grow turn by turn; each turn repeats the whole history. " * 6
    via_front = await front(tc, {"prompt": text, "max_tokens": 16, "stream": False})
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": text, "max_tokens": 16, "temperature": 0}
        async with http.post(a.url + "/v1/completions", json=body) as resp:
            direct = await resp.json()
    assert via_front["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert answer(via_front) == answer(direct)
    streamed = ""
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": text, "max_tokens": 16, "temperature": 0, "stream": True}
        async with http.post(tc.url + "/v1/completions", json=body) as resp:
            async for line in resp.content:
                data = line.strip().removeprefix(b"data: ")
                if data and data != b"[DONE]":
                    streamed += "".join(c["text"] for c in __import__("json").loads(data)["choices"])
    assert streamed == answer(direct)
    chat = await front(
        tc,
        {"messages": [{"role": "user", "content": "Which tier holds the block?"}], "max_tokens": 8},
        path="/v1/chat/completions",
    )
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] >= 1


async def test_a_session_through_the_front_reaches_the_nodes_pool_policy_from_the_connector(served, sidecars):
    """Under vLLM the connector is the worker that tells the node: the front's session goes to vLLM
    in the request's kv_transfer_params, and the scheduler side sends active, then paused, then
    closed on the final turn, to the node's session-aware pool; the control API's changes reach it
    through the vLLM worker."""
    tc, _, _ = served
    sidecars(["worker", "worker"])
    await wait_workers(tc, 2)
    async with Client([tc.url], token=TOKEN) as client:
        await client.set_policy(eviction={"pool": {"policy": "session"}})
        try:

            async def pool_sessions(want: dict) -> dict:
                node = None
                for _ in range(150):  # the node's tier statistics come with its keep-alive
                    # (a node agent an earlier test restarted may not be a member again yet)
                    node = next((m for m in (await client.cluster()).members if m.role == "node"), None)
                    if node and node.tiers["pool"].eviction == "session" and node.tiers["pool"].sessions == want:
                        return want
                    await asyncio.sleep(0.2)
                raise AssertionError(f"the pool never showed {want}: {node and node.tiers['pool']}")

            await pool_sessions({})
            body = {"prompt": prompt(77), "max_tokens": 8, "temperature": 0}
            headers = {"X-Tiercake-Session": "vllm-chat", "X-Tiercake-Session-Pause": "20"}
            async with aiohttp.ClientSession() as http:
                async with http.post(tc.url + "/v1/completions", json={"model": MODEL, **body}, headers=headers) as r:
                    assert r.status == 200, await r.text()
                await pool_sessions({"paused": 1})
                # the control API's changes go through the vLLM worker that ran the turn (its sidecar
                # remembers the blocks the connector paused the session with) to the node
                (listed,) = [
                    s for s in await client.sessions("default") if s.id == session_hash("default", "vllm-chat")
                ]
                changed = await client.change_session(listed.id, "default", retain_s=600, priority=3)
                assert changed.priority == 3 and changed.retain_s == 600 and changed.state == "paused"
                await pool_sessions({"paused": 1})
                await client.change_session(listed.id, "default", close=True)
                await pool_sessions({})
                headers["X-Tiercake-Session-Final"] = "true"  # a final turn closes it too
                async with http.post(tc.url + "/v1/completions", json={"model": MODEL, **body}, headers=headers) as r:
                    assert r.status == 200, await r.text()
            await pool_sessions({})
        finally:
            await client.set_policy(eviction={"pool": {"policy": "lru"}})


@pytest.mark.timeout(600)
async def test_routing_by_what_each_instance_holds_beats_round_robin_on_the_trace(served, sidecars):
    """Conversations on shared system prompts (a generated trace of the conversation trace's shape,
    39 requests) through the front, round robin, then with the cache-aware router, then with the TTFT
    router (each under a tenant of its own, so none reuses
    another's blocks): the instances' own prefix caches hit more when the router knows what each
    holds. The TTFT router fell below round robin here (0.16-0.18 against 0.26) until it counted the
    spread of the instances' fitted fixed costs as noise (TtftRouter's docstring)."""
    tc, a, b = served
    sidecars(["worker", "worker"])
    await wait_workers(tc, 2)
    records = synthetic_trace(40, tenants=1, system_prompts=6, system_blocks=2, seed=3, new_session_p=0.4)
    prompts = conversation_prompts(records, BLOCK)
    ratios = {}
    async with Client([tc.url], token=TOKEN) as client, aiohttp.ClientSession() as http:
        for router in ("round_robin", "cache_aware", "ttft"):
            await client.set_policy(router=router)
            hits, queries = await own_cache_hits(http, [a.url, b.url])
            for tokens in prompts:
                await front(tc, {"prompt": tokens, "max_tokens": 2}, tenant=f"replay-{router}")
            after = await own_cache_hits(http, [a.url, b.url])
            ratios[router] = (after[0] - hits) / (after[1] - queries)
        await client.set_policy(router="ttft")
    print(f"own prefix cache hit ratio over the generated conversations: {ratios}")
    assert ratios["cache_aware"] > ratios["round_robin"] + 0.05, ratios
    assert ratios["ttft"] > ratios["round_robin"] + 0.05, ratios


async def test_prefill_and_decode_on_two_vllm_instances_through_tiercake(served, sidecars):
    """A prefill instance computes the prompt and its blocks go to the node; the decode instance,
    which never saw the prompt, loads every full block of it and computes only the rest."""
    tc, a, b = served
    sidecars(["prefill", "decode"])
    await wait_workers(tc, 2)
    tokens = prompt(31)
    direct = await a.complete(tokens)
    await a.reset_prefix_cache()
    await b.reset_prefix_cache()
    before = [await served_requests(e) for e in (a, b)]
    reply = await front(tc, {"prompt": tokens, "max_tokens": 12})
    assert [await served_requests(e) - was for e, was in zip((a, b), before)] == [1, 1]  # one step each
    assert reply["usage"]["tiercake"]["decode_cached_tokens"] == PROMPT_BLOCKS * BLOCK  # loaded, not computed
    assert answer(reply) == answer(direct)
