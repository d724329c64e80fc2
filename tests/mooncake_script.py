"""One script written for Mooncake Store's Python API, run unchanged against Mooncake and against
tiercake (only the import and the setup call differ): `python mooncake_script.py mooncake HOST:PORT`
or `python mooncake_script.py tiercake CONDUCTOR_URL` (secret and token from the environment). Prints
the transcript of every call's answer as JSON; tests/test_kvstore.py compares the two."""

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
    note("get_into big equal", bytes(buf[8 << 20:28 << 20]) == big)
    blocks = [np.random.default_rng(10 + i).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for i in range(8)]
    for i, b in enumerate(blocks):
        ctypes.memmove(ptr + i * (64 << 10), b, len(b))
    keys = [f"blk{i}" for i in range(8)]
    note("batch_put_from", store.batch_put_from(keys, [ptr + i * (64 << 10) for i in range(8)], [64 << 10] * 8))
    dsts = [ptr + (1 << 20) + i * (64 << 10) for i in range(8)]
    note("batch_get_into", store.batch_get_into(keys + ["missing"], dsts + [ptr + (2 << 20)], [64 << 10] * 9))
    note("batch_get_into equal", [bytes(buf[d - ptr:d - ptr + (64 << 10)]) == b for d, b in zip(dsts, blocks)])
    note("get_batch", [v == b for v, b in zip(store.get_batch(keys[:3]), blocks)])
    note("remove missing", store.remove("missing", force=True))
    note("remove", store.remove("pf", force=True))
    note("is_exist removed", store.is_exist("pf"))
    note("remove_all", store.remove_all(force=True))
    note("batch_is_exist after remove_all", store.batch_is_exist(["a", "big", "blk0"]))
    note("unregister_buffer", store.unregister_buffer(ptr))
    note("unregister_buffer again", store.unregister_buffer(ptr))
    note("close", store.close())
    return out


if __name__ == "__main__":
    print(json.dumps(exercise(connect(sys.argv[1], sys.argv[2]))))
