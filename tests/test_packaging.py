"""A regular (non-editable) install carries every module of every part."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"tiercake": "tiercake", "conductor": "tiercake/conductor", "tiers": "tiercake/tiers",
         "transfer": "tiercake/transfer", "workers": "tiercake/workers", "policies": "tiercake/policies"}


def test_wheel_holds_every_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("tiercake-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{PARTS[source.relative_to(ROOT).parts[0]]}/{Path(*source.relative_to(ROOT).parts[1:]).as_posix()}"
        for part in PARTS
        for source in (ROOT / part).rglob("*.py")
    }
    assert expected - names == set()
