"""The node agent (``agent.py``: the node's tiers behind a transfer server, re-registered and
re-reported through ``workers.conductor_link``) and the node's side of the key-value store
(``objects/``: the slots it serves, the object operations, replication to the slots' backups)."""
