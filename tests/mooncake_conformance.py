"""Run Mooncake Store's own Python tests, unchanged, against tiercake and against Mooncake itself.

Not part of the suite (CI has no copy of Mooncake's repository): a tool for the conformance check of
the key-value store. Give it a checkout of kvcache-ai/Mooncake; nothing of it is copied here. Each
test file runs in its own pytest process, once per store, with only the environment differing:

- tiercake: a conductor and a node agent of this checkout (real processes, real sockets), and
  ``tiercake.kvstore.as_mooncake`` first on ``PYTHONPATH``, so ``import mooncake.store`` is
  tiercake's; the tests' own ``setup(...)`` calls name the conductor as their master.
- mooncake: the installed wheel's ``mooncake_master`` (with its HTTP metadata server), all inside a
  network namespace of its own (``unshare -n``: the master binds every address).

    python tests/mooncake_conformance.py /path/to/Mooncake [--against tiercake,mooncake] [--json OUT]

Prints one line per test that passed on one store and not on the other, and the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

from paths import shm_file

from tiercake.kvstore.as_mooncake import PATH as SHIM
from tiercake.tiers.pool import remove_pool

FILES = (
    "mooncake-wheel/tests/test_distributed_object_store.py",
    "mooncake-wheel/tests/test_replicated_distributed_object_store.py",
    "mooncake-wheel/tests/test_batch_replica_clear.py",
    "mooncake-wheel/tests/test_put_get_tensor.py",
    "mooncake-wheel/tests/test_safetensor_functions.py",
    "scripts/test_tensor_api.py",
    "scripts/test_upsert_api.py",
    "scripts/test_copy_move_api.py",
)
MASTER_PORT = 50051
FILE_TIMEOUT_S = 900


def run_files(repo: Path, env: dict, out: Path, prefix: list[str]) -> dict[str, str]:
    """Each file in its own pytest process; {test id: passed | failed | error | skipped}."""
    outcomes: dict[str, str] = {}
    for rel in os.environ.get("CONFORMANCE_FILES", ",".join(FILES)).split(","):
        path = repo / rel
        if not path.exists():
            print(f"  (no {rel} in this checkout)", file=sys.stderr)
            continue
        xml = out / (rel.replace("/", "_") + ".xml")
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(path.parent),
            f"--junitxml={xml}",
            "-o",
            "junit_family=xunit2",
            str(path),
        ]
        started = time.monotonic()
        try:
            subprocess.run(
                cmd,
                env=env,
                cwd=path.parent,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=FILE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            print(f"  {rel}: timed out after {FILE_TIMEOUT_S} s", file=sys.stderr)
        got = _outcomes(xml, rel)
        print(
            f"  {rel}: {sum(v == 'passed' for v in got.values())} of {len(got)} passed "
            f"({time.monotonic() - started:.0f} s)",
            file=sys.stderr,
        )
        outcomes.update(got)
    return outcomes


def _outcomes(xml: Path, rel: str) -> dict[str, str]:
    if not xml.exists():
        return {f"{rel}::(file)": "error"}
    got = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{rel}::{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        tags = {child.tag for child in case}
        got[name] = (
            "failed"
            if "failure" in tags
            else "error"
            if "error" in tags
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
    return got


class TiercakeCluster:
    """A conductor and two node agents, each with a 2 GiB pool and an SSD directory (Mooncake's
    replicated tests set up two clients that contribute memory: on tiercake nodes hold it)."""

    NODES = 2

    def __init__(self, work: Path) -> None:
        self.secret, self.token = secrets.token_hex(16), secrets.token_hex(16)
        self.env = {**os.environ, "TIERCAKE_SECRET": self.secret, "TIERCAKE_TOKEN": self.token}
        self.logs = [open(work / "conductor.log", "wb")]
        self.procs: list[subprocess.Popen] = []
        info = self._start(["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"], self.logs[0])
        self.url = info["url"]
        self.pools = [str(shm_file(f"conformance-{uuid.uuid4().hex[:8]}")) for _ in range(self.NODES)]
        for i, pool in enumerate(self.pools):
            config = work / f"node{i}.yaml"
            config.write_text(
                f"node_id: conformance-{i}\nstore:\n  layout: null\n  tiers:\n"
                f"    - {{kind: pool, capacity: 2GiB, path: {pool}}}\n"
                f"    - {{kind: ssd, capacity: 4GiB, path: {work / f'ssd{i}'}}}\n"
                f"conductor: {{urls: [{self.url}]}}\ntransfer: {{host: 127.0.0.1}}\n"
            )
            self.logs.append(open(work / f"node{i}.log", "wb"))
            self._start(["node", "--config", str(config)], self.logs[-1])
        time.sleep(3.0)  # the first object map is made bootstrap_s after the nodes register

    def _start(self, args: list[str], log) -> dict:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiercake.cli", *args], stdout=subprocess.PIPE, stderr=log, env=self.env
        )
        self.procs.append(proc)
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"tiercake {args[0]} did not start")
        return json.loads(line)

    def test_env(self, work: Path) -> dict:
        master = self.url.removeprefix("http://").rstrip("/")
        return {**self.env, **_mooncake_env(master, work), "PYTHONPATH": SHIM}

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs:
            log.close()
        for pool in self.pools:
            remove_pool(pool)


def _mooncake_env(master: str, work: Path) -> dict:
    """What Mooncake's tests read to find their master (each file reads a different name). Its lease
    TTL is 5 s on both sides: what the tests assume (Mooncake's master defaults to 10 s)."""
    config = work / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "localhost",
                "metadata_server": "http://127.0.0.1:8080/metadata",
                "global_segment_size": "1GB",
                "local_buffer_size": 512 << 20,
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": master,
            }
        )
    )
    return {
        "MASTER_SERVER": master,
        "MOONCAKE_MASTER": master,
        "MOONCAKE_CONFIG_PATH": str(config),
        "MC_METADATA_SERVER": "http://127.0.0.1:8080/metadata",
        "MOONCAKE_TE_META_DATA_SERVER": "http://127.0.0.1:8080/metadata",
        "MOONCAKE_PROTOCOL": "tcp",
        "PROTOCOL": "tcp",
        "DEVICE_NAME": "",
        "MOONCAKE_DEVICE": "",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }


def against_tiercake(repo: Path, work: Path) -> dict[str, str]:
    cluster = TiercakeCluster(work)
    try:
        return run_files(repo, cluster.test_env(work), work, [])
    finally:
        cluster.close()


def against_mooncake(repo: Path, work: Path) -> dict[str, str]:
    master = Path(sys.executable).with_name("mooncake_master")
    if not master.exists() or not shutil.which("unshare"):
        raise SystemExit("Mooncake's wheel (mooncake_master) or unshare is missing")
    out = work / "result.json"
    inner = (
        f"ip link set lo up && {master} --rpc_port {MASTER_PORT} --enable_http_metadata_server=true --default_kv_lease_ttl=5000 "
        f"--http_metadata_server_port 8080 > {work}/master.log 2>&1 & master=$!; sleep 2; "
        f"{sys.executable} {__file__} {repo} --inside {work} --json {out}; kill $master; wait"
    )
    subprocess.run(["unshare", "-n", "bash", "-c", inner], check=False)
    return json.loads(out.read_text()) if out.exists() else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path, help="a checkout of kvcache-ai/Mooncake")
    parser.add_argument("--against", default="tiercake,mooncake", help="tiercake, mooncake or both (comma)")
    parser.add_argument("--json", type=Path, help="write every test's outcome on each store here")
    parser.add_argument("--files", help="only these of the files (comma-separated paths in the checkout)")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # in Mooncake's namespace
    args = parser.parse_args()
    if args.files:
        os.environ["CONFORMANCE_FILES"] = args.files
    if args.inside is not None:
        got = run_files(
            args.repo, {**os.environ, **_mooncake_env(f"127.0.0.1:{MASTER_PORT}", args.inside)}, args.inside, []
        )
        args.json.write_text(json.dumps(got))
        return 0
    results: dict[str, dict[str, str]] = {}
    for store in args.against.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"mooncake-conformance-{store}-"))
        print(f"{store}:", file=sys.stderr)
        results[store] = against_tiercake(args.repo, work) if store == "tiercake" else against_mooncake(args.repo, work)
    if len(results) == 2:
        ours, theirs = results["tiercake"], results["mooncake"]
        for test in sorted(set(ours) | set(theirs)):
            if ours.get(test) != theirs.get(test):
                print(f"{test}: tiercake {ours.get(test, '-')}, mooncake {theirs.get(test, '-')}")
    for store, got in results.items():
        print(f"{store}: {sum(v == 'passed' for v in got.values())} of {len(got)} passed")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
