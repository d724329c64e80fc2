"""``LayerwiseLoader``: a forward pass's loads into vLLM's paged KV, one layer at a time, beside the pass.

vLLM's attention calls the connector's ``wait_for_layer_load(layer)`` before each layer. The loader
reads every block of the step on its own thread (``fetch``: the transfer and the seal check), then
scatters them layer by layer, announcing each layer as it lands: the pass computes the first layers
while the later ones are filled. On a GPU the copies would run beside the kernels; on a CPU the two
share the cores, so the overlap is smaller.

Nothing can leave the pass waiting: whatever fails, every layer is announced, and every block that
did not land is reported (vLLM recomputes it). A block that did land but whose request failed later
is reported as well: recomputing costs time, never a wrong token.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class Load(Protocol):
    """One request's blocks to load (the connector's ``RequestLoad``)."""

    request_id: str
    blocks: Sequence  # each with ``block_id``: vLLM's block to fill, in chain order


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one request's load did."""

    loaded: int  # blocks now in vLLM's KV
    failed: int  # blocks reported for recompute
    nbytes: int  # bytes loaded
    seconds: float  # reading and scattering them
    waited: float = 0.0  # of which the forward pass waited (the step's; the rest ran under its layers)


@dataclass
class _Step:
    layers: list[threading.Event]  # set once that layer's blocks are in (or the step failed)
    done: threading.Event
    errors: set[int] = field(default_factory=set)
    reports: dict[str, LoadReport] = field(default_factory=dict)
    waited: float = 0.0  # seconds the forward pass spent in ``wait``


class LayerwiseLoader:
    """See the module docstring. ``layers``: each layer's KV as a row of bytes per vLLM block;
    ``fetch(load, rows)``: read the load's blocks into ``rows`` (one tiercake block per row: every
    layer's part, in layer order) and say how many, from the first, are usable."""

    def __init__(self, layers: list[torch.Tensor], fetch: Callable[[Load, torch.Tensor], int]) -> None:
        self.layers = layers
        self.layer_bytes = [rows.shape[1] for rows in layers]
        self.block_bytes = sum(self.layer_bytes)
        self.fetch = fetch
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercake-load")
        self._staging: torch.Tensor | None = None
        self._step: _Step | None = None

    def start(self, loads: Sequence[Load]) -> None:
        """Begin the step's loads. The previous step's must have been finished: its failed blocks must
        reach vLLM, never be dropped."""
        if not loads:
            return
        if self._step is not None:
            raise RuntimeError("LayerwiseLoader: a step's loads started before the last step's were finished")
        rows = self._rows(sum(len(load.blocks) for load in loads))
        parts, at = [], 0
        for load in loads:
            parts.append((load, rows[at : at + len(load.blocks)]))
            at += len(load.blocks)
        self._step = _Step([threading.Event() for _ in self.layers], threading.Event())
        self._thread.submit(self._run, self._step, parts)

    def wait(self, layer: int) -> None:
        """Until ``layer``'s blocks are in vLLM's KV (bounded: the reads have their deadline)."""
        step = self._step
        if step is not None and not step.layers[layer].is_set():
            started = time.perf_counter()
            step.layers[layer].wait()
            step.waited += time.perf_counter() - started

    def finish(self) -> tuple[set[int], dict[str, LoadReport]]:
        """Wait for the step's loads: the blocks vLLM must recompute, and a report per request."""
        step, self._step = self._step, None
        if step is None:
            return set(), {}
        step.done.wait()
        return step.errors, {r: replace(report, waited=step.waited) for r, report in step.reports.items()}

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _rows(self, blocks: int) -> torch.Tensor:
        """A reused host buffer for ``blocks`` blocks: a normal tensor even inside vLLM's inference
        mode, since the transfer's thread writes into it."""
        if self._staging is None or self._staging.shape[0] < blocks:
            with torch.inference_mode(False):
                self._staging = torch.zeros((max(blocks, 16), self.block_bytes), dtype=torch.uint8)
        return self._staging[:blocks]

    def _run(self, step: _Step, parts: list[tuple[Load, torch.Tensor]]) -> None:
        started = time.perf_counter()
        try:
            with torch.inference_mode():  # vLLM's KV tensors are inference tensors
                fetched = [(load, rows, self.fetch(load, rows)) for load, rows in parts]
                indexes = [
                    torch.tensor([b.block_id for b in load.blocks[:n]], dtype=torch.long) for load, _, n in fetched
                ]
                offset = 0
                for layer, (kv, size) in enumerate(zip(self.layers, self.layer_bytes)):
                    for (_, rows, n), index in zip(fetched, indexes):
                        if n:
                            kv.index_copy_(0, index, rows[:n, offset : offset + size])
                    offset += size
                    self._landed(step, layer)
            seconds = time.perf_counter() - started
            for load, _, n in fetched:
                step.errors.update(b.block_id for b in load.blocks[n:])
                step.reports[load.request_id] = LoadReport(n, len(load.blocks) - n, n * self.block_bytes, seconds)
        except Exception as exc:  # noqa: BLE001 - whatever it was, vLLM recomputes every block of the step
            log.exception(
                "TiercakeConnector: loading failed (%s); vLLM recomputes the step's %d blocks",
                exc,
                sum(len(load.blocks) for load, _ in parts),
            )
            for load, _ in parts:
                step.errors.update(b.block_id for b in load.blocks)
                step.reports[load.request_id] = LoadReport(0, len(load.blocks), 0, time.perf_counter() - started)
        finally:
            for ready in step.layers:  # never leaves the forward pass waiting
                ready.set()
            step.done.set()

    def _landed(self, step: _Step, layer: int) -> None:
        step.layers[layer].set()
