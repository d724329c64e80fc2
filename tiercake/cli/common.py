"""What every command of the CLI shares: the consoles, reading a config (and refusing one that names
unknown policies), sizes, progress bars, and the JSON output of reports."""

from __future__ import annotations

import argparse
import contextlib
import shutil

from rich.console import Console

# a terminal's own width; piped or redirected, 160 columns (rich would cut tables at 80)
_WIDTH = max(80, shutil.get_terminal_size((160, 24)).columns)
console = Console(width=_WIDTH, soft_wrap=True)
# stderr: a parent reading stdout reads only what it asked for
errors = Console(stderr=True, width=_WIDTH, soft_wrap=True)


SIZE_HELP = "a size is a number of bytes, or a number and a unit: 512MiB, 2GiB, 1.5GB, 4096"


def byte_size(text: str) -> int:
    """An argparse type: a size such as 512MiB (the config's sizes, from the command line)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{SIZE_HELP}; got {text!r}") from None


def config_problems(exc) -> list[str]:
    """A pydantic ``ValidationError`` as one line per problem: the field, what is wrong (and what is
    accepted, where the validator says), and the value given."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ())) or "config"
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if str(err.get("type", "")).startswith("byte_size"):
            message = SIZE_HELP
        given = err.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r:.80})"
        lines.append(f"invalid configuration: {where}: {message}{shown}")
    return lines


def write_json(args: argparse.Namespace, report) -> int:
    """Every report-producing command takes --json PATH (the benchmark JSON format)."""
    if args.json:
        report.write(args.json)
        console.print(f"wrote {args.json}")
    return 0


@contextlib.contextmanager
def progress_bar(description: str, total: float | None = None):
    """A bar with done / total, time elapsed and time left (ETA) for a long command; yields
    ``update(done, total=None, description=None)``. A total of None: no ETA until one is known."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def update(done: float, total: float | None = None, description: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=description)  # None: left as it is

        yield update


def policy_problems(config) -> list[str]:
    """Every policy a config names that does not resolve to a policy of its kind, one line each (the
    config model validates tier kinds and transports itself; policies live a layer above it)."""
    from tiercake.policies.registry import PolicyNotFoundError, resolve_kind

    named = [
        (f"store.tiers.{i}.{field}", getattr(tier, field), field)
        for i, tier in enumerate(config.store.tiers)
        for field in ("eviction", "admission")
    ]
    named += [
        ("conductor.placement", config.conductor.placement, "placement"),
        ("conductor.replication", config.conductor.replication, "replication"),
        ("serving.router", config.serving.router, "routing"),
    ]
    problems = []
    for where, spec, kind in named:
        try:
            resolve_kind(spec, kind)
        except (PolicyNotFoundError, ImportError, AttributeError, TypeError) as exc:
            problems.append(f"invalid configuration: {where}: {exc}")
    return problems


def with_config(parser) -> None:
    """The options of every command that reads a config."""
    parser.add_argument("--config", metavar="PATH", help="YAML, JSON or TOML config (default: the embedded default)")
    parser.add_argument(
        "--data-dir", default=".tiercake", metavar="DIR", help="where the default config keeps SSD data"
    )


def load(config_path: str | None, data_dir: str):
    from tiercake.config import default_config, load_config, with_environment

    return load_config(config_path, data_dir) if config_path else with_environment(default_config(data_dir))


def refused(config) -> bool:
    """Print every name in ``config`` that resolves to nothing; whether there was one."""
    problems = policy_problems(config)
    for line in problems:
        errors.print(line, markup=False, highlight=False)
    return bool(problems)
