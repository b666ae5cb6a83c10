"""Small helpers shared by the Redis-level tests."""

from __future__ import annotations

import itertools
from typing import Any

from limiter.keys import PoolKeys
from limiter.scripts import Admitted, Scripts

_ids = itertools.count(1)


async def admit(scripts: Scripts, keys: PoolKeys, *, cls: str = "P1", tenant: str = "t1",
                input_tokens: int = 100, max_tokens: int = 10, tenant_rate: float = 1e9,
                tenant_burst: float = 1e9, max_inflight: int = 0, max_wait_ms: int = 0,
                request_id: str | None = None, frontend: str = "fe1") -> Admitted:
    rid = request_id or f"req-{next(_ids)}"
    return await scripts.admit(
        keys, request_id=rid, tenant=tenant, cls=cls, input_tokens=input_tokens, max_tokens=max_tokens,
        tenant_rate=tenant_rate, tenant_burst=tenant_burst, tenant_max_inflight=max_inflight,
        max_wait_ms=max_wait_ms, frontend_id=frontend, payload=b"{}")


def dump_all(client: Any) -> dict[bytes, bytes]:
    """Every key's DUMP (type, value, encoding) and TTL presence: byte-for-byte state."""
    out = {}
    for key in sorted(client.keys("*")):
        out[key] = (client.dump(key), client.pttl(key) > 0)
    return out
