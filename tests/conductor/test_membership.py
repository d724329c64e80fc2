"""Membership and leader election on both metadata backends."""

import asyncio
import time
import uuid

import pytest

from tiercake.conductor.election import LeaderElection
from tiercake.conductor.membership import MemberInfo, Membership, Registration

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.fixture
def prefix():
    return f"/t/{uuid.uuid4().hex[:10]}/".encode()


async def test_members_come_and_go(meta, prefix):
    view = await Membership(meta, prefix + b"members/").start()
    a = await Registration(
        meta, MemberInfo(node_id="node-a", port=7450, tiers={"pool": 1 << 30}), ttl=1, prefix=prefix + b"members/"
    ).start()
    b = await Registration(
        meta, MemberInfo(node_id="node-b", role="decode"), ttl=1, prefix=prefix + b"members/"
    ).start()
    await view.wait_for(lambda v: len(v.members) == 2, 10)
    assert view.members["node-a"].tiers == {"pool": 1 << 30} and [m.node_id for m in view.alive("decode")] == ["node-b"]
    await b.stop()  # a clean leave: gone at once
    await view.wait_for(lambda v: "node-b" not in v.members, 10)
    started = time.monotonic()
    a.crash()  # no more keep-alives: gone within the TTL (etcd rounds leases up to about 1-2 s)
    await view.wait_for(lambda v: "node-a" not in v.members, 10)
    assert time.monotonic() - started < 4
    late = await Membership(meta, prefix + b"members/").start()  # a conductor starting now sees nobody
    assert late.members == {}
    await view.close()
    await late.close()


async def test_a_member_whose_lease_expired_registers_again_and_reports(meta, prefix):
    reports = []

    async def report(lease):
        reports.append(lease)

    reg = await Registration(meta, MemberInfo(node_id="node-a"), ttl=1, prefix=prefix, on_register=report).start()
    await meta.revoke_lease(reg.lease)  # as if it had been partitioned past its TTL
    for _ in range(100):
        await asyncio.sleep(0.05)
        if reg.registrations == 2:
            break
    assert reg.registrations == 2 and len(reports) == 2 and reports[0] != reports[1]
    assert await meta.get(prefix + b"node-a") is not None  # back, under the new lease
    await reg.stop()


async def test_one_leader_and_a_standby_takes_over(meta, prefix):
    first = await LeaderElection(meta, "conductor-1", ttl=1, prefix=prefix).start()
    await asyncio.wait_for(first.leading.wait(), 10)
    second = await LeaderElection(meta, "conductor-2", ttl=1, prefix=prefix).start()
    await asyncio.sleep(0.5)
    assert first.is_leader and not second.is_leader
    assert await second.leader() == "conductor-1"
    started = time.monotonic()
    first.crash()  # killed: no resignation, its lease runs out
    await asyncio.wait_for(second.leading.wait(), 10)
    assert time.monotonic() - started < 2 * 1 + 2.5  # within two TTLs (plus etcd's lease granularity)
    assert await first.leader() == "conductor-2"
    await second.resign()
    assert await second.leader() is None


async def test_a_leader_that_loses_its_lease_steps_down(meta, prefix):
    leader = await LeaderElection(meta, "conductor-1", ttl=1, prefix=prefix).start()
    await asyncio.wait_for(leader.leading.wait(), 10)
    old_lease = leader.lease
    await meta.revoke_lease(old_lease)  # its term ended behind its back (a pause past the TTL)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if leader.terms == 2:
            break
    # it noticed at its next keep-alive, stepped down, and (alone) won a new term under a new lease
    assert leader.terms == 2 and leader.lease != old_lease and leader.is_leader
    await leader.resign()


async def test_a_stalled_leader_is_not_leader_the_moment_it_resumes(meta, prefix, monkeypatch):
    """Where the lease is renewed from the loop (the embedded backend), a loop stalled past the TTL
    is not leader the moment it resumes. Where the renewals run on their own thread (etcd), a turn
    of the loop held past the TTL keeps the lead (a burst of requests once handed it over mid-fill),
    but a loop stuck past ``STALL_S`` gives it up; a paused process (SIGSTOP: no thread runs) loses
    it as before (``test_a_paused_leader_does_not_act_as_leader_when_it_resumes``)."""
    from tiercake.conductor import election

    monkeypatch.setattr(election, "STALL_S", 1.5)
    leader = await LeaderElection(meta, "conductor-1", ttl=1, prefix=prefix).start()
    await asyncio.wait_for(leader.leading.wait(), 10)
    assert leader.is_leader
    time.sleep(1.2)  # the whole event loop stalls past the TTL
    if meta.detached() is None:
        assert not leader.is_leader  # checked before any task runs: no window where it acts as leader
    else:
        assert leader.is_leader  # renewed meanwhile on the election's own thread
        await asyncio.sleep(0.3)
        time.sleep(2.5)  # stuck past STALL_S: the thread stops renewing, and the lease runs out
        assert not leader.is_leader
    await leader.resign()


async def test_a_deposed_leaders_write_in_flight_is_refused_by_the_backend(meta, prefix):
    """Fencing: a leader's durable writes (settings, pins, the object map) carry a guard (the
    election key holds the writer's record), checked in the same transaction, so a write sent after
    the term ended, by a leader that had already passed its own check, is refused instead of landing
    under the new leader."""
    from tiercake.conductor.metadata import FencedError, Guard, Put

    first = await LeaderElection(meta, "conductor-1", ttl=1, prefix=prefix).start()
    await asyncio.wait_for(first.leading.wait(), 10)
    guard = Guard(first.key, first.candidate.encode())
    await meta.commit([Put(prefix + b"settings/flush", b"{}")], guard=guard)  # while leading: written
    first.crash()  # paused past its term; a standby takes over
    second = await LeaderElection(meta, "conductor-2", ttl=1, prefix=prefix).start()
    await asyncio.wait_for(second.leading.wait(), 10)
    with pytest.raises(FencedError):  # the first resumes and sends what it had queued
        await meta.commit([Put(prefix + b"settings/router", b"{}"), Put(prefix + b"pins/x", b"{}")], guard=guard)
    assert await meta.get(prefix + b"settings/flush") is not None
    assert await meta.get(prefix + b"settings/router") is None and await meta.get(prefix + b"pins/x") is None
    await second.resign()


async def test_a_member_whose_re_registration_fails_unexpectedly_registers_again():
    """Its lease lapsed (cut off), and the first registration after met an error no handler
    expected (in the lab: a body cut short as the partition healed). The keep-alive loop once ended
    there, silently, and the node agent stayed out of the cluster while it ran; it must try again."""
    import aiohttp
    from conductor_helpers import running_conductor

    from tiercake.conductor.client import Client
    from tiercake.messages import MemberInfo
    from tiercake.workers.conductor_link import ConductorLink

    member = MemberInfo(node_id="cut-off", role="node", tiers={"pool": 1 << 20})
    async with running_conductor() as (url, conductor):
        link = await ConductorLink(Client([url]), member, None, ttl=2, report=False).start()
        try:
            real, failures = link.client.register, []

            async def register(info, ttl=5):
                if not failures:
                    failures.append(1)
                    raise aiohttp.ClientPayloadError("response cut short")
                return await real(info, ttl)

            link.client.register = register
            first = link.lease
            await conductor.leave("cut-off", first)  # as its lease lapsing would
            await conductor.members.wait_for(lambda ms: "cut-off" not in ms.members, 5)
            deadline = asyncio.get_running_loop().time() + 10
            while not ("cut-off" in conductor.members.members and link.lease != first):
                assert asyncio.get_running_loop().time() < deadline, "it never registered again"
                await asyncio.sleep(0.1)
            assert failures and conductor.members.members["cut-off"].lease == link.lease
        finally:
            await link.close(leave=True)
            await link.client.close()


async def test_a_new_terms_window_does_not_send_again_what_a_change_in_flight_replaced(make_store):
    """A new leader asks a member for what it acknowledged lately while a newer change of the same
    block is on its way: the member sends the block as it is once that change lands, never the older
    state (a removal in flight, then the addition before it sent again, left a removed block listed
    past the failover)."""
    from conductor_helpers import running_conductor
    from conftest import block

    from tiercake.conductor.client import Client
    from tiercake.messages import KeepAliveReply, MemberInfo
    from tiercake.workers.conductor_link import ConductorLink

    store = await make_store(gpu=8, pool=None, ssd=None)
    key = b"x" * 32
    async with running_conductor() as (url, conductor):
        member = MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20})
        link = await ConductorLink(Client([url]), member, store, ttl=30).start()
        try:
            await store.put(key, block(1), tier="gpu", tenant="t")
            await link.send_reports()
            sent: list[str] = []
            landing = asyncio.Event()
            report, remove = link.client.report, link.client.remove

            async def counted_report(*args):
                sent.append("add")
                return await report(*args)

            async def slow_remove(*args):
                sent.append("remove")
                await landing.wait()  # on its way while the new term's window comes
                return await remove(*args)

            link.client.report, link.client.remove = counted_report, slow_remove
            await store.remove(key)
            in_flight = asyncio.create_task(link.send_reports())
            while "remove" not in sent:
                await asyncio.sleep(0.01)
            link._note_term(KeepAliveReply(pins_version=0, term=link._term + 1, rereport_s=30.0))
            landing.set()
            await in_flight
            await link.send_reports()
            assert "add" not in sent and conductor.index.holders("t", key) == {}
        finally:
            await link.close(leave=False)
            await link.client.close()


async def test_a_member_may_report_the_moment_its_register_returns(meta, monkeypatch):
    """A conductor knows its members through a watch; a register answers only once its own record
    came back through it, so the member's next request is never refused as a stranger's (here the
    watch delivers every change half a second late; without the wait the report was a 409)."""
    from tiercake.conductor.service import Conductor

    applied = Membership._apply

    def late(self, event):
        asyncio.get_running_loop().call_later(0.5, applied, self, event)

    monkeypatch.setattr(Membership, "_apply", late)
    conductor = await Conductor(meta, f"c-{uuid.uuid4().hex[:6]}", ttl=2).start()
    try:
        await asyncio.wait_for(conductor.election.leading.wait(), 10)  # members register with the leader
        node = f"n-{uuid.uuid4().hex[:6]}"
        await conductor.register(MemberInfo(node_id=node, tiers={"pool": 1 << 20}), ttl=30)
        assert conductor.report("t", [bytes(32)], node, "pool", [1]) == 1
    finally:
        await conductor.close()


async def test_a_campaign_that_meets_an_error_no_handler_expected_campaigns_again(meta, prefix, monkeypatch):
    """A lease grant refused with an error other than 'unavailable' (etcd answers INTERNAL or
    CANCELLED around its own leader changes): the campaign's loop once ended there, silently, and
    that conductor never stood for leader again while it ran."""
    from tiercake.conductor.metadata import MetadataError

    real, failures = meta.grant_lease, []

    async def grant_lease(ttl: int) -> int:
        if not failures:
            failures.append(ttl)
            raise MetadataError("etcd refused: INTERNAL: a fault of the test")
        return await real(ttl)

    monkeypatch.setattr(meta, "grant_lease", grant_lease)
    election = await LeaderElection(meta, "conductor-1", ttl=1, prefix=prefix).start()
    try:
        await asyncio.wait_for(election.leading.wait(), 10)
        assert failures and election.is_leader
    finally:
        await election.resign()
