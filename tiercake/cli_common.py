"""What every command of the CLI shares: the console and the JSON output of reports."""

from __future__ import annotations

import argparse

from rich.console import Console

console = Console()
errors = Console(stderr=True)  # errors go to stderr: a parent reading stdout reads only what it asked for


def write_json(args: argparse.Namespace, report) -> int:
    """Every report-producing command takes --json PATH (the benchmark JSON format)."""
    if args.json:
        report.write(args.json)
        console.print(f"wrote {args.json}")
    return 0
