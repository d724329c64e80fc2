"""Moving bytes between tiers, processes and nodes: the engine, its transports, the transfer server."""

from tiercake.plugins import TRANSPORTS

from .engine import BlockLoc, BufferLoc, Transfer, TransferEngine, TransferResult, unreachable
from .protocol import (
    AuthenticationError,
    ItemError,
    PeerClosedError,
    ProtocolError,
    SealError,
    Status,
    TransferError,
)
from .server import TransferServer
from .transports import Transport, TransportContext
from .ucx import UcxTransport

__all__ = [
    "TRANSPORTS", "AuthenticationError", "BlockLoc", "BufferLoc", "ItemError", "PeerClosedError", "ProtocolError",
    "SealError", "Status", "Transfer", "TransferEngine", "TransferError", "TransferResult", "TransferServer", "Transport", "TransportContext", "UcxTransport",
    "unreachable",
]
