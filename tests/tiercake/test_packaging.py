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
from up_helpers import left_in_shm

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
    "google-re2",
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


def _venv_without_torch(tmp_path: Path, wheel: Path) -> Path:
    """A fresh venv with the wheel installed and the suite's dependencies visible through a .pth
    file, except torch (and what is built on it): there, ``import torch`` fails as on a machine
    that never installed it. Offline: nothing is downloaded."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    suite = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "deps-without-torch"
    farm.mkdir()
    built_on_torch = ("torch", "vllm", "triton", "torchvision", "torchaudio", "functorch", "xformers", "lmcache")
    for entry in suite.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top in built_on_torch or entry.name.startswith("__editable__") or entry.suffix == ".pth":
            continue
        (farm / entry.name).symlink_to(entry)
    (site / "suite-deps.pth").write_text(f"{farm}\n")
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
    return venv


@pytest.mark.timeout(300)
def test_the_bare_package_runs_the_storage_side_and_the_key_value_store_without_torch(wheel, tmp_path):
    """``pip install tiercake`` with no torch anywhere: ``up --help`` answers, ``up`` with workers
    says in one line that they need torch, and ``up --no-engine`` serves a key-value round trip
    (conductor, node agent with the pool and SSD tiers, Mooncake's client) and stops clean."""
    venv = _venv_without_torch(tmp_path, wheel)
    python, tiercake = str(venv / "bin" / "python"), str(venv / "bin" / "tiercake")
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    helped = subprocess.run([tiercake, "up", "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert helped.returncode == 0 and "--no-engine" in helped.stdout, helped.stderr
    data = tmp_path / "data"
    refused = subprocess.run(
        [tiercake, "up", "--data-dir", str(data), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert refused.returncode == 2 and "needs torch" in refused.stderr and "--no-engine" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [tiercake, "up", "--no-engine", "--data-dir", str(data), "--port", "0", "--control-port", "0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        while not any("Ctrl-C stops everything" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        conductor = next(line for line in lines if "tiercake is up (no engine)" in line).split()[6].rstrip(",")
        env = dict(line.split("=", 1) for line in (data / "connector.env").read_text().split())
        roundtrip = subprocess.run(
            [
                python,
                "-c",
                "import sys; from tiercake.kvstore import MooncakeDistributedStore as S\n"
                "s = S(); assert s.setup(sys.argv[1]) == 0\n"
                "assert s.put('k', b'no torch here') == 0 and s.get('k') == b'no torch here'\n"
                "assert s.remove('k', force=True) == 0; s.close()\n"
                "assert 'torch' not in sys.modules; print('ok')",
                conductor,
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
            env={**os.environ, **env},
        )
        assert roundtrip.returncode == 0 and roundtrip.stdout.strip() == "ok", roundtrip.stderr[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    assert left_in_shm(before) == set()  # another test's pools, made meanwhile under xdist, are not its
