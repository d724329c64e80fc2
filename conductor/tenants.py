"""Who is asking: API keys to tenants, and a tenant to its cache namespace."""

from __future__ import annotations

from aiohttp import web

from tiercake.config import ServingConfig
from tiercake.errors import ApiError, bearer

TENANT_HEADER = "X-Tiercake-Tenant"


class Tenants:
    def __init__(self, serving: ServingConfig) -> None:
        self.api_keys = serving.all_api_keys()
        self.shared = serving.shared_namespace

    def of(self, request: web.Request) -> str:
        """The tenant of a request: its API key's when keys are configured (else a 401), or the tenant
        header (default ``default``)."""
        if self.api_keys:
            tenant = self.api_keys.get(bearer(request))
            if tenant is None:
                raise ApiError(401, "unknown API key: send Authorization: Bearer <key>", "authentication_error",
                               "invalid_api_key")
            return tenant
        tenant = request.headers.get(TENANT_HEADER, "default")
        if not tenant or "/" in tenant or len(tenant) > 128:
            raise ApiError(400, f"{TENANT_HEADER} must be 1-128 characters without '/'")
        return tenant

    def namespace(self, tenant: str) -> tuple[str, str]:
        """(index tenant, hashing salt): tenants share nothing unless the namespace is shared."""
        return ("shared", "") if self.shared else (tenant, tenant)
