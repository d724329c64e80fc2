"""The conductor's gate for work with no pause in it: at most n pieces in one turn of the loop."""

import asyncio

from tiercake.conductor.service import TurnGate


async def test_work_with_no_pause_runs_at_most_n_pieces_a_turn():
    gate, turn, ran = TurnGate(2), 0, []

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
