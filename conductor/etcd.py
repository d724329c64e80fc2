"""The etcd metadata backend, through the asyncio etcd v3 client ``etcd3aio``.

Chosen for its watch, which resumes from the last revision it delivered after etcd restarts or a
member fails over; ``aetcd``'s watch dies on restart, and ``etcd3`` and ``etcetra`` do not work with
current grpcio/protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar, cast

import grpc
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError
from etcd3aio.client import Etcd3Client
from etcd3aio.connections import ConnectionManager
from etcd3aio.kv import KVService

from tiercake.started import started

from .metadata import (
    TXN_OPS,
    CompactedError,
    Delete,
    FencedError,
    Guards,
    KeyValue,
    LeaseNotFoundError,
    MetadataBackend,
    MetadataError,
    MetadataUnavailableError,
    Put,
    WatchEvent,
    chunks,
    guards,
    prefix_end,
)

T = TypeVar("T")
S = TypeVar("S")


def _started(service: S | None) -> S:
    """One of the client's services (None until it connects)."""
    return started(service, "the etcd backend", MetadataError)


KEEPALIVE_MS = 1000  # a gRPC ping each second, a connection dead after a second unanswered: a member cut
# off (its packets black-holed, no reset ever comes) is left by round robin within about two seconds,
# where the library's 10 s + a minute outlived every lease. etcd must allow it: --grpc-keepalive-min-time
# at most 1s (etcd_process.py sets 500ms; an operator's etcd needs the same, docs/DEPLOY.md)
ATTEMPT_S = 1.0  # one try of an idempotent call; the next goes to another member (round robin)


class EtcdBackend(MetadataBackend):
    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0, attempts: int = 2) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint (host:port) is needed")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.attempts = attempts
        self._client: Etcd3Client | None = None

    async def start(self) -> EtcdBackend:
        self._client = Etcd3Client(self.endpoints, rpc_max_attempts=self.attempts)
        # the client makes its channel with fixed keepalives; its manager is the one place to set them
        manager = ConnectionManager(self.endpoints, keepalive_time_ms=KEEPALIVE_MS, keepalive_timeout_ms=KEEPALIVE_MS)
        # pings go on while a call waits for its answer (gRPC's defaults stop after two without data),
        # only while a call is open (etcd answers pings on an idle connection with a GOAWAY), and an
        # unanswered one ends the connection after KEEPALIVE_MS (gRPC's own ping timeout: a minute)
        options = dict(manager.grpc_options)
        options.update(
            {
                "grpc.http2.max_pings_without_data": 0,
                "grpc.http2.min_time_between_pings_ms": KEEPALIVE_MS,
                "grpc.keepalive_permit_without_calls": 0,
                "grpc.http2.ping_timeout_ms": KEEPALIVE_MS,
            }
        )
        manager.grpc_options = list(options.items())
        self._client._manager = manager
        await self._call(self._client.connect)
        return self

    def detached(self) -> EtcdBackend:
        return EtcdBackend(self.endpoints, timeout=self.timeout, attempts=self.attempts)

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None

    @property
    def client(self) -> Etcd3Client:
        return started(self._client, "the etcd backend", MetadataError)

    async def _call(self, fn: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except (EtcdConnectionError, EtcdTransientError, TimeoutError) as exc:
            raise MetadataUnavailableError(f"etcd at {', '.join(self.endpoints)} is unavailable: {exc!r}") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MetadataUnavailableError(f"etcd is unavailable: {exc.details()}") from exc
            if exc.code() is grpc.StatusCode.NOT_FOUND and "lease" in (exc.details() or ""):
                raise LeaseNotFoundError(exc.details()) from exc
            raise MetadataError(f"etcd refused: {exc.code().name}: {exc.details()}") from exc
        except EtcdError as exc:
            raise MetadataError(str(exc)) from exc

    async def _idempotent(self, fn: Callable[..., Awaitable[T]], *args, **kwargs) -> T:
        """A call that may be repeated (a read, a lease's refresh), tried ``ATTEMPT_S`` at a time until
        ``timeout``: a try that went to a member cut off (the channel does not know it yet) costs a
        second, not the whole timeout, and the next try goes to another member."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(min(ATTEMPT_S, max(left, 0.01))):
                    return await self._call(fn, *args, **kwargs)
            except (TimeoutError, MetadataUnavailableError) as exc:
                if asyncio.get_running_loop().time() + 0.05 >= deadline:
                    if isinstance(exc, MetadataUnavailableError):
                        raise
                    raise MetadataUnavailableError(
                        f"etcd at {', '.join(self.endpoints)} did not answer within {self.timeout} s"
                    ) from exc
                await asyncio.sleep(0.05)

    # Reads ----------------------------------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._idempotent(_started(self.client.kv).get, key, timeout=ATTEMPT_S)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        # may take seconds for a big prefix: one try, bounded by the channel's keepalive
        resp = await self._call(_started(self.client.kv).get, prefix, prefix_end(prefix), timeout=self.timeout)
        return sorted((_kv(kv) for kv in resp.kvs), key=lambda kv: kv.key), resp.header.revision

    # Writes ---------------------------------------------------------------------------------------

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._call(_started(self.client.kv).put, key, value, lease, timeout=self.timeout)
        self.writes += 1
        return resp.header.revision

    async def delete(self, key: bytes) -> bool:
        resp = await self._call(_started(self.client.kv).delete, key, timeout=self.timeout)
        self.writes += 1
        return resp.deleted > 0

    async def commit(self, ops: Sequence[Put | Delete], concurrency: int = 1, guard: Guards = None) -> int:
        gate = asyncio.Semaphore(max(1, concurrency))
        compare = [KVService.txn_compare_value(g.key, g.value) for g in guards(guard)]
        fence = ", ".join(g.key.decode(errors="replace") for g in guards(guard))

        async def one(chunk: Sequence[Put | Delete]) -> int:
            requests = [
                KVService.txn_op_put(op.key, op.value, lease=op.lease)
                if isinstance(op, Put)
                else KVService.txn_op_delete(op.key)
                for op in chunk
            ]
            async with gate:
                resp = await self._call(_started(self.client.kv).txn, compare, requests, timeout=self.timeout)
            if not resp.succeeded:
                raise FencedError(
                    f"refused: {fence}: not what this writer expects (a new leader was elected, or the record changed)"
                )
            self.writes += len(chunk)
            return resp.header.revision

        parts = chunks(ops, TXN_OPS)
        if concurrency <= 1:
            revision = 0
            for chunk in parts:
                revision = await one(chunk)
            return revision
        return max(await asyncio.gather(*(one(chunk) for chunk in parts)), default=0)

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        absent = KVService.txn_compare_create_revision(key, 0)
        resp = await self._call(
            _started(self.client.kv).txn,
            [absent],
            [KVService.txn_op_put(key, value, lease=lease)],
            timeout=self.timeout,
        )
        self.writes += bool(resp.succeeded)
        return bool(resp.succeeded)

    # Leases ---------------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        if ttl < 1:
            raise ValueError("a lease TTL is at least 1 second")
        resp = await self._call(_started(self.client.lease).grant, ttl, timeout=self.timeout)
        return resp.ID

    async def refresh_lease(self, lease: int) -> int:
        """One renewal, on a keep-alive stream of its own. One long-lived stream for every renewal
        cost 30% less CPU, but etcd answers a stream's renewals one after another, and a write
        cancelled by a timeout under load could leave a stream that took no more: members' keep-
        alives then waited past their leases, and each lapse brought a full re-report. Renewals sent
        in batches on one stream each (a group commit) cost 120 us of CPU a renewal instead of 585,
        but under load a batch's answers, one loop turn each, outran the attempt's second: at 1,000
        nodes beside two busy processes no renewal got through (bench fleet), where one stream each
        held at 128k placements/s."""

        async def once() -> int:
            stream = _started(self.client.lease).keep_alive(lease)
            try:
                async for resp in stream:
                    return resp.TTL
                return 0
            finally:
                stream.cancel()

        ttl = await self._idempotent(once)
        if ttl <= 0:
            raise LeaseNotFoundError(f"lease {lease:x} expired or was revoked")
        return ttl

    async def revoke_lease(self, lease: int) -> None:
        with contextlib.suppress(LeaseNotFoundError):
            await self._call(_started(self.client.lease).revoke, lease, timeout=self.timeout)

    # Watches --------------------------------------------------------------------------------------

    async def watch(self, prefix: bytes, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        service = _started(self.client.watch)
        # etcd3aio reconnects a watch cut by a transient error itself, from the last answer's header
        # revision + 1: past events etcd had not sent yet (a watch's creation answer, and a catching-up
        # watcher's batches, carry the store's revision ahead of their events), so a member put as a
        # partition began was never seen by a conductor's view. Here the error ends the watch instead
        # (MetadataUnavailableError), and ``metadata.follow`` resumes after the last event it applied.
        setattr(service, "_is_transient_error", _never_resumed)  # noqa: B010 - the library's own hook
        # an async generator, though the library declares an iterator: closed below, ending the watch
        stream = cast(
            AsyncGenerator[Any, None], service.watch(prefix, prefix_end(prefix), start_revision=start_revision)
        )
        try:
            async for resp in stream:
                if resp.compact_revision > 0 and start_revision and start_revision < resp.compact_revision:
                    raise CompactedError(f"revision {start_revision} was compacted (now {resp.compact_revision})")
                for ev in resp.events:
                    kind: Literal["put", "delete"] = "delete" if ev.type == 1 else "put"
                    yield WatchEvent(kind, ev.kv.key, ev.kv.value if kind == "put" else b"", ev.kv.mod_revision)
        except grpc.aio.AioRpcError as exc:
            raise MetadataUnavailableError(f"etcd watch failed: {exc.details()}") from exc
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()


def _never_resumed(exc: grpc.aio.AioRpcError) -> bool:
    """No watch error is one the library may resume from itself (``EtcdBackend.watch``)."""
    return False


def _kv(kv) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.lease, kv.mod_revision)
