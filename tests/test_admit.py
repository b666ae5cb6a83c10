"""admit.lua against a real redis-server: the tenant quota, idempotency, caps, and the one
reason a class refuses work: it could not start within its max wait.

Admission enforces limits, not shares: work above a class's guaranteed rate is queued (claim
decides who runs), and a 429 comes only from the tenant's own quota or an estimated wait
longer than the request's max wait, with a Retry-After that says when it would fit."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limiter.config import demo_config
from limiter.errors import Overloaded, QueueFull, TenantBusy, Throttled
from tests.support.helpers import admit, class_cfg, dump_all, init_pool, redis_ms


async def _flood(scripts, keys, duration_s: float, at_least: float = 0.0, **kw) -> list[tuple[int, float]]:
    """Admit as fast as possible for ``duration_s``, and then on until the bucket refuses one or
    ``at_least`` tokens are in (a loaded machine floods slowly: in 0.4 s beside two busy loops
    only 88 of a 168-token burst got in); return (enq_ms, cost) of the admitted."""
    admitted = []
    loop = asyncio.get_running_loop()
    end, deadline = loop.time() + duration_s, loop.time() + 60
    refused, total = False, 0.0
    while loop.time() < end or (not refused and total < at_least):
        assert loop.time() < deadline, f"neither a refusal nor {at_least} tokens admitted in 60 s"
        try:
            a = await admit(scripts, keys, **kw)
        except Throttled:
            refused = True
            await asyncio.sleep(0.001)
            continue
        admitted.append(a)
        total += a.cost
    return [(a.deadline_ms, a.cost) for a in admitted]


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


# --- the tenant's quota ---------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=st.floats(200, 3000), burst_s=st.floats(0.05, 0.5), cost=st.integers(1, 60))
async def test_tenant_bucket_never_admits_more_than_burst_plus_rate(scripts, sync_redis, rate, burst_s, cost):
    sync_redis.flushall()
    keys = await init_pool(scripts, demo_config(), capacity=1e9)
    burst = max(rate * burst_s, cost + 1)
    need = burst - (cost + 1)
    rows = await _flood(scripts, keys, 0.4, at_least=need, cls="P0", input_tokens=cost, max_tokens=1,
                        tenant_rate=rate, tenant_burst=burst, max_wait_ms=0)
    # deadline = enq_ms + max wait, the same shift for every row: intervals are unchanged.
    assert _max_window_excess(rows, rate, burst) <= 1e-6
    # ... and the bucket really is the limiter, not something else: the whole burst got in
    # before any refusal (how much of the refill a flood catches depends on how fast the
    # machine floods, and so did how much of the burst 0.4 s reached)
    total = sum(c for _, c in rows)
    assert total >= need


async def test_fractional_tokens_are_not_lost(scripts, sync_redis):
    """The stored level equals a float reference model replaying the same admissions."""
    cfg = class_cfg(P0={"weight": 0.37, "out_weight": 1.13})
    keys = await init_pool(scripts, cfg, capacity=1e9)
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
    raw = await scripts.client.hgetall(keys.tenant_bucket("frac"))
    stored = {k.decode(): float(v) for k, v in raw.items()}
    assert int(stored["ts"]) == ts
    assert stored["tokens"] == pytest.approx(level, rel=0, abs=1e-9)
    assert any(c != int(c) for _, c in enq)  # costs really were fractional
    # The ledger balances: tokens = start + refilled - debited + refunded.
    assert stored["tokens"] == pytest.approx(stored["start"] + stored["refilled"] - stored["debited"]
                                             + stored["refunded"], abs=1e-9)
    assert stored["debited"] == pytest.approx(sum(c for _, c in enq), abs=1e-9)


async def test_throttled_reply_says_when_tokens_will_be_there(scripts, pool):
    slow = {"tenant": "slow", "input_tokens": 90, "max_tokens": 10, "tenant_rate": 100, "tenant_burst": 100}
    t0 = await redis_ms(scripts.client)
    await admit(scripts, pool, **slow)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, pool, **slow)
    # The bucket refills between the two admits (at 100/s): the wait is 1 s less however long
    # that took, which on a loaded machine is not a few ms (Redis's clock, read around both).
    between = await redis_ms(scripts.client) - t0
    assert exc.value.bucket == "tenant"
    assert 900 - between <= exc.value.retry_after_ms <= 1000
    await asyncio.sleep(exc.value.retry_after_ms / 1000 + 0.01)
    await admit(scripts, pool, **slow)


async def test_a_throttled_wait_too_long_for_an_integer_reply_is_still_a_positive_wait(scripts, pool):
    # A tenant at the least quota admit takes (1e-9 tokens/s) in debt for a 10M-token request:
    # the wait, 1e19 ms, does not fit Redis' integer reply (int64): the frontend read it as
    # -9223372036854775808, i.e. -1, "the class is disabled (its ceiling is 0)".
    starved = {"tenant": "starved", "tenant_rate": 1e-9, "tenant_burst": 1e-9}
    await admit(scripts, pool, input_tokens=10_000_000, max_tokens=1, **starved)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, pool, input_tokens=1, max_tokens=1, **starved)
    assert exc.value.bucket == "tenant"
    assert exc.value.retry_after_ms >= 10**15  # over 31,000 years: never, honestly


async def test_request_larger_than_burst_needs_a_full_bucket_then_leaves_debt(scripts, pool):
    big = {"tenant": "big", "tenant_rate": 100, "tenant_burst": 100}
    t0 = await redis_ms(scripts.client)
    await admit(scripts, pool, input_tokens=250, max_tokens=50, **big)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, pool, input_tokens=1, max_tokens=1, **big)
    between = await redis_ms(scripts.client) - t0  # refilled meanwhile, at 100/s (see above)
    assert 1990 - between <= exc.value.retry_after_ms <= 2020  # 200 tokens of debt + 2 at 100/s


async def test_readmitting_the_same_id_is_idempotent(scripts, pool):
    a = await admit(scripts, pool, request_id="same", tenant="idem", input_tokens=50, max_tokens=50,
                    tenant_rate=1, tenant_burst=100)
    b = await admit(scripts, pool, request_id="same", tenant="idem", input_tokens=50, max_tokens=50,
                    tenant_rate=1, tenant_burst=100)
    assert a.duplicate_state is None and b.duplicate_state == "queued"
    assert await scripts.client.zcard(pool.queue("P1", "idem")) == 1
    assert int(await scripts.client.hget(pool.queued, "P1")) == 1
    assert float(await scripts.client.hget(pool.tenant_bucket("idem"), "tokens")) < 1  # charged once


async def test_bounded_queue_and_tenant_inflight_cap(scripts, sync_redis):
    cfg = class_cfg(P2={"queue_cap": 3})
    keys = await init_pool(scripts, cfg)
    for _ in range(3):
        await admit(scripts, keys, cls="P2", input_tokens=1, max_tokens=1)
    with pytest.raises(QueueFull):
        await admit(scripts, keys, cls="P2", input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)
    with pytest.raises(TenantBusy):
        await admit(scripts, keys, cls="P1", tenant="capped", max_inflight=2, input_tokens=1, max_tokens=1)


# --- queued above the guarantee; refused only when the max wait cannot be met -----------------

async def test_work_above_the_class_guarantee_is_queued_not_refused(scripts, sync_redis):
    """P2's guarantee is 5 % of 10,000 tokens/s; a burst of 40x that is queued, because an idle
    pool starts it within its 60 s max wait."""
    keys = await init_pool(scripts, demo_config(), capacity=10_000)
    for i in range(40):
        a = await admit(scripts, keys, cls="P2", request_id=f"p2-{i}", input_tokens=450, max_tokens=50)
        assert a.est_wait_ms <= 60_000
    assert int(await scripts.client.hget(keys.queued, "P2")) == 40
    assert float(await scripts.client.hget(keys.queued, "P2.cost")) == pytest.approx(40 * 500)


async def test_a_request_that_cannot_start_in_time_is_refused_with_an_honest_retry_after(scripts, sync_redis):
    """The wait estimate: (work queued at or above the class) / (capacity it can get). Once the
    queue ahead holds more than max_wait of work the next request is refused, nothing
    changes, and Retry-After is the time until enough of that queue has drained."""
    keys = await init_pool(scripts, class_cfg(P1={"max_wait_ms": 2000}), capacity=1000)
    # P1 alone: its spare capacity is the whole pool (no lower class is backlogged)
    admitted = 0
    with pytest.raises(Overloaded) as exc:
        for i in range(100):
            await admit(scripts, keys, cls="P1", request_id=f"q{i}", input_tokens=90, max_tokens=10)
            admitted += 1
    assert admitted == 21  # 20 x 100 tokens ahead = 2.0 s at 1000/s still fits; 21 do not
    e = exc.value
    assert e.cls == "P1" and e.max_wait_ms == 2000
    assert e.est_wait_ms == pytest.approx(2100, abs=2)
    assert e.retry_after_ms == pytest.approx(100, abs=2)
    before = dump_all(sync_redis)
    with pytest.raises(Overloaded):
        await admit(scripts, keys, cls="P1", request_id="again", input_tokens=90, max_tokens=10)
    assert dump_all(sync_redis) == before  # a refusal charges and queues nothing
    # A shorter max wait of the client's own is refused earlier; a higher class is not.
    with pytest.raises(Overloaded):
        await admit(scripts, keys, cls="P1", request_id="short", input_tokens=1, max_tokens=1,
                    max_wait_ms=500)
    a = await admit(scripts, keys, cls="P0", request_id="top", input_tokens=90, max_tokens=10)
    assert a.est_wait_ms == 0  # nothing of P0 is queued: it goes first


async def test_the_estimate_counts_higher_classes_and_the_guarantees_of_lower_ones(scripts, sync_redis):
    keys = await init_pool(scripts, demo_config(), capacity=1000)  # rates 600 / 350 / 50
    await admit(scripts, keys, cls="P0", request_id="a", input_tokens=900, max_tokens=100)
    p1 = await admit(scripts, keys, cls="P1", request_id="b", input_tokens=90, max_tokens=10)
    # nothing of P1 queued and its guarantee holds credit: the next claim after P0's takes it
    assert p1.est_wait_ms == 0
    await admit(scripts, keys, cls="P2", request_id="c", input_tokens=0, max_tokens=1)
    p1b = await admit(scripts, keys, cls="P1", request_id="d", input_tokens=0, max_tokens=100)
    # by its guarantee: 100 queued / 350 per s = 0.286 s; by priority: (1000 of P0 + 100) /
    # (1000 - P2's 50 while P2 is backlogged) = 1.16 s: the smaller counts
    assert p1b.est_wait_ms == pytest.approx(286, abs=2)
    p2 = await admit(scripts, keys, cls="P2", request_id="e", input_tokens=0, max_tokens=100)
    # P2: 1 queued / 50 per s = 0.02 s by its guarantee; by priority everything ahead / 1000
    assert p2.est_wait_ms == pytest.approx(20, abs=2)


async def test_a_flooding_tenant_does_not_get_a_light_one_refused(scripts, sync_redis):
    """In a fair class a tenant's wait is its own queued work at its share of the class: a
    flood fills its own queue up to its max wait, and another tenant still gets in at once."""
    keys = await init_pool(scripts, class_cfg(P1={"max_wait_ms": 2000}), capacity=1000)
    flooded = 0
    with pytest.raises(Overloaded):
        for i in range(100):
            await admit(scripts, keys, cls="P1", tenant="flood", request_id=f"f{i}", input_tokens=90,
                        max_tokens=10)
            flooded += 1
    assert flooded == 21  # alone in P1: its 2,000 queued tokens at 1,000/s fit its 2 s
    steady = await admit(scripts, keys, cls="P1", tenant="steady", request_id="s", input_tokens=90,
                         max_tokens=10)
    assert steady.est_wait_ms == 0  # lifted to the flood's counter: the next P1 claim is its
    # ... and from now on the flood has half of P1: its 2,100 queued count double, capped by
    # the whole class's queue (2,200 at 1,000/s)
    with pytest.raises(Overloaded) as exc:
        await admit(scripts, keys, cls="P1", tenant="flood", request_id="more", input_tokens=0, max_tokens=1)
    assert exc.value.est_wait_ms == pytest.approx(2200, abs=2)


async def test_a_class_at_its_ceiling_waits_at_least_its_queue_over_its_ceiling(scripts, sync_redis):
    keys = await init_pool(scripts, class_cfg(P2={"ceil_share": 0.1, "max_wait_ms": 1000}), capacity=1000)
    # P2: rate 50/s, ceiling 100/s; queued work / ceiling is a floor on the spare-capacity path
    for i in range(2):
        await admit(scripts, keys, cls="P2", request_id=f"c{i}", input_tokens=40, max_tokens=10)
    a = await admit(scripts, keys, cls="P2", request_id="c2", input_tokens=40, max_tokens=10)
    assert a.est_wait_ms == pytest.approx(1000, abs=2)  # 100 queued / 100 per s (guarantee: 2 s)
    with pytest.raises(Overloaded):
        await admit(scripts, keys, cls="P2", request_id="c3", input_tokens=40, max_tokens=10)


async def test_a_ceiling_in_debt_bounds_the_wait_whatever_the_guarantee_holds(scripts, sync_redis):
    """A claim serves no class whose ceiling bucket is not above 0, guarantee or not; the wait
    estimate took the guarantee path's wait as a cap after the ceiling's floor, so with its
    guarantee in credit a class deep in ceiling debt admitted requests that could only expire
    (a review). The ceiling's wait is a floor the guarantee cannot lower."""
    keys = await init_pool(scripts, class_cfg(P2={"ceil_share": 0.1, "max_wait_ms": 1000}), capacity=1000)
    now = await redis_ms(scripts.client)
    sync_redis.hset(keys.ceil_bucket("P2"), mapping={"tokens": -5000, "ts": now})  # 50 s of debt at 100/s
    with pytest.raises(Overloaded) as exc:
        await admit(scripts, keys, cls="P2", request_id="late", input_tokens=40, max_tokens=10)
    assert exc.value.est_wait_ms >= 49_000
    assert sync_redis.hget(keys.request("late"), "state") is None  # nothing admitted


async def test_a_disabled_class_is_refused_at_once(scripts, sync_redis):
    keys = await init_pool(scripts, class_cfg(P2={"share": 0.0, "ceil_share": 0.0}), capacity=1000)
    with pytest.raises(Throttled) as exc:
        await admit(scripts, keys, cls="P2", input_tokens=1, max_tokens=1)
    assert exc.value.bucket == "class" and exc.value.retry_after_ms == -1


@pytest.mark.parametrize("served", [
    {"P0": repr(616004.70012516), "P1": repr(823624.2151600365)},  # their subtraction leaves 1e-12
    {"P0": "1000", "P1": "2000"},  # exactly nothing left
], ids=["rounding", "exact"])
async def test_a_class_with_no_rate_and_no_capacity_left_is_refused_whatever_the_rounding(scripts, sync_redis,
                                                                                         served):
    """Spare capacity = capacity less what the higher classes are served: with them served
    past it, nothing. The subtraction's rounding left +1e-12 a quarter of the time, and a class
    with no rate (share 0) was admitted into a queue nothing drains, or refused with a wait
    past int64 (Redis replied -9223372036854775808) (found by a review of the Lua layer)."""
    from limiter.keys import PoolKeys
    from limiter.scripts import policy_document
    from tests.support.helpers import ALIVE

    cfg = demo_config()
    policy = policy_document(cfg, cfg.pool("tiny"), 100.0)
    for c in policy["classes"]:
        if c["name"] == "P2":
            c["rate"], c["burst"] = 0.0, 0.0
    policy["floor_half_life_ms"] = 10_000
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy, reset_rates=True)
    await scripts.client.zadd(keys.frontends, {"fe1": ALIVE})
    await scripts.client.hset(keys.served, mapping={".ts": ALIVE, "P2": "0", **served})
    before = dump_all(sync_redis)
    with pytest.raises(Overloaded) as alone:
        await admit(scripts, keys, cls="P2", request_id="nothing-ahead", input_tokens=10, max_tokens=1)
    assert alone.value.est_wait_ms == -1 and dump_all(sync_redis) == before  # nothing queued
    await admit(scripts, keys, cls="P0", request_id="big", input_tokens=200_000, max_tokens=1)
    with pytest.raises(Overloaded) as behind:
        await admit(scripts, keys, cls="P2", request_id="behind-p0", input_tokens=10, max_tokens=1)
    assert behind.value.est_wait_ms == -1 and behind.value.retry_after_ms == -1
