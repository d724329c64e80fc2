"""The worker side of ``TiercakeConnector`` (in vLLM's model runner): when the forward pass starts, a
loader thread leases the blocks the scheduler side planned in the holding node's shared pool (same
host; across hosts, and for blocks only on its disk, they are read into a reused host buffer), checks
their seals over those bytes (two threads), and copies them into vLLM's paged KV one layer at a time
(``loading.py``); each layer's attention waits only for its own layer. A block that cannot be read,
or whose seal does not verify under the request's salt, is reported and vLLM recomputes from it.
After the pass, newly full blocks are gathered from every layer into one tiercake block, sealed, and
written to the node agent in the background, within a bounded budget of bytes in flight (past it,
saves are dropped and counted: a missed save is a future miss, never a stall); none in a step whose
load failed, nor in the next (what the pass computed over KV it lacked is never sealed and saved)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from tiercake.blocks import SealCheck, Sealer, SealKeys
from tiercake.transfer import ItemError, Status

from .link import TiercakeLink
from .loading import Fetched, LayerwiseLoader, LoadReport, Segment
from .metadata import ConnectorSettings, RequestLoad, TiercakeMetadata, TiercakeWorkerMetadata

log = logging.getLogger(__name__)


def _leading(blocks: list) -> list[tuple[int, int, bytes]]:
    """The leased blocks before the first that is not."""
    n = next((i for i, b in enumerate(blocks) if isinstance(b, BaseException)), len(blocks))
    return blocks[:n]


def _on_disk(block: object) -> bool:
    """Whether a block the pool could not lease is on the node's disk (read it over the stream)."""
    return isinstance(block, ItemError) and block.status is Status.NOT_IN_MEMORY


def allow_amx() -> bool:
    """Ask Linux for Intel AMX tiles for this process, before its first attention step.

    vLLM's CPU attention picks its AMX kernel for bf16 wherever the CPU has AMX
    (``cpu_attn._get_attn_isa``), but never asks for the tiles (``arch_prctl(ARCH_REQ_XCOMP_PERM)``),
    without which the first AMX instruction is SIGILL; torch asks only when one of its own oneDNN
    kernels first uses AMX. A server whose first step is attention over KV it loaded (a restarted
    instance asked for a prompt the pool holds) reached vLLM's kernel first and died ("Illegal
    instruction" in ``cpu_attention_with_kv_cache``). Asking is harmless on a CPU without AMX.
    Whether this process may now use AMX (False: no AMX, or not granted)."""
    cpu = getattr(torch, "cpu", None)
    init = getattr(cpu, "_init_amx", None)
    return bool(init()) if init is not None else False


class SaveBuffers:
    """Host rows for the saves in flight, reused. Memory never touched fills at under 1 GB/s here, so
    gathering a step's new blocks into fresh pages cost more than the copy itself (4.8 ms against
    0.13 ms of memcpy for 3.5 MiB); a buffer comes back when every write from it has ended."""

    KEEP = 8  # buffers kept for reuse at most (past it, returned ones are let go)

    def __init__(self, block_bytes: int = 0, budget: int = 0) -> None:
        self.block_bytes, self.budget = block_bytes, budget
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, rows: int) -> torch.Tensor:
        """A buffer of at least ``rows`` blocks (its first rows are the caller's)."""
        with self._lock:
            fits = [b for b in self._free if b.shape[0] >= rows]
            if fits:
                best = min(fits, key=lambda b: b.shape[0])
                self._free.remove(best)
                return best
        # room for a few steps' saves, within the bytes a save may have in flight
        size = max(rows, min(64, self.budget // max(self.block_bytes, 1)))
        with torch.inference_mode(False):  # the link's thread reads it after this step
            return torch.zeros((size, self.block_bytes), dtype=torch.uint8)  # touched once, here

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.KEEP:
                self._free.remove(min(self._free, key=lambda b: b.shape[0]))


class ConnectorWorker:
    """The worker side's state: vLLM's paged KV as rows of bytes, the layer-by-layer loader, the
    loads' reports and errors, and the saves in flight."""

    def __init__(
        self,
        settings: ConnectorSettings,
        link: TiercakeLink,
        seal_keys: SealKeys | None,
        layer_names: list[str],
        num_blocks: int,
    ) -> None:
        self.settings, self.link, self._seal_keys = settings, link, seal_keys
        self.layer_names, self.num_blocks = layer_names, num_blocks
        self._layers: list[torch.Tensor] = []
        self._layer_bytes: list[int] = []
        self.block_nbytes = 0
        self._load_errors: set[int] = set()
        self._layer_index: dict[str, int] = {}
        self._loader: LayerwiseLoader[RequestLoad] | None = None
        self._reports: dict[str, LoadReport] = {}
        self._unsafe_steps = 0  # steps left whose saves are not made: a load failed (``wait_for_save``)
        self._in_flight = 0  # bytes of saves not yet acknowledged
        self._lock = threading.Lock()
        self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiercake-seal")
        self._save_buffers = SaveBuffers()
        self.stats = {
            "loaded_blocks": 0,
            "in_place_blocks": 0,  # of which copied straight from the node's shared pool (no staging copy)
            "unleased_blocks": 0,  # of which read by the pool's index entries, with no lease (no round trip)
            "moved_blocks": 0,  # read that way, but freed or moved in the pool meanwhile: recomputed
            "failed_blocks": 0,
            "refused_blocks": 0,
            "saved_blocks": 0,
            "dropped_saves": 0,
            "unsafe_saves": 0,  # not made: a step after a failed load (computed over KV it lacked)
            "failed_saves": 0,
        }

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        allow_amx()
        names = self.layer_names or sorted(kv_caches)
        layers = []
        for name in names:
            kv = kv_caches[name]
            if kv.shape[0] != self.num_blocks or kv.stride(0) != kv[0].numel() or not kv[0].is_contiguous():
                raise ValueError(
                    f"TiercakeConnector: layer {name} has KV of shape {tuple(kv.shape)} and strides "
                    f"{kv.stride()}; expected {self.num_blocks} contiguous blocks along the first dimension"
                )
            layers.append(kv.view(kv.shape[0], -1).view(torch.uint8))  # a row of bytes per block
        self._layers = layers
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._loader = LayerwiseLoader(layers, self._fetch)
        self._layer_bytes, self.block_nbytes = self._loader.layer_bytes, self._loader.block_bytes
        self._save_buffers = SaveBuffers(self.block_nbytes, self.settings.max_save_bytes_in_flight)

    def _gather(self, block_ids: list[int], staging: torch.Tensor) -> None:
        """Rows of ``staging`` (one tiercake block each: every layer's part, in layer order) from vLLM's
        blocks ``block_ids`` of every layer: one indexed copy per layer (``LayerwiseLoader`` does the
        inverse, layer by layer)."""
        host = None if self._loader is None or self._loader.copier.device else self._loader.copier.host_layers
        index = torch.tensor(block_ids, dtype=torch.long)
        out = staging.numpy()
        offset = 0
        for layer, (rows, n) in enumerate(zip(self._layers, self._layer_bytes)):
            if host is not None:  # numpy's indexed copy: no temporary, the GIL let go
                out[:, offset : offset + n] = host[layer][block_ids]
            else:
                staging[:, offset : offset + n].copy_(rows.index_select(0, index))
            offset += n

    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, TiercakeMetadata) and meta.loads and self._loader is not None:
            self._finish_loads()  # vLLM finishes each step (wait_for_save); this only guards against it not
            self._loader.start(meta.loads)

    def _sealer(self, salt: str) -> Sealer:
        """The seals of keys hashed under ``salt`` (loads and saves are enabled only with the secret)."""
        if self._seal_keys is None:
            raise RuntimeError("this connector has no transfer secret: it neither loads nor saves blocks")
        return self._seal_keys.for_salt(salt)

    def _fetch(self, load: RequestLoad, rows: torch.Tensor) -> Fetched:
        """Find one request's blocks: on this host, leased in place in the node's shared pool (those
        only on its disk read into ``rows``); elsewhere, read into ``rows``. A chain is usable only up
        to its first missing block, or its first whose seal does not verify (forged or corrupt). The
        rest is recomputed."""
        keys = [b.key for b in load.blocks]
        unleased = self._from_index(load, keys)
        if unleased is not None:
            return unleased
        lease = self.link.lease(load.node, keys, self.block_nbytes, self.settings.load_timeout_s)
        if lease is None:
            return self._complete(load, keys, rows, [], None, [], read_rest=True)
        leading = _leading(lease.blocks)
        pool = lease.region.host_array(0, lease.region.data_size)
        found = [(keys[i], pool[offset : offset + n], seal) for i, (offset, n, seal) in enumerate(leading)]
        stop = lease.blocks[len(found)] if len(found) < len(keys) else None
        fetched = self._complete(
            load, keys, rows, found, pool, [offset for offset, _, _ in leading], read_rest=_on_disk(stop)
        )
        fetched.release = lambda: self.link.release(load.node, lease)
        if stop is not None and not _on_disk(stop) and fetched.usable == len(found):
            self._log_missing(load, len(keys) - len(found), stop)
        return fetched

    def _from_index(self, load: RequestLoad, keys: list[bytes]) -> Fetched | None:
        """Every block of ``load`` read in place by the pool index entries the scheduler side found,
        with no lease (no round trip: see ``PoolPlaces``); None when any of them is not there as the
        entries said (a block moved since the lookup: the lease path then). The seals are checked from
        the back on the helper thread while the loader copies, and from the front by the loader once it
        has copied (``SealCheck``), behind the pass; then the entries are read again (``_confirmed``)."""
        entries = [b.entry for b in load.blocks]
        if not load.pool or min(entries) < 0:
            return None
        places = self.link.pool_places(load.node, load.pool, self.settings.load_timeout_s)
        if places is None:
            return None
        snapshot, found = places.read(entries, keys, self.block_nbytes)
        if len(found) < len(keys):
            return None
        pool, n = places.data, self.block_nbytes
        check = self._checking(load, [(k, pool[o : o + n], s) for k, (o, s) in zip(keys, found)])
        fetched = Fetched([Segment(pool, [offset for offset, _ in found])], unleased=True)
        fetched.confirm = lambda: self._confirmed(
            load, fetched, check, len(keys), unmoved=lambda: places.unchanged(entries, snapshot)
        )
        fetched.release = lambda: self.link.touch(load.node, keys, n)  # after the copy: nothing waits for it
        return fetched

    def _checking(self, load: RequestLoad, items: list) -> SealCheck:
        """The seals of ``items`` (key, bytes, seal), the helper thread checking from the back from now
        (fewer than four: not worth a hand-off); the loader joins from the front (``_confirmed``)."""
        check = SealCheck(self._sealer(load.salt), items)
        if len(items) >= 4:
            self._helper.submit(check.from_back)
        return check

    def _confirmed(
        self,
        load: RequestLoad,
        fetched: Fetched,
        check: SealCheck,
        in_place: int,
        unmoved: Callable[[], int] | None = None,
        unread: list | None = None,
    ) -> int:
        """After the copy, behind the pass: how many of the blocks, from the first, carry a seal that
        verifies and, read by their entries (``unmoved``), were not moved in the pool meanwhile (a block
        that moved while it was read failed its seal for that, not because it was forged). The first
        ``in_place`` were copied straight from the pool; ``unread``: the read results after the last
        block read (what to log as missing)."""
        started = time.perf_counter()
        verified = check.prefix(helped=len(check.items) >= 4)
        total = len(check.items)
        unchanged = total if unmoved is None else unmoved()
        fetched.seal_s = time.perf_counter() - started  # what the check added after the copy
        usable = min(verified, unchanged)
        self.stats["in_place_blocks"] += min(in_place, usable)
        if fetched.unleased:
            self.stats["unleased_blocks"] += usable
        if unchanged < total and unchanged <= verified:
            self.stats["moved_blocks"] += total - unchanged
            log.info(
                "TiercakeConnector: request %s: block %d moved in %s's pool while it was loaded; vLLM recomputes "
                "from it",
                load.request_id,
                unchanged,
                load.node,
            )
        elif verified < total:
            self._refused(load, verified, total)
        elif unread:
            self._log_missing(load, len(unread), unread[0].error)
        return usable

    def _refused(self, load: RequestLoad, first: int, total: int) -> None:
        self.stats["refused_blocks"] += total - first
        log.warning(
            "TiercakeConnector: request %s: block %d from %s failed its seal (forged or corrupt); vLLM "
            "recomputes from it",
            load.request_id,
            first,
            load.node,
        )

    def _complete(
        self,
        load: RequestLoad,
        keys: list[bytes],
        rows: torch.Tensor,
        found: list,
        pool: np.ndarray | None,
        starts: list[int],
        read_rest: bool,
    ) -> Fetched:
        """The blocks after ``found`` (those only on disk, or all of them across hosts) read into
        ``rows`` if ``read_rest``; every block found or read is copied in, and its seal checked behind
        the pass (``confirm``: from the back on the helper thread from now, from the front once
        copied). ``found`` holds (key, bytes, seal) of the blocks leased in ``pool`` at ``starts``."""
        first = len(found)
        staged = rows.numpy()
        rest = []
        if read_rest and first < len(keys):
            rest = self.link.read(load.node, keys[first:], list(rows[first:]), self.settings.load_timeout_s)
        read = next((i for i, r in enumerate(rest) if not r.ok), len(rest))
        check = self._checking(load, found + [(keys[first + i], staged[first + i], rest[i].seal) for i in range(read)])
        segments = [Segment(pool, starts)] if pool is not None else []
        segments.append(Segment(staged.reshape(-1), [i * self.block_nbytes for i in range(first, first + read)]))
        fetched = Fetched([s for s in segments if s.starts])
        fetched.confirm = lambda: self._confirmed(load, fetched, check, first, unread=rest[read:])
        return fetched

    def _log_missing(self, load: RequestLoad, missing: int, error: object) -> None:
        log.warning(
            "TiercakeConnector: request %s: %d of %d blocks from %s not loaded (%s); vLLM recomputes them",
            load.request_id,
            missing,
            len(load.blocks),
            load.node,
            error,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self._loader is not None and layer is not None:
            self._loader.wait(layer)

    def _finish_loads(self) -> None:
        """The step's loads, done: their failed blocks and reports handed on."""
        if self._loader is None:
            return
        errors, reports = self._loader.finish()
        if errors:
            self._unsafe_steps = 2  # this step and the next, which vLLM scheduled before it knew
        self._load_errors.update(errors)
        self._reports.update(reports)
        for report in reports.values():
            self.stats["loaded_blocks"] += report.loaded
            self.stats["failed_blocks"] += report.failed

    def wait_for_save(self, meta: object) -> None:
        """Save the step's newly full blocks, in the background. Not in a step whose loads failed, nor
        in the next: the pass computed over KV that was not loaded (a block missing, moved or
        forged), so what it made of the following blocks is wrong until vLLM recomputes them, and a
        save would seal it under their keys (the next step was scheduled before vLLM knew, and a
        request sharing the block is not named here). A save missed is a future miss, never a wrong
        answer; the failed request's blocks are saved when recomputed (the scheduler side)."""
        self._finish_loads()
        unsafe, self._unsafe_steps = self._unsafe_steps > 0, max(0, self._unsafe_steps - 1)
        node = self.settings.node  # (saves are enabled only with a node to save to)
        if not isinstance(meta, TiercakeMetadata) or not meta.saves or not self._layers or node is None:
            return
        if unsafe:
            self.stats["unsafe_saves"] += len(meta.saves)
            return
        nbytes = len(meta.saves) * self.block_nbytes
        with self._lock:
            if self._in_flight + nbytes > self.settings.max_save_bytes_in_flight:
                self.stats["dropped_saves"] += len(meta.saves)
                return
            self._in_flight += nbytes
        buffer = self._save_buffers.take(len(meta.saves))
        staging = buffer[: len(meta.saves)]
        self._gather([s.block_id for s in meta.saves], staging)  # copied now: vLLM may reuse its blocks later
        by_tenant: dict[tuple[str, str], list] = {}
        for s, row in zip(meta.saves, staging):
            by_tenant.setdefault((s.tenant, s.salt), []).append((s.key, s.parent, row))
        writes = [len(by_tenant)]  # the buffer goes back once every write from it has ended
        for (tenant, salt), items in by_tenant.items():
            future = self.link.write(node, items, tenant, self._sealer(salt), self.settings.save_timeout_s)
            saved = functools.partial(
                self._saved, nbytes=len(items) * self.block_nbytes, count=len(items), buffer=buffer, writes=writes
            )
            future.add_done_callback(saved)

    def _saved(self, future, nbytes: int, count: int, buffer: torch.Tensor, writes: list[int]) -> None:
        """On the link's thread, when a background save ends."""
        with self._lock:
            self._in_flight -= nbytes
            writes[0] -= 1
            last = writes[0] == 0
        if last:
            self._save_buffers.give(buffer)
        try:
            results = future.result()
        except Exception as exc:  # noqa: BLE001 - the write's own failure, counted
            log.warning("TiercakeConnector: saving %d blocks failed: %s", count, exc)
            self.stats["failed_saves"] += count
            return
        ok = sum(1 for r in results if r.ok or r.exists)
        self.stats["saved_blocks"] += ok
        if ok < count:
            self.stats["failed_saves"] += count - ok
            first = next(r.error for r in results if not (r.ok or r.exists))
            log.warning("TiercakeConnector: %d of %d blocks not saved: %s", count - ok, count, first)

    def build_connector_worker_meta(self) -> TiercakeWorkerMetadata | None:
        self._finish_loads()
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return TiercakeWorkerMetadata(reports)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        self._helper.shutdown(wait=True)
