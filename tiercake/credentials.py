"""Who may do what, in keys derived from the cluster secret: the one place that makes and checks a
tenant's credential, for the transfer port (``transfer.protocol.Credential``) and the control API.

A tenant's key is an HMAC of the cluster secret and the tenant's name: every node agent and conductor
holds the cluster secret, so each checks a tenant's key with no list of keys to keep, and the key
gives away nothing of the secret or of another tenant's key. On the transfer port it reaches that
tenant's objects and nothing else; on the control API, as the bearer token ``tenant.<name>.<key>``,
only what a key-value store client reads there (the object map, the members, the leader)."""

from __future__ import annotations

import hashlib
import hmac

TENANT_TOKEN_PREFIX = "tenant."
# what a tenant's token may ask of the control API: what its key-value store client needs to find nodes
TENANT_READS = frozenset({("GET", "/v1/objects/map"), ("GET", "/v1/members"), ("GET", "/v1/leader")})


def tenant_key(cluster_secret: bytes, tenant: str) -> bytes:
    """The key of ``tenant``'s clients (64 hex characters)."""
    return hmac.new(cluster_secret, b"tiercake tenant key\0" + tenant.encode(), hashlib.sha256).hexdigest().encode()


def tenant_token(tenant: str, key: bytes | str) -> str:
    """The control API's bearer token of a tenant's key."""
    return f"{TENANT_TOKEN_PREFIX}{tenant}.{key.decode() if isinstance(key, bytes) else key}"


def tenant_of_token(token: str, cluster_secret: bytes) -> str | None:
    """The tenant whose valid token this is, else None (compared in constant time)."""
    if not token.startswith(TENANT_TOKEN_PREFIX):
        return None
    tenant, _, key = token[len(TENANT_TOKEN_PREFIX) :].rpartition(".")
    if not tenant or not hmac.compare_digest(key.encode(), tenant_key(cluster_secret, tenant)):
        return None
    return tenant
