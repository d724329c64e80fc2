"""Tensors in shards (``tiercake.kvstore.parallel``, Mooncake's ``*_with_parallelism`` calls): the
header every shard carries, the axes' rules and names, and a read cutting any split out of the
shards another split wrote, against a real cluster."""

from __future__ import annotations

import ctypes
import uuid
from types import SimpleNamespace

import pytest
import torch
from kvstore_helpers import SECRET, TOKEN, KvCluster

from tiercake.kvstore import DistributedStore, ErrorCode, InvalidParams
from tiercake.kvstore.parallel import ShardRead, decode, layout_of, shard_to_write
from tiercake.kvstore.tensors import HEADER_BYTES, Part, TensorHeader, pack, split, unpack
from tiercake.kvstore.types import ParallelAxis, ReadTarget, TensorParallelism


def axes(*specs) -> TensorParallelism:
    """``("tp", rank, size, split_dim)``, ``("dp", rank, size)``, ``("pp", rank, size, stage)``,
    ``("ep", rank, size, expert)``."""
    out = []
    for kind, rank, size, *extra in specs:
        axis = ParallelAxis(kind, size=size, rank=rank)
        if kind == "tp":
            axis.split_dim = extra[0]
        elif kind == "pp":
            axis.stage_id = extra[0]
        elif kind == "ep":
            axis.expert_id = extra[0]
        out.append(axis)
    return TensorParallelism(out)


def grid(*shape) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)


# The header ------------------------------------------------------------------------------------


def test_the_header_is_304_bytes_and_a_part_keeps_its_place_and_split():
    t = grid(4, 6)
    assert pack(t).size == HEADER_BYTES + t.numel() * 4  # Mooncake's callers size buffers so
    (piece, place), *_ = split(t, 3, 1)[1:]
    header, back = unpack(pack(piece, place))
    assert header == TensorHeader(torch.float32, (4, 2), Part((4, 6), (0, 2), 3, 1)) and torch.equal(back, piece)
    bad = pack(piece, Part((4, 6), (0, 5), 3, 1))  # a part that reaches past its whole
    with pytest.raises(InvalidParams):
        unpack(bad)
    with pytest.raises(InvalidParams):
        unpack(pack(t)[:-1])


# Axes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        axes(("dp", 0, 2), ("tp", 0, 2, 0), ("dp", 1, 2)),  # a kind twice
        TensorParallelism([ParallelAxis("dp", size=2, rank=0, split_dim=0)]),  # dp does not split
        TensorParallelism([ParallelAxis("ep", size=2, rank=0)]),  # an expert axis names its expert
        TensorParallelism([ParallelAxis("pp", size=2, rank=0)]),  # a stage axis names its stage
        TensorParallelism([ParallelAxis("tp", size=2, rank=0)]),  # tp splits along a dimension
        axes(("tp", 2, 2, 0)),
        axes(("tp", 0, 0, 0)),
        axes(("xp", 0, 1)),
        TensorParallelism([ParallelAxis("tp", size=2, rank=0, split_dim=0.5)]),
    ],
)
def test_bad_axes_are_refused(bad):
    with pytest.raises(InvalidParams):
        layout_of(bad)


def test_names_do_not_depend_on_the_order_axes_are_listed_in():
    a = layout_of(axes(("dp", 1, 2), ("tp", 0, 4, 1)))
    b = layout_of(axes(("tp", 0, 4, 1), ("dp", 1, 2)))
    assert a == b and a.name("k") == "k__dp_1of2__tp_0" and a.name("k", 3) == "k__dp_1of2__tp_3"
    assert layout_of(axes(("tp", 2, 4, 0))).name("k") == "k_tp_2"  # the *_with_tp calls' names
    assert layout_of(axes(("pp", 0, 2, 7), ("ep", 1, 2, 11))).name("k") == "k__pp_0of2_sid7__ep_1of2_eid11"
    assert layout_of(None).name("k") == "k"


def test_a_write_cuts_its_shard_from_the_whole_only_when_told_and_only_evenly():
    t = grid(4, 6)
    shard, place = shard_to_write(t, layout_of(axes(("dp", 0, 2), ("tp", 1, 3, 1))), full=True)
    assert torch.equal(shard, t[:, 2:4]) and place == Part((4, 6), (0, 2), 3, 1)
    shard, place = shard_to_write(t[:, :2], layout_of(axes(("tp", 0, 3, 1))), full=False)
    assert place.whole == (4, 6)  # a caller-split shard: the whole is inferred from the split
    with pytest.raises(InvalidParams):
        shard_to_write(t, layout_of(axes(("dp", 0, 2), ("tp", 0, 4, 1))), full=True)  # 6 in 4
    with pytest.raises(InvalidParams):
        shard_to_write(t, layout_of(axes(("dp", 0, 2), ("tp", 0, 2, 2))), full=True)  # no dimension 2


def _run(read: ShardRead, objects: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor | None, list[list[str]]]:
    rounds = []
    while read.wants():
        rounds.append(list(read.wants()))
        read.feed({n: decode(objects[n]) if objects.get(n) is not None else None for n in read.wants()})
    return read.result, rounds


def test_a_read_takes_one_round_when_the_split_matches_and_at_most_three_otherwise():
    t = grid(8, 6)
    stored = {f"k_tp_{r}": pack(piece, place) for r, (piece, place) in enumerate(split(t, 4, 0))}
    got, rounds = _run(ShardRead("k", ReadTarget("shard", axes(("tp", 1, 4, 0)))), stored)
    assert torch.equal(got, t[2:4]) and rounds == [["k_tp_1"]]
    got, rounds = _run(ShardRead("k", ReadTarget("shard", axes(("tp", 1, 2, 0)))), stored)
    assert torch.equal(got, t[4:]) and rounds == [["k_tp_1"], ["k_tp_2", "k_tp_3"]]
    got, rounds = _run(ShardRead("k", ReadTarget("shard", axes(("tp", 5, 8, 0)))), stored)
    assert torch.equal(got, t[5:6]) and rounds == [["k_tp_5"], ["k_tp_0"], ["k_tp_2"]]
    got, _ = _run(ShardRead("k", ReadTarget("shard", axes(("tp", 0, 3, 1)))), stored)
    assert torch.equal(got, t[:, :2])  # across the stored split: every stored shard gives a piece
    got, _ = _run(ShardRead("k", ReadTarget("full")), stored)
    assert torch.equal(got, t)
    assert _run(ShardRead("k", ReadTarget("shard", axes(("tp", 0, 5, 0)))), stored)[0] is None  # 8 rows in 5
    del stored["k_tp_2"]
    assert _run(ShardRead("k", ReadTarget("full")), stored)[0] is None  # a missing shard: no answer
    stored["k_tp_2"] = pack(*split(grid(8, 6) + 1, 2, 0)[1])  # a shard of another split
    assert _run(ShardRead("k", ReadTarget("full")), stored)[0] is None


# Against a cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    cluster = KvCluster(tmp_path_factory.mktemp("kvparallel"))
    s = DistributedStore()
    assert s.setup(cluster.urls, secret=SECRET, token=TOKEN, tenant=f"par{uuid.uuid4().hex[:6]}") == 0
    yield s
    s.close()
    cluster.close()


@pytest.mark.cluster
def test_shards_written_one_way_are_read_any_way(store):
    t = grid(8, 12, 6)
    for mode in ("tp", "dp_tp", "pp_tp", "ep_tp"):
        key = f"m-{mode}"
        scope = {"tp": (), "dp_tp": (("dp", 0, 2),), "pp_tp": (("pp", 0, 2, 7),), "ep_tp": (("ep", 0, 2, 11),)}[mode]
        for rank in range(4):
            p = axes(*scope, ("tp", rank, 4, 1))
            given = t.chunk(4, 1)[rank].contiguous() if mode == "tp" else t  # tp alone takes the shard
            assert store.put_tensor_with_parallelism(key, given, p) == 0
        for size in (2, 3, 4, 6, 12):
            for rank in range(size):
                got = store.get_tensor_with_parallelism(key, ReadTarget("shard", axes(*scope, ("tp", rank, size, 1))))
                assert torch.equal(got, t.chunk(size, 1)[rank]), (mode, size, rank)
        full = store.get_tensor_with_parallelism(key, ReadTarget("full", axes(("tp", 3, 4, 1), *scope)))
        assert torch.equal(full, t)  # and the axes in another order name the same shards
        assert store.get_tensor_with_parallelism(key, ReadTarget("shard", axes(*scope, ("tp", 0, 5, 1)))) is None
    assert torch.equal(store.get_tensor_with_tp("m-tp", 2, 4, 1), t.chunk(4, 1)[2])  # the wrapper's names


@pytest.mark.cluster
def test_writer_partitions_and_upserts_and_refusals(store):
    t = grid(6, 8)
    for rank in range(4):
        assert (
            store.put_tensor_with_parallelism("w", t, writer_partition=SimpleNamespace(rank=rank, size=4, split_dim=1))
            == 0
        )
    assert torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("full")), t)
    assert torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("shard", axes(("tp", 1, 2, 1)))), t[:, 4:])
    new = t + 100
    codes = store.batch_upsert_tensor_with_parallelism(
        ["w"] * 4, [new] * 4, writer_partitions=[SimpleNamespace(rank=r, size=4, split_dim=1) for r in range(4)]
    )
    assert codes == [0] * 4 and torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("full")), new)
    # refused, and nothing stored: an uneven split, bad axes, both routes at once, mismatched lists
    odd = grid(2, 3)
    assert (
        store.put_tensor_with_parallelism("odd", odd, axes(("dp", 0, 2), ("tp", 0, 2, 1))) == ErrorCode.INVALID_PARAMS
    )
    assert store.get_tensor_with_parallelism("odd", ReadTarget("shard", axes(("dp", 0, 2), ("tp", 0, 2, 1)))) is None
    assert store.put_tensor_with_parallelism("odd", odd, TensorParallelism([ParallelAxis("ep", 2, 0)])) != 0
    both = store.batch_put_tensor_with_parallelism(
        ["x"], [t], [axes(("tp", 0, 2, 0))], writer_partitions=[SimpleNamespace(rank=0, size=2, split_dim=0)]
    )
    assert both == [ErrorCode.INVALID_PARAMS]
    assert store.batch_put_tensor_with_parallelism(["x", "y"], [t]) == [ErrorCode.INVALID_PARAMS] * 2
    mixed = store.batch_put_tensor_with_parallelism(
        ["ok", "bad"], [grid(2, 4), odd], [axes(("dp", 0, 2), ("tp", 1, 2, 1))] * 2
    )
    assert mixed[0] == 0 and mixed[1] == ErrorCode.INVALID_PARAMS  # per item, as Mooncake answers
    assert store.get_tensor_with_parallelism("nothing", ReadTarget("full")) is None
    assert store.get_tensor_with_parallelism("w", ReadTarget("sideways")) is None  # a bad mode: no answer


@pytest.mark.cluster
def test_reads_into_registered_buffers_and_writes_from_them(store):
    t = grid(8, 6)
    size = HEADER_BYTES + t.numel() * 4  # exactly what a packed tensor takes
    buf = (ctypes.c_ubyte * (2 * size))()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 2 * size) == 0
    try:
        assert store.put_tensor("seed", t) == 0
        assert torch.equal(store.get_tensor_into("seed", ptr, size), t)
        for rank in range(2):  # the buffer holds the packed whole: each rank's write cuts its shard
            p = axes(("pp", 0, 2, 4), ("tp", rank, 2, 0))
            assert store.put_tensor_with_parallelism_from("f", ptr, size, p) == 0
        p = axes(("pp", 0, 2, 4), ("tp", 1, 2, 0))
        got = store.batch_get_tensor_with_parallelism_into(
            ["f", "f"], [ptr + size, ptr], [size, 100], [ReadTarget("full", p), ReadTarget("full", p)]
        )
        assert torch.equal(got[0], t) and got[1] is None  # the second buffer is too small
        got[0].fill_(7)  # a view of the buffer
        assert bytes(buf)[size + HEADER_BYTES : size + HEADER_BYTES + 4] == torch.tensor([7.0]).numpy().tobytes()
        assert store.put_tensor_with_parallelism_from("f2", ptr, 10, p) == ErrorCode.INVALID_PARAMS
    finally:
        assert store.unregister_buffer(ptr) == 0
