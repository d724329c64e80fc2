"""The one policy registry: built-ins by name, plug-ins from entry points, and ``module:Class``.

Third-party packages expose policies in the entry-point group ``tiercake.policies``::

    [project.entry-points."tiercake.policies"]
    my_lru = "my_package.policies:MyLRU"

and any importable class works by path: ``"my_package.policies:MyLRU"``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from tiercake.plugins import PluginNotFoundError, PluginRegistry, load_path

from . import admission, eviction, placement, routing, sessions
from .base import AdmissionPolicy, EvictionPolicy
from .placement import PlacementStrategy, ReplicationPolicy
from .routing import Router

ENTRY_POINT_GROUP = "tiercake.policies"

_KINDS = {
    EvictionPolicy: "eviction",
    AdmissionPolicy: "admission",
    PlacementStrategy: "placement",
    ReplicationPolicy: "replication",
    Router: "routing",
}

# A name is unique within a kind ("random" is a placement strategy and a router).
_BUILTINS: dict[tuple[str, str], type] = {
    (cls.name, next(kind for base, kind in _KINDS.items() if issubclass(cls, base))): cls
    for cls in (
        eviction.LRU,
        eviction.FIFO,
        eviction.LFU,
        eviction.S3FIFO,
        eviction.ARC,
        eviction.LeafFirstLRU,
        eviction.ReuseAware,
        sessions.SessionAware,
        admission.AlwaysAdmit,
        admission.AdmitOnNth,
        placement.LeastUsed,
        placement.LocalFirst,
        placement.RandomPlacement,
        placement.FixedReplicas,
        placement.HotReplicas,
        routing.TtftRouter,
        routing.SessionRouter,
        routing.CacheAwareRouter,
        routing.LeastLoadedRouter,
        routing.RoundRobinRouter,
        routing.RandomRouter,
    )
}


class PolicyNotFoundError(PluginNotFoundError):
    """No built-in, entry point or importable class has that name."""


# one registry per kind, over one entry-point group; a name is unique within a kind ("random" is a
# placement strategy and a router)
REGISTRIES = {
    kind: PluginRegistry(
        f"{kind} policy",
        ENTRY_POINT_GROUP,
        {name: cls for (name, k), cls in _BUILTINS.items() if k == kind},
        by_path=True,
        error=PolicyNotFoundError,
    )
    for kind in _KINDS.values()
}


def resolve(spec: str, kind: str | None = None) -> type:
    """The policy class named by ``spec``: a built-in name (of ``kind``, when two kinds share it), an
    entry point, or ``module:Class``. A built-in of another kind resolves too (``resolve_kind`` then
    says it is the wrong kind)."""
    owners = [k for k, registry in REGISTRIES.items() if registry.builtin(spec)]
    if kind in owners or (kind is not None and not owners):
        return REGISTRIES[kind].resolve(spec)
    if len(owners) > 1:
        raise PolicyNotFoundError(f"policy {spec!r} is ambiguous: say which kind")
    if owners:
        return REGISTRIES[owners[0]].resolve(spec)
    if ":" in spec:
        return load_path(spec, "policy", PolicyNotFoundError)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return ep.load()
    known = ", ".join(sorted({n for n, _ in _BUILTINS}))  # "random" is two kinds
    raise PolicyNotFoundError(
        f"unknown policy {spec!r}: not a built-in ({known}), a plug-in from the entry-point group "
        f"{ENTRY_POINT_GROUP!r} or a 'module:Class' path"
    )


def resolve_kind(spec: str, kind: str) -> type:
    """``resolve``, and the class must be a policy of ``kind`` (``TypeError`` otherwise)."""
    base = next(b for b, k in _KINDS.items() if k == kind)
    cls = resolve(spec, kind)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"policy {spec!r} resolves to {cls!r}, which is not a {base.__name__} ({kind} policy)")
    return cls


def _create(spec: str, kind: str, params: dict[str, Any] | None) -> Any:
    """A policy of ``kind`` made from ``spec`` (each ``create_*`` below names what it returns)."""
    cls = resolve_kind(spec, kind)
    try:
        if hasattr(cls, "from_params"):  # a policy made of other policies: named in its params
            return cls.from_params(params or {}, create_eviction)
        return cls(**(params or {}))
    except TypeError as exc:
        raise TypeError(f"policy {spec!r} rejected its parameters {params!r}: {exc}") from exc


def create_eviction(spec: str, params: dict[str, Any] | None = None) -> EvictionPolicy:
    return _create(spec, "eviction", params)


def create_admission(spec: str, params: dict[str, Any] | None = None) -> AdmissionPolicy:
    return _create(spec, "admission", params)


def create_placement(spec: str, params: dict[str, Any] | None = None) -> PlacementStrategy:
    return _create(spec, "placement", params)


def create_replication(spec: str, params: dict[str, Any] | None = None) -> ReplicationPolicy:
    return _create(spec, "replication", params)


def create_router(spec: str, params: dict[str, Any] | None = None) -> Router:
    return _create(spec, "routing", params)


def available() -> dict[str, str]:
    """Every policy name that resolves without a path, with its kind (kinds, when several share it)."""
    found: dict[str, str] = {}
    for name, kind in sorted(_BUILTINS):
        found[name] = f"{found[name]}, {kind}" if name in found else kind
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, "plug-in")
    return found
