"""``AsyncStore``: Mooncake Store's object API over a running tiercake cluster, for asyncio callers.

An object is a name and its bytes. ``layout.py`` says how it lies in blocks; this module places the
blocks with the conductor (its placement strategy and replication policy pick the nodes of each
object's head, the chunks go with it), moves them with the transfer engine (the shared pool on the
same host, TCP across hosts) and keeps the index exact: a put returns once every block is stored
and its placement durable, a remove once the nodes dropped the blocks and the index forgot them.

Semantics (Mooncake's, checked against Mooncake Store 0.3.13 in ``tests/test_kvstore.py``):
- a put of a name that exists keeps the first value and succeeds; ``replace=True`` (Mooncake's
  ``upsert``) replaces it;
- objects are whole or absent: the head is written last, and a reader follows one version;
- a remove while a reader holds the object is refused (``ObjectHasLease``); ``force`` waits for the
  readers (at most ``LEASE_WAIT_S``);
- the cluster is a cache: a put into full nodes makes them evict (``begin_put(evict=True)``); an
  object one of whose chunks was evicted is not found by ``get``. The head's parent is its last
  chunk, so prefix-aware eviction (``leaf_lru``) takes the head, a leaf, before any chunk; under
  other policies ``exists`` may answer true for such an object until its head goes too.

Each batch call costs one conductor request for the lookups (or the placements) and one transfer
request per node, whatever the number of objects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tiercake.blocks import BlockKey, object_head_key
from tiercake.conductor.client import Client, ConductorError, NodeDirectory
from tiercake.conductor.placement import TIER_ORDER
from tiercake.messages import PrefixHolding
from tiercake.tiers import StoreError
from tiercake.tiers.buffers import as_bytes
from tiercake.transfer import BlockLoc, BufferLoc, Status, Transfer, TransferEngine, TransferResult

from .errors import InvalidParams, NoSpace, ObjectHasLease, ObjectNotFound, RpcFailed, StoreApiError, TransferFailed
from .layout import HEADER, Header, LayoutError, ObjectBlocks, name_bytes, size_from_head

log = logging.getLogger(__name__)

Outcome = StoreApiError | None


@dataclass(slots=True)
class _Found:
    """Where one object's head lies: (node, head block bytes), fastest tier first."""

    name: str
    head: BlockKey
    holders: list[tuple[str, int]]


@dataclass(slots=True, eq=False)
class _Put:
    """One object of a put batch on its way to its nodes."""

    index: int
    blocks: ObjectBlocks
    src: torch.Tensor
    nodes: list[str] = field(default_factory=list)
    replacing: _Found | None = None  # the object a replace removes once the new chunks are stored
    committed: int = 0
    error: StoreApiError | None = None


class AsyncStore:
    LEASE_WAIT_S = 5.0  # how long a forced remove (and the chunks of any remove) waits out readers
    CONCURRENCY = 16  # objects read one by one (chunked, or retried at another replica) at a time
    PLACES = 1 << 16  # objects whose place this client remembers

    def __init__(self, conductors: str | Sequence[str], *, secret: bytes | str, token: str | None = None,
                 tenant: str = "default", tier: str = "pool", transports: Sequence[str] = ("shm", "tcp"),
                 identity: str | None = None, ssl=None, streams: int = 2, conductor_timeout: float = 5.0,
                 transfer_tls=None) -> None:
        """``conductors``: the conductor URLs; ``secret``: the cluster's transfer secret; ``token``: its
        control token; ``tenant``: whose objects (tenants never see each other's); ``tier``: where new
        objects are placed (a tier the nodes have: ``pool``, or ``ssd`` on SSD-only nodes); ``ssl``: the
        conductors' TLS client context; ``transfer_tls``: the node agents' (``transfer.tls``)."""
        if not tenant or "/" in tenant or "#" in tenant:
            raise ValueError(f"a tenant is a non-empty name without '/' or '#', got {tenant!r}")
        urls = [conductors] if isinstance(conductors, str) else list(conductors)
        self.tenant = tenant
        self.tier = tier
        self._heads = f"{tenant}#objects"  # the index's tenants: heads apart from chunks, so that
        self._chunks = f"{tenant}#chunks"  # remove_all counts objects
        self.client = Client(urls, token=token, timeout=conductor_timeout, ssl=ssl)
        secret = secret.encode() if isinstance(secret, str) else secret
        identity = identity or f"kvstore-{os.getpid()}-{secrets.token_hex(3)}"
        self.engine = TransferEngine(identity, secret, transports=tuple(transports), streams=streams, tls=transfer_tls)
        self.nodes = NodeDirectory(self.client, self.engine, every=0.0)  # the live node agents
        self._slots = asyncio.Semaphore(self.CONCURRENCY)
        # head -> (node, head block bytes) where this client last put or found it: reads go there first
        self._places: OrderedDict[bytes, tuple[str, int]] = OrderedDict()

    async def open(self) -> AsyncStore:
        await self._refresh()
        return self

    async def close(self) -> None:
        await self.engine.close()
        await self.client.close()

    async def __aenter__(self) -> AsyncStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # The API, one object at a time: each is its batch of one ----------------------------------------

    async def put(self, name: str, value, *, replace: bool = False) -> None:
        """Store ``value`` (bytes, a buffer, an array or a tensor: its bytes) under ``name``."""
        _raise((await self.put_many([name], [value], replace=replace))[0])

    async def get(self, name: str) -> bytes:
        return bytes((await self.get_tensor(name)).numpy())

    async def get_tensor(self, name: str) -> torch.Tensor:
        """The object's bytes as a flat uint8 tensor (no copy beyond the transfer's)."""
        got = (await self.get_many([name]))[0]
        _raise(got if isinstance(got, StoreApiError) else None)
        return got

    async def get_into(self, name: str, buffer) -> int:
        """Read the object into ``buffer`` (writable; at least its size); returns its size."""
        got = (await self.get_many_into([name], [buffer]))[0]
        _raise(got if isinstance(got, StoreApiError) else None)
        return got

    async def exists(self, name: str) -> bool:
        return (await self.exists_many([name]))[0]

    async def get_size(self, name: str) -> int:
        found = (await self._locate([name]))[0]
        if found is None:
            raise ObjectNotFound(f"no object {name!r}")
        last: StoreApiError | None = None
        for node, head_bytes in found.holders:
            inline = size_from_head(head_bytes)
            if inline is not None:
                return inline
            try:
                return (await self._header(node, found.head)).size
            except (ObjectNotFound, TransferFailed) as exc:
                last = exc
        raise last

    async def remove(self, name: str, *, force: bool = False) -> None:
        _raise((await self.remove_many([name], force=force))[0])

    # Batches ------------------------------------------------------------------------------------

    async def exists_many(self, names: Sequence[str]) -> list[bool]:
        return [found is not None for found in await self._locate(names)]

    async def get_many(self, names: Sequence[str]) -> list[torch.Tensor | StoreApiError]:
        """Each object's bytes (a tensor of exactly its size), or why not."""
        return await self._read_many(names, [None] * len(names))

    async def get_many_into(self, names: Sequence[str], buffers: Sequence) -> list[int | StoreApiError]:
        """Read each object into the buffer beside it; its size, or why not."""
        if len(names) != len(buffers):
            raise InvalidParams(f"{len(names)} keys for {len(buffers)} buffers")
        outs: list[torch.Tensor | None] = []
        errors: dict[int, StoreApiError] = {}
        for i, buf in enumerate(buffers):
            try:
                outs.append(_writable(buf))
            except (StoreError, TypeError, ValueError) as exc:
                outs.append(None)
                errors[i] = InvalidParams(f"buffer {i}: {exc}")
        got = await self._read_many([n for i, n in enumerate(names) if i not in errors],
                                    [o for i, o in enumerate(outs) if i not in errors])
        it = iter(got)
        return [errors[i] if i in errors else _size_or_error(next(it)) for i in range(len(names))]

    async def put_many(self, names: Sequence[str], values: Sequence, *, replace: bool = False) -> list[Outcome]:
        """Store each value under the name beside it; None for each stored (or already there), or why
        not. Nothing of an object that failed is visible."""
        if len(names) != len(values):
            raise InvalidParams(f"{len(names)} keys for {len(values)} values")
        results: list[Outcome] = [None] * len(names)
        puts: list[_Put] = []
        seen: set[bytes] = set()
        for i, (name, value) in enumerate(zip(names, values)):
            try:
                src = as_bytes(value)
                blocks = ObjectBlocks.new(name_bytes(name), self.tenant, src.numel())
            except (StoreError, TypeError, ValueError) as exc:
                results[i] = InvalidParams(f"{name!r}: {exc}")
                continue
            if blocks.head not in seen:  # a name twice in one batch: the first value is stored
                seen.add(blocks.head)
                puts.append(_Put(i, blocks, src))
        await self._find_existing(names, puts, replace)
        todo = [p for p in puts if p.error is None and p.committed == 0]
        if todo:
            await self._place(todo, replace)
        for p in puts:
            results[p.index] = p.error if p.committed == 0 else None
        return results

    async def remove_many(self, names: Sequence[str], *, force: bool = False) -> list[Outcome]:
        """Remove each object from every node that holds it; None for each removed, or why not."""
        async def one(found: _Found | None, name: str) -> Outcome:
            if found is None:
                return ObjectNotFound(f"no object {name!r}")
            try:
                for node, head_bytes in found.holders:
                    await self._remove_at(node, found.head, head_bytes, force)
            except StoreApiError as exc:
                return exc
            return None

        located = await self._locate(names)
        return list(await asyncio.gather(*(one(f, n) for f, n in zip(located, names))))

    async def remove_all(self, *, force: bool = False) -> int:
        """Remove every object of this tenant from every node; returns how many objects went. Objects
        being read are left (unless ``force``), as Mooncake's ``remove_all`` leaves leased ones."""
        await self._refresh()
        removed: set[bytes] = set()
        for node in list(self.nodes.members):
            blocks = await self._rpc(self.client.node_blocks(node))
            heads = {bytes.fromhex(b.key): b.size for b in blocks if b.tenant == self._heads}
            for head, size in heads.items():
                try:
                    await self._remove_at(node, BlockKey(head), size, force)
                    removed.add(head)
                except ObjectHasLease:
                    continue
                except (ObjectNotFound, TransferFailed) as exc:
                    log.warning("kvstore: remove_all on %s: %s", node, exc)
        # Chunks no head leads to are not swept here: they could be a put's in flight (its head not yet
        # written) or a leased object's. A failed put removes its own; eviction takes any left.
        return len(removed)

    # Finding objects --------------------------------------------------------------------------------

    def _heads_of(self, names: Sequence[str]) -> list[BlockKey]:
        try:
            return [object_head_key(name_bytes(name), self.tenant) for name in names]
        except (TypeError, ValueError) as exc:
            raise InvalidParams(str(exc)) from None

    async def _locate(self, names: Sequence[str], heads: list[BlockKey] | None = None) -> list[_Found | None]:
        """Where each object's head lies (live nodes only), from one lookup for the whole batch."""
        heads = self._heads_of(names) if heads is None else heads
        if not heads:
            return []
        replies = await self._rpc(self.client.lookup_many(self._heads, [[h] for h in heads], sizes=True))
        if any(node not in self.nodes for reply in replies for node in reply):
            await self._refresh()
        located = [self._found(name, head, reply) for name, head, reply in zip(names, heads, replies)]
        for head, found in zip(heads, located):
            if found is None:
                self._places.pop(head, None)
            else:
                self._remember(head, *found.holders[0])
        return located

    def _known(self, name: str, head: BlockKey) -> _Found | None:
        place = self._places.get(head)
        if place is None or place[0] not in self.nodes:
            return None
        self._places.move_to_end(head)
        return _Found(name, head, [place])

    def _remember(self, head: bytes, node: str, head_bytes: int) -> None:
        self._places[head] = (node, head_bytes)
        self._places.move_to_end(head)
        while len(self._places) > self.PLACES:
            self._places.popitem(last=False)

    def _found(self, name: str, head: BlockKey, reply: dict[str, PrefixHolding]) -> _Found | None:
        def speed(item: tuple[str, PrefixHolding]) -> int:
            runs = item[1].runs
            return TIER_ORDER.get(runs[0][0], len(TIER_ORDER)) if runs else len(TIER_ORDER)

        holders = [(node, holding.sizes[0]) for node, holding in sorted(reply.items(), key=speed)
                   if node in self.nodes and holding.length and holding.sizes]
        return _Found(name, head, holders) if holders else None

    async def _find_existing(self, names: Sequence[str], puts: list[_Put], replace: bool) -> None:
        """Mooncake keeps the first value of a name: without ``replace``, puts of names that exist are
        done already; with it, what they replace is noted. Without ``replace`` only chunked objects
        are looked up first (to spare their chunks' transfer): an inline head that exists is refused
        by its node, which counts as done."""
        puts = [p for p in puts if replace or p.blocks.chunks]
        if not puts:
            return
        located = await self._locate([names[p.index] for p in puts])
        for p, found in zip(puts, located):
            if found is not None and replace:
                p.replacing = found
            elif found is not None:
                p.committed = len(found.holders)

    # Reading ------------------------------------------------------------------------------------

    async def _read_many(self, names: Sequence[str], outs: list[torch.Tensor | None]
                         ) -> list[torch.Tensor | StoreApiError]:
        """Each object into ``outs[i]`` (or a new tensor). Objects this client knows the place of are
        read there first, without a lookup; the node is the authority (the head names the object and
        its version), so a stale place costs only the fallback: a lookup and a read at every holder."""
        heads = self._heads_of(names)
        results: list[torch.Tensor | StoreApiError | None] = [None] * len(names)
        known = [self._known(name, head) for name, head in zip(names, heads)]
        if any(known):
            await self._read_located([i for i, f in enumerate(known) if f], known, outs, results, final=False)
        rest = [i for i, r in enumerate(results) if r is None]
        if rest:
            found = await self._locate([names[i] for i in rest], [heads[i] for i in rest])
            located: list[_Found | None] = [None] * len(names)
            for i, f in zip(rest, found):
                located[i] = f
                if f is None:
                    results[i] = ObjectNotFound(f"no object {names[i]!r}")
            await self._read_located([i for i in rest if located[i] is not None], located, outs, results, final=True)
        return results

    async def _read_located(self, items: list[int], located: list[_Found | None], outs, results, final: bool) -> None:
        """Inline objects in one request per node (their first holder), the others one by one. With
        ``final``, every holder is tried and the outcome is the answer; without, a failure leaves the
        item for the lookup."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for i in items:
            if size_from_head(located[i].holders[0][1]) is not None:
                by_node[located[i].holders[0][0]].append(i)
        await asyncio.gather(*(self._read_inline(node, group, located, outs, results, final)
                               for node, group in by_node.items()))

        async def one(i: int) -> None:
            async with self._slots:
                got = await self._read_anywhere(located[i], outs[i])
            if final or not isinstance(got, StoreApiError):
                results[i] = got

        await asyncio.gather(*(one(i) for i in items if results[i] is None))

    async def _read_inline(self, node: str, items: list[int], located: list[_Found], outs, results,
                           final: bool) -> None:
        """Inline objects whose first holder is ``node``: one read of their heads. Those that fail here
        are left for ``_read_anywhere`` (or the lookup); a buffer too small for a size the index gave
        fails at once."""
        staged, keys, todo = [], [], []
        for i in items:
            size = size_from_head(located[i].holders[0][1])
            if outs[i] is not None and outs[i].numel() < size:
                if final:
                    results[i] = _too_small(located[i].name, size, outs[i].numel())
                continue
            staged.append(torch.empty(HEADER + size, dtype=torch.uint8))
            keys.append(located[i].head)
            todo.append(i)
        if not todo:
            return
        done = await self._to_node(node, lambda: self.engine.read_blocks(
            node, keys, staged, timeout=self.engine.deadline_for(sum(s.numel() for s in staged))))
        for i, block, result in zip(todo, staged, done):
            if result.ok:
                try:
                    results[i] = _unpack_inline(block, outs[i])
                except TransferFailed:
                    pass  # read again from every holder
            else:
                self._places.pop(located[i].head, None)

    async def _read_anywhere(self, found: _Found, out: torch.Tensor | None) -> torch.Tensor | StoreApiError:
        last: StoreApiError = ObjectNotFound(f"no object {found.name!r}")
        for node, head_bytes in found.holders:
            try:
                return await self._read_at(node, found, head_bytes, out)
            except (ObjectNotFound, TransferFailed) as exc:
                last = exc  # removed or evicted there, or the node failed: the next replica
            except InvalidParams as exc:
                return exc
        return last

    async def _read_at(self, node: str, found: _Found, head_bytes: int, out: torch.Tensor | None) -> torch.Tensor:
        size = size_from_head(head_bytes)
        if size is not None:
            if out is not None and out.numel() < size:
                raise _too_small(found.name, size, out.numel())
            (block,) = await self._read(node, [found.head], [torch.empty(head_bytes, dtype=torch.uint8)])
            return _unpack_inline(block, out)
        header = await self._header(node, found.head)
        if out is not None and out.numel() < header.size:
            raise _too_small(found.name, header.size, out.numel())
        if out is None:
            out = torch.empty(header.size, dtype=torch.uint8)
        blocks = ObjectBlocks.of(found.head, header)
        await self._read(node, blocks.chunks, [out[at:at + n] for at, n in blocks.chunk_spans()],
                         what=f"object {found.name!r} (incomplete there: a chunk was evicted or removed)")
        return out[:header.size]

    async def _header(self, node: str, head: BlockKey) -> Header:
        (block,) = await self._read(node, [head], [torch.empty(HEADER, dtype=torch.uint8)])
        try:
            return Header.decode(bytes(block.numpy()))
        except LayoutError as exc:
            raise TransferFailed(f"{node}: {exc}") from None

    async def _read(self, node: str, keys: list[bytes], dsts: list[torch.Tensor], what: str = "object") -> list[torch.Tensor]:
        nbytes = sum(d.numel() for d in dsts)
        results = await self._to_node(node, lambda: self.engine.read_blocks(
            node, keys, dsts, timeout=self.engine.deadline_for(nbytes)))
        for result in results:
            _check(result, node, what)
        return dsts

    # Writing ------------------------------------------------------------------------------------

    async def _place(self, puts: list[_Put], replace: bool) -> None:
        """Placement for every head (the chunks follow it); each node's chunks; with ``replace``, the
        old objects removed; each node's heads. A replaced object is absent only while its head is
        swapped, never while the new chunks travel."""
        totals = [p.blocks.head_bytes + (p.blocks.header.size if p.blocks.chunks else 0) for p in puts]
        try:
            # evict: the cluster is a cache, as Mooncake Store is: a full node makes room for new objects
            targets = await self._rpc(self.client.begin_put(self._heads, [p.blocks.head for p in puts], totals,
                                                            self.tier, evict=True))
        except StoreApiError as exc:
            for p in puts:
                p.error = exc
            return
        by_node: dict[str, list[_Put]] = defaultdict(list)
        for p in puts:
            p.nodes = targets.get(p.blocks.head, [])
            for node in p.nodes:
                by_node[node].append(p)
        if any(node not in self.nodes for node in by_node):
            await self._refresh()
        await asyncio.gather(*(self._write_chunks(node, share) for node, share in by_node.items()))
        if replace:
            await self._remove_old([p for p in puts if p.error is None and p.replacing is not None])
        await asyncio.gather(*(self._write_heads(node, share) for node, share in by_node.items()))
        for p in puts:
            if p.committed == 0 and p.error is None:
                p.error = NoSpace(f"no node took object {p.index}")

    async def _write_chunks(self, node: str, puts: list[_Put]) -> None:
        """The chunks of the chunked objects placed on ``node``, their placement made durable by a
        report (a head is committed only once everything it leads to is stored)."""
        chunked = [p for p in puts if p.blocks.chunks and p.error is None]
        if not chunked:
            return
        batch, owners = [], []
        for p in chunked:
            parent = None
            for key, (at, n) in zip(p.blocks.chunks, p.blocks.chunk_spans()):
                batch.append(Transfer(BufferLoc(p.src, at), BlockLoc(node, key, parent, self._chunks), n))
                owners.append(p)
                parent = key
        done = await self._write(node, batch)
        for p, result in zip(owners, done):
            if not result.ok and p.error is None:
                p.error = _error_of(result, node, "chunk")
        stored = [(b.dst.key, b.length) for b, r in zip(batch, done) if r.ok]
        if stored:
            try:
                await self._rpc(self.client.report(self._chunks, node, self.tier, [k for k, _ in stored],
                                                   [n for _, n in stored]))
            except StoreApiError as exc:
                for p in chunked:
                    p.error = p.error or exc
        await self._undo(node, [p for p in chunked if p.error is not None], written_heads=[])

    async def _remove_old(self, puts: list[_Put]) -> None:
        async def one(p: _Put) -> None:
            try:
                for node, head_bytes in p.replacing.holders:
                    await self._remove_at(node, p.replacing.head, head_bytes, force=False)
            except ObjectNotFound:
                pass
            except StoreApiError as exc:
                p.error = exc  # the old value stays; the new chunks go

        await asyncio.gather(*(one(p) for p in puts))
        for p in puts:
            if p.error is not None:
                for node in p.nodes:
                    await self._undo(node, [p], written_heads=[])

    async def _write_heads(self, node: str, puts: list[_Put]) -> None:
        """The heads placed on ``node``, then their placement: committed where the conductor holds the
        put begun, reported where the name was placed before (a replaced object)."""
        heads = [p for p in puts if p.error is None]
        if not heads:
            return
        # the head's parent is the last chunk: prefix-aware eviction (leaf_lru) takes the head, a leaf,
        # before any chunk, so an object under pressure vanishes whole
        batch = [Transfer(BufferLoc(_head_block(p)), BlockLoc(node, p.blocks.head, (p.blocks.chunks or [None])[-1],
                                                              self._heads), p.blocks.head_bytes) for p in heads]
        done = await self._write(node, batch)
        written, existed, failed = [], [], []
        for p, result in zip(heads, done):
            if result.ok:
                written.append(p)
            elif result.exists:  # another put of the name won the race: its value stays (Mooncake's rule)
                existed.append(p)
            else:
                p.error = _error_of(result, node, "head")
                failed.append(p)
        for begun, group in ((True, [p for p in written if p.replacing is None]),
                             (False, [p for p in written if p.replacing is not None])):
            if not group:
                continue
            call = self.client.commit if begun else self.client.report
            try:
                await self._rpc(call(self._heads, node, self.tier, [p.blocks.head for p in group],
                                     [p.blocks.head_bytes for p in group]))
                for p in group:
                    p.committed += 1
                    self._remember(p.blocks.head, node, p.blocks.head_bytes)
            except StoreApiError as exc:
                for p in group:
                    p.error = exc
                failed += group
        for p in existed:
            p.committed += 1
        await self._undo(node, failed + existed, written_heads=[p for p in failed if p in written])

    async def _undo(self, node: str, puts: list[_Put], written_heads: list[_Put]) -> None:
        """What a failed (or superfluous) put left on ``node``: its chunks, a head stored but not
        committed, the pending placement. Best effort: eviction takes what is left."""
        if not puts:
            return
        chunks = [k for p in puts for k in p.blocks.chunks]
        heads = [p.blocks.head for p in written_heads]
        try:
            await self._delete(node, self._chunks, chunks, wait=False)
            await self._delete(node, self._heads, heads, wait=False)
            pending = [p.blocks.head for p in puts if p.committed == 0]
            if pending:
                await self._rpc(self.client.revoke(self._heads, node, self.tier, pending))
        except StoreApiError as exc:
            log.warning("kvstore: cleaning up a failed put on %s: %s", node, exc)

    async def _write(self, node: str, batch: list[Transfer]) -> list[TransferResult]:
        nbytes = sum(t.length for t in batch)
        return await self._to_node(node, lambda: self.engine.transfer(batch, timeout=self.engine.deadline_for(nbytes)))

    # Removing -----------------------------------------------------------------------------------

    async def _remove_at(self, node: str, head: BlockKey, head_bytes: int, force: bool) -> None:
        """The head first (refused while read, unless ``force``): the object is gone for readers; then
        its chunks (waiting out a reader that had read the head), then the index."""
        chunks: list[bytes] = []
        if size_from_head(head_bytes) is None:
            try:
                chunks = ObjectBlocks.of(head, await self._header(node, head)).chunks
            except ObjectNotFound:
                pass  # gone there already; the index is told below
        await self._delete(node, self._heads, [head], wait=force)
        self._places.pop(head, None)
        await self._delete(node, self._chunks, chunks, wait=True)

    async def _delete(self, node: str, tenant: str, keys: list[bytes], wait: bool) -> None:
        """Delete ``keys`` on ``node`` and forget them in the index. A key a reader holds raises
        ``ObjectHasLease``, or with ``wait`` is retried until ``LEASE_WAIT_S`` has passed."""
        if not keys:
            return
        deadline = time.monotonic() + (self.LEASE_WAIT_S if wait else 0.0)
        todo, gone = list(keys), []
        while todo:
            results = await self._to_node(node, lambda: self.engine.delete_blocks(node, todo))
            leased = []
            for key, result in zip(todo, results):
                status = getattr(result.error, "status", None)
                if result.ok or status is Status.NOT_FOUND:
                    gone.append(key)
                elif status is Status.LEASED:
                    leased.append(key)
                else:
                    raise _error_of(result, node, "remove")
            todo = leased
            if todo and time.monotonic() >= deadline:
                break
            if todo:
                await asyncio.sleep(0.02)
        member = self.nodes.members.get(node)
        for tier in (member.tiers if member else {self.tier: 0}) if gone else ():
            await self._rpc(self.client.remove(tenant, node, tier, gone))
        if todo:
            raise ObjectHasLease(f"{len(todo)} block(s) on {node} are being read; retry once the read is over "
                                 "(or remove with force=True)")

    # Plumbing -----------------------------------------------------------------------------------

    async def _rpc(self, call):
        try:
            return await call
        except ConductorError as exc:
            if exc.status == 507 or exc.code == "no_room":
                raise NoSpace(str(exc)) from None
            if exc.status in (400, 404, 409, 413, 422):
                raise InvalidParams(str(exc)) from None
            raise RpcFailed(str(exc)) from None

    async def _refresh(self) -> None:
        await self._rpc(self.nodes.refresh())

    async def _to_node(self, node: str, attempt) -> list[TransferResult]:
        return await self._rpc(self.nodes.to_node(node, attempt))


def _raise(outcome: Outcome) -> None:
    if outcome is not None:
        raise outcome


def _size_or_error(got):
    return got if isinstance(got, StoreApiError) else got.numel()


def _writable(buffer) -> torch.Tensor:
    """The buffer's bytes to write into, refusing read-only memory (bytes, a read-only array)."""
    if isinstance(buffer, torch.Tensor):
        return as_bytes(buffer)
    readonly = not buffer.flags.writeable if isinstance(buffer, np.ndarray) else memoryview(buffer).readonly
    if readonly:
        raise ValueError(f"a {type(buffer).__name__} is read-only")
    return as_bytes(buffer)


def _too_small(name: str, size: int, have: int) -> InvalidParams:
    return InvalidParams(f"object {name!r} is {size} bytes, the buffer holds {have}")


def _head_block(p: _Put) -> torch.Tensor:
    block = torch.empty(p.blocks.head_bytes, dtype=torch.uint8)
    block[:HEADER] = torch.frombuffer(bytearray(p.blocks.header.encode()), dtype=torch.uint8)
    if p.blocks.header.inline:
        block[HEADER:] = p.src
    return block


def _unpack_inline(block: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    try:
        header = Header.decode(bytes(block[:HEADER].numpy()))
    except LayoutError as exc:
        raise TransferFailed(str(exc)) from None
    if header.size != block.numel() - HEADER:
        raise TransferFailed(f"object header says {header.size} bytes, its block holds {block.numel() - HEADER}")
    data = block[HEADER:]
    if out is None:
        return data
    out[:header.size].copy_(data)
    return out[:header.size]


def _error_of(result: TransferResult, node: str, what: str) -> StoreApiError:
    status = getattr(result.error, "status", None)
    message = f"{what} on {node}: {result.error}"
    if status is Status.NOT_FOUND:
        return ObjectNotFound(message)
    if status is Status.FULL:
        return NoSpace(message)
    if status is Status.LEASED:
        return ObjectHasLease(message)
    if status is Status.LENGTH_MISMATCH:
        return InvalidParams(message)
    return TransferFailed(message)


def _check(result: TransferResult, node: str, what: str) -> None:
    if not result.ok:
        raise _error_of(result, node, what)
