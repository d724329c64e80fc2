"""A worker's inference engine: the reference model over paged KV in its gpu tier, with the prompt's
cached prefix reused from wherever it is held.

Prefill walks the prompt's block chain: the blocks its own gpu tier holds are used in place; the
conductor is asked who holds more of the chain, and the missing blocks are pulled from that node
(its pool in place over shared memory, a remote pool over TCP, its SSD tier) straight into gpu
blocks; only the rest of the prompt is computed. New full blocks join the gpu tier without a copy
and are written through to the node agent, which reports them to the conductor. Decode runs one
token for every running sequence at once.

Every block written through carries a seal (a MAC of its key and bytes under the tenant's seal key,
``tiercake.blocks``); every pulled block's seal is checked before it is used, and a block whose seal
does not verify (written by someone without the seal secret, or corrupted on a node) is dropped and
recomputed: it costs time, never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from itertools import groupby

import torch

from tiercake.blocks import BlockKey, Namespace, Sealer, SealKeys, block_keys, chain_key, cluster_seal_material
from tiercake.conductor.client import Client, ConductorError
from tiercake.messages import KVHandoff, PrefillStats, PrefixHolding
from tiercake.started import started
from tiercake.tiers import BlockTable, SequenceKV, StoreError, TieredStore
from tiercake.tiers.buffers import host_bytes
from tiercake.transfer import BlockLoc, BufferLoc, SealError, Transfer, TransferEngine

from ..contract import RequestRejected
from .model import PagedChunk, ReferenceModel
from .node_link import NodeLink

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # requests that name no tenant
MEMORY_TIERS = frozenset({"gpu", "pool"})  # tiers a read finds in memory: nothing there to stage
STAGE_TIER = "pool"  # where a node stages disk blocks (its memory tier above the disk)


@dataclass(frozen=True, slots=True)
class Prefetched:
    """What a waiting request's prefetch did (``ModelRunner.prefetch``)."""

    staged: frozenset[bytes] = frozenset()  # keys the source node brought from disk into its memory
    pulled: tuple[tuple[bytes, str], ...] = ()  # keys pulled into the gpu tier ahead, with "<node>:<tier>"


class ContextLimitError(RequestRejected):
    """The prompt plus the tokens asked for do not fit the worker's context."""


@dataclass(slots=True)
class Sequence:
    tenant: str
    salt: str  # the hashing salt its keys were made with
    tokens: list[int]  # prompt and generated so far
    table: BlockTable  # its blocks in the gpu tier
    keys: list[BlockKey]  # keys of its full blocks so far
    logits: torch.Tensor  # of the last position
    stats: PrefillStats
    stored: int = 0  # full blocks already in the store (reused or adopted)


class ModelRunner:
    def __init__(
        self,
        model: ReferenceModel,
        store: TieredStore,
        namespace: Namespace,
        *,
        worker_id: str,
        transfer: TransferEngine | None = None,
        conductor: Client | None = None,
        node: str | None = None,
        max_context: int = 4096,
        prefill_chunk: int = 0,
        seals: bytes | None = None,
    ) -> None:
        """``seals``: the seal material (``TransferConfig.seal_material``); default: derived from the
        transfer engine's cluster secret."""
        self.model = model
        self.store = store
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.kv = SequenceKV(store, namespace.block_size)  # the gpu tier's blocks, per sequence
        self.worker_id = worker_id
        self.transfer = transfer
        self.conductor = conductor
        self.node = node  # the node agent new blocks are written through to
        self.max_context = max_context
        # tokens per forward pass of a prefill (0: the whole prompt at once); between two chunks the
        # compute lock lets a decode step of the running batch through
        self.prefill_chunk = prefill_chunk
        self.block_nbytes = self.kv.block_nbytes
        self._writes: set[asyncio.Task] = set()
        self._compute = asyncio.Lock()  # one forward pass at a time over the pool
        self.link = NodeLink(worker_id, transfer, conductor)
        self.staged_blocks = 0  # blocks nodes brought into memory for this worker's waiting requests
        self.prefetched_blocks = 0  # blocks pulled into the gpu tier while their request waited
        if seals is None and transfer is not None:
            seals = cluster_seal_material(transfer.secret)
        self._seal_keys = None if seals is None else SealKeys(seals)
        self.refused_blocks = 0  # pulled blocks whose seal did not verify

    def sealer(self, salt: str) -> Sealer:
        """The sealer of blocks hashed with ``salt`` (a tenant's)."""
        if self._seal_keys is None:
            raise RuntimeError("this engine has no seal material (no transfer engine and none given)")
        return self._seal_keys.for_salt(salt)

    def namespace_for(self, tenant_salt: str) -> Namespace:
        return self.namespace.model_copy(update={"tenant_salt": tenant_salt})

    # Prefill --------------------------------------------------------------------------------------

    async def prefill(
        self,
        tokens: list[int],
        tenant: str = DEFAULT_TENANT,
        salt: str | None = None,
        max_new_tokens: int = 0,
        pull: bool = True,
        source: KVHandoff | None = None,
        staged: frozenset[bytes] | set[bytes] = frozenset(),
        prefetched: Prefetched | None = None,
    ) -> Sequence:
        """Compute the prompt's KV, reusing every cached block of its prefix; returns the sequence
        with the logits of its last position. ``tenant`` names the index namespace, ``salt`` the
        hashing salt (default: the tenant, so tenants never share blocks). ``pull``: load what
        nodes hold beyond the own gpu tier's prefix (the router may say not to). ``source``:
        where to pull the prefix from without asking the index (the front routed with the index
        already; a decode worker taking over knows where the prefill worker wrote the blocks).
        ``staged``: keys ``stage`` had the source bring into memory (their loads count as its pool's).
        ``prefetched``: what ``prefetch`` did while the request waited (its blocks are credited to the
        node and tier they came from, not to the own gpu tier they now sit in)."""
        try:
            self.model.check_tokens(tokens)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        if len(tokens) + max_new_tokens > self.max_context:
            raise ContextLimitError(
                f"{len(tokens)} prompt tokens + {max_new_tokens} new tokens exceed the context of {self.max_context}"
            )
        stats = PrefillStats(prompt_tokens=len(tokens))
        keys = block_keys(self.namespace_for(tenant if salt is None else salt), tokens)
        reusable = keys[: (len(tokens) - 1) // self.block_size]  # at least one token is computed
        own = self.kv.cached_prefix(reusable)
        stats.sources = {"gpu": own} if own else {}
        if prefetched is not None:
            staged = staged or prefetched.staged
            self._credit_prefetched(stats, reusable[:own], prefetched)
        if pull and own < len(reusable) and self.conductor is not None and self.transfer is not None:
            await self._load(tenant, tenant if salt is None else salt, reusable, own, stats, source, staged)
        table = self.kv.open(reusable)
        cached = table.cached * self.block_size
        stats.cached_tokens = cached
        try:
            await self.kv.grow(table, len(tokens))
            step = self.prefill_chunk or len(tokens)
            for start in range(cached, len(tokens), step):
                async with self._compute:
                    started = time.perf_counter()  # computing only: not the decode steps between chunks
                    (logits,) = await asyncio.to_thread(
                        self.model.forward_paged,
                        [PagedChunk(tokens[start : start + step], start, list(table.blocks))],
                        self.kv.kv,
                    )
                    stats.compute_s += time.perf_counter() - started
        except BaseException:
            self.kv.close(table)
            raise
        seq = Sequence(
            tenant, tenant if salt is None else salt, list(tokens), table, keys, logits[-1], stats, stored=table.cached
        )
        self._store_full_blocks(seq, resend_cached=True)
        if self.node is not None and self.transfer is not None:
            stats.written_blocks = max(0, len(tokens) // self.block_size - table.cached)
        return seq

    async def _load(
        self,
        tenant: str,
        salt: str,
        keys: list[BlockKey],
        own: int,
        stats: PrefillStats,
        source: KVHandoff | None = None,
        staged: frozenset[bytes] | set[bytes] = frozenset(),
    ) -> None:
        """Pull ``keys[own:]`` (as far as one node holds the chain) into the gpu tier."""
        began = time.perf_counter()
        try:
            if source is not None:
                found = {
                    source.node: PrefixHolding(
                        length=min(source.blocks, len(keys)), tiers={source.tier: 1}, runs=source.runs
                    )
                }
            else:
                found = await started(self.conductor, "the worker's conductor client").lookup(tenant, keys)
        except ConductorError as exc:
            log.warning("worker %s: lookup failed (%s); computing instead", self.worker_id, exc)
            return
        finally:
            stats.lookup_s = time.perf_counter() - began
        found = {n: p for n, p in found.items() if await self.link.reachable(n)}
        if not found:
            return
        node, prefix = max(found.items(), key=lambda item: item[1].length)
        if prefix.length <= own:
            return
        began = time.perf_counter()
        await self.store.reclaim("gpu", (prefix.length - own) * self.block_nbytes)
        loaded, refused = await self._pull(node, tenant, salt, keys, own, prefix.length)
        stats.refused_blocks += refused
        if loaded:  # each block credited to the tier it came from (by the index's runs)
            if staged and prefix.runs:  # ... but what was staged came from memory
                tiers = [tier for tier, n in prefix.runs for _ in range(n)]
                for i in range(own, min(own + loaded, len(tiers))):
                    if keys[i] in staged:
                        tiers[i] = STAGE_TIER
                prefix = prefix.model_copy(update={"runs": [(t, len(list(g))) for t, g in groupby(tiers)]})
            served = prefix.served_from(own, loaded)
            for tier, count in served.items():
                stats.sources[f"{node}:{tier}"] = count
            stats.load_tier = max(served, key=lambda tier: served[tier])
            stats.load_bytes = loaded * self.block_nbytes
        stats.load_s = time.perf_counter() - began

    async def _pull(
        self, node: str, tenant: str, salt: str, keys: list[BlockKey], start: int, end: int
    ) -> tuple[int, int]:
        """Pull ``keys[start:end]`` of a chain from ``node`` into the gpu tier; returns how many of them,
        from ``start``, the tier now holds (a chain is usable up to its first missing block) and how many
        failed their seal. A pulled block is committed only if its seal verifies under the tenant's key:
        a forged or corrupt one never enters the gpu tier, and the chain is cut there."""
        batch = [
            Transfer(
                BlockLoc(node, key),
                BlockLoc(self.worker_id, key, keys[i - 1] if i else None, tenant),
                self.block_nbytes,
            )
            for i, key in enumerate(keys[start:end], start=start)
        ]
        results = await self.link.send(node, batch, verify=self.sealer(salt).verify)
        refused = sum(isinstance(r.error, SealError) for r in results)
        if refused:
            self.refused_blocks += refused
            log.warning(
                "worker %s: %d block(s) from %s failed their seal (forged or corrupt); recomputed",
                self.worker_id,
                refused,
                node,
            )
        loaded = 0
        for result in results:
            if not result.ok and not self.store.contains(keys[start + loaded]):
                log.info("worker %s: pull from %s stopped: %s", self.worker_id, node, result.error)
                break
            loaded += 1
        return loaded, refused

    def _credit_prefetched(self, stats: PrefillStats, held: list[BlockKey], prefetched: Prefetched) -> None:
        pulled = dict(prefetched.pulled)
        for key in held:
            origin = pulled.get(key)
            if origin is not None:
                stats.sources["gpu"] -= 1
                stats.sources[origin] = stats.sources.get(origin, 0) + 1
                stats.prefetched_blocks += 1
        if not stats.sources.get("gpu", 1):
            del stats.sources["gpu"]

    async def prefetch(self, tokens: list[int], tenant: str, salt: str | None, source: KVHandoff) -> Prefetched:
        """A request that waits for the worker: meanwhile, the source node brings the prefix blocks it
        holds only on disk into its memory (``stage``), then the worker pulls the prefix into its own gpu
        tier, as far as the tier has room below its high watermark (so the prefetch never evicts).
        Best effort: what it did not do, the prefill's own load does."""
        staged = await self.stage(tokens, tenant, salt, source)
        salt = tenant if salt is None else salt
        keys = block_keys(self.namespace_for(salt), tokens)[: min(source.blocks, (len(tokens) - 1) // self.block_size)]
        own = self.kv.cached_prefix(keys)
        gpu = self.store.tier("gpu")
        room = int(gpu.high_watermark * gpu.backend.capacity_bytes) - gpu.backend.used_bytes
        end = min(len(keys), own + max(0, room) // self.block_nbytes)
        if end <= own or self.transfer is None or not await self.link.reachable(source.node):
            return Prefetched(staged)
        try:
            loaded, _ = await self._pull(source.node, tenant, salt, keys, own, end)
        except Exception as exc:  # noqa: BLE001 - a prefetch never fails the request
            log.info("worker %s: prefetch from %s failed: %s", self.worker_id, source.node, exc)
            return Prefetched(staged)
        tiers = [tier for tier, n in source.runs for _ in range(n)]
        pulled = tuple(
            (key, f"{source.node}:{STAGE_TIER if key in staged else tiers[i] if i < len(tiers) else source.tier}")
            for i, key in enumerate(keys[own : own + loaded], start=own)
        )
        self.prefetched_blocks += len(pulled)
        return Prefetched(staged, pulled)

    async def stage(self, tokens: list[int], tenant: str, salt: str | None, source: KVHandoff) -> frozenset[bytes]:
        """A prefetch for a request that waits: ask ``source``'s node to bring the prefix blocks it
        holds only on disk (by the index's runs) into its memory; returns the keys now there. Best
        effort: a failure only means the load reads the disk, as without it."""
        if self.transfer is None or not source.runs:
            return frozenset()
        keys = block_keys(self.namespace_for(tenant if salt is None else salt), tokens)
        keys = keys[: min(source.blocks, (len(tokens) - 1) // self.block_size)]
        tiers = [tier for tier, n in source.runs for _ in range(n)]
        wanted: list[bytes] = [key for key, tier in zip(keys, tiers) if tier not in MEMORY_TIERS]
        if not wanted or not await self.link.reachable(source.node):
            return frozenset()
        try:
            results = await self.transfer.stage_blocks(source.node, wanted)
        except Exception as exc:  # noqa: BLE001 - a prefetch never fails the request
            log.info("worker %s: staging on %s failed: %s", self.worker_id, source.node, exc)
            return frozenset()
        self.staged_blocks += sum(r.ok for r in results)
        return frozenset(key for key, r in zip(wanted, results) if r.ok)

    def _store_full_blocks(self, seq: Sequence, resend_cached: bool = False) -> None:
        """Adopt the sequence's newly full blocks into the gpu tier and write them through. With
        ``resend_cached`` (a prefill), the prefix the gpu tier already held goes along in the same batch
        when there is anything new to send: a node that lost it (its agent restarted, it evicted it)
        gets the chain whole again, and one that holds it answers "exists" without the bytes."""
        full = len(seq.tokens) // self.block_size
        bs = self.block_size
        while len(seq.keys) < full:  # generated tokens fill blocks too: extend the chain by one key each
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else self.namespace_for(seq.salt).root()
            seq.keys.append(chain_key(parent, seq.tokens[i * bs : (i + 1) * bs]))
        new = []
        for i in range(seq.stored, full):
            if self.kv.adopt(seq.table, i, seq.keys[i], seq.keys[i - 1] if i else None, seq.tenant):
                new.append(i)
        if new and resend_cached:
            new = list(range(seq.stored)) + new
        seq.stored = full
        if new and self.node is not None and self.transfer is not None:
            leases = [self.store.acquire_lease(seq.keys[i], math.inf, tier="gpu") for i in new]  # held while sent
            task = asyncio.get_running_loop().create_task(self._write_through(self.node, seq, new, leases))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write_through(self, node: str, seq: Sequence, indices: list[int], leases: list) -> None:
        """Send the adopted blocks at ``indices`` to the node agent ``node``. The gpu tier's leases on them were
        taken when they were adopted (the sequence may end and the blocks be evicted meanwhile
        otherwise); they are released here whatever happens."""
        try:
            if not self.link.fence.open(node):
                return  # the node is fenced: the blocks stay in the gpu tier only
            if not await self.link.reachable(node, force=True):
                log.warning("worker %s: node %s is not a live member; blocks not written through", self.worker_id, node)
                return
            sealer = self.sealer(seq.salt)
            seals = await asyncio.to_thread(
                lambda: [sealer.seal(seq.keys[i], host_bytes(lease.data)) for i, lease in zip(indices, leases)]
            )
            batch = [
                Transfer(
                    BufferLoc(lease.data),
                    BlockLoc(node, seq.keys[i], seq.keys[i - 1] if i else None, seq.tenant, seal),
                    self.block_nbytes,
                )
                for i, lease, seal in zip(indices, leases, seals)
            ]
            for result in await self.link.send(node, batch):  # the gpu leases wait on it
                if not result.ok and not result.exists:
                    log.warning("worker %s: write-through to %s failed: %s", self.worker_id, node, result.error)
        except Exception:  # noqa: BLE001 - a task nobody awaits: say what went wrong
            log.exception("worker %s: write-through to %s failed", self.worker_id, node)
        finally:
            await self.store.release_leases([lease.id for lease in leases])

    async def flush(self) -> None:
        """Wait for write-throughs in flight."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def handoff(self, prompt_tokens: int) -> KVHandoff | None:
        """Where a prompt of ``prompt_tokens`` now has its full blocks, for a decode worker to pull
        them: this worker's node, once the write-throughs in flight are done (None: not written)."""
        blocks = prompt_tokens // self.block_size
        if self.node is None or self.transfer is None or not blocks or not self.link.fence.open(self.node):
            return None
        await self.flush()
        return KVHandoff(node=self.node, blocks=blocks)

    # Decode ---------------------------------------------------------------------------------------

    async def decode(self, seqs: list[Sequence], next_tokens: list[int]) -> None:
        """Append one token to each sequence and compute its logits, all sequences in one pass."""
        for seq, token in zip(seqs, next_tokens, strict=True):
            seq.tokens.append(token)
            await self.kv.grow(seq.table, len(seq.tokens))
        chunks = [PagedChunk([s.tokens[-1]], len(s.tokens) - 1, list(s.table.blocks)) for s in seqs]
        async with self._compute:
            logits = await asyncio.to_thread(self.model.forward_paged, chunks, self.kv.kv)
        for seq, out in zip(seqs, logits):
            seq.logits = out[-1]
            if len(seq.tokens) % self.block_size == 0:
                self._store_full_blocks(seq)

    async def reserve(self, seq: Sequence, positions: int) -> None:
        """Blocks for ``positions`` tokens of ``seq`` (``TierFullError`` when none can be freed)."""
        await self.kv.grow(seq.table, positions)

    def free(self, seq: Sequence) -> None:
        """The request is over: its blocks go back (full blocks stay cached in the gpu tier)."""
        self.kv.close(seq.table)


def next_token(
    logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None, top_p: float = 1.0
) -> int:
    """Greedy at temperature 0, else a sample from the softmax at that temperature, over the smallest
    set of tokens whose probabilities add up to ``top_p`` (nucleus sampling; 1: all of them). Shifted
    by the maximum first and in float64, so any temperature is well defined: a tiny one tends to greedy
    (1e-40 once overflowed to NaN probabilities and crashed the sampler), a huge one to uniform."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = (logits.double() - logits.max().double()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    if not torch.isfinite(probs).all():
        raise ValueError(f"logits are not finite at temperature {temperature}")
    if top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(ordered, dim=-1) - ordered >= top_p  # those after the nucleus is full
        ordered[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the model's distribution (before temperature and top_p: what
    vLLM reports by default) and the ``top`` most likely tokens with theirs, most likely first."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = [] if best is None else [(int(t), float(v)) for v, t in zip(best.values, best.indices)]
    return float(logp[token]), alternatives


__all__ = [
    "ContextLimitError",
    "ModelRunner",
    "PrefillStats",
    "Sequence",
    "StoreError",
    "logprobs_of",
    "next_token",
]
