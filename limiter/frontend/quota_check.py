"""A tenant's quota, checked before the model server counts its prompt.

With ``tokenizer = "upstream"`` a prompt is counted by the model server (``/tokenize``)
before admission checks the tenant's quota: a throttled tenant cost the server a count per
request, however many it sent. Once admission refused a tenant for its quota in such a pool,
its next requests there (for QUOTA_CHECK_S after each refusal) read its bucket first, and one
whose least possible cost the bucket cannot hold within the class's admission wait is a 429
with no count. Any other tenant, and every pool counted locally, is left alone: no extra
Redis call on the common path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from limiter.config import ClassConfig, TenantConfig
from limiter.errors import Throttled
from limiter.frontend import openai_api as oa
from limiter.keys import PoolKeys
from limiter.redis_conn import REDIS_ERRORS

QUOTA_CHECK_S = 60.0  # how long after a quota refusal a tenant's bucket is read before counting
QUOTA_CHECKS_MAX = 10_000  # tenants checked so at once, per frontend


def admission_cost(prompt_tokens: int, max_tokens: int, cls: ClassConfig) -> float:
    """The weighted tokens admit.lua charges a request of class ``cls`` (its ``Cost``)."""
    return prompt_tokens * cls.weight + max_tokens * cls.out_weight


def least_cost(draft: oa.Draft, cls: ClassConfig) -> float:
    """The least weighted cost ``draft`` can have once its prompt is counted (a prompt of p
    tokens, 0 <= p < the context; max_tokens as given, else its default within the room
    left): rising in p up to the bend where the default stops filling the room, linear past
    it, so its least is at one end."""
    pool = draft.pool
    last = max(pool.context_tokens - 1, 0)

    def cost(p: int) -> float:
        room = pool.context_tokens - p
        out = draft.max_tokens if draft.max_tokens is not None else min(pool.default_max_tokens, room)
        return admission_cost(p, out, cls)

    return min(cost(0), cost(last))


class QuotaCheck:
    """The tenants to check before counting, per pool, and the check (one HMGET)."""

    def __init__(self, client: Any, pool_keys: Mapping[str, PoolKeys], upstream_counted: set[str],
                 redis_now_ms: Callable[[str], float]) -> None:
        self.client = client
        self.pool_keys = pool_keys
        self.upstream_counted = upstream_counted
        self.redis_now_ms = redis_now_ms
        self.until: dict[tuple[str, str], float] = {}  # (pool, tenant) -> time.monotonic() to stop

    def refused(self, pool: str, tenant: str) -> None:
        """Admission refused ``tenant`` for its quota in ``pool``."""
        if pool not in self.upstream_counted:
            return
        now = time.monotonic()
        if len(self.until) >= QUOTA_CHECKS_MAX and (pool, tenant) not in self.until:
            self.until = {k: t for k, t in self.until.items() if t > now}  # the lapsed go
            if len(self.until) >= QUOTA_CHECKS_MAX:
                return  # (bounded: a frontend's memory is not the tenants' to grow)
        self.until[(pool, tenant)] = now + QUOTA_CHECK_S

    def admitted(self, pool: str, tenant: str) -> None:
        self.until.pop((pool, tenant), None)

    async def refuse_if_spent(self, draft: oa.Draft, tenant: TenantConfig, cls: ClassConfig) -> None:
        """Raise :class:`Throttled` (the tenant's bucket: a 429) when ``tenant`` is checked and
        its bucket cannot hold :func:`least_cost` within the class's admission wait. The level
        is the bucket's as its last writer left it plus the refill since at the tenant's rate,
        as admit computes it. A Redis that does not answer leaves the decision to admit."""
        key = (draft.pool.name, tenant.name)
        until = self.until.get(key)
        if until is None:
            return
        if time.monotonic() >= until:
            del self.until[key]
            return
        try:
            tokens, ts = await self.client.hmget(self.pool_keys[draft.pool.name].tenant_bucket(tenant.name),
                                                 ["tokens", "ts"])
        except REDIS_ERRORS:
            return
        if tokens is None or ts is None:
            return  # a bucket not written yet is full
        rate, burst = tenant.rate_tokens_s, tenant.rate_tokens_s * tenant.burst_s
        elapsed_ms = max(self.redis_now_ms(draft.pool.name) - float(ts), 0.0)
        level = min(float(tokens) + rate * elapsed_ms / 1000, burst)
        need = min(least_cost(draft, cls), burst)  # admit asks min(cost, burst) of the bucket
        if level >= need or rate <= 0:
            return
        wait_ms = math.ceil((need - level) / rate * 1000)
        if wait_ms <= cls.admission_wait_ms:
            return  # admission would wait for it: counted as usual
        raise Throttled("tenant", wait_ms)
