"""The worker side of ``TiercakeConnector`` (in vLLM's model runner): when the forward pass starts, a
loader thread reads the blocks the scheduler side planned from the holding node (the shared pool in
place on the same host, TCP across hosts) and scatters them into vLLM's paged KV one layer at a time;
each layer's attention waits only for its own layer. A block that cannot be read, or whose seal does
not verify under the request's salt, is reported and vLLM recomputes from it. After the pass, newly
full blocks are gathered from every layer into one tiercake block, sealed, and written to the node
agent in the background, within a bounded budget of bytes in flight (past it, saves are dropped and
counted: a missed save is a future miss, never a stall)."""

from __future__ import annotations

import logging
import threading

import torch

from tiercake.blocks import SealKeys

from .link import TiercakeLink
from .loading import LayerwiseLoader, LoadReport
from .metadata import ConnectorSettings, RequestLoad, TiercakeMetadata, TiercakeWorkerMetadata

log = logging.getLogger(__name__)


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
        self._loader: LayerwiseLoader | None = None
        self._reports: dict[str, LoadReport] = {}
        self._in_flight = 0  # bytes of saves not yet acknowledged
        self._lock = threading.Lock()
        self.stats = {
            "loaded_blocks": 0,
            "failed_blocks": 0,
            "refused_blocks": 0,
            "saved_blocks": 0,
            "dropped_saves": 0,
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

    def _gather(self, block_ids: list[int], staging: torch.Tensor) -> None:
        """Rows of ``staging`` (one tiercake block each: every layer's part, in layer order) from vLLM's
        blocks ``block_ids`` of every layer: one indexed copy per layer (``LayerwiseLoader`` does the
        inverse, layer by layer)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        offset = 0
        for rows, n in zip(self._layers, self._layer_bytes):
            staging[:, offset : offset + n].copy_(rows.index_select(0, index))
            offset += n

    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, TiercakeMetadata) and meta.loads and self._loader is not None:
            self._finish_loads()  # vLLM finishes each step (wait_for_save); this only guards against it not
            self._loader.start(meta.loads)

    def _fetch(self, load: RequestLoad, rows: torch.Tensor) -> int:
        """Read one request's blocks into ``rows``; how many of them, from the first, are usable: a
        chain is usable only up to its first missing block, or its first whose seal does not verify
        (forged or corrupt). The rest is recomputed."""
        results = self.link.read(load.node, [b.key for b in load.blocks], list(rows), self.settings.load_timeout_s)
        loaded = next((i for i, r in enumerate(results) if not r.ok), len(results))
        sealer = self._seal_keys.for_salt(load.salt)
        verified = next(
            (i for i in range(loaded) if not sealer.verify(load.blocks[i].key, rows[i].numpy(), results[i].seal)),
            loaded,
        )
        if verified < loaded:
            self.stats["refused_blocks"] += loaded - verified
            log.warning(
                "TiercakeConnector: request %s: block %d from %s failed its seal (forged or corrupt); vLLM "
                "recomputes from it",
                load.request_id,
                verified,
                load.node,
            )
        elif loaded < len(results):
            error = next((r.error for r in results if not r.ok), None)
            log.warning(
                "TiercakeConnector: request %s: %d of %d blocks from %s not loaded (%s); vLLM recomputes them",
                load.request_id,
                len(results) - loaded,
                len(results),
                load.node,
                error,
            )
        return verified

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self._loader is not None and layer is not None:
            self._loader.wait(layer)

    def _finish_loads(self) -> None:
        """The step's loads, done: their failed blocks and reports handed on."""
        if self._loader is None:
            return
        errors, reports = self._loader.finish()
        self._load_errors.update(errors)
        self._reports.update(reports)
        for report in reports.values():
            self.stats["loaded_blocks"] += report.loaded
            self.stats["failed_blocks"] += report.failed

    def wait_for_save(self, meta: object) -> None:
        self._finish_loads()
        if not isinstance(meta, TiercakeMetadata) or not meta.saves or not self._layers:
            return
        nbytes = len(meta.saves) * self.block_nbytes
        with self._lock:
            if self._in_flight + nbytes > self.settings.max_save_bytes_in_flight:
                self.stats["dropped_saves"] += len(meta.saves)
                return
            self._in_flight += nbytes
        with torch.inference_mode(False):  # the link's thread reads it after this step
            staging = torch.empty((len(meta.saves), self.block_nbytes), dtype=torch.uint8)
        self._gather([s.block_id for s in meta.saves], staging)  # copied now: vLLM may reuse its blocks later
        by_tenant: dict[tuple[str, str], list] = {}
        for s, row in zip(meta.saves, staging):
            by_tenant.setdefault((s.tenant, s.salt), []).append((s.key, s.parent, row))
        for (tenant, salt), items in by_tenant.items():
            future = self.link.write(
                self.settings.node, items, tenant, self._seal_keys.for_salt(salt), self.settings.save_timeout_s
            )
            count = len(items)
            future.add_done_callback(lambda f, n=count: self._saved(f, n * self.block_nbytes, n))

    def _saved(self, future, nbytes: int, count: int) -> None:
        """On the link's thread, when a background save ends."""
        with self._lock:
            self._in_flight -= nbytes
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
