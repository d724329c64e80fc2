"""The `tiercake` command line: one module per family of commands, each registering its own
subcommands (``cluster``: up and the processes it runs, chaos; ``local``: ask, demo, model, config, secret;
``bench``; ``analysis``: policies, replay, simulate, trace); ``common`` what they share."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from ..lab.hosts import LabUnavailable
from ..up import SPARE_ENV, StartError
from ..up_state import DataDirBusy
from . import analysis, bench, cluster, lab, local
from .common import config_problems, errors


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
    for family in (cluster, lab, local, bench, analysis):
        family.register(sub)
    return parser


# What a warm spare of a command imports before it waits (see ``_wait_as_spare``).
SPARE_IMPORTS = {"node": "tiercake.workers.node.agent", "worker": "tiercake.workers.worker"}


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
    _stop_on_sigterm()
    try:
        return args.func(args)
    except ValidationError as exc:
        for line in config_problems(exc):
            errors.print(line, markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure of a command is one line on stderr and exit 2
        errors.print(f"error: {one_line(exc)}", markup=False, highlight=False)
        if level == "DEBUG" or args.verbose:
            logging.getLogger("tiercake.cli").exception("what failed")
        return 2


def _stop_on_sigterm() -> None:
    """SIGTERM stops a command as Ctrl-C does: its cleanups run (a bench's pool file, a demo's store),
    where the default action would kill it on the spot. Commands that serve (up, node, conductor)
    install handlers of their own, which replace this one."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


# What a user can act on: said as it is. Anything else is a fault of tiercake, said with its type and
# how to see where it happened.
USER_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    StartError,
    DataDirBusy,
    TimeoutError,
    LabUnavailable,
)


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its message's first line (the rest is for -v)."""
    from tiercake.conductor.client import ConductorError
    from tiercake.tiers.errors import PoolFormatError, PoolInUseError, StoreError

    text = " ".join(str(exc).split("\n", 1)[0].split()) or type(exc).__name__
    if isinstance(exc, (*USER_ERRORS, ConductorError, StoreError, PoolInUseError, PoolFormatError)):
        return text
    return f"{type(exc).__name__}: {text} (unexpected: -v shows where it happened)"


def run() -> int:
    """The ``tiercake`` script and ``python -m tiercake.cli``: ``main``, then an exit that skips the
    interpreter's last garbage collections. Everything is stopped and flushed by then; with torch
    loaded those collections took 0.7-1.7 s per process (a Ctrl-C of ``up`` waits for every one of
    its processes to exit). ``gc.freeze`` keeps the exit's handlers, unlike ``os._exit``."""
    import gc

    code = main()
    gc.freeze()
    _quiet_exit()
    return code


def _quiet_exit() -> None:
    """Nothing after the command's own last line: triton's extension (loaded with vLLM, transformers
    or torch's compiler) reports nanobind's "leaked" objects on stderr at interpreter shutdown, about
    30 lines that say nothing about tiercake. As triton does for its own workers, stderr goes to
    /dev/null once the command has finished and flushed what it had to say."""
    import os

    if "triton" not in sys.modules:
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
