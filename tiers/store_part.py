"""What the three files of ``TieredStore`` (``store.py``, ``removal.py``, ``eviction.py``) know of
each other: the store's state, and the methods one file calls in another. Declarations only: the
state is made in ``TieredStore.__init__`` and every method is defined once, in the file that owns it;
this is the contract the type checker holds each file to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .entries import Copy, Entry, Tier
    from .eviction import Throttled


class StorePart:
    tiers: list[Tier]
    inline_copy_max: int
    _entries: dict[bytes, Entry]
    _holds: list[tuple[float, bytes]]  # (until, key) of held blocks, out of their tiers' policies
    _spill_failures: Throttled

    if TYPE_CHECKING:
        # store.py
        def tier(self, name: str) -> Tier: ...

        def _committed_entry(self, key: bytes) -> Entry: ...

        async def _place(self, entry: Entry, start: int, *, offer: bool, src: Any = None) -> Copy | None: ...

        async def _allocate(self, tier: Tier, nbytes: int, lossless: bool = False) -> Any: ...

        def _notify(self, entry: Entry, tier: Tier, added: bool) -> None: ...

        def _commit_copy(self, entry: Entry, copy: Copy) -> None: ...

        async def release_lease(self, key: bytes, lease: int) -> None: ...

        def _lease(self, copy: Copy, until: float) -> int: ...

        # eviction.py
        async def _demote(self, tier: Tier, key: bytes) -> None: ...

        # removal.py
        def _end_holds(self) -> None: ...
