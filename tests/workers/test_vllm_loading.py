"""The connector's loads into vLLM's paged KV, layer by layer (``LayerwiseLoader``), on real tensors laid
out as vLLM's CPU KV cache is (a row of bytes per block per layer). Through real vLLM: test_vllm.py."""

import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from paths import KV_DEVICE

from tiercake.workers.vllm.loading import Fetched, LayerwiseLoader, Segment, block_window

LAYERS, BLOCKS, LAYER_BYTES = 3, 12, 64


@dataclass
class Block:
    block_id: int


@dataclass
class Load:
    request_id: str
    blocks: list[Block]


def kv_layers(device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros((BLOCKS, LAYER_BYTES), dtype=torch.uint8, device=device) for _ in range(LAYERS)]


def payload(load: Load, i: int) -> torch.Tensor:
    """Tiercake block ``i`` of a load: layer l's part filled with a byte naming the block and layer."""
    return torch.cat(
        [torch.full((LAYER_BYTES,), 10 * load.blocks[i].block_id + layer, dtype=torch.uint8) for layer in range(LAYERS)]
    )


def fetch_all_but(unusable: dict[str, int]):
    """Each load's blocks read into its staging rows; its last ``unusable`` are not usable."""

    def fetch(load: Load, rows: torch.Tensor) -> Fetched:
        for i in range(len(load.blocks)):
            rows[i].copy_(payload(load, i))
        usable = len(load.blocks) - unusable.get(load.request_id, 0)
        return Fetched([Segment(rows.numpy().reshape(-1), [i * rows.shape[1] for i in range(usable)])])

    return fetch


def fetch_from_pool(pool: np.ndarray, released: list[str], staged_from: int | None = None):
    """Each load's blocks at odd, scattered offsets of a pool buffer (leased in place), or, from
    ``staged_from`` on, in the staging rows (read there: only on the node's disk)."""

    def fetch(load: Load, rows: torch.Tensor) -> Fetched:
        block = rows.shape[1]
        stop = len(load.blocks) if staged_from is None else staged_from
        starts = []
        for i in range(stop):
            start = 7 + (load.blocks[i].block_id * 3 + i) * (block + 13)  # unaligned, out of order
            pool[start : start + block] = payload(load, i).numpy()
            starts.append(start)
        for i in range(stop, len(load.blocks)):
            rows[i].copy_(payload(load, i))
        segments = [
            Segment(pool, starts),
            Segment(rows.numpy().reshape(-1), [i * block for i in range(stop, len(load.blocks))]),
        ]
        return Fetched([s for s in segments if s.starts], release=lambda: released.append(load.request_id))

    return fetch


class Made:
    """Loaders of one kind, over layers where that kind's KV lives: on the host, numpy's indexed
    copies; the GPU path (a pinned buffer, torch's indexed copies on a side stream) over layers on
    ``KV_DEVICE``: the CPU here, which takes the same path, or a GPU where one is lent."""

    def __init__(self, device: bool) -> None:
        self.device, self.loaders = device, []

    def layers(self) -> list[torch.Tensor]:
        return kv_layers(KV_DEVICE if self.device else "cpu")

    def __call__(self, layers, fetch, inline_bytes: int = 0) -> LayerwiseLoader:
        """``inline_bytes``: 0, every load on the loader thread (what these tests look at)."""
        self.loaders.append(LayerwiseLoader(layers, fetch, device=self.device, inline_bytes=inline_bytes))
        return self.loaders[-1]


@pytest.fixture(params=["host", "device"])
def made(request):
    made = Made(request.param == "device")
    yield made
    for loader in made.loaders:
        loader.close()


def test_each_load_lands_in_every_layer_of_its_blocks_and_an_unusable_tail_is_reported(made):
    layers = made.layers()
    loader = made(layers, fetch_all_but({"b": 1}))
    a, b = Load("a", [Block(3), Block(7)]), Load("b", [Block(1), Block(9), Block(4)])
    loader.start([a, b])
    for layer in range(LAYERS):
        loader.wait(layer)
    errors, reports = loader.finish()
    assert errors == {4}  # b's last block: vLLM recomputes it
    assert (reports["a"].loaded, reports["a"].failed, reports["b"].loaded, reports["b"].failed) == (2, 0, 2, 1)
    assert reports["a"].nbytes == 2 * LAYERS * LAYER_BYTES
    for layer in range(LAYERS):
        for block in (3, 7, 1, 9):
            assert bool((layers[layer][block] == 10 * block + layer).all())
        assert bool((layers[layer][4] == 0).all())  # not written
    assert loader.finish() == (set(), {})  # the step is over
    loader.start([Load("c", [Block(0)])])
    with pytest.raises(RuntimeError, match="before the last step's were finished"):
        loader.start([Load("d", [Block(1)])])  # its failures must reach vLLM first, never be dropped
    loader.finish()


def test_a_layer_is_ready_before_the_later_layers_are_in(made):
    """The forward pass computes layer 0 while layers 1 and 2 are still being filled."""
    loader = made(made.layers(), fetch_all_but({}))
    gate, landed = threading.Event(), []
    original = loader._landed

    def landed_then_hold(step, layer):
        original(step, layer)
        landed.append(layer)
        if layer == 0:
            gate.wait(10)

    loader._landed = landed_then_hold
    loader.start([Load("a", [Block(2), Block(5)])])
    loader.wait(0)  # returns while the loader holds before layer 1
    later = threading.Thread(target=loader.wait, args=(1,))
    later.start()
    later.join(0.3)
    assert later.is_alive() and landed == [0]
    gate.set()
    later.join(5)
    assert not later.is_alive()
    errors, reports = loader.finish()
    assert errors == set() and reports["a"].loaded == 2 and landed == [0, 1, 2]


def test_a_load_that_fails_outright_never_leaves_the_pass_waiting_and_every_block_is_recomputed(made):
    def broken(load, rows) -> Fetched:
        raise RuntimeError("the link's thread is gone")

    loader = made(made.layers(), broken)
    loader.start([Load("a", [Block(2), Block(5)]), Load("b", [Block(6)])])
    for layer in range(LAYERS):
        loader.wait(layer)  # each returns
    errors, reports = loader.finish()
    assert errors == {2, 5, 6} and reports["a"].loaded == 0 and reports["b"].failed == 1


@pytest.mark.parametrize("staged_from", [None, 1])
def test_blocks_leased_in_place_anywhere_in_the_pool_land_in_every_layer_and_the_lease_is_given_back(made, staged_from):
    """Straight from the pool's bytes (no staging copy), at offsets no block size divides; a chain's
    blocks only on disk come through the staging rows after the pool's."""
    layers, released = made.layers(), []
    pool = np.zeros(1 << 16, dtype=np.uint8)
    loader = made(layers, fetch_from_pool(pool, released, staged_from))
    a, b = Load("a", [Block(3), Block(7), Block(0)]), Load("b", [Block(11), Block(5)])
    loader.start([a, b])
    for layer in range(LAYERS):
        loader.wait(layer)
    errors, reports = loader.finish()
    assert errors == set() and reports["a"].loaded == 3 and reports["b"].loaded == 2
    assert sorted(released) == ["a", "b"]  # once the bytes are copied in
    for layer in range(LAYERS):
        for block in (3, 7, 0, 11, 5):
            assert bool((layers[layer][block] == 10 * block + layer).all()), (layer, block)
        assert bool((layers[layer][1] == 0).all())


def test_the_lease_is_given_back_when_copying_fails():
    released = []
    pool = np.zeros(1 << 16, dtype=np.uint8)
    fetch = fetch_from_pool(pool, released)

    def then_no_such_block(load, rows):
        got = fetch(load, rows)
        got.segments[0].starts[-1] = pool.size  # past the pool's end: the copy raises
        return got

    loader = LayerwiseLoader(kv_layers(), then_no_such_block)
    try:
        loader.start([Load("a", [Block(2), Block(4)])])
        errors, reports = loader.finish()
    finally:
        loader.close()
    assert errors == {2, 4} and reports["a"].loaded == 0 and released == ["a"]


def test_a_block_window_reads_any_run_of_the_buffer_without_copying_it():
    base = np.arange(40, dtype=np.uint8)
    window = block_window(base, 8)
    assert window.shape == (33, 8) and not window.flags.writeable
    assert window[[5, 0, 32]].tolist() == [list(range(5, 13)), list(range(8)), list(range(32, 40))]
    base[6] = 99
    assert window[5, 1] == 99  # a view


def test_what_the_pass_waited_is_part_of_the_loads_own_time(made):
    """The pass waits from the step's start; its wake-up after the last layer is not the load's. The
    read goes on only once the pass is about to wait, then takes 0.1 s: the pass waited most of it
    however late its thread came to ``wait`` (a fixed 0.05 s read, started with the step, left a
    busy machine's late pass 0.03 s of it to wait)."""
    import time

    waiting = threading.Event()

    def slow(load, rows):
        waiting.wait(10)
        time.sleep(0.1)
        return fetch_all_but({})(load, rows)

    loader = made(made.layers(), slow)
    loader.start([Load("a", [Block(1)])])
    waiting.set()
    for layer in range(LAYERS):
        loader.wait(layer)
    _, reports = loader.finish()
    assert 0.05 < reports["a"].waited <= reports["a"].seconds


def test_every_layer_reaches_the_pass_before_the_seals_are_confirmed_and_a_failure_is_still_reported(made):
    """The seals (and entries) are confirmed behind the pass: every layer is announced once copied,
    the confirmation runs meanwhile, and a block it fails is reported when the step finishes (vLLM
    throws away what the pass made of it and recomputes). The load's time ends with the copy."""
    confirmed, go_on = threading.Event(), threading.Event()

    def confirm_later(load, rows):
        got = fetch_all_but({})(load, rows)

        def confirm() -> int:
            go_on.wait(10)
            confirmed.set()
            return got.usable - 1  # the last block failed its seal

        got.confirm = confirm
        return got

    loader = made(made.layers(), confirm_later)
    loader.start([Load("a", [Block(1), Block(2)])])
    for layer in range(LAYERS):
        loader.wait(layer)
    assert not confirmed.is_set()  # the pass had every layer before the check ended
    go_on.set()
    errors, reports = loader.finish()
    report = reports["a"]
    assert confirmed.is_set() and errors == {2} and report.loaded == 1
    assert report.seconds >= report.fetch_s + report.copy_s


def test_a_small_load_is_copied_on_the_asking_thread_and_confirmed_behind_the_pass(made):
    """Under ``inline_bytes``, ``start`` itself fetches and copies (every layer is in when it returns:
    no hand-off to the loader thread and back); the confirmation still runs on the loader thread, and
    what it fails is reported when the step finishes."""
    asked_on, go_on = [], threading.Event()

    def fetch(load, rows):
        asked_on.append(threading.current_thread())
        got = fetch_all_but({})(load, rows)

        def confirm() -> int:
            go_on.wait(10)
            asked_on.append(threading.current_thread())
            return got.usable - 1

        got.confirm = confirm
        return got

    layers = made.layers()
    loader = made(layers, fetch, inline_bytes=1 << 20)
    loader.start([Load("a", [Block(1), Block(2)])])
    assert asked_on == [threading.current_thread()]
    if KV_DEVICE != "cpu":  # into a GPU's KV the copies were enqueued on a side stream: the pass's wait orders them
        for layer in range(LAYERS):
            loader.wait(layer)
    assert all(int(layers[layer][1][0]) == 10 + layer for layer in range(LAYERS))  # in before start returned
    go_on.set()
    errors, reports = loader.finish()
    assert asked_on[1] is not threading.current_thread()  # the check ran on the loader thread
    assert errors == {2} and reports["a"].loaded == 1
