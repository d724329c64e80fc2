"""The scheduler side of ``TiercakeConnector`` (in vLLM's engine core): for a new request, the
prompt's blocks beyond vLLM's own prefix cache are keyed with tiercake's one hashing function; this
node's pool index (read in place) answers when it holds them all, else the conductor's index is asked
without blocking vLLM's scheduler and names the live node with the longest run; vLLM is told it may
allocate for those tokens. Every step it hands the worker side what to load (node, key, vLLM block)
and which newly full blocks to save (key, parent, vLLM block)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tiercake.blocks import Namespace, chain_key
from tiercake.messages import SessionDirective
from tiercake.transfer.protocol import SessionNotice

from ..sessions import ended_notice, started_notice
from .link import TiercakeLink
from .loading import LoadReport
from .metadata import BlockLoad, BlockSave, ConnectorSettings, RequestLoad, TiercakeMetadata, TiercakeWorkerMetadata

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    request: Request
    tenant: str  # the index tenant its blocks are looked up and saved under
    salt: str  # the hashing salt of its keys
    keys: list[bytes] = field(default_factory=list)  # of its full blocks so far
    blocks: list[int] = field(default_factory=list)  # vLLM's block ids, in position order
    next_save: int = 0  # first block index not yet handed out to save
    external_tokens: int = 0  # vLLM was told it could load these
    load_first: int = 0  # the block index its load starts at
    load: LoadReport | None = None  # what the worker side did
    lookup_s: float = 0.0  # from the first question to the answer (the conductor's, if it was asked)
    lookup_cpu_s: float = 0.0  # of which vLLM's scheduler thread spent in this connector's lookups
    lookup_local: bool = False  # answered by the local pool's index alone
    session: SessionDirective | None = None  # the conversation it belongs to (the front's, in its params)


@dataclass(slots=True)
class _Plan:
    node: str
    first: int  # first block index to load
    count: int


class ConnectorScheduler:
    """The scheduler side's state: the requests it tracks, the loads it planned, the loads it owes the
    worker side."""

    def __init__(
        self,
        settings: ConnectorSettings,
        link: TiercakeLink,
        namespace: Namespace,
        block_size: int,
        space: dict[str, Any],
        loads_enabled: bool,
        saves_enabled: bool,
    ) -> None:
        self.settings, self.link, self.namespace, self.block_size = settings, link, namespace, block_size
        self.space, self.loads_enabled, self.saves_enabled = space, loads_enabled, saves_enabled
        self._tracked: dict[str, _Tracked] = {}
        self._plans: dict[str, _Plan] = {}
        self._pending_loads: list[RequestLoad] = []
        self._asked: dict[str, tuple[float, concurrent.futures.Future]] = {}  # the conductor's answers to come

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
            tracked.session = self._session(request)
            self._tell(tracked, started_notice, list(request.prompt_token_ids or []))
        return tracked

    @staticmethod
    def _session(request: Request) -> SessionDirective | None:
        """The session the front named in the request's ``kv_transfer_params`` (None: none, or not
        one: logged)."""
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get("tiercake") if isinstance(params, dict) else None
        session = ours.get("session") if isinstance(ours, dict) else None
        if session is None:
            return None
        try:
            return SessionDirective.model_validate(session)
        except ValidationError as exc:
            log.warning("TiercakeConnector: request %s names a bad session: %s", request.request_id, exc)
            return None

    def _tell(
        self, tracked: _Tracked, notice: Callable[[SessionDirective, str], SessionNotice], tokens: list[int]
    ) -> None:
        """The node's tiers told of the request's session (its blocks: the full ones of ``tokens``)."""
        node = self.settings.node
        if tracked.session is None or node is None:
            return
        made = notice(tracked.session, tracked.tenant)
        keys = self._keys(tracked, tokens, len(tokens) // self.block_size) if made.state != "closed" else []
        self.link.tell_session(node, made, list(keys))

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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        tokens = list(request.prompt_token_ids or [])
        usable = (len(tokens) - 1) // bs  # vLLM computes at least the last prompt token
        first = num_computed_tokens // bs
        tracked = self._track(request)
        tracked.next_save = first  # vLLM's own cache had these: saved when they were computed
        self._plans.pop(request.request_id, None)
        if not self.loads_enabled or usable <= first:
            self._asked.pop(request.request_id, None)
            return 0, False
        keys = self._keys(tracked, tokens, usable)  # (needed for the saves too: not counted as the lookup's)
        started = time.perf_counter()
        found = self._find(tracked, request.request_id, keys)
        tracked.lookup_cpu_s += time.perf_counter() - started
        if tracked.lookup_local:
            tracked.lookup_s = tracked.lookup_cpu_s  # answered here, in this call
        if found is None:
            return None, False  # the conductor answers on the link's thread: vLLM asks again next step
        node, length = found
        if node is None or length <= first:
            return 0, False
        self._plans[request.request_id] = _Plan(node, first, length - first)
        return (length - first) * bs, False

    def _find(self, tracked: _Tracked, request_id: str, keys: list[bytes]) -> tuple[str | None, int] | None:
        """Where the longest run of ``keys`` is: this node's pool, when its index (read in place, in
        microseconds) holds at least ``local_prefix_stands`` of them (or all); else whichever live node
        the conductor names (asked without waiting: None until it answers, at most
        ``lookup_timeout_s``; then nothing is loaded)."""
        node = self.settings.node
        local = self.link.local_prefix(tracked.tenant, keys) if node is not None else 0
        if local >= min(len(keys), self.settings.local_prefix_stands):
            tracked.lookup_local = True
            return node, local
        asked = self._asked.get(request_id)
        if asked is None:
            asked = self._asked[request_id] = (time.monotonic(), self.link.longest_prefix_soon(tracked.tenant, keys))
        since, future = asked
        waited = time.monotonic() - since
        if not future.done():
            if waited < self.settings.lookup_timeout_s:
                return None
            future.cancel()
            log.warning("TiercakeConnector: lookup took over %s s, computing instead", self.settings.lookup_timeout_s)
        del self._asked[request_id]
        tracked.lookup_s = waited
        remote, length = (None, 0) if future.cancelled() else future.result()
        return (node, local) if local > length else (remote, length)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._track(request)
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        ids = blocks.get_block_ids()[0]
        count = min(plan.count, num_external_tokens // self.block_size)
        keys = tracked.keys[plan.first : plan.first + count]
        pool, entries = self.link.pool_entries(tracked.tenant, keys) if plan.node == self.settings.node else ("", [])
        entries += [-1] * (count - len(entries))
        self._pending_loads.append(
            RequestLoad(
                request.request_id,
                plan.node,
                [BlockLoad(keys[i], ids[plan.first + i], entries[i]) for i in range(count)],
                tracked.salt,
                pool,
            )
        )
        tracked.next_save = plan.first + count
        tracked.load_first = plan.first
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
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
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
                tracked = self._tracked.get(req_id)
                if tracked is None:
                    continue
                tracked.load = report
                if report.failed:  # vLLM recomputes from the first block not loaded: save it once it has
                    tracked.next_save = min(tracked.next_save, tracked.load_first + report.loaded)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:  # what its next turn reads: prompt and answer
            self._tell(tracked, ended_notice, list(getattr(request, "all_token_ids", request.prompt_token_ids or [])))
        self._plans.pop(request.request_id, None)
        asked = self._asked.pop(request.request_id, None)
        if asked is not None:
            asked[1].cancel()
        if tracked is None:
            return False, None
        figures: dict[str, Any] = {
            "planned_load_tokens": tracked.external_tokens,
            "lookup_s": tracked.lookup_s,
            "lookup_cpu_s": tracked.lookup_cpu_s,
            "lookup_local": tracked.lookup_local,
            "local_index": self.link.pool_index_state,
            **self.space,
        }
        report = tracked.load
        if report is None and not tracked.external_tokens:
            report = LoadReport(0, 0, 0, 0.0)
        if report is not None:  # the worker's report comes a step late: unknown for a one-step request
            figures.update(
                loaded_tokens=report.loaded * self.block_size,
                load_bytes=report.nbytes,
                load_s=report.seconds,
                load_wait_s=report.waited,
                load_unleased_tokens=report.unleased * self.block_size,  # read by index entries, no lease
            )
        # in the request's output: what vLLM was told it could load, what it did (the rest it
        # recomputed), and how long loading took
        return False, {"tiercake": figures}
