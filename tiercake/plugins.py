"""Registries of plug-ins by kind: tier backends and transports. (Policies have their own registry in
``tiercake.policies``, with several kinds under one entry-point group.)

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
    """No built-in, registered plug-in or entry point has that name."""


class PluginRegistry:
    def __init__(self, kind: str, group: str, builtins: dict[str, str], specs: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.group = group
        self._paths = dict(builtins)
        self._specs = dict(specs or {})  # built-in name -> ``module:attr`` of what the config checks against
        self._loaded: dict[str, Any] = {}

    def register(self, name: str, plugin: Any) -> None:
        """Add (or replace) ``name``: an object, or a ``module:attr`` path imported on first use."""
        self._loaded.pop(name, None)
        self._specs.pop(name, None)  # a replaced built-in is checked by its replacement
        if isinstance(plugin, str):
            self._paths[name] = plugin
        else:
            self._paths.pop(name, None)
            self._loaded[name] = plugin

    def unregister(self, name: str) -> None:
        """Forget a plug-in registered at run time (built-ins and entry points stay)."""
        self._loaded.pop(name, None)

    def names(self) -> list[str]:
        """Every name that resolves, without importing anything."""
        return sorted({*self._paths, *self._loaded, *(ep.name for ep in entry_points(group=self.group))})

    def __contains__(self, name: str) -> bool:
        return (
            name in self._paths or name in self._loaded or any(ep.name == name for ep in entry_points(group=self.group))
        )

    def spec(self, name: str) -> Any:
        """What a configuration checks ``name`` against: a built-in's light spec, else the plug-in."""
        path = self._specs.get(name)
        if path is None:
            return self.resolve(name)
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)

    def resolve(self, name: str) -> Any:
        if name in self._loaded:
            return self._loaded[name]
        path = self._paths.get(name)
        if path is None:
            found = [ep for ep in entry_points(group=self.group) if ep.name == name]
            if not found:
                raise PluginNotFoundError(
                    f"unknown {self.kind} {name!r}; known: {', '.join(self.names())} (plug-ins "
                    f"register in the entry-point group {self.group!r})"
                )
            plugin = found[0].load()
        else:
            module, _, attr = path.partition(":")
            plugin = getattr(importlib.import_module(module), attr)
        self._loaded[name] = plugin
        return plugin


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
