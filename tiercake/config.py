"""The one configuration model. The CLI, the node agent and the Kubernetes ConfigMap all use it."""

from __future__ import annotations

import hashlib
import json
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from .blocks import BlockLayout, Namespace
from .messages.members import MAX_MEMBER_TTL


class ModelConfig(BaseModel):
    """The reference model's dimensions; its weights come from ``seed`` (nothing is downloaded)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    vocab: int = Field(default=256, gt=0, description="byte-level: 256")
    dim: int = Field(default=128, gt=0)
    layers: int = Field(default=4, gt=0)
    heads: int = Field(default=4, gt=0)
    kv_heads: int = Field(default=2, gt=0)
    ffn_dim: int = Field(default=256, gt=0)
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float16"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def layout(self, block_size: int = 16) -> BlockLayout:
        return BlockLayout(
            layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, block_size=block_size, dtype=self.dtype
        )


class TierConfig(BaseModel):
    """One storage tier. Fields that do not apply to a tier's ``kind`` must be left unset."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: str = Field(description="a registered tier backend: gpu, pool, ssd, or a plug-in's name")
    name: str | None = Field(default=None, description="defaults to the kind")
    capacity: ByteSize = Field(description="bytes, or a size such as '512MiB'")
    eviction: str = Field(default="lru", description="policy name, entry point or module:Class")
    eviction_params: dict[str, Any] = Field(default_factory=dict)
    admission: str = "always"
    admission_params: dict[str, Any] = Field(default_factory=dict)
    high_watermark: float = Field(default=0.9, gt=0, le=1)
    evict_fraction: float = Field(default=0.05, gt=0, lt=1)
    tenant_quota: ByteSize | None = Field(
        default=None,
        description="the most one tenant may hold in this tier; "
        "beyond it the tenant's own blocks leave first (by the tier's policy), "
        "so one tenant cannot evict the others' (null: no limit)",
    )
    # gpu
    device: str | None = Field(default=None, description="gpu: torch device; default cuda if present, else cpu")
    # pool
    path: str | None = Field(default=None, description="pool: shm/file/DAX path; ssd: directory")
    page_size: int = Field(default=4096, ge=4096, description="pool: allocation granularity")
    prefault: bool = Field(default=True, description="pool: touch every page at start")
    adopt: bool = Field(
        default=True,
        description="pool: a node agent that finds the region a dead one left adopts the blocks it "
        "holds (false: every start begins empty)",
    )
    keep_on_stop: bool = Field(
        default=False,
        description="pool: a clean stop (SIGTERM, Ctrl-C) leaves the region's file for the next node "
        "agent on this host to adopt, so a rolling restart keeps the memory level (tiercake up and the "
        "Kubernetes manifests set it: they retire the file themselves); false: a clean stop removes it, "
        "and nothing stays in /dev/shm",
    )
    index_entries: int | None = Field(
        default=None,
        ge=1,
        description="pool: how many blocks the region's index can describe (default: one per four pages)",
    )
    # ssd
    compression: bool = False
    shuffle: bool = True
    zstd_level: int = Field(default=1, ge=-7, le=22)
    fsync: bool = False
    direct_io: bool | None = Field(default=None, description="ssd: O_DIRECT; default: probe the file system")
    io_threads: int = Field(default=4, ge=1, le=64)
    layout: Literal["files", "log"] = Field(
        default="log",
        description="ssd: 'log' (blocks appended to segment files; small blocks write several times "
        "faster) or 'files' (a file per block); see docs/ARCHITECTURE.md",
    )
    segment_bytes: ByteSize | None = Field(
        default=None,
        description="ssd, layout log: bytes per segment file (default: a sixteenth of the capacity, 4-64 MiB)",
    )
    # a plug-in backend
    options: dict[str, Any] = Field(default_factory=dict, description="settings of a plug-in tier backend")

    @model_validator(mode="after")
    def _check_kind(self) -> TierConfig:
        self.spec().validate_config(self)
        return self

    def spec(self):
        """What the registry knows of ``kind`` without building it (``tiers.kinds``: rank, config checks;
        ``ValueError`` when unknown). Imports no torch for the built-in kinds."""
        from .plugins import TIER_BACKENDS, PluginNotFoundError

        try:
            return TIER_BACKENDS.spec(self.kind)
        except PluginNotFoundError as exc:
            raise ValueError(str(exc)) from None

    @property
    def tier_name(self) -> str:
        return self.name or self.kind

    @property
    def region_path(self) -> Path:
        """pool: the region's file (or DAX device); by default one in /dev/shm named after the tier."""
        return Path(self.path or f"/dev/shm/tiercake-{self.tier_name}")


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    layout: BlockLayout | None = Field(
        default_factory=lambda: BlockLayout(layers=4, kv_heads=2, head_dim=32),
        description="the KV block every put must match; null: any size (a node pool shared by models)",
    )
    tiers: list[TierConfig] = Field(min_length=1)
    promote_on_hit: bool = True
    lease_ttl_s: float = Field(default=5.0, gt=0)
    session_prefetch_lead_s: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="a paused session's blocks on disk are staged into memory this long before its announced resume",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> StoreConfig:
        names = [t.tier_name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        ranks = [t.spec().rank for t in self.tiers]
        if ranks != sorted(ranks):
            raise ValueError(
                f"tiers must be listed fastest first (gpu, then pool, then ssd): got {[t.kind for t in self.tiers]}"
            )
        if self.layout is None and any(t.kind == "gpu" for t in self.tiers):
            raise ValueError("a gpu tier needs the block layout (store.layout)")
        return self


class TransferConfig(BaseModel):
    """The node's transfer server and engine."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = Field(default="127.0.0.1", description="address the transfer server listens on")
    advertise_host: str | None = Field(
        default=None,
        description="the address peers reach it at (default: the "
        "listen address, or this host's address when listening on all; "
        "$TIERCAKE_ADVERTISE_HOST overrides)",
    )
    port: int = Field(default=0, ge=0, le=65535, description="0: any free port (printed at start)")
    secret_file: str | None = Field(default=None, description="file holding the cluster secret")
    secret_env: str = Field(default="TIERCAKE_SECRET", description="environment variable with the secret")
    seal_secret_file: str | None = Field(default=None, description="file holding the seal secret")
    seal_secret_env: str = Field(
        default="TIERCAKE_SEAL_SECRET",
        description="environment variable with the seal "
        "secret: the key KV writers seal blocks with and KV readers check them by. Give it "
        "to workers only; when unset it is derived from the cluster secret, and then anyone "
        "holding that (node agents, key-value store clients) could forge a block",
    )
    node_secret_file: str | None = Field(default=None, description="file holding the node secret")
    node_secret_env: str = Field(
        default="TIERCAKE_NODE_SECRET",
        description="environment variable with the node secret: what "
        "node agents prove to each other for a slot's replication, its copies and handoffs. Give it to "
        "node agents only (never to clients, workers or vLLM): a node agent in a cluster refuses to "
        "start without it",
    )
    transports: list[str] = Field(
        default_factory=lambda: ["local", "shm", "tcp"],
        description="transports in order of preference: local, shm, tcp, ucx, plug-ins "
        "(a node agent serves UCX only when ucx is listed)",
    )
    streams: int = Field(default=2, ge=1, le=64, description="connections per peer")
    spin_us: int = Field(
        default=300,
        ge=0,
        le=100_000,
        description="the node agent polls for the next request this "
        "long after it was busy, before it sleeps (an idle core wakes slowly; 0: never; "
        "transfer/spin.py)",
    )
    checksum: bool = Field(default=False, description="xxh3 every block in transit and verify it")
    buffer_bytes: int | None = Field(default=None, description="socket buffers; default: kernel autotuning")
    tls: bool = Field(
        default=False,
        description="the transfer port speaks TLS only, with the tls section's "
        "certificate (node agents) and CA (every client); UCX is then not used (its bytes would "
        "bypass TLS)",
    )
    max_block_bytes: ByteSize = Field(default=ByteSize(1 << 30), description="largest block a peer may write")
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="the node agent's own Prometheus "
        "/metrics on this port of host (0: any free port, announced; none: not "
        "served); the conductor token guards it unless conductor.metrics_open",
    )

    @field_validator("transports")
    @classmethod
    def _known_transports(cls, names: list[str]) -> list[str]:
        from .plugins import TRANSPORTS

        unknown = [n for n in names if n not in TRANSPORTS]
        if unknown:
            raise ValueError(f"unknown transports {unknown}; known: {TRANSPORTS.names()}")
        return names

    def secret(self) -> bytes:
        """The cluster secret from the environment or the secret file; at least 16 bytes."""
        import os

        value: bytes | None = os.environ.get(self.secret_env, "").encode() or None
        if value is None and self.secret_file:
            value = Path(self.secret_file).read_bytes().strip()
        if not value:
            raise ValueError(f"no cluster secret: set ${self.secret_env} or transfer.secret_file")
        if len(value) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        return value

    def node_secret(self) -> bytes | None:
        """The node secret from the environment or its file (None: unset); at least 16 bytes, and not
        the cluster secret (which clients hold)."""
        import os

        value: bytes | None = os.environ.get(self.node_secret_env, "").encode() or None
        if value is None and self.node_secret_file:
            value = Path(self.node_secret_file).read_bytes().strip()
        if value is None:
            return None
        if len(value) < 16:
            raise ValueError("the node secret must be at least 16 bytes")
        if value == self.secret():
            raise ValueError("the node secret must not be the cluster secret: clients hold that one")
        return value

    def seal_material(self) -> bytes:
        """What every tenant's seal key is derived from (``tiercake.blocks.sealer_for``): the seal
        secret, else the cluster secret."""
        import os

        from .blocks import cluster_seal_material, seal_material

        value = os.environ.get(self.seal_secret_env, "").encode()
        if not value and self.seal_secret_file:
            value = Path(self.seal_secret_file).read_bytes().strip()
        if value:
            return seal_material(value)
        return cluster_seal_material(self.secret())


class ConductorConfig(BaseModel):
    """The control plane: how a conductor runs, and how nodes and workers reach it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    urls: list[str] = Field(
        default_factory=list, description="conductor URLs nodes and workers talk to; empty: a standalone node"
    )
    host: str = Field(default="127.0.0.1", description="address a conductor's API listens on")
    advertise_url: str | None = Field(
        default=None,
        description="the URL clients and other conductors use (default: "
        "from the bound address; $TIERCAKE_ADVERTISE_HOST sets its host)",
    )
    port: int = Field(default=8081, ge=0, le=65535, description="0: any free port (printed at start)")
    etcd: list[str] = Field(default_factory=list, description="etcd endpoints host:port; empty: embedded backend")
    token_env: str = Field(
        default="TIERCAKE_TOKEN", description="environment variable with the bearer token (clients) or tokens (server)"
    )
    token_file: str | None = Field(default=None, description="file with bearer tokens, whitespace-separated")
    leader_ttl: int = Field(default=3, ge=1, description="seconds a dead leader keeps the lead")
    member_ttl: int = Field(
        default=5, ge=1, le=MAX_MEMBER_TTL, description="seconds a silent node or worker stays a member"
    )
    placement: str = Field(default="least_used", description="placement strategy: least_used, local_first, random")
    replication: str = Field(default="fixed", description="replication policy: fixed, hot")
    replication_params: dict[str, Any] = Field(default_factory=dict)

    put_timeout_s: float = Field(default=60.0, gt=0, description="a begun put not committed by then is forgotten")
    index_max_blocks: int = Field(
        default=1 << 30,
        ge=1024,
        le=(1 << 31) - 1,
        description="blocks the placement index reserves address space for (48 bytes each, memory only "
        "as they are used); past it a report is refused with a 507",
    )
    metrics_open: bool = Field(
        default=True,
        description="serve /metrics without the token, so Prometheus scrapes "
        "it by annotation (it holds counts by member, tier and phase: no tenant, prompt or "
        "key); false: the token, as every other control endpoint",
    )
    insecure: bool = Field(
        default=False,
        description="serve the control API and the workers' API without a token "
        "(anyone who reaches them can register workers, read every tenant's keys and answer "
        "requests): for a throwaway cluster on a laptop only; refused by default",
    )

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "volatile_tiers" in data:
            raise ValueError(
                "volatile_tiers was removed: every tier's placements now live in the conductors' memory, "
                "none in etcd (docs/SCALE.md); delete the setting"
            )
        return data

    def tokens(self) -> list[str]:
        """Bearer tokens from the environment variable and the token file, as found (maybe none)."""
        import os

        found = os.environ.get(self.token_env, "").split()
        if self.token_file:
            found += Path(self.token_file).read_text().split()
        return found

    def required_tokens(self) -> list[str]:
        """The tokens a server of the cluster (a conductor, a worker) checks callers against: at least
        one, unless ``insecure`` (then none). ``InsecureConfigError`` says how to give one."""
        found = self.tokens()
        if not found and not self.insecure:
            raise InsecureConfigError(
                f"no control token: set ${self.token_env} or conductor.token_file (the control API and the "
                "workers never run open), or say conductor.insecure: true / --insecure for a throwaway cluster"
            )
        return found


class ObjectsConfig(BaseModel):
    """The key-value store's objects: how their owners are chosen and how long things last."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    slots: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="conductor: slots of the object map (fixed once "
        "the map exists: each object's slot comes from its name)",
    )
    replicas_max: int = Field(
        default=3,
        ge=1,
        le=16,
        description="conductor: nodes per slot (a primary and its backups); a put may ask for up to this many replicas",
    )
    failover_s: float = Field(
        default=10.0,
        gt=0,
        le=86400,
        description="conductor: how long a slot's primary may "
        "be absent (its lease expired) before a backup takes the slot over, and never less than "
        "that node's member TTL; a node agent that restarts sooner keeps its slots and, with its "
        "pool adopted, all it held",
    )
    bootstrap_s: float = Field(
        default=2.0,
        ge=0,
        le=600,
        description="conductor: how long after the first node "
        "registers the first object map is made (restarted nodes offer the map they had to "
        "a conductor that lost it)",
    )
    lease_ttl_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="node: how long a get or an exists keeps "
        "the object from a remove (unless forced) and from eviction, as Mooncake's "
        "default_kv_lease_ttl",
    )


class InsecureConfigError(ValueError):
    """A server of the cluster would run without authentication and the operator did not ask for it."""


class TenantQuota(BaseModel):
    """What one tenant may use of a front at once (each front counts on its own); unset: no limit.
    Over a limit, a request is refused with 429 and Retry-After, so one tenant cannot starve the others."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    requests_in_flight: int | None = Field(default=None, gt=0, description="requests being served at once")
    tokens_per_minute: int | None = Field(
        default=None,
        gt=0,
        description="prompt tokens plus max_tokens admitted per minute (a token bucket of a minute's worth)",
    )


class ServingConfig(BaseModel):
    """The serving path: the model, the workers' gpu tiers, the OpenAI-compatible front, routing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: ModelConfig = Field(default_factory=ModelConfig)
    block_size: int = Field(default=16, gt=0, le=4096, description="tokens per KV block")
    gpu_blocks: int = Field(default=256, gt=0, description="KV blocks in each worker's gpu tier")
    device: str | None = Field(default=None, description="torch device; default cuda if present, else cpu")
    max_context: int = Field(default=2048, gt=1, description="prompt plus generated tokens, per request")
    max_batch: int = Field(default=32, gt=0, description="sequences a worker decodes at once")
    prefill_chunk_tokens: int = Field(
        default=256,
        ge=0,
        description="tokens per forward pass of a prefill; "
        "decode steps of the running batch go between two chunks, so a long prompt "
        "does not stall them (0: the whole prompt in one pass)",
    )
    prefetch: bool = Field(
        default=True,
        description="a request that must wait for the worker has its prefix "
        "brought from the node's SSD into its pool meanwhile and pulled into the worker's gpu "
        "tier (as far as it has room below its watermark), so its prefill loads little or nothing",
    )
    host: str | None = Field(
        default=None, description="the OpenAI-compatible API's own address; default: conductor.host"
    )
    port: int | None = Field(
        default=8080,
        ge=0,
        le=65535,
        description="the OpenAI-compatible API's own port (/v1/completions, /v1/models), apart "
        "from the control API, so a firewall can open one and close the other (0: any free "
        "port, printed at start); null: beside the control API on conductor.port",
    )
    tokenizer: str | None = Field(
        default=None,
        description="a Hugging Face tokenizer directory (the served "
        "model's, e.g. vLLM's --model directory): the front tokenizes with it; null: "
        "the reference model's UTF-8 bytes",
    )
    router: str = Field(
        default="ttft", description="ttft, session, cache_aware, least_loaded, round_robin, random, plug-in"
    )
    router_params: dict[str, Any] = Field(default_factory=dict)

    slo_ttft_s: float | None = Field(default=None, gt=0, description="reject (429) when predicted TTFT exceeds it")
    slo_tbt_s: float | None = Field(default=None, gt=0, description="reject (429) when predicted TBT exceeds it")
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="API key -> tenant; when set, every request needs a known key"
    )
    api_keys_file: str | None = Field(
        default=None,
        description="more API keys: a YAML or JSON mapping of key -> "
        "tenant (a mounted Secret keeps them out of the config)",
    )
    shared_namespace: bool = Field(default=False, description="all tenants share one cache namespace")
    quota: TenantQuota = Field(
        default_factory=TenantQuota, description="every tenant's limits, unless tenant_quotas names the tenant"
    )
    tenant_quotas: dict[str, TenantQuota] = Field(default_factory=dict, description="tenant -> its own limits")
    disaggregated: bool = Field(default=True, description="separate prefill and decode workers when both exist")
    reuse_window_blocks: int = Field(
        default=100_000,
        ge=0,
        description="the front measures reuse distance and "
        "prefetchability over this many recent distinct blocks (about 0.5 KB each); "
        "0: not measured",
    )
    record_trace: str | None = Field(
        default=None, description="append every served request to this file in the Mooncake trace format (with tenant)"
    )

    def layout(self) -> BlockLayout:
        return self.model.layout(self.block_size)

    def all_api_keys(self) -> dict[str, str]:
        """``api_keys`` and those of ``api_keys_file``; a malformed file is a ``ValueError`` that names it."""
        keys = dict(self.api_keys)
        if self.api_keys_file:
            import yaml

            try:
                loaded = yaml.safe_load(Path(self.api_keys_file).read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ValueError(f"serving.api_keys_file {self.api_keys_file}: {exc}") from None
            if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k and v for k, v in loaded.items()
            ):
                raise ValueError(
                    f"serving.api_keys_file {self.api_keys_file}: expected a mapping of API key -> tenant name"
                )
            keys.update(loaded)
        return keys


class TlsConfig(BaseModel):
    """TLS for every HTTP API of the cluster: the conductor's control and OpenAI-compatible APIs and the
    workers'; and for the transfer port with ``transfer.tls`` (without it, the transfer port is not
    encrypted: it authenticates both ends with the cluster secret and carries KV bytes in the clear)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cert_file: str | None = Field(
        default=None, description="the server certificate chain (PEM); with key_file, every HTTP API serves https only"
    )
    key_file: str | None = Field(default=None, description="its private key (PEM)")
    ca_file: str | None = Field(
        default=None, description="the CA the cluster's own clients trust (default: the system's, or $SSL_CERT_FILE)"
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls.cert_file and tls.key_file go together")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.cert_file else "http"

    def server_context(self):
        """The servers' context (None: plain http)."""
        if not self.cert_file:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def client_context(self):
        """What the cluster's own clients verify servers with (None: aiohttp's default, the system's CAs)."""
        return ca_context(self.ca_file) if self.ca_file else None

    def transfer_client_context(self):
        """What transfer clients check node agents with: any certificate the CA signed, whatever name
        it carries (node agents are reached by address, and the secret's challenge inside the stream
        proves each end is of the cluster). Only with a CA of the cluster's own: the system's CAs
        sign names, and no name is checked here."""
        if not self.ca_file:
            raise ValueError("transfer TLS needs tls.ca_file: without a name to check, only the cluster's CA may sign")
        return ca_context(self.ca_file, check_hostname=False)


def ca_context(ca_file: str, check_hostname: bool = True):
    """A TLS client context that trusts ``ca_file``."""
    import ssl

    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = check_hostname
    return context


class TiercakeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    node_id: str = Field(default_factory=socket.gethostname)
    model_id: str = "tiercake-reference"
    store: StoreConfig
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    conductor: ConductorConfig = Field(default_factory=ConductorConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    objects: ObjectsConfig = Field(default_factory=ObjectsConfig)

    @model_validator(mode="after")
    def _transfer_tls(self) -> TiercakeConfig:
        if self.transfer.tls:
            if not (self.tls.cert_file and self.tls.ca_file):
                raise ValueError(
                    "transfer.tls needs tls.cert_file, tls.key_file (node agents serve with them) and "
                    "tls.ca_file (every client checks them against it)"
                )
            if "ucx" in self.transfer.transports:
                raise ValueError(
                    "transfer.tls: UCX moves bytes outside the TLS stream; take ucx out of transfer.transports"
                )
        return self

    def transfer_tls_server(self):
        """The transfer server's TLS context (None: ``transfer.tls`` is off)."""
        return self.tls.server_context() if self.transfer.tls else None

    def transfer_tls_client(self):
        """What transfer clients check node agents with (None: ``transfer.tls`` is off)."""
        return self.tls.transfer_client_context() if self.transfer.tls else None

    def serving_namespace(self, tenant_salt: str = "") -> Namespace:
        """The namespace of the served model's blocks (what workers and the front hash with)."""
        layout = self.serving.layout()
        return Namespace(
            model_id=self.model_id, kv_layout=layout.tag, block_size=layout.block_size, tenant_salt=tenant_salt
        )

    def namespace(self, tenant_salt: str = "") -> Namespace:
        layout = self.store.layout
        if layout is None:
            raise ValueError("a namespace needs the block layout (store.layout)")
        return Namespace(
            model_id=self.model_id, kv_layout=layout.tag, block_size=layout.block_size, tenant_salt=tenant_salt
        )


def reachable_host(bound: str, advertise: str | None = None) -> str:
    """The address others should use for a server bound to ``bound``: ``advertise`` (or
    $TIERCAKE_ADVERTISE_HOST, such as a pod's IP) when given; for a wildcard bind, this host's address
    (a wildcard is not an address anyone can connect to)."""
    import os

    chosen = advertise or os.environ.get("TIERCAKE_ADVERTISE_HOST")
    if chosen:
        return chosen
    if bound in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return bound


def default_config(data_dir: str | Path = ".tiercake") -> TiercakeConfig:
    """The embedded default: every tier on one machine, small enough for a laptop or CI."""
    data_dir = Path(data_dir)
    # the data directory is the cluster's identity on this host: two clusters in two directories get
    # two pools (one pool path per host made the second a PoolInUseError)
    which = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:10]
    return TiercakeConfig(
        store=StoreConfig(
            tiers=[
                TierConfig(kind="gpu", capacity=ByteSize(4 << 20)),
                TierConfig(
                    kind="pool", capacity=ByteSize(16 << 20), path=f"/dev/shm/tiercake-{socket.gethostname()}-{which}"
                ),
                TierConfig(kind="ssd", capacity=ByteSize(256 << 20), path=str(data_dir / "ssd"), compression=True),
            ]
        )
    )


def load_config(path: str | Path, data_dir: str | Path = ".tiercake") -> TiercakeConfig:
    """Read YAML, JSON or TOML (by extension), over the embedded default (``default_config``): a
    section or field the file does not name keeps its default (mappings merge; a list, such as the
    tiers, is replaced whole). A file that does not parse is a ``ValueError`` naming the file and the
    place."""
    merged = merge(default_config(data_dir).model_dump(mode="json"), config_data(path))
    return with_environment(TiercakeConfig.model_validate(merged))


def config_data(path: str | Path) -> dict:
    """The mapping a config file holds (YAML, JSON or TOML, by extension), not yet merged or checked."""
    path = Path(path)
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        raise ValueError(
            f"{path}: not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {' '.join(str(exc).split())}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping, got {type(data).__name__}")
    return data


def merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``: mappings merge key by key, anything else (a list, a value, null) replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


ENV_PREFIX = "TIERCAKE__"


def with_environment(config: TiercakeConfig) -> TiercakeConfig:
    """The config with what the environment says: $TIERCAKE_NODE_ID (the node's name, for every
    process on it), and any field as ``TIERCAKE__<SECTION>__<FIELD>`` (nested by ``__``, the value as
    YAML: ``TIERCAKE__SERVING__PORT=9000``, ``TIERCAKE__CONDUCTOR__ETCD='[etcd-0:2379, etcd-1:2379]'``),
    validated like the file. A variable naming no field is a ``ValueError`` that says which."""
    import os

    data = config.model_dump(mode="json")
    changed = False
    for name, raw in sorted(os.environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        node: object = data
        model: type[BaseModel] | None = TiercakeConfig
        for part in path[:-1]:
            field = model.model_fields.get(part) if model is not None else None
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"${name}: no setting {'.'.join(path)}")
            node, model = node[part], _model_of(field)
        if not isinstance(node, dict) or (model is not None and path[-1] not in model.model_fields):
            raise ValueError(f"${name}: no setting {'.'.join(path)}")
        node[path[-1]] = yaml.safe_load(raw) if raw.strip() else None
        changed = True
    node_id = os.environ.get("TIERCAKE_NODE_ID")
    if node_id:
        data["node_id"], changed = node_id, True
    return TiercakeConfig.model_validate(data) if changed else config


def _model_of(field) -> type[BaseModel] | None:
    """The pydantic model a field holds (None: a mapping or a plain value)."""
    annotation = getattr(field, "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
