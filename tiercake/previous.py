"""Run a tiercake other than this one: the previous release, installed in a folder of its own
(``pip install --no-deps --target DIR tiercake==X``, or built from git as the N-1 tests do), for
upgrade tests and ``tiercake chaos --previous DIR``. Its imports find that folder before this
installation (an editable install's import hook, which would win otherwise, is taken out first).
"""

from __future__ import annotations

import sys
from pathlib import Path

_BOOT = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]
sys.path.insert(0, {site!r})
for name in [m for m in sys.modules if m == 'tiercake' or m.startswith('tiercake.')]:
    del sys.modules[name]
sys.argv = sys.argv[1:]
if sys.argv[0].endswith('.py'):
    runpy.run_path(sys.argv[0], run_name='__main__')
else:
    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
"""


def previous_python(site: Path, target: str = "tiercake.cli") -> list[str]:
    """argv running ``target`` (a script path or a module name) under the tiercake in ``site``."""
    if not (Path(site) / "tiercake" / "__init__.py").exists():
        raise FileNotFoundError(f"{site}: no tiercake installed there (pip install --no-deps --target {site} ...)")
    return [sys.executable, "-c", _BOOT.format(site=str(site)), target]
