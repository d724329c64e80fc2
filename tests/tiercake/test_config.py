import json

import pytest
from pydantic import ValidationError

from tiercake.config import StoreConfig, TiercakeConfig, TierConfig, default_config, load_config
from tiercake.tiers.build import build_store

YAML = """
node_id: node-a
store:
  layout: {layers: 2, kv_heads: 2, head_dim: 16, block_size: 16}
  tiers:
    - {kind: gpu, capacity: 64KiB, device: cpu, eviction: arc}
    - {kind: pool, capacity: 256KiB, path: %(shm)s, eviction: s3fifo}
    - {kind: ssd, capacity: 1MiB, path: %(ssd)s, admission: nth, admission_params: {n: 2}, compression: true}
"""


def test_load_yaml_json_toml(tmp_path, shm_path):
    text = YAML % {"shm": shm_path, "ssd": tmp_path / "ssd"}
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.store.tiers[0].capacity == 64 * 1024 and cfg.store.tiers[2].admission_params == {"n": 2}
    (tmp_path / "c.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    assert load_config(tmp_path / "c.json") == cfg
    (tmp_path / "c.toml").write_text('node_id = "n"\n[store]\n[[store.tiers]]\nkind = "pool"\ncapacity = "1MiB"\n')
    assert load_config(tmp_path / "c.toml").store.tiers[0].kind == "pool"


async def test_config_builds_a_working_store(tmp_path, shm_path):
    cfg = TiercakeConfig.model_validate(__import__("yaml").safe_load(YAML % {"shm": shm_path, "ssd": tmp_path / "ssd"}))
    store = await build_store(cfg.store).open()
    assert [t.eviction.name for t in store.tiers] == ["arc", "s3fifo", "lru"]
    assert store.tiers[2].admission.n == 2
    assert store.tier("gpu").backend.pool.num_blocks == 64 * 1024 // cfg.store.layout.nbytes
    await store.close()
    cfg.store.tiers[1].tenant_quota = __import__("pydantic").ByteSize(256 << 10)  # each tenant's share of the pool
    store = await build_store(cfg.store).open()
    assert store.tier("pool").tenant_quota_bytes == 256 << 10 and store.tier("gpu").tenant_quota_bytes is None
    await store.close()


@pytest.mark.parametrize(
    "tiers, message",
    [
        ([{"kind": "ssd", "capacity": "1MiB"}], "needs a 'path'"),
        ([{"kind": "gpu", "capacity": "1MiB", "path": "/x"}], "has no 'path'"),
        ([{"kind": "pool", "capacity": "1MiB"}, {"kind": "gpu", "capacity": "1MiB"}], "fastest first"),
        ([{"kind": "pool", "capacity": "1MiB"}, {"kind": "pool", "capacity": "1MiB"}], "unique"),
        ([{"kind": "tape", "capacity": "1MiB"}], "kind"),
        ([{"kind": "pool", "capacity": "lots"}], "capacity"),
        ([{"kind": "pool", "capacity": "1MiB", "high_watermark": 1.5}], "high_watermark"),
        ([{"kind": "pool", "capacity": "1MiB", "colour": "red"}], "colour"),
        ([], "at least 1"),
    ],
)
def test_bad_configs_are_clear(tiers, message):
    with pytest.raises(ValidationError, match=message):
        StoreConfig(tiers=tiers)


async def test_bad_policy_name_fails_at_build(tmp_path):
    from tiercake.policies import PolicyNotFoundError

    cfg = StoreConfig(tiers=[TierConfig(kind="gpu", capacity="64KiB", device="cpu", eviction="belady-oracle")])
    with pytest.raises(PolicyNotFoundError, match="belady-oracle"):
        build_store(cfg)


def test_not_a_mapping(tmp_path):
    (tmp_path / "c.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(tmp_path / "c.yaml")


def test_default_config_namespace(tmp_path):
    cfg = default_config(tmp_path)
    ns = cfg.namespace("tenant-a")
    assert ns.block_size == cfg.store.layout.block_size and ns.kv_layout == cfg.store.layout.tag
    assert ns.root() != cfg.namespace("tenant-b").root()


def test_advertised_addresses_and_the_node_id_from_the_environment(tmp_path, monkeypatch):
    from tiercake.config import load_config, reachable_host

    monkeypatch.delenv("TIERCAKE_ADVERTISE_HOST", raising=False)
    assert reachable_host("10.1.2.3") == "10.1.2.3"
    assert reachable_host("0.0.0.0") not in ("0.0.0.0", "")  # a wildcard is no address to connect to
    assert reachable_host("0.0.0.0", "node-a.internal") == "node-a.internal"
    monkeypatch.setenv("TIERCAKE_ADVERTISE_HOST", "10.9.8.7")  # a pod's IP, from the downward API
    assert reachable_host("0.0.0.0") == "10.9.8.7"
    path = tmp_path / "c.yaml"
    path.write_text("node_id: from-file\nstore: {tiers: [{kind: pool, capacity: 1MiB}]}\n")
    assert load_config(path).node_id == "from-file"
    monkeypatch.setenv("TIERCAKE_NODE_ID", "k8s-node-3")  # the node's name, shared by a ConfigMap's users
    assert load_config(path).node_id == "k8s-node-3"


def test_api_keys_file_adds_keys_and_a_bad_one_is_a_clear_error(tmp_path):
    from tiercake.config import ServingConfig

    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-b: bob\nsk-c: carol\n")
    serving = ServingConfig(api_keys={"sk-a": "alice"}, api_keys_file=str(keys))
    assert serving.all_api_keys() == {"sk-a": "alice", "sk-b": "bob", "sk-c": "carol"}
    keys.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping of API key"):
        serving.all_api_keys()
    with pytest.raises(ValueError, match="missing.yaml"):
        ServingConfig(api_keys_file=str(tmp_path / "missing.yaml")).all_api_keys()


def test_default_clusters_in_two_data_dirs_get_two_pools(tmp_path):
    """The pool path of the embedded default follows the data directory, so a second `tiercake up`
    (or `make run DATA_DIR=...`) on the same host does not find the first one's pool in use."""
    from tiercake.config import default_config

    def pool(config):
        return next(t.path for t in config.store.tiers if t.kind == "pool")

    assert pool(default_config(tmp_path / "a")) != pool(default_config(tmp_path / "b"))
    assert pool(default_config(tmp_path / "a")) == pool(default_config(str(tmp_path / "a")))  # stable


def test_every_setting_from_the_environment(tmp_path, monkeypatch):
    """On Kubernetes every field can come from the pod's environment: TIERCAKE__SECTION__FIELD, the
    value as YAML, validated like the file; a variable that names no setting is refused by name."""
    from pydantic import ValidationError

    path = tmp_path / "c.yaml"
    path.write_text("store: {tiers: [{kind: pool, capacity: 1MiB, path: /dev/shm/x}]}\n")
    monkeypatch.setenv("TIERCAKE__SERVING__PORT", "9000")
    monkeypatch.setenv("TIERCAKE__CONDUCTOR__ETCD", "[etcd-0:2379, etcd-1:2379]")
    monkeypatch.setenv("TIERCAKE__SERVING__QUOTA__TOKENS_PER_MINUTE", "5000")
    monkeypatch.setenv("TIERCAKE__TRANSFER__CHECKSUM", "true")
    monkeypatch.setenv("TIERCAKE__MODEL_ID", "my-model")
    config = load_config(path)
    assert config.serving.port == 9000 and config.conductor.etcd == ["etcd-0:2379", "etcd-1:2379"]
    assert config.serving.quota.tokens_per_minute == 5000 and config.transfer.checksum is True
    assert config.model_id == "my-model"
    monkeypatch.setenv("TIERCAKE__SERVING__PORTT", "1")
    with pytest.raises(ValueError, match="TIERCAKE__SERVING__PORTT: no setting serving.portt"):
        load_config(path)
    monkeypatch.delenv("TIERCAKE__SERVING__PORTT")
    monkeypatch.setenv("TIERCAKE__SERVING__PORT", "not a port")
    with pytest.raises(ValidationError, match="serving.port"):
        load_config(path)


def test_transfer_tls_needs_the_certificates_and_rules_out_ucx():
    store = {"tiers": [{"kind": "pool", "capacity": "1MiB"}]}
    with pytest.raises(ValidationError, match="transfer.tls needs tls.cert_file"):
        TiercakeConfig.model_validate({"store": store, "transfer": {"tls": True}})
    tls = {"cert_file": "c.pem", "key_file": "k.pem", "ca_file": "c.pem"}
    with pytest.raises(ValidationError, match="take ucx out"):
        TiercakeConfig.model_validate(
            {"store": store, "tls": tls, "transfer": {"tls": True, "transports": ["ucx", "tcp"]}}
        )
    plain = TiercakeConfig.model_validate({"store": store, "tls": tls})
    assert plain.transfer_tls_server() is None and plain.transfer_tls_client() is None


def test_a_transfer_client_checks_no_name_so_it_trusts_only_the_clusters_ca():
    from tiercake.config import TlsConfig

    # the system's CAs sign names, and a transfer client checks none: without the cluster's CA it refuses
    with pytest.raises(ValueError, match="transfer TLS needs tls.ca_file"):
        TlsConfig().transfer_client_context()


def test_the_seal_secret_is_its_own_or_derived_from_the_cluster_secret(monkeypatch, tmp_path):
    from tiercake.config import TransferConfig

    monkeypatch.setenv("TIERCAKE_SECRET", "the-cluster-secret-0123")
    monkeypatch.delenv("TIERCAKE_SEAL_SECRET", raising=False)
    derived = TransferConfig().seal_material()
    monkeypatch.setenv("TIERCAKE_SEAL_SECRET", "the-seal-secret-0123456")
    own = TransferConfig().seal_material()
    assert len(own) == len(derived) == 32 and own != derived
    (tmp_path / "seal").write_text("the-seal-secret-0123456\n")
    monkeypatch.delenv("TIERCAKE_SEAL_SECRET")
    assert TransferConfig(seal_secret_file=str(tmp_path / "seal")).seal_material() == own
    monkeypatch.setenv("TIERCAKE_SEAL_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TransferConfig().seal_material()
