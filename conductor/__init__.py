"""Control plane: placement index, etcd persistence, membership, routing, HTTP API (issue 4)."""
