"""`tiercake bench sessions --live`: the same agentic trace replayed twice against one live cluster
(``tiercake up``: conductor, node agent, prefill and decode workers of the reference model), once
session-blind (the node's pool under LRU, no session headers) and once session-aware (the pool under
the session policy, each turn's session, announced pause and final turn sent as headers).

The pool holds a fraction of the conversations' KV and the workers' gpu tiers less than one
conversation's, so a turn after a tool pause finds its prefix only if the pool kept it. Figures: TTFT
of the turns after a pause (p50, p90), session-aware against session-blind; their prompt tokens
found cached; and the answers, which must be the same in both runs (temperature 0: a wrong block
would change them). Runs alternate (blind, aware, blind, aware with ``--live`` outside ``--quick``),
each under its own tenant after a flush, so neither finds the other's blocks.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from tiercake.agent_traces import AgentShape, agentic_trace
from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.replay import Outcome, replay
from tiercake.up import UpProcess

from .report import Report

CONFIG = """node_id: bench-node
store:
  layout: null
  tiers:
    - {{kind: pool, capacity: {pool}, path: {pool_path}}}
conductor: {{member_ttl: 3}}
serving:
  model: {{dim: 512, layers: 8, heads: 8, kv_heads: 2, ffn_dim: 1536}}
  gpu_blocks: 96
  max_context: 4096
"""
TOKENS_PER_BLOCK = 64  # each trace block: four of the cluster's 16-token blocks
POOL = "6MiB"  # about a third of the conversations' KV at their longest


def shape(quick: bool) -> AgentShape:
    """Agents only (every pause announced), a few turns each, tool pauses of seconds."""
    return AgentShape(
        sessions=6 if quick else 12,
        rate_per_s=0.4,
        agent_share=1.0,
        agent_turns=(3, 5),
        tool_pause_s=4.0,
        pause_sigma=0.5,
        announce_sigma=0.2,
        subagent_p=0.0,
        turn_blocks=(1, 2),
        system_prompts=2,
        system_blocks=4,
        seed=3,
    )


async def run(report: Report, quick: bool) -> None:
    records = agentic_trace(shape(quick))
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-sessions-") as tmp:
        root = Path(tmp)
        pool_path = f"/dev/shm/tiercake-bench-sessions-{os.getpid()}"
        config = root / "bench.yaml"
        config.write_text(CONFIG.format(pool=POOL, pool_path=pool_path))
        up = UpProcess(config, root / "data", free_port())
        try:
            await asyncio.to_thread(up.wait_ready, 2)
            runs: dict[str, list[list[Outcome]]] = {"blind": [], "aware": []}
            rounds = 1 if quick else 2
            for i in range(rounds):
                for name in ("blind", "aware"):
                    runs[name].append(await _one_run(up, records, name, i))
        finally:
            up.stop()
            Path(pool_path).unlink(missing_ok=True)
    _figures(report, runs, len(records), quick)


async def _one_run(up: UpProcess, records: list, name: str, round_: int) -> list[Outcome]:
    aware = name == "aware"
    async with Client([up.control_url], token=up.token, timeout=60) as ops:
        await ops.set_policy(eviction={"pool": {"policy": "session" if aware else "lru"}})
        await ops.flush(wait=True)
    done = await replay(
        records,
        up.url,
        tokens_per_block=TOKENS_PER_BLOCK,
        max_output=8,
        concurrency=8,
        control=up.control_url,
        control_token=up.token,
        sessions=aware,
        tenant=f"{name}-{round_}",
    )
    return done.outcomes


def _figures(report: Report, runs: dict[str, list[list[Outcome]]], requests: int, quick: bool) -> None:
    def resumed(outcomes: list[Outcome]) -> list[Outcome]:
        return [o for o in outcomes if o.turn and o.status == "ok"]

    def pct(values: list[float], p: int) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] if values else 0.0

    common = {"trace": "agentic (generated)", "requests": requests, "rounds": len(runs["aware"]), "quick": quick}
    blind = [o for r in runs["blind"] for o in resumed(r)]
    aware = [o for r in runs["aware"] for o in resumed(r)]
    for p in (50, 90):
        report.add(
            f"live.resumed_ttft.p{p}",
            pct([o.ttft_s for o in aware], p),
            "s",
            pct([o.ttft_s for o in blind], p),
            limit_name="session-blind run",
            turns=len(aware),
            **common,
        )
    for name, outcomes in (("aware", aware), ("blind", blind)):
        cached = sum(o.cached_tokens for o in outcomes)
        report.add(
            f"live.resumed_cached.{name}",
            cached,
            "tokens",
            sum(o.prompt_tokens for o in outcomes),
            limit_name="prompt tokens",
            **common,
        )
    answers = [
        (a.text == b.text, a.status == b.status == "ok")
        for ra, rb in zip(runs["aware"], runs["blind"])
        for a, b in zip(ra, rb)
    ]
    report.add(
        "live.same_answers",
        sum(same for same, ok in answers if ok),
        "requests",
        sum(ok for _, ok in answers),
        limit_name="answered in both runs",
        **common,
    )
    for name, done in runs.items():  # rejected: a 429 (the small gpu tier full); failed: anything else
        sent = sum(len(r) for r in done)
        for status in ("rejected", "failed"):
            count = sum(o.status == status for r in done for o in r)
            errors = sorted({o.error for r in done for o in r if o.status == status})[:3]
            report.add(f"live.{status}.{name}", count, "requests", sent, errors=errors, **common)
    if aware and blind:
        report.add(
            "live.resumed_ttft.mean",
            statistics.fmean(o.ttft_s for o in aware),
            "s",
            statistics.fmean(o.ttft_s for o in blind),
            limit_name="session-blind run",
            **common,
        )
