"""The etcd backend when etcd members die and come back (real etcd processes)."""

import asyncio

import pytest

from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.etcd_process import EtcdCluster
from tiercake.conductor.metadata import MetadataUnavailableError, follow, retry_unavailable
from tiercake.messages import MemberInfo

pytestmark = pytest.mark.cluster  # every test here starts processes


async def test_three_member_cluster_survives_a_dead_member(tmp_path):
    cluster = EtcdCluster(tmp_path, size=3).start()
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=2.0).start()
        await meta.put(b"/k/1", b"before")
        cluster.members[0].stop(kill=True)  # SIGKILL one member: two of three keep the quorum
        await retry_unavailable(lambda: meta.put(b"/k/2", b"after"))
        assert (await meta.get(b"/k/1")).value == b"before"
        assert (await meta.get(b"/k/2")).value == b"after"
        await meta.close()
    finally:
        cluster.stop()


async def test_etcd_down_then_back_recovers_by_itself(tmp_path):
    cluster = EtcdCluster(tmp_path, size=1).start()
    member = cluster.members[0]
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=1.0, attempts=1).start()
        await meta.put(b"/k/a", b"1")
        seen: list[bytes] = []
        _, revision = await meta.range(b"/k/")
        # a watch cut by the outage ends (MetadataUnavailableError); follow asks again where it stopped
        watcher = asyncio.create_task(
            follow(meta, b"/k/", revision + 1, lambda ev: seen.append(ev.key), "test", present=None)
        )
        await asyncio.sleep(0.3)
        member.stop()
        with pytest.raises(MetadataUnavailableError):
            await meta.put(b"/k/x", b"lost")
        member.start()  # same data directory: a restart, not a new cluster
        member.wait_ready()
        await retry_unavailable(lambda: meta.put(b"/k/b", b"2"), attempts=60)
        assert (await meta.get(b"/k/a")).value == b"1"  # durable across the restart
        async with asyncio.timeout(20):  # and the watch resumed, by itself
            while b"/k/b" not in seen:
                await asyncio.sleep(0.05)
        watcher.cancel()
        assert seen[-1] == b"/k/b"
        await meta.close()
    finally:
        cluster.stop()


async def test_conductor_on_three_members_through_member_deaths_and_quorum_loss(tmp_path):
    """One member dies: reports go on. A second dies (no quorum): the conductor cannot renew its
    lease and stops leading; lookups still answer from memory, reports fail with a retryable 503.
    It comes back: the conductor leads again with the index it kept, and reports succeed again,
    with nothing lost; no placement was ever in etcd."""
    from aiohttp import web

    from tiercake.conductor.api import build_app
    from tiercake.conductor.client import Client, ConductorError
    from tiercake.conductor.service import Conductor

    def k(i: int) -> bytes:
        return i.to_bytes(4, "big") * 8

    cluster = EtcdCluster(tmp_path, size=3).start()
    meta = conductor = runner = None
    try:
        meta = await EtcdBackend(cluster.endpoints, timeout=1.0).start()
        conductor = await Conductor(meta, "c3", ttl=2).start()
        runner = web.AppRunner(build_app(conductor))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        await asyncio.wait_for(conductor.election.leading.wait(), 20)
        async with Client([url], timeout=5.0, retries=60) as client:
            await client.register(MemberInfo(node_id="n", tiers={"pool": 1 << 30}), ttl=40)
            await client.report("t", "n", "pool", [k(1)], [1])
            cluster.members[0].stop(kill=True)
            await client.report("t", "n", "pool", [k(2)], [1])  # two of three: still a quorum
            cluster.members[1].stop(kill=True)
            assert (await client.lookup("t", [k(1), k(2)]))["n"].length == 2  # from memory
            for _ in range(200):  # it cannot renew its lease: it steps down within its TTL
                if not conductor.is_leader:
                    break
                await asyncio.sleep(0.05)
            assert not conductor.is_leader
            assert (await client.lookup("t", [k(1), k(2)]))["n"].length == 2  # still from memory
            impatient = Client([url], timeout=5.0, retries=1)
            with pytest.raises(ConductorError) as err:
                await impatient.report("t", "n", "pool", [k(3)], [1])
            await impatient.close()
            assert err.value.status == 503
            cluster.members[1].start()
            await client.report("t", "n", "pool", [k(3)], [1])  # retried until the quorum is back
            assert (await client.lookup("t", [k(1), k(2), k(3)]))["n"].length == 3
        assert not (await meta.range(b"/tiercake/placements/"))[0]
    finally:
        if runner is not None:
            await runner.cleanup()
        if conductor is not None:
            await conductor.close()
        if meta is not None:
            await meta.close()
        cluster.stop()


async def test_a_watch_cut_by_a_transient_error_ends_so_its_follower_resumes_after_its_last_event():
    """etcd3aio resumes a cut watch itself from the last answer's header revision, which runs ahead of
    the events still to come (a creation answer carries the store's revision before the history):
    a conductor's view skipped a member put as a partition began. Our watch ends on the error instead,
    so ``follow`` asks again from the event after the last it applied. (One class, its stream faked.)"""
    from types import SimpleNamespace

    import grpc
    from etcd3aio.watch import WatchService

    def answer(revision: int, *keys: bytes):
        events = [SimpleNamespace(type=0, kv=SimpleNamespace(key=k, value=b"v", mod_revision=revision)) for k in keys]
        return SimpleNamespace(compact_revision=0, header=SimpleNamespace(revision=90), events=events)

    asked: list[int] = []

    class Call:  # a gRPC stream call: iterated, then cancelled
        def __init__(self, answers) -> None:
            self.answers = answers

        def __aiter__(self):
            return self.answers

        def cancel(self) -> None:
            pass

    class Stub:
        def Watch(self, requests, metadata=None):  # noqa: N802 - the gRPC stub's name
            async def stream():
                first = await anext(requests)
                asked.append(first.create_request.start_revision)
                if len(asked) == 1:  # the store is at 90; the history from 5 comes, then the cut
                    yield answer(5, b"/m/a")
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "cut"
                    )
                yield answer(6, b"/m/b")  # asked again from 6: the event the cut held back
                await asyncio.Future()

            return Call(stream())

    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never connected: its stub is the fake above
    service = WatchService(channel, reconnect_backoff_seconds=0.01, max_reconnect_backoff_seconds=0.01)
    service._stub = Stub()  # type: ignore[assignment]
    backend = EtcdBackend(["127.0.0.1:1"])
    backend._client = SimpleNamespace(watch=service)  # type: ignore[assignment]
    seen: list[bytes] = []
    task = asyncio.create_task(follow(backend, b"/m/", 5, lambda e: seen.append(e.key), "test", present=None))
    try:
        for _ in range(500):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await channel.close()
    assert seen == [b"/m/a", b"/m/b"] and asked == [5, 6], (seen, asked)  # the library alone would have asked from 91


async def test_a_view_follows_on_after_its_watch_fails_in_a_way_nobody_expected():
    """A watch that ends on an error no handler names (not 'unavailable', not 'compacted'): the view's
    ``follow`` once ended there, silently, and the conductor's view of the members froze while it
    served. It resumes after the last event it applied. (One function, its backend faked.)"""
    from tiercake.conductor.metadata import WatchEvent

    asked: list[int] = []

    class Backend:
        async def watch(self, prefix: bytes, start_revision: int = 0):
            asked.append(start_revision)
            if len(asked) == 1:
                yield WatchEvent("put", b"/m/a", b"v", 5)
                raise RuntimeError("aclose(): asynchronous generator is already running")
            yield WatchEvent("put", b"/m/b", b"v", 6)
            await asyncio.Future()

    seen: list[bytes] = []
    task = asyncio.create_task(follow(Backend(), b"/m/", 5, lambda e: seen.append(e.key), "test", present=None))
    try:
        for _ in range(300):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert seen == [b"/m/a", b"/m/b"] and asked == [5, 6], (seen, asked)
