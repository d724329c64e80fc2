"""The worker process's own rules (its serving is tested through real clusters in tests/cluster)."""

import pytest

from tiercake.config import TiercakeConfig
from tiercake.workers.worker import Worker

CONFIG = {"store": {"tiers": [{"kind": "pool", "capacity": "1MiB"}]}}


def test_a_worker_names_its_role_and_says_when_it_is_not_started():
    config = TiercakeConfig.model_validate(CONFIG)
    with pytest.raises(ValueError, match="unknown role"):
        Worker(config, role="both")
    worker = Worker(config, role="prefill")
    with pytest.raises(RuntimeError, match="not started"):  # asked before start made its engine
        assert worker.serving is None
