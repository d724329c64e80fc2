"""`tiercake bench sessions`: what knowing sessions is worth to a tier's eviction, offline, as shares
of the tree-constrained optimum and as ratios to the best session-blind policy (LRU, ARC, S3-FIFO,
``reuse``) in the same sitting: ``vs_best_blind.*``, which the session policy's learning keeps near 1
or above whatever it is told.

Three traces: a generated agentic one (tool pauses announced with a 30% error, human chats that
announce nothing, subagent fans), the same shape with honest clients (``HONEST``: a share of the
pauses announced, within a factor of two, abandoned sessions, compaction) and, given ``--trace``, a trace in the Mooncake format with sessions
inferred from its block chains (a turn extends its conversation's whole prompt); such a trace
announces no pause and no close. The session-aware policy runs told each level of information
(``SESSION_INFO``): nothing, sessions only (open, expiring by retention), also when they close, also
each announced pause (as the trace carries them), and the oracle, which reads every pause and close
from the trace's future (an upper bound, never a figure of what a client tells); the conversation
trace also with a 30% error on each oracle pause. Then the ``session`` router against ``ttft`` in
the cluster simulator, on the agentic trace.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from tiercake.agent_traces import AgentShape, agentic_trace
from tiercake.analysis.cluster_sim import ClusterSpec, simulate_cluster
from tiercake.analysis.evaluate import SessionScore, evaluate_sessions
from tiercake.traces import TraceRecord, infer_sessions, read_trace

from .report import Report, machine

BLIND = [(name, "none", None, 0.0) for name in ("lru", "arc", "s3fifo", "reuse")]
AWARE = [("session", info, None, 0.0) for info in ("open", "close", "announced", "oracle")]
# what real agents tell, roughly: most tool pauses announced within a factor of two, no think time,
# a third of the users walking away without a close, long conversations now and then compacted
HONEST = {"announce_share": 0.7, "announce_sigma": 0.69, "abandon_p": 0.3, "compact_p": 0.05}


async def run(quick: bool = False, trace: str | Path | None = None, live: bool = False) -> Report:
    report = Report(bench="sessions", machine=machine())
    if live:  # first: its cluster starts on an idle machine
        from . import sessions_live

        await sessions_live.run(report, quick)
    sets: list[tuple[str, list[TraceRecord], list[float], list]] = []
    shape = AgentShape(sessions=80 if quick else 400, seed=1)
    sets.append(("agentic (generated)", agentic_trace(shape), [300, 1000], BLIND + AWARE))
    honest = replace(shape, **HONEST)  # type: ignore[arg-type]
    sets.append(("agentic, honest clients (generated)", agentic_trace(honest), [100, 300], BLIND + AWARE))
    if trace is not None:
        records = await asyncio.to_thread(read_trace, trace, 4000 if quick else None)
        noisy = [("session", "oracle", None, 0.3)]
        sets.append((Path(trace).name, infer_sessions(records), [1000, 10_000], BLIND + AWARE + noisy))
    for name, records, capacities, runs in sets:
        scores = await asyncio.to_thread(evaluate_sessions, records, capacities, runs)
        _add(report, name, records, scores)
    await asyncio.to_thread(_routing, report, sets[0][1])
    return report


def _routing(report: Report, records: list[TraceRecord]) -> None:
    """The ``session`` router against ``ttft`` on the agentic trace in the cluster simulator (four
    prefill workers, small gpu caches, a shared pool): blocks pulled from the pool, gpu-local hits and
    mean TTFT, each as a ratio to ``ttft``'s."""
    for local_blocks in (100, 300):
        spec = ClusterSpec(prefill_workers=4, decode_workers=4, local_blocks=local_blocks, global_blocks=1e9)
        blind, aware = (simulate_cluster(records, spec, router).summary() for router in ("ttft", "session"))
        common = {"trace": "agentic (generated)", "prefill_workers": 4, "local_blocks": local_blocks}
        for figure, unit in (("bytes_moved", "B"), ("local_hit_ratio", "ratio"), ("ttft_mean_s", "s")):
            report.add(f"router.{figure}", aware[figure], unit, blind[figure], limit_name="ttft", **common)


def _add(report: Report, trace: str, records: list[TraceRecord], scores: list[SessionScore]) -> None:
    sessions = len({(r.tenant, r.session) for r in records})
    for cap in dict.fromkeys(s.capacity for s in scores):
        row = [s for s in scores if s.capacity == cap]
        blind = max((s for s in row if s.info == "none"), key=lambda s: s.hit_ratio)
        common = {"trace": trace, "capacity": int(cap), "requests": len(records), "sessions": sessions}
        for s in row:
            report.add(f"hit_ratio.{s.label}", s.hit_ratio, "ratio", s.optimum, limit_name="optimum", **common)
            if s.info != "none":
                report.add(
                    f"vs_best_blind.{s.label}", s.hit_ratio, "ratio", blind.hit_ratio, limit_name=blind.policy, **common
                )
