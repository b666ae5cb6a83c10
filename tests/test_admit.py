"""admit.lua against a real redis-server: bucket math, borrowing, idempotency, caps."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limiter.config import QosConfig, demo_config
from limiter.errors import QueueFull, TenantBusy, Throttled
from limiter.keys import PoolKeys
from limiter.scripts import policy_document
from tests.helpers import admit


def _cfg(**class_overrides) -> QosConfig:
    cfg = demo_config()
    classes = tuple(dataclasses.replace(c, **class_overrides.get(c.name, {})) for c in cfg.classes)
    return dataclasses.replace(cfg, classes=classes)


async def _init(scripts, cfg: QosConfig, capacity: float | None = None) -> PoolKeys:
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny"), capacity), reset_rates=True)
    return keys


async def _flood(scripts, keys, duration_s: float, **kw) -> list[tuple[int, float]]:
    """Admit as fast as possible for a while; return (enq_ms, cost) of the admitted."""
    admitted = []
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    while loop.time() < end:
        try:
            a = await admit(scripts, keys, **kw)
        except Throttled:
            await asyncio.sleep(0.001)
            continue
        admitted.append(a)
    rows = []
    for a in admitted:
        rows.append((a.deadline_ms, a.cost))
    return rows


def _max_window_excess(rows: list[tuple[int, float]], rate: float, burst: float) -> float:
    """max over intervals [t_i, t_j] of admitted - (burst + rate x elapsed)."""
    rows = sorted(rows)
    worst = -float("inf")
    for i in range(len(rows)):
        total = 0.0
        for j in range(i, len(rows)):
            total += rows[j][1]
            allowed = burst + rate * (rows[j][0] - rows[i][0]) / 1000
            worst = max(worst, total - allowed)
    return worst


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=st.floats(200, 3000), burst_s=st.floats(0.05, 0.5), cost=st.integers(1, 60))
async def test_tenant_bucket_never_admits_more_than_burst_plus_rate(scripts, sync_redis, rate, burst_s, cost):
    sync_redis.flushall()
    keys = await _init(scripts, demo_config())
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    burst = max(rate * burst_s, cost + 1)
    rows = await _flood(scripts, keys, 0.4, cls="P0", input_tokens=cost, max_tokens=1,
                        tenant_rate=rate, tenant_burst=burst, max_wait_ms=0)
    # deadline = enq_ms + max wait, the same shift for every row: intervals are unchanged.
    assert _max_window_excess(rows, rate, burst) <= 1e-6
    # ... and the bucket really is the limiter: the flood admitted about burst + rate x t.
    total = sum(c for _, c in rows)
    assert total >= burst + rate * 0.1 - (cost + 1)  # loose: a loaded CI machine floods slowly


async def test_class_bucket_bound_without_borrowing(scripts, sync_redis):
    cfg = _cfg(P1={"ceil_share": 0.35})  # ceil == rate: no borrowing
    keys = await _init(scripts, cfg, capacity=4000)
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    rows = await _flood(scripts, keys, 0.4, cls="P1", input_tokens=30, max_tokens=5, max_wait_ms=0)
    rate, burst = 0.35 * 4000, 0.35 * 4000 * 0.5
    assert _max_window_excess(rows, rate, burst) <= 1e-6
    stats = await scripts.client.hgetall(keys.stats)
    assert b"P1.borrowed" not in stats


async def test_fractional_tokens_are_not_lost(scripts, sync_redis):
    """The stored level equals a float reference model replaying the same admissions."""
    cfg = _cfg(P0={"weight": 0.37, "out_weight": 1.13, "ceil_share": 0.6})
    keys = await _init(scripts, cfg, capacity=1000.3)
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    rate, burst = 333.7, 41.3
    enq = []
    for i in range(40):
        try:
            a = await admit(scripts, keys, cls="P0", tenant="frac", input_tokens=7 + i % 5, max_tokens=3,
                            tenant_rate=rate, tenant_burst=burst, max_wait_ms=1)
            enq.append((a.deadline_ms - 1, a.cost))
        except Throttled:
            pass
        await asyncio.sleep(0.003)
    level, ts = burst, None
    for t, cost in enq:
        if ts is not None:
            level = min(burst, level + rate * max(t - ts, 0) / 1000)
        level -= cost
        ts = t
    stored = await scripts.client.hgetall(keys.tenant_bucket("frac"))
    assert int(stored[b"ts"]) == ts
    assert float(stored[b"tokens"]) == pytest.approx(level, rel=0, abs=1e-9)
    assert any(c != int(c) for _, c in enq)  # costs really were fractional


async def test_throttled_reply_says_when_tokens_will_be_there(scripts, pool):
    slow = {"tenant": "slow", "input_tokens": 90, "max_tokens": 10, "tenant_rate": 100, "tenant_burst": 100}
    await admit(scripts, pool, **slow)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, pool, **slow)
    assert exc.value.bucket == "tenant"
    assert 900 <= exc.value.retry_after_ms <= 1000
    await asyncio.sleep(exc.value.retry_after_ms / 1000 + 0.01)
    await admit(scripts, pool, **slow)


async def test_request_larger_than_burst_needs_a_full_bucket_then_leaves_debt(scripts, pool):
    big = {"tenant": "big", "tenant_rate": 100, "tenant_burst": 100}
    await admit(scripts, pool, input_tokens=250, max_tokens=50, **big)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, pool, input_tokens=1, max_tokens=1, **big)
    assert 1990 <= exc.value.retry_after_ms <= 2020  # 200 tokens of debt + 2 at 100/s


async def test_readmitting_the_same_id_is_idempotent(scripts, pool):
    a = await admit(scripts, pool, request_id="same", tenant="idem", input_tokens=50, max_tokens=50,
                    tenant_rate=1, tenant_burst=100)
    b = await admit(scripts, pool, request_id="same", tenant="idem", input_tokens=50, max_tokens=50,
                    tenant_rate=1, tenant_burst=100)
    assert a.duplicate_state is None and b.duplicate_state == "queued"
    assert await scripts.client.zcard(pool.queue("P1")) == 1
    assert float(await scripts.client.hget(pool.tenant_bucket("idem"), "tokens")) < 1  # charged once


async def test_bounded_queue_and_tenant_inflight_cap(scripts, sync_redis):
    cfg = _cfg(P2={"queue_cap": 3})
    keys = await _init(scripts, cfg)
    for _ in range(3):
        await admit(scripts, keys, cls="P2", input_tokens=1, max_tokens=1)
    with pytest.raises(QueueFull):
        await admit(scripts, keys, cls="P2", input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)
    with pytest.raises(TenantBusy):
        await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)


async def test_idle_pool_lends_to_a_low_class_up_to_its_ceiling(scripts, sync_redis):
    """Work conservation: P2 alone exceeds its own rate, bounded by its ceiling bucket."""
    cfg = _cfg(P2={"ceil_share": 0.5})
    keys = await _init(scripts, cfg, capacity=10_000)
    rows = await _flood(scripts, keys, 0.5, cls="P2", input_tokens=40, max_tokens=10, max_wait_ms=0)
    total = sum(c for _, c in rows)
    p2_rate, ceil = 0.05 * 10_000, 0.5 * 10_000
    assert total > 3 * (p2_rate * 0.5 + p2_rate * 0.5)  # well past its guarantee
    assert _max_window_excess(rows, ceil, ceil * 0.5) <= 1e-6  # never past its ceiling
    stats = await scripts.client.hgetall(keys.stats)
    assert int(stats[b"P2.borrowed"]) > 0


async def test_under_contention_each_class_keeps_its_guarantee_and_higher_borrows_first(scripts, sync_redis):
    keys = await _init(scripts, demo_config(), capacity=10_000)
    got = {"P0": 0.0, "P1": 0.0, "P2": 0.0}

    async def flood(cls):
        for a_rows in [await _flood(scripts, keys, 0.8, cls=cls, input_tokens=40, max_tokens=10,
                                     tenant=f"t{cls}", max_wait_ms=0)]:
            got[cls] = sum(c for _, c in a_rows)

    await asyncio.gather(flood("P0"), flood("P1"), flood("P2"))
    stats = {k.decode(): int(v) for k, v in (await scripts.client.hgetall(keys.stats)).items()}
    # Guarantees: each class got at least ~its rate for the run (minus one request of slack).
    for cls, share in (("P0", 0.6), ("P1", 0.35), ("P2", 0.05)):
        assert got[cls] >= share * 10_000 * 0.8 * 0.8, (cls, got)
    # The pool never hands out more than it has: capacity x t plus its bursts.
    assert sum(got.values()) <= 10_000 * 0.8 + 10_000 * 0.5 + 6000 + 3500 + 500 + 3 * 50
    assert stats.get("P1.borrowed", 0) >= stats.get("P2.borrowed", 0)


async def test_the_top_class_may_borrow_into_the_pools_debt_and_no_further(scripts, sync_redis):
    """At overload every admission drains the pool, so with each class at its rate it sits
    near empty. A P0 burst still gets in (into the pool's debt, down to -pool_burst, and
    within its ceiling bucket) while a P1 that wants to borrow is refused."""
    keys = await _init(scripts, demo_config(), capacity=100)  # P0 60/s burst 30 ceil_burst 50; pool 50
    p1 = await admit(scripts, keys, cls="P1", tenant="a", input_tokens=35, max_tokens=5)  # P1 own; pool 10
    p0 = await admit(scripts, keys, cls="P0", tenant="b", input_tokens=25, max_tokens=5)  # P0 own; pool -20
    assert not p1.borrowed and not p0.borrowed
    small = {"input_tokens": 5, "max_tokens": 5}
    assert (await admit(scripts, keys, cls="P0", tenant="b", **small)).borrowed  # pool -30, ceiling 10
    with pytest.raises(Throttled) as exc:  # P1 must leave P0's burst in the pool: refused
        await admit(scripts, keys, cls="P1", tenant="a", **small)
    assert exc.value.bucket == "class"
    assert (await admit(scripts, keys, cls="P0", tenant="b", **small)).borrowed  # pool -40, ceiling 0
    with pytest.raises(Throttled):  # P0's ceiling bucket is empty now
        await admit(scripts, keys, cls="P0", tenant="b", **small)
    # The debt floor: with its ceiling refilled, P0 still needs the pool above -pool_burst + cost.
    sec, usec = sync_redis.time()
    now = sec * 1000 + usec // 1000
    sync_redis.hset(keys.ceil_bucket("P0"), mapping={"tokens": 50, "ts": now})
    sync_redis.hset(keys.pool_bucket, mapping={"tokens": -45, "ts": now})
    with pytest.raises(Throttled) as exc:
        await admit(scripts, keys, cls="P0", tenant="b", **small)
    assert 40 <= exc.value.retry_after_ms <= 60  # 5 tokens short at 100/s
