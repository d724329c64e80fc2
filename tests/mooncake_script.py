"""One script written for Mooncake Store's Python API, run unchanged against Mooncake and against
tiercake (only the import and the setup call differ): `python mooncake_script.py mooncake HOST:PORT`
or `python mooncake_script.py tiercake CONDUCTOR_URL` (secret and token from the environment). Prints
the transcript of every call's answer as JSON; tests/kvstore/test_kvstore.py compares the two."""

import ctypes
import json
import sys

import numpy as np


def connect(kind: str, where: str):
    if kind == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 128 << 20, 64 << 20, "tcp", "", where)
    else:
        from tiercake.kvstore import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(where)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    return store


def exercise(store) -> list:
    out = []

    def note(what, value):
        out.append([what, value])

    big = np.random.default_rng(1).integers(0, 256, 20 << 20, dtype=np.uint8).tobytes()
    note("put", store.put("a", b"hello"))
    note("put again", store.put("a", b"other value"))
    note("get", store.get("a").decode())
    note("get missing", store.get("missing").decode())
    note("get_size", store.get_size("a"))
    note("get_size missing", store.get_size("missing"))
    note("is_exist", [store.is_exist("a"), store.is_exist("missing")])
    note("batch_is_exist", store.batch_is_exist(["a", "missing", "a"]))
    note("put empty value", store.put("empty", b""))
    note("put empty key", store.put("", b"x"))
    note("put big", store.put("big", big))
    note("get_size big", store.get_size("big"))
    note("get big equal", store.get("big") == big)
    note("upsert", store.upsert("a", b"replaced"))
    note("get after upsert", store.get("a").decode())

    size = 32 << 20
    buf = (ctypes.c_ubyte * size)()
    ptr = ctypes.addressof(buf)
    note("register_buffer", store.register_buffer(ptr, size))
    ctypes.memmove(ptr, b"from a buffer", 13)
    note("put_from", store.put_from("pf", ptr, 13))
    note("get pf", store.get("pf").decode())
    note("get_into too small", store.get_into("a", ptr + 1000, 3))
    note("get_into", store.get_into("a", ptr + 1000, 100))
    note("get_into bytes", bytes(buf[1000:1008]).decode())
    note("get_into missing", store.get_into("missing", ptr + 1000, 100))
    note("get_into big", store.get_into("big", ptr + (8 << 20), 20 << 20))
    note("get_into big equal", bytes(buf[8 << 20 : 28 << 20]) == big)
    blocks = [np.random.default_rng(10 + i).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for i in range(8)]
    for i, b in enumerate(blocks):
        ctypes.memmove(ptr + i * (64 << 10), b, len(b))
    keys = [f"blk{i}" for i in range(8)]
    note("batch_put_from", store.batch_put_from(keys, [ptr + i * (64 << 10) for i in range(8)], [64 << 10] * 8))
    dsts = [ptr + (1 << 20) + i * (64 << 10) for i in range(8)]
    note("batch_get_into", store.batch_get_into(keys + ["missing"], dsts + [ptr + (2 << 20)], [64 << 10] * 9))
    note("batch_get_into equal", [bytes(buf[d - ptr : d - ptr + (64 << 10)]) == b for d, b in zip(dsts, blocks)])
    note("get_batch", [v == b for v, b in zip(store.get_batch(keys[:3]), blocks)])
    note("remove missing", store.remove("missing", force=True))
    note("remove", store.remove("pf", force=True))
    note("is_exist removed", store.is_exist("pf"))
    note("remove_all", store.remove_all(force=True))
    note("batch_is_exist after remove_all", store.batch_is_exist(["a", "big", "blk0"]))
    exercise_more(store, ptr, note)
    note("unregister_buffer", store.unregister_buffer(ptr))
    note("unregister_buffer again", store.unregister_buffer(ptr))
    note("close", store.close())
    return out


def exercise_more(store, ptr, note) -> None:
    """Batches, leases, buffers, parts, descriptors, multi-buffer and range reads, tensors."""
    import torch

    note("put_batch with an empty value", store.put_batch(["pb1", "pb2", "pb3"], [b"x", b"", b"z"]))
    note("put_batch stored none of it", store.batch_is_exist(["pb1", "pb2", "pb3"]))
    note("put_batch twice one key", store.put_batch(["d1", "d1"], [b"one", b"two"]))
    note("get of it", store.get("d1").decode())
    note("put_batch of nothing", store.put_batch([], []))
    note("put_batch of unequal lists", store.put_batch(["a1", "a2"], [b"x"]))
    store.put("k", b"value-k")
    store.is_exist("k")
    note("remove after is_exist", store.remove("k"))  # the exists granted a read lease
    note("upsert under a lease", store.upsert("k", b"new-k"))
    note("get after it", store.get("k").decode())
    handle = store.get_buffer("k")
    note("get_buffer", [handle.size(), ctypes.string_at(handle.ptr(), handle.size()).decode()])
    note("get_buffer missing", store.get_buffer("nope"))
    note("batch_get_buffer", [None if h is None else h.size() for h in store.batch_get_buffer(["k", "nope", "d1"])])
    note("put_parts", store.put_parts("parts", b"ab", b"cd", b"ef"))
    note("get parts", store.get("parts").decode())
    note("upsert_parts", store.upsert_parts("parts", b"XY", b"Z"))
    note("get parts again", store.get("parts").decode())
    note("upsert_batch", store.upsert_batch(["k", "u2"], [b"v1", b"v2"]))
    note("get u2", store.get("u2").decode())
    note(
        "replica desc",
        [
            [d.is_memory_replica(), d.is_disk_replica(), d.get_memory_descriptor().buffer_descriptor.size > 0]
            for d in store.get_replica_desc("k")
        ][:1],
    )
    note("replica desc missing", len(store.get_replica_desc("nope")))
    note("batch replica desc", sorted(store.batch_get_replica_desc(["k", "nope"])))
    note("health_check", store.health_check())
    note("remove_by_regex bad pattern", store.remove_by_regex("([", True))
    ctypes.memmove(ptr, b"AAAA", 4)
    ctypes.memmove(ptr + 4096, b"BBBBBB", 6)
    note(
        "multi-buffer put",
        store.batch_put_from_multi_buffers(["m1", "m2"], [[ptr, ptr + 4096], [ptr + 4096]], [[4, 6], [6]]),
    )
    note("multi-buffer object", store.get("m1").decode())
    note(
        "multi-buffer get",
        store.batch_get_into_multi_buffers(
            ["m1", "nope"], [[ptr + 100000, ptr + 200000], [ptr + 300000]], [[5, 5], [10]]
        ),
    )
    note("multi-buffer got", [ctypes.string_at(ptr + 100000, 5).decode(), ctypes.string_at(ptr + 200000, 5).decode()])
    note("multi-buffer get too small", store.batch_get_into_multi_buffers(["m1"], [[ptr + 100000]], [[3]]))
    note(
        "ranges",
        store.get_into_ranges([ptr + 500000], [["m1", "m2"]], [[[0, 10], [20]]], [[[0, 2], [1]]], [[[2, 2], [3]]]),
    )
    note(
        "ranges got",
        [
            ctypes.string_at(ptr + 500000, 2).decode(),
            ctypes.string_at(ptr + 500010, 2).decode(),
            ctypes.string_at(ptr + 500020, 3).decode(),
        ],
    )
    note("put_from_with_metadata", store.put_from_with_metadata("pm", ptr + 4096, ptr, 6, 4))
    note("its object", store.get("pm").decode())
    note("batch_upsert_from", store.batch_upsert_from(["m1"], [ptr + 4096], [6]))
    note("upserted from a buffer", store.get("m1").decode())
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    note("put_tensor", store.put_tensor("t", t))
    note("get_tensor", store.get_tensor("t").tolist())
    note("get_tensor missing", store.get_tensor("nope"))
    note("put_tensor of a transposed tensor", store.put_tensor("tn", t.t()))
    note("its tensor", store.get_tensor("tn").tolist())
    note("put_tensor_with_tp", store.put_tensor_with_tp("tp", t, tp_rank=0, tp_size=2, split_dim=1))
    note("its shards", store.batch_is_exist(["tp", "tp_tp_0", "tp_tp_1"]))
    note("get_tensor_with_tp rank 1", store.get_tensor_with_tp("tp", tp_rank=1, tp_size=2, split_dim=1).tolist())
    note("get_tensor of the base key", store.get_tensor("tp"))
    note("put_tensor of bytes", store.put_tensor("tb", b"xx"))
    note("get_tensor of bytes", store.get_tensor("k"))
    note("put of an empty tensor", store.put_tensor("te", torch.empty(0)))
    note("get of an empty tensor", store.get_tensor("te").tolist())
    for name in ("rx1", "rx2", "rx3"):
        store.put(name, b"r")
    note("remove_by_regex", store.remove_by_regex("^rx", True))


if __name__ == "__main__":
    print(json.dumps(exercise(connect(sys.argv[1], sys.argv[2]))))
