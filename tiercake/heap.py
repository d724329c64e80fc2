"""A long-running process's heap once it has started: what it built to start (modules, torch, the
model, the tiers' tables) lives as long as the process, yet Python's collector walks all of it in
every full collection. With torch loaded that is over 200,000 objects and about 100 ms, paid by
whichever request happens to allocate past the threshold: in the lab, one put of a pull's
fortieth block, which priced the link it came over as slow. ``gc.freeze`` moves what is alive now
out of the collector's reach, as vLLM's engine does once it has started; later garbage is still
collected."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what starting left behind, then freeze what is alive; how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


YOUNG_OBJECTS = 50_000  # allocations between young collections (Python's default: 700)


def collect_less_often(young: int = YOUNG_OBJECTS) -> tuple[int, int, int]:
    """Collect the young generation every ``young`` allocations, the middle one every 20 of those and
    the old one every 100 of those; the thresholds it replaced. A conductor at 1,000 nodes holds
    40,000-100,000 tracked objects past its frozen start, most of them asyncio's per-request ones
    (tasks, handles, contexts) that come and go; at Python's defaults it collected every few
    seconds for 5-12 ms, and in full for 40-130 ms, pauses its lookups waited behind: its lookup p99
    under ``bench fleet --nodes 1000`` was 15.4-20.5 ms, 8.1-13.2 with these (four runs each,
    interleaved). Cycles still go, only in larger batches."""
    before = gc.get_threshold()
    gc.set_threshold(young, 20, 100)
    return before
