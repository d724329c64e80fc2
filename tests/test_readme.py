"""The README's store example runs as written (it once had undefined names and a payload of the wrong
dtype), and its policy example is a complete policy the registry accepts."""

import os
import subprocess
import sys
from pathlib import Path

from tiercake.tiers.pool import remove_pool

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _block(after: str) -> str:
    return README.split(after, 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_the_store_example_runs(tmp_path):
    (tmp_path / "tiercake.yaml").write_text(
        "store:\n  tiers:\n"
        f"    - {{kind: pool, capacity: 4MiB, path: /dev/shm/tiercake-readme-{os.getpid()}}}\n"
        f"    - {{kind: ssd, capacity: 16MiB, path: {tmp_path / 'ssd'}}}\n")
    (tmp_path / "example.py").write_text(_block("## Python API"))
    try:
        done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        remove_pool(f"/dev/shm/tiercake-readme-{os.getpid()}")
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_policy_example_is_a_whole_policy():
    namespace: dict = {}
    exec(_block("### Writing a policy"), namespace)  # noqa: S102 - the README's own code
    policy = namespace["Fifo"]()
    for key in "abc":
        policy.on_insert(key)
    policy.on_access("a")
    assert policy.victims(2, can_evict=lambda k: k != "a") == ["b", "c"]
    assert len(policy) == 1 and "a" in policy and "b" not in policy
    policy.on_remove("a")
    policy.on_remove("a")  # idempotent
    assert len(policy) == 0
