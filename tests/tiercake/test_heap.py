"""``tiercake.heap``: what a process built to start is frozen, so a full collection no longer walks it
(with torch loaded, over 200,000 objects: a 100 ms pause in the middle of a request's pull)."""

import gc

from tiercake.heap import freeze_startup_heap


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
