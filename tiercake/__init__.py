"""tiercake: hybrid-tier KV-cache orchestration for LLM serving.

The public face: block identity and configuration load without torch; the store and policies load
on first use.
"""

from __future__ import annotations

from typing import Any

from .blocks import BlockKey, BlockLayout, Namespace, block_keys, chain_key
from .config import StoreConfig, TiercakeConfig, TierConfig, default_config, load_config

__version__ = "0.1.0"

_LAZY = {
    "TieredStore": "tiercake.tiers",
    "Tier": "tiercake.tiers",
    "build_store": "tiercake.tiers.build",
    "EvictionPolicy": "tiercake.policies",
    "AdmissionPolicy": "tiercake.policies",
    "BlockMeta": "tiercake.policies",
    "Client": "tiercake.conductor.client",
    "TransferEngine": "tiercake.transfer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tiercake' has no attribute {name!r}")


__all__ = [
    "BlockKey",
    "BlockLayout",
    "Namespace",
    "StoreConfig",
    "TierConfig",
    "TiercakeConfig",
    "block_keys",
    "chain_key",
    "default_config",
    "load_config",
    *_LAZY,
]
