"""The key-value store API's outcomes: Mooncake Store's error codes (the synchronous client returns
them as Mooncake's does) and one typed exception per code (what the asyncio client raises)."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """The codes of Mooncake Store's ``ErrorCode`` that this API can answer, with Mooncake's values."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10  # a value larger than the local buffer the Mooncake-style setup gave
    NO_AVAILABLE_HANDLE = -200  # no room for the object (nothing may be evicted), or fewer nodes than replicas
    INVALID_PARAMS = -600  # an empty or oversized key, an empty value, a buffer too small or unregistered
    ILLEGAL_CLIENT = -601  # a tenant's key asking for another tenant's objects
    REPLICA_IS_NOT_READY = -703  # its only holder is away (a persisted object): unavailable, not lost
    OBJECT_NOT_FOUND = -704
    OBJECT_HAS_LEASE = -706  # a remove while a reader's lease holds the object
    TRANSFER_FAIL = -800  # a node died or stalled mid-transfer: a write's outcome is unknown
    RPC_FAIL = -900  # no conductor answered
    NOT_SUPPORTED = (
        -1012
    )  # a call of Mooncake's that has no meaning on tiercake (segments, CUDA memory on a host without one)


class StoreApiError(Exception):
    """Base of the key-value store API's errors; ``code`` is the Mooncake code it stands for."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR


class InvalidParams(StoreApiError, ValueError):
    code = ErrorCode.INVALID_PARAMS


class ObjectNotFound(StoreApiError, KeyError):
    code = ErrorCode.OBJECT_NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "object not found"


class IllegalClient(StoreApiError):
    code = ErrorCode.ILLEGAL_CLIENT


class NotReady(StoreApiError):
    """The object's only holder is away: it is not lost, and reads again once that node is back."""

    code = ErrorCode.REPLICA_IS_NOT_READY


class ObjectHasLease(StoreApiError):
    code = ErrorCode.OBJECT_HAS_LEASE


class NoSpace(StoreApiError):
    code = ErrorCode.NO_AVAILABLE_HANDLE


class NotSupported(StoreApiError):
    code = ErrorCode.NOT_SUPPORTED


class TransferFailed(StoreApiError, ConnectionError):
    code = ErrorCode.TRANSFER_FAIL


class RpcFailed(StoreApiError, ConnectionError):
    code = ErrorCode.RPC_FAIL


def code_of(exc: BaseException) -> int:
    """The Mooncake code for an outcome of the asyncio client."""
    return int(exc.code) if isinstance(exc, StoreApiError) else int(ErrorCode.INTERNAL_ERROR)
