"""``tiercake chaos --lab``: the nemesis's partitions (``tiercake.lab.nemesis``) on a three-host lab,
each under both workloads: the serving one (requests through the front, every answer checked
against a recompute) and the key-value one (concurrent clients, checksummed values, each key's
history checked for linearizability), a fresh set of keys for each fault. Per fault, figures
``partition.<fault>.acked_lost``, ``.stale_reads``, ``.nonlinearizable_keys``, ``.wrong_answers``
(each 0 when the contract holds), ``.served_share`` (requests answered right during the fault over
the rate just before) and ``.recovery_s`` (from the heal until the store answers, every host's node
agent and worker is a member again and requests are served at 60% of the rate before, over 4 s)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tiercake.bench.report import Report, machine
from tiercake.config import load_config
from tiercake.kvstore import AsyncStore, Durability, StoreApiError, TransferFailed
from tiercake.lab.nemesis import FAULTS, Findings, Nemesis, etcd_range
from tiercake.lab.process import LabProcess
from tiercake.replay import TokenMap
from tiercake.traces import synthetic_trace

from .kv import KvLoad
from .load import MAX_TOKENS, Load, Oracle

RATE_WINDOW_S = 4.0
FULL = 0.6  # of the rate before a fault: served again in full (two requests in flight: the rate is noisy)
RECOVERY_TIMEOUT_S = 90.0
DURABILITY = Durability(replicas=2, persist=True)  # what outlives a host cut off: a copy on another


async def run(quick: bool = False, faults: tuple[str, ...] = FAULTS, progress: Callable[[str], None] = print) -> Report:
    report = Report(bench="chaos-lab", machine=machine())
    with tempfile.TemporaryDirectory(prefix="tiercake-chaos-lab-") as tmp:
        started = time.monotonic()
        lab = LabProcess(Path(tmp) / "lab", ["--hosts", "3", "--port", "8080"])
        try:
            await asyncio.to_thread(lab.wait_ready)
            cold_start = time.monotonic() - started
            progress(f"the lab is up in {cold_start:.0f} s: {lab.url}")
            async with Campaign(lab, quick, cold_start, progress) as campaign:
                for fault in faults:
                    await campaign.fault(fault, report)
        finally:
            output = await asyncio.to_thread(lab.stop)
            if "tiercake lab is down" not in output:
                progress(output[-2000:])
    return report


class Campaign:
    """Faults on a running lab, one after another, under the serving workload (running throughout)
    and, per fault, a key-value workload of its own keys. The tests share one per lab."""

    def __init__(
        self, lab: LabProcess, quick: bool, cold_start: float, progress: Callable[[str], None] = print
    ) -> None:
        self.lab, self.cold_start, self.progress = lab, cold_start, progress
        self.load = _serving(lab, quick)
        self.nemesis = Nemesis(
            lab, hold_s=6.0 if quick else 15.0, loss_s=10.0 if quick else 30.0, flaps=5 if quick else 15
        )
        self._writer = _store(lab)

    async def __aenter__(self) -> Campaign:
        self.load.start()
        writer = await self._writer.open()
        self.nemesis.writer = lambda name, value: _until_put(writer, name, value)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.load.stop()
        finally:
            await self._writer.close()

    async def fault(self, fault: str, report: Report) -> None:
        """``fault`` injected, held and healed, once the lab is whole again after the one before (every
        host's node agent and worker a member, or 30 s); its figures added to ``report``."""
        await _whole(self.lab, 30.0)  # a fault that never recovered has said so: go on regardless
        await _one(fault, self.lab, self.nemesis, self.load, report, self.cold_start, self.progress)


async def _whole(lab: LabProcess, timeout: float) -> tuple[list[str], float]:
    """Until every host's node agent and worker are members again: what is still missing after
    ``timeout`` (empty: the lab is whole), and when it was seen whole."""
    from tiercake.conductor.client import Client, ConductorError

    wanted = {h.name for h in lab.hosts}
    deadline = time.monotonic() + timeout
    missing: list[str] = ["(the conductors did not answer)"]
    async with Client(lab.control_urls, token=lab.token, timeout=5) as client:
        while True:
            try:
                members = (await client.cluster()).members
                nodes = {m.id for m in members if m.role == "node"}
                workers = {m.id.split("-", 1)[0] for m in members if m.role != "node"}
                missing = [f"{h}'s node agent" for h in sorted(wanted - nodes)]
                missing += [f"{h}'s worker" for h in sorted(wanted - workers)]
                if not missing:
                    return [], time.monotonic()
            except (ConductorError, OSError):
                pass
            if time.monotonic() > deadline:
                return missing, time.monotonic()
            await asyncio.sleep(0.2)


async def _diagnosis(lab: LabProcess, missing: list[str]) -> str:
    """What a fault that never recovered left behind, for its report: each conductor's own view of the
    members, the member and liveness records in etcd, and the log tails of the conductors and of the
    hosts still missing (the lab's logs go with its temporary folder)."""
    from tiercake.conductor.client import Client, ConductorError
    from tiercake.conductor.liveness import LIVENESS
    from tiercake.conductor.membership import MEMBERS

    lines = [f"missing: {missing}"]
    for url in lab.control_urls:
        async with Client([url], token=lab.token, timeout=3, retries=1) as client:
            try:
                view = sorted(m.id for m in (await client.cluster()).members)
                lines.append(f"{url} sees {view}")
            except (ConductorError, OSError) as exc:
                lines.append(f"{url} did not answer: {exc}")
    for prefix in (MEMBERS, LIVENESS):
        try:
            records = await asyncio.to_thread(etcd_range, lab.hosts[-1], prefix)
            lines.append(f"etcd {prefix.decode()}: " + "; ".join(f"{k.decode()} lease={lease}" for k, lease in records))
        except (OSError, ValueError, KeyError) as exc:
            lines.append(f"etcd {prefix.decode()}: not read ({exc})")
    hosts = {m.split("'", 1)[0] for m in missing}
    logs = sorted(lab.root.glob("logs/*-conductor.log")) + [
        p for h in sorted(hosts) for p in sorted(lab.root.glob(f"logs/{h}-*.log"))
    ]
    theirs = [h.address for h in lab.hosts if h.name in hosts]
    lines += await asyncio.to_thread(_tails, logs, theirs)
    return "\n".join(lines)


def _tails(logs: list[Path], theirs: list[str]) -> list[str]:
    """Each log's last lines: what the missing hosts (at ``theirs``) asked, and every other line."""
    lines: list[str] = []
    for path in logs:
        said = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if "aiohttp.access" not in line or any(f"{a} " in line for a in theirs)
        ]
        lines += [f"--- {path.name}", *said[-25:]]
    return lines


async def _until_put(store: AsyncStore, name: str, value: bytes, timeout: float = 30.0) -> None:
    """An upsert, tried again while its outcome is unknown (its connection to the old owner broke)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await store.put(name, value, replace=True, durability=DURABILITY)
        except TransferFailed:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _store(lab: LabProcess) -> AsyncStore:
    return AsyncStore(lab.control_urls, secret=lab.secret, token=lab.token, retry_s=20.0, timeout_s=3.0)


def _serving(lab: LabProcess, quick: bool) -> Load:
    config = load_config(lab.config_path())
    records = synthetic_trace(
        30 if quick else 300, tenants=2, system_prompts=2, system_blocks=4, turn_blocks=(1, 3), seed=7
    )
    tokens = TokenMap(16)
    prompts = [(tokens.prompt(r, 320 - MAX_TOKENS), r.tenant) for r in records]
    return Load(lab.url, Oracle(config), prompts)


async def _one(fault: str, lab: LabProcess, nemesis: Nemesis, load: Load, report: Report, cold_start: float, progress):
    kv = KvLoad(lambda: _store(lab), clients=2, durability=DURABILITY, large=16 << 10, pause_s=0.02, prefix=f"{fault}-")
    await kv.start()
    t = load.tally
    ok0 = t.ok
    await asyncio.sleep(RATE_WINDOW_S)
    rate_before = (t.ok - ok0) / RATE_WINDOW_S
    progress(f"{fault} ... ({rate_before:.1f} requests/s before)")
    at, ok_at, wrong_at = time.monotonic(), t.ok, t.wrong
    healed = await getattr(nemesis, fault)()
    lasted = max(healed - at, 1e-9)
    served = t.ok - ok_at
    whole = asyncio.ensure_future(_whole(lab, RECOVERY_TIMEOUT_S))  # measured from the heal too
    recovery = await _recovered(lab, load, healed, rate_before)
    missing, whole_at = await whole
    if missing:  # served again, but not every host's processes are members: not recovered
        recovery = None
        progress(await _diagnosis(lab, missing))
    elif recovery is not None:
        recovery = max(recovery, whole_at - healed)
    await kv.read_back()
    await kv.stop()
    verdict = kv.verdict()
    name = f"partition.{fault}"
    keys = len(kv.steady) + len(kv.churn)
    acked = sum(o.kind != "get" and o.returned is not None for ops in kv.history.values() for o in ops)
    reads = sum(o.kind == "get" and o.returned is not None for ops in kv.history.values() for o in ops)
    report.add(f"{name}.acked_lost", verdict.lost, "reads", max(acked, 1), limit_name="writes acknowledged")
    report.add(f"{name}.stale_reads", verdict.stale, "reads", max(reads, 1), limit_name="reads answered")
    report.add(
        f"{name}.nonlinearizable_keys",
        len(verdict.violations),
        "keys",
        keys,
        limit_name="keys",
        first=verdict.violations[:1],
        torn=verdict.torn,
        unknown_outcome=verdict.unknown,
        ops=verdict.ops,
    )
    report.add(f"{name}.wrong_answers", t.wrong - wrong_at, "answers", max(served, 1), limit_name="answers during it")
    report.add(
        f"{name}.served_share",
        served / lasted,
        "requests/s",
        max(rate_before, 1e-9),
        limit_name="requests/s just before",
        seconds=round(lasted, 1),
    )
    report.add(
        f"{name}.recovery_s",
        recovery if recovery is not None else RECOVERY_TIMEOUT_S,
        "s",
        cold_start,
        limit_name="the lab's cold start, same run",
        recovered=recovery is not None,
        missing=missing,
    )
    found = nemesis.found.get(fault)
    if found is not None:
        _fence_figures(report, name, found)
    progress(
        f"{fault}: {lasted:.1f} s, {served} answered ({t.wrong - wrong_at} wrong), back {recovery} s after the heal; "
        f"kv {verdict.ops} ops, {verdict.lost} lost, {verdict.stale} stale, {len(verdict.violations)} keys not linearizable"
    )


def _fence_figures(report: Report, name: str, found: Findings) -> None:
    report.add(
        f"{name}.old_owner_acked",
        found.fence_acked,
        "requests",
        max(found.fence_asked, 1),
        limit_name="requests sent to the old owner with its old map, just healed",
        answers=found.statuses[:16],
    )
    report.add(
        f"{name}.old_owner_refused",
        found.fence_refused,
        "requests",
        max(found.fence_asked, 1),
        limit_name="requests sent to the old owner with its old map, just healed",
        stale_answers=found.fence_stale,
        moved_slots=found.moved_slots,
    )


async def _recovered(lab: LabProcess, load: Load, healed: float, rate_before: float) -> float | None:
    """Seconds from the heal until the service is whole again: a put and a get of the store went
    through, and the requests answered right in a window of ``RATE_WINDOW_S`` came to ``FULL`` of
    the rate before the fault (when that window began)."""
    deadline = healed + RECOVERY_TIMEOUT_S
    kv_at = None
    async with _store(lab) as store:
        while time.monotonic() < deadline:
            try:
                await store.put("recovery-probe", b"back", replace=True)
                await store.get("recovery-probe")
                kv_at = time.monotonic()
                break
            except (StoreApiError, TransferFailed, OSError):
                await asyncio.sleep(0.2)
    if kv_at is None:
        return None
    wanted = FULL * rate_before * RATE_WINDOW_S
    while time.monotonic() < deadline:
        answered = [at for at, _, _ in load.tally.served if at >= healed]
        for i, begun in enumerate(answered):
            if begun + RATE_WINDOW_S > time.monotonic():
                break  # that window is not over yet
            if sum(1 for at in answered[i:] if at < begun + RATE_WINDOW_S) >= wanted:
                return max(begun, kv_at) - healed
        await asyncio.sleep(0.5)
    return None


def failed(report: Report) -> list[str]:
    """What fails a lab chaos run: any acknowledged write lost, stale read, key not linearizable, wrong
    answer, write acknowledged by a fenced owner, or a fault never recovered from."""
    reasons = []
    for f in report.figures:
        tail = f.name.rsplit(".", 1)[1]
        if (
            tail in ("acked_lost", "stale_reads", "nonlinearizable_keys", "wrong_answers", "old_owner_acked")
            and f.value
        ):
            reasons.append(f"{f.name} = {f.value:.0f}")
        if tail == "recovery_s" and not f.params["recovered"]:
            reasons.append(f"never recovered from {f.name.split('.')[1]}")
    return reasons
