"""A worker's fence around node agents that stop answering (workers/fence.py): out at the first
timeout, back once a background probe is answered, never on a request's path meanwhile."""

import asyncio

from tiercake.workers.fence import NodeFence


async def test_a_node_that_times_out_stays_fenced_until_a_probe_is_answered(monkeypatch):
    monkeypatch.setattr(NodeFence, "PROBE_EVERY_S", 0.01)
    silent = {"n"}
    probed: list[str] = []

    async def probe(node: str) -> bool:
        probed.append(node)
        return node not in silent

    fence = NodeFence("w", probe)
    assert fence.open("n")
    fence.timed_out("n")
    fence.timed_out("n")  # a second timeout while fenced starts no second prober
    assert not fence.open("n") and fence.open("other")
    await asyncio.sleep(0.1)
    assert not fence.open("n") and len(probed) >= 3  # still silent: still out
    silent.clear()
    await asyncio.sleep(0.05)
    assert fence.open("n") and fence.fenced == 1
    count = len(probed)
    await asyncio.sleep(0.05)
    assert len(probed) == count  # answered: probing stops


async def test_a_node_silent_past_the_give_up_time_or_a_failing_probe_lifts_the_fence(monkeypatch):
    monkeypatch.setattr(NodeFence, "PROBE_EVERY_S", 0.01)
    monkeypatch.setattr(NodeFence, "GIVE_UP_S", 0.05)

    async def never(node: str) -> bool:
        return False

    async def broken(node: str) -> bool:
        raise RuntimeError("no transfer engine")

    quiet, failing = NodeFence("w", never), NodeFence("w", broken)
    quiet.timed_out("n")
    failing.timed_out("n")
    await asyncio.sleep(0.15)
    assert quiet.open("n") and failing.open("n")  # the membership decides from here


async def test_close_stops_the_probers():
    async def never(node: str) -> bool:
        return False

    fence = NodeFence("w", never)
    fence.timed_out("a")
    fence.timed_out("b")
    await fence.close()
    assert fence.open("a") and fence.open("b")
