"""A member's link to the conductors (workers/conductor_link.py) when the leader stops answering it:
real conductors behind their HTTP apps, a proxy in front of the leader that can black-hole it."""

import asyncio
import contextlib

from conductor_helpers import leader_and_follower

from tiercake.conductor.client import Client
from tiercake.messages import MemberInfo
from tiercake.workers.conductor_link import ConductorLink


class Stall:
    """A TCP proxy to ``target`` that, once ``stalled``, forwards nothing either way (a link cut
    without a reset: connections hang, as across a partition)."""

    def __init__(self, target: str) -> None:
        self.host, port = target.removeprefix("http://").split(":")
        self.port = int(port)
        self.stalled = False
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _pipe(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def copy(src, dst) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    if not self.stalled:
                        dst.write(data)
                        await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


async def test_a_member_whose_leader_stops_answering_stays_a_member_through_a_follower():
    """The leader black-holed for this member (a partition between it and the leader's host): each
    keep-alive gives up on the leader within a third of the TTL and a follower relays it. It waited
    the client's 5 s on the leader, and the member's 1 s lease ran out with a follower in reach."""
    async with leader_and_follower() as (leader, follower):
        proxy = Stall(leader.url)
        async with proxy as to_leader, Client([to_leader, follower.url], token="peer-token") as client:
            link = ConductorLink(client, MemberInfo(node_id="cut-off", role="prefill"), None, ttl=1)
            await link.start()  # registered through the proxy: the leader is where it goes first
            try:
                assert "cut-off" in leader.members.members
                proxy.stalled = True
                await asyncio.sleep(2)  # two TTLs (without the mend it went at about 1.3 s)
                assert "cut-off" in leader.members.members and link.registrations == 1
                assert follower.liveness.relayed > 0 and leader.liveness.relayed > 0
            finally:
                await link.close(leave=False)


async def test_the_keep_alives_go_on_while_an_answer_is_acted_on_and_after_any_failure():
    """Acting on a keep-alive's answer (pins, a replication pull from a peer cut off, a flush) once ran
    inside the keep-alive loop: a pull waiting out its deadline let a lease of a few seconds lapse.
    And an error no handler expected (here, the store's figures), or a cancellation leaked from
    within, ended the loop silently: the member left the cluster for good while its process ran. A
    real conductor; the acting that never ends and the failing figures are the test's."""
    from conductor_helpers import running_conductor

    member = MemberInfo(node_id="busy", role="node")
    async with running_conductor() as (url, conductor), Client([url]) as client:
        link = await ConductorLink(client, member, None, ttl=2, report=False).start()
        try:
            acted: list[float] = []

            async def stuck_settings(settings) -> None:
                acted.append(asyncio.get_running_loop().time())
                await asyncio.Event().wait()  # never done (cancelled as the link closes)

            real_stats, calls = link._stats, []

            def stats():  # the 2nd keep-alive meets an error, the 5th a cancellation from within
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("a fault of the test")
                if len(calls) == 5:
                    raise asyncio.CancelledError()
                return real_stats()

            link.orders.apply_settings = stuck_settings  # type: ignore[method-assign]
            link._stats = stats  # type: ignore[method-assign]
            async with asyncio.timeout(20):  # past both failures, with the acting stuck throughout
                while len(calls) < 8:
                    await asyncio.sleep(0.1)
            assert len(acted) == 1, acted  # one answer acted on at a time: the rest skipped meanwhile
            assert "busy" in conductor.members.members and link.registrations == 1, link.registrations
        finally:
            await link.close(leave=False)
