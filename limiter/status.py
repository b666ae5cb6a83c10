"""A read-only QoS snapshot built from Redis alone (the admin endpoint; ``qos status``).

Per pool and class: the current rate, burst and ceiling (controller-owned, from the policy
hash), the guarantee (and, where it binds, ceiling) bucket refilled to Redis' now exactly as
the scripts compute it, queued requests and their reserved cost, backlogged tenants, leased
requests, SLO compliance (``keys.compliance``, written by the controller; null when absent)
and the lifetime counters; per worker and frontend, seconds since the last heartbeat. Reads
only: safe to call at any rate from any process.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from limiter.config import PoolConfig, QosConfig
from limiter.errors import RedisUnavailable
from limiter.keys import PoolKeys, policy_text
from limiter.redis_conn import eviction_risk, map_redis_errors, redis_now_ms


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _f(v: Any) -> float | None:
    """A stored number, or None (absent, not a number, or not finite: ``--json`` printed
    NaN, which is not JSON)."""
    if v is None:
        return None
    try:
        x = float(_s(v))
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def bucket_level(tokens: float | None, ts: float | None, rate: float, burst: float, now_ms: float) -> float:
    """lua/include/bucket.lua's bucket_get: a missing bucket is full; refill, cap at burst."""
    if tokens is None or ts is None:
        return burst
    return min(burst, tokens + rate * max(now_ms - ts, 0.0) / 1000.0)


def _ages(rows: list[tuple[Any, float]], now_ms: float) -> dict[str, dict[str, float]]:
    return {_s(m): {"last_seen_s": round(max(now_ms - score, 0.0) / 1000.0, 3)} for m, score in rows}


UNREACHABLE = "its Redis shard cannot be reached"
# A pool's status read longer than this counts its shard as out of reach: under the client's
# 5 s socket timeout, so a shard that does not answer leaves the others' figures current.
POOL_READ_S = 3.0
T = TypeVar("T")


async def snapshot(client: Any, cfg: QosConfig) -> dict[str, Any]:
    """The status of every configured pool; raises RedisUnavailable if Redis cannot answer
    for any. A pool whose server (a cluster's shard) does not answer while others do is
    ``{"model": ..., "unreachable": UNREACHABLE}``: one shard down hid every pool's status."""
    clocks: dict[str, float] = {}  # pool -> its shard's now, ms
    read = await each_pool(cfg.pools, lambda pool: _pool_status(client, cfg, pool, clocks))
    down = [r for r in read.values() if isinstance(r, RedisUnavailable)]
    if down and len(down) == len(cfg.pools):
        raise down[0]
    out: dict[str, Any] = {"now_ms": int(next(clocks[p.name] for p in cfg.pools if p.name in clocks))}
    out["pools"] = {name: {"model": cfg.pool(name).model_name, "unreachable": UNREACHABLE}
                    if isinstance(r, RedisUnavailable) else r for name, r in read.items()}
    return out


async def each_pool(pools: Sequence[PoolConfig], read: Callable[[PoolConfig], Awaitable[T]]
                    ) -> dict[str, T | RedisUnavailable]:
    """``read(pool)`` of every pool, the pools at the same time, each within
    :data:`POOL_READ_S`: pool name -> its result, or the RedisUnavailable that stood for it.
    A shard that does not answer at all held each of its pools' reads for the client's 5 s
    socket timeout, one pool after another (``qos top`` froze for as long)."""

    async def one(pool: PoolConfig) -> T | RedisUnavailable:
        try:
            async with asyncio.timeout(POOL_READ_S):
                with map_redis_errors():
                    return await read(pool)
        except RedisUnavailable as exc:
            return exc
        except TimeoutError:
            return RedisUnavailable(f"pool {pool.name}: Redis did not answer within {POOL_READ_S:g} s")

    # every read ends (each is bounded) before another error is raised: none is left writing
    results = await asyncio.gather(*(one(p) for p in pools), return_exceptions=True)
    if failed := [r for r in results if isinstance(r, BaseException) and not isinstance(r, RedisUnavailable)]:
        raise failed[0]
    return {p.name: r for p, r in zip(pools, results, strict=True)}


async def _pool_status(client: Any, cfg: QosConfig, pool: PoolConfig,
                       clocks: dict[str, float]) -> dict[str, Any]:
    classes = cfg.class_names()
    keys = PoolKeys(pool.name)
    # each pool's buckets and heartbeats against its own shard's clock (they are stamped
    # with it; one node's clock for every pool shifted ages and levels by the skew)
    now_ms = clocks[pool.name] = await redis_now_ms(client, keys)
    eviction = await eviction_risk(client, keys)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.policy)
    pipe.hgetall(keys.inflight)
    pipe.hgetall(keys.compliance)
    pipe.hgetall(keys.stats)
    pipe.hgetall(keys.queued)
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    pipe.zrange(keys.frontends, 0, -1, withscores=True)
    for c in classes:
        pipe.hmget(keys.class_bucket(c), ["tokens", "ts"])
        pipe.hmget(keys.ceil_bucket(c), ["tokens", "ts"])
        pipe.zcard(keys.backlog(c))
    res = await pipe.execute()
    policy = policy_text(res[0])
    inflight, compliance, stats, queued = (_hash(r) for r in res[1:5])
    workers, frontends = res[5], res[6]
    capacity = _f(policy.get("capacity"))
    per_class: dict[str, Any] = {}
    for i, c in enumerate(classes):
        bucket, ceil_bucket, tenants = res[7 + 3 * i], res[8 + 3 * i], res[9 + 3 * i]
        rate, burst = _f(policy.get(f"{c}.rate")), _f(policy.get(f"{c}.burst"))
        ceil, ceil_burst = _f(policy.get(f"{c}.ceil")), _f(policy.get(f"{c}.ceil_burst"))
        tokens = ceil_tokens = None
        if rate is not None and burst is not None:
            tokens = round(bucket_level(_f(bucket[0]), _f(bucket[1]), rate, burst, now_ms), 3)
        if ceil is not None and ceil_burst is not None and capacity is not None and ceil < capacity:
            ceil_tokens = round(bucket_level(_f(ceil_bucket[0]), _f(ceil_bucket[1]), ceil, ceil_burst,
                                             now_ms), 3)
        per_class[c] = {
            "rate": rate, "burst": burst, "ceil": ceil, "tokens": tokens, "ceil_tokens": ceil_tokens,
            "queued": int(queued.get(c, 0)), "queued_cost": round(_f(queued.get(f"{c}.cost")) or 0.0, 3),
            "backlogged_tenants": int(tenants), "inflight": int(inflight.get(c, 0)),
            "compliance": _f(compliance.get(c)),
            "counters": {k.split(".", 1)[1]: int(v) for k, v in stats.items() if k.startswith(c + ".")},
        }
    return {
        "model": pool.model_name,
        "initialised": bool(policy),
        "policy_version": int(policy["version"]) if "version" in policy else None,
        "capacity": capacity,
        "measured_capacity": _f(compliance.get(".capacity")),
        "capacity_source": compliance.get(".capacity_source"),
        "capacity_confidence": _f(compliance.get(".capacity_confidence")),
        # how old the controller's numbers above are: a controller that died leaves them
        # until the hash expires (10 ticks)
        "compliance_age_s": None if (updated := _f(compliance.get(".updated_ms"))) is None
        else round(max(now_ms - updated, 0.0) / 1000.0, 1),
        "compliance_controller": compliance.get(".controller"),
        "redis_eviction": eviction,
        "classes": per_class,
        "workers": _ages(workers, now_ms),
        "frontends": _ages(frontends, now_ms),
    }
