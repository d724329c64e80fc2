"""The ssd tier. Both layouts write the same record (``record.py``): ``layout: files`` a file per block
(``files.py``, ``SsdTier``), ``layout: log`` records appended to segments (``log.py``, ``SsdLogTier``).
The layout is chosen here, above both, so neither layout's module imports the other's."""

from __future__ import annotations

from .files import SsdLockedError, SsdTier
from .log import SsdLogTier
from .record import HEADER_SIZE, shuffle16, unshuffle16


class SsdBackend(SsdTier):
    """The registry's ``ssd`` kind: config checks from ``SsdTier``; ``from_config`` builds the layout
    the config names (never an instance of this class)."""

    @classmethod
    def from_config(cls, cfg, layout) -> SsdTier:
        settings = SsdTier.settings_of(cfg)
        if cfg.layout == "log":
            return SsdLogTier(cfg.path, segment_bytes=int(cfg.segment_bytes) if cfg.segment_bytes else None, **settings)
        return SsdTier(cfg.path, **settings)


__all__ = ["HEADER_SIZE", "SsdBackend", "SsdLockedError", "SsdLogTier", "SsdTier", "shuffle16", "unshuffle16"]
