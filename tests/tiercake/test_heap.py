"""``tiercake.heap``: what a process built to start is frozen, so a full collection no longer walks it
(with torch loaded, over 200,000 objects: a 100 ms pause in the middle of a request's pull)."""

import gc

from tiercake.heap import collect_less_often, freeze_startup_heap


def test_the_heap_a_process_started_with_is_frozen_and_its_garbage_collected_first():
    started = [{"i": i} for i in range(50_000)]  # what a start leaves alive
    garbage = [[] for _ in range(1000)]
    for g in garbage:
        g.append(g)  # cycles only the collector frees
    del garbage
    gc.unfreeze()
    walked = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        after = len(gc.get_objects())
    finally:
        gc.unfreeze()  # the test process goes on as it was
    assert walked > len(started) and frozen >= len(started)
    assert after < 1_000, (walked, frozen, after)  # a full collection walks only what comes later
    assert frozen < walked - 900  # the cycles were collected, not frozen


def test_collecting_less_often_lets_young_cycles_wait_for_their_batch_and_still_frees_them():
    before = collect_less_often(young=5_000)
    try:
        assert gc.get_threshold() == (5_000, 20, 100)
        gc.collect()
        cycles = [[] for _ in range(1_000)]
        for c in cycles:
            c.append(c)
        del cycles, c
        assert gc.get_count()[0] >= 1_000  # Python's default (700) would have collected them already
        assert gc.collect(0) >= 1_000  # a young collection still frees them
    finally:
        gc.set_threshold(*before)  # the test process goes on as it was
