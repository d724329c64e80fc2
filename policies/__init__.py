"""Eviction, admission, placement, replication and routing policies, and the registry that finds
them by name.

A plug-in author needs only this package: subclass one of the policy interfaces.
"""

from .admission import AdmitOnNth, AlwaysAdmit
from .base import AdmissionPolicy, BlockMeta, EvictionPolicy, SessionEvent, SessionState
from .eviction import ARC, FIFO, LFU, LRU, S3FIFO, LeafFirstLRU, ReuseAware
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
    create_router,
    resolve,
)
from .routing import (
    CacheAwareRouter,
    LeastLoadedRouter,
    LinkModel,
    PrefillModel,
    RandomRouter,
    RoundRobinRouter,
    RouteDecision,
    Router,
    RouteRequest,
    SessionRouter,
    TtftRouter,
    WorkerState,
    fit_link,
    fit_prefill,
)
from .sessions import SessionAware

__all__ = [
    "ARC",
    "FIFO",
    "LFU",
    "LRU",
    "S3FIFO",
    "AdmissionPolicy",
    "AdmitOnNth",
    "AlwaysAdmit",
    "BlockMeta",
    "EvictionPolicy",
    "LeafFirstLRU",
    "ReuseAware",
    "SessionAware",
    "SessionEvent",
    "SessionState",
    "PolicyNotFoundError",
    "available",
    "create_admission",
    "create_eviction",
    "resolve",
    "FixedReplicas",
    "HotReplicas",
    "LeastUsed",
    "LocalFirst",
    "NodeLoad",
    "PlacementStrategy",
    "RandomPlacement",
    "ReplicationPolicy",
    "create_placement",
    "create_replication",
    "CacheAwareRouter",
    "LeastLoadedRouter",
    "LinkModel",
    "PrefillModel",
    "RandomRouter",
    "RoundRobinRouter",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "SessionRouter",
    "TtftRouter",
    "WorkerState",
    "create_router",
    "fit_link",
    "fit_prefill",
]
