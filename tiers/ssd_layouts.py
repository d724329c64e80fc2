"""The ssd tier as configured: its layout chosen in one place below both (``layout: file``, a file
per block, ``ssd.py``; ``layout: log``, segments appended to, ``ssd_log.py``), so neither layout's
module imports the other's."""

from __future__ import annotations

from .ssd import SsdTier
from .ssd_log import SsdLogTier


class SsdBackend(SsdTier):
    """The registry's ``ssd`` kind: config checks from ``SsdTier``; ``from_config`` builds the layout
    the config names (never an instance of this class)."""

    @classmethod
    def from_config(cls, cfg, layout) -> SsdTier:
        settings = SsdTier.settings_of(cfg)
        if cfg.layout == "log":
            return SsdLogTier(cfg.path, segment_bytes=int(cfg.segment_bytes) if cfg.segment_bytes else None, **settings)
        return SsdTier(cfg.path, **settings)
