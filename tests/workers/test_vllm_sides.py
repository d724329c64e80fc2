"""The connector's two sides without vLLM's engine. Scheduler side: where a prompt's blocks are is
answered from this node's pool index at once, else by the conductor without blocking vLLM's
scheduler (a mock link inside this one class's test). Worker side: the saves' host buffers are
reused. Through real vLLM and a real node agent: test_vllm.py; the loader: test_vllm_loading.py."""

import concurrent.futures
import time
from types import SimpleNamespace

import pytest

from tiercake.blocks import Namespace

pytestmark = pytest.mark.cluster  # importing vLLM's connector base probes the platform in a process

BLOCK = 32


class Link:
    """What the scheduler side uses of ``TiercakeLink``: the local index's answer, and the
    conductor's answers as futures the test completes."""

    def __init__(self, local: int) -> None:
        self.local = local
        self.pool_index_state = "read" if local else "not read yet"
        self.asked: list[concurrent.futures.Future] = []
        self.told: list = []

    def local_prefix(self, tenant, keys):
        return min(self.local, len(keys))

    def pool_entries(self, tenant, keys):
        return "region-1", [100 + i for i in range(min(self.local, len(keys)))]

    def longest_prefix_soon(self, tenant, keys):
        self.asked.append(concurrent.futures.Future())
        return self.asked[-1]

    def tell_session(self, node, notice, keys):
        self.told.append((node, notice, keys))


def scheduler(link: Link, timeout: float = 5.0, stands: int = 1):
    from tiercake.workers.vllm.metadata import ConnectorSettings
    from tiercake.workers.vllm.scheduler_side import ConnectorScheduler

    settings = ConnectorSettings(
        conductor="http://127.0.0.1:1", node="here", lookup_timeout_s=timeout, local_prefix_stands=stands
    )
    namespace = Namespace(model_id="m", kv_layout="l", block_size=BLOCK)
    return ConnectorScheduler(settings, link, namespace, BLOCK, {}, True, True)


def request(blocks: int = 4, rid: str = "r"):
    tokens = list(range(3, 3 + blocks * BLOCK + 1))  # one more token: vLLM computes the last one
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, kv_transfer_params=None, cache_salt=None
    )


@pytest.mark.parametrize("local", [4, 2])
def test_a_prefix_the_local_pool_holds_is_answered_at_once_without_asking_the_conductor(local):
    link = Link(local=local)
    s = scheduler(link, stands=2)
    assert s.get_num_new_matched_tokens(request(), 0) == (local * BLOCK, False)
    assert link.asked == []
    assert s._plans["r"].node == "here"


def test_a_load_from_the_local_pool_names_each_blocks_index_entry_for_the_worker_side():
    """The worker side reads those blocks by these entries, without a lease; a block the index did not
    show (a stale read) has none, and the worker side leases instead."""
    link = Link(local=4)
    s = scheduler(link)
    r = request()
    assert s.get_num_new_matched_tokens(r, 0) == (4 * BLOCK, False)
    link.local = 3  # the index lost the last block since
    s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10, 11],)), 4 * BLOCK)
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
    )
    (loaded,) = s.build_connector_meta(out).loads
    assert loaded.node == "here" and loaded.pool == "region-1"
    assert [(b.block_id, b.entry) for b in loaded.blocks] == [(7, 100), (8, 101), (9, 102), (10, -1)]


def test_blocks_a_failed_load_left_to_recompute_are_saved_once_recomputed():
    """The worker side reports block 2 of 4 not loaded: vLLM recomputes from it, and the worker side
    made no save in that step; the scheduler side hands those blocks out to save again once they are
    computed, not only the blocks after the load."""
    from tiercake.workers.vllm.loading import LoadReport
    from tiercake.workers.vllm.metadata import TiercakeWorkerMetadata

    link = Link(local=4)
    s = scheduler(link)
    r = request(blocks=6)
    assert s.get_num_new_matched_tokens(r, 0) == (4 * BLOCK, False)
    ids = [7, 8, 9, 10, 11, 12, 13]
    s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (ids,)), 4 * BLOCK)

    def step(computed: int, scheduled: int, new: bool) -> list[int]:
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
        news = []
        if new:
            news = [SimpleNamespace(req_id="r", block_ids=(ids,), num_computed_tokens=computed)]
        else:
            cached = SimpleNamespace(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[computed])
        out = SimpleNamespace(
            scheduled_new_reqs=news, scheduled_cached_reqs=cached, num_scheduled_tokens={"r": scheduled}
        )
        return [save.block_id for save in s.build_connector_meta(out).saves]

    assert step(4 * BLOCK, 2 * BLOCK + 1, new=True) == [11, 12]  # the step that loads, and computes the rest
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=TiercakeWorkerMetadata({"r": LoadReport(2, 2, 0, 0.01)}))
    )
    # vLLM truncated the request at block 2 and recomputes blocks 2 to 5
    assert step(2 * BLOCK, 4 * BLOCK + 1, new=False) == [9, 10, 11, 12]


def test_otherwise_the_conductor_is_asked_while_vllm_schedules_on_and_the_longer_holder_wins():
    link = Link(local=1)
    s = scheduler(link, stands=2)
    req = request()
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)  # vLLM asks again next step
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.asked) == 1  # one question per request, not per step
    link.asked[0].set_result(("there", 3))
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    assert s._plans["r"].node == "there"
    other = request(rid="q")
    assert s.get_num_new_matched_tokens(other, 0) == (None, False)
    link.asked[1].set_result((None, 0))  # nobody else: this node's one block
    assert s.get_num_new_matched_tokens(other, 0) == (BLOCK, False)
    assert s._plans["q"].node == "here"


def test_a_conductor_that_does_not_answer_in_time_means_computing_and_a_finished_request_stops_waiting():
    link = Link(local=0)
    s = scheduler(link, timeout=0.1)
    req = request()
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.15)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert link.asked[0].cancelled()
    gone = request(rid="gone")
    assert s.get_num_new_matched_tokens(gone, 0) == (None, False)
    s.request_finished(gone, [])
    assert link.asked[1].cancelled() and "gone" not in s._asked


def test_a_saves_buffer_is_reused_once_its_writes_end_and_only_a_few_are_kept():
    from tiercake.workers.vllm.worker_side import SaveBuffers

    buffers = SaveBuffers(block_bytes=16, budget=16 * 10)
    first = buffers.take(3)
    assert first.shape == (10, 16)  # room for a few steps within the bytes in flight
    assert buffers.take(3) is not first  # still in use
    buffers.give(first)
    assert buffers.take(5) is first  # fresh pages would cost more than the copy
    assert buffers.take(40).shape == (40, 16)  # a larger step gets a buffer of its size
    for _ in range(SaveBuffers.KEEP + 3):
        buffers.give(SaveBuffers(16, 160).take(1))
    assert len(buffers._free) == SaveBuffers.KEEP


def test_a_session_named_by_the_front_is_told_to_the_node_when_the_request_starts_and_ends():
    """Active with the prompt's full blocks at its first lookup; paused with prompt and answer's when
    it finishes (what its next turn reads); closed on a final turn; a bad session is ignored."""
    from tiercake.workers.vllm.scheduler_side import ConnectorScheduler

    link = Link(local=4)
    s = scheduler(link)
    session = {"id": "ab" * 16, "pause_s": 12.5, "priority": 3}
    req = request(blocks=4)
    req.kv_transfer_params = {"tiercake": {"tenant": "acme", "salt": "acme", "session": session}}
    req.all_token_ids = req.prompt_token_ids + list(range(2 * BLOCK))  # the answer fills two more blocks
    s.get_num_new_matched_tokens(req, 0)
    s.get_num_new_matched_tokens(req, 0)  # asked again: told once
    ((node, notice, keys),) = link.told
    assert node == "here" and notice.state == "active" and notice.tenant == "acme" and notice.priority == 3
    assert len(keys) == 4 and keys == s._tracked["r"].keys[:4]
    s.request_finished(req, [])
    node, notice, keys = link.told[1]
    assert notice.state == "paused" and notice.resume_in == 12.5 and len(keys) == 6 and keys[:4] == link.told[0][2]

    final = request(rid="f")
    final.kv_transfer_params = {"tiercake": {"session": {"id": "cd" * 16, "close": True}}}
    s.get_num_new_matched_tokens(final, 0)
    s.request_finished(final, [])
    assert link.told[-1][1].state == "closed" and link.told[-1][2] == []

    bad = request(rid="b")
    bad.kv_transfer_params = {"tiercake": {"session": {"id": "not hex", "pause_s": -1}}}
    assert ConnectorScheduler._session(bad) is None
    before = len(link.told)
    s.get_num_new_matched_tokens(bad, 0)
    s.request_finished(bad, [])
    assert len(link.told) == before
