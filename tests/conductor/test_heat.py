"""Access rates as lookups count them: decayed by their half-life, the same across a rescale."""

import pytest

from tiercake.conductor import heat
from tiercake.conductor.heat import AccessRates


def test_a_steady_rate_is_measured_and_halves_after_a_half_life(monkeypatch):
    rates = AccessRates(half_life=10.0)
    start = rates._epoch
    for tick in range(2000):  # 20 accesses a second for 100 s
        rates.hit(["hot"], now=start + tick / 20)
    rates.hit(["cold"], now=start + 99.0)
    at = start + 100.0
    assert rates.rate("hot", at) == pytest.approx(20.0, rel=0.05)
    assert rates.rate("hot", at + 10.0) == pytest.approx(10.0, rel=0.05)  # one half-life later
    assert rates.rate("nothing", at) == 0.0
    assert rates.take_touched() == {"hot", "cold"} and rates.take_touched() == set()
    monkeypatch.setattr(heat, "RESCALE", 10.0)  # every count scaled down, the epoch moved: same rates
    before = dict(rates.items(at + 50.0))
    assert dict(rates.items(at + 50.0)) == pytest.approx(before) and rates._epoch == at + 50.0


def test_only_the_hottest_half_is_kept_when_full():
    rates = AccessRates(half_life=10.0, max_keys=10)
    now = rates._epoch
    rates.add([(f"k{i}", float(i + 1)) for i in range(11)], now=now)
    assert len(rates) == 6 and "k10" in dict(rates.items(now)) and "k0" not in dict(rates.items(now))


def test_a_full_table_of_equal_counts_halves_too_and_forgets_what_it_dropped_as_touched():
    rates = AccessRates(half_life=10.0, max_keys=10)
    now = rates._epoch
    rates.add([(f"k{i}", 1.0) for i in range(11)], now=now)  # every count the median
    kept = dict(rates.items(now))
    assert len(kept) == 6 and rates.take_touched() == set(kept)
    rates.add([(f"k{i}", 1.0) for i in range(11, 16)], now=now)  # past max_keys again: halved again
    assert len(rates) == 6  # 11 again, 6 kept
