"""The etcd backend when etcd members die and come back (real etcd processes)."""

import asyncio

import pytest
from tiercake.conductor.etcd_process import EtcdCluster

from tiercake.conductor.etcd import EtcdBackend
from tiercake.conductor.metadata import MetadataUnavailableError, retry_unavailable


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
        seen = []

        async def follow():
            async for ev in meta.watch(b"/k/"):
                seen.append(ev.key)
                if ev.key == b"/k/b":
                    return

        watcher = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        member.stop()
        with pytest.raises(MetadataUnavailableError):
            await meta.put(b"/k/x", b"lost")
        member.start()  # same data directory: a restart, not a new cluster
        member.wait_ready()
        await retry_unavailable(lambda: meta.put(b"/k/b", b"2"), attempts=60)
        assert (await meta.get(b"/k/a")).value == b"1"  # durable across the restart
        await asyncio.wait_for(watcher, 20)  # and the watch resumed on its own
        assert seen[-1] == b"/k/b"
        await meta.close()
    finally:
        cluster.stop()
