"""The previous release of tiercake, built from git, to run beside the current code (N-1 tests).

``PREVIOUS`` is the last commit of transfer protocol 4 (the current one speaks 5 and 4). It is
built once per machine from this repository's own history (``git archive`` and ``pip install
--no-deps --target``: no download) into a cache folder, and run in subprocesses whose imports find
it before the current checkout (``tiercake.previous``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiercake.previous import previous_python

__all__ = ["PREVIOUS", "previous_python", "previous_site"]

PREVIOUS = "505ccf97b9f0a8aa6a2f155e523a1652194893ad"  # transfer protocol 4
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".pytest_cache" / f"tiercake-{PREVIOUS[:12]}"


def previous_site() -> Path:
    """The folder the previous release is installed in (built the first time)."""
    site = CACHE / "site"
    if (site / "tiercake" / "__init__.py").exists():
        return site
    source = CACHE / "src"
    source.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site.with_suffix(".part")),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    site.with_suffix(".part").rename(site)
    return site
