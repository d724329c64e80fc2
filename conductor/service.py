"""The conductor: one process's share of the control plane, over a metadata backend.

Every conductor follows the membership, pins and settings in the backend and keeps the placement
index in memory (the leader's fed by members' reports, a follower's by the leader's change log), and
serves lookups from it; the one that wins the election also accepts placement changes. The HTTP
face is ``api.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence

from tiercake.loop_lag import LoopLag
from tiercake.messages import ClusterSettings, ConductorInfo, FlushSetting, MemberInfo, MemberStats
from tiercake.policies import create_placement, create_replication

from .block_table import DEFAULT_RESERVE, KEY_BYTES, BlockKeys
from .election import LeaderElection
from .heat import AccessRates
from .leader_link import LeaderLink
from .liveness import Liveness
from .membership import Membership
from .metadata import (
    Delete,
    Guard,
    MetadataBackend,
    MetadataUnavailableError,
    Put,
    WatchEvent,
    follow,
)
from .objects import ObjectMapKeeper
from .placement import PlacementIndex
from .puts import PlacementError, PutBook
from .replica_planner import ReplicaMove, ReplicaPlanner

log = logging.getLogger(__name__)


class NotLeaderError(Exception):
    """A write reached a conductor that does not lead; ``leader`` says who does (if anyone)."""

    def __init__(self, leader: str | None) -> None:
        super().__init__(f"this conductor does not lead; the leader is {leader or 'not known yet'}")
        self.leader = leader


class FlushTimeoutError(Exception):
    """A flush that was waited for is not applied by every member in time."""


PINS = b"/tiercake/pins/"
SETTINGS = b"/tiercake/settings/"  # cluster-wide run-time settings: flush epoch, policies
# A follower's mirror of the index is kept on a win if in step this recently (members keep 60 s of
# acknowledged changes, ``workers.conductor_link.RECENT_S``); the window they re-report is its age
# and a margin for the last poll's flight and the clocks' rates.
MIRROR_FRESH_S = 30.0
REGISTER_SEEN_S = 5.0  # how long a register waits for its own member record to come back through the watch
INGEST_AT_ONCE = 2  # placement change batches parsed and applied in one turn of the loop, at most
REREPORT_MARGIN_S = 2.0


def _pin_key(tenant: str, key: bytes) -> bytes:
    return PINS + f"{tenant}/{key.hex()}".encode()


class IngestBusyError(Exception):
    """More placement change batches wait than the leader queues: retry a little later."""


class TurnGate:
    """``async with`` it around work that has no pause in it (parsing and applying a batch of
    placement changes). At most ``n`` such pieces run in one turn of the loop: a thousand members'
    reports arriving together once ran in one turn, two seconds long (renewals, lookups and the
    follower's feed all waited behind them); a semaphore alone would not do, since work with no
    pause takes and gives it back within one step, so here each holder gives the turn up once
    before it works. Together they take at most ``share`` of the loop's time: a leader that spent
    all of it on a fleet's fill answered renewals so late, and left etcd so little of the machine,
    that members' leases lapsed, and each lapse cost a drop and a re-report of everything. Past
    ``queue`` waiting, a batch is refused at once (``IngestBusyError``: a retryable 503)."""

    def __init__(self, n: int, share: float = 0.6, queue: int = 1024, burst_s: float = 0.1) -> None:
        self._slots = asyncio.Semaphore(n)
        self.share, self.queue, self.burst_s = share, queue, burst_s
        self._waiting = 0
        self._credit = burst_s  # seconds of work it may start now; below 0, the next waits
        self._credited_at = time.monotonic()
        self._working: dict[asyncio.Task | None, float] = {}  # holder -> when its work started

    async def __aenter__(self) -> None:
        if self._waiting >= self.queue:
            raise IngestBusyError(f"{self._waiting} batches of placement changes wait already; retry")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            await asyncio.sleep(0)  # this turn ends for it here; it works at the start of the next
            while (credit := self._refill()) < 0:
                await asyncio.sleep(-credit / self.share)
        except BaseException:
            self._slots.release()
            raise
        self._working[asyncio.current_task()] = time.monotonic()

    def _refill(self) -> float:
        now = time.monotonic()
        self._credit = min(self.burst_s, self._credit + (now - self._credited_at) * self.share)
        self._credited_at = now
        return self._credit

    async def __aexit__(self, *exc: object) -> None:
        started = self._working.pop(asyncio.current_task(), None)
        if started is not None:
            self._credit -= time.monotonic() - started
        self._slots.release()


class FlushBarrier:
    """The leader's account of which member applied which flush epoch, and a wait until every member
    live at a flush's start (and still live) has."""

    def __init__(self, members: Membership) -> None:
        self.members = members
        self._applied: dict[str, int] = {}  # member -> the last flush epoch it confirmed
        self._confirmation = asyncio.Event()

    def applied(self, member: str, epoch: int) -> None:
        live = self.members.members
        if len(self._applied) >= len(live):
            for gone in [m for m in self._applied if m not in live]:
                del self._applied[gone]
        self._applied[member] = max(epoch, self._applied.get(member, 0))
        self._confirmation.set()

    async def confirmed(self, epoch: int, members: set[str], wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._confirmation.clear()  # before looking: a confirmation from now on wakes us
            alive = {m.node_id for m in self.members.alive()}
            late = sorted(m for m in members & alive if self._applied.get(m, 0) < epoch)
            if not late:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise FlushTimeoutError(
                    f"flush {epoch} is not yet applied by {', '.join(late)} after {wait_s:g} s "
                    "(they apply it at their next keep-alive; it stays in force)"
                )
            with contextlib.suppress(TimeoutError):  # woken by a confirmation, or to notice members that left
                async with asyncio.timeout(min(left, 0.5)):
                    await self._confirmation.wait()


class Conductor:
    def __init__(
        self,
        meta: MetadataBackend,
        conductor_id: str | None = None,
        url: str = "",
        ttl: int = 3,
        placement: str = "least_used",
        replication: str = "fixed",
        replication_params: dict | None = None,
        put_timeout: float = 60.0,
        heat_half_life: float = 10.0,
        peer_token: str | None = None,
        peer_ssl=None,
        objects=None,
        index_max_blocks: int = DEFAULT_RESERVE,
    ) -> None:
        """``objects``: the ``ObjectsConfig`` the object map is kept by (slots, replicas, failover);
        ``index_max_blocks``: the blocks the placement index reserves room for."""
        self.meta = meta
        self.placement = create_placement(placement)
        self.replication = create_replication(replication, replication_params)
        self.conductor_id = conductor_id or f"conductor-{uuid.uuid4().hex[:8]}"
        self.url = url
        self.index = PlacementIndex(reserve=index_max_blocks)
        self.members = Membership(meta)
        self.ingest = TurnGate(INGEST_AT_ONCE)
        self.puts = PutBook(self.index, self.members, self.placement, self.replication, put_timeout, self._member)
        self.election = LeaderElection(
            meta, ConductorInfo(conductor_id=self.conductor_id, url=url).model_dump_json(), ttl=ttl
        )
        # Placements are the leader's: a term starts with the follower's fresh mirror (or none), ends
        # with none, and a member that leaves takes its own along.
        self.election.on_change = self._leadership_changed
        self._mirror_synced: float | None = None  # monotonic: when this term's mirror was last in step
        self.members.leave_listeners.append(self._member_left)
        # the leader's writes go through only while the election key is still its own (fencing)
        self.guard = Guard(self.election.key, self.election.candidate.encode())
        self.heat = AccessRates(half_life=heat_half_life)
        # a follower's lookups count too: it sends them to the leader, which decides replication
        self.peer_token = peer_token  # the control token conductors use with each other
        self.peer_ssl = peer_ssl  # and what they verify each other's https with
        self.link = LeaderLink(self)
        self.pins: set[tuple[str, bytes]] = set()
        self.pins_version = 0
        self.replicas = ReplicaPlanner(self)
        self._pin_follower: asyncio.Task | None = None
        self._settings: dict[str, object] = {}  # name -> JSON value, followed from the backend
        self.settings = ClusterSettings()  # the same, typed
        self.member_stats: dict[str, MemberStats] = {}  # what members said of their stores in keep-alives
        self.flushes = FlushBarrier(self.members)
        self._settings_follower: asyncio.Task | None = None
        self.loop_lag = LoopLag(f"conductor {self.conductor_id}")
        self._lag_watch: asyncio.Task | None = None
        self.liveness = Liveness(meta, self.members, self.guard)
        self.objects = ObjectMapKeeper.of(
            meta, self.members, self.guard, lambda: self.is_leader, objects, self.liveness.ttl_of
        )

    async def start(self) -> Conductor:
        await self.index.start()
        await self.members.start()
        kvs, revision = await self.meta.range(PINS)
        for kv in kvs:
            self._apply_pin(WatchEvent("put", kv.key, kv.value, revision))
        self._pin_follower = asyncio.get_running_loop().create_task(
            follow(self.meta, PINS, revision + 1, self._apply_pin, "pins", present=[kv.key for kv in kvs])
        )
        kvs, revision = await self.meta.range(SETTINGS)
        for kv in kvs:
            self._apply_setting(WatchEvent("put", kv.key, kv.value, revision))
        self._settings_follower = asyncio.get_running_loop().create_task(
            follow(self.meta, SETTINGS, revision + 1, self._apply_setting, "settings", present=[kv.key for kv in kvs])
        )
        await self.objects.start()
        await self.election.start()
        self.link.start()
        self._lag_watch = asyncio.get_running_loop().create_task(self.loop_lag.watch())
        return self

    async def close(self) -> None:
        await self.election.resign()
        await self.liveness.close()
        await self.objects.close()
        for task in (self._pin_follower, self._settings_follower, self._lag_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.link.close()
        await self.members.close()
        await self.index.close()

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    @property
    def read_role(self) -> str:
        """What this conductor's lookups are worth to a client choosing where to send them: the
        leader's (``leader``), a follower's in step with it (``follower``: as good, and it takes no
        keep-alives or reports), or a follower's that is not (``behind``: ask the leader)."""
        if self.is_leader:
            return "leader"
        return "follower" if self.link.in_step() else "behind"

    async def leader(self) -> ConductorInfo | None:
        raw = await self.election.leader()
        return ConductorInfo.model_validate_json(raw) if raw else None

    async def ready(self) -> tuple[bool, str]:
        """Ready to serve: the backend answers and a leader is known."""
        try:
            leader = await self.leader()
        except MetadataUnavailableError as exc:
            return False, f"metadata backend unreachable: {exc}"
        if leader is None:
            return False, "no leader elected yet"
        return True, f"leader {leader.conductor_id}"

    def _leadership_changed(self, leading: bool) -> None:
        """A win keeps the follower's mirror of the old leader's index if it was in step with it less
        than ``MIRROR_FRESH_S`` ago: every change the mirror may lack was acknowledged since, and the
        members re-report only those (``rereport_s``), not the whole index, which at a fleet's size
        costs more than a term lasts. A stale or missing mirror is dropped. A leader that steps down
        keeps its index as a mirror in step at that moment: it wins again with it (etcd lost its
        quorum for a while, say), or follows the next leader from a snapshot."""
        if not leading:
            self.liveness.term_ended()
            self.link.stepped_down()
            self._mirror_synced = None
            return
        self.liveness.term_began()
        age = self.link.mirror_age()
        if age is not None and age <= MIRROR_FRESH_S:
            kept = self.index.keep_mirror(self.members.members)
            self._mirror_synced = time.monotonic() - age
            log.info("conductor %s: leading with %d mirrored replicas (%.1f s old)", self.conductor_id, kept, age)
        else:
            self.index.clear()
            self._mirror_synced = None

    def _member_left(self, node: str) -> None:
        if self.election.leading.is_set():  # the leader's log tells the followers
            self.index.drop_node(node)

    @property
    def rereport_s(self) -> float | None:
        """What this leader's term asks a member to re-report, as of now: the changes it had
        acknowledged since the mirror this term began with was last in step (plus a margin for the
        poll's flight), or None (everything: the term began with no mirror). Counted back from now,
        so a member that hears of the term late still reaches back far enough."""
        if self._mirror_synced is None:
            return None
        return time.monotonic() - self._mirror_synced + REREPORT_MARGIN_S

    def term_and_window(self) -> tuple[int, float | None]:
        """The leader's term a keep-alive answer names, and what that term asks members to re-report
        (``KeepAliveReply.rereport_s``), read together: the leader's own, or what a follower's feed
        last heard from the leader. A follower that follows no leader now names no term (0: a member
        keeps its own) rather than one whose window it does not know: between a leader's death and
        its own win, a follower named the new term from the backend with no window, and members
        re-reported everything they held."""
        if self.is_leader:
            return self.election.won_term, self.rereport_s
        if self.link.followed_term:
            return self.link.followed_term, self.link.followed_window()
        return 0, None

    async def require_leader(self) -> None:
        """``NotLeaderError`` naming the leader's URL unless this conductor leads. The leader asks
        the backend nothing: every report, commit and begin asked etcd who leads (a read per request,
        6% of the leader's CPU under a fleet's reports)."""
        if not self.is_leader:
            leader = await self.leader()
            raise NotLeaderError(leader.url if leader else None)

    # Membership -----------------------------------------------------------------------------------

    async def register(self, info: MemberInfo, ttl: int) -> int:
        """Register a member (node or worker) with the leader's liveness; returns its lease (the
        registration's id)."""
        await self.require_leader()
        lease = await self.liveness.register(info, ttl)
        # read your writes: the member's next request may come at once, and this conductor knows its
        # members through a watch (a report right after a register was refused, 409, under load)
        with contextlib.suppress(TimeoutError):
            await self.members.wait_for(lambda m: _lease_of(m, info.node_id) == lease, REGISTER_SEEN_S)
        return lease

    def note_stats(self, member: str, stats: MemberStats) -> None:
        """What a member said of its store in a keep-alive; those of members that left are dropped."""
        live = self.members.members
        if len(self.member_stats) >= len(live):  # some may have left: only then is the walk worth it
            for gone in [m for m in self.member_stats if m not in live]:
                del self.member_stats[gone]
        self.member_stats[member] = stats

    async def keep_alive(self, node: str, lease: int) -> None:
        """The leader notes the keep-alive; a follower relays it to the leader through the backend,
        or vouches for it while none is named (``liveness.py``). ``LeaseExpiredError``: register
        again. A member reaches a follower when the leader did not answer it; its next report, which
        only the leader takes, sends it back there."""
        if self.is_leader:
            await self.liveness.keep_alive(node, lease)
            return
        leader = await self.leader()
        if leader is None:
            await self.liveness.vouch(node, lease)
        elif not await self.liveness.relay(node, lease):  # a previous release's leader renews it
            raise NotLeaderError(leader.url)

    async def objects_epoch(self) -> int:
        """The object map's epoch, as a keep-alive answer names it: the node serves by its map only
        once it holds one as new. The leader writes the map, so its own is the newest; a follower's
        copy follows a watch and may lag, so it reads the epoch from the backend too: a keep-alive a
        follower answered (relayed or vouched) with a lagging epoch would let a node that came back
        serve by the map it had before its slots moved."""
        if self.is_leader:
            return self.objects.map.epoch
        return max(self.objects.map.epoch, await self.objects.stored_epoch())

    async def leave(self, node: str, lease: int) -> None:
        """A member leaves at once (its records are deleted, its placements dropped). One that holds
        an etcd lease of its own (registered straight into the backend) leaves by revoking it."""
        await self.require_leader()
        if not await self.liveness.leave(node, lease):
            await self.meta.revoke_lease(lease)

    def _member(self, node: str, tier: str) -> MemberInfo:
        member = self.members.members.get(node)
        if member is None:
            raise PlacementError(f"{node!r} is not a live member: register it first")
        if tier not in member.tiers:
            raise PlacementError(f"node {node!r} has no tier {tier!r} (it has {sorted(member.tiers)})")
        return member

    # What nodes report ----------------------------------------------------------------------------

    def report(self, tenant: str, keys: BlockKeys, node: str, tier: str, sizes: list[int]) -> int:
        """A live node holds these blocks (it spilled or promoted them, or its SSD tier still has them
        after a restart): record what is new; returns how many were. Only members may report, and
        only into tiers they registered."""
        self._member(node, tier)
        return self.index.add_many(tenant, keys, node, tier, sizes)

    def remove(self, tenant: str, keys: BlockKeys, node: str, tier: str) -> tuple[int, int]:
        """The node no longer holds these blocks in ``tier``: returns (removed, unknown), unknown being
        replicas the index never had (nothing to do for them)."""
        removed = self.index.remove_many(tenant, keys, node, tier)
        count = len(keys) // KEY_BYTES if isinstance(keys, bytes) else len(keys)
        return removed, count - removed

    def lookup(self, tenant: str, keys: BlockKeys) -> dict:
        """The longest cached prefix per node (``keys``: a chain's keys, or them back to back); the
        blocks found count as accesses (hot replication)."""
        found = self.index.lookup(tenant, keys)
        longest = max((p.length for p in found.values()), default=0)
        if longest:
            if isinstance(keys, bytes):
                hits = [(tenant, keys[i : i + KEY_BYTES]) for i in range(0, longest * KEY_BYTES, KEY_BYTES)]
            else:
                hits = [(tenant, k) for k in keys[:longest]]
            self.heat.hit(hits)
            if not self.is_leader:
                self.link.count(hits)
        return found

    def add_heat(self, counts: list[tuple[tuple[str, bytes], int]]) -> None:
        """Accesses a follower counted, sent to the leader."""
        self.heat.add(counts)

    # Pins -----------------------------------------------------------------------------------------

    def _apply_pin(self, event: WatchEvent) -> None:
        tenant, _, key_hex = event.key[len(PINS) :].decode().partition("/")
        pin = (tenant, bytes.fromhex(key_hex))
        if event.kind == "put":
            self.pins.add(pin)
        else:
            self.pins.discard(pin)
        self.pins_version += 1

    async def pin(self, tenant: str, keys: Sequence[bytes], ttl: int | None = None) -> None:
        """Keep these blocks on every node that holds them (never evicted there) until unpinned or,
        with ``ttl``, for that many seconds. Durable: a new leader keeps the pins."""
        lease = await self.meta.grant_lease(ttl) if ttl else 0
        await self.meta.commit([Put(_pin_key(tenant, k), b"{}", lease) for k in keys], guard=self.guard)
        self.pins.update((tenant, k) for k in keys)

    async def unpin(self, tenant: str, keys: Sequence[bytes]) -> None:
        await self.meta.commit([Delete(_pin_key(tenant, k)) for k in keys], guard=self.guard)
        self.pins.difference_update((tenant, k) for k in keys)

    def node_pins(self, node: str) -> list[tuple[str, bytes]]:
        """The pinned blocks ``node`` holds (it applies them to its store)."""
        return [(t, k) for t, k in self.pins if any(r.node == node for r in self.index.holders(t, k))]

    # Run-time settings ----------------------------------------------------------------------------

    def _apply_setting(self, event: WatchEvent) -> None:
        name = event.key[len(SETTINGS) :].decode()
        if event.kind == "put":
            self._settings[name] = json.loads(event.value)
        else:
            self._settings.pop(name, None)
        self._retype_settings()

    def _retype_settings(self) -> None:
        try:
            self.settings = ClusterSettings.model_validate(self._settings)
        except ValueError as exc:  # a setting written by hand, or by a newer version: keep the rest
            log.error("conductor %s: cluster settings refused: %s", self.conductor_id, exc)

    async def put_setting(self, name: str, value: object) -> None:
        """Durable, and seen by every conductor (and through them by every member). ``name`` is a
        field of ``ClusterSettings``; ``value`` its model (or a JSON-able value of its shape)."""
        if name not in ClusterSettings.model_fields:
            raise ValueError(f"unknown cluster setting {name!r}")
        encoded = json.loads(ClusterSettings.model_validate({name: value}).model_dump_json(include={name}))[name]
        await self.meta.commit([Put(SETTINGS + name.encode(), json.dumps(encoded).encode())], guard=self.guard)
        self._settings[name] = encoded
        self._retype_settings()

    def flush_applied(self, member: str, epoch: int) -> None:
        """A member applied flush ``epoch`` and reported what it removed."""
        self.flushes.applied(member, epoch)

    async def flush(self, tiers: list[str] | None = None, wait_s: float | None = None) -> int:
        """Ask every node and worker to drop what it may (unpinned, unleased, unused blocks); with
        ``tiers``, only what those tiers hold, pushed down to the next tier. Returns the flush epoch
        once it is durable or, given ``wait_s``, once every member live now has confirmed it (a member
        that leaves meanwhile is not waited for); ``FlushTimeoutError`` names those that did not."""
        waiting_for = {m.node_id for m in self.members.alive()}
        epoch = self.settings.flush.epoch + 1
        await self.put_setting("flush", FlushSetting(epoch=epoch, tiers=tiers))
        if wait_s is not None:
            await self.flushes.confirmed(epoch, waiting_for, wait_s)
        return epoch

    def replication_tasks(self, node: str, limit: int = 64) -> list[ReplicaMove]:
        """What ``node`` should copy or drop now (``ReplicaPlanner.tasks``)."""
        return self.replicas.tasks(node, limit)


def _lease_of(members: Membership, node: str) -> int | None:
    member = members.members.get(node)
    return None if member is None else member.lease
