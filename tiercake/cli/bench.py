"""`tiercake bench ...`: every benchmark as a ratio to a limit measured in the same run, under a
progress bar whose total comes from the last run of the same bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from pathlib import Path

from .common import console, progress_bar, write_json


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
        vllm.run(quick=args.quick, trace=args.trace, peers=args.peers),
    )


def cmd_bench_vllm_kv(args: argparse.Namespace) -> int:
    from tiercake.bench import vllm_kv

    return _bench(
        args,
        f"the TiercakeConnector's loads and saves on {args.device} (a conductor and a node agent start for it)",
        vllm_kv.run(quick=args.quick, device=args.device),
    )


def cmd_bench_store_api(args: argparse.Namespace) -> int:
    from tiercake.bench import store_api

    return _bench(
        args,
        "the key-value store API (a conductor, a node agent and, if installed, Mooncake start for it)",
        store_api.run(quick=args.quick, load=args.load),
    )


def cmd_bench_restart(args: argparse.Namespace) -> int:
    from tiercake.bench import restart

    return _bench(args, "a full node agent's restarts", restart.run(quick=args.quick, load=args.load))


def cmd_bench_sessions(args: argparse.Namespace) -> int:
    from tiercake.bench import sessions

    return _bench(args, "session-aware eviction against session-blind", sessions.run(args.quick, args.trace, args.live))


def cmd_bench_metadata(args: argparse.Namespace) -> int:
    from tiercake.bench import metadata

    return _bench(args, "the placement index (a local etcd starts for it)", metadata.run(quick=args.quick))


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    from tiercake.bench import fleet

    run = fleet.run(
        quick=args.quick, sizes=_ints(args.nodes), blocks=args.blocks_per_node, budget_s=args.budget, load=args.load
    )
    return _bench(args, "the control plane under simulated fleets (etcd and two conductors start for each)", run)


def cmd_bench_hosts(args: argparse.Namespace) -> int:
    from tiercake.bench import hosts
    from tiercake.lab.hosts import require_root

    require_root()
    return _bench(args, "a three-host lab (network namespaces; about 3 minutes)", hosts.run(quick=args.quick))


def register(sub) -> None:
    """The ``bench`` command and one subcommand per bench."""
    bench = sub.add_parser("bench", help="benchmarks, each as a ratio to a limit measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def bench_parser(name: str, **kwargs) -> argparse.ArgumentParser:
        """A bench command: every bench takes --quick and --json."""
        p = bench_sub.add_parser(name, **kwargs)
        p.add_argument("--quick", action="store_true", help="a short run (under 30 s)")
        p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
        p.add_argument("--plot", metavar="PATH", help="a PNG of each figure's ratio to its limit")
        return p

    _data_path_benches(bench_parser)
    _control_plane_benches(bench_parser)
    _serving_benches(bench_parser)


def _data_path_benches(bench_parser) -> None:
    """The tiers, the transfer engine, the key-value store API and the metadata path."""
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

    hosts = bench_parser(
        "hosts",
        help="KV reuse across hosts on a lab: TTFT of a pull vs recompute at 0.2/1/5 ms; a pull vs raw TCP",
        description="On a three-host lab (tiercake lab up; needs root): the TTFT of a 1024-token prompt 90% "
        "held on another host, pulled, against its recompute on the same worker, at 0.2, 1 and 5 ms round "
        "trips; over a 20 Mbit/s link, whether the router computes instead; and a client's pull of 1 MiB "
        "objects from another host against a raw TCP stream between the same two hosts, in the same run.",
    )
    hosts.set_defaults(func=cmd_bench_hosts)

    restart = bench_parser(
        "restart",
        help="a full node agent SIGKILLed and restarted: seconds to listen and to serve vs 3 s",
        description="A node agent whose SSD holds 2 GiB of persisted objects (512 MiB with --quick) and whose "
        "pool is full, killed and started again: how long until it listens and until a get answers.",
    )
    restart.add_argument("--load", type=int, default=0, help="processes spinning on the CPU meanwhile")
    restart.set_defaults(func=cmd_bench_restart)


def _control_plane_benches(bench_parser) -> None:
    """The conductor's index and membership, without block bytes."""
    meta = bench_parser(
        "metadata",
        help="the placement index: ingest vs raw etcd and 100k/core, chain lookups vs probes, memory vs a flat array",
        description="Placements taken into the in-memory index (reports of 1,024 blocks) per second of one "
        "core, against 100k per core and against raw batched etcd transactions of the same placements (a local "
        "etcd started from the installed binary); lookups of 64-block chains in an index of 10M blocks (200k "
        "with --quick) against 64 probes of the same table; resident memory per replica against a flat array.",
    )
    meta.set_defaults(func=cmd_bench_metadata)

    fleet = bench_parser(
        "fleet",
        help="the control plane under 10/100/1000 simulated nodes: placements/s, lookups, memory, failover",
        description="A real etcd (three members; one with --quick) and two conductor processes, driven by "
        "load-generator processes whose simulated node agents register, renew their leases and report their "
        "blocks through the conductor client, and a front that looks up 64-block chains. Per fleet size: "
        "placements/s against raw etcd and per leader CPU-second, etcd's writes meanwhile, lookup p50/p99, "
        "memory per replica, etcd's database size, lease renewals, how long a dead node's blocks stay listed, "
        "and a failover after the leader is SIGKILLed; --plot draws each against the fleet size.",
    )
    fleet.add_argument("--nodes", metavar="N,...", help="fleet sizes (default 10,100,1000; 10,100 with --quick)")
    fleet.add_argument(
        "--blocks-per-node", type=int, metavar="N", help="blocks each node reports (default 100000; 1024 with --quick)"
    )
    fleet.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help="seconds a fill may take per fleet size (default 900; 60 with --quick)",
    )
    fleet.add_argument("--load", type=int, default=0, help="processes spinning on the CPU meanwhile (a busy machine)")
    fleet.set_defaults(func=cmd_bench_fleet)


def _serving_benches(bench_parser) -> None:
    """Time to first token, on tiercake's own workers and on vLLM."""
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
    vllm_bench.add_argument(
        "--peers",
        action="store_true",
        help="also time a second instance loading the prefixes the first saved, and the same requests on vLLM "
        "with a do-nothing connector (the cold baseline), with vLLM's LMCacheMPConnector over LMCache's server "
        "and with its MooncakeStoreConnector over Mooncake Store (each where installed; with Mooncake the whole "
        "bench runs inside unshare -n), every instance in the same interleaved rounds",
    )
    vllm_bench.set_defaults(func=cmd_bench_vllm)

    kv = bench_parser(
        "vllm-kv",
        help="the vLLM connector's loads into paged KV vs memcpy (or pinned host-to-GPU copy); needs no vLLM",
        description="Starts a conductor and a node agent with a pool tier, builds paged KV shaped as vLLM's "
        "on --device, saves a prefix's blocks through the TiercakeConnector's worker side and loads them back "
        "layer by layer, checked byte for byte: load throughput against a plain copy of the same bytes in the "
        "same run (memcpy on the CPU, a copy from pinned host memory on a GPU), the seal check's share, the "
        "copy into the layers alone, and a save's time inside the step.",
    )
    kv.add_argument("--device", default="cpu", help="where the KV lives: cpu (default) or cuda[:N]")
    kv.set_defaults(func=cmd_bench_vllm_kv)

    sessions = bench_parser(
        "sessions",
        help="session-aware eviction vs session-blind policies and the optimum, offline",
        description="Replays a generated agentic trace (and, with --trace, a trace with sessions inferred from its "
        "block chains) through the session-aware eviction policy, told nothing, sessions, closes and announced "
        "pauses, beside LRU, the reuse policy and the tree-constrained optimum at two capacities.",
    )
    sessions.add_argument("--trace", metavar="FILE", help="also a trace in the Mooncake format (sessions inferred)")
    sessions.add_argument(
        "--live",
        action="store_true",
        help="also replay an agentic trace against a live cluster it starts, session-blind then session-aware: "
        "TTFT of the turns after a pause, and the answers compared (minutes)",
    )
    sessions.set_defaults(func=cmd_bench_sessions)
