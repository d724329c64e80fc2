"""The front's reading of a request's session: which header names it, tenant-scoped hashes, and the
directives' checks (the live path is in tests/cluster/test_serving.py)."""

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from tiercake.conductor.front.sessions import session_hash, session_of
from tiercake.errors import ApiError


def of(headers: dict, body_key: str | None = None, tenant: str = "t"):
    return session_of(CIMultiDictProxy(CIMultiDict(headers)), body_key, tenant)


def test_each_client_family_names_its_session_and_parent():
    h = lambda s: session_hash("t", s)  # noqa: E731
    cases = [
        ({"X-Tiercake-Session": "a", "X-Tiercake-Parent-Session": "p"}, h("a"), h("p")),
        ({"x-dynamo-session-id": "run:researcher", "X-Dynamo-Parent-Session-ID": "run"}, h("run:researcher"), h("run")),
        ({"X-Claude-Code-Session-ID": "cc"}, h("cc"), None),
        ({"X-Claude-Code-Session-ID": "cc", "X-Claude-Code-Agent-ID": "sub"}, h("cc/sub"), h("cc")),
        (
            {"X-Claude-Code-Session-ID": "cc", "X-Claude-Code-Agent-ID": "sub", "X-Claude-Code-Parent-Agent-ID": "p"},
            h("cc/sub"),
            h("cc/p"),
        ),
        ({"Thread-ID": "th", "X-Codex-Parent-Thread-ID": "root"}, h("th"), h("root")),
        ({"Session-ID": "codex-old"}, h("codex-old"), None),
        ({"X-Session-ID": "oc", "X-Parent-Session-ID": "oc-root"}, h("oc"), h("oc-root")),
    ]
    for headers, session, parent in cases:
        got = of(headers)
        assert (got.id, got.parent) == (session, parent), headers
    # ours wins over an agent's; a header over the body; the body's prompt_cache_key (or user) last
    assert of({"X-Tiercake-Session": "mine", "X-Session-ID": "theirs"}).id == h("mine")
    assert of({"X-Session-ID": "hdr"}, body_key="body").id == h("hdr")
    assert of({}, body_key="body").id == h("body")
    assert of({}) is None


def test_ids_are_scoped_by_tenant_and_never_the_clients_string():
    a, b = of({"X-Tiercake-Session": "same"}, tenant="a"), of({"X-Tiercake-Session": "same"}, tenant="b")
    assert a.id != b.id and "same" not in a.id and len(a.id) == 32


def test_directives_are_read_and_checked():
    got = of(
        {
            "X-Tiercake-Session": "s",
            "X-Tiercake-Session-Retain": "600",
            "X-Tiercake-Session-Priority": "-3",
            "X-Tiercake-Session-Pause": "0",
            "X-Dynamo-Session-Final": "TRUE",
        }
    )
    assert (got.retain_s, got.priority, got.pause_s, got.close) == (600.0, -3, 0.0, True)
    bad = [
        {"X-Tiercake-Session-Final": "true"},  # no session
        {"X-Tiercake-Session": "s", "X-Tiercake-Session-Retain": "inf"},
        {"X-Tiercake-Session": "s", "X-Tiercake-Session-Retain": "-1"},
        {"X-Tiercake-Session": "s", "X-Tiercake-Session-Pause": "1e30"},
        {"X-Tiercake-Session": "s", "X-Tiercake-Session-Priority": "1.5"},
        {"X-Tiercake-Session": "s", "X-Tiercake-Session-Final": "yes"},
        {"X-Tiercake-Session": ""},
        {"X-Tiercake-Session": "a\x07b"},
        {"X-Tiercake-Session": "s", "X-Tiercake-Parent-Session": "p" * 257},
    ]
    for headers in bad:
        with pytest.raises(ApiError) as err:
            of(headers)
        assert err.value.status == 400, headers


def test_the_book_keeps_the_latest_sessions_and_lets_closed_ones_age_out(monkeypatch):
    from tiercake.conductor.front import session_book
    from tiercake.messages import SessionDirective

    now = [1000.0]
    monkeypatch.setattr(session_book.time, "monotonic", lambda: now[0])
    book = session_book.SessionBook(max_sessions=2, closed_kept_s=10)
    a, b, c = (SessionDirective(id=f"{i}" * 32) for i in "abc")
    for s in (a, b, c):
        book.began("t", s)
        book.ended("t", s, "w1")
    assert [s.id for s in book.list()] == [b.id, c.id]  # a, the least recently used, went
    book.began("t", b)
    assert [s.state for s in book.list("t")] == ["paused", "active"] and book.list("other") == []
    book.ended("t", b.model_copy(update={"close": True}), None)
    closed = book.list()[-1]
    assert closed.state == "closed" and closed.turns == 2 and closed.worker == "w1"  # kept from the last turn
    now[0] += 11
    assert [s.id for s in book.list()] == [c.id]


def test_the_book_names_each_turns_preferred_workers_and_counts_paused_sessions_per_worker(monkeypatch):
    """What the session router reads: a turn starts where its session's last prompt was computed (not
    where its decode ran), a subagent's first turn where its parent's was; and how many paused
    sessions within their retention each worker computed last."""
    from tiercake.conductor.front import session_book
    from tiercake.messages import SessionDirective

    now = [1000.0]
    monkeypatch.setattr(session_book.time, "monotonic", lambda: now[0])
    book = session_book.SessionBook()
    parent, short = SessionDirective(id="a" * 32), SessionDirective(id="c" * 32, retain_s=5)
    child = SessionDirective(id="b" * 32, parent=parent.id)
    assert book.began("t", parent) == ()
    book.ended("t", parent, "decode-1", "prefill-2")
    assert book.began("t", child) == ("prefill-2",)  # its first turn: where the parent's prefix is
    book.ended("t", child, "decode-1", "prefill-1")
    assert book.began("t", child) == ("prefill-1", "prefill-2") and book.began("other", child) == ()
    book.ended("t", child, "decode-1", "prefill-1")
    book.began("t", short)
    book.ended("t", short, "w3")  # no split: the worker that answered computed it
    assert book.held_per_worker() == {"prefill-1": 1, "prefill-2": 1, "w3": 1}
    now[0] += 6  # the short session's retention is over; the count is at most a second stale
    assert book.held_per_worker()["w3"] == 0
    burst = SessionDirective(id="d" * 32)
    book.began("t", burst)
    book.ended("t", burst, "w9")
    assert book.held_per_worker()["w9"] == 1  # at once, not at the next recount: a burst spreads
    book.began("t", burst)
    assert book.held_per_worker()["w9"] == 0
    book.ended("t", parent.model_copy(update={"close": True}), "decode-1", "prefill-2")
    assert book.began("t", child) == ("prefill-1",)  # a closed parent is no reason to go anywhere
    now[0] += 1
    assert +book.held_per_worker() == {}  # the child runs a turn, the parent closed: nothing paused
