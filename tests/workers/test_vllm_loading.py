"""The connector's loads into vLLM's paged KV, layer by layer (``LayerwiseLoader``), on real tensors laid
out as vLLM's CPU KV cache is (a row of bytes per block per layer). Through real vLLM: test_vllm.py."""

import threading
from dataclasses import dataclass

import pytest
import torch

from tiercake.workers.vllm.loading import LayerwiseLoader

LAYERS, BLOCKS, LAYER_BYTES = 3, 12, 64


@dataclass
class Block:
    block_id: int


@dataclass
class Load:
    request_id: str
    blocks: list[Block]


def kv_layers() -> list[torch.Tensor]:
    return [torch.zeros((BLOCKS, LAYER_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]


def payload(load: Load, i: int) -> torch.Tensor:
    """Tiercake block ``i`` of a load: layer l's part filled with a byte naming the block and layer."""
    return torch.cat(
        [torch.full((LAYER_BYTES,), 10 * load.blocks[i].block_id + layer, dtype=torch.uint8) for layer in range(LAYERS)]
    )


def fetch_all_but(unusable: dict[str, int]):
    def fetch(load: Load, rows: torch.Tensor) -> int:
        for i in range(len(load.blocks)):
            rows[i].copy_(payload(load, i))
        return len(load.blocks) - unusable.get(load.request_id, 0)

    return fetch


@pytest.fixture
def made():
    loaders = []

    def make(layers, fetch) -> LayerwiseLoader:
        loaders.append(LayerwiseLoader(layers, fetch))
        return loaders[-1]

    yield make
    for loader in loaders:
        loader.close()


def test_each_load_lands_in_every_layer_of_its_blocks_and_an_unusable_tail_is_reported(made):
    layers = kv_layers()
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
    loader = made(kv_layers(), fetch_all_but({}))
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
    def broken(load, rows):
        raise RuntimeError("the link's thread is gone")

    loader = made(kv_layers(), broken)
    loader.start([Load("a", [Block(2), Block(5)]), Load("b", [Block(6)])])
    for layer in range(LAYERS):
        loader.wait(layer)  # each returns
    errors, reports = loader.finish()
    assert errors == {2, 5, 6} and reports["a"].loaded == 0 and reports["b"].failed == 1
