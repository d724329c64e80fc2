"""``setup``'s arguments in each form it takes: tiercake's (the conductor's URL or URLs and keyword
settings), Mooncake's seven positional ones and their keyword names, or Mooncake's dict; sizes as
Mooncake writes them ('16MB', '1 GiB', a number of bytes); and which credential a store proves."""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

from tiercake.credentials import tenant_token
from tiercake.transfer.protocol import TENANT, Credential

from .errors import InvalidParams

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 1 << 10,
    "m": 1e6,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1e9,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1e12,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


def setup_form(args: tuple, kwargs: dict) -> tuple[object, dict]:
    """(conductor URL(s), the other settings) from any of setup's forms."""
    mooncake_names = (
        "local_hostname",
        "metadata_server",
        "global_segment_size",
        "local_buffer_size",
        "protocol",
        "rdma_devices",
        "master_server_addr",
    )
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        return _mooncake_setup(dict(args[0]))
    if len(args) >= 7 or "master_server_addr" in kwargs:
        named = dict(zip(mooncake_names, args))
        extra = (
            "engine",
            "enable_ssd_offload",
            "ssd_offload_path",
            "tenant_id",
            "enable_client_http_server",
            "client_http_port",
        )
        named.update(dict(zip(extra, args[7:])))
        named.update(kwargs)
        return _mooncake_setup(named)
    conductor = args[0] if args else kwargs.pop("conductor", None)
    if len(args) > 1:
        raise TypeError("tiercake's setup takes the conductor URL(s) and keyword arguments")
    allowed = {"config", "secret", "tenant_key", "token", "tenant", "transports", "connect_timeout"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise TypeError(f"setup got unknown arguments {sorted(unknown)}")
    if conductor is not None:
        conductor = _urls(conductor)
    return conductor, dict(kwargs)


def _urls(given) -> list[str]:
    """Conductor URLs from a string (comma-separated) or a list; ``host:port`` means http."""
    parts = given.split(",") if isinstance(given, str) else list(given)
    if not all(isinstance(u, str) for u in parts):
        raise InvalidParams(f"conductor URLs are strings, got {given!r}")
    urls = [u.strip() if "://" in u else f"http://{u.strip()}" for u in parts if u.strip()]
    if not urls:
        raise InvalidParams("setup needs the conductor's URL (or host:port)")
    odd = [u for u in urls if not u.startswith(("http://", "https://"))]
    if odd:
        raise InvalidParams(f"a conductor's URL is http:// or https://, got {odd[0]!r}")
    return urls


def _mooncake_setup(named: dict) -> tuple[list[str], dict]:
    master = named.get("master_server_addr") or named.get("master_server_address")
    if not master or not isinstance(master, str):
        raise InvalidParams("master_server_addr is the conductor's URL (or host:port)")
    for size in ("global_segment_size", "local_buffer_size"):
        if size in named:
            named[size] = _size(named[size], size)
    options: dict = {"hostname": str(named.get("local_hostname") or "")}
    if "local_buffer_size" in named:
        options["local_buffer"] = named["local_buffer_size"]
    tenant = named.get("tenant_id")
    if tenant:
        options["tenant"] = str(tenant)
    return _urls(master), options


def _size(value, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidParams(f"{what} is a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidParams(f"{what} is not negative")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    raise InvalidParams(f"{what}: {value!r} is not a size (a number of bytes, or '16MB', '1 GiB')")


@dataclass(frozen=True, slots=True)
class ClientCredential:
    """What a store proves to the node agents, as whom, and its token for the conductors."""

    credential: bytes | Credential
    identity: str
    token: str | None
    may_map_pools: bool  # a same-host store reads the node's pool in place (the cluster's own clients)


def client_credential(
    secret: bytes | str | None, tenant_key: bytes | str | None, tenant: str, identity: str | None, token: str | None
) -> ClientCredential:
    """The cluster secret (every tenant's objects, the node's pool in place), or a tenant's key
    (``tiercake.credentials``: that tenant's objects only, over the stream; proved under its tenant's
    name, and the control API's token too unless one is given)."""
    if (secret is None) == (tenant_key is None):
        raise ValueError("a store needs the cluster secret or its tenant's key (one of them)")
    if tenant_key is not None:
        key = tenant_key.encode() if isinstance(tenant_key, str) else tenant_key
        return ClientCredential(Credential(key, TENANT), tenant, token or tenant_token(tenant, key), False)
    own = identity or f"kvstore-{os.getpid()}-{secrets.token_hex(3)}"
    assert secret is not None  # one of the two, checked above
    return ClientCredential(secret.encode() if isinstance(secret, str) else secret, own, token, True)
