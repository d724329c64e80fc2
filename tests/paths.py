"""Where the tests find the repository and their own support files (tests sit one folder down, by the
package they test, so ``__file__`` arithmetic is kept here, once). Nothing outside the repository:
a test makes the data it needs."""

import os
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
README = ROOT / "README.md"

# This run's mark, in the name of every /dev/shm file its tests make (xdist's workers and every process
# a test starts inherit it): the shm guard removes what this run left, never another run's pools
SUITE = os.environ.setdefault("TIERCAKE_TEST_SUITE", uuid.uuid4().hex[:8])


def shm_file(what: str) -> Path:
    """A /dev/shm path for a test's pool, marked as this run's (``what`` makes it unique)."""
    return Path(f"/dev/shm/tiercake-{SUITE}-{what}")


# Where the tests of a GPU path put their tensors: "cpu" runs the same path on the CPU; on a machine with a
# GPU, tiercake/gpu_check.py sets TIERCAKE_TEST_DEVICE=cuda
KV_DEVICE = os.environ.get("TIERCAKE_TEST_DEVICE", "cpu")
