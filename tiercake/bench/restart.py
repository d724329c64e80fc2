"""`tiercake bench restart`: how long a full node agent takes to come back. A conductor and a node
agent (processes of their own), the node's SSD filled with persisted key-value objects (512 MiB with
``--quick``, 2 GiB otherwise, of 1 MiB each) and its pool full; then it is SIGKILLed and started again
several times. Per restart: the seconds until it listens (its address printed) and until it serves
(a client's get of an object answers), against the limit of 3 s (issue 49: it took 8-38 s, reading
every object whole). ``load``: that many processes spinning on the CPU meanwhile."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path

from .report import Report, machine, spinners

LIMIT_S = 3.0
OBJECT = 1 << 20


async def run(quick: bool = False, load: int = 0) -> Report:
    from tiercake.kvstore import AsyncStore, Durability
    from tiercake.tiers.pool import remove_pool
    from tiercake.up import Child

    report = Report(bench="restart", machine=machine())
    total = (512 if quick else 2048) * OBJECT
    restarts = 2 if quick else 5
    secret, token = secrets.token_hex(24), secrets.token_hex(16)
    env = {
        **os.environ,
        "TIERCAKE_SECRET": secret,
        "TIERCAKE_TOKEN": token,
        "TIERCAKE_NODE_SECRET": secrets.token_hex(24),
    }
    burners = spinners(load)
    with tempfile.TemporaryDirectory(prefix="tiercake-bench-restart-") as tmp:
        root = Path(tmp)
        pool = Path(f"/dev/shm/tiercake-bench-restart-{os.getpid()}")
        conductor = Child(
            "conductor", ["conductor", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"], env, root
        )
        node = None
        try:
            url = conductor.wait_announce(60)["url"]
            config = root / "node.yaml"
            config.write_text(
                "node_id: bench-node\nstore:\n  layout: null\n  tiers:\n"
                f"    - {{kind: pool, capacity: 256MiB, path: {pool}}}\n"
                f"    - {{kind: ssd, capacity: {total * 5 // 4}, path: {root / 'ssd'}}}\n"
                f"conductor: {{urls: [{json.dumps(url)}]}}\ntransfer: {{host: 127.0.0.1}}\n"
            )
            node = Child("node", ["node", "--config", str(config)], env, root)
            node.wait_announce(60)
            async with AsyncStore([url], secret=secret, token=token, retry_s=60.0) as store:
                await _fill(store, total // OBJECT, Durability(persist=True))
                listened, served = [], []
                for _ in range(restarts):
                    node.proc.kill()
                    node.proc.wait(10)
                    started = time.monotonic()
                    node.start()
                    node.wait_announce(120)
                    listened.append(time.monotonic() - started)
                    await store.get("restart-0")
                    served.append(time.monotonic() - started)
            params = {"stored_bytes": total, "objects": total // OBJECT, "restarts": restarts, "load": load}
            for name, seconds in (("restart.listen_s", listened), ("restart.serve_s", served)):
                report.add(
                    name,
                    max(seconds),
                    "s",
                    LIMIT_S,
                    limit_name="3 s (issue 49)",
                    each=[round(s, 2) for s in seconds],
                    **params,
                )
        finally:
            for child in (node, conductor):
                if child is not None:
                    child.stop()
            for burner in burners:
                burner.kill()
            remove_pool(pool)
    return report


async def _fill(store, count: int, durability) -> None:
    value = os.urandom(OBJECT)
    names = [f"restart-{i}" for i in range(count)]
    for lo in range(0, count, 32):
        chunk = names[lo : lo + 32]
        answers = await store.put_many(chunk, [value] * len(chunk), durability=durability)
        if any(a is not None for a in answers):
            raise RuntimeError(f"the node did not take the objects: {next(a for a in answers if a is not None)}")
