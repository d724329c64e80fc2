"""The `tiercake` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path

import yaml
from pydantic import ByteSize, ValidationError

from .cli_analysis import cmd_policy_eval, cmd_replay, cmd_simulate, cmd_trace_generate, cmd_trace_stats
from .cli_common import byte_size, config_problems, console, errors, policy_problems, progress_bar, write_json
from .up import SPARE_ENV, StartError
from .up_state import DataDirBusy


def _load(config_path: str | None, data_dir: str):
    from tiercake.config import default_config, load_config, with_environment

    return load_config(config_path, data_dir) if config_path else with_environment(default_config(data_dir))


def cmd_demo(args: argparse.Namespace) -> int:
    from tiercake.demo import run_demo

    asyncio.run(run_demo(_load(args.config, args.data_dir), console))
    return 0


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def _bench(args: argparse.Namespace, what: str, run) -> int:
    """Run a bench coroutine under a progress bar (figures done; the total and ETA from the last run
    of the same bench and arguments), print its table, plot and write its JSON when asked."""
    from tiercake.bench.report import ON_FIGURE

    memory = _bench_memory(args)
    expected = json.loads(memory.read_text())["figures"] if memory.is_file() else None
    with progress_bar(f"benchmarking {what}", expected) as update:
        done = 0

        def figure(name: str) -> None:
            nonlocal done
            done += 1
            update(done, max(expected or 0, done) if expected else None, f"{args.bench}: {name}")

        token = ON_FIGURE.set(figure)
        try:
            report = asyncio.run(run)
        finally:
            ON_FIGURE.reset(token)
    with contextlib.suppress(OSError):  # a read-only home: no ETA next time, nothing worse
        memory.parent.mkdir(parents=True, exist_ok=True)
        memory.write_text(json.dumps({"figures": len(report.figures)}))
    report.print(console)
    if args.plot:
        report.plot(args.plot)
        console.print(f"plot: {args.plot}")
    return write_json(args, report)


def _bench_memory(args: argparse.Namespace) -> Path:
    """Where the number of figures of this bench with these arguments is kept (for the next ETA)."""
    import hashlib
    import os

    shape = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "json", "plot")}
    digest = hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:16]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "tiercake" / "bench" / f"{args.bench}-{digest}.json"


def cmd_bench_store(args: argparse.Namespace) -> int:
    from tiercake.bench import store

    run = store.run(quick=args.quick, ssd_dir=args.ssd_dir, sizes=_ints(args.sizes))
    return _bench(args, "the store (memcpy and raw-disk limits first)", run)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from tiercake.bench import transfer

    run = transfer.run(quick=args.quick, sizes=_ints(args.sizes), batches=_ints(args.batches), streams=args.streams)
    return _bench(args, "transfers (raw socket and memcpy limits first)", run)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tiercake.bench import serve

    what = f"the cluster at {args.target}" if args.target else "a local cluster (tiercake up, started for it)"
    return _bench(
        args, f"time to first token on {what}", serve.run(quick=args.quick, target=args.target, control=args.control)
    )


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    from tiercake.bench import vllm

    return _bench(
        args,
        "vLLM with the TiercakeConnector (a conductor, a node agent and vLLM start for it)",
        vllm.run(quick=args.quick, trace=args.trace),
    )


def cmd_bench_store_api(args: argparse.Namespace) -> int:
    from tiercake.bench import store_api

    return _bench(
        args,
        "the key-value store API (a conductor, a node agent and, if installed, Mooncake start for it)",
        store_api.run(quick=args.quick, load=args.load),
    )


def cmd_bench_metadata(args: argparse.Namespace) -> int:
    from tiercake.bench import metadata

    return _bench(args, "the placement index (a local etcd starts for it)", metadata.run(quick=args.quick))


def cmd_chaos(args: argparse.Namespace) -> int:
    from tiercake import chaos

    faults = tuple(f for f in (args.faults or ",".join(chaos.FAULTS)).split(",") if f)
    unknown = [f for f in faults if f not in chaos.FAULTS]
    if unknown:
        errors.print(f"error: unknown faults {unknown}; known: {', '.join(chaos.FAULTS)}")
        return 2
    with progress_bar("chaos") as stage:  # messages print above the bar
        report = asyncio.run(
            chaos.run(quick=args.quick, faults=faults, progress=console.print, stage=stage, previous=args.previous)
        )
    report.print(console)
    write_json(args, report)
    reasons = chaos.failed(report)
    if reasons:
        errors.print(f"[red]chaos run failed:[/red] {'; '.join(reasons)}")
        return 1
    return 0


def cmd_conductor(args: argparse.Namespace) -> int:
    from tiercake.conductor.api import serve

    full = _load(args.config, args.data_dir)
    cfg = full.conductor
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        cfg.host, cfg.port = host or cfg.host, int(port)
    if args.token_file:
        cfg.token_file = args.token_file
    if args.api_listen:
        host, _, port = args.api_listen.rpartition(":")
        full.serving.host, full.serving.port = host or full.serving.host, int(port)
    if args.insecure:
        cfg.insecure = True
    if args.etcd:
        cfg.etcd = [e for e in args.etcd.split(",") if e]
    if args.ttl:
        cfg.leader_ttl = args.ttl
    asyncio.run(serve(full, conductor_id=args.id))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from tiercake.transfer import spin
    from tiercake.workers.node_agent import NodeAgent

    config = _load(args.config, args.data_dir)
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        config.transfer.host, config.transfer.port = host or config.transfer.host, int(port)
    spin.run(NodeAgent(config).serve_forever(), config.transfer.spin_us / 1e6)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from tiercake.workers.worker import Worker

    config = _load(args.config, args.data_dir)
    host, _, port = (args.listen or "127.0.0.1:0").rpartition(":")
    engine = None
    if args.engine == "vllm":
        if not args.vllm_url:
            errors.print("error: --engine vllm needs --vllm-url URL (a vLLM server with the TiercakeConnector)")
            return 2
        from tiercake.workers.vllm.engine import VllmEngine

        engine = lambda client: VllmEngine(args.vllm_url, client, wait_s=args.vllm_wait).start()  # noqa: E731
    worker = Worker(config, args.role, args.id, args.data_dir, advertise=args.advertise, engine=engine)
    asyncio.run(worker.serve_forever(host or "127.0.0.1", int(port)))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tiercake.up import up

    config = _load(args.config, args.data_dir)
    if _refused(config):
        return 2
    if args.gpu_blocks:
        config.serving.gpu_blocks = args.gpu_blocks
    if args.insecure:
        config.conductor.insecure = True
    for kind, size in (("pool", args.pool), ("ssd", args.ssd)):
        for tier in config.store.tiers:
            if size and tier.kind == kind:
                tier.capacity = ByteSize(size)
            if args.pool_path and tier.kind == "pool":
                tier.path = args.pool_path
    print_fn = lambda text: console.print(text, soft_wrap=True, markup=False, highlight=False)  # noqa: E731
    if args.engine == "vllm":
        from tiercake.up import up_vllm

        if not args.model:
            errors.print("error: --engine vllm needs --model DIR (a Hugging Face model directory)")
            return 2
        if args.vllm_prefill or args.vllm_decode:
            if not (args.vllm_prefill and args.vllm_decode):
                errors.print("error: --vllm-prefill and --vllm-decode go together (at least one of each)")
                return 2
            roles = ["prefill"] * args.vllm_prefill + ["decode"] * args.vllm_decode
        else:
            roles = ["worker"] * args.vllm
        return up_vllm(
            config,
            Path(args.data_dir),
            Path(args.model),
            roles,
            args.port,
            args.host,
            print_fn=print_fn,
            vllm_args=args.vllm_arg or [],
        )
    etcd = [e for e in (args.etcd or "").split(",") if e]
    workers = args.workers if args.workers is not None else 0
    prefill, decode = (args.prefill, args.decode) if not workers else (0, 0)
    node_netns = None
    if args.node_netns:
        namespace, _, address = args.node_netns.partition(":")
        if not namespace or not address:
            errors.print("error: --node-netns takes NAMESPACE:ADDRESS")
            return 2
        node_netns = (namespace, address)
    return up(
        config,
        Path(args.data_dir),
        args.host,
        args.port,
        prefill,
        decode,
        workers,
        etcd,
        print_fn=print_fn,
        control_port=args.control_port,
        node_netns=node_netns,
    )


def cmd_ask(args: argparse.Namespace) -> int:
    import time

    from tiercake.conductor.client import Client, ConductorError

    async def ask() -> None:
        async with Client([args.url], token=args.api_key, timeout=120, retries=3) as client:
            model = args.model or (await client.models())[0]["id"]  # the model the cluster serves
            started = time.perf_counter()
            first = None
            text, usage = [], {}
            async for chunk in client.stream_completion(
                args.prompt, model=model, max_tokens=args.max_tokens, temperature=args.temperature, tenant=args.tenant
            ):
                if chunk.get("choices"):
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(chunk["choices"][0]["text"])
                    console.print(chunk["choices"][0]["text"], end="", markup=False, highlight=False)
                if chunk.get("usage"):
                    usage = chunk["usage"]
            total = time.perf_counter() - started
            console.print()
            generated = usage.get("completion_tokens", len(text))
            rate = (generated - 1) / (total - first) if first is not None and total > first and generated > 1 else 0
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            extra = usage.get("tiercake", {})
            console.print(
                f"[dim]TTFT {first or 0:.3f} s · {rate:.1f} tokens/s · {generated} tokens · "
                f"cached prompt tokens {cached}/{usage.get('prompt_tokens', '?')} · "
                f"sources {extra.get('sources', {})}[/dim]"
            )

    try:
        asyncio.run(ask())
    except ConductorError as exc:
        errors.print(f"error: {args.url} answered {exc}", markup=False, highlight=False)
        return 1
    return 0


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


def cmd_model_make(args: argparse.Namespace) -> int:
    from tiercake.workers.vllm.tiny_model import make_tiny_llama

    print(make_tiny_llama(args.dir, seed=args.seed))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    config = _load(args.config, args.data_dir)
    if _refused(config):
        return 2
    print(yaml.safe_dump(_readable(config), sort_keys=False), end="")
    return 0


def _refused(config) -> bool:
    """Print every name in ``config`` that resolves to nothing; whether there was one."""
    problems = policy_problems(config)
    for line in problems:
        errors.print(line, markup=False, highlight=False)
    return bool(problems)


def _readable(value):
    """A config for people: sizes with their unit (16MiB, as a config may give them), everything else
    as its JSON form."""
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    if isinstance(value, BaseModel):
        return {name: _readable(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, ByteSize):
        return value.human_readable(separator="").replace(".0", "") if value >= 1024 else int(value)
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_readable(v) for v in value]
    return to_jsonable_python(value)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiercake")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercake",
        description="Hybrid-tier KV-cache orchestration for LLM serving: GPU, node-pool and SSD tiers under "
        "pluggable policies, a conductor that routes requests by predicted time to first token, and the tools "
        "to measure why it is fast (benchmarks, trace replay, simulators). Start with: tiercake up",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the store does")
    parser.add_argument("--version", action="version", version=f"tiercake {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="PATH", help="YAML, JSON or TOML config (default: the embedded default)")
        p.add_argument("--data-dir", default=".tiercake", metavar="DIR", help="where the default config keeps SSD data")

    demo = sub.add_parser(
        "demo",
        help="run the store on the embedded default and show what it did",
        description="Compute KV with the reference model for prompts that share a prefix, store it in "
        "the tiers, reuse it, and restart onto the SSD tier. Runs twice in a row to see the restart.",
    )
    with_config(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks, each as a ratio to a limit measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def bench_parser(name: str, **kwargs) -> argparse.ArgumentParser:
        """A bench command: every bench takes --quick and --json."""
        p = bench_sub.add_parser(name, **kwargs)
        p.add_argument("--quick", action="store_true", help="a short run (under 30 s)")
        p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
        p.add_argument("--plot", metavar="PATH", help="a PNG of each figure's ratio to its limit")
        return p

    store = bench_parser(
        "store",
        help="put/get throughput per tier vs memcpy and raw disk; zstd on real KV",
        description="Put and get throughput of the gpu (on this device), pool and ssd tiers for blocks "
        "of 64 KiB to 16 MiB, each as a ratio to memcpy or raw sequential file I/O measured in the same run.",
    )
    store.add_argument("--ssd-dir", metavar="DIR", help="file system to test the ssd tier on (default: temp dir)")
    store.add_argument("--sizes", metavar="BYTES,...", help="block sizes in bytes (default: 64 KiB to 16 MiB)")
    store.set_defaults(func=cmd_bench_store)

    transfer = bench_parser(
        "transfer",
        help="transfer engine between two processes vs raw socket and memcpy",
        description="Read and write batches of blocks between this process and a node agent in another "
        "process, over TCP and through the shared pool, each as a ratio to a plain blocking-socket stream "
        "or memcpy of the same bytes measured in the same run.",
    )
    transfer.add_argument("--sizes", metavar="BYTES,...", help="block sizes (default: 64 KiB to 64 MiB)")
    transfer.add_argument("--batches", metavar="N,...", help="batch sizes (default: 1, 4, 16, 64)")
    transfer.add_argument("--streams", type=int, default=2, help="connections per peer (default 2)")
    transfer.set_defaults(func=cmd_bench_transfer)

    store_api = bench_parser(
        "store-api",
        help="the key-value store API vs a raw socket and Mooncake Store",
        description="put_from/get_into one object at a time and in batches at 64 KiB, 1 MiB and 16 MiB between "
        "this process and a node agent (over TCP and the shared pool), each as a ratio to a raw socket stream of "
        "the same bytes measured in the same run, and, where Mooncake's package is installed, the same calls on "
        "Mooncake Store in the same run, repetitions interleaved (vs_mooncake: tiercake over Mooncake).",
    )
    store_api.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="N processes spinning on the CPU while it measures (a busy machine; default 0)",
    )
    store_api.set_defaults(func=cmd_bench_store_api)

    meta = bench_parser(
        "metadata",
        help="placement index lookups and durable commits vs dict probes and raw etcd",
        description="Lookups of 64-block chains in an index of 1M blocks against the same dictionary probes, "
        "and placements made durable in a local etcd (started from the installed binary) through group "
        "commit against raw batched etcd transactions of the same operations; metadata bytes per block.",
    )
    meta.set_defaults(func=cmd_bench_metadata)

    serve = bench_parser(
        "serve",
        help="TTFT with 0/50/90%% of the prompt cached, per source tier, vs compute only",
        description="Time to first token for prompts whose prefix is cached in the prefill worker's gpu tier, "
        "the node pool or the node's SSD, beside the same prompt with nothing cached, measured in the same run, "
        "with the server's breakdown (routing, lookup, load, compute). Starts its own cluster unless --target.",
    )
    serve.add_argument("--target", metavar="URL", help="a running cluster's OpenAI-compatible API (default: start one)")
    serve.add_argument(
        "--control",
        metavar="URL",
        help="that cluster's control API, with the token in "
        "$TIERCAKE_TOKEN (default: --target, where both share a port)",
    )
    serve.set_defaults(func=cmd_bench_serve)

    vllm_bench = bench_parser(
        "vllm",
        help="TTFT on vLLM with 50/90%% of the prompt held in tiercake vs recomputed; load vs memcpy",
        description="Starts a conductor, a node agent and a vLLM server with the TiercakeConnector (a locally "
        "made Llama). Time to first token of prompts whose first 50% or 90% of blocks are held in tiercake's "
        "pool (vLLM's own prefix cache reset), against the same prompts recomputed in the same run; the "
        "connector's load throughput into vLLM's paged KV against memcpy. With --trace, routing across two "
        "vLLM servers behind tiercake's front: the share of prompt tokens their own prefix caches serve under "
        "each router, against the offline bound. --quick takes about a minute (more with --trace): vLLM "
        "itself starts in 30-40 s here.",
    )
    vllm_bench.add_argument(
        "--trace",
        metavar="FILE",
        help="a conversation trace (Mooncake's format): also "
        "measure routing across two vLLM servers on its first 300 requests (600 without --quick)",
    )
    vllm_bench.set_defaults(func=cmd_bench_vllm)

    chaos_parser = sub.add_parser(
        "chaos",
        help="fault injection under load: kills, stalls, corrupt SSD blocks, etcd leader loss, a rolling restart",
        description="Starts its own cluster (tiercake up, on a 3-member etcd when etcd is installed), replays a "
        "synthetic trace against it with greedy decoding beside a key-value workload, and injects faults one after "
        "another; every answer is checked against a recompute from scratch, every placement the index lists at the "
        "end is read back, every key's history is checked for linearizability. Figures: requests ok / wrong, "
        "placements lost, objects lost, histories not linearizable, throughput and hit ratio during lasting "
        "faults, recovery time per fault against the cluster's cold start. Exits 1 on any wrong answer, lost "
        "placement or object, unexplained history or fault not recovered from. --quick takes about three minutes; "
        "--faults with an unknown name lists the faults.",
    )
    chaos_parser.add_argument("--quick", action="store_true", help="a short run (CI runs it)")
    chaos_parser.add_argument("--faults", metavar="F,...", help="which faults, in order (default: all)")
    chaos_parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    chaos_parser.add_argument(
        "--previous",
        metavar="DIR",
        type=Path,
        help="the previous release, installed in DIR (pip install --no-deps --target DIR "
        "tiercake==X): the upgrade fault runs a node agent of it beside this one",
    )
    chaos_parser.set_defaults(func=cmd_chaos)

    conductor = sub.add_parser(
        "conductor",
        help="run a conductor: placement index, membership and election behind an HTTP API",
        description="Serve the control API on --listen. With --etcd, the state lives in etcd and several "
        "conductors elect one leader (followers serve lookups and point writers at the leader); without it, "
        "an embedded in-process backend. Prints its id and URL as JSON, then runs until SIGINT or SIGTERM.",
    )
    with_config(conductor)
    conductor.add_argument(
        "--etcd", metavar="HOST:PORT,...", help="etcd endpoints (default: conductor.etcd; none: embedded backend)"
    )
    conductor.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="the control API's address, port 0: any (default: conductor.host and conductor.port)",
    )
    conductor.add_argument(
        "--api-listen",
        metavar="HOST:PORT",
        help="the OpenAI-compatible API's address, port 0: any (default: serving.host and serving.port, 8080)",
    )
    conductor.add_argument(
        "--insecure",
        action="store_true",
        help="serve the control API without a token (refused otherwise when none is configured)",
    )
    conductor.add_argument(
        "--token-file", metavar="PATH", help="bearer tokens, whitespace-separated (also read from $TIERCAKE_TOKEN)"
    )
    conductor.add_argument("--ttl", type=int, help="leader lease TTL in seconds (default: conductor.leader_ttl)")
    conductor.add_argument("--id", help="conductor id (default: random)")
    conductor.set_defaults(func=cmd_conductor)

    node = sub.add_parser(
        "node",
        help="run a node agent: the node's tiers behind a transfer server",
        description="Open the store of the config (rebuilding the SSD index), serve it to peers that know "
        "the cluster secret ($TIERCAKE_SECRET or transfer.secret_file), print the address as JSON, and run "
        "until SIGINT or SIGTERM.",
    )
    with_config(node)
    node.add_argument("--listen", metavar="HOST:PORT", help="override transfer.host and transfer.port")
    node.set_defaults(func=cmd_node)

    worker = sub.add_parser(
        "worker",
        help="run a prefill, decode or combined worker: the model over its own gpu tier, or a vLLM server",
        description="Load the reference model (or stand for a vLLM server: --engine vllm), fit its timings "
        "(persisted in --data-dir), register with the conductor (conductor.urls) and serve /generate for the "
        "front. Prints its id and URL as JSON.",
    )
    with_config(worker)
    worker.add_argument(
        "--role",
        choices=["prefill", "decode", "worker"],
        default="worker",
        help="prefill, decode, or both (worker; the default)",
    )
    worker.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: tiercake's model; vllm: stand for the vLLM server at --vllm-url",
    )
    worker.add_argument(
        "--vllm-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="--engine vllm: wait this long for the vLLM server to answer at start (default 0)",
    )
    worker.add_argument(
        "--vllm-url",
        metavar="URL",
        help="--engine vllm: the vLLM OpenAI server (started with "
        "the TiercakeConnector) this worker sends its requests to",
    )
    worker.add_argument("--listen", metavar="HOST:PORT", help="its HTTP API (default 127.0.0.1, any port)")
    worker.add_argument("--id", help="worker id (default: <node_id>-<role>)")
    worker.add_argument(
        "--advertise",
        metavar="HOST",
        help="the address the front reaches it at (default: $TIERCAKE_ADVERTISE_HOST, else the listen address)",
    )
    worker.set_defaults(func=cmd_worker)

    upp = sub.add_parser(
        "up",
        help="start a local cluster: conductor, node agent, prefill and decode workers",
        description="One command for a whole cluster on this machine (embedded metadata unless --etcd). "
        "Prints where it listens and how to send a request; Ctrl-C stops everything.",
    )
    with_config(upp)
    upp.add_argument("--port", type=int, default=8080, help="the OpenAI-compatible API's port (default 8080)")
    upp.add_argument(
        "--control-port",
        type=int,
        help="the control API's port (default: --port + 1); it needs "
        "the token in $TIERCAKE_TOKEN, or one made up and written to <data dir>/control-token",
    )
    upp.add_argument("--host", default="127.0.0.1", help="the address both APIs listen on (default 127.0.0.1)")
    upp.add_argument(
        "--insecure",
        action="store_true",
        help="no control token: anyone who reaches the control "
        "API or a worker can register workers and read every tenant's keys (a throwaway cluster)",
    )
    upp.add_argument("--etcd", metavar="HOST:PORT,...", help="keep the metadata in this etcd")
    upp.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    upp.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    upp.add_argument("--workers", type=int, help="combined prefill+decode workers instead of separate ones")
    upp.add_argument("--gpu-blocks", type=int, help="KV blocks in each worker's gpu tier (serving.gpu_blocks)")
    upp.add_argument("--pool", metavar="SIZE", type=byte_size, help="the node pool's capacity, e.g. 1GiB")
    upp.add_argument("--ssd", metavar="SIZE", type=byte_size, help="the node SSD tier's capacity, e.g. 20GiB")
    upp.add_argument(
        "--pool-path",
        metavar="PATH",
        help="the node pool's file (default: /dev/shm/tiercake-<host>-<hash "
        "of the data dir>, so clusters in different data dirs never share one)",
    )
    upp.add_argument(
        "--node-netns",
        metavar="NAMESPACE:ADDRESS",
        help="fault injection: run the node agent in "
        "this network namespace, its transfer port at ADDRESS (tiercake chaos cuts its link; --host "
        "must be reachable from it; needs root)",
    )
    upp.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: tiercake's own workers; vllm: vLLM servers with the TiercakeConnector",
    )
    upp.add_argument("--model", metavar="DIR", help="--engine vllm: the Hugging Face model directory")
    upp.add_argument(
        "--vllm",
        type=int,
        default=1,
        metavar="N",
        help="--engine vllm: vLLM servers behind the front on --port, each prefilling and decoding (default 1)",
    )
    upp.add_argument(
        "--vllm-arg",
        action="append",
        metavar="ARG",
        help="--engine vllm: one more flag for every "
        "vLLM server, as vllm serve takes it (repeatable; --vllm-arg=--enforce-eager skips its "
        "compilation, a minute less to start on CPU)",
    )
    upp.add_argument(
        "--vllm-prefill",
        type=int,
        default=0,
        metavar="N",
        help="--engine vllm: disaggregated: N vLLM servers that prefill (with --vllm-decode)",
    )
    upp.add_argument(
        "--vllm-decode",
        type=int,
        default=0,
        metavar="N",
        help="--engine vllm: N vLLM servers that decode what the prefill servers computed, "
        "loading its KV through tiercake",
    )
    upp.set_defaults(func=cmd_up)

    ask = sub.add_parser(
        "ask",
        help="send a prompt to a running cluster and print the answer with its timing",
        description="Streams the completion and prints TTFT, tokens per second and how many prompt tokens "
        "came from the cache: send the same prompt twice to see the cache work.",
    )
    ask.add_argument("prompt", help="the prompt's text")
    ask.add_argument(
        "--url",
        default="http://127.0.0.1:8080",
        help="the cluster's OpenAI-compatible API (default: tiercake up's, http://127.0.0.1:8080)",
    )
    ask.add_argument("--model", help="the model to ask (default: the one the cluster serves, from /v1/models)")
    ask.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    ask.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ask.add_argument("--api-key", help="an API key (serving.api_keys)")
    ask.add_argument("--tenant", help="the tenant header, when the cluster has no API keys")
    ask.set_defaults(func=cmd_ask)

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
    peval.add_argument("--plot", metavar="PATH", help="the PNG (default policy-eval-<policy>.png)")
    peval.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    peval.set_defaults(func=cmd_policy_eval)

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
    rep.add_argument("--plot", metavar="PATH", help="the PNG (default replay.png)")
    rep.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    rep.set_defaults(func=cmd_replay)

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
    generate.add_argument("--seed", type=int, default=0, help="the same seed writes the same file (default 0)")
    generate.set_defaults(func=cmd_trace_generate)
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

    model = sub.add_parser("model", help="models for vLLM, made here (nothing is downloaded)")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_sub.add_parser(
        "make",
        help="write a small Llama (Hugging Face layout: config, tokenizer, weights from a seed) to DIR",
        description="Write a 4-layer, 256-wide Llama with a byte-level BPE tokenizer and seeded random weights to "
        "DIR, for `tiercake up --engine vllm --model DIR` where nothing can be downloaded. Its answers are noise; "
        "every instance that loads it computes the same KV for the same tokens. Kept if DIR already holds it.",
    )
    make.add_argument("dir", metavar="DIR", help="where to write it (created)")
    make.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    make.set_defaults(func=cmd_model_make)

    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="validate a config and print it with every default filled in")
    with_config(show)
    show.set_defaults(func=cmd_config_show)
    return parser


# What a warm spare of a command imports before it waits (see ``_wait_as_spare``).
SPARE_IMPORTS = {"node": "tiercake.workers.node_agent", "worker": "tiercake.workers.worker"}


def _wait_as_spare(command: str) -> bool:
    """A warm spare (``up`` starts one beside a node agent): import what the command needs, then wait
    for a line on stdin before running it. Its supervisor swaps it in when the running process exits,
    so a restart costs no interpreter start and no imports (2-4 s of torch and the rest). Whether to go
    on: an end of input means the supervisor went away."""
    import importlib

    importlib.import_module(SPARE_IMPORTS[command])
    return bool(sys.stdin.readline())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import os

    if os.environ.pop(SPARE_ENV, None) and args.command in SPARE_IMPORTS and not _wait_as_spare(args.command):
        return 0
    level = os.environ.get("TIERCAKE_LOG_LEVEL", "INFO" if args.verbose else "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValidationError as exc:
        for line in config_problems(exc):
            errors.print(line, markup=False, highlight=False)
        return 2
    except (OSError, ValueError, StartError, DataDirBusy) as exc:
        errors.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
