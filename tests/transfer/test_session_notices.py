"""SESSION over a real socket: a worker tells a node a conversation's state, and the node's tiers
keep or demote its blocks by it (a session-aware pool spills the session expected back last to SSD,
where LRU would have spilled the oldest); hostile notices are refused without harm."""

import asyncio
import os
import uuid

import pytest
import torch
from paths import shm_file
from transfer_helpers import SECRET, authenticated_socket, closed, payload, raw_frame, read_frame

from tiercake.policies import LRU, SessionAware
from tiercake.tiers import PoolBackend, PoolRegion, SsdFilesBackend, Tier, TieredStore
from tiercake.tiers.pool import remove_pool
from tiercake.transfer import TransferEngine, TransferServer
from tiercake.transfer import protocol as p
from tiercake.transfer.protocol import SessionNotice

KB = 1024
BLOCK = 64 * KB


@pytest.fixture
async def session_node(tmp_path):
    """A node whose 4-block pool is session-aware (LRU among blocks of no session) over an SSD."""
    path = str(shm_file(f"test-sessions-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
    policy = SessionAware(LRU(), max_sessions=5_000)  # a table smaller than one flood below
    pool = Tier(PoolBackend(PoolRegion.create(path, 4 * BLOCK)), eviction=policy, high_watermark=1.0)
    store = await TieredStore([pool, Tier(SsdFilesBackend(tmp_path / "ssd", capacity_bytes=8 << 20))]).open()
    server = await TransferServer(store, SECRET, "node-b").start()
    engine = TransferEngine("worker", SECRET, transports=("tcp",))
    engine.add_peer("node-b", *server.address)
    yield store, server, engine
    await engine.close()
    await server.close()
    await store.close()
    remove_pool(path)


async def turn(engine, session: str, keys: list[bytes], resume_in: float | None, first: int) -> None:
    """One turn as a worker runs it: active, its blocks written, then paused (announced)."""
    active = await engine.session_event("node-b", SessionNotice(session=session, state="active"), keys)
    assert active.ok, active.error
    data = [payload(first + i, BLOCK) for i in range(len(keys))]
    assert all(r.ok for r in await engine.write_blocks("node-b", keys, data))
    notice = SessionNotice(session=session, state="paused", resume_in=resume_in)
    assert (await engine.session_event("node-b", notice, keys)).ok


async def test_the_pool_spills_the_session_expected_back_last_not_the_oldest(session_node):
    store, _, engine = session_node
    soon, late, now = [b"soon-0", b"soon-1"], [b"late-0", b"late-1"], [b"now-0", b"now-1"]
    await turn(engine, "soon", soon, resume_in=5, first=0)  # the oldest: LRU would spill these
    await turn(engine, "late", late, resume_in=3600, first=2)
    await turn(engine, "now", now, resume_in=None, first=4)
    assert [store.where(k) for k in soon + now] == [["pool"]] * 4
    assert [store.where(k)[-1] for k in late] == ["ssd", "ssd"] and not any("pool" in store.where(k) for k in late)
    pool_policy = store.tiers[0].eviction.describe()
    assert pool_policy["sessions"] == {"paused": 3} and pool_policy["held"] == 4
    out = torch.empty(BLOCK, dtype=torch.uint8)  # what was spilled reads back whole
    (read,) = await engine.read_blocks("node-b", [late[0]], [out])
    assert read.ok and torch.equal(out, payload(2, BLOCK))


async def test_a_closed_session_goes_first(session_node):
    store, _, engine = session_node
    await turn(engine, "a", [b"a-0", b"a-1"], resume_in=5, first=0)
    await turn(engine, "b", [b"b-0", b"b-1"], resume_in=3600, first=2)
    assert (await engine.session_event("node-b", SessionNotice(session="a", state="closed"), [])).ok
    await turn(engine, "c", [b"c-0"], resume_in=5, first=4)
    assert "pool" not in store.where(b"a-1") and "pool" in store.where(b"b-1")


async def test_a_notice_to_this_process_own_store_applies_without_a_socket(session_node):
    store, _, _ = session_node
    local = TransferEngine("node-b", SECRET, store=store)
    try:
        assert (await local.session_event("node-b", SessionNotice(session="x", state="active"), [b"k"])).ok
        assert store.tiers[0].eviction.describe()["sessions"] == {"active": 1}
    finally:
        await local.close()


@pytest.mark.parametrize(
    "body,said",
    [
        (b"\x00", b"too short"),
        (b"\xff\x00\x00\x00{}", b"past the body"),
        (p.SESSION_HEADER.pack(2) + b"{}" + p.encode_keys([]), b"bad SESSION notice"),
        (p.SESSION_HEADER.pack(40) + b'{"session":"s","state":"paused","resume_in":-1}'[:40], b"bad SESSION"),
    ],
)
async def test_hostile_notices_are_refused_and_the_node_serves_on(session_node, body, said):
    store, server, engine = session_node

    def by_hand():
        sock = authenticated_socket(server.address)
        sock.sendall(raw_frame(p.Op.SESSION, body))
        op, reply = read_frame(sock)
        return op, reply, closed(sock)

    op, reply, was_closed = await asyncio.to_thread(by_hand)
    assert op == p.Op.ERROR and said in reply and was_closed
    assert store.tiers[0].eviction.describe()["sessions"] == {}
    assert (await engine.session_event("node-b", SessionNotice(session="ok", state="active"), [])).ok


def test_a_notice_checks_its_numbers():
    for bad in (
        {"resume_in": float("nan")},
        {"resume_in": -1},
        {"retain_s": 0},
        {"retain_s": 1e12},
        {"priority": 10**6},
    ):
        with pytest.raises(ValueError):
            SessionNotice(session="s", state="paused", **bad)
    with pytest.raises(ValueError):
        SessionNotice(session="", state="paused")
    with pytest.raises(ValueError):
        SessionNotice(session="s", state="sleeping")


async def test_a_demoted_session_is_staged_back_into_the_pool_just_before_its_announced_resume(tmp_path):
    """Demoted to SSD while another session computes, a paused session announced back in 1.5 s is in
    the pool again about ``lead`` before that, read from memory by its next turn."""
    path = str(shm_file(f"test-prefetch-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
    pool = Tier(PoolBackend(PoolRegion.create(path, 8 * BLOCK)), eviction=SessionAware(LRU()), high_watermark=1.0)
    ssd = Tier(SsdFilesBackend(tmp_path / "ssd", capacity_bytes=8 << 20))
    store = await TieredStore([pool, ssd], session_prefetch_lead_s=0.5).open()
    server = await TransferServer(store, SECRET, "node-b").start()
    engine = TransferEngine("worker", SECRET, transports=("tcp",))
    engine.add_peer("node-b", *server.address)
    try:
        back = [b"back-0", b"back-1"]
        started = asyncio.get_running_loop().time()
        await turn(engine, "back", back, resume_in=1.5, first=0)
        busy = [f"busy-{i}".encode() for i in range(8)]  # computing: it pushes the paused one out
        assert (await engine.session_event("node-b", SessionNotice(session="busy", state="active"), busy)).ok
        assert all(r.ok for r in await engine.write_blocks("node-b", busy, [payload(10 + i, BLOCK) for i in range(8)]))
        assert all("pool" not in store.where(k) for k in back)
        assert (await engine.session_event("node-b", SessionNotice(session="busy", state="closed"), [])).ok
        while not all("pool" in store.where(k) for k in back):
            assert asyncio.get_running_loop().time() - started < 3, [store.where(k) for k in back]
            await asyncio.sleep(0.05)
        assert asyncio.get_running_loop().time() - started >= 0.9  # not before resume - lead
        assert store.session_prefetch.staged == 2
        out = torch.empty(BLOCK, dtype=torch.uint8)
        (read,) = await engine.read_blocks("node-b", [back[1]], [out])
        assert read.ok and torch.equal(out, payload(1, BLOCK))
    finally:
        await engine.close()
        await server.close()
        await store.close()
        remove_pool(path)


async def test_a_new_notice_replaces_the_planned_staging(session_node):
    store, _, engine = session_node
    await turn(engine, "s", [b"s-0"], resume_in=60, first=0)
    assert len(store.session_prefetch._planned) == 1
    assert (await engine.session_event("node-b", SessionNotice(session="s", state="closed"), [])).ok
    assert store.session_prefetch._planned == {}


async def test_retained_kv_is_found_in_the_tier_it_was_demoted_to_until_its_retention_ends(tmp_path):
    """Pool and SSD both session-aware: a paused session pushed out of the pool is found on SSD while
    its retention lasts; once it has ended, its blocks are the first the full SSD lets go, while a
    session still retained stays."""
    path = str(shm_file(f"test-retain-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
    policy = SessionAware(LRU(), max_sessions=5_000)
    pool = Tier(PoolBackend(PoolRegion.create(path, 4 * BLOCK)), eviction=policy, high_watermark=1.0)
    ssd = Tier(
        SsdFilesBackend(tmp_path / "ssd", capacity_bytes=4 * BLOCK), eviction=SessionAware(LRU()), high_watermark=1.0
    )
    store = await TieredStore([pool, ssd], session_prefetch_lead_s=0).open()
    server = await TransferServer(store, SECRET, "node-b").start()
    engine = TransferEngine("worker", SECRET, transports=("tcp",))
    engine.add_peer("node-b", *server.address)

    async def paused(session: str, keys: list[bytes], first: int, retain: float, back: float = 600) -> None:
        assert (await engine.session_event("node-b", SessionNotice(session=session, state="active"), keys)).ok
        data = [payload(first + i, BLOCK) for i in range(len(keys))]
        assert all(r.ok for r in await engine.write_blocks("node-b", keys, data))
        notice = SessionNotice(session=session, state="paused", resume_in=back, retain_s=retain)
        assert (await engine.session_event("node-b", notice, keys)).ok

    try:
        short, kept = [b"short-0", b"short-1"], [b"kept-0", b"kept-1"]
        await paused("short", short, 0, retain=1.0)
        await paused("kept", kept, 2, retain=600, back=60)  # expected back before the others
        await paused("p1", [b"p1-0", b"p1-1"], 4, retain=600)  # pressure: the pool holds four blocks
        await paused("p2", [b"p2-0", b"p2-1"], 6, retain=600)
        assert [store.where(k) for k in short] == [["ssd"], ["ssd"]]  # demoted, not dropped
        out = torch.empty(BLOCK, dtype=torch.uint8)
        (read,) = await engine.read_blocks("node-b", [short[1]], [out])  # found where it was demoted to
        assert read.ok and torch.equal(out, payload(1, BLOCK))
        await asyncio.sleep(1.2)  # "short" is past its retention: any notice advances the node's clock
        assert (await engine.session_event("node-b", SessionNotice(session="tick", state="closed"), [])).ok
        more = [f"more-{i}".encode() for i in range(4)]
        await paused("more", more, 8, retain=600)  # pushes four more blocks down into the full SSD
        assert not any(store.contains(k) for k in short)  # the expired session went first
        assert all(store.contains(k) for k in kept)  # the retained one stayed, in one tier or the other
    finally:
        await engine.close()
        await server.close()
        await store.close()
        remove_pool(path)


async def test_one_tenants_flood_of_empty_sessions_leaves_anothers_paused_sessions_in_place(session_node):
    """Over the socket, as workers tell a node: tenant b pauses a session holding two blocks, then
    tenant a pauses 10,000 sessions of no blocks (each expected back sooner, kept longer), twice what
    the whole table holds. It is bounded per tenant (``max_tenant_sessions``): a's own sessions make
    room for a's, b's stays paused and its blocks held (the table was shared and capped by count only:
    past the cap the longest retention survived, and a's empty sessions pushed out all of b's)."""
    store, _, engine = session_node
    policy = store.tiers[0].eviction
    b_keys = [b"b-0", b"b-1"]
    active = SessionNotice(session="b-session", state="active", tenant="b")
    assert (await engine.session_event("node-b", active, b_keys)).ok
    assert all(r.ok for r in await engine.write_blocks("node-b", b_keys, [payload(i, BLOCK) for i in range(2)]))
    paused = SessionNotice(session="b-session", state="paused", resume_in=600, retain_s=3600, tenant="b")
    assert (await engine.session_event("node-b", paused, b_keys)).ok

    async def flood(first: int, n: int) -> None:
        for i in range(first, first + n):
            notice = SessionNotice(session=f"a-{i}", state="paused", resume_in=1, retain_s=7200, tenant="a")
            assert (await engine.session_event("node-b", notice, [])).ok

    await asyncio.gather(*(flood(lo, 1_250) for lo in range(0, 10_000, 1_250)))
    described = policy.describe()
    assert described["sessions"]["paused"] <= policy.max_tenant_sessions + 1
    assert described["held"] == 2 and described["held_by_tenant"].get("b") == 2 * BLOCK  # b's still held
    assert [store.where(k) for k in b_keys] == [["pool"], ["pool"]]
