"""The primary's copy of a slot to a backup that joins (workers/node/objects/replication.py), against
a table whose contents and writes in flight the test sets: which objects a copy takes."""

import asyncio
from dataclasses import dataclass, field

from tiercake.tiers.objects import Meta
from tiercake.workers.node.objects.ownership import Ownership
from tiercake.workers.node.objects.replication import Replicator


@dataclass
class _Stored:
    oid: bytes
    meta: Meta
    size: int = 100


@dataclass
class _Table:
    """The part of ``ObjectTable`` a copy's listing reads: its objects and the writes under way."""

    objects: dict[bytes, _Stored] = field(default_factory=dict)
    in_flight: list[bytes] = field(default_factory=list)

    def __iter__(self):
        return iter(list(self.objects.values()))

    def writing(self) -> list[bytes]:
        return list(self.in_flight)

    def get(self, oid: bytes):
        return self.objects.get(oid)


async def test_a_copy_takes_the_objects_a_write_is_under_way_for():
    """A write that chose its backups before the new one was added, and makes a new object, installs
    it only after the copy listed the slot: it was neither sent to the new backup nor copied. The
    copy now lists the objects with writes under way too (taken under their locks, after the write)."""
    table = _Table()
    table.objects[b"kept"] = _Stored(b"kept", Meta(replicas=2))
    table.objects[b"memory-level"] = _Stored(b"memory-level", Meta(replicas=1))
    table.in_flight = [b"new", b"kept"]  # a put of a new object, and an upsert of one already there
    replicator = Replicator("primary", table, Ownership("primary", None, ttl=5), channels=None, client=None)
    copied: list[bytes] = []

    async def copy_batch(slot, backup, oids, replicated=True):
        copied.extend(oids)

    replicator._copy_batch = copy_batch
    await replicator._copy_objects(0, "joining", replicated=True)
    assert sorted(copied) == [b"kept", b"new"]  # each once; the memory-level one is not a backup's
    copied.clear()
    await replicator._copy_objects(0, "target", replicated=False)  # a handoff's copy: the same rule
    assert sorted(copied) == [b"kept", b"memory-level", b"new"]  # (its batch skips what is replicated)
    await asyncio.sleep(0)
