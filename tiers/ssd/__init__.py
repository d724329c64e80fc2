"""The ssd tier. Both layouts write the same record (``record.py``): ``layout: files`` a file per block
(``files.py``, ``SsdFilesBackend``), ``layout: log`` records appended to segments (``log.py``, ``SsdLogBackend``).
The layout is chosen here, above both, so neither layout's module imports the other's."""

from __future__ import annotations

from .files import SsdFilesBackend, SsdTier
from .layout import SsdLayout, SsdLockedError
from .log import SsdLogBackend, SsdLogTier
from .record import HEADER_SIZE, shuffle16, unshuffle16


class SsdBackend(SsdFilesBackend):
    """The registry's ``ssd`` kind: config checks from ``SsdKind``; ``from_config`` builds the layout the
    config names (never an instance of this class)."""

    @classmethod
    def from_config(cls, cfg, layout) -> SsdLayout:  # type: ignore[override]  # a layout, not this class
        settings = SsdLayout.settings_of(cfg)
        if cfg.layout == "log":
            return SsdLogBackend(
                cfg.path, segment_bytes=int(cfg.segment_bytes) if cfg.segment_bytes else None, **settings
            )
        return SsdFilesBackend(cfg.path, **settings)


__all__ = [
    "HEADER_SIZE",
    "SsdBackend",
    "SsdLockedError",
    "SsdLogBackend",
    "SsdFilesBackend",
    "shuffle16",
    "unshuffle16",
    "SsdTier",
    "SsdLogTier",
]
