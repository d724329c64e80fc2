"""tiercake's reference engine, in nano-vllm's shape: ``engine`` (``ReferenceEngine``, the worker
contract's ``ServingEngine``), ``scheduler`` (continuous batching), ``runner`` (``ModelRunner``: the
model over paged KV in the gpu tier, the cached prefix reused from wherever it is held) and ``model``
(the reference model itself)."""
