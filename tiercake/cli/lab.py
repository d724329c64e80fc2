"""``tiercake lab up`` and ``tiercake lab down``: a multi-host cluster on this machine, each host a
network namespace of its own (``tiercake.lab``)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from .common import errors

DEFAULT_DIR = ".tiercake-lab"


def cmd_lab_up(args: argparse.Namespace) -> int:
    from tiercake.lab.cluster import Lab, LabSpec
    from tiercake.lab.hosts import require_root
    from tiercake.up import Interrupted, Supervisor, on_stop_signals

    spec = LabSpec(
        hosts=args.hosts,
        rtt_ms=args.rtt_ms,
        loss=args.loss,
        rate_gbit=args.rate,
        workers=args.workers,
        port=args.port,
        config=Path(args.config) if args.config else None,
    )
    spec.check()
    require_root()  # before anything is read or made
    root = Path(args.data_dir).resolve()
    _refuse_if_running(root)
    stop = on_stop_signals()
    lab = Lab(root, spec, print_fn=print)
    try:
        lab.start(stop)
    except Interrupted:
        return 130
    try:
        _print_up(lab)
        supervisor = Supervisor(lab.children, print, on_restart=lab.restarted)
        return 0 if supervisor.watch(stop) else 1
    finally:
        left = lab.close()
        print("tiercake lab is down" + (f"; could not remove: {', '.join(left)}" if left else ""))


def _refuse_if_running(root: Path) -> None:
    from tiercake.lab.cluster import STATE
    from tiercake.lab.hosts import HostsState

    path = root / STATE
    if path.exists():
        owner = HostsState.load(path).owner
        if owner and _alive(owner):
            raise ValueError(f"a lab already runs from {root} (pid {owner}): tiercake lab down --data-dir {root}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: it has exited, and whoever started it (a test, a
    supervisor) has not reaped it yet; it still answers signal 0, and kept ``lab down`` waiting out
    its whole deadline (30 s) for a ``lab up`` that had stopped. (The lab is Linux's: /proc is there.)"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state follows the command's name


def _print_up(lab) -> None:
    spec, state = lab.spec, lab.state
    print(f"tiercake lab is up: {lab.url}")
    print(
        f"  {spec.hosts} hosts on bridge {state.bridge} (198.18.{state.net}.0/24): "
        + ", ".join(f"{h.name} {h.address}" for h in state.hosts)
    )
    print(
        f"  each link: round trip {lab.measured_rtt_s * 1e3:.2f} ms measured ({spec.rtt_ms} ms asked)"
        + (f", loss {spec.loss:.1%}" if spec.loss else "")
        + (f", {spec.rate_gbit} Gbit/s" if spec.rate_gbit else "")
    )
    print(f"  etcd on {', '.join(h.name for h in lab.etcd_hosts())}; conductors {', '.join(lab.control_urls)}")
    if lab.token_at:
        print(f"  control API bearer token: {lab.token_at}")
    print(f"  logs in {lab.root / 'logs'}; tiercake lab down (or Ctrl-C) takes it all away")
    print(f"  try: tiercake ask 'Hello, tiers!' --url {lab.url}")


def cmd_lab_down(args: argparse.Namespace) -> int:
    from tiercake.lab.cluster import STATE
    from tiercake.lab.hosts import HostsState, remove, require_root

    root = Path(args.data_dir).resolve()
    path = root / STATE
    if not path.exists():
        print(f"no lab runs from {root}")
        return 0
    require_root()
    state = HostsState.load(path)
    if state.owner and _alive(state.owner):
        os.kill(state.owner, signal.SIGTERM)  # it stops its processes and takes its hosts away
        deadline = time.monotonic() + 30
        while _alive(state.owner) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = remove(state) if path.exists() else []  # what a crashed or killed `lab up` left
    if left:
        errors.print(f"error: could not remove {', '.join(left)}")
        return 1
    path.unlink(missing_ok=True)
    print("tiercake lab is down")
    return 0


def register(sub) -> None:
    """``lab up`` and ``lab down``."""
    lab = sub.add_parser(
        "lab",
        help="a multi-host cluster on this machine: each host a network namespace (needs root)",
        description="Hosts as network namespaces on one bridge (addresses from 198.18.0.0/15), each with its own "
        "/dev/shm; links that delay, drop and limit; on them a 3-member etcd, two conductors, the front, and a "
        "node agent and workers per host.",
    )
    verbs = lab.add_subparsers(dest="lab_command", required=True, metavar="VERB")
    up = verbs.add_parser("up", help="make the hosts and start the cluster on them; Ctrl-C takes it all away")
    up.add_argument("--hosts", type=int, default=3, help="how many hosts (default 3)")
    up.add_argument("--rtt-ms", type=float, default=0.4, help="each link's round trip in ms (default 0.4)")
    up.add_argument("--loss", type=float, default=0.0, help="the share of packets each host drops (default 0)")
    up.add_argument("--rate", type=float, metavar="GBIT", help="the most each host sends, Gbit/s (default: no limit)")
    up.add_argument("--workers", type=int, default=1, help="workers per host (default 1)")
    up.add_argument("--port", type=int, default=8080, help="the front's port on the first host (default 8080)")
    up.add_argument("--config", metavar="PATH", help="a config over the lab's defaults (addresses are the lab's)")
    up.add_argument("--data-dir", default=DEFAULT_DIR, help=f"logs, state and SSD tiers (default {DEFAULT_DIR})")
    up.set_defaults(func=cmd_lab_up)
    down = verbs.add_parser("down", help="stop the lab and remove every namespace, link, process and file it made")
    down.add_argument("--data-dir", default=DEFAULT_DIR, help=f"the lab's (default {DEFAULT_DIR})")
    down.set_defaults(func=cmd_lab_down)
