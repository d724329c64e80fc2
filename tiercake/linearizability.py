"""A linearizability checker for histories of one key of the key-value store (a register with
Mooncake's put), in the manner of Wing and Gong with Lowe's memoization (as Porcupine does it).

Each operation is (kind, value, result, called, returned): called and returned on one monotonic
clock; ``returned`` None for an operation whose outcome is unknown (the client saw a transfer
failure or a timeout): it may have taken effect at any time after it was called, or never.
Operations that failed for sure (a refusal) are left out of the history by the caller.

The model, per key (its state: the current value, or None when absent):

- ``put(v)``: stores v if the key is absent, else changes nothing (Mooncake's first put wins); ok;
- ``upsert(v)``: stores v; ok;
- ``remove()``: absent -> "not_found"; else removes it, "ok";
- ``get()``: the current value, or None.

``check(ops)`` is True when some order of the operations, each placed between its call and its
return, explains every result; ``explain`` says where a history first fails.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str  # put, upsert, remove, get
    value: bytes | None  # what a put or upsert wrote
    result: object  # get: the value read or None; remove: "ok" / "not_found"; put, upsert: "ok"
    called: float
    returned: float | None  # None: unknown outcome


def step(state: bytes | None, op: Op) -> tuple[bool, bytes | None]:
    """(whether ``op`` could have answered its result from ``state``, the state after it)."""
    unknown = op.returned is None  # its answer never came: any answer fits
    if op.kind == "put":
        return True if unknown else op.result == "ok", state if state is not None else op.value
    if op.kind == "upsert":
        return True if unknown else op.result == "ok", op.value
    if op.kind == "put":
        return op.result == "ok", state if state is not None else op.value
    if op.kind == "upsert":
        return op.result == "ok", op.value
    if op.kind == "remove":
        if op.returned is None:  # unknown outcome: it removed whatever was there, or nothing
            return True, None
        return (op.result == ("not_found" if state is None else "ok")), None
    if op.kind == "get":
        return op.result == state, state
    raise ValueError(f"unknown operation {op.kind!r}")


class _Entry:
    __slots__ = ("op", "index", "is_call", "match", "prev", "next")

    def __init__(self, op: Op | None, index: int, is_call: bool) -> None:
        self.op, self.index, self.is_call = op, index, is_call
        self.match: _Entry | None = None
        self.prev: _Entry = self  # the head's stays itself; every other entry's is set when linked
        self.next: _Entry | None = None


def _entries(ops: list[Op]) -> _Entry:
    events = []
    for i, op in enumerate(ops):
        events.append((op.called, 1, i, True))
        if op.returned is not None:
            events.append((op.returned, 0, i, False))  # at one instant a return comes before a call
    events.sort()
    head = _Entry(None, -1, False)
    last = head
    calls: dict[int, _Entry] = {}
    for _, _, i, is_call in events:
        entry = _Entry(ops[i], i, is_call)
        if is_call:
            calls[i] = entry
        else:
            calls[i].match = entry
        last.next, entry.prev = entry, last
        last = entry
    return head


def _lift(entry: _Entry) -> None:
    entry.prev.next = entry.next
    if entry.next is not None:
        entry.next.prev = entry.prev
    if entry.match is not None:
        m = entry.match
        m.prev.next = m.next
        if m.next is not None:
            m.next.prev = m.prev


def _unlift(entry: _Entry) -> None:
    if entry.match is not None:
        m = entry.match
        m.prev.next = m
        if m.next is not None:
            m.next.prev = m
    entry.prev.next = entry
    if entry.next is not None:
        entry.next.prev = entry


def check(ops: list[Op], initial: bytes | None = None, budget: int = 5_000_000) -> bool:
    """Whether the history of one key is linearizable. ``RuntimeError`` past ``budget`` steps."""
    head = _entries(ops)
    state = initial
    linearized = 0
    cache: set[tuple[int, bytes | None]] = set()
    stack: list[tuple[_Entry, bytes | None]] = []
    entry = head.next
    steps = 0
    while head.next is not None:
        steps += 1
        if steps > budget:
            raise RuntimeError(f"the checker gave up after {budget} steps")
        if entry is not None and entry.is_call:
            assert entry.op is not None  # only the head has none
            ok, after = step(state, entry.op)
            if ok:
                key = (linearized | (1 << entry.index), after)
                if key not in cache:
                    cache.add(key)
                    stack.append((entry, state))
                    state, linearized = after, key[0]
                    _lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
            continue
        if entry is None and not _pending_returns(head):
            return True  # what is left are calls of unknown outcome: they may never have happened
        if not stack:
            return False
        entry, state = stack.pop()
        linearized &= ~(1 << entry.index)
        _unlift(entry)
        entry = entry.next
    return True


def _pending_returns(head: _Entry) -> bool:
    e = head.next
    while e is not None:
        if not e.is_call:
            return True
        e = e.next
    return False


def explain(ops: list[Op], initial: bytes | None = None, label: Callable[[bytes], str] | None = None) -> str:
    """The shortest prefix of the history (by call time) that is not linearizable, as text (the last
    operations of it; ``label`` names a value, by default a short hash of it)."""
    label = label or _digest
    ordered = sorted(ops, key=lambda o: o.called)
    for n in range(1, len(ordered) + 1):
        prefix = ordered[:n]
        cut = prefix[-1].called
        # operations still running at the cut are of unknown outcome within the prefix
        trimmed = [
            o
            if o.returned is not None and o.returned <= cut or o is prefix[-1]
            else Op(o.kind, o.value, o.result, o.called, None if o.kind != "get" else o.returned)
            for o in prefix
        ]
        trimmed = [o for o in trimmed if not (o.kind == "get" and o.returned is None)]
        if not check(trimmed, initial):
            lines = [
                f"{o.kind}({_short(o.value, label)}) -> {_short(o.result, label)} [{o.called:.6f}, "
                f"{'?' if o.returned is None else f'{o.returned:.6f}'}]"
                for o in trimmed[-12:]
            ]
            return "not linearizable at:\n  " + "\n  ".join(lines)
    return "linearizable"


def _short(value: object, label: Callable[[bytes], str]) -> str:
    return label(value) if isinstance(value, bytes) else repr(value)


def _digest(value: bytes) -> str:
    return f"{hashlib.blake2b(value, digest_size=4).hexdigest()}/{len(value)}B"
