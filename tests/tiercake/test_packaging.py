"""A regular (non-editable) install carries every module of every part, declares what it imports,
and serves a completion from a fresh virtual environment with no Makefile."""

import os
import signal
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from paths import ROOT

pytestmark = pytest.mark.cluster  # every test here starts processes

PARTS = {
    "tiercake": "tiercake",
    "conductor": "tiercake/conductor",
    "tiers": "tiercake/tiers",
    "transfer": "tiercake/transfer",
    "workers": "tiercake/workers",
    "policies": "tiercake/policies",
    "analysis": "tiercake/analysis",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("tiercake-*.whl")
    return built


def test_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{PARTS[source.relative_to(ROOT).parts[0]]}/{Path(*source.relative_to(ROOT).parts[1:]).as_posix()}"
        for part in PARTS
        for source in (ROOT / part).rglob("*.py")
    }
    assert expected - names == set()


# third-party modules the installed package imports, by the distribution that must provide them
# (torch is the reference engine's, in the extra of that name: the control plane and the storage side
# run without it; vLLM's extra brings transformers, pyzmq and tokenizers for the vLLM side; ucxx,
# mooncake and cryptography are optional)
CORE = {
    "numpy",
    "pydantic",
    "aiohttp",
    "zstandard",
    "xxhash",
    "blake3",
    "prometheus-client",
    "rich",
    "pyyaml",
    "etcd3aio",
    "matplotlib",
    "msgspec",
}


def test_the_wheel_declares_what_the_core_imports(wheel):
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read("tiercake-0.1.0.dist-info/METADATA").decode())
    required = {
        r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower()
        for r in meta.get_all("Requires-Dist")
        if "extra ==" not in r
    }
    assert CORE <= required, CORE - required
    assert "torch" not in required and not any(r.startswith("nvidia") for r in required)  # no GPU stack by default
    extras = {r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") if 'extra == "reference"' in r}
    assert any(r.startswith("torch") for r in extras), extras


@pytest.mark.timeout(300)
def test_pip_install_of_the_wheel_alone_serves_a_completion(wheel, tmp_path):
    """A fresh venv with only the wheel installed (no Makefile, no editable checkout): the wheel's own
    files must be enough. Its dependencies come from the suite's environment through a .pth file
    (not reinstalled: minutes of downloads), which does not bring the editable checkout along."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "suite-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert installed.returncode == 0, installed.stderr
    tiercake = str(venv / "bin" / "tiercake")
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import tiercake.transfer.object_wire as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the wheel's, not the checkout's
    proc = subprocess.Popen(
        [
            tiercake,
            "up",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            "0",
            "--control-port",
            "0",
            "--prefill",
            "0",
            "--decode",
            "0",
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        while not any("tiercake is up:" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        url = next(line for line in lines if "tiercake is up:" in line).split()[3]
        asked = subprocess.run(
            [tiercake, "ask", "Hello from a wheel!", "--url", url, "--max-tokens", "4"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert asked.returncode == 0 and "cached prompt tokens" in asked.stdout, asked.stdout + asked.stderr
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
