"""Membership: every conductor follows the member keys through a watch. A member that misses its
keep-alives for its TTL vanishes (the leader deletes its key, ``liveness.py``, and its placements
go with it); one that comes back registers again and is told to re-report what it still holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from tiercake.messages import MemberInfo

from .metadata import LeaseNotFoundError, MetadataBackend, MetadataUnavailableError, WatchEvent, follow

log = logging.getLogger(__name__)

MEMBERS = b"/tiercake/members/"

__all__ = ["MEMBERS", "MemberInfo", "Membership", "Registration"]


class Registration:
    """Keeps one member registered straight in the backend under an etcd lease of its own, renewed
    every third of the TTL: how members registered before liveness moved into the leader's memory
    (a conductor of the previous release still registers them so), and what the membership tests
    stand members up with."""

    def __init__(
        self,
        meta: MetadataBackend,
        info: MemberInfo,
        ttl: int = 5,
        *,
        prefix: bytes = MEMBERS,
        on_register: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.meta = meta
        self.info = info
        self.ttl = ttl
        self.key = prefix + info.node_id.encode()
        self.on_register = on_register  # called with the new lease after every (re-)registration
        self.lease = 0
        self.registrations = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> Registration:
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._keep_alive())
        return self

    async def _register(self) -> None:
        self.lease = await self.meta.grant_lease(self.ttl)
        self.info = self.info.model_copy(update={"lease": self.lease})
        await self.meta.put(self.key, self.info.model_dump_json().encode(), lease=self.lease)
        self.registrations += 1
        if self.on_register is not None:
            await self.on_register(self.lease)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(max(self.ttl / 3, 0.2))
            try:
                await self.meta.refresh_lease(self.lease)
            except LeaseNotFoundError:
                log.warning("member %s: lease expired; registering again", self.info.node_id)
                with contextlib.suppress(MetadataUnavailableError):
                    await self._register()
            except MetadataUnavailableError as exc:
                log.warning("member %s: keep-alive failed (%s); retrying", self.info.node_id, exc)

    def crash(self) -> None:
        """Stop keeping the lease alive without revoking it, as a killed process would."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        """Leave cleanly: the lease is revoked and the member (and its placements) go at once."""
        self.crash()
        with contextlib.suppress(MetadataUnavailableError):
            await self.meta.revoke_lease(self.lease)


class Membership:
    """The conductor's view of live members, kept current by a watch."""

    def __init__(self, meta: MetadataBackend, prefix: bytes = MEMBERS) -> None:
        self.meta = meta
        self.prefix = prefix
        self.members: dict[str, MemberInfo] = {}
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.version = 0  # bumped on every change seen
        self.leave_listeners: list[Callable[[str], None]] = []  # each told of every member whose record went

    async def start(self) -> Membership:
        kvs, revision = await self.meta.range(self.prefix)
        for kv in kvs:
            info = MemberInfo.model_validate_json(kv.value)
            self.members[info.node_id] = info
        self._task = asyncio.get_running_loop().create_task(
            follow(self.meta, self.prefix, revision + 1, self._apply, "membership", present=[kv.key for kv in kvs])
        )
        return self

    def _apply(self, event: WatchEvent) -> None:
        node = event.key[len(self.prefix) :].decode()
        if event.kind == "put":
            self.members[node] = MemberInfo.model_validate_json(event.value)
        else:
            self.members.pop(node, None)
            for listener in self.leave_listeners:
                listener(node)
        self.version += 1
        self._changed.set()  # wakes every waiter; later waiters wait on a fresh event
        self._changed = asyncio.Event()

    def alive(self, role: str | None = None) -> list[MemberInfo]:
        return [m for m in self.members.values() if role is None or m.role == role]

    async def wait_for(self, predicate: Callable[[Membership], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
