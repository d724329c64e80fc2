"""``TiercakeConnector``: vLLM's KV connector onto tiercake's tiers.

Load it into vLLM with::

    --kv-transfer-config '{"kv_connector": "TiercakeConnector",
        "kv_connector_module_path": "tiercake.workers.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"conductor": "http://127.0.0.1:8700", "node": "node-a"}}'

and the cluster secret in ``$TIERCAKE_SECRET`` (the control token, if any, in ``$TIERCAKE_TOKEN``).
A request's blocks are indexed under the tenant its ``kv_transfer_params`` name
(``{"tiercake": {"tenant": ...}}``, as tiercake's front sends them), else the instance's ``tenant``.

The connector is thin, as vLLM's own ``OffloadingConnector`` is: it builds what both sides share and
hands each call to its side (``scheduler_side.ConnectorScheduler``, ``worker_side.ConnectorWorker``;
what passes between them is in ``metadata.py``).

Scheduler side (vLLM's engine core): for a new request, the prompt's blocks beyond vLLM's own prefix
cache are keyed with tiercake's one hashing function (``tiercake.blocks``: the namespace is the
model, vLLM's KV layout and block size, and the request's ``cache_salt``). Where they are is answered
without a round trip when this node's pool holds them all (its index, read in place from the shared
pool every ``index_refresh_s``); otherwise the conductor's index is asked on the link's thread while
vLLM goes on scheduling (the request waits a step or two, never the scheduler), and names the live
node with the longest run. vLLM is told it may allocate for those tokens. Every step it hands the
worker side what to load (node, key, vLLM block) and which newly full blocks to save (key, parent,
vLLM block).

Worker side (vLLM's model runner): when the forward pass starts, a loader thread leases the step's
blocks in the holding node's shared pool in one round trip (same host; across hosts, and for blocks
only on its disk, they are read into a reused host buffer), checks their seals over the mapped bytes,
and copies each layer's part of every block straight into vLLM's paged KV with one indexed copy per
layer; each layer's attention waits only for its own layer (``wait_for_layer_load``).
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
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from tiercake.blocks import Namespace, SealKeys
from tiercake.config import TransferConfig

from .link import TiercakeLink
from .metadata import (
    ConnectorSettings,
    block_bytes,
    kv_layout_tag,
)
from .scheduler_side import ConnectorScheduler
from .worker_side import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _settings(transfer: Any) -> ConnectorSettings:
    """``kv_connector_extra_config`` checked, and a warning where vLLM would fail a request that a
    block tiercake cannot load would otherwise only slow down."""
    try:
        settings = ConnectorSettings.model_validate(transfer.kv_connector_extra_config or {})
    except ValidationError as exc:
        raise ValueError(f"TiercakeConnector: bad kv_connector_extra_config: {exc}") from None
    if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
        log.warning(
            "TiercakeConnector: kv_load_failure_policy is %r; with 'recompute' a block tiercake "
            "cannot load costs time instead of failing the request",
            transfer.kv_load_failure_policy,
        )
    return settings


def _space(namespace: Namespace, settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any) -> dict:
    """In every request's figures: how this instance keys and sizes its blocks, and where it saves them
    (a front routing to it keys prompts the same way; a prefill's decode finds them there), and where
    it publishes its prefix cache's changes (the worker beside it follows them)."""
    space: dict[str, Any] = {
        "namespace": namespace.model_dump(exclude={"tenant_salt"}),
        "block_bytes": block_bytes(kv_cache_config),
        "node": settings.node,
    }
    events = vllm_config.kv_events_config
    if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
        space["kv_events"] = {
            "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint,
            "topic": events.topic,
        }
    return space


def _seal_keys(settings: ConnectorSettings) -> SealKeys:
    return SealKeys(
        TransferConfig(secret_env=settings.secret_env, seal_secret_env=settings.seal_secret_env).seal_material()
    )


class TiercakeConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = _settings(transfer)
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
        self.space = _space(self.namespace, self.settings, vllm_config, kv_cache_config)
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
        self._seal_keys = None if secret is None else _seal_keys(self.settings)
        self.scheduler = ConnectorScheduler(
            self.settings,
            self.link,
            self.namespace,
            self.block_size,
            self.space,
            self.loads_enabled,
            self.saves_enabled,
        )
        self.worker = ConnectorWorker(self.settings, self.link, self._seal_keys, self.layer_names, self.num_blocks)
        if role == KVConnectorRole.SCHEDULER and self.loads_enabled and self.settings.node is not None:
            self.link.watch_pool(self.settings.node, self.settings.index_refresh_s)  # lookups without a round trip

    # ==== scheduler side: ConnectorScheduler ======================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ==== worker side: ConnectorWorker ============================================================

    @property
    def stats(self) -> dict[str, int]:
        return self.worker.stats

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are gathered from every layer at once, after the pass (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        self.worker.close()
        if self.role == KVConnectorRole.WORKER:
            log.info("TiercakeConnector: %s", ", ".join(f"{k} {v}" for k, v in self.stats.items()))
        self.link.close()
