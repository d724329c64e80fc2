"""A ``mooncake`` package that is tiercake: put ``PATH`` first on ``sys.path`` (``PYTHONPATH``) and code
that imports ``mooncake.store`` (vLLM's ``MooncakeStoreConnector``, SGLang's HiCache Mooncake
backend) runs on tiercake's key-value store, unchanged:

    PYTHONPATH=$(python -m tiercake.kvstore.as_mooncake) vllm serve ... --kv-transfer-config \\
        '{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}'

with ``MOONCAKE_CONFIG_PATH``'s ``master_server_address`` naming the conductor (``host:port``) and the
cluster's secret and token in ``$TIERCAKE_SECRET`` and ``$TIERCAKE_TOKEN``. Only the store's module
(``mooncake.store``, ``mooncake.async_store``) is there: Mooncake's transfer engine is not."""

from pathlib import Path

PATH = str(Path(__file__).resolve().parent)
