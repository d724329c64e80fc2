"""The cluster's processes: `tiercake up` (a whole cluster on this machine), the `conductor`, `node`
and `worker` processes it supervises, and `chaos`, which runs one under faults."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from pydantic import ByteSize

from .common import byte_size, console, errors, load, progress_bar, refused, with_config, write_json


def cmd_chaos(args: argparse.Namespace) -> int:
    from tiercake import chaos
    from tiercake.chaos import lab_run
    from tiercake.lab.nemesis import FAULTS as LAB_FAULTS

    known = LAB_FAULTS if args.lab else chaos.FAULTS
    faults = tuple(f for f in (args.faults or ",".join(known)).split(",") if f)
    unknown = [f for f in faults if f not in known]
    if unknown:
        errors.print(f"error: unknown faults {unknown}; known{' with --lab' if args.lab else ''}: {', '.join(known)}")
        return 2
    if args.lab:
        from tiercake.lab.hosts import require_root

        require_root()
        report = asyncio.run(lab_run.run(quick=args.quick, faults=faults, progress=console.print))
        failed = lab_run.failed
    else:
        with progress_bar("chaos") as stage:  # messages print above the bar
            report = asyncio.run(
                chaos.run(quick=args.quick, faults=faults, progress=console.print, stage=stage, previous=args.previous)
            )
        failed = chaos.failed
    report.print(console)
    write_json(args, report)
    reasons = failed(report)
    if reasons:
        errors.print(f"[red]chaos run failed:[/red] {'; '.join(reasons)}")
        return 1
    return 0


def cmd_conductor(args: argparse.Namespace) -> int:
    from tiercake.conductor.api import serve

    full = load(args.config, args.data_dir)
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
    from tiercake.workers.node.agent import NodeAgent

    config = load(args.config, args.data_dir)
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        config.transfer.host, config.transfer.port = host or config.transfer.host, int(port)
    spin.run(NodeAgent(config).serve_forever(), config.transfer.spin_us / 1e6)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from tiercake.workers.worker import Worker

    config = load(args.config, args.data_dir)
    host, _, port = (args.listen or "127.0.0.1:0").rpartition(":")
    engine = None
    if args.engine == "vllm":
        if not args.vllm_url:
            errors.print("error: --engine vllm needs --vllm-url URL (a vLLM server with the TiercakeConnector)")
            return 2
        from tiercake.workers.vllm.engine import VllmEngine

        def engine(client):
            return VllmEngine(
                args.vllm_url, client, wait_s=args.vllm_wait, transfer=session_transfer(config, args.id)
            ).start()

    worker = Worker(config, args.role, args.id, args.data_dir, advertise=args.advertise, engine=engine)
    asyncio.run(worker.serve_forever(host or "127.0.0.1", int(port)))
    return 0


def session_transfer(config, identity: str | None):
    """The vLLM worker's transfer engine, for the control API's session changes: None (they answer
    501) without a cluster secret, which the connector inside vLLM has as the node agent does."""
    from tiercake.transfer import TransferEngine

    try:
        secret = config.transfer.secret()
    except ValueError:
        return None
    return TransferEngine(
        identity or "vllm-worker",
        secret,
        transports=("tcp",),
        tls=config.transfer_tls_client(),
    )


def cmd_up(args: argparse.Namespace) -> int:
    from tiercake.up import up

    config = load(args.config, args.data_dir)
    if refused(config):
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
        from tiercake.up_vllm import up_vllm

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
    if args.engine == "none":
        prefill = decode = workers = 0
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
        engine=args.engine != "none",
        node_netns=node_netns,
    )


def register(sub) -> None:
    """``up``, ``conductor``, ``node``, ``worker`` and ``chaos``."""
    for parser_of in (_up, _conductor, _node, _worker, _chaos):
        parser_of(sub)


def _chaos(sub) -> None:
    """``tiercake chaos``."""
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
        "--lab",
        action="store_true",
        help="on a three-host lab (tiercake lab up; needs root): partitions, loss, flapping links and remote "
        "kills, each under the serving and key-value workloads",
    )
    chaos_parser.add_argument(
        "--previous",
        metavar="DIR",
        type=Path,
        help="the previous release, installed in DIR (pip install --no-deps --target DIR "
        "tiercake==X): the upgrade fault runs a node agent of it beside this one",
    )
    chaos_parser.set_defaults(func=cmd_chaos)


def _conductor(sub) -> None:
    """``tiercake conductor``."""
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


def _node(sub) -> None:
    """``tiercake node``."""
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


def _worker(sub) -> None:
    """``tiercake worker``."""
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


def _up(sub) -> None:
    """``tiercake up``."""
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
    _up_vllm_flags(upp)
    upp.set_defaults(func=cmd_up)


def _up_vllm_flags(upp) -> None:
    """``tiercake up``'s flags for running vLLM servers instead of tiercake's own workers."""
    group = upp.add_argument_group("under vLLM")
    group.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: tiercake's own workers; vllm: vLLM servers with the TiercakeConnector",
    )
    group.add_argument(
        "--no-engine",
        dest="engine",
        action="store_const",
        const="none",
        help="the storage side alone (conductor, node agent; no workers): for vLLM servers started by hand, "
        "told where it is by the files it writes to the data directory (connector.env, kv-transfer-config.json)",
    )
    group.add_argument("--model", metavar="DIR", help="--engine vllm: the Hugging Face model directory")
    group.add_argument(
        "--vllm",
        type=int,
        default=1,
        metavar="N",
        help="--engine vllm: vLLM servers behind the front on --port, each prefilling and decoding (default 1)",
    )
    group.add_argument(
        "--vllm-arg",
        action="append",
        metavar="ARG",
        help="--engine vllm: one more flag for every "
        "vLLM server, as vllm serve takes it (repeatable; --vllm-arg=--enforce-eager skips its "
        "compilation, a minute less to start on CPU)",
    )
    group.add_argument(
        "--vllm-prefill",
        type=int,
        default=0,
        metavar="N",
        help="--engine vllm: disaggregated: N vLLM servers that prefill (with --vllm-decode)",
    )
    group.add_argument(
        "--vllm-decode",
        type=int,
        default=0,
        metavar="N",
        help="--engine vllm: N vLLM servers that decode what the prefill servers computed, "
        "loading its KV through tiercake",
    )
