"""What the configuration knows of each built-in tier kind, without its implementation.

Loading a config checks every tier against its kind: the speed rank (tiers are listed fastest first)
and the kind's own rules. A process that only reads a config (the command line, ``tiercake up``, the
conductor) must not pay for a backend's imports (the gpu tier's is torch: about 3 s with its exit)
for that. So each rule lives here, once, and each backend class inherits its kind's: ``GpuBackend(GpuKind, ...)``.
A plug-in backend is its own kind (the registry gives its class for both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tiercake.config import TierConfig


class TierKind:
    kind: ClassVar[str]  # the registry name
    # speed order among kinds (0 fastest): a store lists its tiers fastest first, and spills down
    rank: ClassVar[int]
    in_memory: ClassVar[bool]

    @classmethod
    def validate_config(cls, cfg: TierConfig) -> None:
        """Refuse (``ValueError``) a ``TierConfig`` this kind cannot build from (at config load time)."""


class GpuKind(TierKind):
    kind = "gpu"
    rank = 0
    in_memory = True

    @classmethod
    def validate_config(cls, cfg: TierConfig) -> None:
        if cfg.path:
            raise ValueError("a gpu tier has no 'path'")


class PoolKind(TierKind):
    kind = "pool"
    rank = 1
    in_memory = True


class SsdKind(TierKind):
    kind = "ssd"
    rank = 2
    in_memory = False

    @classmethod
    def validate_config(cls, cfg: TierConfig) -> None:
        if not cfg.path:
            raise ValueError("an ssd tier needs a 'path' (a directory)")
