"""The conductor's gate for work with no pause in it: at most n pieces in one turn of the loop, at
most its share of the loop's time, and a bounded queue."""

import asyncio
import time

import pytest

from tiercake.conductor.service import IngestBusyError, TurnGate


async def test_work_with_no_pause_runs_at_most_n_pieces_a_turn():
    gate, turn, ran = TurnGate(2, share=1.0), 0, []

    async def ticker():
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    async def piece():
        async with gate:
            ran.append(turn)  # the work itself: no await

    ticking = asyncio.create_task(ticker())
    await asyncio.gather(*(piece() for _ in range(40)))
    ticking.cancel()
    assert len(ran) == 40 and max(ran.count(t) for t in set(ran)) <= 2
    plain, ran = asyncio.Semaphore(2), []  # the reason for the gate: a semaphore alone lets every piece by

    async def unguarded():
        async with plain:
            ran.append(turn)

    await asyncio.gather(*(unguarded() for _ in range(40)))
    assert max(ran.count(t) for t in set(ran)) == 40


async def test_the_gated_work_takes_at_most_its_share_of_the_time():
    gate = TurnGate(2, share=0.5, burst_s=0.01)

    async def piece():
        async with gate:
            time.sleep(0.01)  # 10 ms of work with no pause in it

    started = time.monotonic()
    await asyncio.gather(*(piece() for _ in range(30)))
    assert time.monotonic() - started >= 0.3 / 0.5 - 0.05  # 0.3 s of work at half the time: 0.6 s


async def test_past_its_queue_a_batch_is_refused_at_once():
    gate, release = TurnGate(1, queue=3), asyncio.Event()

    async def held():
        async with gate:
            await release.wait()

    holder = asyncio.create_task(held())
    waiting = [asyncio.create_task(held()) for _ in range(3)]
    await asyncio.sleep(0.05)
    with pytest.raises(IngestBusyError):
        async with gate:
            pass
    release.set()
    await asyncio.gather(holder, *waiting)
