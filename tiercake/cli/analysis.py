"""The analysis commands of the CLI: the policies (list, evaluation), trace generation and statistics,
the cluster simulator, and replaying a trace against a running cluster. Each prints tables, writes a PNG where a
picture helps, and takes --json PATH (the benchmark JSON format)."""

from __future__ import annotations

import argparse
import asyncio
import json

from .common import console, progress_bar, write_json


def cmd_policy_eval(args: argparse.Namespace) -> int:
    import json
    import math
    from pathlib import Path

    from rich.table import Table

    from tiercake.analysis.cache_sim import Access, session_stream
    from tiercake.analysis.evaluate import evaluate, parse_capacities, plot
    from tiercake.bench.report import Report, machine
    from tiercake.traces import infer_sessions, read_trace

    capacities = parse_capacities(args.capacity)
    params = json.loads(args.params) if args.params else None
    with console.status(f"reading {args.trace}..."):
        records = read_trace(args.trace, args.limit)
        if args.sessions != "none":  # sessions the trace lacks are inferred; blind policies ignore the events
            records = infer_sessions(records)
        stream = session_stream(records, args.sessions)
    blocks = sum(isinstance(a, Access) for a in stream)
    with progress_bar("policies") as update:  # a slow policy once ran minutes unseen; update(done, total, running)
        scores = evaluate(stream, args.policy, capacities, params, args.admission, progress=update)
    table = Table(title=f"{args.policy} on {Path(args.trace).name} ({blocks} block accesses)")
    for column in ("capacity", args.policy, "lru", "optimum", "gap to optimum", "accesses/s"):
        table.add_column(column, justify="right")
    report = Report(bench="policy-eval", machine=machine())
    for cap in capacities:
        row = {s.policy: s for s in scores if s.capacity == cap}
        mine, best = row[args.policy], row["optimum"]
        table.add_row(
            "inf" if math.isinf(cap) else f"{cap:,}",
            f"{mine.hit_ratio:.4f}",
            f"{row['lru'].hit_ratio:.4f}",
            f"{best.hit_ratio:.4f}",
            f"{best.hit_ratio - mine.hit_ratio:.4f}",
            f"{mine.accesses_per_s:,.0f}",
        )
        for s in row.values():
            figure = report.add(
                f"hit_ratio.{s.policy}",
                s.hit_ratio,
                "ratio",
                best.hit_ratio,
                capacity="inf" if math.isinf(cap) else cap,
                limit_name="optimum",
                token_hit_ratio=round(s.token_hit_ratio, 5),
                accesses_per_s=round(s.accesses_per_s),
            )
            figure.params["trace"] = Path(args.trace).name
            if s.policy == args.policy:
                figure.params["sessions"] = args.sessions
    console.print(table)
    plot_path = args.plot or f"policy-eval-{args.policy.replace(':', '-').replace('/', '-')}.png"
    plot(scores, plot_path, f"{args.policy} vs LRU and the optimum on {Path(args.trace).name}")
    console.print(f"plot: {plot_path}")
    return write_json(args, report)


def cmd_trace_generate(args: argparse.Namespace) -> int:
    from tiercake.agent_traces import AgentShape, agentic_trace
    from tiercake.traces import synthetic_trace, write_trace

    if args.agentic:
        shape = AgentShape(
            sessions=args.sessions,
            tenants=args.tenants,
            system_prompts=args.system_prompts,
            seed=args.seed,
            announce_share=args.announce_share,
            announce_sigma=args.announce_sigma,
            announce_bias=args.announce_bias,
            abandon_p=args.abandon,
            compact_p=args.compact,
        )
        records = agentic_trace(shape)
    else:
        records = synthetic_trace(
            args.requests,
            tenants=args.tenants,
            system_prompts=args.system_prompts,
            rate_per_s=args.rate,
            bursty=args.bursty,
            seed=args.seed,
        )
    write_trace(args.out, records)
    console.print(
        f"wrote {len(records)} requests ({sum(len(r.hash_ids) for r in records)} block accesses, "
        f"{records[-1].timestamp / 1000:.0f} s) to {args.out}"
    )
    return 0


def cmd_trace_sessions(args: argparse.Namespace) -> int:
    from collections import Counter

    from tiercake.traces import infer_sessions, read_trace, write_trace

    records = infer_sessions(read_trace(args.trace, args.limit), args.min_blocks)
    write_trace(args.out, records)
    turns = Counter(Counter((r.tenant, r.session) for r in records).values())
    sessions = sum(turns.values())
    forks = len({(r.tenant, r.session) for r in records if r.fork_of})
    console.print(
        f"wrote {len(records)} requests in {sessions} sessions ({forks} forked; "
        f"{turns[1]} of one turn, the longest {max(turns)} turns) to {args.out}"
    )
    return 0


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.table import Table

    from tiercake.analysis.cache_sim import accesses
    from tiercake.analysis.evaluate import parse_capacities
    from tiercake.analysis.trace_stats import histogram, residency, trace_stats
    from tiercake.bench.report import Report, machine
    from tiercake.policies import create_eviction
    from tiercake.traces import read_trace

    records = read_trace(args.trace, args.limit)
    (capacity,) = parse_capacities(args.capacity)
    with console.status("measuring..."):
        stats = trace_stats(records, args.lead)
        stream = accesses(records)
        times = [r.timestamp / 1000 for r in records for _ in r.hash_ids]
        stays = residency(stream, capacity, create_eviction(args.policy), times)
    finite = [d for d in stats.reuse_distances if d != float("inf")]
    sections = {
        "reuse distance (distinct blocks between uses)": histogram(finite, [0, 10, 100, 1_000, 10_000, 100_000]),
        "reuse time (s)": histogram(stats.reuse_times_s, [0, 1, 10, 60, 600, 1800]),
        f"residency under {args.policy} at {args.capacity} blocks (s)": histogram(stays, [0, 1, 10, 60, 600, 1800]),
    }
    for title, counts in sections.items():
        table = Table(title=title)
        table.add_column("bucket")
        table.add_column("count", justify="right")
        for bucket, count in counts.items():
            table.add_row(bucket, f"{count:,}")
        console.print(table)
    console.print(
        f"{stats.accesses:,} block accesses, {stats.reaccesses:,} re-accesses; prefetchable "
        f"(follow-up turns announced at least {args.lead:g} s ahead): {stats.prefetchable_share:.1%}"
    )
    report = Report(bench="trace-stats", machine=machine())
    common = {"trace": Path(args.trace).name}
    report.add("prefetchable_share", stats.prefetchable_share, "ratio", 1.0, lead_s=args.lead, **common)
    report.add(
        "lru_hit_ratio.from_stack_distance",
        stats.lru_hit_ratio(capacity),
        "ratio",
        stats.reaccesses / stats.accesses,
        capacity=args.capacity,
        limit_name="infinite cache",
        **common,
    )
    for title, counts in sections.items():
        for bucket, count in counts.items():
            report.add(
                f"histogram.{title.split(' (')[0].split(' under')[0].replace(' ', '_')}",
                count,
                "count",
                max(1, sum(counts.values())),
                bucket=bucket,
                **common,
            )
    plot_path = args.plot or "trace-stats.png"
    _plot_cdfs(
        {
            "reuse distance (blocks)": finite,
            "reuse time (s)": stats.reuse_times_s,
            f"residency, {args.policy} @ {args.capacity} (s)": stays,
        },
        plot_path,
        Path(args.trace).name,
    )
    console.print(f"plot: {plot_path}")
    return write_json(args, report)


def _plot_cdfs(series: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.8))
    for ax, (label, values) in zip(axes, series.items()):
        values = sorted(values)
        if values:  # zeros count too (a block reused at once): a log scale would drop them, symlog keeps them
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
            if values[0] <= 0:
                ax.set_xscale("symlog", linthresh=1)
            else:
                ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("share")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    import math
    from pathlib import Path

    from tiercake.analysis.cluster_sim import ABLATION, ClusterSpec, plot, simulate_cluster
    from tiercake.analysis.evaluate import parse_capacities
    from tiercake.bench.report import Report, machine
    from tiercake.traces import read_trace

    records = read_trace(args.trace, args.limit)
    (local,) = parse_capacities(args.local_blocks)
    (pool,) = parse_capacities(args.global_blocks)
    spec = ClusterSpec(
        prefill_workers=args.prefill,
        decode_workers=args.decode,
        local_blocks=local,
        global_blocks=pool,
        slo_ttft_s=args.slo_ttft,
        slo_tbt_s=args.slo_tbt,
        time_scale=args.time_scale,
        fit_noise=args.fit_noise,
    )
    router_params = json.loads(args.router_params) if args.router_params else {}
    runs = (
        {name: (router, params, with_pool) for name, (router, params, with_pool) in ABLATION.items()}
        if args.ablation
        else {args.router: (args.router, router_params, pool > 0)}
    )
    compute_only = sum(spec.prefill.seconds(r.input_length) for r in records) / len(records)
    report = Report(bench="simulate", machine=machine())
    table, phases = _simulate_tables(
        f"{Path(args.trace).name}: {len(records)} requests, {args.prefill} prefill / {args.decode} "
        f"decode workers, local {args.local_blocks} blocks, global {args.global_blocks}"
    )
    results = {}
    with progress_bar(f"simulating {len(records)} requests", len(records) * len(runs)) as update:
        for i, (name, (router, params, with_pool)) in enumerate(runs.items()):
            run = ClusterSpec(**{**spec.__dict__, "global_blocks": pool if with_pool else 0})

            def progress(done: int, base: int = i * len(records), name: str = name) -> None:
                update(base + done, description=name)

            results[name] = simulate_cluster(
                records,
                run,
                router,
                params,
                progress=progress,
            )
    for name in runs:
        summary = results[name].summary()
        _simulate_rows(table, phases, name, summary)
        report.add(
            f"ttft_mean.{name}",
            summary["ttft_mean_s"],
            "s",
            compute_only,
            limit_name="compute only, no queue",
            router=router,
            **{k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v) for k, v in summary.items()},
        )
    console.print(table)
    console.print(phases)
    plot_path = args.plot or "simulate.png"
    plot(results, plot_path, table.title)
    console.print(f"plot: {plot_path}")
    return write_json(args, report)


PHASES = ("queue", "lookup", "load_pool", "compute")


def _simulate_tables(title: str):
    """(the summary table, the TTFT-by-phase table) of ``tiercake simulate``."""
    from rich.table import Table

    table = Table(title=title)
    columns = ("scheduler", "TTFT mean", "P50", "P99", "TBT P99", "SLO met", "rejected", "hit ratio", "local / global")
    for column in (*columns, "moved"):
        table.add_column(column, justify="left" if column == "scheduler" else "right")
    phases = Table(title="TTFT by phase, P50 / P99 (s)")
    for column in ("scheduler", *PHASES):
        phases.add_column(column, justify="left" if column == "scheduler" else "right")
    return table, phases


def _simulate_rows(table, phases, name: str, summary: dict) -> None:
    phases.add_row(name, *(f"{summary[f'{p}_p50_s']:.3g} / {summary[f'{p}_p99_s']:.3g}" for p in PHASES))
    table.add_row(
        name,
        f"{summary['ttft_mean_s']:.2f} s",
        f"{summary['ttft_p50_s']:.2f}",
        f"{summary['ttft_p99_s']:.2f}",
        f"{summary['tbt_p99_s'] * 1000:.0f} ms",
        f"{summary['slo_attainment']:.1%}",
        str(summary["rejected"]),
        f"{summary['hit_ratio']:.3f}",
        f"{summary['local_hit_ratio']:.3f} / {summary['global_hit_ratio']:.3f}",
        f"{summary['bytes_moved'] / 1e12:.2f} TB",
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tiercake import replay as rp
    from tiercake.traces import infer_sessions, read_trace

    records = read_trace(args.trace, args.limit)
    if not records:
        raise ValueError(f"{args.trace}: no requests")
    if args.sessions:
        records = infer_sessions(records)  # a trace's own sessions are kept
    with progress_bar(f"replaying {len(records)} requests", len(records)) as update:
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            update(done)

        run = asyncio.run(
            rp.replay(
                records,
                args.target,
                time_scale=args.time_scale,
                tokens_per_block=args.tokens_per_block,
                max_output=args.max_output,
                concurrency=args.concurrency,
                api_key=args.api_key,
                control=args.control,
                control_token=args.control_token,
                progress=advance,
                sessions=args.sessions,
            )
        )
    if run.cluster_before is None:
        console.print(
            f"note: no cluster view at {args.control or args.target}/v1/cluster (give --control and "
            "--control-token): metadata and prefetchability figures left out"
        )
    report = rp.report(
        run, records, Path(args.trace).name, time_scale=args.time_scale, tokens_per_block=args.tokens_per_block
    )
    report.print(console)
    plot_path = args.plot or "replay.png"
    rp.plot(run.outcomes, plot_path, f"{Path(args.trace).name} on {args.target}")
    console.print(f"plot: {plot_path}")
    return write_json(args, report)


def cmd_policy_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tiercake.policies import available, resolve

    table = Table(title="policies (by name; any module:Class path works too)")
    table.add_column("name")
    table.add_column("kind")
    table.add_column("what it does")
    for name, kind in sorted(available().items(), key=lambda x: (x[1], x[0])):
        doc = (resolve(name, kind.split(", ")[0]).__doc__ or "").strip().splitlines()
        table.add_row(name, kind, doc[0] if doc else "")
    console.print(table)
    return 0


def register(sub) -> None:
    """``policy``, ``replay``, ``simulate`` and ``trace``."""
    for parser_of in (_policy, _replay, _simulate, _trace):
        parser_of(sub)


def _policy(sub) -> None:
    """``tiercake policy list`` and ``policy eval``."""
    policy = sub.add_parser("policy", help="eviction, admission, placement, replication and routing policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    plist = policy_sub.add_parser("list", help="the policies that resolve by name, built-in and plug-in")
    plist.set_defaults(func=cmd_policy_list)
    peval = policy_sub.add_parser(
        "eval",
        help="score an eviction policy on a trace against LRU and the offline optimum",
        description="Replay a trace in the Mooncake format through POLICY (a built-in name, an entry point or "
        "module:Class), LRU and the tree-constrained Belady optimum at each capacity; print a table, write a "
        "PNG plot of hit ratio against capacity, and --json the figures in the benchmark format.",
    )
    peval.add_argument("policy", help="an eviction policy: a built-in name, an entry point or module:Class")
    peval.add_argument("--trace", required=True, metavar="FILE", help="a trace in the Mooncake format")
    peval.add_argument("--capacity", required=True, metavar="N[,N...]", help="blocks, e.g. 1000,10k,100k,inf")
    peval.add_argument("--params", metavar="JSON", help="the policy's parameters as a JSON object")
    peval.add_argument("--admission", default="always", help="admission policy in front of it (default always)")
    peval.add_argument("--limit", type=int, help="only the first N requests of the trace")
    peval.add_argument(
        "--sessions",
        default="none",
        choices=["none", "open", "close", "announced", "oracle"],
        help="what the policy is told of sessions (inferred where the trace has none): nothing (default), that "
        "they exist, also when they close, also each turn's announced pause (closes and pauses as the trace "
        "carries them); oracle: every pause and close read from the trace's future, an upper bound",
    )
    peval.add_argument("--plot", metavar="PATH", help="the PNG (default policy-eval-<policy>.png)")
    peval.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    peval.set_defaults(func=cmd_policy_eval)


def _replay(sub) -> None:
    """``tiercake replay``."""
    rep = sub.add_parser(
        "replay",
        help="drive a running cluster with a trace; report TTFT and hit ratio",
        description="Send the trace's requests to a cluster (tiercake up) at their timestamps, scaled by "
        "--time-scale; each 512-token trace block becomes --tokens-per-block tokens derived from its hash id, "
        "so reuse in the trace is reuse in the cluster. Prints a table, writes a PNG and --json.",
    )
    rep.add_argument("trace", help="a trace file in Mooncake's format (JSON lines)")
    rep.add_argument(
        "--target",
        default="http://127.0.0.1:8080",
        help="the cluster's OpenAI-compatible API (default http://127.0.0.1:8080)",
    )
    rep.add_argument("--time-scale", type=float, default=1.0, help="0.1: ten times faster (default 1)")
    rep.add_argument("--limit", type=int, help="only the first N requests")
    rep.add_argument("--tokens-per-block", type=int, default=16, help="tokens per trace block (default 16)")
    rep.add_argument("--max-output", type=int, default=32, help="cap on generated tokens per request")
    rep.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    rep.add_argument("--api-key", help="an API key of the cluster (serving.api_keys)")
    rep.add_argument(
        "--control",
        metavar="URL",
        help="the control API, for the cluster's own counters (default: --target, where both APIs share a port)",
    )
    rep.add_argument("--control-token", help="a control API token (default: --api-key)")
    rep.add_argument(
        "--sessions",
        action="store_true",
        help="send each request's session as the front's session headers (inferred where the trace has none), "
        "with the pause and close the trace announces; TTFT of resumed turns reported apart",
    )
    rep.add_argument("--plot", metavar="PATH", help="the PNG (default replay.png)")
    rep.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    rep.set_defaults(func=cmd_replay)


def _simulate(sub) -> None:
    """``tiercake simulate``."""
    sim = sub.add_parser(
        "simulate",
        help="simulate a cluster on a trace: routers, local and global caches, SLOs",
        description="A discrete-event simulation of prefill and decode workers with per-worker caches and an "
        "optional global pool, routed by the live router code. --ablation runs Mooncake's four schedulers "
        "(random, load balancing, local cache-aware, global cache-aware) on the same trace.",
    )
    sim.add_argument("trace", help="a trace file in Mooncake's format (JSON lines)")
    sim.add_argument("--router", default="ttft", help="routing policy (default ttft)")
    sim.add_argument("--router-params", metavar="JSON", help="its parameters, e.g. '{\"margin\": 0}'")
    sim.add_argument(
        "--fit-noise",
        type=float,
        default=0.0,
        metavar="F",
        help="each prefill worker's timings as "
        "the router sees them are off by a factor drawn once from [1-F, 1+F] (live workers fit their own)",
    )
    sim.add_argument("--ablation", action="store_true", help="the four schedulers of Mooncake's ablation")
    sim.add_argument("--prefill", type=int, default=8, help="prefill workers (default 8)")
    sim.add_argument("--decode", type=int, default=8, help="decode workers (default 8)")
    sim.add_argument("--local-blocks", default="2000", help="each prefill worker's cache (blocks)")
    sim.add_argument("--global-blocks", default="inf", help="the shared pool (blocks; 0: none)")
    sim.add_argument("--slo-ttft", type=float, help="seconds; predicted over it: rejected")
    sim.add_argument("--slo-tbt", type=float, help="seconds")
    sim.add_argument("--time-scale", type=float, default=1.0, help="arrival times are multiplied by it")
    sim.add_argument("--limit", type=int, help="only the first N requests")
    sim.add_argument(
        "--plot", metavar="PATH", help="the PNG: TTFT CDFs, SLO attainment and hit ratios (default simulate.png)"
    )
    sim.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    sim.set_defaults(func=cmd_simulate)


def _trace(sub) -> None:
    """``tiercake trace generate``, ``trace sessions`` and ``trace stats``."""
    trace = sub.add_parser("trace", help="traces in the Mooncake format")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    generate = trace_sub.add_parser(
        "generate",
        help="write a seeded synthetic trace: sessions, shared system prompts, tenants",
        description="Multi-turn sessions whose prompts grow turn by turn, system prompts shared within a "
        "tenant, several tenants, Poisson or bursty arrivals; the same seed gives the same file.",
    )
    generate.add_argument("--out", required=True, metavar="FILE", help="the trace file to write")
    generate.add_argument("--requests", type=int, default=1000, help="how many requests (default 1000)")
    generate.add_argument("--tenants", type=int, default=2, help="how many tenants (default 2)")
    generate.add_argument("--system-prompts", type=int, default=4, help="per tenant")
    generate.add_argument("--rate", type=float, default=2.0, help="requests per second (mean)")
    generate.add_argument("--bursty", action="store_true", help="alternate busy and quiet periods")
    generate.add_argument(
        "--agentic",
        action="store_true",
        help="agents with tool pauses (announced), human chats and subagent fans, sessions marked",
    )
    generate.add_argument("--sessions", type=int, default=200, help="with --agentic: how many sessions (default 200)")
    honest = generate.add_argument_group("with --agentic: how honest the clients are")
    honest.add_argument(
        "--announce-share", type=float, default=1.0, help="of agents' tool pauses, the share announced (default 1)"
    )
    honest.add_argument(
        "--announce-sigma",
        type=float,
        default=0.3,
        help="log-normal error on each announced pause (default 0.3; 0.69: a factor of two)",
    )
    honest.add_argument(
        "--announce-bias", type=float, default=1.0, help="each announced pause times this (default 1; 0.5: says half)"
    )
    honest.add_argument(
        "--abandon", type=float, default=0.0, help="share of sessions that end without a close (default 0)"
    )
    honest.add_argument(
        "--compact", type=float, default=0.0, help="per turn of a long conversation: chance its context is compacted"
    )
    generate.add_argument("--seed", type=int, default=0, help="the same seed writes the same file (default 0)")
    generate.set_defaults(func=cmd_trace_generate)
    tsessions = trace_sub.add_parser(
        "sessions",
        help="infer sessions in a trace without them: a turn extends its conversation's whole prompt",
        description="Writes the trace with session, turn and fork_of on every request, from what came before it "
        "only: a request whose full blocks extend a previous request's whole prompt continues that session (the "
        "first to do so; later ones fork from it). Pauses and closes are left as the trace carries them.",
    )
    tsessions.add_argument("trace", help="a trace file in Mooncake's format (JSON lines)")
    tsessions.add_argument("--out", required=True, metavar="FILE", help="the trace file to write")
    tsessions.add_argument(
        "--min-blocks", type=int, default=2, help="the shortest prompt (full blocks) a turn continues (default 2)"
    )
    tsessions.add_argument("--limit", type=int, help="only the first N requests")
    tsessions.set_defaults(func=cmd_trace_sessions)
    tstats = trace_sub.add_parser(
        "stats",
        help="reuse distance, reuse time, residency under a policy, prefetchability",
        description="Histograms of reuse distance (distinct blocks between two uses: LRU's stack distance), "
        "reuse time and block residency under POLICY at CAPACITY, and the share of re-accesses a system could "
        "have prefetched (follow-up turns of a conversation, announced at least --lead seconds ahead).",
    )
    tstats.add_argument("trace", help="a trace file in Mooncake's format (JSON lines)")
    tstats.add_argument("--capacity", default="10k", help="blocks, for residency (default 10k)")
    tstats.add_argument("--policy", default="lru", help="the eviction policy for residency (default lru)")
    tstats.add_argument("--lead", type=float, default=0.0, help="seconds a prefetch needs (default 0)")
    tstats.add_argument("--limit", type=int, help="only the first N requests")
    tstats.add_argument("--plot", metavar="PATH", help="the PNG (default trace-stats.png)")
    tstats.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    tstats.set_defaults(func=cmd_trace_stats)
