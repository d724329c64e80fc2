"""What a key-value store client on the same host as a node agent reads in place: the node's pool
and its directory of objects, mapped read-only here, and the reads it made from the directory with
no round trip, noted for the node (Mooncake's read leases: it is told ahead of the next request to
it, so a remove after those reads finds their leases). One owner, ``AsyncStore``; its blocking path
(``fast.py``) reads through the same object."""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from tiercake.tiers.directory import DirectoryReader
from tiercake.tiers.pool import PoolFormatError, PoolRegion
from tiercake.transfer import object_wire as w
from tiercake.transfer.connection import Channels
from tiercake.transfer.protocol import TransferError, boot_id

from .errors import RpcFailed

log = logging.getLogger(__name__)

NOTES_MAX = 256  # reads from a node's directory it is told of at once (their leases)


class SameHost:
    def __init__(self, tenant: str, enabled: bool) -> None:
        """``enabled``: the store may map nodes' pools (same host, no TLS, the cluster's credential)."""
        self.tenant = tenant
        self.enabled = enabled
        self.pools: dict[str, PoolRegion | None] = {}  # node -> its pool, mapped here (None: not same host)
        self._directories: dict[str, DirectoryReader] = {}  # node -> its object directory, mapped here
        self._notes: dict[str, list[tuple[bytes, float]]] = defaultdict(list)  # node -> (name, when) read

    async def pool(self, node: str, channels: Channels) -> PoolRegion | None:
        """``node``'s pool, mapped here once (None: not on this host, or not to be mapped)."""
        if not self.enabled:
            return None
        if node in self.pools:
            return self.pools[node]
        region = None
        try:
            info = await (await channels.get(node)).peer_info()
            if info.pool_path and info.boot_id == boot_id():
                region = PoolRegion.attach(info.pool_path)
                if region.instance != info.pool_id:  # a pool at the path, not the node's (yet)
                    region.close(unlink=False)
                    region = None
                elif info.objects_path:
                    data = region.array[region.data_offset :]
                    self._directories[node] = DirectoryReader(info.objects_path, data, bytes.fromhex(region.instance))
        except (TransferError, OSError, PoolFormatError, RpcFailed) as exc:
            log.info("kvstore: %s's pool cannot be mapped here (%s): the stream carries its bytes", node, exc)
            region = None
        self.pools[node] = region
        return region

    def mapped(self, node: str) -> bool:
        """Whether this store has looked for ``node``'s pool (mapped or not)."""
        return node in self.pools

    def directory(self, node: str) -> DirectoryReader | None:
        """``node``'s directory, while it is valid (the node's lease surely alive); one gone stale (the
        node restarted on a new directory or pool) is dropped with the pool mapped beside it, so that
        the next request asks the node where they are now."""
        reader = self._directories.get(node)
        if reader is None:
            return None
        if reader.stale():
            self.drop(node)
            return None
        return reader if reader.valid() else None

    def drop(self, node: str) -> None:
        """Forget ``node``'s pool and directory (it restarted elsewhere, or with a new pool)."""
        reader = self._directories.pop(node, None)
        if reader is not None:
            reader.close()
        region = self.pools.pop(node, None)
        if region is not None:
            region.close(unlink=False)

    def close(self) -> None:
        for node in list(self.pools):
            self.drop(node)

    def note_reads(self, node: str, names: list[bytes]) -> bool:
        """Note reads from ``node``'s directory (their leases, from now); True when it is time to tell it."""
        notes = self._notes[node]
        now = time.monotonic()
        notes.extend((name, now) for name in names)
        return len(notes) >= NOTES_MAX

    def take_note(self, node: str, epoch: int) -> bytes | None:
        """What to tell ``node`` of the reads noted (None: nothing): the names and how long ago each
        was read, so that its leases run from the reads, not from the note."""
        notes = self._notes.pop(node, None)
        if not notes:
            return None
        now = time.monotonic()
        ages = [int((now - when) * 1e3) for _, when in notes]
        return w.encode(w.QueryRequest(self.tenant, epoch, [n for n, _ in notes], True, ages))
