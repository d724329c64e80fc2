"""The history checker the key-value store's tests rely on: it must accept what a linearizable
register may answer and refuse each way a store can go wrong (a stale read, a lost update, a second
put's value winning, a read of nothing while the key holds a value)."""

from tiercake.linearizability import Op, check, explain


def op(kind, value, result, called, returned):
    return Op(kind, value, result, called, returned)


def test_sequential_histories_follow_the_model():
    assert check(
        [
            op("put", b"a", "ok", 0, 1),
            op("get", None, b"a", 2, 3),
            op("put", b"b", "ok", 4, 5),
            op("get", None, b"a", 6, 7),
            op("upsert", b"c", "ok", 8, 9),
            op("get", None, b"c", 10, 11),
            op("remove", None, "ok", 12, 13),
            op("get", None, None, 14, 15),
            op("remove", None, "not_found", 16, 17),
        ]
    )


def test_a_stale_read_after_a_completed_write_is_refused():
    history = [op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 3), op("get", None, b"a", 4, 5)]
    assert not check(history)
    assert "not linearizable" in explain(history)


def test_a_read_overlapping_a_write_may_see_either_value_but_not_go_back():
    assert check([op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 6), op("get", None, b"a", 3, 4)])
    assert check([op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 6), op("get", None, b"b", 3, 4)])
    # once a reader saw the new value, a later reader cannot see the old one
    assert not check(
        [
            op("upsert", b"a", "ok", 0, 1),
            op("upsert", b"b", "ok", 2, 10),
            op("get", None, b"b", 3, 4),
            op("get", None, b"a", 5, 6),
        ]
    )


def test_first_put_wins_and_a_second_put_cannot_replace_it():
    assert check([op("put", b"a", "ok", 0, 1), op("put", b"b", "ok", 2, 3), op("get", None, b"a", 4, 5)])
    assert not check([op("put", b"a", "ok", 0, 1), op("put", b"b", "ok", 2, 3), op("get", None, b"b", 4, 5)])
    # racing first puts: either may win, and then it stays
    assert check(
        [
            op("put", b"a", "ok", 0, 3),
            op("put", b"b", "ok", 1, 2),
            op("get", None, b"b", 4, 5),
            op("get", None, b"b", 6, 7),
        ]
    )
    assert not check(
        [
            op("put", b"a", "ok", 0, 3),
            op("put", b"b", "ok", 1, 2),
            op("get", None, b"b", 4, 5),
            op("get", None, b"a", 6, 7),
        ]
    )


def test_a_read_of_nothing_while_the_key_holds_a_value_is_refused():
    assert not check([op("put", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 5), op("get", None, None, 3, 4)])


def test_a_lost_update_is_refused():
    assert not check(
        [
            op("upsert", b"a", "ok", 0, 1),
            op("upsert", b"b", "ok", 2, 3),
            op("get", None, b"b", 4, 5),
            op("get", None, b"a", 6, 7),
        ]
    )


def test_a_write_of_unknown_outcome_may_land_late_or_never():
    assert check(
        [
            op("upsert", b"a", "ok", 0, 1),
            op("upsert", b"b", None, 2, None),
            op("get", None, b"a", 3, 4),
            op("get", None, b"b", 5, 6),
        ]
    )
    assert check([op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", None, 2, None), op("get", None, b"a", 3, 4)])
    # but not before it was called
    assert not check([op("upsert", b"a", "ok", 0, 1), op("get", None, b"b", 2, 3), op("upsert", b"b", None, 4, None)])


def test_a_long_concurrent_history_is_checked_quickly():
    import random

    rng = random.Random(7)
    ops, state, t = [], None, 0.0
    for i in range(1500):  # a sequential register's answers, with every call widened to overlap others
        kind = rng.choice(["put", "upsert", "remove", "get", "get"])
        value = f"v{i}".encode() if kind in ("put", "upsert") else None
        if kind == "put":
            result, state = "ok", state if state is not None else value
        elif kind == "upsert":
            result, state = "ok", value
        elif kind == "remove":
            result, state = ("ok" if state is not None else "not_found"), None
        else:
            result = state
        ops.append(op(kind, value, result, t - rng.random() * 3, t + rng.random() * 3))
        t += 1.0
    assert check(ops)


def test_stale_reads_are_counted_one_by_one_and_only_where_no_order_allows_them():
    from tiercake.chaos.kv import stale_reads

    # a read of a value an upsert replaced before the read began: stale, each such read counted
    replaced = [op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 3)]
    assert stale_reads([*replaced, op("get", None, b"a", 4, 5), op("get", None, b"a", 6, 7)]) == 2
    assert stale_reads([*replaced, op("get", None, b"b", 4, 5)]) == 0
    # a put onto a present object leaves it as it was: reading the first value after it is right
    assert stale_reads([op("put", b"a", "ok", 0, 1), op("put", b"b", "ok", 2, 3), op("get", None, b"a", 4, 5)]) == 0
    # a write still running when the read began may or may not be seen
    assert (
        stale_reads([op("upsert", b"a", "ok", 0, 1), op("upsert", b"b", "ok", 2, 6), op("get", None, b"a", 3, 4)]) == 0
    )
    # nothing read back: stale unless a removal may fall between the last write and the read
    wrote = [op("upsert", b"a", "ok", 0, 1)]
    assert stale_reads([*wrote, op("get", None, None, 2, 3)]) == 1
    assert stale_reads([*wrote, op("remove", None, "ok", 0.5, 2.5), op("get", None, None, 2, 3)]) == 0
    assert stale_reads([*wrote, op("remove", None, "ok", 0.5, None), op("get", None, None, 2, 3)]) == 0
    # a removal done before the read, after the value was written: reading the value is stale
    assert stale_reads([*wrote, op("remove", None, "ok", 2, 3), op("get", None, b"a", 4, 5)]) == 1
    # what the checker refuses as not linearizable, stale_reads names
    history = [*replaced, op("get", None, b"a", 4, 5)]
    assert not check(history) and stale_reads(history) == 1
