"""What every command of the CLI shares: the console and the JSON output of reports."""

from __future__ import annotations

import argparse
import contextlib

from rich.console import Console

console = Console()
errors = Console(stderr=True)  # errors go to stderr: a parent reading stdout reads only what it asked for


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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def update(done: float, total: float | None = None, description: str | None = None) -> None:
            bar.update(task, completed=done, **({"total": total} if total is not None else {}),
                       **({"description": description} if description is not None else {}))

        yield update
