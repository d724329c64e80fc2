"""The multi-host lab (``tiercake lab``) and the nemesis's faults on it, with real processes in real
network namespaces: one lab for the module, made by ``tiercake lab up`` as printed, asked through
its front from the machine's own namespace, each fault injected and healed under both workloads
(their zero figures asserted), then taken away by ``tiercake lab down``, which must leave no
namespace, link, process or shared-memory file behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiercake.bench.report import Report, machine
from tiercake.chaos.lab_run import Campaign, failed
from tiercake.lab.cluster import POOL, STATE
from tiercake.lab.hosts import PREFIX, RUN
from tiercake.lab.process import LabProcess

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab makes network namespaces: it needs root (CI runs as root)"),
]

TIERCAKE = [sys.executable, "-m", "tiercake.cli"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    shm_before = set(os.listdir("/dev/shm"))
    started = time.monotonic()
    lab = LabProcess(tmp_path_factory.mktemp("lab") / "lab", ["--hosts", "3"])
    try:
        lab.wait_ready()
        lab.cold_start = time.monotonic() - started
        lab.shm_before = shm_before
        yield lab
    finally:
        lab.stop()


def test_the_labs_front_answers_from_the_machine(lab):
    assert lab.url.startswith("http://198.18.") and lab.url.endswith(":8080"), lab.url
    assert [h.address.startswith("198.18.") for h in lab.hosts] == [True] * 3
    ask = [*TIERCAKE, "ask", "Hello, tiers across hosts!", "--url", lab.url, "--max-tokens", "8"]
    first = subprocess.run(ask, capture_output=True, text=True, timeout=120)
    second = subprocess.run(ask, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.split("\n")[0] == second.stdout.split("\n")[0]  # the same answer
    assert "cached" in second.stdout, second.stdout


def _no_root(argv: list[str]) -> subprocess.CompletedProcess:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    return subprocess.run(
        nobody + argv, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"}
    )


def test_without_root_the_lab_says_so_in_one_line(tmp_path):
    tmp_path.chmod(0o777)
    done = _no_root([*TIERCAKE, "lab", "up", "--hosts", "2", "--data-dir", str(tmp_path / "lab")])
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stdout + done.stderr
    assert "needs root" in lines[0], lines


async def _fault(lab: LabProcess, fault: str) -> Report:
    report = Report(bench="chaos-lab", machine=machine())
    async with Campaign(lab, quick=True, cold_start=lab.cold_start, progress=print) as campaign:
        await campaign.fault(fault, report)
    for f in report.figures:  # whole, in the captured output (an assertion's message is cut short)
        print(f"{f.name} = {f.value} of {f.limit} {f.params}")
    assert failed(report) == [], failed(report)
    figures = {f.name.split(".", 2)[2]: f for f in report.figures}
    for zero in ("acked_lost", "stale_reads", "nonlinearizable_keys", "wrong_answers"):
        assert figures[zero].value == 0, figures[zero]
    assert figures["recovery_s"].params["recovered"], figures["recovery_s"]
    assert figures["served_share"].value > 0, figures["served_share"]  # the front's host is never the cut one
    return report


async def test_the_etcd_leaders_host_isolated(lab):
    await _fault(lab, "isolate_etcd_leader")


async def test_a_nodes_host_isolated_until_its_slots_move_then_fenced(lab):
    report = await _fault(lab, "isolate_node")
    figures = {f.name: f for f in report.figures}
    refused, acked = (
        figures["partition.isolate_node.old_owner_refused"],
        figures["partition.isolate_node.old_owner_acked"],
    )
    assert refused.params["moved_slots"] > 0 and refused.value == refused.limit > 0, refused
    assert acked.value == 0 and refused.params["stale_answers"] == 0, (acked, refused)


async def test_the_two_conductors_split(lab):
    await _fault(lab, "split_conductors")


async def test_an_asymmetric_partition(lab):
    await _fault(lab, "asymmetric")


async def test_five_percent_loss_on_every_link(lab):
    await _fault(lab, "loss")


async def test_a_flapping_link(lab):
    await _fault(lab, "flap")


async def test_processes_killed_and_stopped_on_a_cut_off_host(lab):
    await _fault(lab, "kill_remote")


def test_lab_down_leaves_no_namespace_link_process_or_shared_memory(lab):
    assert (lab.root / STATE).exists() and lab.state is not None
    state, pids = lab.state, list(lab.pids)
    down = subprocess.run(
        [*TIERCAKE, "lab", "down", "--data-dir", str(lab.root)], capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0 and "tiercake lab is down" in down.stdout, down.stdout + down.stderr
    lab.proc.wait(60)  # the lab up it ended
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"{PREFIX}{state.tag}" not in namespaces and f"{PREFIX}{state.tag}" not in links
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"
    assert not list(RUN.glob(f"{state.tag}-*")), "mounts or files left"
    # the hosts' pools were in their own /dev/shm; other tests' pools may appear here meanwhile (xdist)
    leaked = {n for n in set(os.listdir("/dev/shm")) - lab.shm_before if n.startswith(Path(POOL).name)}
    assert not leaked, leaked
    again = subprocess.run(
        [*TIERCAKE, "lab", "down", "--data-dir", str(lab.root)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "no lab runs" in again.stdout, again.stdout + again.stderr
