"""Member liveness in the leader's memory: a keep-alive is a timestamp, not an etcd lease renewal.

Every member registered through a conductor holds its record (``MEMBERS``) and a liveness record
(``LIVENESS``: its registration's id and TTL) under one etcd lease shared by all of them, the
*backstop*, which the leader renews every ``BACKSTOP_TTL / 6`` s whatever the fleet's size. A
keep-alive reaches the leader and sets the member's last-seen time; the leader deletes the records
of members silent for their TTL, fenced by its own election key and by the liveness record of the
registration it expires (a delete applied late, after an etcd election, once took the records of
the member's next registration). Before this, each keep-alive
renewed the member's own etcd lease: a gRPC stream of about a millisecond of the conductor's CPU, 55%
of the conductors' CPU at 1,000 members (docs/SCALE.md). Mooncake's master, too, keeps its clients'
heartbeats in memory.

What keeps it safe (a node serves objects only while its lease is *surely* alive: the last
keep-alive acknowledged was sent less than its TTL ago, ``workers/node/objects/ownership.py``):

- the leader deletes a member no sooner than its TTL after the last keep-alive it received, and it
  received it after the member sent it;
- a new leader counts every member as seen when its term begins, so it deletes none before its
  TTL has run from then;
- a follower vouches for a member (answers its keep-alive itself) only when the backend names no
  leader: whichever conductor wins next starts its term, and its members' clocks, after that read;
- while a leader is named, a follower *relays* a keep-alive that reached it (a member cut off from
  the leader but not from the follower: the two conductors split, or one way only): it writes
  ``RELAYED`` for the member, guarded by the member's liveness record being the registration the
  member names, and answers once that write is in; the leader watches ``RELAYED`` and counts the
  member as seen when the write reaches it, after the member sent it. A relay that lands between
  a sweep's verdict and its delete is answered still: that member serves until its TTL (less a
  margin) from its send, and its slots move only its TTL (or ``objects.failover_s``, if longer)
  after the delete (``ttl_of``, which the object map's keeper asks). Before the relay, a partition between
  the conductors expired every member on the follower's side, which the leader no longer heard,
  and moved its slots while clients still reached it;
- the backstop outlives every member's TTL by a refresh period and more (``MAX_MEMBER_TTL``): a
  leader that dies leaves the records in place for the next one, and only a control plane with no
  leader for ``BACKSTOP_TTL`` lets them all go.

Records of members that hold a lease of their own (registered straight into the backend, or by a
conductor of the release before) are not the leader's to expire: their lease does that. A
keep-alive for one reaches a leader that does not know its id and is told to register again, so an
upgraded control plane moves every member onto the backstop within a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from tiercake.messages import MAX_MEMBER_TTL, MemberInfo

from .membership import MEMBERS, Membership
from .metadata import (
    Delete,
    FencedError,
    Guard,
    LeaseNotFoundError,
    MetadataBackend,
    MetadataUnavailableError,
    Put,
    WatchEvent,
    follow,
)

log = logging.getLogger(__name__)

LIVENESS = b"/tiercake/liveness/"  # node -> {"lease": its registration's id, "ttl": seconds}
RELAYED = b"/tiercake/liveness-relayed/"  # node -> the registration a follower relayed a keep-alive for
BACKSTOP = b"/tiercake/liveness-lease"  # the backstop lease's id, written by the leader
BACKSTOP_TTL = 60
assert MAX_MEMBER_TTL <= BACKSTOP_TTL * 5 / 6  # a member's TTL ends before the backstop's can
SWEEP_S = 0.25  # how often the leader looks for silent members: a dead one goes within TTL + this
# a sweep later than this past its time: the leader's loop stalled (paused, swapped out), well past
# the longest turn its own gates allow (a 10^8-block index's busy turns made dead nodes linger)
STALL_GRACE_S = 1.0
TERM_READY_S = 5.0  # how long a registration waits for a new term's liveness to be loaded
DELETES_AT_ONCE = 64  # silent members' deletions in flight at once (one transaction each)
# how long a gone member's TTL is remembered (``ttl_of``): at least twice the TTL, past the object map
# keeper's move of its slots (at most its TTL after it went); then forgotten, so ids do not pile up
TTLS_KEPT_S = 3600.0


def _record(lease: int, ttl: int) -> bytes:
    """A member's liveness record (``LIVENESS``), as written at its registration and compared at its
    deletion."""
    return json.dumps({"lease": lease, "ttl": ttl}).encode()


class LeaseExpiredError(Exception):
    """A keep-alive for a registration the leader no longer holds: the member must register again
    (and re-report)."""


@dataclass(slots=True)
class _Kept:
    lease: int  # the registration's id, as the member knows it
    ttl: int
    seen: float  # monotonic: the last keep-alive (or registration, or the term's start)


class Liveness:
    """The leader's account of its members' keep-alives, and the backstop lease under their
    records. One instance per conductor; it acts only during this conductor's terms."""

    def __init__(self, meta: MetadataBackend, members: Membership, guard: Guard) -> None:
        self.meta = meta
        self.members = members
        self.guard = guard
        self.backstop = 0  # the lease every record of a kept member is under (this term's)
        self._kept: dict[str, _Kept] = {}
        self._doomed: dict[str, bytes] = {}  # node -> the liveness record to delete with its others (retried)
        self._ttls: dict[str, int] = {}  # node -> its latest registration's TTL (kept past its expiry)
        self._gone: dict[
            str, float
        ] = {}  # node -> when its records were deleted, oldest first (its TTL forgotten later)
        self._changing = asyncio.Lock()  # a registration and the deletion of a member's records
        self._ready = asyncio.Event()  # set while this conductor leads and its term is loaded
        self._task: asyncio.Task | None = None
        self._relays: asyncio.Task | None = None  # the leader's watch of the followers' relays
        self.expired = 0  # members this conductor deleted for silence
        self.relayed = 0  # keep-alives this conductor relayed (as a follower) or heard relayed (leader)

    # The leader's term ----------------------------------------------------------------------------

    def term_began(self) -> None:
        self.term_ended()
        self._task = asyncio.get_running_loop().create_task(self._lead())

    def term_ended(self) -> None:
        self._ready.clear()
        for task in (self._task, self._relays):
            if task is not None:
                task.cancel()
        self._task = self._relays = None
        self._kept.clear()
        self._doomed.clear()

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._relays) if t is not None]
        self.term_ended()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _lead(self) -> None:
        """Take the backstop over, count every kept member as seen now, then sweep and renew."""
        while True:
            try:
                await self._take_over()
                break
            except (MetadataUnavailableError, FencedError) as exc:
                log.warning("liveness: the backstop lease is not taken over yet (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except Exception:  # noqa: BLE001 - a term never loaded refuses every registration
                log.exception("liveness: taking the backstop lease over failed; retrying")
                await asyncio.sleep(0.5)
        self._ready.set()
        renewed = swept = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_S)
            # a leader whose loop stalled (paused, swapped out) heard nobody meanwhile: the stall is
            # its own, not its members' silence
            stalled = time.monotonic() - swept - SWEEP_S - STALL_GRACE_S
            if stalled > 0:
                log.warning(
                    "liveness: this leader's loop stalled %.1f s; its members' silence meanwhile is not theirs", stalled
                )
                for kept in self._kept.values():
                    kept.seen += stalled
            try:  # the sweeps must outlive any one failure: without them the dead stay members
                await self._sweep()
                if time.monotonic() - renewed >= BACKSTOP_TTL / 6:
                    with contextlib.suppress(MetadataUnavailableError):  # tried again at the next sweep
                        await self._renew()
                        renewed = time.monotonic()
            except Exception:  # noqa: BLE001
                log.exception("liveness: a sweep failed; the next one tries again")
            swept = time.monotonic()

    async def _take_over(self) -> None:
        found = await self.meta.get(BACKSTOP)
        lease = int(found.value) if found is not None else 0
        if lease:
            try:
                await self.meta.refresh_lease(lease)
            except LeaseNotFoundError:  # no leader for BACKSTOP_TTL: every kept record went with it
                lease = 0
        if not lease:
            await self._new_backstop()
            return
        self.backstop = lease
        kvs, revision = await self.meta.range(LIVENESS)
        now = time.monotonic()
        for kv in kvs:
            node = kv.key[len(LIVENESS) :].decode()
            record = json.loads(kv.value)
            self._kept[node] = _Kept(int(record["lease"]), int(record["ttl"]), now)
            self._ttls[node] = int(record["ttl"])
        self._watch_relays(revision + 1)  # every relay before that is counted by the term's start

    async def _new_backstop(self) -> None:
        lease = await self.meta.grant_lease(BACKSTOP_TTL)
        revision = await self.meta.commit([Put(BACKSTOP, str(lease).encode())], guard=self.guard)
        self.backstop = lease
        self._kept.clear()
        self._watch_relays(revision + 1)

    def _watch_relays(self, start_revision: int) -> None:
        if self._relays is not None:
            self._relays.cancel()
        self._relays = asyncio.get_running_loop().create_task(
            follow(self.meta, RELAYED, start_revision, self._relay_heard, "liveness: followers' relays", present=None)
        )

    def _relay_heard(self, event: WatchEvent) -> None:
        """A follower relayed a keep-alive: the member sent it before the follower's write, and that
        before this event reached the leader."""
        if event.kind != "put":
            return
        kept = self._kept.get(event.key[len(RELAYED) :].decode())
        if kept is not None and str(kept.lease).encode() == event.value:
            kept.seen = time.monotonic()
            self.relayed += 1

    async def _renew(self) -> None:
        try:
            await self.meta.refresh_lease(self.backstop)
        except LeaseNotFoundError:
            log.error("liveness: the backstop lease expired under a live leader; members register again")
            async with self._changing:
                await self._new_backstop()

    async def _sweep(self) -> None:
        now = time.monotonic()
        for node, kept in list(self._kept.items()):
            if now - kept.seen > kept.ttl:
                del self._kept[node]  # its keep-alives are refused from now on
                record = self.members.members.get(node)
                if record is not None and record.lease != kept.lease:
                    continue  # registered since under a lease of its own (a conductor of the release before)
                self._doomed[node] = _record(kept.lease, kept.ttl)
                log.warning("liveness: %s missed its keep-alives for %d s; its records go", node, kept.ttl)
        if self._doomed:
            async with self._changing:
                doomed, self._doomed = self._doomed, {}
                try:
                    gone, again = await self._delete(doomed)
                except BaseException:
                    self._doomed = doomed | self._doomed  # tried again at the next sweep
                    raise  # logged by the loop
                self.expired += len(gone)
                self._gone |= dict.fromkeys(gone, now)
                self._doomed = {node: doomed[node] for node in again} | self._doomed  # tried at the next sweep
        while self._gone:  # oldest first (a node comes back to it only after its registration took it out)
            node, at = next(iter(self._gone.items()))
            if now - at <= max(TTLS_KEPT_S, 2 * self._ttls.get(node, 0)):
                break  # every later one went later: a sweep looks at one kept entry, not all of them
            del self._gone[node]
            self._ttls.pop(node, None)

    async def _delete(self, doomed: dict[str, bytes]) -> tuple[list[str], list[str]]:
        """Delete each member's records while they are still the registration ``doomed`` names (its
        liveness record as written) and this conductor leads: returns the members whose records went
        and those to try again (the backend did not answer). A delete whose outcome was unknown (a
        timeout around an etcd election) could apply later, after the member had registered again,
        and took its new records with it: the member kept alive and reported into a cluster that no
        longer listed it. Guarded by the record, such a delete finds a new one and does nothing."""
        gone: list[str] = []
        again: list[str] = []
        nodes = list(doomed)
        for i in range(0, len(nodes), DELETES_AT_ONCE):
            batch = nodes[i : i + DELETES_AT_ONCE]
            outcomes = await asyncio.gather(*(self._delete_one(n, doomed[n]) for n in batch), return_exceptions=True)
            for node, outcome in zip(batch, outcomes, strict=True):
                if outcome is None:
                    gone.append(node)
                elif not isinstance(outcome, FencedError):  # (fenced: registered again, or deposed)
                    if not isinstance(outcome, MetadataUnavailableError):
                        log.error("liveness: deleting %s's records failed (%r); trying again", node, outcome)
                    again.append(node)
        return gone, again

    async def _delete_one(self, node: str, record: bytes) -> None:
        key = node.encode()
        ops = [Delete(MEMBERS + key), Delete(LIVENESS + key), Delete(RELAYED + key)]
        await self.meta.commit(ops, guard=(self.guard, Guard(LIVENESS + key, record)))

    async def _leading(self) -> None:
        if self._ready.is_set():  # the common case: no timeout to arm (17 us of each keep-alive)
            return
        try:
            async with asyncio.timeout(TERM_READY_S):
                await self._ready.wait()
        except TimeoutError:
            raise MetadataUnavailableError("this leader's term is not loaded yet; retry") from None

    # What members ask ----------------------------------------------------------------------------

    async def register(self, info: MemberInfo, ttl: int) -> int:
        """Write the member's records under the backstop; returns its registration's id (what the
        member calls its lease)."""
        await self._leading()
        lease = secrets.randbits(62) + 1
        record = info.model_copy(update={"lease": lease}).model_dump_json().encode()
        node = info.node_id.encode()
        async with self._changing:
            self._doomed.pop(info.node_id, None)  # its new records must not be deleted for the old
            self._gone.pop(info.node_id, None)
            await self.meta.commit(
                [Put(MEMBERS + node, record, self.backstop), Put(LIVENESS + node, _record(lease, ttl), self.backstop)],
                guard=self.guard,
            )
            self._kept[info.node_id] = _Kept(lease, ttl, time.monotonic())
            self._ttls[info.node_id] = ttl
        return lease

    def ttl_of(self, node: str) -> float:
        """The TTL of ``node``'s latest registration this conductor saw (0: none): how long after
        its records went it may still serve what it owned."""
        return self._ttls.get(node, 0)

    async def keep_alive(self, node: str, lease: int) -> None:
        """The leader's answer to a keep-alive; ``LeaseExpiredError`` when the registration is not
        (or no longer) one it keeps."""
        await self._leading()
        kept = self._kept.get(node)
        if kept is None or kept.lease != lease:
            raise LeaseExpiredError(f"lease {lease} has expired: register again and re-report")
        kept.seen = time.monotonic()

    async def vouch(self, node: str, lease: int) -> None:
        """A follower's answer to a keep-alive while no leader is named (see the module's note): the
        registration must be one a leader keeps (a member under an etcd lease of its own, from a
        conductor of the release before, is alive only as long as that lease)."""
        found = await self.meta.get(LIVENESS + node.encode())
        if found is None or int(json.loads(found.value)["lease"]) != lease:
            raise LeaseExpiredError(f"lease {lease} has expired: register again and re-report")

    async def relay(self, node: str, lease: int) -> bool:
        """A follower's answer to a keep-alive while a leader is named (see the module's note): a
        write the leader watches, guarded by the member's liveness record naming this registration;
        answered once the write is in. A backend write per keep-alive, only for members that reach
        a follower (the leader did not answer them). False: the member holds an etcd lease of its
        own (a leader of the release before registered it), which only that leader renews."""
        key = LIVENESS + node.encode()
        found = await self.meta.get(key)
        if found is None or int(json.loads(found.value)["lease"]) != lease:
            record = self.members.members.get(node)
            if record is not None and record.lease == lease:
                return False
            raise LeaseExpiredError(f"lease {lease} has expired: register again and re-report")
        try:
            await self.meta.commit(
                [Put(RELAYED + node.encode(), str(lease).encode(), found.lease)], guard=Guard(key, found.value)
            )
        except FencedError:  # deleted or registered again since the read
            raise LeaseExpiredError(f"lease {lease} has expired: register again and re-report") from None
        self.relayed += 1
        return True

    async def leave(self, node: str, lease: int) -> bool:
        """Delete a kept member's records now; False when this registration is not kept here."""
        await self._leading()
        async with self._changing:
            kept = self._kept.get(node)
            if kept is None or kept.lease != lease:
                return False
            del self._kept[node]
            await self._delete_one(node, _record(kept.lease, kept.ttl))
            self._gone[node] = time.monotonic()
        return True
