"""Build a TieredStore from the configuration model."""

from __future__ import annotations

from tiercake.config import StoreConfig, TierConfig
from tiercake.policies import create_admission, create_eviction

from .gpu import GpuBlockPool, GpuTier
from .pool import PoolRegion, PoolTier
from .ssd import SsdTier
from .store import Tier, TieredStore


def build_backend(cfg: TierConfig, store_cfg: StoreConfig):
    layout = store_cfg.layout
    if cfg.kind == "gpu":
        blocks = int(cfg.capacity) // layout.nbytes
        if blocks < 1:
            raise ValueError(f"gpu tier capacity {int(cfg.capacity)} is below one block ({layout.nbytes} bytes)")
        pool = GpuBlockPool(blocks, layout.shape, layout.torch_dtype(), cfg.device)
        return GpuTier(pool, name=cfg.tier_name)
    if cfg.kind == "pool":
        path = cfg.path or f"/dev/shm/tiercake-{cfg.tier_name}"
        region = PoolRegion.create(path, int(cfg.capacity), page_size=cfg.page_size, prefault=cfg.prefault)
        return PoolTier(region, name=cfg.tier_name)
    return SsdTier(
        cfg.path,
        capacity_bytes=int(cfg.capacity),
        compression=cfg.compression,
        shuffle=cfg.shuffle,
        zstd_level=cfg.zstd_level,
        direct_io=cfg.direct_io,
        fsync=cfg.fsync,
        io_threads=cfg.io_threads,
        name=cfg.tier_name,
    )


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
                )
            )
    except BaseException:
        for tier in tiers:
            tier.backend.close()
        raise
    return TieredStore(
        tiers,
        payload_nbytes=cfg.layout.nbytes if cfg.layout else None,
        payload_dtype=cfg.layout.torch_dtype() if cfg.layout else None,
        promote_on_hit=cfg.promote_on_hit,
        lease_ttl=cfg.lease_ttl_s,
    )
