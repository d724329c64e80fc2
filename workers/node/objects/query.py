"""A query (what the store holds of some names: Mooncake's ``is_exist`` and ``get_replica_desc``), and
a same-host reader's note of what it read through the directory, which grants the read leases those
reads began (``QueryRequest.lease``, with each read's age). It waits for nothing: both doors answer
it with this one function."""

from __future__ import annotations

from tiercake.blocks import object_id
from tiercake.tiers.objects import ObjectTable
from tiercake.transfer import object_wire as w
from tiercake.transfer.protocol import Status

from .ownership import Ownership
from .replication import Replicator

MAX_AGE_MS = 60_000  # a read older than this is noted as this old (its read lease has run out anyway)


def query(
    node_id: str, table: ObjectTable, ownership: Ownership, replicator: Replicator, req: w.QueryRequest
) -> w.QueryReply:
    items = []
    ages = req.ages_ms if len(req.ages_ms) == len(req.names) else None
    for i, name in enumerate(req.names):
        if not name:
            items.append(w.Described(Status.INVALID, message="an object needs a name"))
            continue
        oid = object_id(name, req.tenant)
        refused = ownership.refusal(oid, req.epoch)
        if refused is not None:
            items.append(w.Described(refused.status, message=refused.message))
            continue
        stored = table.get(oid)
        if stored is None:
            items.append(w.Described(Status.NOT_FOUND))
            continue
        if req.lease:  # from when it was read (a note comes after the reads it tells of)
            table.lease(stored, 0.0 if ages is None else min(max(ages[i], 0), MAX_AGE_MS) / 1e3)
        slot = ownership.slot_of(oid)
        backups = sorted(replicator.forward_to.get(slot, ())) if stored.meta.replicas > 1 else []
        meta = stored.meta
        items.append(
            w.Described(Status.OK, stored.size, stored.version, meta.replicas, meta.persist, [node_id, *backups])
        )
    return w.QueryReply(ownership.map.epoch, items)
