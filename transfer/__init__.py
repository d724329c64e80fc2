"""Moving bytes between tiers, processes and nodes: the engine, its transports, the transfer server.

The protocol (its errors, its versions) loads without torch, so the conductor, which only speaks
it, starts without torch; the engine and its transports load on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiercake.plugins import TRANSPORTS

from .protocol import (
    AuthenticationError,
    ItemError,
    PeerClosedError,
    ProtocolError,
    SealError,
    Status,
    TransferError,
)

if TYPE_CHECKING:  # the names as the type checker sees them
    from .engine import BlockLoc, BufferLoc, Transfer, TransferEngine, TransferResult, unreachable
    from .server import TransferServer
    from .transports import Transport, TransportContext
    from .ucx import UcxTransport

_LAZY = {
    "BlockLoc": ".engine",
    "BufferLoc": ".engine",
    "Transfer": ".engine",
    "TransferEngine": ".engine",
    "TransferResult": ".engine",
    "unreachable": ".engine",
    "TransferServer": ".server",
    "Transport": ".transports",
    "TransportContext": ".transports",
    "UcxTransport": ".ucx",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TRANSPORTS",
    "AuthenticationError",
    "ItemError",
    "PeerClosedError",
    "ProtocolError",
    "SealError",
    "Status",
    "TransferError",
    "BlockLoc",
    "BufferLoc",
    "Transfer",
    "TransferEngine",
    "TransferResult",
    "unreachable",
    "TransferServer",
    "Transport",
    "TransportContext",
    "UcxTransport",
]
