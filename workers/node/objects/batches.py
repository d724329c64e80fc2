"""A large request's items, worked through without holding the event loop: the node's keep-alive and
every other connection get a turn between runs of items (a 4,096-item put of small objects is
hundreds of milliseconds of Python; without turns a node's lease ran out behind a few of them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")

RUN = 256  # items between two turns of the loop


async def await_every(items: Iterable[T], run: int = RUN) -> AsyncIterator[T]:
    """``items``, with a turn of the event loop after every ``run`` of them."""
    for i, item in enumerate(items):
        if i and i % run == 0:
            await asyncio.sleep(0)
        yield item
