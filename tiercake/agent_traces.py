"""Agentic traces in the Mooncake format, with their sessions: human chats (long multi-turn
conversations, unannounced pauses), agents (tool calls: short pauses with a heavy tail, each announced
by the client with an error) and subagent fans (forks that share the parent's whole conversation, run
a few turns of their own and close, after which the parent goes on).

Each turn's prompt is its session's conversation so far plus new blocks; its last block is partial,
so the next turn's prompt replaces it (its hash changes), as a real tokenizer's blocks would.
Seeded: the same arguments write the same trace.

Clients are as honest as a shape says (issue 48): an agent announces a share of its tool pauses
(``announce_share``), each with a log-normal error (``announce_sigma``; ln 2 ~ 0.69 is "within a
factor of two" at one sigma) and, if asked, a bias (``announce_bias``: a client that always says
half); a human's think time is never announced; a share of sessions is
abandoned (``abandon_p``: the last turn does not close, as when a user walks away); and a long
conversation may be compacted (``compact_p`` per turn once it holds ``compact_after`` blocks of its
own): its context is replaced by a short summary, so its next prompt shares only the system prompt
with what the cache holds for it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from .traces import TRACE_BLOCK_TOKENS, TraceRecord


@dataclass(frozen=True, slots=True)
class AgentShape:
    """What kind of conversations a generated trace holds (times in seconds)."""

    sessions: int = 200
    rate_per_s: float = 0.5  # new sessions per second (Poisson)
    agent_share: float = 0.6  # the rest are human chats
    chat_turns: tuple[int, int] = (2, 12)
    agent_turns: tuple[int, int] = (4, 24)
    chat_pause_s: float = 40.0  # medians of log-normal pauses
    tool_pause_s: float = 6.0
    pause_sigma: float = 1.0
    announce_sigma: float = 0.3  # an agent's announced pause = the real one times a log-normal error
    announce_share: float = 1.0  # of an agent's tool pauses, how many it announces
    announce_bias: float = 1.0  # what it announces is the pause times this (0.5: it always says half)
    abandon_p: float = 0.0  # sessions whose last turn does not close (the user walked away; subagents end)
    compact_p: float = 0.0  # per turn, once a conversation is long: its context compacted
    compact_after: int = 24  # blocks of its own a conversation holds before it may be compacted
    summary_blocks: tuple[int, int] = (2, 4)  # what a compaction leaves of it
    subagent_p: float = 0.15  # per agent turn: a fan of subagents starts
    fan: tuple[int, int] = (2, 6)
    turn_blocks: tuple[int, int] = (1, 4)
    # blocks of the session's own context in its first prompt (a task, the files an agent read): a
    # long conversation of short turns; (0, 0): none
    context_blocks: tuple[int, int] = (0, 0)
    tenants: int = 1
    system_prompts: int = 4
    system_blocks: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        numbers = [self.chat_pause_s, self.tool_pause_s, self.pause_sigma, self.announce_sigma]
        positive = [self.rate_per_s, self.announce_bias]
        if not all(math.isfinite(x) and x >= 0 for x in numbers) or not all(0 < x < math.inf for x in positive):
            raise ValueError("pauses and sigmas must be finite and not negative, the rate and announce_bias positive")
        if self.sessions < 1 or self.tenants < 1 or self.system_prompts < 1 or self.system_blocks < 1:
            raise ValueError("sessions, tenants, system_prompts and system_blocks must be >= 1")
        probabilities = (self.agent_share, self.subagent_p, self.announce_share, self.abandon_p, self.compact_p)
        if not all(0 <= p <= 1 for p in probabilities):
            raise ValueError("agent_share, subagent_p, announce_share, abandon_p and compact_p are probabilities")
        if self.compact_after < 1:
            raise ValueError("compact_after must be >= 1 block")
        for low, high in (self.chat_turns, self.agent_turns, self.fan, self.turn_blocks, self.summary_blocks):
            if not 1 <= low <= high:
                raise ValueError(f"a range ({low}, {high}) must have 1 <= low <= high")
        if not 0 <= self.context_blocks[0] <= self.context_blocks[1]:
            raise ValueError(f"context_blocks {self.context_blocks} must have 0 <= low <= high")


@dataclass(order=True)
class _Turn:
    at: float
    seq: int
    session: str = field(compare=False)
    tenant: int = field(compare=False)
    ids: list[int] = field(compare=False)  # the conversation's full blocks so far
    left: int = field(compare=False)  # turns left, this one included
    agent: bool = field(compare=False)
    fork_of: str | None = field(compare=False, default=None)
    parent: _Turn | None = field(compare=False, default=None)  # a subagent's parent, waiting for its fan
    waiting: int = field(compare=False, default=0)  # a parent's subagents still running
    system: int = field(compare=False, default=0)  # blocks of its system prompt, never compacted
    abandoned: bool = field(compare=False, default=False)  # its last turn will not close


class _Generator:
    def __init__(self, shape: AgentShape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        self.ids = itertools.count(1)
        self.seq = itertools.count()
        self.prompts = {
            (t, p): [next(self.ids) for _ in range(shape.system_blocks)]
            for t in range(shape.tenants)
            for p in range(shape.system_prompts)
        }
        self.queue: list[_Turn] = []
        self.records: list[TraceRecord] = []

    def run(self) -> list[TraceRecord]:
        clock = 0.0
        for n in range(self.shape.sessions):
            clock += self.rng.expovariate(self.shape.rate_per_s)
            self._start(clock, f"a{n}")
        while self.queue:
            self._serve(heapq.heappop(self.queue))
        self.records.sort(key=lambda r: r.timestamp)
        return self.records

    def _start(self, at: float, session: str) -> None:
        shape, rng = self.shape, self.rng
        tenant = rng.randrange(shape.tenants)
        agent = rng.random() < shape.agent_share
        turns = rng.randint(*(shape.agent_turns if agent else shape.chat_turns))
        ids = list(self.prompts[(tenant, rng.randrange(shape.system_prompts))])
        system = len(ids)
        if shape.context_blocks[1]:  # drawn only when asked: other shapes keep their random stream
            ids += [next(self.ids) for _ in range(rng.randint(*shape.context_blocks))]
        abandoned = bool(shape.abandon_p) and rng.random() < shape.abandon_p
        turn = _Turn(at, next(self.seq), session, tenant, ids, turns, agent, system=system, abandoned=abandoned)
        heapq.heappush(self.queue, turn)

    def _pause(self, agent: bool) -> float:
        median = self.shape.tool_pause_s if agent else self.shape.chat_pause_s
        return median * math.exp(self.rng.gauss(0, self.shape.pause_sigma))

    def _serve(self, turn: _Turn) -> None:
        shape, rng = self.shape, self.rng
        if shape.compact_p and len(turn.ids) - turn.system >= shape.compact_after and rng.random() < shape.compact_p:
            turn.ids = turn.ids[: turn.system] + [next(self.ids) for _ in range(rng.randint(*shape.summary_blocks))]
        turn.ids = turn.ids + [next(self.ids) for _ in range(rng.randint(*shape.turn_blocks))]
        partial = next(self.ids)  # this turn's last, partial block: the next turn's prompt refills it
        last = turn.left == 1
        nested = turn.fork_of is not None  # subagents do not fan out again
        fan = 0 if last or nested or not turn.agent or rng.random() >= shape.subagent_p else rng.randint(*shape.fan)
        pause = self._pause(turn.agent)
        announced = None
        tells = shape.announce_share >= 1 or (shape.announce_share > 0 and rng.random() < shape.announce_share)
        if turn.agent and not fan and tells:
            announced = int(1000 * pause * shape.announce_bias * math.exp(rng.gauss(0, shape.announce_sigma)))
        self.records.append(
            TraceRecord(
                timestamp=int(turn.at * 1000),
                input_length=TRACE_BLOCK_TOKENS * len(turn.ids) + rng.randint(1, TRACE_BLOCK_TOKENS - 1),
                output_length=rng.randint(16, 512),
                hash_ids=(*turn.ids, partial),
                tenant=f"tenant-{turn.tenant}" if shape.tenants > 1 else None,
                session=turn.session,
                pause_ms=announced,
                closes=last and not turn.abandoned,
                fork_of=turn.fork_of,
            )
        )
        if last:
            self._ended(turn)
            return
        turn.left -= 1
        if fan:
            self._fork(turn, fan)
            return
        turn.at += pause
        turn.seq = next(self.seq)
        heapq.heappush(self.queue, turn)

    def _fork(self, parent: _Turn, fan: int) -> None:
        """Subagents share the parent's whole conversation; the parent waits for all of them."""
        parent.waiting = fan
        for k in range(fan):
            child = _Turn(
                parent.at + 0.05 * (k + 1),
                next(self.seq),
                f"{parent.session}.{parent.left}.{k}",
                parent.tenant,
                list(parent.ids),
                self.rng.randint(1, 4),
                True,
                fork_of=parent.session,
                parent=parent,
                system=parent.system,
            )
            heapq.heappush(self.queue, child)

    def _ended(self, turn: _Turn) -> None:
        parent = turn.parent
        if parent is None:
            return
        parent.waiting -= 1
        parent.at = max(parent.at, turn.at)
        if parent.waiting == 0:  # the fan is done: the parent's next turn reads their answers
            parent.at += 1.0
            parent.seq = next(self.seq)
            heapq.heappush(self.queue, parent)


def agentic_trace(shape: AgentShape | None = None, **overrides: object) -> list[TraceRecord]:
    """A trace of ``shape`` (or the defaults with ``overrides``), sessions, turns and forks marked."""
    shape = shape or AgentShape(**overrides)  # type: ignore[arg-type]
    records = _Generator(shape).run()
    turns: dict[str, int] = {}
    out = []
    for record in records:
        turn = turns.get(record.session or "", -1) + 1
        turns[record.session or ""] = turn
        out.append(record.model_copy(update={"turn": turn}))
    return out
