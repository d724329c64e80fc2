"""Who is asking: API keys to tenants, a tenant to its cache namespace, and what a tenant may use."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict

from aiohttp import web

from tiercake.config import ServingConfig, TenantQuota
from tiercake.errors import ApiError, bearer

log = logging.getLogger(__name__)
TENANT_HEADER = "X-Tiercake-Tenant"


SHARED_CACHE_NOTE = (
    "no API keys are configured: callers that send no tenant header all share the tenant "
    "'default' and its cache, so one can tell from its cached tokens whether another sent a "
    "prompt. Give each caller an API key (serving.api_keys: key -> tenant), or send "
    f"{TENANT_HEADER} per caller"
)


class Tenants:
    def __init__(self, serving: ServingConfig) -> None:
        self.api_keys = serving.all_api_keys()
        self.shared = serving.shared_namespace
        self._said = False

    def of(self, request: web.Request) -> str:
        """The tenant of a request: its API key's when keys are configured (else a 401), or the tenant
        header (default ``default``)."""
        if self.api_keys:
            tenant = self.api_keys.get(bearer(request))
            if tenant is None:
                raise ApiError(
                    401, "unknown API key: send Authorization: Bearer <key>", "authentication_error", "invalid_api_key"
                )
            return tenant
        tenant = request.headers.get(TENANT_HEADER, "default")
        if not tenant or "/" in tenant or len(tenant) > 128:
            raise ApiError(400, f"{TENANT_HEADER} must be 1-128 characters without '/'")
        if not self._said:  # said once, where an operator reads the front's log
            self._said = True
            log.warning("front: %s", SHARED_CACHE_NOTE)
        return tenant

    def namespace(self, tenant: str) -> tuple[str, str]:
        """(index tenant, hashing salt): tenants share nothing unless the namespace is shared."""
        return ("shared", "") if self.shared else (tenant, tenant)


class Quotas:
    """Per tenant: requests in flight, and tokens per minute as a token bucket holding a minute's
    worth (refilled continuously). ``admit`` is held for a request's whole life; a request over a
    limit is a 429 with Retry-After (when the bucket will hold its tokens, or 1 s for in-flight)."""

    def __init__(self, serving: ServingConfig) -> None:
        self.default, self.per_tenant = serving.quota, serving.tenant_quotas
        self.in_flight: dict[str, int] = defaultdict(int)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens available, at)
        self.refused: dict[str, int] = defaultdict(int)

    def of(self, tenant: str) -> TenantQuota:
        return self.per_tenant.get(tenant, self.default)

    @contextlib.contextmanager
    def admit(self, tenant: str, tokens: int):
        quota = self.of(tenant)
        if quota.requests_in_flight is not None and self.in_flight[tenant] >= quota.requests_in_flight:
            self._refuse(tenant, f"tenant {tenant!r} has {quota.requests_in_flight} requests in flight, its limit", 1)
        if quota.tokens_per_minute is not None:
            self._take(tenant, tokens, quota.tokens_per_minute)
        self.in_flight[tenant] += 1
        try:
            yield
        finally:
            self.in_flight[tenant] -= 1

    def _take(self, tenant: str, tokens: int, per_minute: int) -> None:
        if tokens > per_minute:
            raise ApiError(
                400,
                f"{tokens} tokens (prompt + max_tokens) exceed tenant {tenant!r}'s limit of "
                f"{per_minute} per minute: no wait would admit the request",
                code="tenant_quota",
            )
        now = time.monotonic()
        available, at = self._buckets.get(tenant, (float(per_minute), now))
        available = min(per_minute, available + (now - at) * per_minute / 60)
        if available < tokens:
            self._buckets[tenant] = (available, now)
            wait = (tokens - available) * 60 / per_minute
            self._refuse(tenant, f"tenant {tenant!r} is over its {per_minute} tokens per minute", math.ceil(wait))
        self._buckets[tenant] = (available - tokens, now)

    def _refuse(self, tenant: str, why: str, retry_after: int) -> None:
        self.refused[tenant] += 1
        raise ApiError(
            429,
            f"{why}; retry in {retry_after} s",
            "rate_limit_error",
            "tenant_quota",
            headers={"Retry-After": str(retry_after)},
            retryable=True,
        )
