"""``DistributedStore``: Mooncake Store's ``MooncakeDistributedStore``, method for method, over tiercake.

Code written for Mooncake runs by changing its import and its ``setup`` call:

    from mooncake.store import MooncakeDistributedStore          from tiercake.kvstore import DistributedStore
    store.setup("host", "P2PHANDSHAKE", seg, buf, "tcp", "",       store.setup("http://conductor:8081",
                "master:50051")                                                secret=..., token=...)

Every call blocks the caller (an event loop runs on a thread of its own underneath) and answers as
Mooncake's does: 0 or a size on success, a negative ``ErrorCode`` otherwise; ``get`` answers ``b""``
for a missing object, ``is_exist`` 1, 0 or -1. Buffers are raw addresses, as in Mooncake: ``put_from``,
``get_into`` and their batches take only memory inside a ``register_buffer``ed range (checked, so a
wrong address is an error, never a crash), and move the bytes in place. Mooncake's TCP transport
takes unregistered memory too; tiercake refuses it (INVALID_PARAMS), since it cannot tell a valid
address from a wild one.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercake.loop_thread import LoopThread

from .aio import AsyncStore
from .errors import ErrorCode, InvalidParams, StoreApiError, code_of

log = logging.getLogger(__name__)


@dataclass
class ReplicateConfig:
    """Accepted where Mooncake takes one. tiercake's conductor decides the replicas (its replication
    policy) and the nodes (its placement strategy), so the fields are read but not obeyed."""

    replica_num: int = 1
    with_soft_pin: bool = False
    preferred_segment: str = ""


class DistributedStore:
    TIMEOUT_S = 120.0  # the longest any one call may block

    def __init__(self) -> None:
        self._loop: LoopThread | None = None
        self._store: AsyncStore | None = None
        self._buffers: list[tuple[int, int]] = []  # registered (start, end), sorted
        self._lock = threading.Lock()

    # Setup --------------------------------------------------------------------------------------

    def setup(self, conductor: str | Sequence[str] | None = None, *, config: str | None = None,
              secret: str | bytes | None = None, token: str | None = None, tenant: str = "default",
              tier: str = "pool", transports: Sequence[str] = ("shm", "tcp"), connect_timeout: float = 30.0) -> int:
        """Connect to a tiercake cluster: its conductor URL(s), the cluster's transfer ``secret`` and
        control ``token`` (default: ``$TIERCAKE_SECRET`` and ``$TIERCAKE_TOKEN``), or a tiercake
        config file (``config``) that names all three. 0, or a negative code (logged) on failure (RPC_FAIL
        when no conductor answered within ``connect_timeout`` seconds)."""
        if self._store is not None:
            log.error("kvstore: setup called twice")
            return int(ErrorCode.INVALID_PARAMS)
        ssl = transfer_tls = None
        if config is not None:
            from tiercake.config import load_config, with_environment

            try:
                cfg = with_environment(load_config(config))
                conductor = conductor or cfg.conductor.urls
                tokens = cfg.conductor.tokens()
                token = token or (tokens[0] if tokens else None)
                secret = secret or cfg.transfer.secret()
                ssl = cfg.tls.client_context()
                transfer_tls = cfg.transfer_tls_client()
            except (OSError, ValueError) as exc:  # no such file, an invalid config, no secret
                log.error("kvstore: setup: config %s: %s", config, exc)
                return int(ErrorCode.INVALID_PARAMS)
        secret = secret or os.environ.get("TIERCAKE_SECRET")
        token = token or os.environ.get("TIERCAKE_TOKEN") or None
        if not conductor or not secret:
            log.error("kvstore: setup needs the conductor URL(s) and the cluster secret ($TIERCAKE_SECRET)")
            return int(ErrorCode.INVALID_PARAMS)
        self._loop = LoopThread("tiercake-kvstore")

        async def connect() -> AsyncStore:
            store = AsyncStore(conductor, secret=secret, token=token, tenant=tenant, tier=tier,
                               transports=transports, ssl=ssl, transfer_tls=transfer_tls)
            try:
                return await store.open()
            except BaseException:
                await store.close()
                raise

        try:
            self._store = self._loop.call(connect(), connect_timeout)
        except (StoreApiError, ValueError, TimeoutError) as exc:
            log.error("kvstore: setup failed: %s", exc)
            self._loop.stop()
            self._loop = None
            if isinstance(exc, TimeoutError):
                return int(ErrorCode.RPC_FAIL)
            return code_of(exc) if isinstance(exc, StoreApiError) else int(ErrorCode.INVALID_PARAMS)
        return 0

    def close(self) -> int:
        if self._store is not None:
            try:
                self._loop.call(self._store.close(), self.TIMEOUT_S)
            finally:
                self._loop.stop()
                self._store, self._loop = None, None
        return 0

    # Calls --------------------------------------------------------------------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._code(lambda s: s.put(key, _readable(value)))

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        return self._code(lambda s: s.put(key, _readable(value), replace=True))

    def put_batch(self, keys: list[str], values: list, config: ReplicateConfig | None = None) -> int:
        """0 if every value was stored, else the first failure's code."""
        outcomes = self._run(lambda s: s.put_many(keys, [_readable(v) for v in values]))
        if isinstance(outcomes, _Failed):
            return outcomes
        return next((code_of(o) for o in outcomes if o is not None), 0)

    def get(self, key: str) -> bytes:
        got = self._run(lambda s: s.get(key))
        return got if isinstance(got, bytes) else b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        got = self._run(lambda s: s.get_many(keys))
        if isinstance(got, _Failed):
            return [b""] * len(keys)
        return [b"" if isinstance(g, StoreApiError) else bytes(g.numpy()) for g in got]

    def get_size(self, key: str) -> int:
        return self._run(lambda s: s.get_size(key))

    def is_exist(self, key: str) -> int:
        got = self._run(lambda s: s.exists(key))
        return -1 if isinstance(got, _Failed) else int(got)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        got = self._run(lambda s: s.exists_many(keys))
        return [-1] * len(keys) if isinstance(got, _Failed) else [int(g) for g in got]

    def remove(self, key: str, force: bool = False) -> int:
        return self._code(lambda s: s.remove(key, force=force))

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        got = self._run(lambda s: s.remove_many(keys, force=force))
        return [got] * len(keys) if isinstance(got, _Failed) else [0 if o is None else code_of(o) for o in got]

    def remove_all(self, force: bool = False) -> int:
        return self._run(lambda s: s.remove_all(force=force))

    # Registered memory --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        with self._lock:
            start, end = buffer_ptr, buffer_ptr + size
            i = bisect.bisect(self._buffers, (start, end))
            overlaps = (i > 0 and self._buffers[i - 1][1] > start) or (i < len(self._buffers) and self._buffers[i][0] < end)
            if overlaps:
                log.error("kvstore: buffer at %#x (%d bytes) overlaps a registered one", buffer_ptr, size)
                return int(ErrorCode.INVALID_PARAMS)
            self._buffers.insert(i, (start, end))
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            for i, (start, _) in enumerate(self._buffers):
                if start == buffer_ptr:
                    del self._buffers[i]
                    return 0
        return int(ErrorCode.INVALID_PARAMS)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        try:
            view = self._memory(buffer_ptr, size)
        except InvalidParams as exc:
            return _logged(exc)
        return self._code(lambda s: s.put(key, view))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """The object's size once it is in the buffer, or a negative code."""
        try:
            view = self._memory(buffer_ptr, size)
        except InvalidParams as exc:
            return _logged(exc)
        return self._run(lambda s: s.get_into(key, view))

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        views, codes = self._memories(keys, buffer_ptrs, sizes)
        todo = [i for i, c in enumerate(codes) if c == 0]
        got = self._run(lambda s: s.put_many([keys[i] for i in todo], [views[i] for i in todo]))
        for i, outcome in zip(todo, [got] * len(todo) if isinstance(got, _Failed) else got):
            codes[i] = int(outcome) if isinstance(outcome, _Failed) else (0 if outcome is None else code_of(outcome))
        return codes

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        views, codes = self._memories(keys, buffer_ptrs, sizes)
        todo = [i for i, c in enumerate(codes) if c == 0]
        got = self._run(lambda s: s.get_many_into([keys[i] for i in todo], [views[i] for i in todo]))
        for i, outcome in zip(todo, [got] * len(todo) if isinstance(got, _Failed) else got):
            codes[i] = int(outcome) if isinstance(outcome, int) else code_of(outcome)  # a size, or why not
        return codes

    def _memory(self, ptr: int, size: int) -> torch.Tensor:
        """The registered memory ``[ptr, ptr + size)`` as a uint8 tensor (no copy)."""
        if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
            raise InvalidParams(f"a buffer is a positive address and size, got {ptr!r}, {size!r}")
        with self._lock:
            i = bisect.bisect(self._buffers, (ptr, float("inf"))) - 1
            if i < 0 or ptr + size > self._buffers[i][1]:
                raise InvalidParams(f"{size} bytes at {ptr:#x} are not inside a registered buffer (register_buffer)")
        return torch.frombuffer((ctypes.c_ubyte * size).from_address(ptr), dtype=torch.uint8)

    def _memories(self, keys, ptrs, sizes) -> tuple[list[torch.Tensor | None], list[int]]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [], [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views: list[torch.Tensor | None] = []
        codes: list[int] = []
        for ptr, size in zip(ptrs, sizes):
            try:
                views.append(self._memory(ptr, size))
                codes.append(0)
            except InvalidParams as exc:
                views.append(None)
                codes.append(_logged(exc))
        return views, codes

    # Plumbing -----------------------------------------------------------------------------------

    def _run(self, call):
        """``call(store)`` on the loop; its result, or ``_Failed`` with the negative code of what went
        wrong (logged)."""
        if self._store is None:
            log.error("kvstore: call before setup (or after close)")
            return _Failed(ErrorCode.INVALID_PARAMS)
        try:
            return self._loop.call(call(self._store), self.TIMEOUT_S)
        except StoreApiError as exc:
            return _Failed(_logged(exc))
        except (TypeError, ValueError) as exc:  # a value that is no buffer, a key that is no str
            return _Failed(_logged(InvalidParams(str(exc))))
        except TimeoutError as exc:
            log.error("kvstore: %s", exc)
            return _Failed(ErrorCode.TRANSFER_FAIL)

    def _code(self, call) -> int:
        got = self._run(call)
        return got if isinstance(got, _Failed) else 0


class _Failed(int):
    """A call's negative code, told apart from a result that is an int (a size, a count, a bool)."""


def _readable(value):
    """Mooncake's put takes any buffer (bytes, bytearray, memoryview, numpy arrays)."""
    return value if isinstance(value, torch.Tensor) else memoryview(value)


def _logged(exc: StoreApiError) -> int:
    log.warning("kvstore: %s", exc)
    return code_of(exc)
