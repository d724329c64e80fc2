"""``TiercakeConnector``: vLLM's KV connector onto tiercake's tiers.

Load it into vLLM with::

    --kv-transfer-config '{"kv_connector": "TiercakeConnector",
        "kv_connector_module_path": "tiercake.workers.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"conductor": "http://127.0.0.1:8700", "node": "node-a"}}'

and the cluster secret in ``$TIERCAKE_SECRET`` (the control token, if any, in ``$TIERCAKE_TOKEN``).
A request's blocks are indexed under the tenant its ``kv_transfer_params`` name
(``{"tiercake": {"tenant": ...}}``, as tiercake's front sends them), else the instance's ``tenant``.

Scheduler side (vLLM's engine core): for a new request, the prompt's blocks beyond vLLM's own prefix
cache are keyed with tiercake's one hashing function (``tiercake.blocks``: the namespace is the
model, vLLM's KV layout and block size, and the request's ``cache_salt``), the conductor's index says
which live node holds the longest run of them, and vLLM is told it may allocate for those tokens.
Every step it hands the worker side what to load (node, key, vLLM block) and which newly full blocks
to save (key, parent, vLLM block).

Worker side (vLLM's model runner): when the forward pass starts, a loader thread reads the blocks from
the holding node (the shared pool in place on the same host, TCP across hosts) and scatters them into
vLLM's paged KV one layer at a time; each layer's attention waits only for its own layer
(``wait_for_layer_load``), so the first layers compute while the later ones are filled.
A block that cannot be read, or whose seal does not verify under the request's salt
(forged or corrupt, ``tiercake.blocks.Sealer``), is reported (``get_block_ids_with_load_errors``)
and vLLM recomputes from it, so a dead node or a forged block costs time, never a wrong token. After
the pass, newly full blocks are gathered from every layer into one tiercake block, sealed, and
written to the node agent in the background, within a bounded budget of bytes in flight (past it, saves are
dropped and counted: a missed save is a future miss, never a stall).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from tiercake.blocks import Namespace, SealKeys, chain_key
from tiercake.config import TransferConfig

from .link import TiercakeLink
from .loading import LayerwiseLoader, LoadReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``: where tiercake is and how this instance uses it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    conductor: str | list[str] = Field(description="control API URL(s) of the conductor")
    node: str | None = Field(
        default=None, description="node agent that new blocks are saved to (None: this instance only loads)"
    )
    model_id: str | None = Field(
        default=None, description="the model's name in block keys (default: vLLM's served model name)"
    )
    tenant: str = Field(default="default", description="the index namespace of this instance's blocks")
    secret_env: str = "TIERCAKE_SECRET"
    seal_secret_env: str = "TIERCAKE_SEAL_SECRET"  # blocks are sealed with it and checked by it (else: derived
    # from the cluster secret); see TransferConfig
    token_env: str = "TIERCAKE_TOKEN"  # the conductor's bearer token, as every tiercake client reads it
    transports: list[str] = ["shm", "tcp"]
    ca_file: str | None = None  # the cluster's TLS CA: https conductors, and node agents with transfer_tls
    transfer_tls: bool = False  # the node agents' transfer ports speak TLS (their transfer.tls)
    lookup_timeout_s: float = Field(default=1.0, gt=0)
    load_timeout_s: float = Field(default=10.0, gt=0)
    save_timeout_s: float = Field(default=30.0, gt=0)
    max_save_bytes_in_flight: int = Field(default=256 << 20, gt=0)

    @property
    def conductors(self) -> list[str]:
        return [self.conductor] if isinstance(self.conductor, str) else list(self.conductor)


# What the scheduler side hands the worker side each step ---------------------------------------


@dataclass(frozen=True, slots=True)
class BlockLoad:
    key: bytes
    block_id: int  # vLLM's block to fill


@dataclass(frozen=True, slots=True)
class RequestLoad:
    request_id: str
    node: str
    blocks: list[BlockLoad]
    salt: str  # its keys' hashing salt: the seals are checked under it


@dataclass(frozen=True, slots=True)
class BlockSave:
    key: bytes
    parent: bytes | None
    block_id: int  # vLLM's block to copy out
    tenant: str  # the index tenant the block is saved under
    salt: str  # the hashing salt of its key: it is sealed under it


@dataclass
class TiercakeMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class TiercakeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker side -> scheduler side, once per step: the loads it ran."""

    loads: dict[str, LoadReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TiercakeWorkerMetadata):
            self.loads.update(other.loads)
        return self


# Scheduler-side state of one request ------------------------------------------------------------


@dataclass(slots=True)
class _Tracked:
    request: Request
    tenant: str  # the index tenant its blocks are looked up and saved under
    salt: str  # the hashing salt of its keys
    keys: list[bytes] = field(default_factory=list)  # of its full blocks so far
    blocks: list[int] = field(default_factory=list)  # vLLM's block ids, in position order
    next_save: int = 0  # first block index not yet handed out to save
    external_tokens: int = 0  # vLLM was told it could load these
    load: LoadReport | None = None  # what the worker side did


@dataclass(slots=True)
class _Plan:
    node: str
    first: int  # first block index to load
    count: int


def kv_layout_tag(kv_cache_config: KVCacheConfig) -> str:
    """vLLM's KV layout as a namespace field: two instances share keys only when their paged KV is
    byte-for-byte the same kind (layers, heads, head size, dtype, cache layout)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"TiercakeConnector supports models with one KV cache group, this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    return (
        f"vllm:{type(spec).__name__}:L{len(groups[0].layer_names)}:H{spec.num_kv_heads}:D{spec.head_size}:"
        f"{dtype}:{getattr(kv_cache_config, 'kv_cache_layout', '')}"
    )


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one tiercake block: one vLLM block of every layer."""
    groups = kv_cache_config.kv_cache_groups
    return groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names) if groups else 0


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


class TiercakeConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        try:
            self.settings = ConnectorSettings.model_validate(transfer.kv_connector_extra_config or {})
        except ValidationError as exc:
            raise ValueError(f"TiercakeConnector: bad kv_connector_extra_config: {exc}") from None
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "TiercakeConnector: kv_load_failure_policy is %r; with 'recompute' a block tiercake "
                "cannot load costs time instead of failing the request",
                transfer.kv_load_failure_policy,
            )
        self.block_size = vllm_config.cache_config.block_size
        self.layer_names = (
            list(kv_cache_config.kv_cache_groups[0].layer_names) if kv_cache_config.kv_cache_groups else []
        )
        self.num_blocks = kv_cache_config.num_blocks
        model_id = self.settings.model_id or vllm_config.model_config.served_model_name
        if isinstance(model_id, list):
            model_id = model_id[0]
        self.namespace = Namespace(
            model_id=str(model_id), kv_layout=kv_layout_tag(kv_cache_config), block_size=self.block_size
        )
        # in every request's figures: how this instance keys and sizes its blocks, and where it saves
        # them (a front routing to it keys prompts the same way; a prefill's decode finds them there)
        self.space = {
            "namespace": self.namespace.model_dump(exclude={"tenant_salt"}),
            "block_bytes": block_bytes(kv_cache_config),
            "node": self.settings.node,
        }
        events = vllm_config.kv_events_config
        if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
            # where this instance publishes its prefix cache's changes: the worker beside it follows them
            self.space["kv_events"] = {
                "endpoint": events.endpoint,
                "replay_endpoint": events.replay_endpoint,
                "topic": events.topic,
            }
        secret = os.environ.get(self.settings.secret_env, "").encode() or None
        if secret is None:
            log.warning(
                "TiercakeConnector: no cluster secret in $%s: nothing is loaded or saved", self.settings.secret_env
            )
        self.loads_enabled = secret is not None and transfer.kv_role in ("kv_both", "kv_consumer")
        self.saves_enabled = (
            secret is not None and transfer.kv_role in ("kv_both", "kv_producer") and self.settings.node is not None
        )
        # the variable may hold several whitespace-separated tokens (as the Secret's control-tokens do)
        token = next(iter(os.environ.get(self.settings.token_env, "").split()), None)
        identity = f"vllm-{os.getpid()}-{role.name.lower()}"
        self.link = TiercakeLink(
            self.settings.conductors,
            token,
            secret,
            identity,
            tuple(self.settings.transports),
            ca_file=self.settings.ca_file,
            transfer_tls=self.settings.transfer_tls,
        )
        self._seal_keys = (
            None
            if secret is None
            else SealKeys(
                TransferConfig(
                    secret_env=self.settings.secret_env, seal_secret_env=self.settings.seal_secret_env
                ).seal_material()
            )
        )
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._plans: dict[str, _Plan] = {}
        self._pending_loads: list[RequestLoad] = []
        # worker side
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

    # ==== scheduler side ==========================================================================

    def _keys(self, tracked: _Tracked, tokens: list[int], blocks: int) -> list[bytes]:
        """Keys of the first ``blocks`` full blocks of ``tokens`` (extending the request's chain)."""
        keys, bs = tracked.keys, self.block_size
        if len(keys) < blocks:
            parent = keys[-1] if keys else self.namespace.model_copy(update={"tenant_salt": tracked.salt}).root()
            for i in range(len(keys), blocks):
                parent = chain_key(parent, tokens[i * bs : (i + 1) * bs])
                keys.append(parent)
        return keys[:blocks]

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = self._tracked[request.request_id] = _Tracked(request, *self._tenant(request))
        return tracked

    def _tenant(self, request: Request) -> tuple[str, str]:
        """The index tenant and the hashing salt. tiercake's front names both in the request's
        ``kv_transfer_params`` (``{"tiercake": {"tenant": ..., "salt": ...}}``; vLLM's port is for the
        front, not for clients); else the instance's ``tenant`` and the request's ``cache_salt``."""
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get("tiercake") if isinstance(params, dict) else None
        ours = ours if isinstance(ours, dict) else {}
        tenant, salt = ours.get("tenant", self.settings.tenant), ours.get("salt")
        if not isinstance(tenant, str) or not tenant or "/" in tenant:
            log.warning(
                "TiercakeConnector: request %s names tenant %r (not a tenant name); using %r",
                request.request_id,
                tenant,
                self.settings.tenant,
            )
            tenant = self.settings.tenant
        if not isinstance(salt, str):
            salt = getattr(request, "cache_salt", None) or ""
        return tenant, salt

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        tokens = list(request.prompt_token_ids or [])
        usable = (len(tokens) - 1) // bs  # vLLM computes at least the last prompt token
        first = num_computed_tokens // bs
        tracked = self._track(request)
        tracked.next_save = first  # vLLM's own cache had these: saved when they were computed
        self._plans.pop(request.request_id, None)
        if not self.loads_enabled or usable <= first:
            return 0, False
        keys = self._keys(tracked, tokens, usable)
        node, length = self.link.longest_prefix(tracked.tenant, keys, self.settings.lookup_timeout_s)
        if node is None or length <= first:
            return 0, False
        self._plans[request.request_id] = _Plan(node, first, length - first)
        return (length - first) * bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._track(request)
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        ids = blocks.get_block_ids()[0]
        count = min(plan.count, num_external_tokens // self.block_size)
        keys = tracked.keys
        self._pending_loads.append(
            RequestLoad(
                request.request_id,
                plan.node,
                [BlockLoad(keys[i], ids[i]) for i in range(plan.first, plan.first + count)],
                tracked.salt,
            )
        )
        tracked.next_save = plan.first + count
        tracked.external_tokens = count * self.block_size

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TiercakeMetadata(loads=self._pending_loads)
        self._pending_loads = []
        done: dict[str, int] = {}  # request -> tokens whose KV exists after this step
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.blocks = list(new.block_ids[0])
                done[new.req_id] = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                tracked.blocks = list(new_ids[0]) if req_id in resumed else tracked.blocks + list(new_ids[0])
            done[req_id] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if self.saves_enabled:
            for req_id, tokens_done in done.items():
                meta.saves.extend(self._saves(self._tracked[req_id], tokens_done))
        return meta

    def _saves(self, tracked: _Tracked, tokens_done: int) -> list[BlockSave]:
        all_tokens = tracked.request.all_token_ids
        full = min(tokens_done, len(all_tokens), len(tracked.blocks) * self.block_size) // self.block_size
        if full <= tracked.next_save:  # most steps of a decode: nothing new is full
            return []
        keys = self._keys(tracked, list(all_tokens[: full * self.block_size]), full)
        saves = [
            BlockSave(keys[i], keys[i - 1] if i else None, tracked.blocks[i], tracked.tenant, tracked.salt)
            for i in range(tracked.next_save, full)
        ]
        tracked.next_save = full
        return saves

    def update_connector_output(self, connector_output: Any) -> None:
        """What the worker side's loads of a step did, for the requests' reports."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TiercakeWorkerMetadata):
            for req_id, report in meta.loads.items():
                if req_id in self._tracked:
                    self._tracked[req_id].load = report

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        if tracked is None:
            return False, None
        figures: dict[str, Any] = {"planned_load_tokens": tracked.external_tokens, **self.space}
        report = tracked.load
        if report is None and not tracked.external_tokens:
            report = LoadReport(0, 0, 0, 0.0)
        if report is not None:  # the worker's report comes a step late: unknown for a one-step request
            figures.update(
                loaded_tokens=report.loaded * self.block_size,
                load_bytes=report.nbytes,
                load_s=report.seconds,
                load_wait_s=report.waited,
            )
        # in the request's output: what vLLM was told it could load, what it did (the rest it
        # recomputed), and how long loading took
        return False, {"tiercake": figures}

    # ==== worker side =============================================================================

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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are gathered from every layer at once, after the pass (wait_for_save)

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
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

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._finish_loads()
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return TiercakeWorkerMetadata(reports)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self.role == KVConnectorRole.WORKER:
            log.info("TiercakeConnector: %s", ", ".join(f"{k} {v}" for k, v in self.stats.items()))
        self.link.close()
