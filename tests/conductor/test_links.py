"""The front's book of links (``conductor/front/links.py``): each pull a worker reports prices the
link from the node its blocks came from, pair by pair."""

import pytest
from pydantic import ValidationError

from tiercake.conductor.front.links import LinkBook, source_node
from tiercake.messages import PrefillStats
from tiercake.policies import LinkModel


def pull(nbytes: int, seconds: float, **sources: int) -> PrefillStats:
    return PrefillStats(prompt_tokens=1024, load_bytes=nbytes, load_s=seconds, sources=sources)


def test_each_pair_is_priced_by_its_own_pulls():
    book = LinkBook()
    for n in (1 << 20, 8 << 20):
        book.observe("w1", pull(n, 0.001 + n / 20e9, **{"h1:pool": 8}))  # its own host's pool
        book.observe("w1", pull(n, 0.004 + n / 0.1e9, **{"h3:pool": 8, "gpu": 2}))  # a far host, slow
    near, far = book.model("w1", "h1"), book.model("w1", "h3")
    assert near.bytes_per_s == pytest.approx(20e9) and near.latency_s == pytest.approx(0.001)
    assert far.bytes_per_s == pytest.approx(0.1e9) and far.latency_s == pytest.approx(0.004)
    # a node it never pulled from: its pulls from anywhere; another worker: nothing measured yet
    assert book.model("w1", "h2").bytes_per_s < near.bytes_per_s
    assert book.model("w2", "h1") == LinkModel()


def test_a_report_without_a_measurement_is_ignored_and_sources_name_the_node():
    book = LinkBook()
    book.observe("w1", pull(0, 0.0))
    book.observe("w1", pull(1 << 20, 0.0, **{"h1:pool": 1}))
    assert book.model("w1", "h1") == LinkModel()
    with pytest.raises(ValidationError):  # a worker's NaN never reaches the book
        pull(1 << 20, float("nan"), **{"h1:pool": 1})
    assert source_node(pull(1, 1.0, **{"gpu": 9, "h2:ssd": 3, "h3:pool": 2})) == "h2"
    assert source_node(pull(1, 1.0, gpu=4)) is None


def test_a_pairs_price_goes_stale_so_a_link_priced_slow_is_measured_again():
    """One pull that waited behind something else priced a fast link slow; nothing pulls over a link
    priced slow, so without an end to the measurement it would stay unused for good."""
    from tiercake.conductor.front.links import STALE_S

    now = [0.0]
    book = LinkBook(clock=lambda: now[0])
    book.observe("w1", pull(1 << 20, 0.2, **{"h3:pool": 16}))
    assert book.model("w1", "h3").seconds(1 << 20) == pytest.approx(0.2)
    now[0] = STALE_S + 1
    assert book.model("w1", "h3") == LinkModel()  # unmeasured again: the next pull measures it
