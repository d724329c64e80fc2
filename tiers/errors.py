"""Typed errors of the block store. Every refusal names the key, the tier and the reason."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class ObjectNotFoundError(StoreError, KeyError):
    """No committed copy of the key exists in any tier."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectExistsError(StoreError):
    """The key is already committed: objects are immutable once committed."""


class PutInProgressError(StoreError):
    """A put of the same key is already started and neither committed nor revoked."""


class InvalidStateError(StoreError):
    """The operation does not fit the object's state (double commit, write after revoke, ...)."""


class PayloadError(StoreError, ValueError):
    """The payload has the wrong size, dtype or shape for this store or tier."""


class TierFullError(StoreError):
    """The tier has no room and nothing in it may be evicted (everything leased, pinned or in use)."""


class DiskFullError(TierFullError):
    """The file system under the SSD tier ran out of space."""


class ObjectLeasedError(StoreError):
    """A reader holds a lease on the object, so it cannot be removed now."""


class ObjectPinnedError(StoreError):
    """The object is hard-pinned; unpin it before removing it."""


class CorruptBlockError(StoreError):
    """A stored block failed its checksum or header check; it is dropped and counted as a miss."""


class PoolFormatError(RuntimeError):
    """The mapped path is not a tiercake pool region (wrong magic or size)."""


class PoolInUseError(RuntimeError):
    """Another live process owns the pool region at this path."""
