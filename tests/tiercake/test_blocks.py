import concurrent.futures
import subprocess
import sys
import threading

import numpy as np
import pytest

from tiercake.blocks import (
    BlockKey,
    BlockLayout,
    Namespace,
    SealCheck,
    block_keys,
    block_parents,
    chain_key,
    seal_material,
    sealer_for,
)

NS = Namespace(model_id="llama-3-8b@rev1", kv_layout="L32.H8.D128.B16.float16", block_size=16)


def test_full_blocks_only():
    assert len(block_keys(NS, list(range(47)))) == 2
    assert len(block_keys(NS, list(range(48)))) == 3
    assert block_keys(NS, list(range(15))) == []


def test_shared_prefix_gives_equal_leading_keys():
    a = block_keys(NS, list(range(64)))
    b = block_keys(NS, list(range(32)) + [7] * 32)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_key_names_the_whole_prefix():
    # the same second block after a different first block is a different key
    a = block_keys(NS, [1] * 16 + [2] * 16)
    b = block_keys(NS, [3] * 16 + [2] * 16)
    assert a[1] != b[1]


@pytest.mark.parametrize(
    "other",
    [
        NS.model_copy(update={"model_id": "llama-3-8b@rev2"}),
        NS.model_copy(update={"kv_layout": "L32.H8.D128.B16.bfloat16"}),
        NS.model_copy(update={"tenant_salt": "tenant-b"}),
    ],
)
def test_other_namespace_other_keys(other):
    tokens = list(range(64))
    assert not set(block_keys(NS, tokens)) & set(block_keys(other, tokens))


def test_block_size_is_part_of_the_namespace():
    ns32 = NS.model_copy(update={"block_size": 32})
    assert block_keys(ns32, list(range(64)))[0] != block_keys(NS, list(range(64)))[1]
    assert NS.root() != ns32.root()


@pytest.mark.cluster
def test_keys_are_stable_across_processes():
    """The key of a fixed input is a constant: no per-process hash seed, no Python hash()."""
    code = (
        "from tiercake.blocks import Namespace, block_keys;"
        "ns = Namespace(model_id='m', kv_layout='x', block_size=4, tenant_salt='t');"
        "print(block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8])[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1
    ns = Namespace(model_id="m", kv_layout="x", block_size=4, tenant_salt="t")
    assert outs == {chain_key(chain_key(ns.root(), [1, 2, 3, 4]), [5, 6, 7, 8]).hex()}


def test_key_is_pinned_to_a_known_value():
    ns = Namespace(model_id="m", kv_layout="x", block_size=2)
    assert block_keys(ns, [0, 1])[0].hex() == KNOWN


# Computed once and pinned: a change to the hash would silently orphan every persisted block.
KNOWN = "b494397bc7ad346e63b6de3bf146dc8b50d2c21fb468d20a743e5de45ed75de7"


def test_numpy_and_list_tokens_agree():
    tokens = list(range(100, 164))
    assert block_keys(NS, tokens) == block_keys(NS, np.array(tokens, dtype=np.int64))
    assert block_keys(NS, tokens) == block_keys(NS, np.array(tokens, dtype=np.uint32))


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_out_of_range_tokens_are_refused(bad):
    with pytest.raises(ValueError):
        block_keys(NS, bad)


def test_non_integer_tokens_are_refused():
    with pytest.raises(TypeError):
        block_keys(NS, np.zeros(16, dtype=np.float32))
    with pytest.raises(ValueError):
        block_keys(NS, np.zeros((2, 16), dtype=np.int64))


def test_block_key_type():
    k = block_keys(NS, list(range(16)))[0]
    assert isinstance(k, BlockKey) and len(k) == 32
    assert BlockKey.from_hex(k.hex()) == k
    with pytest.raises(ValueError):
        BlockKey(b"short")
    with pytest.raises(ValueError):
        BlockKey.from_hex("zz")


def test_parents_chain():
    keys = block_keys(NS, list(range(48)))
    assert block_parents(keys) == [(keys[0], None), (keys[1], keys[0]), (keys[2], keys[1])]


def test_layout_sizes():
    layout = BlockLayout(layers=80, kv_heads=8, head_dim=128, block_size=1, dtype="bfloat16")
    assert layout.nbytes == 320 * 1024  # Llama-3-70B: about 320 KiB per token
    assert layout.shape == (80, 2, 1, 8, 128)
    with pytest.raises(ValueError):
        BlockLayout(layers=1, kv_heads=1, head_dim=1, dtype="float64")


def test_a_seal_binds_the_bytes_to_the_key_the_tenant_and_the_secret():
    material = seal_material(b"the-seal-secret-0123")
    alice = sealer_for(material, "alice")
    data = np.arange(4096, dtype=np.uint8)
    seal = alice.seal(b"k1", data)
    assert len(seal) == 16 and alice.verify(b"k1", data, seal)
    flipped = data.copy()
    flipped[100] ^= 1
    assert not alice.verify(b"k1", flipped, seal)  # other bytes
    assert not alice.verify(b"k2", data, seal)  # the same bytes under another key
    assert not sealer_for(material, "bob").verify(b"k1", data, seal)  # another tenant's salt
    assert not sealer_for(seal_material(b"another-secret-0123"), "alice").verify(b"k1", data, seal)
    assert not alice.verify(b"k1", data, b"") and not alice.verify(b"k1", data, seal[:8])
    assert sealer_for(material, "alice").seal(b"k1", data.tobytes()) == seal  # stable, any buffer
    with pytest.raises(ValueError, match="at least 16 bytes"):
        seal_material(b"short")


def test_block_keys_extend_a_known_chain_as_they_would_hash_it_whole():
    tokens = list(range(5 * NS.block_size + 3))
    whole = block_keys(NS, tokens)
    prompt = block_keys(NS, tokens[: 2 * NS.block_size + 1])
    assert block_keys(NS, tokens, known=prompt) == whole
    assert block_keys(NS, tokens[: NS.block_size], known=whole) == whole[:1]  # more known than full blocks


def test_a_seal_check_from_both_ends_finds_the_first_bad_seal_and_never_waits_for_an_idle_helper():
    """``SealCheck``: the loader's thread checks from the front, a helper from the back; the answer is
    the verified prefix either way. A helper still busy elsewhere when the front has checked every
    item is not waited for (the load would stall behind unrelated work)."""
    sealer = sealer_for(bytes(32), "")
    items = [(bytes([i]) * 32, bytes([i]) * 4096) for i in range(10)]
    sealed = [(k, d, sealer.seal(k, d)) for k, d in items]
    forged = list(sealed)
    forged[6] = (forged[6][0], forged[6][1], bytes(16))
    with concurrent.futures.ThreadPoolExecutor(1) as helper:

        def verified_prefix(items, helped: bool) -> int:
            check = SealCheck(sealer, items)
            if helped:
                helper.submit(check.from_back)
            return check.prefix(helped)

        assert verified_prefix(sealed, True) == 10 and verified_prefix(forged, True) == 6
        assert verified_prefix(forged, False) == 6 and verified_prefix(forged[:3], False) == 3
        check = SealCheck(sealer, forged)
        helper.submit(check.from_back)
        assert check.prefix() == 6  # both ends ran, whichever took the bad one
        busy = threading.Event()
        helper.submit(busy.wait)  # the helper is taken
        check = SealCheck(sealer, sealed)
        helper.submit(check.from_back)  # queued behind it
        assert check.prefix() == 10  # returned without the helper
        busy.set()
