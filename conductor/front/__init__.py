"""The front: the OpenAI-compatible API a conductor serves beside its control plane. ``frontend`` puts
it together (the process's composition root for the serving side); ``openai_api`` and
``openai_models`` the adapter and its request types; ``dispatch`` one request through the cluster;
``worker_client`` the worker contract's client side; ``tenants`` keys, namespaces and quotas;
``serving_stats`` and ``access_stats`` what it measures; ``operator`` the operator's endpoints."""
