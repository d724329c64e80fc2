"""A paused session's blocks in a node's three tiers, each under the session policy: demoted tier by
tier (gpu, then pool, then SSD) as sessions expected back sooner arrive, never dropped while retained,
found where they went, and the first to go once their retention is over."""

import asyncio

import torch
from conftest import block, key

from tiercake.policies import LRU, SessionAware
from tiercake.policies.base import SessionEvent, SessionState

TIERS = ("gpu", "pool", "ssd")


async def paused(store, session: str, first: int, at: float, back: float, retain: float = 600) -> list[bytes]:
    """One turn: active with two new blocks, written, then paused, expected back in ``back`` s."""
    keys = [key(first), key(first + 1)]
    store.on_session(SessionEvent(session, SessionState.ACTIVE, at, tuple(keys)))
    for i, k in enumerate(keys):
        await store.put(k, block(first + i))
    store.on_session(SessionEvent(session, SessionState.PAUSED, at, tuple(keys), back, retain))
    return keys


def test_a_paused_session_is_demoted_tier_by_tier_and_found_where_it_went(make_store):
    async def go():
        store = await make_store(gpu=2, pool=2, ssd=8, policies={t: SessionAware(LRU()) for t in TIERS})
        kept = await paused(store, "kept", 0, at=1000, back=900)
        assert [store.where(k) for k in kept] == [["gpu"], ["gpu"]]
        await paused(store, "sooner", 10, at=1001, back=60)  # expected back first: "kept" goes down to the pool
        assert [store.where(k) for k in kept] == [["pool"], ["pool"]]
        await paused(store, "soonest", 20, at=1002, back=30)  # and again: "kept" is on SSD now
        assert [store.where(k) for k in kept] == [["ssd"], ["ssd"]]
        for i, k in enumerate(kept):  # demoted, never dropped: its bytes are there
            assert torch.equal(
                torch.from_numpy(await store.get(k)).view(torch.float16).reshape(block(i).shape), block(i)
            )

    asyncio.run(go())


def test_once_its_retention_is_over_a_paused_session_is_the_first_to_go(make_store, tmp_path):
    """The same turns twice, the first session retained 600 s, then 100 s. At t=1101 a new session
    needs the gpu tier: retained, the first session (overdue, so expected back any moment) stays and
    the one expected back last goes down; past its retention, the first session goes down instead."""

    async def where_after(retain: float) -> tuple[list, list]:
        policies = {t: SessionAware(LRU()) for t in TIERS}
        store = await make_store(gpu=4, pool=2, ssd=4, ssd_dir=tmp_path / f"ssd-{retain}", policies=policies)
        first = await paused(store, "first", 0, at=1000, back=10, retain=retain)
        await paused(store, "second", 10, at=1001, back=60)
        third = await paused(store, "third", 20, at=1002, back=30)  # the gpu tier holds two sessions
        assert [store.where(k) for k in (*first, *third)] == [["gpu"]] * 4
        await paused(store, "fourth", 30, at=1101, back=5)
        where = [store.where(k) for k in first], [store.where(k) for k in third]
        await store.close()  # the next store makes the same pool region
        return where

    async def go():
        first, third = await where_after(retain=600)
        assert first == [["gpu"]] * 2 and third != [["gpu"]] * 2
        first, third = await where_after(retain=100)
        assert ["gpu"] not in first and third == [["gpu"]] * 2

    asyncio.run(go())
