"""The conductor's HTTP API and client: in process, and as real processes with a leader killed."""

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from conductor_helpers import leader_and_follower, running_conductor
from conftest import block

from tiercake.conductor.client import Client, ConductorError
from tiercake.conductor.service import Conductor
from tiercake.messages import MAX_KEYS, ErrorReply, MemberInfo


def _batch(keys: bytes, sizes: list[int]) -> bytes:
    body = {"tenant": "t", "node": "n", "tier": "pool", "keys": base64.b64encode(keys).decode(), "sizes": sizes}
    return json.dumps(body).encode()


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
async def api():
    async with running_conductor(tokens=["s3cret-token"]) as running:
        yield running


async def test_client_commit_lookup_remove(api):
    url, conductor = api
    async with Client([url], token="s3cret-token") as client:
        lease_a = await client.register(MemberInfo(node_id="node-a", tiers={"pool": 1 << 20}), ttl=5)
        await client.register(MemberInfo(node_id="node-b", tiers={"ssd": 1 << 20}), ttl=5)
        assert await client.report("t", "node-a", "pool", [k(i) for i in range(4)], [4096] * 4) == 4
        assert await client.report("t", "node-a", "pool", [k(i) for i in range(4)], [4096] * 4) == 0  # known
        await client.report("t", "node-b", "ssd", [k(0), k(1)], [4096] * 2)
        found = await client.lookup("t", [k(i) for i in range(5)])
        assert {n: p.length for n, p in found.items()} == {"node-a": 4, "node-b": 2}
        assert found["node-b"].tiers == {"ssd": 2}
        # removing what the node holds, and what the index never had: counted apart, no error
        assert await client.remove("t", "node-a", "pool", [k(3), k(77)]) == (1, 1)
        assert (await client.lookup("t", [k(i) for i in range(5)]))["node-a"].length == 3
        assert (await client.leader()).conductor_id == "c1"
        members = {m.node_id: m for m in await client.members()}
        assert members["node-a"].lease == lease_a and members["node-b"].tiers == {"ssd": 1 << 20}
        # a node that never registered, or a tier the node does not have: refused, nothing recorded
        for node, tier in (("node-z", "pool"), ("node-b", "pool")):
            with pytest.raises(ConductorError) as err:
                await client.report("t", node, tier, [k(9)], [4096])
            assert err.value.status == 409
        assert not await client.lookup("t", [k(9)])
        # keys of one tenant mean nothing to another
        assert await client.lookup("other", [k(i) for i in range(5)]) == {}
        held = await client.node_blocks("node-a")
        assert sorted(b.key for b in held) == sorted(k(i).hex() for i in range(3))
        assert all(b.tenant == "t" and b.tier == "pool" and not b.pinned for b in held)


async def test_pins_are_durable_listed_per_node_and_expire(api):
    url, conductor = api
    async with Client([url], token="s3cret-token") as client:
        await client.register(MemberInfo(node_id="node-a", tiers={"pool": 1 << 20}), ttl=5)
        await client.report("t", "node-a", "pool", [k(1), k(2)], [10, 10])
        version, pins = await client.node_pins("node-a")
        assert pins == []
        assert await client.pin("t", [k(1)]) == 1
        await client.pin("t", [k(2)], ttl=1)
        version2, pins = await client.node_pins("node-a")
        assert version2 > version and sorted(pins) == [("t", k(1)), ("t", k(2))]
        assert [b.pinned for b in sorted(await client.node_blocks("node-a"), key=lambda b: b.key)] == [True, True]
        # a new conductor on the same backend knows the pins (they are in the backend, not in memory)
        other = await Conductor(conductor.meta, "c2").start()
        assert other.pins == {("t", k(1)), ("t", k(2))}
        await other.close()
        deadline = time.monotonic() + 10
        while len((await client.node_pins("node-a"))[1]) == 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert (await client.node_pins("node-a"))[1] == [("t", k(1))]  # the ttl pin expired
        await client.unpin("t", [k(1)])
        assert (await client.node_pins("node-a"))[1] == []


async def test_bad_requests_are_clear_4xx(api):
    url, _ = api
    headers = {"Authorization": "Bearer s3cret-token"}
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:  # health needs no token
            assert resp.status == 200
        async with http.post(url + "/v1/placements/lookup", json={"tenant": "t", "keys": []}) as resp:
            assert resp.status == 401 and "bearer token" in (await resp.json())["error"]["message"]
        async with http.post(
            url + "/v1/placements/lookup", headers={"Authorization": "Bearer wrong"}, json={"tenant": "t", "keys": []}
        ) as resp:
            assert resp.status == 401
        cases = [
            ("/v1/placements/lookup", b"{not json"),
            ("/v1/placements/lookup", b'{"tenant": "\xff\xfe", "keys": []}'),  # not UTF-8 (was a 500)
            ("/v1/placements/commit", b"\xff"),
            ("/v1/placements/lookup", json.dumps({"tenant": "t"}).encode()),
            ("/v1/placements/lookup", json.dumps({"tenant": "a/b", "keys": []}).encode()),
            ("/v1/placements/lookup", json.dumps({"tenant": "t", "keys": ["zz"]}).encode()),
            ("/v1/placements/report", json.dumps({"tenant": "t", "node": "n", "tier": "pool", "blocks": []}).encode()),
            (
                "/v1/placements/commit",
                json.dumps(
                    {"tenant": "t", "node": "n", "tier": "pool", "blocks": [{"key": "abc", "size": 1}]}
                ).encode(),
            ),
            (
                "/v1/placements/commit",
                json.dumps(
                    {"tenant": "t", "node": "n", "tier": "pool", "blocks": [{"key": "ab", "size": -1}]}
                ).encode(),
            ),
            # keys back to back, base64: not whole 32-byte keys, not base64, sizes that do not match
            ("/v1/placements/report", _batch(b"k" * 31, [1])),
            ("/v1/placements/report", json.dumps({"tenant": "t", "node": "n", "tier": "pool", "keys": "!!"}).encode()),
            ("/v1/placements/report", _batch(k(1) + k(2), [1])),
            ("/v1/placements/report", _batch(k(1), [1 << 32])),  # the index keeps 32 bits of size
            ("/v1/placements/report", _batch(k(1), [])),  # an addition without its size
            ("/v1/placements/report", _batch(k(1), [1]).replace(b"[1]", b"[NaN]")),
            ("/v1/placements/remove", _batch(k(1), [1])),  # a removal takes no sizes
            ("/v1/placements/remove", _batch(b"", [])),
            (
                "/v1/placements/lookup",
                json.dumps({"tenant": "t", "keys": base64.b64encode(b"k" * 33).decode()}).encode(),
            ),
        ]
        for path, body in cases:
            async with http.post(url + path, headers=headers, data=body) as resp:
                assert resp.status == 400, (path, body, await resp.text())
                ErrorReply.model_validate(await resp.json())  # the one error format
        async with http.post(url + "/v1/placements/lookup", headers=headers, data=b"x" * (9 << 20)) as resp:
            assert resp.status == 413 and "body size" in ErrorReply.model_validate(await resp.json()).error.message
        async with http.get(url + "/v1/nope", headers=headers) as resp:  # aiohttp's own errors too
            assert resp.status == 404 and ErrorReply.model_validate(await resp.json()).error.type == "not_found_error"
        async with http.get(url + "/v1/placements/lookup", headers=headers) as resp:
            assert resp.status == 405 and ErrorReply.model_validate(await resp.json()).error.message
        async with http.get(url + "/ready", headers=headers) as resp:
            assert resp.status == 200 and (await resp.json())["ready"]
        async with http.get(url + "/metrics") as resp:  # scrapers carry no token: metrics hold no tenant data
            text = await resp.text()
            assert resp.status == 200 and "tiercake_is_leader 1.0" in text and "tiercake_index_replicas" in text
            assert "# TYPE tiercake_leader_changes_total counter" in text and "tiercake_leader_terms_total 1.0" in text
            for name in (
                "tiercake_placement_ops_total",
                "tiercake_placement_batch_keys_bucket",
                "tiercake_leader_changes",
                "tiercake_lookup_seconds_bucket",
                'tiercake_members{role="node"}',
            ):
                assert name in text, name
    async with Client([url], token="s3cret-token") as client:
        with pytest.raises(ConductorError) as err:
            await client.lookup("a/b", [k(1)])
        assert err.value.status == 400


@pytest.fixture
def conductors(etcd, tmp_path):
    procs = []

    def start(name: str):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercake.cli",
                "conductor",
                "--etcd",
                ",".join(etcd.endpoints),
                "--ttl",
                "1",
                "--listen",
                "127.0.0.1:0",
                "--api-listen",
                "127.0.0.1:0",
                "--insecure",  # elections, not auth
                "--id",
                name,
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"{name}.log").open("w"),  # a file: a pipe nobody reads would stall it once full
        )
        procs.append(proc)
        line = proc.stdout.readline()
        assert line, (tmp_path / f"{name}.log").read_text()[-2000:]
        return proc, json.loads(line)["url"]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def _clean_slate(etcd) -> None:
    """No election or placements left on the shared etcd by an earlier test."""
    from tiercake.conductor.etcd import EtcdBackend

    meta = await EtcdBackend(etcd.endpoints).start()
    for prefix in (b"/tiercake/leader/", b"/tiercake/placements/"):
        for kv in (await meta.range(prefix))[0]:
            await meta.delete(kv.key)
    await meta.close()


class Member:
    """A node as the conductors meet it: a store whose every change its ``ConductorLink`` reports,
    re-reporting to a new leader as real members do. A change is acknowledged once ``settle``
    returns (the conductor took it)."""

    def __init__(self, store, urls: list[str], name: str = "node-a", ttl: int = 2) -> None:
        from tiercake.workers.conductor_link import ConductorLink

        self.store = store
        tiers = {t.name: 1 << 30 for t in store.tiers}
        self.link = ConductorLink(Client(urls, timeout=2.0), MemberInfo(node_id=name, tiers=tiers), store, ttl=ttl)

    async def __aenter__(self) -> "Member":
        await self.link.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.link.close(leave=False)
        await self.link.client.close()

    async def add(self, keys: list[bytes], tier: str) -> None:
        for key in keys:
            await self.store.put(key, block(0), tier=tier, tenant="t")

    async def settle(self) -> None:
        while True:  # retried through a failover, as the link's own loop does
            try:
                return await self.link.send_reports()
            except ConductorError:
                await asyncio.sleep(0.1)


async def _held(client: Client, keys: list[bytes], node: str = "node-a") -> int:
    found = (await client.lookup("t", keys)).get(node)
    return found.length if found else 0


async def _until(check, timeout: float = 15.0) -> float:
    """Seconds until ``check()`` (a coroutine function) answers True; AssertionError after ``timeout``."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout, "not within the time allowed"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.cluster
async def test_leader_killed_standby_takes_over_with_every_placement(conductors, etcd, make_store):
    """Placements live in the conductors' memory, none in etcd: the follower mirrors the leader, and
    when the leader is SIGKILLed it leads with its mirror at once and the member re-reports what the
    mirror may lack; every block acknowledged before the kill is listed within the staleness bound,
    from every tier, and a member that leaves takes its placements along."""
    await _clean_slate(etcd)  # this test's election on the shared etcd
    from tiercake.conductor.etcd import EtcdBackend

    first, url1 = conductors("c-one")
    await asyncio.sleep(1.0)  # c-one wins the election
    second, url2 = conductors("c-two")
    store = await make_store(gpu=64, pool=256, ssd=None)
    gpu, pool = [k(i) for i in range(40)], [k(100 + i) for i in range(100)]
    async with Client([url2, url1]) as client, Member(store, [url2, url1]) as member:  # found the leader itself
        await member.add(gpu, "gpu")
        await member.add(pool, "pool")
        await member.settle()
        assert (await client.leader()).conductor_id == "c-one"
        meta = await EtcdBackend(etcd.endpoints).start()
        assert not (await meta.range(b"/tiercake/placements/"))[0]  # no placement in etcd
        await meta.close()
        first.send_signal(signal.SIGKILL)
        started = time.monotonic()
        await _until(lambda: _leads(client, "c-two"))
        await _until(lambda: _both(client, gpu, pool), timeout=STALE_BOUND_S + 5)
        assert time.monotonic() - started < 2 * 1 + 3 + STALE_BOUND_S  # two leader TTLs, etcd's rounding, a re-report
    async with Client([url2]) as client:
        await _until(lambda: _none(client, gpu + pool))  # the member stopped: its lease lapsed, its blocks went


async def _leads(client: Client, name: str) -> bool:
    leader = await client.leader()
    return leader is not None and leader.conductor_id == name


async def _both(client: Client, gpu: list[bytes], pool: list[bytes]) -> bool:
    return await _held(client, gpu) == len(gpu) and await _held(client, pool) == len(pool)


async def _none(client: Client, keys: list[bytes]) -> bool:
    return not any([await client.lookup("t", [key]) for key in keys])


async def test_many_chains_looked_up_at_once_with_their_sizes(api):
    url, _ = api
    async with Client([url], token="s3cret-token") as client:
        await client.register(MemberInfo(node_id="node-a", tiers={"pool": 1 << 20}), ttl=5)
        await client.report("t", "node-a", "pool", [k(1), k(2)], [100, 200])
        await client.report("t", "node-a", "pool", [k(5)], [500])
        chains = [[k(1), k(2), k(3)], [k(5)], [k(9)]]
        many = await client.lookup_many("t", chains, sizes=True)
        assert [{n: h.length for n, h in f.items()} for f in many] == [{"node-a": 2}, {"node-a": 1}, {}]
        assert many[0]["node-a"].sizes == [100, 200] and many[1]["node-a"].sizes == [500]
        single = await client.lookup("t", chains[0])  # the same answer as one chain alone, without sizes
        assert single["node-a"].length == 2 and single["node-a"].sizes is None
        with pytest.raises(ConductorError) as err:  # the bound is on every key of the request together
            await client.lookup_many("t", [[k(i) for i in range(MAX_KEYS // 2 + 1)]] * 2)
        assert 400 <= err.value.status < 500


async def test_begin_commit_revoke_and_their_refusals(api):
    url, conductor = api
    from tiercake.conductor.membership import MemberInfo, Registration

    regs = [
        await Registration(conductor.meta, MemberInfo(node_id=f"node-{n}", tiers={"pool": 10_000}), ttl=5).start()
        for n in "abc"
    ]
    await conductor.members.wait_for(lambda m: len(m.alive("node")) == 3, 10)
    async with Client([url], token="s3cret-token") as client:
        targets = await client.begin_put("t", [k(1), k(2), k(3)], [4000, 4000, 4000])
        # least used: three blocks spread over three empty nodes, one replica each
        assert sorted(n for nodes in targets.values() for n in nodes) == ["node-a", "node-b", "node-c"]
        node = targets[k(1)][0]
        assert await client.commit("t", node, "pool", [k(1)], [4000]) == 1
        assert (await client.lookup("t", [k(1)]))[node].length == 1
        with pytest.raises(ConductorError) as err:
            await client.commit("t", node, "pool", [k(1)], [4000])  # double commit
        assert err.value.status == 409 and "no put in progress" in str(err.value)
        with pytest.raises(ConductorError) as err:
            await client.commit("t", "node-z", "pool", [k(9)], [1])  # commit of an unknown put
        assert err.value.status == 409
        other = targets[k(2)][0]
        assert await client.revoke("t", other, "pool", [k(2)]) == 1
        with pytest.raises(ConductorError) as err:
            await client.commit("t", other, "pool", [k(2)], [4000])  # commit after revoke
        assert err.value.status == 409
        assert (await client.begin_put("t", [k(1)], [4000]))[k(1)] == [node]  # placed: stays where it is
        with pytest.raises(ConductorError) as err:
            await client.begin_put("t", [k(50)], [20_000])  # bigger than any node's free space
        assert err.value.status == 507
        for i, name in enumerate(["node-a", "node-b", "node-c"]):  # every pool full by the index's count
            await client.report("t", name, "pool", [k(70 + i)], [6_000 if name == node else 9_500])
        with pytest.raises(ConductorError) as err:
            await client.begin_put("t", [k(80)], [5_000])
        assert err.value.status == 507
        # a cache's put: the node evicts to make room, so any node whose pool can hold the block will do
        placed = await client.begin_put("t", [k(80)], [5_000], evict=True)
        assert len(placed[k(80)]) == 1 and placed[k(80)][0] in {"node-a", "node-b", "node-c"}
        with pytest.raises(ConductorError) as err:
            await client.begin_put("t", [k(81)], [20_000], evict=True)  # no pool that large
        assert err.value.status == 507
    for reg in regs:
        await reg.stop()


def test_placement_strategies_and_replication():
    from tiercake.policies import HotReplicas, LeastUsed, LocalFirst, NodeLoad, RandomPlacement, create_placement

    loads = [NodeLoad("a", 100, 90), NodeLoad("b", 100, 10), NodeLoad("c", 200, 100)]
    assert LeastUsed().choose(loads, 5, 2) == ["b", "c"]
    assert LeastUsed().choose(loads, 50, 3) == ["b", "c"]  # a has no room for 50
    assert LocalFirst().choose(loads, 5, 2, local="a") == ["a", "b"]
    assert sorted(RandomPlacement(seed=1).choose(loads, 5, 3)) == ["a", "b", "c"]
    assert isinstance(create_placement("local_first"), LocalFirst)
    hot = HotReplicas(base=1, threshold=10, maximum=3)
    # up as it heats; down one level at a time, only once clearly below the level that raised it
    assert [hot.replicas("k", r) for r in (0, 12, 25, 40, 18, 14, 9, 2)] == [1, 2, 3, 3, 3, 3, 2, 1]


@pytest.mark.cluster
async def test_leader_killed_mid_batch_loses_no_acknowledged_placement(conductors, etcd, make_store):
    """Sixteen writers add blocks and wait for their reports to be taken while the leader is
    SIGKILLed: once the member has met the new leader, every acknowledged block is listed."""
    first, url1 = conductors("m-one")
    async with Client([url1]) as client:
        await wait_for_leader(client, "m-one")
    second, url2 = conductors("m-two")
    acknowledged: list[bytes] = []
    store = await make_store(gpu=None, pool=8192, ssd=None)  # room for every block: none is evicted

    async def writer(member: Member, w: int) -> None:
        for n in range(6):
            keys = [k(100_000 + w * 1000 + n * 10 + i) for i in range(10)]
            await member.add(keys, "pool")
            await member.settle()  # retried on the new leader
            acknowledged.extend(keys)

    async with Client([url1, url2], timeout=2.0) as client, Member(store, [url1, url2], "node-m") as member:
        writers = [asyncio.create_task(writer(member, w)) for w in range(16)]
        while len(acknowledged) < 300:
            await asyncio.sleep(0.005)
        first.send_signal(signal.SIGKILL)  # with reports in flight
        assert len(acknowledged) < 16 * 6 * 10
        await asyncio.gather(*writers)
        assert len(acknowledged) == 16 * 6 * 10
        await wait_for_leader(client, "m-two")

        async def all_listed() -> bool:
            found = await client.lookup_many("t", [[key] for key in acknowledged])
            return all("node-m" in f for f in found)

        assert {c.key for c in store.holdings()} == set(acknowledged)  # the store evicted none
        await _until(all_listed, timeout=STALE_BOUND_S + 5)


@pytest.mark.cluster
async def test_a_paused_leader_does_not_act_as_leader_when_it_resumes(conductors, etcd):
    first, url1 = conductors("p-one")
    async with Client([url1]) as client:
        await wait_for_leader(client, "p-one")  # the previous test's leader, if any, has to expire first
        await client.register(MemberInfo(node_id="node-p", tiers={"pool": 1 << 30}), ttl=40)
    second, url2 = conductors("p-two")
    first.send_signal(signal.SIGSTOP)  # a partition, as far as etcd can tell
    try:
        async with Client([url2]) as client:
            await client.report("t", "node-p", "pool", [k(5000)], [1])  # p-two takes over meanwhile
            assert (await client.leader()).conductor_id == "p-two"
    finally:
        first.send_signal(signal.SIGCONT)
    # at once after resuming, before its own renewal could have failed: it refuses writes
    async with aiohttp.ClientSession() as http:
        body = {"tenant": "t", "node": "node-p", "tier": "pool", "blocks": [{"key": k(5001).hex(), "size": 1}]}
        async with http.post(url1 + "/v1/placements/report", json=body) as resp:
            assert resp.status == 503, await resp.text()
            assert resp.headers["X-Tiercake-Leader"] == url2
        async with http.get(url1 + "/metrics") as resp:
            assert "tiercake_is_leader 0.0" in await resp.text()


@pytest.mark.cluster
async def test_conductor_runs_from_the_config_file_with_tokens_from_the_environment(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "store: {tiers: [{kind: pool, capacity: 1MiB}]}\n"
        "conductor: {host: 127.0.0.1, port: 0, token_env: MY_TOKENS, placement: random}\n"
        "serving: {port: 0}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiercake.cli", "conductor", "--config", str(config), "--id", "cfg"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "MY_TOKENS": "tok-1 tok-2"},
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()[-2000:]
        url = json.loads(line)["url"]
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/leader") as resp:
                assert resp.status == 401
        async with Client([url], token="tok-2") as client:
            leader = await wait_for_leader(client)
            assert leader.conductor_id == "cfg"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0  # a clean stop


async def wait_for_leader(client, name: str | None = None):
    for _ in range(100):
        leader = await client.leader()
        if leader and name in (None, leader.conductor_id):
            return leader
        await asyncio.sleep(0.1)
    raise AssertionError(f"no leader {name or ''}")


@pytest.mark.cluster
async def test_the_openai_api_on_its_own_port_apart_from_the_control_api(tmp_path):
    """serving.port set: completions and models there (no control token), the control endpoints only
    on the control port (token), so a firewall can open one port and keep the other internal."""
    from tiercake.conductor.etcd_process import free_port

    public_port = free_port()
    config = tmp_path / "c.yaml"
    config.write_text(
        "store: {tiers: [{kind: pool, capacity: 1MiB}]}\n"
        "conductor: {host: 127.0.0.1, port: 0, token_env: MY_TOKENS}\n"
        f"serving: {{host: 127.0.0.1, port: {public_port}}}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiercake.cli", "conductor", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "MY_TOKENS": "tok-1"},
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()[-2000:]
        announced = json.loads(line)
        control, public = announced["url"], announced["api_url"]
        assert public.endswith(f":{public_port}")
        token = {"Authorization": "Bearer tok-1"}
        async with aiohttp.ClientSession() as http:
            async with http.get(public + "/v1/models") as resp:  # no worker yet: the model is not served
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "no_worker" and resp.headers["Retry-After"]
            async with http.post(public + "/v1/completions", json={"model": "nope", "prompt": "x"}) as resp:
                assert resp.status == 404 and "model" in (await resp.json())["error"]["message"]
            for method, path in (
                ("GET", "/v1/cluster"),
                ("POST", "/v1/flush"),
                ("GET", "/v1/members"),
                ("POST", "/v1/placements/lookup"),
                ("GET", "/metrics"),
            ):
                async with http.request(method, public + path, headers=token) as resp:
                    assert resp.status in (404, 405), (path, resp.status)
            for _ in range(50):  # the control port: ready once a leader is known
                async with http.get(control + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert resp.status == 200
            async with http.get(public + "/ready") as resp:  # the public port: not before a worker can serve
                body = await resp.json()
                assert resp.status == 503 and "no worker" in body["reason"], body
            worker = {
                "member": {
                    "node_id": "w1",
                    "role": "prefill",
                    "host": "127.0.0.1",
                    "port": 9,
                    "url": "http://127.0.0.1:9",
                    "tiers": {"gpu": 1},
                },
                "ttl": 40,
            }
            async with http.post(control + "/v1/members/register", json=worker, headers=token) as resp:
                assert resp.status == 200, await resp.text()
            for _ in range(50):
                async with http.get(public + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert resp.status == 200, await resp.text()
            async with http.get(control + "/v1/cluster") as resp:
                assert resp.status == 401
            async with http.get(control + "/v1/cluster", headers=token) as resp:
                assert resp.status == 200 and "members" in await resp.json()
            async with http.post(control + "/v1/completions", headers=token, json={"prompt": "x"}) as resp:
                assert resp.status in (404, 405)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


async def test_a_followers_lookups_reach_the_leaders_access_rates(tmp_path):
    """With several conductors behind one Service, a follower's front serves lookups too: it sends
    the accesses it counted to the leader, whose rates drive hot replication."""
    async with leader_and_follower() as (leader, follower):
        keys = [k(i) for i in range(4)]
        leader.index.add_many("t", keys, "node-a", "pool", [1] * 4)
        for _ in range(100):  # the follower's index follows the leader's writes
            if follower.index.lookup("t", keys):
                break
            await asyncio.sleep(0.05)
        for _ in range(30):
            follower.lookup("t", keys)
        assert not leader.heat.items()  # nothing looked up on the leader itself
        for _ in range(60):
            rates = dict(leader.heat.items())
            if len(rates) == 4:
                break
            await asyncio.sleep(0.1)
        assert set(rates) == {("t", key) for key in keys} and min(rates.values()) > 0
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer peer-token"}) as http:
            async with http.post(
                follower.url + "/v1/heat", json={"hits": [{"tenant": "t", "key": keys[0].hex(), "count": 1}]}
            ) as resp:
                assert resp.status == 503  # only the leader takes counts
            async with http.post(
                leader.url + "/v1/heat", json={"hits": [{"tenant": "t", "key": "zz", "count": 1}]}
            ) as resp:
                assert resp.status == 400
            async with http.post(leader.url + "/v1/heat", json={"hits": []}) as resp:
                assert resp.status == 400
            # the packed form: one count a key, each at least 1
            two = base64.b64encode(keys[0] + keys[1]).decode()
            for counts in ([1], [1, 0], [1, 1, 1]):
                packed = {"packed": [{"tenant": "t", "keys": two, "counts": counts}]}
                async with http.post(leader.url + "/v1/heat", json=packed) as resp:
                    assert resp.status == 400, counts
            async with http.post(
                leader.url + "/v1/heat", json={"packed": [{"tenant": "t", "keys": two, "counts": [2, 5]}]}
            ) as resp:
                assert resp.status == 200 and (await resp.json())["accepted"] == 2


async def test_a_follower_mirrors_the_leaders_index_over_http(monkeypatch):
    """Only the leader hears of placements; a follower's lookups see them through its feed from the
    leader (a snapshot, page by page, then each change), a worker that leaves is forgotten by both,
    and no placement is ever written to the backend."""
    from tiercake.conductor import placement

    monkeypatch.setattr(placement, "SNAPSHOT_ROWS", 4)  # the snapshot below takes several pages

    async def seen(conductor: Conductor, keys: list[bytes], want: int) -> int:
        for _ in range(100):
            found = conductor.index.lookup("t", keys).get("w")
            if (found.length if found else 0) == want:
                break
            await asyncio.sleep(0.05)
        return found.length if found else 0

    async with leader_and_follower() as (leader, follower):
        keys = [k(i) for i in range(6)]
        async with Client([leader.url], token="peer-token") as client:
            lease = await client.register(MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
            writes_before = leader.meta.writes
            await client.report("t", "w", "gpu", keys[:4], [1] * 4)
            assert await seen(follower, keys, 4) == 4
            assert leader.meta.writes == writes_before  # no placement is written to the backend
            # a conductor that starts late (or fell further behind than the log keeps) reads a
            # snapshot of 14 blocks in pages of 4 while changes go on, then follows
            await client.register(MemberInfo(node_id="x", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
            await client.report("t", "x", "gpu", [k(100 + i) for i in range(10)], [7] * 10)
            late = await Conductor(leader.meta, "late", ttl=1, peer_token="peer-token").start()
            try:
                await client.report("t", "x", "gpu", [k(200)], [7])
                await client.remove("t", "x", "gpu", [k(100)])
                for _ in range(100):
                    if len(late.index) == len(leader.index) == 14 and late.link.mirror_age() is not None:
                        break
                    await asyncio.sleep(0.05)
                assert sorted(late.index.node_blocks("x")) == sorted(leader.index.node_blocks("x"))
                assert len(late.index.node_blocks("x")) == 10 and late.index.lookup("t", keys)["w"].length == 4
            finally:
                await late.close()
            await client.report("t", "w", "gpu", keys[4:], [1] * 2)
            await client.remove("t", "w", "gpu", [keys[3]])
            assert await seen(follower, keys, 3) == 3 and follower.index.holders("t", keys[5])
            assert not (await leader.meta.range(b"/tiercake/placements/"))[0]  # none of it in the backend
            await client.leave("w", lease)
            assert await seen(leader, keys, 0) == 0 and await seen(follower, keys, 0) == 0
            assert not follower.index.holders("t", keys[5])
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer peer-token"}) as http:
            for url, body, status in (
                (follower.url, {"term": 0, "after": 0}, 503),
                (leader.url, {"term": 0, "after": -1}, 400),
                (leader.url, {"term": 0, "after": 0, "wait_s": 60}, 400),
                (leader.url, {"term": 0, "after": 0, "snapshot_row": -1}, 400),
            ):
                async with http.post(url + "/v1/placements/feed", json=body) as resp:
                    assert resp.status == status, await resp.text()
            async with http.post(leader.url + "/v1/placements/feed", json={"term": 0, "after": 0}) as resp:
                answer = await resp.json()
                assert answer["reset"] and answer["term"] == leader.election.won_term > 0


async def test_a_followers_mirror_follows_on_after_a_failure_no_handler_expected():
    """Applying a page of the leader's feed failed in a way nobody expected: the follower's mirror once
    stopped there, silently, and its lookups (and its index, were it to win) went stale for good. It
    starts over from a snapshot."""
    async with leader_and_follower() as (leader, follower):
        real, failures = follower.index.apply, []

        def apply(changes, reset=False):
            if not failures:
                failures.append(reset)
                raise RuntimeError("a fault of the test")
            return real(changes, reset=reset)

        follower.index.apply = apply
        keys = [k(i) for i in range(3)]
        async with Client([leader.url], token="peer-token") as client:
            await client.register(MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
            await client.report("t", "w", "gpu", keys, [1] * 3)
            for _ in range(100):
                found = follower.index.lookup("t", keys).get("w")
                if found is not None and found.length == 3:
                    break
                await asyncio.sleep(0.05)
            assert failures and found is not None and found.length == 3, (failures, found)


async def test_a_winning_follower_keeps_its_mirror_and_members_re_report_only_the_last_changes(make_store):
    """The leader dies: the follower that wins serves the volatile replicas it mirrored at once, and
    a member re-reports only what was acknowledged in the window the new term names (here a change
    the mirror lacks), not everything it holds: at a fleet's size that storm outlasted a term."""
    from tiercake.conductor.block_table import as_keys
    from tiercake.conductor.placement import Change
    from tiercake.workers.conductor_link import ConductorLink

    store = await make_store(gpu=8, pool=None, ssd=None)
    member = MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20})
    async with leader_and_follower() as (leader, follower):
        link = await ConductorLink(Client([leader.url, follower.url], token="peer-token"), member, store, ttl=3).start()
        try:
            old = [k(i) for i in range(3)]
            for i, key in enumerate(old):
                await store.put(key, block(i), tier="gpu", tenant="t")
            await link.send_reports()
            for _ in range(100):
                if (found := follower.index.lookup("t", old).get("w")) and found.length == 3:
                    break
                await asyncio.sleep(0.05)
            assert found.length == 3
            old_acked = time.monotonic()
            await asyncio.sleep(5.0)  # older than any window a quick failover names (under 5 s, asserted below)
            late = k(99)
            await store.put(late, block(9), tier="gpu", tenant="t")
            await link.send_reports()
            for _ in range(100):  # then the mirror misses that change, as a follower one poll behind
                if follower.index.holders("t", late):
                    break
                await asyncio.sleep(0.05)
            follower.index.apply([Change("remove", "t", "w", "gpu", as_keys([late]))])
            sent: list[bytes] = []  # what the member sends from here on
            report = link.client.report

            async def counted(tenant, node, tier, keys, sizes):
                sent.extend(keys)
                return await report(tenant, node, tier, keys, sizes)

            link.client.report = counted
            heard: list[tuple[float, float | None, int]] = []  # (when, window, term) of each answer
            note_term = link._note_term

            def noting(answer):
                heard.append((time.monotonic(), answer.rereport_s, answer.term))
                note_term(answer)

            link._note_term = noting
            leader.election.crash()
            await asyncio.wait_for(follower.election.leading.wait(), 10)
            assert follower.index.lookup("t", old)["w"].length == 3  # the mirror, before any re-report
            assert follower.rereport_s is not None and follower.rereport_s < 5.0
            for _ in range(100):
                if follower.index.holders("t", late):
                    break
                await asyncio.sleep(0.05)
            assert follower.index.holders("t", late), "the change after the mirror was not re-reported"
            # that one; the three before only where the window the member heard reaches back to them
            # (counted back from when it heard of the term: on a busy machine, seconds after the win)
            at, window = next((at, w) for at, w, term in heard if term == follower.election.won_term)
            assert window is not None and late in sent
            assert sorted(sent) == sorted([late, *old] if at - window <= old_acked else [late]), (at, window, old_acked)
        finally:
            await link.close(leave=False)
            await link.client.close()


async def test_a_follower_without_a_fresh_mirror_asks_members_for_everything():
    """A follower that never followed a leader (or lost it long ago) wins with no volatile replicas
    and asks for a full re-report: a window would then miss what it never had."""
    async with leader_and_follower() as (leader, follower):
        async with Client([leader.url], token="peer-token") as client:
            lease = await client.register(MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
            await client.report("t", "w", "gpu", [k(1)], [1])
            for _ in range(100):
                if follower.index.holders("t", k(1)):
                    break
                await asyncio.sleep(0.05)
            follower.link._synced_at -= 60  # as if its feed had stopped a minute ago
            leader.election.crash()
            await asyncio.wait_for(follower.election.leading.wait(), 10)
            assert follower.rereport_s is None and not follower.index.holders("t", k(1))
        async with Client([follower.url], token="peer-token") as client:
            answer = await client.keep_alive("w", lease)
            assert answer.term == follower.election.won_term and answer.rereport_s is None


async def test_a_followers_access_counts_reach_the_leader_in_small_requests(monkeypatch):
    """A follower's counts go to the leader a chunk a request: the leader parses and adds a request
    in one turn of its loop, and 50,000 counts in one took it 180 ms, a stall for every lookup,
    keep-alive and report behind them (bench fleet: its lookups' p99 at 35-43 ms)."""
    from tiercake.conductor import leader_link

    monkeypatch.setattr(leader_link, "HEAT_CHUNK", 3)
    async with leader_and_follower() as (leader, follower):
        keys = [k(i) for i in range(10)]
        leader.index.add_many("t", keys, "node-a", "pool", [1] * 10)
        for _ in range(100):
            if follower.index.lookup("t", keys):
                break
            await asyncio.sleep(0.05)
        sizes: list[int] = []
        add_heat = leader.add_heat
        monkeypatch.setattr(leader, "add_heat", lambda hits: sizes.append(len(hits)) or add_heat(hits))
        for key in keys:
            follower.lookup("t", [key])
        for _ in range(60):
            if len(leader.heat.items()) == 10:
                break
            await asyncio.sleep(0.1)
        assert {key for _, key in dict(leader.heat.items())} == set(keys)
        assert sum(sizes) == 10 and max(sizes) == 3


async def test_lookups_go_to_a_follower_in_step_and_back_to_the_leader_when_it_is_not(monkeypatch):
    """A client given both conductors sends its lookups to the follower once one of them finds it in
    step with the leader (the leader, which takes every keep-alive and report, then answers none of
    them), and its writes to the leader; a follower that falls behind, or stops answering, loses the
    lookups to the leader within one lookup, without an error; found in step again, it gets them back."""
    from tiercake.conductor import client as client_module
    from tiercake.conductor import leader_link

    monkeypatch.setattr(client_module, "FOLLOWER_PROBE_S", 0.0)  # look for a follower at every chance
    # in step however slowly this machine answers its polls: falling behind is made below, not timed
    monkeypatch.setattr(leader_link, "IN_STEP_S", 3600.0)
    keys = [k(i) for i in range(4)]
    async with leader_and_follower(runners_too=True) as (leader, follower, runners):
        async with Client([leader.url, follower.url], token="peer-token") as client:
            await client.register(MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
            await client.report("t", "w", "gpu", keys, [1] * 4)
            for _ in range(100):
                if follower.read_role == "follower" and follower.index.lookup("t", keys):
                    break
                await asyncio.sleep(0.05)

            async def lookups(n: int) -> tuple[int, int]:
                """n lookups, all answered whole: how many the leader and the follower answered."""
                at = leader.index.stats.lookups, follower.index.stats.lookups
                for _ in range(n):
                    assert (await client.lookup("t", keys))["w"].length == 4
                return leader.index.stats.lookups - at[0], follower.index.stats.lookups - at[1]

            assert await lookups(10) == (0, 10)  # the first one looked for a follower, found it
            monkeypatch.setattr(client_module, "FOLLOWER_PROBE_S", 60.0)
            await client.report("t", "w", "gpu", [k(9)], [1])  # a write: the leader's, as before
            assert leader.read_role == "leader" and await lookups(3) == (0, 3)
            # behind: the lookup it answers says so, and the next ones go to the leader (until a look
            # for a follower in step again, one a probe period)
            with monkeypatch.context() as behind:
                behind.setattr(follower.link, "in_step", lambda: False)
                assert await lookups(1) == (0, 1)
                assert await lookups(6) == (6, 0)
            # in step again: found at the next look
            monkeypatch.setattr(client_module, "FOLLOWER_PROBE_S", 0.0)
            assert await lookups(1) == (0, 1)
            monkeypatch.setattr(client_module, "FOLLOWER_PROBE_S", 60.0)
            assert await lookups(5) == (0, 5)
            # its HTTP stops: the lookup under way is answered by the leader, and the next ones too
            await runners[1].cleanup()
            assert await lookups(5) == (5, 0)


async def test_a_follower_relays_keep_alives_while_a_leader_is_named_and_vouches_while_none_is():
    """Liveness is the leader's (conductor/liveness.py): a follower relays a member's keep-alive to
    the leader it names (a guarded write the leader watches: it was a 503 sending the member there,
    and a member cut off from the leader lost its lease), and answers it itself while the backend
    names no leader (whoever wins next counts its members' TTLs from its own term's start).
    Answering so, a follower that follows no leader names no term: between a leader's death and the
    next leader's word reaching a follower, it once named the new term from the backend with no
    window, and members re-reported everything."""
    from tiercake.conductor.election import LeaderElection
    from tiercake.messages import ConductorInfo

    async with leader_and_follower() as (leader, follower):
        async with Client([leader.url], token="peer-token") as client:
            lease = await client.register(MemberInfo(node_id="w", role="worker", tiers={"gpu": 1 << 20}), ttl=30)
        await follower.members.wait_for(lambda m: "w" in m.members, 5)
        only_follower = Client([follower.url], token="peer-token", retries=1)  # follows no hint
        try:
            await only_follower.keep_alive("w", lease)  # relayed
            assert follower.liveness.relayed == 1
            for _ in range(100):  # the leader's watch hears it
                if leader.liveness.relayed:
                    break
                await asyncio.sleep(0.05)
            assert leader.liveness.relayed == 1
            with pytest.raises(ConductorError) as unknown:  # a registration the leader does not keep
                await only_follower.keep_alive("w", lease + 1)
            assert unknown.value.status == 404 and follower.liveness.relayed == 1
            await follower.link.close()  # its feed stops, as when the leader it followed died
            follower.link.followed_term = 0
            follower.election.crash()  # neither leads now; the leader's key runs out
            leader.election.crash()
            for _ in range(100):
                if await follower.leader() is None:
                    break
                await asyncio.sleep(0.05)
            answer = await only_follower.keep_alive("w", lease)  # vouched for
            assert answer.term == 0 and answer.rereport_s is None and follower.liveness.relayed == 1
            with pytest.raises(ConductorError) as unknown:  # a registration it does not hold
                await only_follower.keep_alive("w", lease + 1)
            assert unknown.value.status == 404
            # a third candidate wins: the follower relays to it again
            info = ConductorInfo(conductor_id="third", url="http://127.0.0.1:9").model_dump_json()
            third = await LeaderElection(follower.meta, info, ttl=1).start()
            try:
                await asyncio.wait_for(third.leading.wait(), 10)
                await only_follower.keep_alive("w", lease)
                assert follower.liveness.relayed == 2
            finally:
                await third.resign()
        finally:
            await only_follower.close()


async def test_a_followers_keep_alive_answer_names_the_stored_map_epoch_even_when_its_copy_lags(monkeypatch):
    """A node serves its slots by its object map only once it holds one as new as the epoch its
    keep-alive answer names. A follower's copy of the map follows a watch and may lag: its answer
    names the epoch in the backend, so a node that came back does not serve by the map it had
    before its slots moved."""
    from tiercake.conductor.objects import OBJECT_MAP
    from tiercake.messages import ObjectMap

    async with leader_and_follower() as (leader, follower):
        async with Client([leader.url], token="peer-token") as client:
            lease = await client.register(MemberInfo(node_id="n", role="node"), ttl=30)
        await follower.members.wait_for(lambda m: "n" in m.members, 5)
        await follower.objects.close()  # its copy stops following: as a watch that lags
        stale = follower.objects.map.epoch
        await leader.meta.put(OBJECT_MAP, ObjectMap(epoch=stale + 7).model_dump_json().encode())
        async with Client([follower.url], token="peer-token", retries=1) as only_follower:
            answer = await only_follower.keep_alive("n", lease)  # relayed
            assert follower.objects.map.epoch == stale and answer.objects_epoch == stale + 7
            parsed: list[bytes] = []
            parse = ObjectMap.model_validate_json
            monkeypatch.setattr(
                ObjectMap, "model_validate_json", lambda raw, **kw: parsed.append(raw) or parse(raw, **kw)
            )
            again = await only_follower.keep_alive("n", lease)  # the same stored map: not parsed again
            assert parsed == []
            monkeypatch.undo()
            await leader.meta.put(OBJECT_MAP, ObjectMap(epoch=stale + 9).model_dump_json().encode())
            newer = await only_follower.keep_alive("n", lease)  # a newer one: read anew
        assert again.objects_epoch == stale + 7 and newer.objects_epoch == stale + 9


async def test_a_member_that_left_takes_its_metric_series_with_it(api):
    from tiercake.messages import MemberStats, TierStats

    url, _ = api
    async with Client([url], token="s3cret-token") as client, aiohttp.ClientSession() as http:
        lease = await client.register(MemberInfo(node_id="gone-soon", tiers={"pool": 1 << 20}), ttl=5)
        await client.keep_alive("gone-soon", lease, MemberStats(tiers={"pool": TierStats(kind="pool", used_bytes=7)}))
        async with http.get(url + "/metrics") as resp:
            assert 'tiercake_tier_used_bytes{member="gone-soon",tier="pool"} 7.0' in await resp.text()
        await client.leave("gone-soon", lease)
        for _ in range(50):
            if not await client.members():
                break
            await asyncio.sleep(0.05)
        async with http.get(url + "/metrics") as resp:
            assert 'member="gone-soon"' not in await resp.text()  # not frozen at its last value forever


async def test_node_directory_retries_a_node_once_where_it_may_have_moved():
    """``to_node`` after an unreachable attempt: reads the members again and retries once; with
    ``moved_only`` (a worker's serving path) only when the node is listed at another address; a
    members call that fails then leaves the attempt's own failure, it does not raise."""
    from tiercake.conductor.client import NodeDirectory
    from tiercake.messages import MemberInfo
    from tiercake.transfer import PeerClosedError, TransferResult

    class Members:  # the conductor's member list, as the client returns it
        def __init__(self):
            self.port, self.fail = 7001, False

        async def members(self):
            if self.fail:
                raise ConductorError(503, "the conductor is down")
            return [MemberInfo(node_id="n1", role="node", host="127.0.0.1", port=self.port)]

    class Engine:  # the addresses a transfer engine knows
        def __init__(self):
            self.peers = {}

        def ensure_peer(self, node, host, port):
            self.peers[node] = (host, port)

        def address(self, node):
            return self.peers.get(node)

    async def run(moved_only: bool, move: bool, fail: bool = False) -> int:
        members, engine, attempts = Members(), Engine(), []
        directory = NodeDirectory(members, engine, moved_only=moved_only)

        async def attempt():
            attempts.append(engine.address("n1"))
            return (
                [TransferResult(False, error=PeerClosedError("gone"))] if len(attempts) == 1 else [TransferResult(True)]
            )

        await directory.refresh()
        members.port, members.fail = (7002 if move else 7001), fail
        results = await directory.to_node("n1", attempt)
        assert results[0].ok == (len(attempts) == 2)
        return len(attempts)

    assert await run(moved_only=False, move=False) == 2
    assert await run(moved_only=True, move=False) == 1  # same address: a stalled node costs one deadline
    assert await run(moved_only=True, move=True) == 2
    assert await run(moved_only=False, move=False, fail=True) == 1  # the transfer's own failure stands


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"POST /v1/placements/lookup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20000 + b"\r\n\r\n",
    ],
)
async def test_a_request_aiohttp_cannot_parse_is_answered_in_the_one_error_format(api, raw):
    url, _ = api
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def send() -> bytes:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    head, _, body = (await asyncio.to_thread(send)).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"application/json" in head, head
    error = ErrorReply.model_validate_json(body).error
    assert error.type == "invalid_request_error" and error.message.startswith("unparsable request: ")


async def test_a_request_head_that_trickles_is_cut_at_its_deadline(api, monkeypatch):
    """A client that sends its headers a byte at a time held a connection for as long as it liked
    (aiohttp has no deadline for a request's head); now it has HEAD_DEADLINE_S from its first byte."""
    import tiercake.errors

    monkeypatch.setattr(tiercake.errors, "HEAD_DEADLINE_S", 1.0)
    url, _ = api
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def trickle() -> float:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(30):  # 9 s of headers, if it let us
                    sock.sendall(b"X-Slow: 1\r\n")
                    time.sleep(0.3)
                    sock.setblocking(False)
                    try:
                        if sock.recv(1) == b"":
                            break  # closed
                    except BlockingIOError:
                        pass
                    finally:
                        sock.setblocking(True)
            except OSError:
                pass  # reset
            return time.monotonic() - start

    took = await asyncio.to_thread(trickle)
    assert took < 3.0, took
    async with aiohttp.ClientSession() as http:  # and everyone else is served
        async with http.get(url + "/health") as resp:
            assert resp.status == 200


async def test_the_leader_takes_reports_without_asking_the_backend_who_leads():
    """Every report, commit and begin used to read the election key from etcd first: one read per
    request on the leader's hot path. A follower still answers with the leader's URL."""
    async with leader_and_follower() as (leader, follower):
        asked = []
        original = leader.election.leader

        async def counted():
            asked.append(1)
            return await original()

        leader.election.leader = counted
        async with Client([leader.url], token="peer-token") as client:
            await client.register(MemberInfo(node_id="node-a", tiers={"pool": 1 << 20}), ttl=5)
            for i in range(20):
                await client.report("t", "node-a", "pool", [k(i)], [1])
        assert asked == []
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer peer-token"}) as http:
            body = {"tenant": "t", "node": "node-a", "tier": "pool", "blocks": [{"key": k(99).hex(), "size": 1}]}
            async with http.post(follower.url + "/v1/placements/report", json=body) as resp:
                assert resp.status == 503 and leader.url in await resp.text()


# docs/SCALE.md: how long after its removal is acknowledged a lookup may name a block, through a
# leader's SIGKILL (the member hears of the new term at its next renewal, a third of its 2 s lease, and
# re-reports what it had acknowledged since the new leader's mirror was last in step)
STALE_BOUND_S = 2 / 3 + 1.0


@pytest.mark.cluster
async def test_a_failover_during_churn_keeps_every_placement_and_no_removed_one(conductors, etcd, make_store):
    """A node adds and removes blocks without pause while the leader is SIGKILLed: after the
    failover, every block whose addition was acknowledged and not removed is listed, and no lookup
    later than ``STALE_BOUND_S`` after a removal's acknowledgement names that block."""
    await _clean_slate(etcd)

    first, url1 = conductors("c-churn-1")
    await asyncio.sleep(1.0)  # the first one leads
    _, url2 = conductors("c-churn-2")
    added: set[bytes] = set()
    removed: dict[bytes, float] = {}  # key -> when its removal was acknowledged
    stop = asyncio.Event()
    store = await make_store(gpu=None, pool=64, ssd=None)

    async def churn(member: Member) -> None:
        i = 0
        while not stop.is_set():
            key = k(10_000 + i)
            await member.add([key], "pool")
            await member.settle()
            added.add(key)
            if i >= 8:  # keep eight, remove the oldest
                old = k(10_000 + i - 8)
                await store.remove(old)
                await member.settle()
                removed[old] = time.monotonic()
            i += 1

    async with Client([url2, url1]) as reader, Member(store, [url1, url2], "node-a") as member:
        task = asyncio.create_task(churn(member))
        await asyncio.sleep(1.0)
        first.send_signal(signal.SIGKILL)
        await asyncio.sleep(4.0)  # through the failover, churning
        stop.set()
        await task
        assert (await reader.leader()).conductor_id == "c-churn-2"
        assert len(removed) > 50, len(removed)  # churn went on before and after the kill
        await asyncio.sleep(STALE_BOUND_S)
        found = await reader.lookup_many("t", [[key] for key in sorted(added)])
        listed = {key: "node-a" in f for key, f in zip(sorted(added), found, strict=True)}
    stale = [key.hex() for key, at in removed.items() if listed[key]]
    lost = [key.hex() for key in added - set(removed) if not listed[key]]
    assert stale == [] and lost == [], (stale, lost)
