"""Eviction and admission policies, and the registry that finds them by name.

A plug-in author needs only this package: subclass ``EvictionPolicy`` or ``AdmissionPolicy``.
"""

from .admission import AdmitOnNth, AlwaysAdmit
from .base import AdmissionPolicy, BlockMeta, EvictionPolicy
from .eviction import ARC, FIFO, LFU, LRU, S3FIFO, LeafFirstLRU
from .placement import (
    FixedReplicas,
    HotReplicas,
    LeastUsed,
    LocalFirst,
    NodeLoad,
    PlacementStrategy,
    RandomPlacement,
    ReplicationPolicy,
)
from .registry import (
    PolicyNotFoundError,
    available,
    create_admission,
    create_eviction,
    create_placement,
    create_replication,
    resolve,
)

__all__ = [
    "ARC", "FIFO", "LFU", "LRU", "S3FIFO", "AdmissionPolicy", "AdmitOnNth", "AlwaysAdmit", "BlockMeta",
    "EvictionPolicy", "LeafFirstLRU", "PolicyNotFoundError", "available", "create_admission",
    "create_eviction", "resolve", "FixedReplicas", "HotReplicas", "LeastUsed", "LocalFirst", "NodeLoad",
    "PlacementStrategy", "RandomPlacement", "ReplicationPolicy", "create_placement", "create_replication",
]
