"""``LayerwiseLoader``: a forward pass's loads into vLLM's paged KV, one layer at a time, beside the pass.

vLLM's attention calls the connector's ``wait_for_layer_load(layer)`` before each layer. The loader
fetches every block of the step on its own thread (``fetch``: the blocks leased in place in the
node's shared pool, or read into a reused host buffer), then copies them in layer by layer,
announcing each layer as it lands: the pass computes the first layers while the later ones are
filled. The seals are checked behind the pass (``Fetched.confirm``: the helper thread starts from
the back as soon as the blocks are found, the loader joins from the front once it has copied); a
block that fails is reported with the step's invalid blocks, and vLLM throws away what the pass made
of it for the requests that read it and recomputes (its ``recompute`` policy). On this CPU the check
costs about four times a copy of the same bytes: in front of the pass, it was most of a load.

Where the bytes come from is a ``Segment``: a host buffer (the mapped pool itself, or the staging
buffer) and where each block starts in it. Each layer's part of every block is one indexed copy per
segment, straight from that buffer into the layer's KV (``KvCopier``): on the host, numpy's indexed
assignment over a strided view of the buffer (no copy per block, the GIL released for the bytes);
for KV on a GPU, one gather into a reused pinned buffer and a host-to-device copy on a side stream,
each layer's attention waiting for that layer's copy on the device (the same code runs on the CPU).

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
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

log = logging.getLogger(__name__)


class Load(Protocol):
    """One request's blocks to load (the connector's ``RequestLoad``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def blocks(self) -> Sequence:  # each with ``block_id``: vLLM's block to fill, in chain order
        ...


L = TypeVar("L", bound=Load)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one request's load did."""

    loaded: int  # blocks now in vLLM's KV
    failed: int  # blocks reported for recompute
    nbytes: int  # bytes loaded
    seconds: float  # from the step's start until every layer was in
    waited: float = 0.0  # of which the forward pass waited (the step's; the rest ran under its layers)
    seal_s: float = 0.0  # checking the seals after the copy, behind the pass (not part of ``seconds``)
    fetch_s: float = 0.0  # of which the step's finding its blocks (leases, reads)
    copy_s: float = 0.0  # of which the step's copying into the layers
    unleased: int = 0  # of the blocks loaded, those read by the pool's index entries, without a lease


@dataclass(slots=True)
class Segment:
    """Consecutive blocks of a load in one host buffer: block i is ``base[starts[i]:][:block_bytes]``."""

    base: np.ndarray  # flat uint8: the mapped pool, or the loader's staging buffer
    starts: list[int]

    def step(self) -> int | None:
        """The blocks' spacing when they lie evenly within ``base`` (else None)."""
        starts = self.starts
        step = starts[1] - starts[0] if len(starts) > 1 else 0
        even = step > 0 and all(b - a == step for a, b in zip(starts, starts[1:]))
        if (even or len(starts) == 1) and starts[0] >= 0 and starts[-1] <= self.base.size:
            return step
        return None

    def part(self, offset: int, size: int, window: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Bytes ``[offset, offset + size)`` of each block, a row per block: a plain strided view where
        the blocks lie evenly (as a chain saved in one batch does in the pool: no temporary), else an
        indexed read of ``window(base)`` (its ``block_window``)."""
        step = self.step()
        if step is None or self.starts[-1] + offset + size > self.base.size:
            return window(self.base)[self.starts, offset : offset + size]  # (numpy checks these bounds)
        start = self.starts[0] + offset
        return as_strided(self.base[start:], (len(self.starts), size), (step, 1), writeable=False)


@dataclass(slots=True)
class Fetched:
    """What ``fetch`` found of one load: its usable blocks (a chain is usable up to its first block
    that is missing or whose seal does not verify), in chain order across the segments, and what to
    call once they are copied in (the pool's lease given back)."""

    segments: list[Segment]
    release: Callable[[], None] | None = None
    seal_s: float = 0.0
    unleased: bool = False  # read by the pool's index entries, with no lease
    # after the copy, behind the pass: how many of the usable blocks, from the first, carry a seal that
    # verifies (and, read without a lease, are still where their entries said); None: all of them
    confirm: Callable[[], int] | None = None

    @property
    def usable(self) -> int:
        return sum(len(s.starts) for s in self.segments)


Fetch = Callable[[L, torch.Tensor], Fetched]


def block_window(base: np.ndarray, block_bytes: int) -> np.ndarray:
    """Every ``block_bytes``-long run of ``base`` by where it starts (row s is ``base[s:][:block_bytes]``):
    a read-only view, so one indexed read takes blocks from anywhere in the buffer."""
    return as_strided(base, (base.size - block_bytes + 1, block_bytes), (1, 1), writeable=False)


class KvCopier:
    """Copies one layer's part of a segment's blocks into that layer's KV.

    On the host: ``kv[ids] = window[starts, part]``, one numpy indexed copy (no copy per block).
    Elsewhere (KV on a GPU): the part is gathered into a reused pinned host buffer, one row per block,
    and copied over and scattered on a side stream; ``wait_device(layer)`` makes the current stream
    wait for that layer's copies. ``device=True`` takes that path for host KV too (tested on CPU)."""

    def __init__(self, layers: list[torch.Tensor], device: bool | None = None) -> None:
        self.layers = layers
        self.layer_bytes = [rows.shape[1] for rows in layers]
        self.block_bytes = sum(self.layer_bytes)
        on_host = all(t.device.type == "cpu" for t in layers)
        self.device = (not on_host) if device is None else device
        self.host_layers = None if self.device else [t.numpy() for t in layers]
        self._pinned: torch.Tensor | None = None
        cuda = not on_host and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device=layers[0].device) if cuda else None
        self._events: dict[int, Any] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def window(self, base: np.ndarray) -> np.ndarray:
        key = (base.__array_interface__["data"][0], base.size)
        found = self._windows.get(key)
        if found is None:
            if len(self._windows) > 8:  # staging buffers are replaced as they grow; the pool stays
                self._windows.clear()
            found = self._windows[key] = block_window(base, self.block_bytes)
        return found

    def staging(self, blocks: int) -> np.ndarray:
        """For the device path: a reused host buffer of ``blocks`` rows of a layer's size (pinned where a
        GPU is present). The previous step's copies must be finished (``synchronize``)."""
        need = blocks * max(self.layer_bytes) * len(self.layers)
        if self._pinned is None or self._pinned.numel() < need:
            with torch.inference_mode(False):
                self._pinned = torch.empty(max(need, 1 << 20), dtype=torch.uint8, pin_memory=self._stream is not None)
        return self._pinned.numpy()

    def copy(self, layer: int, offset: int, parts: list[tuple[Segment, list[int]]]) -> None:
        """Layer ``layer``'s bytes (``offset`` into each block) of each segment's blocks into vLLM's
        blocks ``ids`` beside it."""
        size = self.layer_bytes[layer]
        if self.host_layers is not None:
            kv = self.host_layers[layer]
            for seg, ids in parts:
                src = seg.part(offset, size, self.window)
                if ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1)):
                    kv[ids[0] : ids[-1] + 1] = src  # vLLM's blocks in a run: a strided copy
                else:
                    kv[ids] = src
            return
        count = sum(len(ids) for _, ids in parts)
        start = layer * count * max(self.layer_bytes)  # each layer its own rows: copies may still be in flight
        rows = self._pinned_rows(start, count, size)
        at = 0
        for seg, ids in parts:
            rows.numpy()[at : at + len(ids)] = seg.part(offset, size, self.window)
            at += len(ids)
        index = torch.tensor([i for _, ids in parts for i in ids], dtype=torch.long)
        dst = self.layers[layer]
        if self._stream is None:
            dst.index_copy_(0, index, rows)
            return
        with torch.cuda.stream(self._stream):
            dst.index_copy_(0, index.to(dst.device, non_blocking=True), rows.to(dst.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[layer] = event

    def _pinned_rows(self, start: int, count: int, size: int) -> torch.Tensor:
        flat = self._pinned
        assert flat is not None, "staging() sizes the buffer before a step's copies"
        return flat[start : start + count * size].view(count, size)

    def wait_device(self, layer: int) -> None:
        event = self._events.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.layers[layer].device).wait_event(event)

    def synchronize(self) -> None:
        """Every copy enqueued so far is done (its host buffers may be reused)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._events.clear()


@dataclass
class _Copied(Generic[L]):
    """What ``_load`` did of a step, for ``_confirm``: the blocks found, when, or why it failed."""

    fetched: list[tuple[L, Fetched]] = field(default_factory=list)
    found_at: float = 0.0
    copied_at: float = 0.0
    failed: Exception | None = None


@dataclass
class _Step:
    layers: list[threading.Event]  # set once that layer's blocks are in (or the step failed)
    done: threading.Event
    errors: set[int] = field(default_factory=set)
    reports: dict[str, LoadReport] = field(default_factory=dict)
    waited: float = 0.0  # seconds the forward pass spent in ``wait``
    started: float = field(default_factory=time.perf_counter)  # when ``start`` began the step


class LayerwiseLoader(Generic[L]):
    """See the module docstring. ``layers``: each layer's KV as a row of bytes per vLLM block;
    ``fetch(load, rows)``: find the load's blocks (in place, or read into ``rows``: one tiercake
    block per row, every layer's part in layer order) and say which are usable (``Fetched``)."""

    INLINE_BYTES = 4 << 20  # a load this small is fetched and copied on the thread that asks (``start``)

    def __init__(
        self, layers: list[torch.Tensor], fetch: Fetch[L], device: bool | None = None, inline_bytes: int | None = None
    ) -> None:
        self.inline_bytes = self.INLINE_BYTES if inline_bytes is None else inline_bytes
        self.copier = KvCopier(layers, device)
        self.layers = layers
        self.layer_bytes = self.copier.layer_bytes
        self.block_bytes = self.copier.block_bytes
        self.fetch = fetch
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercake-load")
        self._staging: torch.Tensor | None = None
        self._step: _Step | None = None

    def start(self, loads: Sequence[L]) -> None:
        """Begin the step's loads. The previous step's must have been finished: its failed blocks must
        reach vLLM, never be dropped. A load of at most ``inline_bytes`` is fetched and copied here, on
        the asking thread (handing it to the loader thread and each layer back cost more wake-ups
        than its copy here); its confirmation still runs behind the pass, on the loader thread."""
        if not loads:
            return
        if self._step is not None:
            raise RuntimeError("LayerwiseLoader: a step's loads started before the last step's were finished")
        blocks = sum(len(load.blocks) for load in loads)
        rows = self._rows(blocks)
        parts, at = [], 0
        for load in loads:
            parts.append((load, rows[at : at + len(load.blocks)]))
            at += len(load.blocks)
        step = self._step = _Step([threading.Event() for _ in self.layers], threading.Event())
        if blocks * self.block_bytes <= self.inline_bytes:
            copied = self._load(step, parts)
            self._thread.submit(self._confirm, step, parts, copied)
        else:
            self._thread.submit(lambda: self._confirm(step, parts, self._load(step, parts)))

    def wait(self, layer: int) -> None:
        """Until ``layer``'s blocks are in vLLM's KV (bounded: the reads have their deadline)."""
        step = self._step
        if step is not None and not step.layers[layer].is_set():
            started = time.perf_counter()
            step.layers[layer].wait()
            step.waited += time.perf_counter() - started
        if step is not None:
            self.copier.wait_device(layer)

    def finish(self) -> tuple[set[int], dict[str, LoadReport]]:
        """Wait for the step's loads: the blocks vLLM must recompute, and a report per request."""
        step, self._step = self._step, None
        if step is None:
            return set(), {}
        step.done.wait()
        # the pass's last wake-up can come after the loader's clock stopped: what it waited beyond the
        # load's own time was that wake-up, not the load
        return step.errors, {
            r: replace(report, waited=min(step.waited, report.seconds)) for r, report in step.reports.items()
        }

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _rows(self, blocks: int) -> torch.Tensor:
        """A reused host buffer for ``blocks`` blocks: a normal tensor even inside vLLM's inference
        mode, since the transfer's thread writes into it."""
        if self._staging is None or self._staging.shape[0] < blocks:
            with torch.inference_mode(False):
                self._staging = torch.zeros((max(blocks, 16), self.block_bytes), dtype=torch.uint8)
        return self._staging[:blocks]

    def _load(self, step: _Step, parts: list[tuple[L, torch.Tensor]]) -> _Copied[L]:
        """Find the step's blocks and copy them in, each layer announced as it lands. Whatever fails,
        every layer is announced (the pass never waits on a load that will not come)."""
        copied: _Copied[L] = _Copied()
        try:
            with torch.inference_mode():  # vLLM's KV tensors are inference tensors
                copied.fetched = [(load, self.fetch(load, rows)) for load, rows in parts]
                copied.found_at = time.perf_counter()
                self._copy_in(step, copied.fetched)
                copied.copied_at = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - whatever it was, vLLM recomputes every block of the step
            copied.failed = exc
        finally:
            for ready in step.layers:
                ready.set()
        return copied

    def _confirm(self, step: _Step, parts: list[tuple[L, torch.Tensor]], copied: _Copied[L]) -> None:
        """Behind the pass: the seals (and entries) of what was copied, checked; the step's failed
        blocks and reports; the blocks' leases given back."""
        started = step.started  # from the step's start: the pass may wait from then on
        try:
            if copied.failed is not None:
                raise copied.failed
            fetched = copied.fetched
            # what fails is reported with the step's invalid blocks: vLLM throws away what the pass
            # made of it and recomputes
            usable = [got.usable if got.confirm is None else min(got.usable, got.confirm()) for _, got in fetched]
            for (load, got), n in zip(fetched, usable):
                step.errors.update(b.block_id for b in load.blocks[n:])
                step.reports[load.request_id] = LoadReport(
                    n,
                    len(load.blocks) - n,
                    n * self.block_bytes,
                    copied.copied_at - started,
                    seal_s=got.seal_s,
                    fetch_s=copied.found_at - started,
                    copy_s=copied.copied_at - copied.found_at,
                    unleased=n * got.unleased,
                )
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
            for _, got in copied.fetched:  # after the layers: nothing the pass waits for
                if got.release is not None:
                    got.release()
            step.done.set()

    def _copy_in(self, step: _Step, fetched: list[tuple[L, Fetched]]) -> None:
        """Every usable block into each layer's KV, a layer at a time, announcing each."""
        parts: list[tuple[Segment, list[int]]] = []
        for load, got in fetched:
            at = 0
            for seg in got.segments:
                parts.append((seg, [b.block_id for b in load.blocks[at : at + len(seg.starts)]]))
                at += len(seg.starts)
        parts = [(seg, ids) for seg, ids in parts if ids]
        if self.copier.device:
            self.copier.synchronize()  # the last step's copies are done before their buffer is reused
            self.copier.staging(sum(len(ids) for _, ids in parts))
        offset = 0
        for layer, size in enumerate(self.layer_bytes):
            if parts:
                self.copier.copy(layer, offset, parts)
            offset += size
            self._landed(step, layer)

    def _landed(self, step: _Step, layer: int) -> None:
        step.layers[layer].set()
