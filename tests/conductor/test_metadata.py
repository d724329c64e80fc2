"""One conformance suite for both metadata backends: a real etcd server, and the embedded one."""

import asyncio
import uuid

import pytest

from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.metadata import (
    TXN_OPS,
    Delete,
    LeaseNotFoundError,
    MetadataError,
    MetadataUnavailableError,
    Put,
    WatchEvent,
    follow,
    prefix_end,
)


@pytest.fixture
def backend(meta):
    return meta


@pytest.fixture
def ns():
    """A key prefix of this test's own on the shared etcd."""
    return f"/t/{uuid.uuid4().hex[:10]}/".encode()


async def test_an_etcd_backend_not_started_says_so():
    """Asked before ``start`` connected it: a typed error that says why (it was an AttributeError)."""
    backend = EtcdBackend(["127.0.0.1:1"])
    with pytest.raises(MetadataError, match="not started"):
        await backend.get(b"/x")
    with pytest.raises(MetadataError, match="not started"):
        await backend.commit([Put(b"/x", b"1")])


@pytest.mark.cluster
async def test_put_get_range_delete(backend, ns):
    r1 = await backend.put(ns + b"b", b"2")
    r2 = await backend.put(ns + b"a", b"1")
    await backend.put(ns + b"c/x", b"3")
    await backend.put(ns[:-1] + b"-other", b"not in the prefix")
    assert r2 > r1
    assert (await backend.get(ns + b"a")).value == b"1"
    assert await backend.get(ns + b"missing") is None
    kvs, revision = await backend.range(ns)
    assert [kv.key for kv in kvs] == [ns + b"a", ns + b"b", ns + b"c/x"]
    assert revision >= r2 and kvs[0].mod_revision == r2
    assert await backend.delete(ns + b"a") is True
    assert await backend.delete(ns + b"a") is False
    assert [kv.key for kv in (await backend.range(ns))[0]] == [ns + b"b", ns + b"c/x"]


@pytest.mark.cluster
async def test_commit_spans_several_transactions(backend, ns):
    ops = [Put(ns + b"k%04d" % i, b"v%d" % i) for i in range(3 * TXN_OPS + 7)]
    revision = await backend.commit(ops)
    kvs, _ = await backend.range(ns)
    assert len(kvs) == len(ops) and kvs[-1].value == b"v%d" % (len(ops) - 1)
    # each transaction is one revision: 4 transactions for 391 operations
    assert len({kv.mod_revision for kv in kvs}) == 4 and max(kv.mod_revision for kv in kvs) == revision
    await backend.commit([Delete(ns + b"k%04d" % i) for i in range(0, len(ops), 2)] + [Put(ns + b"new", b"x")])
    kvs, _ = await backend.range(ns)
    assert len(kvs) == len(ops) // 2 + 1


@pytest.mark.cluster
async def test_create_only_if_absent(backend, ns):
    assert await backend.create(ns + b"leader", b"me") is True
    assert await backend.create(ns + b"leader", b"you") is False
    assert (await backend.get(ns + b"leader")).value == b"me"


@pytest.mark.cluster
async def test_lease_keys_vanish_when_it_expires(backend, ns):
    lease = await backend.grant_lease(1)
    await backend.put(ns + b"node/a", b"alive", lease=lease)
    await backend.commit([Put(ns + b"node/b", b"alive", lease), Put(ns + b"durable", b"stays")])
    assert await backend.refresh_lease(lease) >= 1
    for _ in range(60):  # no more keep-alives: gone within the TTL (plus etcd's granularity)
        await asyncio.sleep(0.1)
        if await backend.get(ns + b"node/a") is None:
            break
    assert await backend.get(ns + b"node/a") is None and await backend.get(ns + b"node/b") is None
    assert (await backend.get(ns + b"durable")).value == b"stays"
    with pytest.raises(LeaseNotFoundError):
        await backend.refresh_lease(lease)


@pytest.mark.cluster
async def test_concurrent_renewals_each_get_their_own_answer(backend):
    """A fleet's keep-alives at once: every live lease is renewed, every revoked one says so, and one
    lease renewed twice at once answers both."""
    live = [await backend.grant_lease(30) for _ in range(300)]
    gone = [await backend.grant_lease(30) for _ in range(5)]
    for lease in gone:
        await backend.revoke_lease(lease)
    asked = live + gone + live[:10]
    results = await asyncio.gather(*(backend.refresh_lease(lease) for lease in asked), return_exceptions=True)
    assert all(isinstance(r, int) and r >= 1 for r in results[:300] + results[305:]), results
    assert all(isinstance(r, LeaseNotFoundError) for r in results[300:305]), results[300:305]
    for lease in live:
        await backend.revoke_lease(lease)


@pytest.mark.cluster
async def test_revoke_deletes_at_once(backend, ns):
    lease = await backend.grant_lease(30)
    await backend.put(ns + b"x", b"1", lease=lease)
    await backend.revoke_lease(lease)
    assert await backend.get(ns + b"x") is None
    await backend.revoke_lease(lease)  # revoking twice is not an error


@pytest.mark.cluster
async def test_put_with_unknown_lease_is_refused(backend, ns):
    with pytest.raises(LeaseNotFoundError):
        await backend.put(ns + b"x", b"1", lease=0x7777777)


@pytest.mark.cluster
async def test_watch_sees_changes_in_order(backend, ns):
    events = []

    async def follow():
        async for ev in backend.watch(ns):
            events.append((ev.kind, ev.key, ev.value))
            if len(events) == 4:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)  # the watch is registered
    await backend.put(ns + b"a", b"1")
    await backend.put(ns[:-1] + b"-elsewhere", b"x")
    await backend.commit([Put(ns + b"b", b"2"), Delete(ns + b"a")])
    await backend.delete(ns + b"b")
    await asyncio.wait_for(task, 10)
    assert events == [
        ("put", ns + b"a", b"1"),
        ("put", ns + b"b", b"2"),
        ("delete", ns + b"a", b""),
        ("delete", ns + b"b", b""),
    ]


@pytest.mark.cluster
async def test_watch_from_a_revision_misses_nothing(backend, ns):
    """A follower rebuilds from range() at revision R, then watches from R + 1."""
    await backend.put(ns + b"a", b"1")
    snapshot, revision = await backend.range(ns)
    await backend.put(ns + b"b", b"2")  # happens between the snapshot and the watch
    await backend.delete(ns + b"a")
    seen = []
    async for ev in backend.watch(ns, start_revision=revision + 1):
        seen.append((ev.kind, ev.key))
        if len(seen) == 2:
            break
    assert [kv.key for kv in snapshot] == [ns + b"a"]
    assert seen == [("put", ns + b"b"), ("delete", ns + b"a")]


def test_prefix_end():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\x00"


async def test_unreachable_etcd_is_a_clear_retryable_error():
    from tiercake.conductor.etcd_process import free_port

    meta = EtcdBackend([f"127.0.0.1:{free_port()}"], timeout=0.5, attempts=1)
    with pytest.raises(MetadataUnavailableError):
        await meta.start()
        await meta.put(b"/x", b"1")
    await meta.close()


@pytest.fixture(params=["embedded", "etcd"])
async def forgetful(request):
    """(a backend, a call that throws its history away up to now): etcd compacts; the embedded one
    keeps only its last few events, and the call writes past them."""
    from tiercake.conductor.embedded import EmbeddedBackend

    if request.param == "etcd":
        backend = await EtcdBackend(request.getfixturevalue("etcd").endpoints).start()

        async def forget() -> None:
            _, revision = await backend.range(b"/")
            await backend.client.kv.compact(revision, physical=True)

    else:
        backend = await EmbeddedBackend(history=8).start()

        async def forget() -> None:
            for i in range(10):
                await backend.put(b"/elsewhere/filler", str(i).encode())

    yield backend, forget
    await backend.close()


@pytest.mark.cluster
async def test_a_follower_whose_history_was_compacted_away_catches_up_with_the_state_now(forgetful, ns):
    """A view built at revision R, its watch away while keys change and the history is thrown away:
    ``follow`` reads the state as it is now, applies a delete for each key gone and a put for each
    there, and follows on (it used to die on CompactedError, freezing the view). With
    ``present=None`` (news, not state) nothing is replayed: only what comes after."""
    backend, forget = forgetful
    await backend.put(ns + b"a", b"1")
    await backend.put(ns + b"b", b"1")
    kvs, revision = await backend.range(ns)
    view = {kv.key: kv.value for kv in kvs}
    news: list[bytes] = []

    def apply(event: WatchEvent) -> None:
        if event.kind == "put":
            view[event.key] = event.value
        else:
            view.pop(event.key, None)

    await backend.delete(ns + b"a")
    await backend.put(ns + b"b", b"2")
    await backend.put(ns + b"c", b"1")
    await forget()
    following = [
        asyncio.create_task(follow(backend, ns, revision + 1, apply, "test", present=list(view))),
        asyncio.create_task(follow(backend, ns, revision + 1, lambda e: news.append(e.key), "news", present=None)),
    ]
    try:
        async with asyncio.timeout(10):
            while view != {ns + b"b": b"2", ns + b"c": b"1"}:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the news follower is watching by now
            await backend.put(ns + b"d", b"1")
            while ns + b"d" not in view or not news:
                await asyncio.sleep(0.01)
        assert view == {ns + b"b": b"2", ns + b"c": b"1", ns + b"d": b"1"}
        assert news == [ns + b"d"]
        assert all(not task.done() for task in following)  # still following
    finally:
        for task in following:
            task.cancel()
        await asyncio.gather(*following, return_exceptions=True)
