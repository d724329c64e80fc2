"""Benchmark figures: one JSON format for every bench, and a table for people."""

from __future__ import annotations

import contextvars
import json
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from tiercake.messages import ClusterView

# told of each figure as a bench adds it (the CLI's progress bar); benches need not pass it along
ON_FIGURE: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("on_figure", default=None)


class Figure(BaseModel):
    name: str
    value: float
    unit: str
    limit: float = Field(description="the bound measured in the same run (memcpy, raw disk, ...)")
    ratio: float = Field(description="value / limit, or limit / value for latencies")
    params: dict[str, Any] = Field(default_factory=dict)


class Report(BaseModel):
    bench: str
    machine: dict[str, Any] = Field(default_factory=dict)
    figures: list[Figure] = Field(default_factory=list)

    def add(self, name: str, value: float, unit: str, limit: float, **params: Any) -> Figure:
        figure = Figure(
            name=name, value=value, unit=unit, limit=limit, ratio=value / limit if limit else 0.0, params=params
        )
        self.figures.append(figure)
        hook = ON_FIGURE.get()
        if hook is not None:
            hook(name)
        return figure

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        table = Table(title=f"tiercake bench {self.bench}")
        for column in ("figure", "params", "value", "limit", "ratio"):
            table.add_column(column, justify="right" if column in ("value", "limit", "ratio") else "left")
        for f in self.figures:
            params = " ".join(f"{k}={v}" for k, v in f.params.items() if k != "limit_name")
            table.add_row(
                f.name,
                params,
                f"{f.value:.3f} {f.unit}",
                f"{f.limit:.3f} {f.params.get('limit_name', '')}",
                f"{f.ratio:.2f}",
            )
        console.print(table)

    def plot(self, path: str | Path) -> None:
        """Each figure's ratio to its limit, one bar per figure (1.0: the limit reached)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        values: dict[str, set[str]] = {}
        for f in self.figures:
            for k, v in f.params.items():
                values.setdefault(k, set()).add(str(v))
        varying = [k for k, seen in values.items() if len(seen) > 1 and k != "limit_name"]  # what tells bars apart
        labels = [
            " ".join([f.name, *(f"{k}={f.params[k]}" for k in varying if k in f.params)])[:56] for f in self.figures
        ]
        fig, ax = plt.subplots(figsize=(10, 0.28 * len(labels) + 1.5))
        ax.barh(range(len(labels)), [f.ratio for f in self.figures])
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ratio to the limit measured in the same run")
        ax.set_title(textwrap.fill(f"tiercake bench {self.bench}", 80), fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(), indent=2) + "\n")


def spinners(load: int) -> list[subprocess.Popen]:
    """``load`` processes spinning on the CPU (a busy machine, for ``--load``); the caller kills them."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]


def machine() -> dict[str, Any]:
    # os.uname, not platform.platform(): that one runs `uname -p` in a subprocess on first use
    name = os.uname()
    return {
        "platform": f"{name.sysname}-{name.release}-{name.machine}",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def cluster_figures(before: ClusterView, after: ClusterView, report: Report, **params: Any) -> None:
    """Metadata cost over a run, from two ``/v1/cluster`` views (before and after): bytes of placement
    changes (their keys and sizes) per KV byte moved (pulled into workers or written to nodes), against
    the least an index could be told (one block key per block moved); index operations (lookups and
    placement changes) per request, against one lookup per request; and the writes the conductor made
    to etcd per request (placements never go there), against the same one operation."""
    from tiercake.blocks import KEY_BYTES

    was, now = before.metadata, after.metadata
    moved = now.kv_bytes_moved - was.kv_bytes_moved
    told = now.change_bytes - was.change_bytes
    ops = now.placement_changes + now.lookups - was.placement_changes - was.lookups
    served = after.serving.requests - before.serving.requests
    if moved > 0:
        report.add(
            "metadata.bytes_per_kv_byte",
            told / moved,
            "B/B",
            KEY_BYTES / now.block_bytes,
            limit_name="one block key per block moved",
            kv_bytes_moved=moved,
            metadata_bytes=told,
            block_bytes=now.block_bytes,
            **params,
        )
    if served > 0:
        report.add(
            "metadata.ops_per_request",
            ops / served,
            "ops",
            1.0,
            limit_name="one lookup per request",
            requests_served=served,
            ops=ops,
            changes={kind: n - was.changes.get(kind, 0) for kind, n in now.changes.items()},
            **params,
        )
        writes = now.backend_writes - was.backend_writes
        report.add(
            "metadata.etcd_writes_per_request",
            writes / served,
            "ops",
            1.0,
            limit_name="one operation per request",
            requests_served=served,
            writes=writes,
            **params,
        )
