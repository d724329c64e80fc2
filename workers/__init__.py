"""Prefill and decode worker processes, the node agent and the reference model (issue 5)."""
