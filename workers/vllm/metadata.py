"""What the two sides of ``TiercakeConnector`` share: its settings (``kv_connector_extra_config``),
what the scheduler side hands the worker side each step (``TiercakeMetadata``: loads and saves) and
what comes back (``TiercakeWorkerMetadata``: the loads' reports), and how vLLM's KV layout names a
block namespace and sizes a block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # the connector's worker side runs without vLLM too: `tiercake bench vllm-kv` on a GPU machine

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's base class, where vLLM is not installed."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's base class, where vLLM is not installed."""


from .loading import LoadReport

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``: where tiercake is and how this instance uses it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    conductor: str | list[str] = Field(description="control API URL(s) of the conductor")
    node: str | None = Field(
        default=None, description="node agent that new blocks are saved to (None: this instance only loads)"
    )
    model_id: str | None = Field(
        default=None, description="the model's name in block keys (default: vLLM's served model name)"
    )
    tenant: str = Field(default="default", description="the index namespace of this instance's blocks")
    secret_env: str = "TIERCAKE_SECRET"
    seal_secret_env: str = "TIERCAKE_SEAL_SECRET"  # blocks are sealed with it and checked by it (else: derived
    # from the cluster secret); see TransferConfig
    token_env: str = "TIERCAKE_TOKEN"  # the conductor's bearer token, as every tiercake client reads it
    transports: list[str] = ["shm", "tcp"]
    ca_file: str | None = None  # the cluster's TLS CA: https conductors, and node agents with transfer_tls
    transfer_tls: bool = False  # the node agents' transfer ports speak TLS (their transfer.tls)
    lookup_timeout_s: float = Field(default=1.0, gt=0)
    local_prefix_stands: int = Field(
        default=1,
        ge=1,
        description="a prefix of at least this many blocks in this node's pool is loaded from there without "
        "asking the conductor whether another node holds more (a cache-aware front routes a request to where its "
        "prefix is); a larger value asks more often",
    )
    index_refresh_s: float = Field(
        default=0.05, gt=0, description="how often the scheduler side rereads its node's pool index (same host)"
    )
    load_timeout_s: float = Field(default=10.0, gt=0)
    save_timeout_s: float = Field(default=30.0, gt=0)
    max_save_bytes_in_flight: int = Field(default=256 << 20, gt=0)

    @property
    def conductors(self) -> list[str]:
        return [self.conductor] if isinstance(self.conductor, str) else list(self.conductor)


@dataclass(frozen=True, slots=True)
class BlockLoad:
    key: bytes
    block_id: int  # vLLM's block to fill
    entry: int = -1  # its entry in the node's pool index, as the scheduler side last read it (-1: not known)


@dataclass(frozen=True, slots=True)
class RequestLoad:
    request_id: str
    node: str
    blocks: list[BlockLoad]
    salt: str  # its keys' hashing salt: the seals are checked under it
    pool: str = ""  # the pool region (its instance id) the blocks' entries are of ("": none known)


@dataclass(frozen=True, slots=True)
class BlockSave:
    key: bytes
    parent: bytes | None
    block_id: int  # vLLM's block to copy out
    tenant: str  # the index tenant the block is saved under
    salt: str  # the hashing salt of its key: it is sealed under it


@dataclass
class TiercakeMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class TiercakeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker side -> scheduler side, once per step: the loads it ran."""

    loads: dict[str, LoadReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TiercakeWorkerMetadata):
            self.loads.update(other.loads)
        return self


def kv_layout_tag(kv_cache_config: KVCacheConfig) -> str:
    """vLLM's KV layout as a namespace field: two instances share keys only when their paged KV is
    byte-for-byte the same kind (layers, heads, head size, dtype, cache layout)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"TiercakeConnector supports models with one KV cache group, this one has {len(groups)}")
    from vllm.v1.kv_cache_interface import AttentionSpec

    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"TiercakeConnector supports attention KV caches, this model's is a {type(spec).__name__}")
    dtype = str(spec.dtype).removeprefix("torch.")
    return (
        f"vllm:{type(spec).__name__}:L{len(groups[0].layer_names)}:H{spec.num_kv_heads}:D{spec.head_size}:"
        f"{dtype}:{getattr(kv_cache_config, 'kv_cache_layout', '')}"
    )


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one tiercake block: one vLLM block of every layer."""
    groups = kv_cache_config.kv_cache_groups
    return groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names) if groups else 0
