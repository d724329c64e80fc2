"""``DistributedStore``: Mooncake Store's ``MooncakeDistributedStore``, method for method, over tiercake.

Code written for Mooncake runs with its import changed; its ``setup`` call may stay as it is:

    from mooncake.store import MooncakeDistributedStore    from tiercake.kvstore import MooncakeDistributedStore
    store.setup("host", "P2PHANDSHAKE", seg, buf, "tcp",    store.setup("host", "P2PHANDSHAKE", seg, buf, "tcp",
                "", "master:50051")                                     "", "http://conductor:8081")

``setup`` takes Mooncake's seven (or more) positional arguments, its dict form, or tiercake's own
(``setup(conductor_url, secret=..., token=...)``); with Mooncake's forms the master address is the
conductor's URL (``host:port`` means http), and the cluster's transfer secret and control token come
from ``$TIERCAKE_SECRET`` and ``$TIERCAKE_TOKEN`` (or ``$TIERCAKE_CONFIG``, a tiercake config file).
The segment and buffer sizes are accepted: tiercake's node agents hold the memory, not the clients
(``local_buffer_size`` still bounds what one put of Python values may stage, as in Mooncake).

Every call blocks the caller (it runs on an event loop of the calling thread's own, ``threads.py``)
and answers as Mooncake's does: 0 or a size on success, a negative ``ErrorCode`` otherwise; ``get`` answers ``b""``
for a missing object, ``is_exist`` 1, 0 or -1, ``get_buffer`` None. Raw addresses (``put_from``,
``get_into`` and their batches) must lie inside a ``register_buffer``ed range: checked, so a wrong
address is INVALID_PARAMS, never a crash (Mooncake's TCP transport faults on one). Calls with no
meaning here (mounting segments, copy and move tasks) answer NOT_SUPPORTED (-1012).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import socket
import threading
from collections.abc import Sequence

import aiohttp
import numpy as np

from tiercake.tiers.objects import compile_pattern

from .aio import AsyncStore
from .errors import ErrorCode, InvalidParams, NotSupported, ObjectNotFound, StoreApiError, code_of
from .fast import FastPath
from .requests import MEMORY, Described, Durability, finish_reads, merged, readable
from .setup_args import setup_form
from .tensor_calls import TensorCalls
from .threads import ThreadClients
from .types import BufferHandle, Descriptor, DiskDescriptor, MemoryDescriptor, ReplicaDescriptor, ReplicateConfig

log = logging.getLogger(__name__)


class _Failed(int):
    """A call's negative code, told apart from a result that is an int (a size, a count, a bool)."""


class DistributedStore(TensorCalls):
    TIMEOUT_S = 120.0  # the longest any one call may block

    def __init__(self) -> None:
        self._clients: ThreadClients | None = None
        self._buffers: list[tuple[int, int]] = []  # registered (start, end), sorted
        self._views: dict[int, np.ndarray] = {}  # start -> the registered range as bytes, made once
        self._lock = threading.Lock()
        self._hostname = ""
        self._local_buffer: int | None = None  # Mooncake's local_buffer_size, when a Mooncake setup gave one

    # Setup --------------------------------------------------------------------------------------

    def setup(self, *args, **kwargs) -> int:
        """Connect to a tiercake cluster. Mooncake's forms: ``setup(local_hostname, metadata_server,
        global_segment_size, local_buffer_size, protocol, rdma_devices, master_server_addr, ...,
        tenant_id=...)`` and ``setup(config_dict)``; tiercake's: ``setup(conductor_url(s), *,
        config=, secret= or tenant_key=, token=, tenant=, transports=)``. 0, or a negative code (logged)."""
        if self._clients is not None:
            log.error("kvstore: setup called twice (close first)")
            return int(ErrorCode.INVALID_PARAMS)
        try:
            conductor, options = setup_form(args, kwargs)
        except (InvalidParams, TypeError, ValueError) as exc:
            log.error("kvstore: setup: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        self._hostname = options.pop("hostname", "") or socket.gethostname()
        self._local_buffer = options.pop("local_buffer", None)
        return self._connect(conductor, **options)

    def _connect(
        self,
        conductor,
        *,
        config: str | None = None,
        secret=None,
        tenant_key=None,
        token=None,
        tenant: str = "default",
        transports: Sequence[str] = ("shm", "tcp"),
        connect_timeout: float = 30.0,
    ) -> int:
        ssl = transfer_tls = None
        config = config or (os.environ.get("TIERCAKE_CONFIG") if not (conductor and secret) else None)
        if config:
            from tiercake.config import load_config

            try:
                cfg = load_config(config)
                conductor = conductor or cfg.conductor.urls
                tokens = cfg.conductor.tokens()
                token = token or (tokens[0] if tokens else None)
                secret = secret or cfg.transfer.secret()
                ssl = cfg.tls.client_context()
                transfer_tls = cfg.transfer_tls_client()
            except (OSError, ValueError) as exc:  # no such file, an invalid config, no secret
                log.error("kvstore: setup: config %s: %s", config, exc)
                return int(ErrorCode.INVALID_PARAMS)
        tenant_key = tenant_key or (None if secret else os.environ.get("TIERCAKE_TENANT_KEY") or None)
        secret = secret or (None if tenant_key else os.environ.get("TIERCAKE_SECRET"))
        token = token or os.environ.get("TIERCAKE_TOKEN") or None
        if not conductor or not (secret or tenant_key):
            log.error(
                "kvstore: setup needs the conductor URL(s) and the cluster secret ($TIERCAKE_SECRET, or a "
                "config file: $TIERCAKE_CONFIG) or a tenant's key ($TIERCAKE_TENANT_KEY)"
            )
            return int(ErrorCode.INVALID_PARAMS)

        async def connect() -> AsyncStore:
            store = AsyncStore(
                conductor,
                secret=secret,
                tenant_key=tenant_key,
                token=token,
                tenant=tenant,
                transports=transports,
                ssl=ssl,
                transfer_tls=transfer_tls,
                blocking=True,
            )
            try:
                return await store.open()
            except BaseException:
                await store.close()
                raise

        clients = ThreadClients(connect)
        try:
            clients.run(lambda store: store.refresh(), connect_timeout)  # this thread's client, connected
        except (StoreApiError, ValueError, TimeoutError, OSError, aiohttp.ClientError) as exc:
            log.error("kvstore: setup failed: %s", exc)
            clients.close(5.0)
            if isinstance(exc, TimeoutError | OSError | aiohttp.ClientError):
                return int(ErrorCode.RPC_FAIL)
            return code_of(exc) if isinstance(exc, StoreApiError) else int(ErrorCode.INVALID_PARAMS)
        self._clients = clients
        return 0

    def close(self) -> int:
        if self._clients is not None:
            clients, self._clients = self._clients, None
            clients.close(self.TIMEOUT_S)
        return 0

    @property
    def _store(self) -> AsyncStore | None:
        """A store of this client (what every thread's knows alike: the members, the map)."""
        return self._clients.any_store() if self._clients is not None else None

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the conductor cannot be reached (Mooncake's codes)."""
        if self._clients is None:
            return 1
        got = self._run(lambda s: s.refresh())
        return 2 if isinstance(got, _Failed) else 0

    def ready(self) -> bool:
        """Whether objects can be stored now: a node agent is a member and the object map gives its
        slots out, as the conductor says on asking (tiercake's; Mooncake has no such call)."""
        if self._clients is None or isinstance(self._run(lambda s: s.refresh()), _Failed):
            return False
        store = self._store
        return store is not None and bool(store.members) and bool(store.map.chains)

    def get_hostname(self) -> str:
        """The name this client was set up with (Mooncake's local_hostname)."""
        return self._hostname

    # Bytes --------------------------------------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._put([key], [value], config, upsert=False, whole=True)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._put([key], [value], config, upsert=True, whole=True)

    def put_batch(self, keys: list[str], values: list, config: ReplicateConfig | None = None) -> int:
        """0 if every value was stored; a bad value anywhere stores nothing (INVALID_PARAMS), as in
        Mooncake; else the first failure's code."""
        return self._put(keys, values, config, upsert=False, whole=True)

    def upsert_batch(self, keys: list[str], values: list, config: ReplicateConfig | None = None) -> int:
        return self._put(keys, values, config, upsert=True, whole=True)

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """One object of the parts' bytes, in order."""
        return self._put_joined(key, parts, config, upsert=False)

    def upsert_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        return self._put_joined(key, parts, config, upsert=True)

    def get(self, key: str) -> bytes:
        got = self._gets([key])
        if isinstance(got, _Failed) or isinstance(got[0], StoreApiError):
            return b""
        return got[0].tobytes()

    def get_batch(self, keys: list[str]) -> list[bytes]:
        got = self._gets(keys)
        if isinstance(got, _Failed):
            return [b""] * len(keys)
        return [b"" if isinstance(g, StoreApiError) else g.tobytes() for g in got]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in memory this process owns (None when missing)."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        got = self._gets(keys)
        if isinstance(got, _Failed):
            return [None] * len(keys)
        return [None if isinstance(g, StoreApiError) else BufferHandle(g) for g in got]

    def get_size(self, key: str) -> int:
        got = self._describes([key])
        if isinstance(got, _Failed):
            return got
        return _logged(got[0]) if isinstance(got[0], StoreApiError) else got[0].size

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1, 0, or -1 (could not tell) per key; a found object gets Mooncake's read lease."""
        got = self._exists(keys)
        if isinstance(got, _Failed):
            return [-1] * len(keys)
        return [-1 if isinstance(g, StoreApiError) else int(g) for g in got]

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """One descriptor per node holding the object in memory (and one per synced disk copy);
        [] when it is missing."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        got = self._describes(keys, lease=False)
        if isinstance(got, _Failed):
            return {}
        members = self._store.members if self._store is not None else {}
        return {key: _descriptors(d, members) for key, d in zip(keys, got) if isinstance(d, Described)}

    # Removing -----------------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        got = self._removes(keys, force)
        return [got] * len(keys) if isinstance(got, _Failed) else [0 if o is None else _logged(o) for o in got]

    def remove_all(self, force: bool = False) -> int:
        return self._run(lambda s: s.remove_all(force=force))

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose names match went (a search with RE2's semantics: linear time, no
        backreferences or lookarounds); INVALID_PARAMS for a bad pattern."""
        try:
            compile_pattern(regex_pattern)
        except (ValueError, TypeError, AttributeError) as exc:
            return _logged(InvalidParams(f"bad pattern {regex_pattern!r}: {exc}"))
        return self._run(lambda s: s.remove_matching(regex_pattern, force=force))

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Clear the objects' replicas (every one, or those on node ``segment_name``); only objects no
        reader's lease holds. Returns the keys cleared. Clearing a single backup's copy is not done
        (a backup keeps every replicated object of its slot): such keys are not cleared."""
        described = self._describes(keys, lease=False)
        if isinstance(described, _Failed):
            return []
        wanted = [
            k
            for k, d in zip(keys, described)
            if isinstance(d, Described) and (not segment_name or (d.holders and d.holders[0] == segment_name))
        ]
        if not wanted:
            return []
        got = self._removes(wanted, False)
        return [] if isinstance(got, _Failed) else [k for k, o in zip(wanted, got) if o is None]

    # Registered memory --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if not _is_int(buffer_ptr) or not _is_int(size) or buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        try:  # (no byte of it is read: the range is only described)
            view = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(buffer_ptr))
        except (OverflowError, ValueError, MemoryError) as exc:
            return _logged(InvalidParams(f"a buffer of {size} bytes at {buffer_ptr:#x}: {exc}"))
        with self._lock:
            start, end = buffer_ptr, buffer_ptr + size
            i = bisect.bisect(self._buffers, (start, end))
            overlaps = (i > 0 and self._buffers[i - 1][1] > start) or (
                i < len(self._buffers) and self._buffers[i][0] < end
            )
            if overlaps:
                log.error("kvstore: buffer at %#x (%d bytes) overlaps a registered one", buffer_ptr, size)
                return int(ErrorCode.INVALID_PARAMS)
            self._buffers.insert(i, (start, end))
            self._views[start] = view
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            for i, (start, _) in enumerate(self._buffers):
                if start == buffer_ptr:
                    del self._buffers[i]
                    del self._views[start]
                    return 0
        return int(ErrorCode.INVALID_PARAMS)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """One object: the metadata's bytes, then the data's (both in registered memory)."""
        return self.batch_put_from_multi_buffers(
            [key], [[metadata_buffer_ptr, buffer_ptr]], [[metadata_size, size]], config
        )[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """The object's size once it is in the buffer, or a negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._put_views(keys, self._memories(keys, buffer_ptrs, sizes), config, upsert=False)

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._put_views(keys, self._memories(keys, buffer_ptrs, sizes), config, upsert=True)

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        views, codes = self._memories(keys, buffer_ptrs, sizes)
        todo = [i for i, c in enumerate(codes) if c == 0]
        got = self._gets([keys[i] for i in todo], [views[i] for i in todo], sizes=True)
        for i, outcome in zip(todo, [got] * len(todo) if isinstance(got, _Failed) else got):
            codes[i] = int(outcome) if isinstance(outcome, int) else _logged(outcome)  # a size, or why not
        return codes

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """One object per key, made of its buffers' bytes in order (vLLM's connector saves a block's
        layers so)."""
        return self._put_views(keys, self._gathered(keys, all_buffer_ptrs, all_sizes), config, upsert=False)

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self.batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, config)

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Each object's bytes spread over its buffers in order; its size, or a negative code
        (INVALID_PARAMS when the buffers together cannot hold it)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        codes = [0] * len(keys)
        parts: list[list[np.ndarray]] = []
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes)):
            try:
                parts.append(self._many(ptrs, sizes))
            except InvalidParams as exc:
                parts.append([])  # not read: its code says why
                codes[i] = _logged(exc)
        todo = [i for i, c in enumerate(codes) if c == 0]
        got = self._gets([keys[i] for i in todo])
        for i, outcome in zip(todo, [got] * len(todo) if isinstance(got, _Failed) else got):
            if isinstance(outcome, int):
                codes[i] = outcome
            elif isinstance(outcome, StoreApiError):
                codes[i] = _logged(outcome)
            else:
                codes[i] = _scatter(outcome, parts[i])
        return codes

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        return self.batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node)

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """For each buffer, for each of its objects, copy ranges (source offset in the object, size) to
        destination offsets in the buffer; per range its size, or a negative code."""
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            _logged(InvalidParams("get_into_ranges: the lists of buffers, keys and ranges differ in length"))
            return [[[int(ErrorCode.INVALID_PARAMS)] for _ in keys] for keys in all_keys]
        out: list[list[list[int]]] = []
        names = sorted({k for keys in all_keys for k in keys})
        got = self._gets(names)
        objects = {} if isinstance(got, _Failed) else dict(zip(names, got))
        for b, ptr in enumerate(buffer_ptrs):
            per_key = []
            for k, key in enumerate(all_keys[b]):
                obj = objects.get(key, got if isinstance(got, _Failed) else ObjectNotFound(key))
                dsts, srcs, sizes = all_dst_offsets[b][k], all_src_offsets[b][k], all_sizes[b][k]
                if not len(dsts) == len(srcs) == len(sizes):  # ranges that do not line up: refused whole
                    per_key.append([int(ErrorCode.INVALID_PARAMS)] * max(len(dsts), len(srcs), len(sizes)))
                    continue
                per_key.append([self._copy_range(obj, ptr, dst, src, n) for dst, src, n in zip(dsts, srcs, sizes)])
            out.append(per_key)
        return out

    def _copy_range(self, obj, ptr: int, dst: int, src: int, n: int) -> int:
        if isinstance(obj, (int, StoreApiError)):
            return obj if isinstance(obj, int) else _logged(obj)
        if not all(_is_int(v) and v >= 0 for v in (dst, src, n)) or src + n > obj.size:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            view = self._memory(ptr + dst, n) if n else None
        except InvalidParams as exc:
            return _logged(exc)
        if view is not None:
            view[:] = obj[src : src + n]
        return n

    def _memory(self, ptr: int, size: int) -> np.ndarray:
        """The registered memory ``[ptr, ptr + size)`` as a uint8 array (no copy)."""
        if not _is_int(ptr) or not _is_int(size) or ptr <= 0 or size <= 0:
            raise InvalidParams(f"a buffer is a positive address and size, got {ptr!r}, {size!r}")
        with self._lock:
            i = bisect.bisect(self._buffers, (ptr, float("inf"))) - 1
            if i < 0 or ptr + size > self._buffers[i][1]:
                raise InvalidParams(f"{size} bytes at {ptr:#x} are not inside a registered buffer (register_buffer)")
            start = self._buffers[i][0]
            return self._views[start][ptr - start : ptr - start + size]  # a slice: no ctypes array per call

    def _many(self, ptrs: list[int], sizes: list[int]) -> list[np.ndarray]:
        if len(ptrs) != len(sizes) or not ptrs:
            raise InvalidParams(f"{len(ptrs)} buffers for {len(sizes)} sizes")
        return [self._memory(p, n) for p, n in zip(ptrs, sizes)]

    def _memories(self, keys, ptrs, sizes) -> tuple[list[np.ndarray | None], list[int]]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [None] * len(keys), [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views: list[np.ndarray | None] = []
        codes: list[int] = []
        for ptr, size in zip(ptrs, sizes):
            try:
                views.append(self._memory(ptr, size))
                codes.append(0)
            except InvalidParams as exc:
                views.append(None)
                codes.append(_logged(exc))
        return views, codes

    def _gathered(self, keys, all_ptrs, all_sizes) -> tuple[list[np.ndarray | None], list[int]]:
        if not len(keys) == len(all_ptrs) == len(all_sizes):
            return [None] * len(keys), [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views: list[np.ndarray | None] = []
        codes: list[int] = []
        for ptrs, sizes in zip(all_ptrs, all_sizes):
            try:
                parts = self._many(ptrs, sizes)
                views.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
                codes.append(0)
            except InvalidParams as exc:
                views.append(None)
                codes.append(_logged(exc))
        return views, codes

    # Plumbing -----------------------------------------------------------------------------------

    def _put(self, keys: list[str], values: list, config: ReplicateConfig | None, *, upsert: bool, whole: bool) -> int:
        """A put of Python values: every value checked first, and nothing stored if one is bad."""
        if len(keys) != len(values):
            return _logged(InvalidParams(f"{len(keys)} keys for {len(values)} values"))
        if not keys:
            return 0
        try:
            durability = _durability(config, upsert)
            if config is not None:
                config.check_groups(len(keys))
            views = [_value(v) for v in values]
            if self._local_buffer is not None and max(v.size for v in views) > self._local_buffer:
                log.warning(
                    "kvstore: a value of %d bytes is larger than this client's local_buffer_size (%d)",
                    max(v.size for v in views),
                    self._local_buffer,
                )
                return int(ErrorCode.BUFFER_OVERFLOW)
            for key, view in zip(keys, views):
                if not isinstance(key, str) or not key or not view.size:
                    raise InvalidParams(f"{key!r}: an object needs a non-empty str key and at least one byte")
        except InvalidParams as exc:
            return _logged(exc)
        got = self._puts(keys, views, upsert, durability)
        if isinstance(got, _Failed):
            return got
        return next((_logged(o) for o in got if o is not None), 0)

    def _put_joined(self, key: str, parts, config: ReplicateConfig | None, *, upsert: bool) -> int:
        try:
            views = [_value(p) for p in parts]
        except InvalidParams as exc:
            return _logged(exc)
        if not views:
            return 0  # Mooncake answers 0 for no parts and stores nothing
        return self._put(
            [key], [views[0] if len(views) == 1 else np.concatenate(views)], config, upsert=upsert, whole=True
        )

    def _put_views(
        self, keys: list[str], memories, config: ReplicateConfig | None, *, upsert: bool, groups: bool = True
    ) -> list[int]:
        """``groups``: ``keys`` are the caller's (one ``group_ids`` entry each); tensor shards are not."""
        views, codes = memories
        try:
            durability = _durability(config, upsert)
            if config is not None and groups:
                config.check_groups(len(keys))
        except InvalidParams as exc:
            return [_logged(exc)] * len(keys)
        todo = [i for i, c in enumerate(codes) if c == 0]
        got = self._puts([keys[i] for i in todo], [views[i] for i in todo], upsert, durability)
        for i, outcome in zip(todo, [got] * len(todo) if isinstance(got, _Failed) else got):
            codes[i] = int(outcome) if isinstance(outcome, _Failed) else (0 if outcome is None else _logged(outcome))
        return codes

    def _run(self, call):
        """``call(store)`` on the loop; its result, or ``_Failed`` with the negative code of what went
        wrong (logged)."""
        if self._clients is None:
            log.error("kvstore: call before setup (or after close)")
            return _Failed(ErrorCode.INVALID_PARAMS)
        try:
            return self._clients.run(call, self.TIMEOUT_S)
        except StoreApiError as exc:
            return _Failed(_logged(exc))
        except (TypeError, ValueError) as exc:  # a value that is no buffer, a key that is no str
            return _Failed(_logged(InvalidParams(str(exc))))
        except TimeoutError as exc:
            log.error("kvstore: %s", exc)
            return _Failed(ErrorCode.TRANSFER_FAIL)

    def _fast(self, plan, fast, slow, finish=merged):
        """A call through the calling thread's fast path first (``ThreadClients.fast``); its
        outcomes, or ``_Failed`` as ``_run``'s."""
        if self._clients is None:
            log.error("kvstore: call before setup (or after close)")
            return _Failed(ErrorCode.INVALID_PARAMS)
        try:
            return self._clients.fast(plan, fast, slow, finish, self.TIMEOUT_S)
        except StoreApiError as exc:
            return _Failed(_logged(exc))
        except (TypeError, ValueError) as exc:
            return _Failed(_logged(InvalidParams(str(exc))))
        except TimeoutError as exc:
            log.error("kvstore: %s", exc)
            return _Failed(ErrorCode.TRANSFER_FAIL)

    def _puts(self, keys: list[str], values: list, upsert: bool, durability: Durability):
        return self._fast(lambda s: s.plan_puts(keys, values, upsert, durability), FastPath.put, AsyncStore.put_items)

    def _gets(self, keys: list[str], buffers: list | None = None, sizes: bool = False):
        """Each object's bytes (its size instead, with ``sizes``), or why not."""
        got = self._fast(
            lambda s: s.plan_reads(keys, buffers if buffers is not None else [None] * len(keys)),
            FastPath.get,
            AsyncStore.get_items,
            finish_reads,
        )
        if sizes and not isinstance(got, _Failed):
            return [g.size if isinstance(g, np.ndarray) else g for g in got]
        return got

    def _describes(self, keys: list[str], lease: bool = True):
        return self._fast(lambda s: (*s.plan_names(keys), lease), FastPath.query, AsyncStore.query_items)

    def _exists(self, keys: list[str]):
        got = self._describes(keys)
        if isinstance(got, _Failed):
            return got
        return [False if isinstance(g, ObjectNotFound) else g if isinstance(g, StoreApiError) else True for g in got]

    def _removes(self, keys: list[str], force: bool):
        return self._fast(lambda s: (*s.plan_names(keys), force), FastPath.remove, AsyncStore.remove_items)

    def _code(self, call) -> int:
        got = self._run(call)
        return got if isinstance(got, _Failed) else 0

    # Mooncake's calls that have no meaning on tiercake ------------------------------------------

    def _not_supported(self, what: str) -> int:
        return _logged(NotSupported(f"{what}: tiercake's node agents own the memory and the placement"))

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = "") -> dict:
        self._not_supported("mount_segment")
        return {"error": int(ErrorCode.NOT_SUPPORTED)}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> dict:
        self._not_supported("allocate_and_mount_segment")
        return {"error": int(ErrorCode.NOT_SUPPORTED)}

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        return self._not_supported("unmount_segment")

    def unmount_and_free_segment(self, *args, **kwargs) -> int:
        return self._not_supported("unmount_and_free_segment")

    def unmount_local_disk_segment(self, *args, **kwargs) -> int:
        return self._not_supported("unmount_local_disk_segment")

    def alloc_from_mem_pool(self, size: int) -> int:
        self._not_supported("alloc_from_mem_pool")
        return 0  # Mooncake's null address: no memory was given

    def create_copy_task(self, key: str, targets: list[str]) -> tuple:
        return (0, 0), self._not_supported("create_copy_task (replicas follow the object's slot)")

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        return (0, 0), self._not_supported("create_move_task (an object's owner follows from its name)")

    def query_task(self, task_id) -> tuple:
        return None, self._not_supported("query_task")

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return [self._not_supported("batch_put_session_start (put_from writes in one round trip)")] * len(keys)

    def batch_put_session_end(self, keys: list[str], *args, **kwargs) -> list[int]:
        return [self._not_supported("batch_put_session_end")] * len(keys)

    def batch_put_session_revoke(self, keys: list[str], *args, **kwargs) -> list[int]:
        return [self._not_supported("batch_put_session_revoke")] * len(keys)

    def batch_get_session_start(self, keys: list[str], *args, **kwargs) -> list[int]:
        return [self._not_supported("batch_get_session_start (get_into reads in one round trip)")] * len(keys)

    def batch_get_session_end(self, keys: list[str], *args, **kwargs) -> list[int]:
        return [self._not_supported("batch_get_session_end")] * len(keys)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy client shares a real client's memory over IPC; a tiercake client needs no
        such parent: ``server_address`` is taken as the conductor's URL."""
        return self.setup("localhost", "", mem_pool_size, local_buffer_size, "tcp", "", server_address)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        return self._not_supported("init_all (setup connects and needs no segment)")

    def get_offload_rpc_read_count(self) -> int:
        return 0


MooncakeDistributedStore = DistributedStore


class MooncakeDistributedStoreAsync(DistributedStore):
    """Mooncake's asyncio flavour: every method ``m`` also as ``async_m``, run off the event loop."""

    def __getattr__(self, name: str):
        if not name.startswith("async_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        sync = getattr(self, name[len("async_") :], None)
        if sync is None or not callable(sync):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        async def call(*args, **kwargs):
            import asyncio
            import functools

            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(sync, *args, **kwargs))

        call.__name__ = name
        setattr(self, name, call)
        return call


# Helpers ----------------------------------------------------------------------------------------------


def _durability(config: ReplicateConfig | None, upsert: bool) -> Durability:
    if config is None:
        return Durability(keep_pin=upsert) if upsert else MEMORY
    if not isinstance(config, ReplicateConfig):
        raise InvalidParams(f"config is a ReplicateConfig, got {type(config).__name__}")
    durability = config.durability(upsert=upsert)
    if config.preserves_pin(upsert=upsert):
        durability = Durability(durability.replicas, durability.persist, durability.hard_pin, None, keep_pin=True)
    return durability


def _value(value) -> np.ndarray:
    """Mooncake's put takes any buffer (bytes, bytearray, memoryview, numpy arrays, tensors)."""
    return readable(value)


def _scatter(data: np.ndarray, parts: list[np.ndarray]) -> int:
    if data.size > sum(p.size for p in parts):
        return _logged(InvalidParams(f"the object is {data.size} bytes, the buffers hold {sum(p.size for p in parts)}"))
    at = 0
    for part in parts:
        n = min(part.size, data.size - at)
        part[:n] = data[at : at + n]
        at += n
    return int(data.size)


def _descriptors(described: Described, members: dict) -> list[ReplicaDescriptor]:
    out = []
    for node in described.holders:
        host, port = members.get(node, ("", 0))
        out.append(
            ReplicaDescriptor(memory=MemoryDescriptor(Descriptor(described.size, 0, f"{host}:{port}")), node=node)
        )
        if described.persist:
            out.append(ReplicaDescriptor(disk=DiskDescriptor(f"{node}:ssd", described.size), node=node))
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logged(exc: StoreApiError) -> int:
    log.warning("kvstore: %s", exc)
    return code_of(exc)
