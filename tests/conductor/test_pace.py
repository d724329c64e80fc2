"""The front's book of worker paces (``conductor/front/pace.py``): a worker's startup fit, scaled by
how its reported prefills compare with it now."""

import pytest
from pydantic import ValidationError

from tiercake.conductor.front.pace import STALE_S, PaceBook
from tiercake.messages import PrefillStats
from tiercake.policies import PrefillModel

FIT = PrefillModel(a=0.0, b=1e-4, q=0.0)  # 0.1 s per 1000 computed tokens


def prefill(compute_s: float, prompt: int = 1000, cached: int = 0) -> PrefillStats:
    return PrefillStats(prompt_tokens=prompt, cached_tokens=cached, compute_s=compute_s)


def test_a_worker_slower_than_its_fit_is_priced_at_its_pace_now():
    now = [0.0]
    book = PaceBook(clock=lambda: now[0])
    assert book.model("w1", FIT) == FIT  # nothing measured: the fit
    for seconds in (0.3, 0.3, 0.31, 0.29, 5.0):  # three times slower (one outlier: the median ignores it)
        book.observe("w1", FIT, prefill(seconds))
    assert 2.9 <= book.pace("w1") <= 3.1
    assert book.model("w1", FIT).seconds(1000) == FIT.seconds(1000) * book.pace("w1")
    assert book.pace("w2") == 1.0  # another worker: its own
    now[0] = STALE_S + 1
    assert book.pace("w1") == 1.0  # the machine may be quiet again: back to the fit


def test_what_is_not_a_pace_is_ignored():
    book = PaceBook()
    book.observe("w1", FIT, prefill(0.0))  # nothing computed measured
    book.observe("w1", FIT, prefill(1.0, prompt=1000, cached=1000))  # all of it cached
    book.observe("w1", FIT, prefill(0.5, prompt=5))  # predicted 0.5 ms: mostly overhead
    book.observe("w1", FIT, prefill(50.0))  # 500 times its fit: a timer's accident
    assert book.pace("w1") == 1.0
    with pytest.raises(ValidationError):  # a worker's infinity never reaches the book
        prefill(float("inf"))
