"""Member liveness in the leader's memory (conductor/liveness.py), on both metadata backends: a
keep-alive costs the backend nothing, a silent member goes within its TTL, a new leader keeps the
members and expires the silent ones counting from its own term's start."""

import asyncio
import time
import uuid

import pytest

from tiercake.conductor.liveness import BACKSTOP, LIVENESS, RELAYED, SWEEP_S, LeaseExpiredError
from tiercake.conductor.membership import MEMBERS
from tiercake.conductor.service import Conductor
from tiercake.messages import MemberInfo, RegisterRequest

pytestmark = pytest.mark.cluster  # the etcd backend is a real etcd process


def _member(name: str) -> MemberInfo:
    return MemberInfo(node_id=name, tiers={"pool": 1 << 20})


async def _leading(meta, name: str, ttl: int = 1) -> Conductor:
    conductor = await Conductor(meta, name, ttl=ttl).start()
    await asyncio.wait_for(conductor.election.leading.wait(), 10)
    return conductor


async def _two(meta) -> tuple[Conductor, Conductor]:
    """A leader and a conductor that follows it, on one backend."""
    leader = await _leading(meta, f"c1-{uuid.uuid4().hex[:6]}")
    return leader, await Conductor(meta, f"c2-{uuid.uuid4().hex[:6]}", ttl=1).start()


async def _gone(conductor: Conductor, node: str, within: float) -> float:
    started = time.monotonic()
    await conductor.members.wait_for(lambda m: node not in m.members, within)
    return time.monotonic() - started


async def test_keep_alives_cost_the_backend_nothing_and_a_silent_member_goes_within_its_ttl(meta, monkeypatch):
    refreshes = []
    real_refresh = meta.refresh_lease

    async def counted(lease):
        refreshes.append(lease)
        return await real_refresh(lease)

    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    try:
        kept, silent = f"kept-{uuid.uuid4().hex[:6]}", f"silent-{uuid.uuid4().hex[:6]}"
        kept_lease = await conductor.register(_member(kept), ttl=1)
        silent_lease = await conductor.register(_member(silent), ttl=1)
        for node in (kept, silent):  # both records under the one backstop lease, not one each
            record = await meta.get(MEMBERS + node.encode())
            assert record.lease == conductor.liveness.backstop and record.lease not in (kept_lease, silent_lease)
        monkeypatch.setattr(meta, "refresh_lease", counted)
        started = time.monotonic()
        gone_after = None
        while time.monotonic() - started < 3:  # three TTLs
            await conductor.keep_alive(kept, kept_lease)
            if gone_after is None and silent not in conductor.members.members:
                gone_after = time.monotonic() - started
            await asyncio.sleep(0.2)
        assert gone_after is not None and gone_after < 1 + 1.0  # TTL, a sweep, the watch
        assert kept in conductor.members.members  # kept alive past its TTL three times over
        # 15 keep-alives and not one lease renewal in the backend (the election renews its own)
        assert [lease for lease in refreshes if lease != conductor.election.lease] == []
        assert await meta.get(LIVENESS + silent.encode()) is None
        with pytest.raises(LeaseExpiredError):  # the silent one must register again
            await conductor.keep_alive(silent, silent_lease)
        await conductor.leave(kept, kept_lease)  # a clean leave: gone at once
        await _gone(conductor, kept, 2)
    finally:
        await conductor.close()


async def test_a_sweep_that_fails_is_tried_again_and_the_silent_member_still_goes(meta, monkeypatch):
    """An unforeseen error in one sweep (a bug, a backend's surprise) must not end the sweeps, nor
    forget whom that sweep was expiring: otherwise a dead member stays listed for good."""
    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    try:
        real_delete, failed = conductor.liveness._delete, []

        async def fails_once(doomed):
            if not failed:
                failed.append(list(doomed))
                raise RuntimeError("an unforeseen error")
            return await real_delete(doomed)

        monkeypatch.setattr(conductor.liveness, "_delete", fails_once)
        silent = f"silent-{uuid.uuid4().hex[:6]}"
        await conductor.register(_member(silent), ttl=1)
        await _gone(conductor, silent, 5)
        assert failed == [[silent]] and await meta.get(MEMBERS + silent.encode()) is None
    finally:
        await conductor.close()


async def test_a_new_leader_keeps_the_members_and_expires_the_silent_ones_from_its_term(meta):
    first, second = await _two(meta)
    try:
        kept, silent = f"kept-{uuid.uuid4().hex[:6]}", f"silent-{uuid.uuid4().hex[:6]}"
        kept_lease = await first.register(_member(kept), ttl=2)
        await first.register(_member(silent), ttl=2)
        backstop = first.liveness.backstop
        await asyncio.sleep(1.5)  # most of their TTL spent under the first leader
        first.election.crash()  # killed: no resignation, its election lease runs out
        first.liveness.term_ended()  # as its process would, being dead
        await asyncio.wait_for(second.election.leading.wait(), 10)
        won = time.monotonic()
        await second.keep_alive(kept, kept_lease)  # the registration carried over the failover
        assert second.liveness.backstop == backstop  # the backstop lease taken over, not replaced
        assert silent in second.members.members  # counted as seen when the term began

        async def keep() -> None:
            while True:
                await asyncio.sleep(0.3)
                await second.keep_alive(kept, kept_lease)

        keeping = asyncio.create_task(keep())
        try:
            await second.members.wait_for(lambda m: silent not in m.members, 5)
            assert time.monotonic() - won >= 2 - 0.3  # not before its TTL from the new term's start
            await asyncio.sleep(1.0)
            assert kept in second.members.members and not keeping.done()
        finally:
            keeping.cancel()
    finally:
        await second.close()
        await first.close()


async def test_a_member_that_reaches_only_a_follower_stays_a_member_through_its_relays(meta):
    """The two conductors cut apart, a member on the follower's side: the follower relays its
    keep-alives to the leader through the backend, so it is not expired (it was, and its slots moved
    while clients still reached it); a relay for a registration the leader does not keep is refused."""
    leader, follower = await _two(meta)
    try:
        node, silent = f"cut-{uuid.uuid4().hex[:6]}", f"silent-{uuid.uuid4().hex[:6]}"
        lease = await leader.register(_member(node), ttl=1)
        await leader.register(_member(silent), ttl=1)
        started = time.monotonic()
        while time.monotonic() - started < 3:  # three TTLs, heard by the follower only
            await follower.keep_alive(node, lease)
            await asyncio.sleep(0.2)
        assert node in leader.members.members and silent not in leader.members.members
        assert follower.liveness.relayed >= 10 and leader.liveness.relayed >= 10
        with pytest.raises(LeaseExpiredError):  # not the registration the leader keeps
            await follower.keep_alive(node, lease + 1)
        await leader.leave(node, lease)
        await follower.members.wait_for(lambda m: node not in m.members, 5)
        with pytest.raises(LeaseExpiredError):  # gone: register again
            await follower.keep_alive(node, lease)
        assert await meta.get(RELAYED + node.encode()) is None  # its relay record went with it
    finally:
        await follower.close()
        await leader.close()


async def test_a_silent_nodes_slots_move_no_sooner_than_its_ttl_after_it_went(meta):
    """A keep-alive a follower relayed may be acknowledged as the leader deletes the member: that
    node serves until its lease, counted from the keep-alive, runs out. So its slots move only once
    its TTL has passed since it went, even where ``objects.failover_s`` is shorter."""
    from tiercake.config import ObjectsConfig
    from tiercake.transfer.protocol import OBJECTS_SINCE

    objects = ObjectsConfig(failover_s=0.2, bootstrap_s=0, slots=16, replicas_max=1)
    leader = await Conductor(meta, f"c-{uuid.uuid4().hex[:6]}", ttl=1, objects=objects).start()
    try:
        await asyncio.wait_for(leader.election.leading.wait(), 10)
        kept, silent = f"kept-{uuid.uuid4().hex[:6]}", f"silent-{uuid.uuid4().hex[:6]}"
        node = {"role": "node", "transfer_version": OBJECTS_SINCE}
        kept_lease = await leader.register(MemberInfo(node_id=kept, **node), ttl=1)
        await leader.register(MemberInfo(node_id=silent, **node), ttl=3)
        assert leader.liveness.ttl_of(silent) == 3

        def owns(name: str) -> bool:
            return any(chain and chain[0] == name for chain in leader.objects.map.chains)

        async def keep(until) -> None:
            while not until():
                await leader.keep_alive(kept, kept_lease)
                await asyncio.sleep(0.2)

        await asyncio.wait_for(keep(lambda: owns(silent) and owns(kept)), 10)  # a map of both
        await asyncio.wait_for(keep(lambda: silent not in leader.members.members), 10)  # its TTL ran out
        went = time.monotonic()
        await asyncio.wait_for(keep(lambda: not owns(silent)), 15)
        assert time.monotonic() - went >= 3 - 0.3  # not at failover_s (0.2 s) but its TTL (3 s) after
        assert leader.liveness.ttl_of(silent) == 3  # known past its expiry
    finally:
        await leader.close()


async def test_a_gone_members_ttl_is_forgotten_twice_its_ttl_after_it_went(meta, monkeypatch):
    """``ttl_of`` remembers a member past its expiry (the keeper's slot move waits for it), then forgets
    it: a fleet whose members come and go under new names does not pile their TTLs up."""
    from tiercake.conductor import liveness

    monkeypatch.setattr(liveness, "TTLS_KEPT_S", 0.0)  # only the 2 x TTL floor is left
    leader = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    try:
        silent, left = f"silent-{uuid.uuid4().hex[:6]}", f"left-{uuid.uuid4().hex[:6]}"
        await leader.register(_member(silent), ttl=1)
        left_lease = await leader.register(_member(left), ttl=1)
        await leader.leave(left, left_lease)
        went = time.monotonic()
        while silent in leader.members.members:
            await asyncio.sleep(0.05)
        expired = time.monotonic()
        assert leader.liveness.ttl_of(silent) == 1 and leader.liveness.ttl_of(left) == 1  # kept past going
        while leader.liveness.ttl_of(silent) or leader.liveness.ttl_of(left):
            assert time.monotonic() - went < 10
            await asyncio.sleep(0.05)
        assert time.monotonic() - expired >= 2 - 0.3  # not before twice its TTL
    finally:
        await leader.close()


async def test_a_backstop_lost_under_a_live_leader_is_replaced_and_members_register_again(meta):
    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    try:
        node = f"n-{uuid.uuid4().hex[:6]}"
        lease = await conductor.register(_member(node), ttl=5)
        old = conductor.liveness.backstop
        await meta.revoke_lease(old)  # etcd lost it (restored from a backup, say): the records went
        await _gone(conductor, node, 5)
        await conductor.liveness._renew()  # the renewal finds it gone and takes a new one
        assert conductor.liveness.backstop != old
        assert int((await meta.get(BACKSTOP)).value) == conductor.liveness.backstop
        with pytest.raises(LeaseExpiredError):
            await conductor.keep_alive(node, lease)
        again = await conductor.register(_member(node), ttl=5)
        await conductor.keep_alive(node, again)
        assert (await meta.get(MEMBERS + node.encode())).lease == conductor.liveness.backstop
    finally:
        await conductor.close()


def test_a_member_ttl_past_the_backstop_is_refused():
    with pytest.raises(ValueError, match="less than or equal to 40"):
        RegisterRequest(member=_member("n"), ttl=41)


async def test_a_leader_whose_own_loop_stalled_does_not_expire_the_members_it_could_not_hear():
    """A leader paused for longer than a member's TTL (swapped out, a long GC) heard nobody meanwhile;
    its next sweep ran before the keep-alives queued behind the pause and expired members that had
    sent them on time."""
    from tiercake.conductor.embedded import EmbeddedBackend

    meta = await EmbeddedBackend().start()
    conductor = await _leading(meta, "stalls", ttl=5)  # it keeps the lead through the stall
    try:
        lease = await conductor.register(_member("patient"), ttl=2)
        await conductor.keep_alive("patient", lease)
        time.sleep(2.5)  # the loop stalls past the TTL; the sweep's timer is due first when it resumes  # noqa: ASYNC251
        await asyncio.sleep(0.6)  # a few sweeps
        await conductor.keep_alive("patient", lease)  # its keep-alive, queued behind the stall
        assert conductor.election.terms == 1  # the same term throughout
        assert "patient" in conductor.members.members and conductor.liveness.expired == 0
    finally:
        await conductor.close()
        await meta.close()


async def test_a_member_that_moved_to_a_lease_of_its_own_is_not_the_leaders_to_expire(meta):
    """During an upgrade a member may register again with a conductor of the release before, under
    an etcd lease of its own: the leader's entry for its old registration goes silent, and deleting
    the record then would take the member out of the cluster while its own lease says it lives; and a
    follower sends its keep-alives to that leader rather than relay them (nobody would hear them)."""
    from tiercake.conductor.membership import Registration
    from tiercake.conductor.service import NotLeaderError

    conductor, follower = await _two(meta)
    own = None
    try:
        node = f"moved-{uuid.uuid4().hex[:6]}"
        await conductor.register(_member(node), ttl=1)
        own = await Registration(meta, _member(node), ttl=5).start()  # as the previous release registers
        await conductor.members.wait_for(lambda m: m.members.get(node) and m.members[node].lease == own.lease, 5)
        await asyncio.sleep(2.0)  # the leader's entry is silent past its TTL
        assert node not in conductor.liveness._kept  # forgotten, not deleted
        assert (await meta.get(MEMBERS + node.encode())).lease == own.lease
        assert node in conductor.members.members
        with pytest.raises(LeaseExpiredError):  # no follower vouches for a lease the leader does not keep
            await conductor.liveness.vouch(node, own.lease)
        await follower.members.wait_for(lambda m: m.members.get(node) and m.members[node].lease == own.lease, 5)
        with pytest.raises(NotLeaderError):
            await follower.keep_alive(node, own.lease)
        assert follower.liveness.relayed == 0
    finally:
        if own is not None:
            await own.stop()
        await follower.close()
        await conductor.close()


async def test_a_term_whose_take_over_meets_an_error_no_handler_expected_is_loaded_still(meta, monkeypatch):
    """Reading the backstop lease as a term began met an error other than 'unavailable': the term's
    task once ended there, silently, and every registration was refused as 'not loaded yet' while
    that conductor led."""
    real_get, failures = meta.get, []

    async def get(key: bytes):
        if key == BACKSTOP and not failures:
            failures.append(key)
            raise RuntimeError("a fault of the test")
        return await real_get(key)

    monkeypatch.setattr(meta, "get", get)
    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    try:
        node = f"n-{uuid.uuid4().hex[:6]}"
        lease = await conductor.register(_member(node), ttl=2)
        assert failures and lease and node in conductor.liveness._kept
    finally:
        await conductor.close()


async def test_a_silent_members_delete_applied_late_leaves_its_next_registration_alone(meta, monkeypatch):
    """The leader expires a silent member; its delete times out around an etcd election but is
    applied later, after the member has registered again (the lab's split of the conductors). The
    delete was fenced by the leader's election key only, so it took the new registration's records:
    the member kept alive (the leader kept it) and reported into a cluster that listed it nowhere.
    Fenced also by the expired registration's own record, the late delete does nothing."""
    from tiercake.conductor.metadata import Delete, MetadataUnavailableError

    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    node = f"late-{uuid.uuid4().hex[:6]}"
    real_commit, late, go = meta.commit, [], asyncio.Event()

    async def commit(ops, concurrency=1, guard=None):
        if not late and any(isinstance(op, Delete) and op.key == MEMBERS + node.encode() for op in ops):

            async def applied_later():  # what etcd does with a proposal whose answer timed out
                await go.wait()
                return await real_commit(ops, concurrency, guard)

            late.append(asyncio.create_task(applied_later()))
            raise MetadataUnavailableError("the answer timed out (a fault of the test)")
        return await real_commit(ops, concurrency, guard)

    monkeypatch.setattr(meta, "commit", commit)
    try:
        await conductor.register(_member(node), ttl=1)  # then silent: expired within a second or so
        await _gone(conductor, node, 10)  # the retried delete went through
        lease = await conductor.register(_member(node), ttl=5)  # it comes back
        go.set()
        await asyncio.gather(*late, return_exceptions=True)  # the first delete lands now
        record = await meta.get(MEMBERS + node.encode())
        assert late and record is not None and MemberInfo.model_validate_json(record.value).lease == lease
        await conductor.keep_alive(node, lease)
    finally:
        go.set()
        await conductor.close()


async def test_a_registration_in_flight_as_the_sweep_expires_the_one_before_is_kept(meta, monkeypatch):
    """What the lab showed: a member registers again (its keep-alive was refused) while the leader
    still keeps its previous registration; that registration's TTL runs out while the new one's write
    is slow (an etcd election), so the sweep dooms the old one and waits for the write; the write
    lands, and the sweep's delete, fenced by the election key only, took the new records with it."""
    from tiercake.conductor.metadata import Put

    conductor = await _leading(meta, f"c-{uuid.uuid4().hex[:6]}")
    node = f"again-{uuid.uuid4().hex[:6]}"
    real_commit, held = meta.commit, []

    async def commit(ops, concurrency=1, guard=None):
        if held and any(isinstance(op, Put) and op.key == MEMBERS + node.encode() for op in ops):
            async with asyncio.timeout(10):  # slow: until the sweep has doomed the registration before
                while node not in conductor.liveness._doomed:
                    await asyncio.sleep(0.02)
        return await real_commit(ops, concurrency, guard)

    monkeypatch.setattr(meta, "commit", commit)
    try:
        await conductor.register(_member(node), ttl=1)  # then silent
        held.append(1)
        lease = await conductor.register(_member(node), ttl=5)  # its write waits out the old one's TTL
        await asyncio.sleep(SWEEP_S * 4)  # the sweep's delete has come and gone
        record = await meta.get(MEMBERS + node.encode())
        assert record is not None and MemberInfo.model_validate_json(record.value).lease == lease
        assert node in conductor.members.members
        await conductor.keep_alive(node, lease)
    finally:
        await conductor.close()
