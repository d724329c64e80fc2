"""Moving bytes between tiers, processes and nodes: transports, batching, the transfer server (issue 3)."""
