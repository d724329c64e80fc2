"""Offline analysis: what a trace says and what a policy would do on it, without a cluster.

- ``trace_stats``: reuse (stack) distance, prefetchability, residency; its ``ReuseTracker`` is also
  what the live conductor runs on its access stream.
- ``cache_sim``: the cache simulator (the registry's policy objects over one or several tiers) and
  the offline optimum.
- ``evaluate``: a policy scored against LRU and the optimum (``tiercake policy eval``).
- ``cluster_sim``: prefill and decode workers, queues and routing on a trace (``tiercake simulate``),
  through the same ``Router`` calls the live front makes.

The layer sits on ``policies`` (the policies it runs) and below everything live.
"""
