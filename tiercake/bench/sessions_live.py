"""`tiercake bench sessions --live`: the same agentic trace replayed twice against one live cluster
(``tiercake up``: conductor, node agent, prefill and decode workers of the reference model), once
session-blind (the node's pool under LRU, no session headers) and once session-aware (the pool under
the session policy, each turn's session, announced pause and final turn sent as headers).

Two scenarios (``scenarios``), each on a cluster of its own. ``fleet``: agents started together,
each reading a long context of its own and then taking short turns between tool calls; the pool
holds 90% of their conversations at their longest, one request runs at a time (on two cores,
concurrent prefills share them and their TTFTs mostly measure each other). ``staggered`` (not with
``--quick``): agents arriving over half a minute, eight requests at a time, a pool of a third of
their KV. The workers' gpu tiers hold less than the conversations, so a turn after a tool pause finds
its prefix only if the pool kept it. Figures: TTFT of the turns after a pause (p50, p90),
session-aware against session-blind; their prompt tokens found cached; and the answers, which must
be the same in both runs (temperature 0: a wrong block would change them). Runs alternate (blind,
aware, blind, aware outside ``--quick``), each under its own tenant after a flush, so neither finds
the other's blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercake.agent_traces import AgentShape, agentic_trace
from tiercake.conductor.client import Client
from tiercake.conductor.etcd_process import free_port
from tiercake.config import ModelConfig
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
  model: {model}
  gpu_blocks: {gpu_blocks}
  max_context: 4096
"""
TOKENS_PER_BLOCK = 64  # each trace block: four of the cluster's 16-token blocks


@dataclass(frozen=True)
class Scenario:
    """A trace shape and the pool's size as a share of the trace's KV working set (every session's
    conversation at its longest)."""

    name: str
    shape: AgentShape
    pool_share: float
    gpu_blocks: int = 96  # each worker's gpu tier, in 16-token blocks
    concurrency: int = 8  # requests in flight at most


def scenarios(quick: bool) -> list[Scenario]:
    """``fleet``: a batch of agents started together, each reading its own long context first and then
    taking short turns between tool calls of about 4 s (a tool-heavy agent's shape); the pool holds
    most of their conversations but not all. ``staggered``: agents arriving over half a minute,
    shorter contexts, a pool of a third of their KV (the first shape measured)."""
    agents: dict[str, Any] = dict(agent_share=1.0, tool_pause_s=4.0, announce_sigma=0.2, subagent_p=0.0, seed=3)
    fleet = AgentShape(
        sessions=8 if quick else 12,
        rate_per_s=4.0,
        agent_turns=(4, 6),
        pause_sigma=0.2,
        turn_blocks=(1, 1),
        context_blocks=(14, 18),
        system_prompts=1,
        system_blocks=2,
        **agents,
    )
    staggered = AgentShape(
        sessions=12,
        rate_per_s=0.4,
        agent_turns=(3, 5),
        pause_sigma=0.5,
        turn_blocks=(1, 2),
        system_prompts=2,
        system_blocks=4,
        **agents,
    )
    chosen = [Scenario("fleet", fleet, FLEET_POOL_SHARE, gpu_blocks=256, concurrency=1)]
    return chosen if quick else [*chosen, Scenario("staggered", staggered, 0.33)]


FLEET_POOL_SHARE = 0.9


def pool_bytes(records: list, kv_bytes_per_token: int, share: float) -> int:
    """``share`` of the KV of every session's conversation at its longest, in whole MiB."""
    longest: dict = {}
    for r in records:
        longest[r.session] = max(longest.get(r.session, 0), len(r.hash_ids) * TOKENS_PER_BLOCK)
    return max(1, round(share * sum(longest.values()) * kv_bytes_per_token / (1 << 20))) << 20


MODEL = ModelConfig(dim=512, layers=8, heads=8, kv_heads=2, ffn_dim=1536)


async def run(report: Report, quick: bool) -> None:
    for scenario in scenarios(quick):
        records = agentic_trace(scenario.shape)
        layout = MODEL.layout()
        pool = pool_bytes(records, layout.nbytes // layout.block_size, scenario.pool_share)
        runs = await _runs(records, pool, scenario, rounds=1 if quick else 2)
        _figures(
            report,
            runs,
            len(records),
            quick,
            scenario=scenario.name,
            pool_mib=pool >> 20,
            gpu_blocks=scenario.gpu_blocks,
        )


async def _runs(records: list, pool: int, scenario: Scenario, rounds: int) -> dict[str, list[list[Outcome]]]:
    """Blind and aware runs, alternating, against one cluster whose pool holds ``pool`` bytes."""
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-sessions-") as tmp:
        root = Path(tmp)
        pool_path = f"/dev/shm/tiercake-bench-sessions-{os.getpid()}"
        config = root / "bench.yaml"
        model = MODEL.model_dump(include={"dim", "layers", "heads", "kv_heads", "ffn_dim"})
        config.write_text(
            CONFIG.format(pool=pool, pool_path=pool_path, model=json.dumps(model), gpu_blocks=scenario.gpu_blocks)
        )
        up = UpProcess(config, root / "data", free_port())
        try:
            await asyncio.to_thread(up.wait_ready, 2)
            runs: dict[str, list[list[Outcome]]] = {"blind": [], "aware": []}
            for i in range(rounds):
                for name in ("blind", "aware"):
                    runs[name].append(await _one_run(up, records, name, i, scenario.concurrency))
            return runs
        finally:
            up.stop()
            Path(pool_path).unlink(missing_ok=True)


async def _one_run(up: UpProcess, records: list, name: str, round_: int, concurrency: int) -> list[Outcome]:
    aware = name == "aware"
    async with Client([up.control_url], token=up.token, timeout=60) as ops:
        await ops.set_policy(eviction={"pool": {"policy": "session" if aware else "lru"}})
        await ops.flush(wait=True)
    done = await replay(
        records,
        up.url,
        tokens_per_block=TOKENS_PER_BLOCK,
        max_output=8,
        concurrency=concurrency,
        control=up.control_url,
        control_token=up.token,
        sessions=aware,
        tenant=f"{name}-{round_}",
    )
    return done.outcomes


def _figures(
    report: Report, runs: dict[str, list[list[Outcome]]], requests: int, quick: bool, **scenario: object
) -> None:
    def resumed(outcomes: list[Outcome]) -> list[Outcome]:
        return [o for o in outcomes if o.turn and o.status == "ok"]

    def pct(values: list[float], p: int) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] if values else 0.0

    common = {
        "trace": "agentic (generated)",
        "requests": requests,
        "rounds": len(runs["aware"]),
        "quick": quick,
        **scenario,
    }
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
