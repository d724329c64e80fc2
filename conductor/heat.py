"""Access rates of blocks, as the conductor sees them through lookups: an exponentially decayed
count per block, so a block's rate follows its recent popularity and a cold block fades away."""

from __future__ import annotations

import math
import time


class AccessRates:
    """Rates are in accesses per second, decayed with ``half_life`` seconds. At most
    ``max_keys`` blocks are tracked: when full, the coldest half is forgotten."""

    def __init__(self, half_life: float = 30.0, max_keys: int = 200_000) -> None:
        self.decay = math.log(2) / half_life
        self.max_keys = max_keys
        self._counts: dict[object, tuple[float, float]] = {}  # key -> (decayed count, at)
        self._touched: set[object] = set()  # accessed since the last ``take_touched``

    def _value(self, key: object, now: float) -> float:
        count, at = self._counts.get(key, (0.0, now))
        return count * math.exp(-self.decay * (now - at))

    def hit(self, keys, now: float | None = None) -> None:
        self.add(((key, 1.0) for key in keys), now)

    def add(self, counts, now: float | None = None) -> None:
        """``(key, accesses)`` pairs: several accesses at once (counted elsewhere and sent here)."""
        now = time.monotonic() if now is None else now
        for key, n in counts:
            self._counts[key] = (self._value(key, now) + n, now)
            self._touched.add(key)
        if len(self._counts) > self.max_keys:
            self._forget_coldest(now)

    def items(self, now: float | None = None) -> list[tuple[object, float]]:
        """Every tracked block with its rate in accesses per second (a steady rate r keeps the
        decayed count at r / decay)."""
        now = time.monotonic() if now is None else now
        return [(key, self._value(key, now) * self.decay) for key in self._counts]

    def rate(self, key: object, now: float | None = None) -> float:
        """One block's rate in accesses per second (0 for one not tracked)."""
        return self._value(key, time.monotonic() if now is None else now) * self.decay

    def take_touched(self) -> set[object]:
        """The tracked blocks accessed since the last call (the rest only cooled meanwhile)."""
        touched, self._touched = self._touched, set()
        return touched

    def forget(self, key: object) -> None:
        self._counts.pop(key, None)
        self._touched.discard(key)

    def _forget_coldest(self, now: float) -> None:
        ranked = sorted(self._counts, key=lambda k: self._value(k, now))
        for key in ranked[: len(ranked) // 2]:
            del self._counts[key]
            self._touched.discard(key)  # what nobody takes (a follower's) stays within max_keys too

    def __len__(self) -> int:
        return len(self._counts)
