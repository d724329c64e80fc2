"""The previous release of tiercake, built from git, to run beside the current code (N-1 tests).

``PREVIOUS`` is the last commit of transfer protocol 3 (the current one speaks 4 and 3). It is
built once per machine from this repository's own history (``git archive`` and ``pip install
--no-deps --target``: no download) into a cache folder, and run in subprocesses whose imports find
it before the current checkout (an editable install's import hook is taken out first).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PREVIOUS = "b314f5746f849ab9254f62be64d92a40c360ec8e"  # transfer protocol 3
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".pytest_cache" / f"tiercake-{PREVIOUS[:12]}"

_BOOT = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]
sys.path.insert(0, {site!r})
for name in [m for m in sys.modules if m == 'tiercake' or m.startswith('tiercake.')]:
    del sys.modules[name]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') else \
    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
"""


def previous_site() -> Path:
    """The folder the previous release is installed in (built the first time)."""
    site = CACHE / "site"
    if (site / "tiercake" / "__init__.py").exists():
        return site
    source = CACHE / "src"
    source.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site.with_suffix(".part")), str(source)], check=True, capture_output=True)
    site.with_suffix(".part").rename(site)
    return site


def previous_python(site: Path, target: str) -> list[str]:
    """argv running ``target`` (a script path or a module name) under the previous release."""
    return [sys.executable, "-c", _BOOT.format(site=str(site)), target]
