"""Node agents joined to a conductor: reports of what they hold, re-reports after a restart, pins
applied to the store, hot-block replication carried out between nodes."""

import signal

import numpy as np
import pytest
import yaml
from conductor_helpers import running_conductor
from node_helpers import k, wait_until
from node_helpers import ssd_node_config as node_config
from transfer_helpers import SECRET, payload, start_node, stop_node

from tiercake.conductor.client import Client
from tiercake.conductor.membership import MemberInfo
from tiercake.tiers import ObjectPinnedError
from tiercake.transfer import TransferEngine
from tiercake.workers.conductor_link import ConductorLink

KB = 1 << 10


@pytest.mark.cluster
async def test_node_reports_dies_and_re_reports_its_ssd_after_a_restart(processes, tmp_path):
    _, conductor = processes(["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--insecure"])
    url = conductor["url"]
    config = node_config(tmp_path, "node-s", url)
    env = {"TIERCAKE_SECRET": SECRET.decode(), "TIERCAKE_ADVERTISE_HOST": "127.0.0.1"}
    node, address = processes(["node", "--config", config], env)
    keys = [k(i) for i in range(6)]
    async with Client([url]) as client:
        engine = TransferEngine("writer", SECRET, transports=("tcp",))
        member = (await client.members())[0]  # listening on every address, advertised at one
        assert address["host"] == "0.0.0.0" and member.host == "127.0.0.1"
        engine.add_peer("node-s", member.host, member.port)
        results = await engine.write_blocks(
            "node-s", keys, [payload(i, 64 * KB) for i in range(6)], chain=True, tenant="acme"
        )
        assert all(r.ok for r in results), [r.error for r in results]
        await engine.close()
        # the node told the conductor, under the tenant the writer gave: only that tenant finds them
        found = await wait_until(lambda: client.lookup("acme", keys), what="the node's report")
        assert found["node-s"].length == 6 and found["node-s"].tiers == {"ssd": 6}
        assert await client.lookup("other", keys) == {}
        member = (await client.members())[0]
        assert (member.node_id, member.port, member.tiers) == ("node-s", address["port"], {"ssd": 64 << 20})

        node.send_signal(signal.SIGKILL)  # its lease runs out: the node and its blocks stop being offered
        await wait_until(lambda: _empty(client.lookup("acme", keys)), what="the dead node's blocks to vanish")
        assert await client.members() == []

        processes(["node", "--config", config], env)  # same SSD directory: the index is rebuilt
        found = await wait_until(lambda: client.lookup("acme", keys), what="the re-report")
        assert found["node-s"].length == 6 and found["node-s"].tiers == {"ssd": 6}


async def _empty(awaitable) -> bool:
    return not await awaitable


@pytest.fixture
async def conductor_api():
    async with running_conductor(
        replication="hot", replication_params={"base": 1, "threshold": 5.0, "maximum": 2}, heat_half_life=1.0
    ) as running:
        yield running


async def _linked_node(name: str, url: str):
    store, server = await start_node(name)
    client = Client([url])
    engine = TransferEngine(name, SECRET, store)
    member = MemberInfo(node_id=name, host=server.address[0], port=server.address[1], tiers={"pool": 8 << 20})
    link = await ConductorLink(client, member, store, ttl=1, engine=engine).start()
    return store, server, client, engine, link


async def _unlink(store, server, client, engine, link) -> None:
    await link.close()
    await client.close()
    await engine.close()
    await stop_node(store, server)


async def test_pins_reach_the_store_and_leave_it(conductor_api):
    url, conductor = conductor_api
    node = await _linked_node("node-p", url)
    store, *_ = node
    try:
        await store.put(k(1), payload(1, 4 * KB), tenant="t")
        async with Client([url]) as client:
            await wait_until(lambda: client.lookup("t", [k(1)]), what="the report")
            await client.pin("t", [k(1)])
            # the node learns of the pin at its next keep-alive and pins the block in its store
            await wait_until(lambda: _async(store.is_pinned(k(1))), what="the pin")
            with pytest.raises(ObjectPinnedError):
                await store.remove(k(1))
            await client.unpin("t", [k(1)])
            await wait_until(lambda: _async(not store.is_pinned(k(1))), what="the unpin")
            await store.remove(k(1))
            # the removal reaches the index too
            await wait_until(lambda: _empty(client.lookup("t", [k(1)])), what="the removal report")
    finally:
        await _unlink(*node)


async def _async(value):
    return value


async def test_hot_block_is_replicated_while_hot_and_dropped_when_it_cools(conductor_api):
    url, conductor = conductor_api
    a = await _linked_node("node-a", url)
    b = await _linked_node("node-b", url)
    try:
        await a[0].put(k(7), payload(7, 64 * KB), tenant="t")
        async with Client([url]) as client:
            await wait_until(lambda: client.lookup("t", [k(7)]), what="the report")

            # a hot block: lookups at well over 5/s make the policy want a second replica
            async def heat_and_check():
                for _ in range(10):
                    await client.lookup("t", [k(7)])
                return len(await client.lookup("t", [k(7)])) == 2

            await wait_until(heat_and_check, what="a second replica")
            assert b[0].contains(k(7))  # node-b pulled it from node-a over the transfer engine
            assert np.array_equal(await b[0].get(k(7)), payload(7, 64 * KB).numpy())
            # no more lookups (the index is read directly, which counts no access): the rate decays
            # (half-life 1 s) and one replica is dropped, from its node's store and from the index
            await wait_until(
                lambda: _async(len({r.node for r in conductor.index.holders("t", k(7))}) == 1),
                timeout=20,
                what="the drop",
            )
            assert a[0].contains(k(7)) != b[0].contains(k(7))
    finally:
        await _unlink(*b)
        await _unlink(*a)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.cluster
async def test_a_node_agent_serves_its_own_metrics(processes, tmp_path):
    """The node agent's /metrics (transfer.metrics_port): its tiers as its store sees them at the scrape
    and its transfer server's counts, in Prometheus' naming; open to scrapers by default, behind the
    cluster token when conductor.metrics_open is false."""
    import aiohttp

    from tiercake.config import TiercakeConfig

    path = tmp_path / "node-m.yaml"
    path.write_text(
        "node_id: node-m\nstore:\n  layout: null\n  tiers:\n"
        f"    - {{kind: ssd, capacity: 64MiB, path: {tmp_path / 'ssd'}}}\n"
        "transfer: {host: 127.0.0.1, metrics_port: 0}\n"
    )
    env = {"TIERCAKE_SECRET": SECRET.decode()}
    _, address = processes(["node", "--config", str(path)], env)
    url = address["metrics_url"]
    async with aiohttp.ClientSession() as http:

        async def scrape() -> dict:
            async with http.get(url) as resp:
                assert resp.status == 200
                return _samples(await resp.text())

        before = await scrape()
        tier = (("member", "node-m"), ("tier", "ssd"))
        assert before[("tiercake_tier_blocks", tier)] == 0
        assert before[("tiercake_tier_capacity_bytes", tier)] == 64 << 20
        engine = TransferEngine("writer", SECRET, transports=("tcp",))
        engine.add_peer("node-m", address["host"], address["port"])
        keys = [k(i) for i in range(3)]
        results = await engine.write_blocks("node-m", keys, [payload(i, 64 * KB) for i in range(3)])
        assert all(r.ok for r in results)
        buffers = [np.empty(64 * KB, np.uint8) for _ in keys]
        assert all(r.ok for r in await engine.read_blocks("node-m", keys, buffers))
        await engine.close()
        after = await scrape()
        assert after[("tiercake_tier_blocks", tier)] == 3 and after[("tiercake_tier_used_bytes", tier)] >= 3 * 64 * KB
        assert after[("tiercake_tier_hits_total", tier)] >= 3  # a counter, named as Prometheus names them
        assert after[("tiercake_transfer_served_bytes_total", (("member", "node-m"),))] == 3 * 64 * KB

    config = TiercakeConfig.model_validate(yaml.safe_load(path.read_text()))
    assert config.conductor.metrics_open  # the default: scrapers need no token
    path.write_text(
        path.read_text().replace("node_id: node-m", "node_id: node-t").replace("/ssd}", "/ssd-t}")
        + "conductor: {metrics_open: false}\n"
    )
    _, address = processes(["node", "--config", str(path)], {**env, "TIERCAKE_TOKEN": "tok-m"})
    async with aiohttp.ClientSession() as http:
        async with http.get(address["metrics_url"]) as resp:
            assert resp.status == 401
        async with http.get(address["metrics_url"], headers={"Authorization": "Bearer tok-m"}) as resp:
            assert resp.status == 200 and "tiercake_tier_blocks" in await resp.text()
