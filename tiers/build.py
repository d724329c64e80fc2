"""Build a TieredStore from the configuration model."""

from __future__ import annotations

from tiercake.config import StoreConfig, TierConfig
from tiercake.plugins import TIER_BACKENDS
from tiercake.policies import create_admission, create_eviction

from .backend import TierBackend
from .store import Tier, TieredStore


def backend_class(kind: str) -> type[TierBackend]:
    """The registered backend of a tier kind (``tiercake.plugins.TIER_BACKENDS``)."""
    cls = TIER_BACKENDS.resolve(kind)
    if not (isinstance(cls, type) and issubclass(cls, TierBackend)):
        raise TypeError(f"tier backend {kind!r} resolves to {cls!r}, which is not a TierBackend")
    return cls


def build_backend(cfg: TierConfig, store_cfg: StoreConfig) -> TierBackend:
    return backend_class(cfg.kind).from_config(cfg, store_cfg.layout)


def build_store(cfg: StoreConfig) -> TieredStore:
    """An unopened store (``await store.open()`` rebuilds persisted tiers)."""
    tiers = []
    try:
        for tier_cfg in cfg.tiers:
            tiers.append(
                Tier(
                    build_backend(tier_cfg, cfg),
                    eviction=create_eviction(tier_cfg.eviction, tier_cfg.eviction_params),
                    admission=create_admission(tier_cfg.admission, tier_cfg.admission_params),
                    high_watermark=tier_cfg.high_watermark,
                    evict_fraction=tier_cfg.evict_fraction,
                    tenant_quota_bytes=None if tier_cfg.tenant_quota is None else int(tier_cfg.tenant_quota),
                )
            )
    except BaseException:
        for tier in tiers:
            tier.backend.close()
        raise
    return TieredStore(
        tiers,
        payload_nbytes=cfg.layout.nbytes if cfg.layout else None,
        payload_dtype=cfg.layout.dtype if cfg.layout else None,
        promote_on_hit=cfg.promote_on_hit,
        lease_ttl=cfg.lease_ttl_s,
        session_prefetch_lead_s=cfg.session_prefetch_lead_s,
    )
