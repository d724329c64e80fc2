"""Score an eviction policy on a trace: its hit ratio beside LRU's and the offline optimum's at each
capacity (``tiercake policy eval``), as a table, a plot and figures in the benchmark JSON format."""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercake.policies.registry import create_admission, create_eviction
from tiercake.traces import TraceRecord

from .cache_sim import Access, Event, TierSpec, accesses, optimum, session_stream, simulate


@dataclass(frozen=True, slots=True)
class Score:
    policy: str
    capacity: float
    hit_ratio: float
    token_hit_ratio: float
    seconds: float
    accesses: int

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.seconds if self.seconds else 0.0


def score(
    stream: list[Access] | list[Event],
    policy: str,
    capacity: float,
    params: dict[str, Any] | None = None,
    admission: str = "always",
) -> Score:
    started = time.perf_counter()
    if policy == "optimum":
        result = optimum(stream, capacity)
    else:
        tier = TierSpec(capacity, create_eviction(policy, params), create_admission(admission))
        result = simulate(stream, [tier])
    seconds = time.perf_counter() - started
    return Score(policy, capacity, result.hit_ratio, result.token_hit_ratio, seconds, result.accesses)


def evaluate(
    stream: list[Access] | list[Event],
    policy: str,
    capacities: list[float],
    params: dict[str, Any] | None = None,
    admission: str = "always",
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Score]:
    """The policy, LRU (unless it is the policy) and the optimum at each capacity; ``progress`` is
    called with (runs done, runs in all, what runs next) before each run and once at the end."""
    names = [policy] + (["lru"] if policy != "lru" else []) + ["optimum"]
    runs = [(cap, name) for cap in capacities for name in names]
    scores = []
    for done, (cap, name) in enumerate(runs):
        if progress is not None:
            progress(done, len(runs), f"{name} @ {'inf' if math.isinf(cap) else f'{cap:,}'} blocks")
        scores.append(
            score(stream, name, cap, params if name == policy else None, admission if name == policy else "always")
        )
    if progress is not None:
        progress(len(runs), len(runs), "done")
    return scores


def parse_capacities(text: str) -> list[float]:
    """``1000,10k,1M,inf`` -> block counts."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("inf", "infinite"):
            out.append(math.inf)
            continue
        factor = {"k": 1_000, "m": 1_000_000}.get(part[-1:], 1)
        number = part[:-1] if factor > 1 else part
        try:
            value = int(float(number) * factor)
        except ValueError:
            raise ValueError(f"capacity {part!r} is not a number of blocks (e.g. 1000, 10k, 1M, inf)") from None
        if value <= 0:
            raise ValueError(f"capacity must be positive, got {part!r}")
        out.append(value)
    return out


def plot(scores: list[Score], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [s.capacity for s in scores if math.isfinite(s.capacity)]
    top = max(finite) * 2 if finite else 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(s.policy for s in scores):
        mine = [s for s in scores if s.policy == name]
        xs = [s.capacity if math.isfinite(s.capacity) else top for s in mine]
        ax.plot(xs, [s.hit_ratio for s in mine], marker="o", label=name, linestyle="--" if name == "optimum" else "-")
    ax.set_xscale("log")
    infinite = any(not math.isfinite(s.capacity) for s in scores)
    ax.set_xlabel("capacity (blocks; the rightmost point is infinite)" if infinite else "capacity (blocks)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(textwrap.fill(title, 70), fontsize=10)  # a long policy spec once ran off the figure
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True, slots=True)
class SessionScore:
    """One policy told one level of session information (``SESSION_INFO``), at one capacity."""

    policy: str
    info: str
    capacity: float
    hit_ratio: float
    optimum: float
    seconds: float
    announce_sigma: float = 0.0

    @property
    def label(self) -> str:
        """``lru``, ``session.close``, ``session.announced~0.3`` (with an error on each pause)."""
        label = self.policy if self.info == "none" else f"{self.policy}.{self.info}"
        return f"{label}~{self.announce_sigma:g}" if self.announce_sigma else label

    @property
    def of_optimum(self) -> float:
        return self.hit_ratio / self.optimum if self.optimum else 0.0


def evaluate_sessions(
    records: list[TraceRecord],
    capacities: list[float],
    runs: list[tuple[str, str, dict[str, Any] | None, float]],
    progress: Callable[[int, int, str], None] | None = None,
) -> list[SessionScore]:
    """Each run ``(policy, session info, params, announce sigma)`` at each capacity, beside the tree
    optimum; records need sessions (``infer_sessions``). Session-blind policies run with "none"."""
    scores = []
    total = len(capacities) * (len(runs) + 1)
    done = 0
    blind = accesses(records)
    streams = {(info, sigma): session_stream(records, info, sigma) for _, info, _, sigma in runs}  # once each
    for cap in capacities:
        if progress is not None:
            progress(done, total, f"optimum @ {cap:,} blocks")
        best = optimum(blind, cap).hit_ratio
        done += 1
        for policy, info, params, sigma in runs:
            if progress is not None:
                progress(done, total, f"{policy} ({info}) @ {cap:,} blocks")
            started = time.perf_counter()
            tier = TierSpec(cap, create_eviction(policy, params))
            hit = simulate(streams[(info, sigma)], [tier]).hit_ratio
            scores.append(SessionScore(policy, info, cap, hit, best, time.perf_counter() - started, sigma))
            done += 1
    if progress is not None:
        progress(total, total, "done")
    return scores
