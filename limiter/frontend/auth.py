"""Identity: an API key maps to a tenant; the tenant's config decides the class.

Priority comes from identity, not from the client's say-so: a request may only ask for
a class at or *below* its key's ceiling (header ``X-QoS-Class``). Keys live in config as
sha256 digests; the presented key is hashed and compared against every stored digest
with :func:`hmac.compare_digest`, without an early exit, so the time taken does not
depend on which digest (if any) matched.
"""

from __future__ import annotations

import hashlib
import hmac

from multidict import CIMultiDictProxy

from limiter.config import QosConfig, TenantConfig
from limiter.frontend.errors import ApiError

CLASS_HEADER = "X-QoS-Class"


def one_header(headers: CIMultiDictProxy[str], name: str) -> str | None:
    """The value of a header sent at most once; a 400 for one sent twice or more. With two
    ``Authorization`` headers the first was taken: a gateway that adds its own key instead of
    replacing the client's ran the request as whatever key the client put first (a review)."""
    values = headers.getall(name, [])
    if len(values) > 1:
        raise ApiError(400, f"The {name} header was sent {len(values)} times: send it once",
                       code="duplicate_header", param=name)
    return values[0] if values else None


class KeyRing:
    def __init__(self, cfg: QosConfig) -> None:
        self._entries: list[tuple[bytes, TenantConfig]] = [
            (bytes.fromhex(digest), tenant) for tenant in cfg.tenants for digest in tenant.key_sha256
        ]

    def lookup(self, key: str) -> TenantConfig | None:
        presented = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: TenantConfig | None = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def identify(self, authorization: str | None) -> TenantConfig:
        """The tenant behind an ``Authorization: Bearer <key>`` header, else a 401."""
        if not authorization:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'",
                           code="missing_api_key", outcome="unauthorized")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Malformed Authorization header: expected 'Bearer <key>'",
                           code="invalid_api_key", outcome="unauthorized")
        tenant = self.lookup(key)
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", outcome="unauthorized")
        return tenant


def resolve_class(cfg: QosConfig, tenant: TenantConfig, requested: str | None) -> str:
    """The tenant's default class, or the requested one if it is at or below the ceiling."""
    if requested is None or requested.strip() == "":
        return tenant.default_class
    name = requested.strip()
    names = cfg.class_names()
    if name not in names:
        raise ApiError(400, f"Unknown class {name[:64]!r} in {CLASS_HEADER} (classes: {', '.join(names)})",
                       code="invalid_class", param=CLASS_HEADER)
    if cfg.class_rank(name) < cfg.class_rank(tenant.max_class):
        raise ApiError(403, f"This key may use class {tenant.max_class} or lower, not {name}",
                       code="class_not_allowed", param=CLASS_HEADER, outcome="forbidden")
    return name


def require_admin(tenant: TenantConfig) -> None:
    if not tenant.admin:
        raise ApiError(403, "This endpoint needs an admin key", code="admin_required", outcome="forbidden")
