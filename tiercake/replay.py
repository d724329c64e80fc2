"""``tiercake replay``: drive a running cluster with a trace in the Mooncake format.

Each trace block (512 tokens, one hash id) becomes ``tokens_per_block`` pseudo-random tokens derived
from its hash id alone, so the same id always yields the same tokens and reuse in the trace is reuse
in the cluster (the chain of ids is a chain of token blocks). Arrivals follow the timestamps, scaled
by ``time_scale``; prompts that would not fit the cluster's context lose trailing blocks. The report:
TTFT percentiles beside those of the requests that found nothing cached (compute only, same run), and
the cluster's hit ratio (in all and by source tier) beside the trace's own ceiling (an infinite
cache, from the simulator), load time per source tier, and from the cluster's own counters over the
run: metadata bytes per KV byte moved and operations per request, and the share of re-accesses the
front found prefetchable beside the share measured offline on the same trace.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tiercake.bench.report import Report, cluster_figures, machine
from tiercake.conductor.client import Client, ConductorError, Session
from tiercake.messages import ClusterView
from tiercake.traces import TRACE_BLOCK_TOKENS, TraceRecord


@dataclass(slots=True)
class Outcome:
    index: int
    sent_at: float
    status: str = "ok"  # ok, rejected (429), failed
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    sources: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)  # the server's breakdown: route, lookup, load, compute
    load_tier: str | None = None  # where the pulled prefix came from (pool, ssd, ...); None: nothing pulled
    prefetched_blocks: int = 0  # of the blocks pulled from nodes, those pulled while the request waited
    error: str = ""
    turn: int | None = None  # its session's turn (replayed with sessions): > 0 came after a pause
    text: str = ""  # the answer, to compare two runs of the same trace


class TokenMap:
    """Hash id -> its tokens (seeded by the id: the same id, the same tokens, in every run)."""

    def __init__(self, tokens_per_block: int, vocab: int = 256) -> None:
        self.tokens_per_block = tokens_per_block
        self.vocab = vocab
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            rng = random.Random(hash_id * 1_000_003 + 17)
            tokens = [rng.randrange(self.vocab) for _ in range(self.tokens_per_block)]
            self._cache[hash_id] = tokens
        return tokens

    def prompt(self, record: TraceRecord, max_tokens: int) -> list[int]:
        ids = list(record.hash_ids)
        last = max(1, math.ceil(record.block_tokens(len(ids) - 1) * self.tokens_per_block / TRACE_BLOCK_TOKENS))
        while ids and (len(ids) - 1) * self.tokens_per_block + last > max_tokens:
            ids.pop()  # too long for the cluster: keep the prefix
            last = self.tokens_per_block
        if not ids:
            return self.block(record.hash_ids[0])[: max(1, max_tokens)]
        return [t for h in ids[:-1] for t in self.block(h)] + self.block(ids[-1])[:last]


@dataclass
class ReplayRun:
    outcomes: list[Outcome]
    cluster_before: ClusterView | None  # /v1/cluster before and after (None: the control API was not reachable)
    cluster_after: ClusterView | None


async def _cluster_view(url: str, token: str | None) -> ClusterView | None:
    try:
        async with Client([url], token=token, timeout=30, retries=1) as control:
            return await control.cluster()
    except (ConductorError, ValueError, aiohttp.ClientError):  # not a tiercake front (vLLM itself, say)
        return None


async def replay(
    records: list[TraceRecord],
    target: str,
    *,
    time_scale: float = 1.0,
    tokens_per_block: int = 16,
    max_output: int = 32,
    concurrency: int = 64,
    api_key: str | None = None,
    model: str | None = None,
    control: str | None = None,
    control_token: str | None = None,
    progress=None,
    sessions: bool = False,
    tenant: str | None = None,
) -> ReplayRun:
    """``control``: the control API's URL, for the cluster's own counters (default: ``target``, where
    the OpenAI API and the control API share a port). ``sessions``: each record's session goes with
    it as the front's session headers (the pause the trace announces, scaled by ``time_scale``, and its
    close). ``tenant``: every request under it (default: each record's own)."""
    control = control or target
    before = await _cluster_view(control, control_token or api_key)
    async with Client([target], token=api_key, timeout=600, retries=3) as client:
        info = (await client.models())[0]
        model = model or info["id"]
        context = int(info.get("max_model_len", 2048))
        tokens = TokenMap(tokens_per_block)
        gate = asyncio.Semaphore(concurrency)
        start = time.monotonic()
        outcomes: list[Outcome] = []
        first_ts = records[0].timestamp if records else 0

        async def one(i: int, record: TraceRecord) -> None:
            delay = (record.timestamp - first_ts) / 1000 * time_scale - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            max_tokens = max(1, min(max_output, round(record.output_length * tokens_per_block / TRACE_BLOCK_TOKENS)))
            prompt = tokens.prompt(record, context - max_tokens)
            outcome = Outcome(i, time.monotonic() - start, prompt_tokens=len(prompt), turn=record.turn)
            session = _session(record, time_scale) if sessions else None
            async with gate:
                sent = time.perf_counter()
                try:
                    async for chunk in client.stream_completion(
                        prompt,
                        model=model,
                        max_tokens=max_tokens,
                        temperature=0.0,
                        tenant=tenant or record.tenant,
                        session=session,
                    ):
                        if chunk.get("choices") and not outcome.ttft_s:
                            outcome.ttft_s = time.perf_counter() - sent
                        outcome.text += "".join(c.get("text", "") for c in chunk.get("choices") or ())
                        usage = chunk.get("usage")
                        if usage:
                            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                            outcome.completion_tokens = usage["completion_tokens"]
                            extra = usage.get("tiercake", {})
                            outcome.sources = extra.get("sources", {})
                            outcome.phases = {
                                k[:-2]: extra.get(k, 0.0) for k in ("route_s", "lookup_s", "load_s", "compute_s")
                            }
                            outcome.load_tier = extra.get("load_tier")
                            outcome.prefetched_blocks = extra.get("prefetched_blocks") or 0
                except ConductorError as exc:
                    outcome.status = "rejected" if exc.status == 429 else "failed"
                    outcome.error = str(exc)[:200]
                except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
                    # a stream cut mid-way, a malformed event: this request failed, the replay goes on
                    outcome.status = "failed"
                    outcome.error = f"{type(exc).__name__}: {exc}"[:200]
                outcome.latency_s = time.perf_counter() - sent
            outcomes.append(outcome)
            if progress is not None:
                progress()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
    after = await _cluster_view(control, control_token or api_key) if before is not None else None
    return ReplayRun(sorted(outcomes, key=lambda o: o.index), before, after)


def _session(record: TraceRecord, time_scale: float) -> Session | None:
    if record.session is None:
        return None
    pause = None if record.pause_ms is None else record.pause_ms / 1000 * time_scale
    return Session(record.session, parent=record.fork_of, pause_s=pause, final=bool(record.closes))


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


MEMORY_TIERS = ("gpu", "pool")  # a node's tiers a load reads from memory


def report(run: ReplayRun, records: list[TraceRecord], trace_name: str, **params) -> Report:
    """Figures: TTFT P50/P99 against the requests with nothing cached; load time per source tier
    against those requests' TTFT; hit ratio, in all and per source tier, against the trace's ceiling
    (every earlier block still cached); how many completed, were rejected, failed; and from the
    cluster's counters, metadata cost and the live prefetchable share against the offline one."""
    outcomes = run.outcomes
    rep = Report(bench="replay", machine=machine())
    ok = [o for o in outcomes if o.status == "ok"]
    common = {"trace": trace_name, "requests": len(outcomes), **params}
    _ttft_figures(rep, ok, common)
    _resumed_figures(rep, ok, common)
    _hit_figures(rep, ok, records, common)
    _pull_figures(rep, ok, common)
    _counter_figures(rep, run, records, common)
    for status in ("ok", "rejected", "failed"):
        rep.add(f"requests.{status}", sum(o.status == status for o in outcomes), "requests", len(outcomes), **common)
    return rep


def _ttft_figures(rep: Report, ok: list[Outcome], common: dict) -> None:
    cold = [o.ttft_s for o in ok if o.cached_tokens == 0]
    tiers = sorted({o.load_tier for o in ok if o.load_tier})
    for p in (50, 99):
        breakdown = {
            f"{phase}_s": round(_pct([o.phases.get(phase, 0.0) for o in ok], p), 5)
            for phase in ("route", "lookup", "load", "compute")
        }
        rep.add(
            f"ttft.p{p}",
            _pct([o.ttft_s for o in ok], p),
            "s",
            _pct(cold, p),
            limit_name="requests with nothing cached",
            **common,
            **breakdown,
        )
        for tier in tiers:  # load time of the requests that pulled from this tier, against their whole TTFT
            pulled = [o for o in ok if o.load_tier == tier]
            rep.add(
                f"load.{tier}.p{p}",
                _pct([o.phases.get("load", 0.0) for o in pulled], p),
                "s",
                _pct([o.ttft_s for o in pulled], p),
                limit_name="TTFT of those requests",
                **common,
                loads=len(pulled),
            )


def _resumed_figures(rep: Report, ok: list[Outcome], common: dict) -> None:
    """TTFT of the turns that came after a pause (a session's turn > 0), against the first turns'."""
    resumed = [o.ttft_s for o in ok if o.turn]
    first = [o.ttft_s for o in ok if o.turn == 0]
    if not resumed or not first:
        return
    for p in (50, 90):
        rep.add(
            f"ttft.resumed.p{p}",
            _pct(resumed, p),
            "s",
            _pct(first, p),
            limit_name="first turns",
            turns=len(resumed),
            **common,
        )


def _hit_figures(rep: Report, ok: list[Outcome], records: list[TraceRecord], common: dict) -> None:
    from tiercake.analysis.cache_sim import TierSpec, accesses, simulate
    from tiercake.policies import LRU

    prompt = sum(o.prompt_tokens for o in ok)
    ceiling = simulate(accesses(records), [TierSpec(math.inf, LRU())]).token_hit_ratio
    rep.add(
        "hit_ratio.tokens",
        sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "ratio",
        ceiling,
        limit_name="infinite cache (simulated)",
        **common,
    )
    by_tier: dict[str, int] = {}
    for o in ok:
        reused = sum(o.sources.values())
        for source, blocks in o.sources.items():  # cached tokens apportioned to the tiers they came from
            tier = source.rsplit(":", 1)[-1]
            by_tier[tier] = by_tier.get(tier, 0) + (o.cached_tokens * blocks // reused if reused else 0)
    for tier, tokens in sorted(by_tier.items()):
        rep.add(
            f"hit_ratio.tokens.{tier}",
            tokens / prompt if prompt else 0.0,
            "ratio",
            ceiling,
            limit_name="infinite cache (simulated)",
            **common,
        )


def _pull_figures(rep: Report, ok: list[Outcome], common: dict) -> None:
    pulled = {"memory": 0, "disk": 0}  # blocks loaded from nodes, by where the node read them
    for o in ok:
        for source, blocks in o.sources.items():
            if ":" in source:
                pulled["memory" if source.rsplit(":", 1)[-1] in MEMORY_TIERS else "disk"] += blocks
    if sum(pulled.values()):  # what prefetching (serving.prefetch) moves up: the share read from memory
        rep.add(
            "load.from_memory",
            pulled["memory"] / sum(pulled.values()),
            "ratio",
            1.0,
            limit_name="every pulled block from memory",
            **common,
            **{f"{k}_blocks": v for k, v in pulled.items()},
        )
        # ... and what it takes off the prefill: the share already in the worker when its prefill began
        rep.add(
            "load.prefetched",
            sum(o.prefetched_blocks for o in ok) / sum(pulled.values()),
            "ratio",
            1.0,
            limit_name="every pulled block before its prefill",
            **common,
        )


def _counter_figures(rep: Report, run: ReplayRun, records: list[TraceRecord], common: dict) -> None:
    from tiercake.analysis.trace_stats import trace_stats

    if run.cluster_before is not None and run.cluster_after is not None:
        cluster_figures(run.cluster_before, run.cluster_after, rep, **common)
        was, now = run.cluster_before.reuse, run.cluster_after.reuse
        if was and now and now["reaccesses"] > was["reaccesses"]:
            live = (now["prefetchable_share"] * now["reaccesses"] - was["prefetchable_share"] * was["reaccesses"]) / (
                now["reaccesses"] - was["reaccesses"]
            )
            rep.add(
                "prefetchable_share.live",
                live,
                "ratio",
                trace_stats(records).prefetchable_share,
                limit_name="the trace's own, measured offline",
                **common,
            )


def plot(outcomes: list[Outcome], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outcomes if o.status == "ok"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    shade = [o.cached_tokens / o.prompt_tokens if o.prompt_tokens else 0 for o in ok]
    points = left.scatter(
        [o.sent_at for o in ok], [o.ttft_s for o in ok], c=shade, cmap="viridis", s=12, vmin=0, vmax=1
    )
    fig.colorbar(points, ax=left, label="cached share of the prompt")
    left.set_xlabel("arrival (s)")
    left.set_ylabel("TTFT (s)")
    left.set_title("time to first token")
    for label, values in (
        ("all", [o.ttft_s for o in ok]),
        ("nothing cached", [o.ttft_s for o in ok if o.cached_tokens == 0]),
    ):
        if values:
            values = sorted(values)
            right.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    right.set_xlabel("TTFT (s)")
    right.set_ylabel("share of requests")
    right.set_title("TTFT distribution")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
