import sys
import textwrap

import pytest

from tiercake.policies import LRU, AdmitOnNth, PolicyNotFoundError, available, create_admission, create_eviction

PLUGIN = textwrap.dedent(
    '''
    from tiercake.policies import EvictionPolicy, BlockMeta

    class NewestFirst(EvictionPolicy):
        """Evicts the most recently inserted block: the opposite of FIFO."""
        name = "newest_first"

        def __init__(self, tag="x"):
            self.tag = tag
            self.keys = []

        def on_insert(self, key, meta=BlockMeta()):
            if key in self.keys:
                self.keys.remove(key)
            self.keys.append(key)

        def on_access(self, key):
            pass

        def on_remove(self, key):
            if key in self.keys:
                self.keys.remove(key)

        def victims(self, n, can_evict=lambda k: True):
            out = [k for k in reversed(self.keys) if can_evict(k)][:n]
            for k in out:
                self.keys.remove(k)
            return out

        def __len__(self):
            return len(self.keys)

        def __contains__(self, key):
            return key in self.keys

    class NotAPolicy:
        pass
    '''
)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A policy package outside tiercake, importable and advertised through an entry point."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "outside_policies.py").write_text(PLUGIN)
    dist = pkg / "outside_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tiercake.policies]\nnewest = outside_policies:NewestFirst\n")
    monkeypatch.syspath_prepend(str(pkg))
    yield pkg
    sys.modules.pop("outside_policies", None)


def test_builtins_by_name():
    assert isinstance(create_eviction("lru"), LRU)
    assert isinstance(create_admission("nth", {"n": 3}), AdmitOnNth)
    assert {"lru", "lfu", "fifo", "s3fifo", "arc", "leaf_lru", "always", "nth"} <= set(available())


def test_module_class_path(plugin_dir):
    policy = create_eviction("outside_policies:NewestFirst", {"tag": "y"})
    assert policy.tag == "y"


def test_entry_point(plugin_dir):
    assert available()["newest"] == "plug-in"
    policy = create_eviction("newest")
    assert type(policy).__name__ == "NewestFirst"


async def test_store_uses_an_outside_policy(plugin_dir, make_store):
    from conftest import block, key

    store = await make_store(gpu=3, pool=None, ssd=None, policies={"gpu": create_eviction("newest")})
    for i in range(3):
        await store.put(key(i), block(i))
    await store.drain()
    # the gpu tier passed its high watermark: the round evicted the newest block, which only this
    # policy would pick (LRU or FIFO would have taken the oldest)
    assert store.tiers[0].eviction.name == "newest_first"
    assert [store.contains(key(i)) for i in range(3)] == [True, True, False]


def test_errors(plugin_dir):
    with pytest.raises(PolicyNotFoundError, match=r"unknown eviction policy 'nope': not a built-in \(arc, fifo"):
        create_eviction("nope")
    with pytest.raises(PolicyNotFoundError, match="cannot import"):
        create_eviction("no_such_module_xyz:Thing")
    with pytest.raises(PolicyNotFoundError, match="has no"):
        create_eviction("outside_policies:Missing")
    with pytest.raises(TypeError, match="not a EvictionPolicy"):
        create_eviction("outside_policies:NotAPolicy")
    with pytest.raises(TypeError, match="not a EvictionPolicy"):
        create_eviction("always")
    with pytest.raises(TypeError, match="rejected its parameters"):
        create_eviction("lru", {"bogus": 1})
