"""Registries of plug-ins, one mechanism for every kind (``PluginRegistry``): tier backends and
transports here, and the five kinds of policy in ``tiercake.policies`` (one registry each, all five
published in one entry-point group, and named by ``module:Class`` path too).

A registry knows its built-ins by ``module:attr`` path, imported on first use, the plug-ins registered
at run time with ``register``, and third-party ones published in the registry's entry-point group. A
built-in may also name a light ``spec`` of itself (``tiers/kinds.py``: a tier kind's rank and config
checks, which the backend class inherits), so that the configuration, which checks every entry against
it, imports no implementation (no torch); anything else is its own spec::

    [project.entry-points."tiercake.tiers"]
    nvme_raw = "my_package.tiers:RawNvmeTier"

    [project.entry-points."tiercake.transports"]
    nixl = "my_package.nixl:NixlTransport"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any


class PluginNotFoundError(LookupError):
    """No built-in, registered plug-in or entry point has that name (nor, where paths are taken,
    does the ``module:attr`` path import)."""


def load_path(path: str, what: str, error: type[PluginNotFoundError] = PluginNotFoundError) -> Any:
    """The object at ``module:attr``; ``error`` says which part is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise error(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from exc


class PluginRegistry:
    """One kind of plug-in. ``builtins``: name -> the object, or its ``module:attr`` path (imported on
    first use); ``specs``: name -> the path of a built-in's light spec (``spec``); ``by_path``: a name
    that is a ``module:attr`` path resolves to what it names; ``error``: what an unknown name raises."""

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: dict[str, Any],
        specs: dict[str, str] | None = None,
        *,
        by_path: bool = False,
        error: type[PluginNotFoundError] = PluginNotFoundError,
    ) -> None:
        self.kind = kind
        self.group = group
        self._paths = {n: p for n, p in builtins.items() if isinstance(p, str)}
        self._loaded: dict[str, Any] = {n: p for n, p in builtins.items() if not isinstance(p, str)}
        self._specs = dict(specs or {})  # built-in name -> ``module:attr`` of what the config checks against
        self._entry_points: dict[str, Any] = {}  # entry points loaded so far (not built in)
        self.by_path = by_path
        self.error = error

    def register(self, name: str, plugin: Any) -> None:
        """Add (or replace) ``name``: an object, or a ``module:attr`` path imported on first use."""
        self._loaded.pop(name, None)
        self._entry_points.pop(name, None)
        self._specs.pop(name, None)  # a replaced built-in is checked by its replacement
        if isinstance(plugin, str):
            self._paths[name] = plugin
        else:
            self._paths.pop(name, None)
            self._loaded[name] = plugin

    def unregister(self, name: str) -> None:
        """Forget a plug-in registered at run time (built-ins and entry points stay)."""
        self._loaded.pop(name, None)

    def builtin(self, name: str) -> bool:
        """Whether ``name`` is built in or registered at run time (not an entry point, not a path)."""
        return name in self._paths or name in self._loaded

    def builtin_names(self) -> list[str]:
        return sorted({*self._paths, *self._loaded})

    def plugin_names(self) -> list[str]:
        """The names published in the entry-point group (without importing them)."""
        return sorted({ep.name for ep in entry_points(group=self.group)})

    def names(self) -> list[str]:
        """Every name that resolves, without importing anything."""
        return sorted({*self.builtin_names(), *self.plugin_names()})

    def __contains__(self, name: str) -> bool:
        return self.builtin(name) or any(ep.name == name for ep in entry_points(group=self.group))

    def spec(self, name: str) -> Any:
        """What a configuration checks ``name`` against: a built-in's light spec, else the plug-in."""
        path = self._specs.get(name)
        return self.resolve(name) if path is None else load_path(path, self.kind, self.error)

    def resolve(self, name: str) -> Any:
        """A built-in or registered plug-in, then (where taken) a ``module:attr`` path, then an entry
        point; ``error`` names what is known otherwise."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._paths:
            self._loaded[name] = load_path(self._paths[name], self.kind, self.error)
            return self._loaded[name]
        if self.by_path and ":" in name:
            return load_path(name, self.kind, self.error)
        if name not in self._entry_points:
            found = [ep for ep in entry_points(group=self.group) if ep.name == name]
            if not found:
                raise self.error(self.unknown(name))
            self._entry_points[name] = found[0].load()
        return self._entry_points[name]

    def unknown(self, name: str) -> str:
        plugins = ", ".join(self.plugin_names()) or "none"
        path = " or a 'module:Class' path" if self.by_path else ""
        return (
            f"unknown {self.kind} {name!r}: not a built-in ({', '.join(self.builtin_names())}), a plug-in "
            f"({plugins}, from the entry-point group {self.group!r}){path}"
        )


TIER_BACKENDS = PluginRegistry(
    "tier backend",
    "tiercake.tiers",
    {
        "gpu": "tiercake.tiers.gpu:GpuBackend",
        "pool": "tiercake.tiers.pool:PoolBackend",
        "ssd": "tiercake.tiers.ssd:SsdBackend",
    },
    specs={
        "gpu": "tiercake.tiers.kinds:GpuKind",
        "pool": "tiercake.tiers.kinds:PoolKind",
        "ssd": "tiercake.tiers.kinds:SsdKind",
    },
)

TRANSPORTS = PluginRegistry(
    "transport",
    "tiercake.transports",
    {
        "local": "tiercake.transfer.transports:LocalTransport",
        "shm": "tiercake.transfer.transports:ShmTransport",
        "tcp": "tiercake.transfer.transports:TcpTransport",
        "ucx": "tiercake.transfer.ucx:UcxTransport",
    },
)
