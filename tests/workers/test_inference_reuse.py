"""Reused KV gives the same answer as a full recompute, whichever tier served the prefix: the
worker's own gpu tier, the node pool over shared memory, a remote pool over TCP, SSD, and SSD after
the node agent restarted. Real conductor API, real transfer servers and sockets, the real model."""

import asyncio
import os
import time
import uuid

import pytest
import torch
from conductor_helpers import running_conductor
from paths import shm_file
from transfer_helpers import SECRET

from tiercake.blocks import Namespace
from tiercake.conductor.client import Client
from tiercake.conductor.membership import MemberInfo
from tiercake.tiers import GpuBackend, GpuBlockPool, PoolBackend, PoolRegion, SsdFilesBackend, Tier, TieredStore
from tiercake.transfer import TransferEngine, TransferServer
from tiercake.workers.conductor_link import ConductorLink
from tiercake.workers.reference.model import ModelConfig, ReferenceModel, encode
from tiercake.workers.reference.runner import ContextLimitError, ModelRunner, next_token

MODEL = ModelConfig()  # 4 layers, 2 kv heads of 32: 16 KiB blocks of 16 tokens
LAYOUT = MODEL.layout(16)
NS = Namespace(model_id="tiercake-reference", kv_layout=LAYOUT.tag, block_size=16)
SHARED = "You are a helpful assistant. Answer briefly and precisely, citing sources. " * 2
PROMPT = SHARED + "Question: what is a KV cache?"
OTHER = SHARED + "Question: why do tiers help?"


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(MODEL)


class Cluster:
    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.closers = []
        self.shm = []

    async def conductor(self):
        running = running_conductor(ttl=2)
        self.url, _ = await running.__aenter__()
        self.closers.append(lambda: running.__aexit__(None, None, None))

    async def node(self, name: str, pool: bool = True, ssd: bool = False):
        tiers, caps = [], {}
        if pool:
            path = str(shm_file(f"test-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
            self.shm.append(path)
            tiers.append(Tier(PoolBackend(PoolRegion.create(path, 4 << 20))))
            caps["pool"] = 4 << 20
        if ssd:
            tiers.append(Tier(SsdFilesBackend(self.tmp_path / name, capacity_bytes=16 << 20)))
            caps["ssd"] = 16 << 20
        store = await TieredStore(tiers).open()
        server = await TransferServer(store, SECRET, name, pool_tier="pool" if pool else None).start()
        client = Client([self.url])
        member = MemberInfo(node_id=name, host=server.address[0], port=server.address[1], tiers=caps)
        link = await ConductorLink(client, member, store, ttl=2).start()

        async def close(leave: bool = True):
            await link.close(leave=leave)
            await client.close()
            await server.close()
            await store.close()

        node = {"store": store, "server": server, "link": link, "close": close, "closed": False}

        async def close_once():
            if not node["closed"]:
                node["closed"] = True
                await close()

        self.closers.append(close_once)
        node["close_once"] = close_once
        return node

    async def worker(
        self, model, name: str, write_to: dict | None = None, transports=("local", "shm", "tcp"), blocks: int = 64
    ):
        pool = GpuBlockPool(blocks, LAYOUT.shape, torch.float16, "cpu")
        store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
        engine = TransferEngine(name, SECRET, store, transports=transports)
        client = Client([self.url])
        inference = ModelRunner(
            model,
            store,
            NS,
            worker_id=name,
            transfer=engine,
            conductor=client,
            node=write_to["server"].node_id if write_to else None,
        )

        async def close():
            await inference.flush()
            await engine.close()
            await client.close()
            await store.close()

        self.closers.append(close)
        return inference

    async def close(self):
        for closer in reversed(self.closers):
            await closer()
        for path in self.shm:
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
async def cluster(tmp_path):
    c = Cluster(tmp_path)
    await c.conductor()
    yield c
    await c.close()


async def generate(engine: ModelRunner, text: str, n: int = 6, tenant: str = "default"):
    """Greedy decoding: (prefill stats, tokens, logits of every step)."""
    seq = await engine.prefill(encode(text), tenant=tenant, max_new_tokens=n)
    out, logits = [], [seq.logits.clone()]
    try:
        for _ in range(n):
            out.append(next_token(seq.logits))
            await engine.decode([seq], [out[-1]])
            logits.append(seq.logits.clone())
    finally:
        engine.free(seq)
    return seq.stats, out, torch.stack(logits)


async def recompute(model, text: str, n: int = 6):
    """The same prompt on a fresh worker with no cache and no conductor."""
    pool = GpuBlockPool(64, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="ref")
    stats, tokens, logits = await generate(engine, text, n)
    await store.close()
    assert stats.cached_tokens == 0
    return tokens, logits


def same_answer(result, reference) -> None:
    (_, tokens, logits), (ref_tokens, ref_logits) = result, reference
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)


async def wait_indexed(client_url: str, tenant: str, text: str, node: str, blocks: int):
    from tiercake.blocks import block_keys

    keys = block_keys(NS.model_copy(update={"tenant_salt": tenant}), encode(text))[:blocks]
    async with Client([client_url]) as client:
        for _ in range(100):
            found = await client.lookup(tenant, keys)
            if node in found and found[node].length >= blocks:
                return found[node]
            await asyncio.sleep(0.05)
    raise AssertionError(f"{node} never reported {blocks} blocks")


def _first_key(text: str) -> bytes:
    from tiercake.blocks import block_keys

    return block_keys(NS.model_copy(update={"tenant_salt": "default"}), encode(text))[0]


def full_blocks(text: str) -> int:
    return (len(encode(text)) - 1) // 16


async def test_reuse_from_own_gpu(cluster, model):
    worker = await cluster.worker(model, "w-gpu")
    first = await generate(worker, PROMPT)
    assert first[0].cached_tokens == 0
    second = await generate(worker, PROMPT)
    assert second[0].cached_tokens == full_blocks(PROMPT) * 16 and second[0].sources == {"gpu": full_blocks(PROMPT)}
    same_answer(second, await recompute(model, PROMPT))
    # a different question after the same system prompt reuses the shared blocks only
    other = await generate(worker, OTHER)
    common = len(os.path.commonprefix([encode(PROMPT), encode(OTHER)]))
    assert other[0].cached_tokens == (common // 16) * 16
    reference = await recompute(model, OTHER)
    same_answer(other, reference)
    # the comparison is sensitive: the same reuse over a damaged cached block gives another answer
    worker.kv.kv[worker.store.slot_of(_first_key(OTHER), "gpu")].mul_(0.5)
    with pytest.raises(AssertionError):
        same_answer(await generate(worker, OTHER), reference)


@pytest.mark.parametrize(
    "transports,moved_by",
    [(("local", "shm", "tcp"), "shm"), (("tcp",), "tcp")],
    ids=["local-pool-shm", "remote-pool-tcp"],
)
async def test_reuse_from_the_node_pool(cluster, model, transports, moved_by):
    node = await cluster.node("node-p")
    writer = await cluster.worker(model, "w-writer", write_to=node)
    await generate(writer, PROMPT)
    await writer.flush()
    await wait_indexed(cluster.url, "default", PROMPT, "node-p", full_blocks(PROMPT))
    reader = await cluster.worker(model, "w-reader", transports=transports)
    result = await generate(reader, PROMPT)
    assert result[0].cached_tokens == full_blocks(PROMPT) * 16
    assert result[0].sources == {"node-p:pool": full_blocks(PROMPT)}
    assert reader.transfer.bytes_moved[moved_by] == full_blocks(PROMPT) * LAYOUT.nbytes
    same_answer(result, await recompute(model, PROMPT))


async def test_reuse_from_ssd_and_from_ssd_after_a_node_restart(cluster, model):
    node = await cluster.node("node-s", pool=False, ssd=True)
    writer = await cluster.worker(model, "w-writer", write_to=node)
    await generate(writer, PROMPT)
    await writer.flush()
    await wait_indexed(cluster.url, "default", PROMPT, "node-s", full_blocks(PROMPT))
    reference = await recompute(model, PROMPT)
    result = await generate(await cluster.worker(model, "w-ssd", transports=("tcp",)), PROMPT)
    assert result[0].sources == {"node-s:ssd": full_blocks(PROMPT)}
    same_answer(result, reference)

    # the node agent goes away without leaving (a crash) and comes back on the same SSD directory
    node["closed"] = True
    await node["close"](leave=False)
    restarted = await cluster.node("node-s", pool=False, ssd=True)
    assert restarted["link"].registrations == 1
    await wait_indexed(cluster.url, "default", PROMPT, "node-s", full_blocks(PROMPT))
    worker = await cluster.worker(model, "w-after-restart", transports=("tcp",))
    result = await generate(worker, PROMPT)
    assert result[0].sources == {"node-s:ssd": full_blocks(PROMPT)}
    same_answer(result, reference)


async def test_tenants_do_not_share_blocks(cluster, model):
    worker = await cluster.worker(model, "w-tenants")
    await generate(worker, PROMPT, tenant="alice")
    assert (await generate(worker, PROMPT, tenant="bob"))[0].cached_tokens == 0
    assert (await generate(worker, PROMPT, tenant="alice"))[0].cached_tokens > 0


async def test_bad_prompts_are_clear_errors(cluster, model):
    worker = await cluster.worker(model, "w-bad")
    with pytest.raises(ValueError, match="empty"):
        await worker.prefill([])
    with pytest.raises(ValueError, match="token ids"):
        await worker.prefill([1, 2, 300])
    with pytest.raises(ContextLimitError):
        await worker.prefill([1] * 4000, max_new_tokens=200)
    assert worker.kv.num_free == worker.kv.num_blocks and not worker.kv.open_sequences  # nothing leaked


async def test_a_full_gpu_tier_fails_only_the_request_that_needs_a_block(model):
    from tiercake.messages import GenerateRequest
    from tiercake.tiers import TierFullError
    from tiercake.workers.reference.scheduler import Scheduler

    pool = GpuBlockPool(12, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="small")
    scheduler = Scheduler(engine).start()
    try:

        async def run(text: str, n: int):
            return [e async for e in scheduler.generate(GenerateRequest(tokens=encode(text), max_tokens=n))]

        # two long generations on 12 blocks: together they outgrow the gpu tier
        results = await asyncio.gather(run("a" * 40, 120), run("b" * 40, 120), return_exceptions=True)
        assert sum(isinstance(r, TierFullError) for r in results) >= 1
        assert any(isinstance(r, list) and r[-1].finish_reason == "length" for r in results)
        assert pool.num_free + len(store.keys()) == pool.num_blocks  # nothing leaked: only cached blocks stay
        # and the worker goes on serving
        assert (await run("c" * 20, 4))[-1].finish_reason == "length"
    finally:
        await scheduler.close()
        await store.close()


async def test_generated_blocks_are_keyed_like_a_follow_up_prompt_under_the_same_salt(cluster, model):
    from tiercake.blocks import block_keys

    worker = await cluster.worker(model, "w-chain")
    prompt = encode(PROMPT)
    seq = await worker.prefill(prompt, tenant="shared", salt="", max_new_tokens=40)
    generated = []
    for _ in range(40):
        generated.append(next_token(seq.logits))
        await worker.decode([seq], [generated[-1]])
    worker.free(seq)
    # a follow-up turn that repeats the conversation finds the generated blocks too
    follow_up = prompt + generated
    expected = block_keys(NS.model_copy(update={"tenant_salt": ""}), follow_up)
    assert seq.keys == expected[: len(seq.keys)] and len(seq.keys) == len(follow_up) // 16
    again = await worker.prefill(follow_up + encode(" and then?"), tenant="shared", salt="")
    assert again.stats.cached_tokens == len(follow_up) // 16 * 16
    worker.free(again)


@pytest.mark.parametrize("chunk", [16, 24])
async def test_a_prefill_in_chunks_computes_the_same_answer(model, chunk):
    pool = GpuBlockPool(64, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="chunked", prefill_chunk=chunk)
    try:
        same_answer(await generate(engine, PROMPT), await recompute(model, PROMPT))
    finally:
        await store.close()


async def test_a_long_prefill_does_not_stall_the_running_batch(model):
    """Decode steps of running sequences go between the chunks of a new prompt's prefill: the longest
    pause between two tokens of a running sequence is a fraction of that prefill's compute time (it
    would be all of it if the prefill ran in one pass, or before the batch's next step)."""
    from tiercake.messages import GenerateRequest
    from tiercake.workers.reference.scheduler import Scheduler

    pool = GpuBlockPool(512, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="chunks", prefill_chunk=64, max_context=8192)
    scheduler = Scheduler(engine).start()
    arrivals: list[float] = []
    try:

        async def running() -> None:
            async for _ in scheduler.generate(GenerateRequest(tokens=encode("a" * 40), max_tokens=3000)):
                arrivals.append(time.perf_counter())
                if long_done.is_set() and len(arrivals) > after_long + 3:
                    return

        long_done, after_long = asyncio.Event(), 10**9
        decoding = asyncio.create_task(running())
        while len(arrivals) < 5:
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        events = [e async for e in scheduler.generate(GenerateRequest(tokens=[7] * 3000, max_tokens=1))]
        finished = time.perf_counter()
        compute = events[0].stats.compute_s
        after_long = len(arrivals)
        long_done.set()
        await asyncio.wait_for(decoding, 60)
        during = [t for t in arrivals if started <= t <= finished]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= started - 0.5 and b <= finished + 0.5]
        assert len(during) >= 5, (len(during), compute)  # the running sequence kept producing tokens
        assert max(gaps) < 0.5 * compute, (max(gaps), compute)
    finally:
        await scheduler.close()
        await store.close()


async def test_a_burst_of_long_prompts_fits_a_gpu_tier_sized_for_one_prefill_at_a_time(model):
    """Prefills run one at a time beside the batch: each holds its whole prompt's blocks from the
    start, so several at once would exhaust a gpu tier that serves them one after another."""
    from tiercake.messages import GenerateRequest
    from tiercake.workers.reference.scheduler import Scheduler

    pool = GpuBlockPool(24, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="burst", prefill_chunk=32)
    scheduler = Scheduler(engine).start()
    try:

        async def run(i: int):
            return [
                e async for e in scheduler.generate(GenerateRequest(tokens=[i] * 160, max_tokens=2))
            ]  # 10 blocks each

        results = await asyncio.gather(*(run(i) for i in range(1, 5)), return_exceptions=True)
        assert all(isinstance(r, list) and r[-1].finish_reason == "length" for r in results), results
    finally:
        await scheduler.close()
        await store.close()


async def test_any_temperature_samples_and_a_failing_sample_fails_only_its_request(model, monkeypatch):
    """A temperature of 1e-40 once overflowed to NaN probabilities: the sampler raised outside any
    guard, the request hung and its blocks were never freed. Any temperature now samples (a tiny one
    as greedy), and a sampler that fails ends its own request only, with nothing leaked."""
    from tiercake.messages import GenerateRequest
    from tiercake.workers.reference import scheduler as scheduler_module

    pool = GpuBlockPool(24, LAYOUT.shape, torch.float16, "cpu")
    store = await TieredStore([Tier(GpuBackend(pool))], payload_nbytes=LAYOUT.nbytes).open()
    engine = ModelRunner(model, store, NS, worker_id="temps")
    scheduler = scheduler_module.Scheduler(engine).start()

    async def run(temperature: float, text: str = "The tiers hold the blocks of a long conversation."):
        request = GenerateRequest(tokens=encode(text), max_tokens=4, temperature=temperature, seed=7)
        return [e.token async for e in scheduler.generate(request)]

    try:
        greedy = await run(0.0)
        assert await run(1e-40) == greedy  # the limit of a vanishing temperature
        for temperature in (1e-6, 1.0, 1e30):
            assert len(await run(temperature)) == 4
        real = scheduler_module.next_token

        def flaky(logits, temperature=0.0, generator=None, top_p=1.0):
            if temperature == 0.5:
                raise RuntimeError("the sampler broke")
            return real(logits, temperature, generator, top_p)

        monkeypatch.setattr(scheduler_module, "next_token", flaky)
        good, bad = await asyncio.gather(run(0.0, "Another prompt entirely."), run(0.5), return_exceptions=True)
        assert good == await run(0.0, "Another prompt entirely.") and isinstance(bad, RuntimeError)
        assert engine.kv.open_sequences == 0 and pool.num_free + len(store.keys()) == pool.num_blocks
        assert await run(0.0) == greedy  # and the worker goes on serving
    finally:
        await scheduler.close()
        await store.close()


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])  # softmax: 0.644, 0.237, 0.087, 0.032
    g = torch.Generator().manual_seed(0)
    assert {next_token(logits, 1.0, g, top_p=0.5) for _ in range(200)} == {0}
    assert {next_token(logits, 1.0, g, top_p=0.9) for _ in range(400)} == {0, 1, 2}  # 0.968 > 0.9: 3 is out
    assert {next_token(logits, 1.0, g) for _ in range(2000)} == {0, 1, 2, 3}


async def test_a_waiting_request_has_its_prefix_staged_and_pulled_into_the_worker_meanwhile(cluster, model):
    """Prefetching that acts: a request that must wait for the worker (another prefill runs) has the
    node bring the prefix it holds only on SSD into its pool meanwhile, and the worker pull it from
    there into its own gpu tier; its prefill then loads nothing (the blocks are credited to the node's
    pool, where they came from), and the answer is the recomputed one."""
    from tiercake.messages import GenerateRequest, KVHandoff
    from tiercake.workers.reference.scheduler import Scheduler

    node = await cluster.node("node-p", pool=True, ssd=True)
    writer = await cluster.worker(model, "w-writer", write_to=node)
    await generate(writer, PROMPT)
    await writer.flush()
    n = full_blocks(PROMPT)
    await wait_indexed(cluster.url, "default", PROMPT, "node-p", n)
    await node["store"].flush(["pool"])  # demoted: only the node's SSD holds the prefix now
    assert all(node["store"].where(key) == ["ssd"] for key in keys_of(PROMPT)[:n])
    reader = await cluster.worker(model, "w-reader", transports=("tcp",), blocks=256)
    scheduler = Scheduler(reader, prefetch=True).start()
    pulled_before_prefill = []
    prefill = reader.prefill

    async def spy(tokens, *args, **kwargs):
        if tokens == encode(PROMPT):
            pulled_before_prefill.append(reader.kv.cached_prefix(keys_of(PROMPT)[:n]))
        return await prefill(tokens, *args, **kwargs)

    reader.prefill = spy
    try:
        busy = asyncio.create_task(collect(scheduler, GenerateRequest(tokens=[7] * 1500, max_tokens=1)))
        await asyncio.sleep(0)
        source = KVHandoff(node="node-p", blocks=n, tier="ssd", runs=[("ssd", n)])
        events = await collect(scheduler, GenerateRequest(tokens=encode(PROMPT), max_tokens=6, source=source))
        await busy
    finally:
        await scheduler.close()
    assert reader.staged_blocks == n and reader.prefetched_blocks == n
    assert pulled_before_prefill == [n]  # in the worker's own gpu tier before its prefill began
    stats = events[0].stats
    assert stats.sources == {"node-p:pool": n}  # read from memory, staged while it waited
    assert stats.prefetched_blocks == n and stats.load_bytes == 0  # nothing left to load at prefill
    assert all(node["store"].where(key)[0] == "pool" for key in keys_of(PROMPT)[:n])
    reference_tokens, _ = await recompute(model, PROMPT)
    assert [e.token for e in events] == reference_tokens


async def test_a_prefetch_takes_only_the_room_below_the_watermark_and_evicts_nothing(cluster, model):
    from tiercake.messages import KVHandoff

    node = await cluster.node("node-q", pool=True)
    writer = await cluster.worker(model, "w-writer-q", write_to=node)
    await generate(writer, PROMPT)
    await writer.flush()
    n = full_blocks(PROMPT)
    await wait_indexed(cluster.url, "default", PROMPT, "node-q", n)
    reader = await cluster.worker(model, "w-full", transports=("tcp",), blocks=n)  # room for the prefix only
    await generate(reader, "A short question.")  # a few blocks of its own in the gpu tier
    held = set(reader.store.keys())
    gpu = reader.store.tier("gpu")
    room = (int(gpu.high_watermark * gpu.backend.capacity_bytes) - gpu.backend.used_bytes) // reader.block_nbytes
    assert 0 < room < n
    source = KVHandoff(node="node-q", blocks=n, tier="pool", runs=[("pool", n)])
    done = await reader.prefetch(encode(PROMPT), "default", None, source)
    assert [origin for _, origin in done.pulled] == ["node-q:pool"] * room  # the first `room` blocks of the chain
    assert [k for k, _ in done.pulled] == keys_of(PROMPT)[:room]
    assert held <= set(reader.store.keys())  # nothing of the worker's own was evicted for it
    assert gpu.usage <= gpu.high_watermark


async def collect(scheduler, request):
    return [event async for event in scheduler.generate(request)]


def keys_of(text: str, tenant: str = "default") -> list[bytes]:
    from tiercake.blocks import block_keys

    return block_keys(NS.model_copy(update={"tenant_salt": tenant}), encode(text))


async def test_a_forged_or_corrupted_block_is_recomputed_never_used(cluster, model, monkeypatch):
    """Someone holding the transfer secret but not the seal secret writes KV under a tenant's keys
    (another prompt's real KV, sealed with a key of its own), and a block is corrupted in a node's
    pool: the reader refuses each by its seal and answers as a full recompute does."""
    from tiercake.blocks import Sealer, block_keys, seal_material, sealer_for

    node = await cluster.node("node-f")
    n = full_blocks(PROMPT)
    decoy = "Ignore all that. " * 3 + PROMPT  # as long, and other KV
    writer = await cluster.worker(model, "w-writer", write_to=node)
    await generate(writer, decoy, tenant="mallory")
    await writer.flush()
    keys = {
        t: block_keys(NS.model_copy(update={"tenant_salt": t}), encode(text))[:n]
        for t, text in (("mallory", decoy), ("default", PROMPT))
    }
    forger = TransferEngine("forger", SECRET)
    forger.add_peer("node-f", *node["server"].address)
    stolen = [torch.empty(LAYOUT.nbytes, dtype=torch.uint8) for _ in range(n)]
    assert all(r.ok for r in await forger.read_blocks("node-f", keys["mallory"], stolen))
    own = sealer_for(seal_material(b"the forger's own secret"), "default")
    seals = [own.seal(k, s.numpy()) for k, s in zip(keys["default"], stolen)]
    written = await forger.write_blocks("node-f", keys["default"], stolen, chain=True, tenant="default", seals=seals)
    assert all(r.ok for r in written)
    await forger.close()
    await wait_indexed(cluster.url, "default", PROMPT, "node-f", n)
    reference = await recompute(model, PROMPT)

    reader = await cluster.worker(model, "w-reader", transports=("tcp",))
    result = await generate(reader, PROMPT)
    assert result[0].refused_blocks == n and result[0].cached_tokens == 0 and reader.refused_blocks == n
    same_answer(result, reference)
    # the check is what kept the forged KV out: without it, the same load changes the answer
    monkeypatch.setattr(Sealer, "verify", lambda *_: True)
    trusting = await generate(await cluster.worker(model, "w-trusting", transports=("tcp",)), PROMPT)
    assert trusting[0].cached_tokens == n * 16
    with pytest.raises(AssertionError):
        same_answer(trusting, reference)
    monkeypatch.undo()

    # an honest block corrupted where it is held: the chain is used up to it, recomputed from it
    await generate(writer, OTHER, tenant="carol")
    await writer.flush()
    await wait_indexed(cluster.url, "carol", OTHER, "node-f", full_blocks(OTHER))
    carol = block_keys(NS.model_copy(update={"tenant_salt": "carol"}), encode(OTHER))
    lease = node["store"].acquire_lease(carol[2], tier="pool")
    lease.data[100] ^= 0xFF
    await node["store"].release_lease(carol[2], lease.id)
    result = await generate(await cluster.worker(model, "w-carol", transports=("tcp",)), OTHER, tenant="carol")
    assert result[0].refused_blocks == 1 and result[0].cached_tokens == 2 * 16
    same_answer(result, await recompute(model, OTHER))
