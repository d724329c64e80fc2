"""The worker's account of vLLM's own prefix cache from vLLM's KV events (``EventMirror``), against
vLLM's own publisher over real ZMQ sockets: the keys it derives are tiercake's, a reset or eviction
takes blocks away, and batches missed while the worker was away come back from vLLM's replay buffer.
(With a real vLLM server: test_vllm.py.)"""

import asyncio
import time

import msgspec
import pytest

from tiercake.blocks import Namespace, block_keys
from tiercake.conductor.etcd_process import free_port
from tiercake.workers.vllm.engine import cache_salt
from tiercake.workers.vllm.events import EventMirror, EventsEndpoints
from tiercake.workers.vllm.process import kv_events_config

BS = 4


# A test that imports vLLM starts processes (vLLM probes the platform) and takes 15-17 s: it is a
# ``cluster`` test, and vLLM is imported on first use, not at the top (every process of ``make check``
# paid that import at collection).
VLLM = pytest.mark.cluster


def kv():
    """vLLM's event types."""
    from vllm.distributed import kv_events

    return kv_events


SPACE = Namespace(model_id="m", kv_layout="L4.x", block_size=BS)


def stored(hashes, parent, tokens, salt=None):
    extra = [(salt,) if salt and i == 0 and parent is None else None for i in range(len(hashes))]
    return kv().BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
    )


def salted(first_token: int, max_blocks: int = 1 << 20) -> tuple[EventMirror, list[int], list[bytes]]:
    """A mirror whose worker sent tenant "t" with salt "s"; a two-block chain of tokens and its keys."""
    mirror = EventMirror(SPACE, 64, max_blocks=max_blocks)
    mirror.remember(cache_salt("s"), "t", "s")
    tokens = list(range(first_token, first_token + 2 * BS))
    return mirror, tokens, block_keys(SPACE.model_copy(update={"tenant_salt": "s"}), tokens)


def held(mirror: EventMirror) -> set[tuple[str, bytes]]:
    return {(c.tenant, c.key) for c in mirror.holdings()}


class Publisher:
    """vLLM's own publisher, set up as ``serve_command`` sets it up."""

    def __init__(self) -> None:
        config = kv_events_config(free_port(), free_port())
        self.where = EventsEndpoints(
            endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"], topic=config["topic"]
        )
        self.pub = kv().ZmqEventPublisher(
            0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"], topic=config["topic"]
        )

    def publish(self, *events) -> None:
        self.pub.publish(kv().KVEventBatch(ts=time.time(), events=list(events)))

    def close(self) -> None:
        self.pub.shutdown()


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.02)


@pytest.fixture
async def follow():
    tasks = []

    def start(mirror: EventMirror, publisher: Publisher) -> asyncio.Task:
        tasks.append(asyncio.create_task(mirror.follow(publisher.where)))
        return tasks[-1]

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@VLLM
async def test_stored_blocks_are_keyed_as_tiercake_keys_them_and_leave_when_vllm_drops_them(follow):
    mirror, publisher = EventMirror(SPACE, 64), Publisher()
    changes = []
    mirror.listeners.append(lambda c: changes.append((c.tenant, c.key, c.added, c.tier)))
    try:
        follow(mirror, publisher)
        mirror.remember(cache_salt("s1"), "alice", "s1")
        tokens = list(range(3, 3 + 3 * BS))
        keys = block_keys(SPACE.model_copy(update={"tenant_salt": "s1"}), tokens)
        # a chain stored in two steps (the prompt, then a block of its answer), as vLLM does
        publisher.publish(stored([b"h1", b"h2"], None, tokens[: 2 * BS], salt=cache_salt("s1")))
        publisher.publish(stored([b"h3"], b"h2", tokens[2 * BS :]))
        # a request that did not come through the worker: its salt is unknown, and so is its child
        publisher.publish(
            stored([b"x1"], None, tokens[:BS], salt=cache_salt("someone")), stored([b"x2"], b"x1", tokens[BS : 2 * BS])
        )
        await until(lambda: mirror.last_seq == 2)
        assert held(mirror) == {("alice", k) for k in keys}
        assert mirror.figures["stored"] == 3 and mirror.figures["unmapped"] == 2
        publisher.publish(kv().BlockRemoved(block_hashes=[b"h3", b"x2"], medium="GPU"))
        await until(lambda: mirror.last_seq == 3)
        assert held(mirror) == {("alice", k) for k in keys[:2]}
        publisher.publish(kv().AllBlocksCleared())  # vLLM's prefix cache reset
        await until(lambda: mirror.last_seq == 4)
        assert held(mirror) == set()
        assert changes == (
            [("alice", k, True, "gpu") for k in keys]
            + [("alice", keys[2], False, "gpu")]
            + [("alice", k, False, "gpu") for k in keys[:2]]
        )
    finally:
        publisher.close()


@VLLM
async def test_batches_published_while_the_worker_was_away_come_back_from_vllms_replay(follow):
    (mirror, tokens, keys), publisher = salted(10), Publisher()
    try:
        publisher.publish(stored([1], None, tokens[:BS], salt=cache_salt("s")))  # before anyone listens
        await asyncio.sleep(0.3)
        task = follow(mirror, publisher)
        await until(lambda: mirror.last_seq == 0)
        assert held(mirror) == {("t", keys[0])}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        publisher.publish(stored([2], 1, tokens[BS:]))  # while the worker is away (restarting)
        await asyncio.sleep(0.3)
        follow(mirror, publisher)
        await until(lambda: mirror.last_seq == 1)
        assert held(mirror) == {("t", k) for k in keys} and mirror.figures["stored"] == 2  # none twice
    finally:
        publisher.close()


@VLLM
async def test_a_restarted_vllm_starts_with_an_empty_cache(follow):
    (mirror, tokens, keys), first = salted(20), Publisher()
    try:
        follow(mirror, first)
        first.publish(stored([1, 2], None, tokens, salt=cache_salt("s")))
        first.publish(kv().BlockRemoved(block_hashes=[7], medium="GPU"))
        first.publish(kv().BlockRemoved(block_hashes=[8], medium="GPU"))
        await until(lambda: mirror.last_seq == 2)
        assert held(mirror) == {("t", k) for k in keys}
    finally:
        first.close()
    await asyncio.sleep(0.3)
    again = Publisher.__new__(Publisher)  # a new vLLM process on the same ports: its numbers start at 0
    again.where = first.where
    again.pub = kv().ZmqEventPublisher(
        0, endpoint=first.where.endpoint, replay_endpoint=first.where.replay_endpoint, topic=first.where.topic
    )
    try:
        # its first batch may go before its socket has connected (dropped): the next one shows the restart
        again.publish(stored([3], None, tokens[:BS], salt=cache_salt("s")))
        await asyncio.sleep(0.5)
        again.publish(stored([4], 3, tokens[BS:]))
        await until(lambda: mirror.figures["restarts"] == 1 and mirror.last_seq == 1)
        assert held(mirror) == {("t", k) for k in keys}  # the first batch back from the new process's replay
    finally:
        again.close()


@VLLM
def test_past_its_bound_the_mirror_forgets_its_oldest_blocks():
    """Removals lost for good (no replay) cannot grow the mirror without bound."""
    mirror, tokens, keys = salted(30, max_blocks=1)
    for seq, (vllm_hash, parent, part) in enumerate([(1, None, tokens[:BS]), (2, 1, tokens[BS:])]):
        batch = kv().KVEventBatch(ts=time.time(), events=[stored([vllm_hash], parent, part, salt=cache_salt("s"))])
        mirror.receive(seq, msgspec.msgpack.encode(batch))
    assert held(mirror) == {("t", keys[1])} and mirror.figures["overflowed"] == 1


def test_an_event_stream_it_cannot_read_is_counted_never_applied():
    mirror = EventMirror(SPACE, 64)
    mirror.receive(0, b"\xc1not msgpack")
    assert mirror.figures["bad_batches"] == 1 and held(mirror) == set()


def test_vllm_is_set_up_to_publish_on_loopback_only():
    config = kv_events_config(5557, 5558)
    where = EventsEndpoints(endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"])
    # vLLM binds wildcard addresses (every interface) and connects to others: the worker binds this one
    assert where.subscriber_binds() and "*" not in config["endpoint"] and "127.0.0.1" in config["replay_endpoint"]
    assert not EventsEndpoints(endpoint="tcp://*:5557").subscriber_binds()
    assert EventsEndpoints(endpoint="tcp://*:5557").subscriber_address() == "tcp://127.0.0.1:5557"
