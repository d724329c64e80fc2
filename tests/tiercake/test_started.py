import pytest

from tiercake.started import started


class Late(Exception):
    pass


def test_a_part_asked_for_before_its_owner_started_is_a_typed_error_naming_it():
    assert started(0, "a counter") == 0  # only None is "not made yet"
    with pytest.raises(RuntimeError, match="the worker is not started"):
        started(None, "the worker")
    with pytest.raises(Late, match="the etcd backend is not started"):
        started(None, "the etcd backend", Late)
