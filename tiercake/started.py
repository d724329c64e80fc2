"""A part made by its owner's ``start``: asked for before then, a typed error naming it.

Several owners (the worker, the reference engine, the etcd backend, the transfer server) keep a part
as ``None`` until they start; this is the one rule for reading one, so every such read fails the
same way and the type checker sees the part as present afterwards."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def started(part: T | None, what: str, error: type[Exception] = RuntimeError) -> T:
    """``part`` once made; ``error("<what> is not started")`` before."""
    if part is None:
        raise error(f"{what} is not started")
    return part
