"""``EventMirror``: what vLLM's own prefix cache holds, as vLLM itself reports it.

vLLM publishes every change of its prefix cache when started with ``--kv-events-config`` (a ZMQ PUB
socket; ``process.serve_command`` sets it up on loopback): a block stored (its vLLM hash, its parent's,
its tokens, and the ``cache_salt`` among its extra keys), blocks removed, everything cleared (a reset).
The worker beside the instance follows that stream and keys each stored block with tiercake's one
hashing function: the parent's tiercake key and the block's tokens, or for the first block of a chain
the root of the instance's namespace under the request's salt. The salt comes from the ``cache_salt``
the worker itself gave vLLM (a digest, ``engine.cache_salt``; the worker remembers which salt and
tenant each digest stands for). So the front sees exactly what the instance holds, generated tokens
included, and no longer what it evicted or forgot.

What cannot be keyed is left out and counted (``figures["unmapped"]``): blocks of requests that did
not come through this worker (no known salt), and their descendants.

Lost messages: every batch carries a sequence number. At start, and on a gap, the follower asks
vLLM's replay endpoint (a ROUTER socket that keeps the last batches) for what it missed; without one a
gap is counted and logged. When the stream is quiet, the follower asks again now and then: batches
published while the subscription was still connecting are dropped with no gap to show it. A sequence
number that goes back, on a batch published later, is a restarted vLLM: the mirror is emptied first.
vLLM publishes a step's events after the step, so a reset shows at its next step.

A mirror that is off by a block costs a load or a recompute, never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tiercake.blocks import Namespace, chain_key
from tiercake.tiers import BlockChange

log = logging.getLogger(__name__)

IDLE_REPLAY_S = 2.0  # when no batch came for this long, vLLM's replay is asked whether any were lost
REPLAY_TIMEOUT_S = 5.0  # the most one replay request waits for vLLM's answer
MAX_SALTS = 65536  # cache salts remembered (least recently used out): tenants and salts in use at once
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay

# vLLM's wire format (vllm/distributed/kv_events.py): the fields read here; the rest are ignored.
BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(EventBatch).decode


class EventsEndpoints(msgspec.Struct):
    """Where an instance publishes (its ``--kv-events-config``, as the connector reports it)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def subscriber_binds(self) -> bool:
        """vLLM binds wildcard, ipc and inproc endpoints and connects to the rest: the other end does
        the opposite."""
        return not ("*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")))

    def subscriber_address(self) -> str:
        return self.endpoint.replace("*", "127.0.0.1")


class EventMirror:
    """See the module docstring. Reported like a store's gpu tier (``HeldBlocks``)."""

    tier = "gpu"

    def __init__(self, namespace: Namespace, block_bytes: int, max_blocks: int = 1 << 20) -> None:
        """``max_blocks``: the most vLLM blocks tracked (a few times vLLM's own): past it the oldest are
        forgotten, so lost removals cannot grow the mirror without bound."""
        self.namespace, self.block_bytes, self.max_blocks = namespace, block_bytes, max_blocks
        self.listeners: list[Callable[[BlockChange], None]] = []
        self._salts: OrderedDict[str, tuple[str, str]] = OrderedDict()  # vLLM cache_salt -> (tenant, salt)
        self._roots: dict[str, bytes] = {}
        self._blocks: dict[BlockHash, tuple[str, bytes] | None] = {}  # vLLM hash -> (tenant, key); None: unkeyed
        self._copies: Counter[tuple[str, bytes]] = Counter()
        self.last_seq, self.last_ts = -1, 0.0
        self._replay_failing = False
        self.batches = asyncio.Event()  # set once a batch has come
        self.figures = Counter(
            stored=0, removed=0, cleared=0, unmapped=0, gaps=0, restarts=0, bad_batches=0, overflowed=0
        )

    # What the worker tells it ------------------------------------------------------------------

    def remember(self, vllm_salt: str | None, tenant: str, salt: str) -> None:
        """A request went to vLLM with ``cache_salt=vllm_salt`` for this tenant and salt."""
        if vllm_salt is None:
            return
        self._salts[vllm_salt] = (tenant, salt)
        self._salts.move_to_end(vllm_salt)
        while len(self._salts) > MAX_SALTS:
            self._salts.popitem(last=False)

    def holdings(self) -> list[BlockChange]:
        return [BlockChange(key, self.tier, self.block_bytes, tenant, True) for tenant, key in self._copies]

    # Applying vLLM's events --------------------------------------------------------------------

    def receive(self, seq: int, payload: bytes) -> None:
        """One batch as published, without the follower's catching up (``follow`` does that)."""
        batch = self._decode(seq, payload)
        if batch is not None:
            self._apply(seq, batch)

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        """The batch, the mirror emptied first if it comes from a restarted vLLM; None if unreadable."""
        try:
            batch = _decode(payload)
        except msgspec.DecodeError as exc:
            self.figures["bad_batches"] += 1
            log.warning("vllm events: batch %d not understood (%s); the mirror may miss its changes", seq, exc)
            self.last_seq = max(self.last_seq, seq)  # not asked for again
            return None
        if self._restarted(seq, batch):
            self._restart(seq)
        return batch

    def _restarted(self, seq: int, batch: EventBatch) -> bool:
        """A sequence number that goes back on a batch published later: a new vLLM process (an earlier
        number published no later than the last batch is a repeat, from a replay)."""
        return seq <= self.last_seq and batch.ts > self.last_ts

    def _restart(self, seq: int) -> None:
        self.figures["restarts"] += 1
        log.info(
            "vllm events: the publisher started again (batch %d after %d); its cache starts empty", seq, self.last_seq
        )
        self._clear()
        self.last_seq, self.last_ts = -1, 0.0

    def _apply(self, seq: int, batch: EventBatch) -> None:
        if seq <= self.last_seq:
            return  # a repeat
        self.last_seq, self.last_ts = seq, batch.ts
        self.batches.set()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self.figures["cleared"] += 1
                self._clear()

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in (None, "GPU"):
            return  # a copy vLLM offloaded elsewhere: not its prefix cache
        size = self.namespace.block_size
        parent = event.parent_block_hash
        for i, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            entry = None
            if event.block_size == size and len(tokens) == size:
                if parent is None:
                    who = self._salt_of(event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None)
                    if who is not None:
                        entry = (who[0], chain_key(self._root(who[1]), tokens))
                else:
                    above = self._blocks.get(parent)
                    if above is not None:
                        entry = (above[0], chain_key(above[1], tokens))
            self._forget(vllm_hash)  # the same hash stored again: replaced, never counted twice
            self._blocks[vllm_hash] = entry
            if len(self._blocks) > self.max_blocks:
                self.figures["overflowed"] += 1
                self._forget(next(iter(self._blocks)))
            if entry is None:
                self.figures["unmapped"] += 1
            else:
                self.figures["stored"] += 1
                self._copies[entry] += 1
                if self._copies[entry] == 1:
                    self._tell(entry, True)
            parent = vllm_hash

    def _removed(self, event: BlockRemoved) -> None:
        if event.medium not in (None, "GPU"):
            return
        for vllm_hash in event.block_hashes:
            self.figures["removed"] += 1
            self._forget(vllm_hash)

    def _forget(self, vllm_hash: BlockHash) -> None:
        entry = self._blocks.pop(vllm_hash, None)
        if entry is None:
            return
        self._copies[entry] -= 1
        if self._copies[entry] <= 0:
            del self._copies[entry]
            self._tell(entry, False)

    def _clear(self) -> None:
        for entry in list(self._copies):
            self._tell(entry, False)
        self._copies.clear()
        self._blocks.clear()

    def _salt_of(self, extra: list[Any] | None) -> tuple[str, str] | None:
        """The (tenant, salt) of the cache salt among a first block's extra keys, if this worker gave it."""
        for value in extra or ():
            if isinstance(value, str) and value in self._salts:
                return self._salts[value]
        return None

    def _root(self, salt: str) -> bytes:
        if salt not in self._roots:
            if len(self._roots) >= MAX_SALTS:  # bounded like the salts: recomputed when needed again
                self._roots.clear()
            self._roots[salt] = self.namespace.model_copy(update={"tenant_salt": salt}).root()
        return self._roots[salt]

    def _tell(self, entry: tuple[str, bytes], added: bool) -> None:
        change = BlockChange(entry[1], self.tier, self.block_bytes, entry[0], added)
        for listener in self.listeners:
            listener(change)

    # Following the stream ----------------------------------------------------------------------

    async def follow(self, where: EventsEndpoints) -> None:
        """Receive vLLM's batches until cancelled: what it kept for replay first, then live ones, asking
        for a replay again whenever a gap shows."""
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, where.topic.encode())
        try:
            if where.subscriber_binds():
                sub.bind(where.subscriber_address())
            else:
                sub.connect(where.subscriber_address())
            replay = where.replay_endpoint
            if replay:  # what was missed before (the live ones queue on the subscription)
                await self._replay(context, replay, self.last_seq + 1)
            while True:
                # (zmq's own timeouts: a zmq future under asyncio.wait_for does not end when cancelled)
                if replay and not await sub.poll(IDLE_REPLAY_S * 1000):
                    # quiet: ask whether the last batches were lost (a peer still connecting drops them)
                    await self._replay(context, replay, self.last_seq + 1)
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.figures["bad_batches"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                batch = self._decode(seq, frames[2])
                if batch is None:
                    continue
                if seq > self.last_seq + 1:  # missed some: vLLM's replay buffer may still have them
                    if replay:
                        await self._replay(context, replay, self.last_seq + 1)
                    if seq > self.last_seq + 1:
                        self.figures["gaps"] += 1
                        log.warning(
                            "vllm events: batches %d-%d lost; the mirror may be off until vLLM "
                            "stores or removes those blocks again",
                            self.last_seq + 1,
                            seq - 1,
                        )
                self._apply(seq, batch)
        finally:
            sub.close()

    async def _replay(self, context: zmq.asyncio.Context, endpoint: str, start: int) -> None:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    self._replay_failing = False
                    return
                self.receive(int.from_bytes(frames[2], "big"), frames[3])
            if not self._replay_failing:  # said once until it answers again
                log.warning("vllm events: no replay from %s within %g s", endpoint, REPLAY_TIMEOUT_S)
            self._replay_failing = True
        finally:
            dealer.close()
