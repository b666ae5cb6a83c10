"""claim.lua: priority, FIFO, starvation floors, expiry, token budget, wake-ups."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack

from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.scripts import policy_document
from tests.helpers import admit


async def test_highest_class_first_and_fifo_within_a_class(scripts, pool):
    ids = {}
    for cls in ("P2", "P1", "P0", "P1", "P0"):
        rid = f"{cls}-{len(ids)}"
        ids[rid] = cls
        await admit(scripts, pool, cls=cls, request_id=rid, input_tokens=1, max_tokens=1)
    got = await scripts.claim(pool, "w1", 1)
    assert [c.request_id for c in got.requests] == ["P0-2"]
    got = await scripts.claim(pool, "w1", 10)
    order = [c.request_id for c in got.requests]
    assert order[:3] == ["P0-4", "P1-1", "P1-3"]
    assert set(order) == {"P0-4", "P1-1", "P1-3", "P2-0"}
    assert all(c.attempt == 1 and c.frontend == "fe1" for c in got.requests)


async def test_starvation_floors_hold_under_a_backlog_of_all_classes(scripts, pool):
    """P0, P1 and P2 all backlogged: P1 still gets >= 30 % and P2 >= 5 % of served tokens."""
    cfg = demo_config()
    await scripts.init_pool(pool, policy_document(cfg, cfg.pool("tiny"), capacity=1e9), reset_rates=True)
    for i in range(700):
        for cls in ("P0", "P1", "P2"):
            if cls == "P0" or i < 300:  # every class stays backlogged for the whole run
                await admit(scripts, pool, cls=cls, request_id=f"{cls}-{i}", input_tokens=90, max_tokens=10)
    served = {"P0": 0, "P1": 0, "P2": 0}
    for _ in range(150):
        got = await scripts.claim(pool, "w1", 4)
        for c in got.requests:
            served[c.cls] += c.input_tokens + c.max_tokens
    total = sum(served.values())
    assert total == 600 * 100
    # The documented guarantee: a floor, less at most one quantum (2048 tokens) of lag.
    slack = 2048 / total + 0.01
    assert served["P1"] / total >= 0.30 - slack
    assert served["P2"] / total >= 0.05 - slack
    assert served["P0"] / total >= 0.55  # priority still rules above the floors


async def test_no_floor_without_backlog_strict_priority(scripts, pool):
    for i in range(20):
        await admit(scripts, pool, cls="P0", request_id=f"a{i}", input_tokens=1, max_tokens=1)
    await admit(scripts, pool, cls="P2", request_id="low", input_tokens=1, max_tokens=1)
    got = await scripts.claim(pool, "w1", 10)
    # A P2 floor applies only when P2 is short of its share: the first pick is P0.
    assert got.requests[0].cls == "P0"


async def test_above_class_claims_only_classes_ranked_above_it(scripts, pool):
    """A full worker's look-ahead: with above_class it takes only work that would preempt."""
    for rid, cls in (("low", "P2"), ("mid", "P1")):
        await admit(scripts, pool, cls=cls, request_id=rid, input_tokens=1, max_tokens=1)
    assert (await scripts.claim(pool, "w1", 5, above_class="P1")).requests == []
    assert (await scripts.claim(pool, "w1", 5, above_class="P0")).requests == []
    await admit(scripts, pool, cls="P0", request_id="top", input_tokens=1, max_tokens=1)
    got = await scripts.claim(pool, "w1", 5, above_class="P2")
    assert [c.request_id for c in got.requests] == ["top", "mid"]
    got = await scripts.claim(pool, "w1", 5, above_class="")
    assert [c.request_id for c in got.requests] == ["low"]


async def test_token_budget_limits_what_a_worker_takes(scripts, pool):
    for i in range(5):
        await admit(scripts, pool, cls="P1", request_id=f"b{i}", input_tokens=300, max_tokens=100)
    got = await scripts.claim(pool, "w1", 10, token_budget=1000)
    assert len(got.requests) == 2
    assert await scripts.client.zcard(pool.queue("P1")) == 3


async def test_p2_expires_with_no_worker_pulling(scripts, sync_redis):
    cfg = demo_config()
    classes = tuple(dataclasses.replace(c, max_wait_ms=150) if c.name == "P2" else c for c in cfg.classes)
    cfg = dataclasses.replace(cfg, classes=classes)
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")), reset_rates=True)
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
    before = await scripts.client.hgetall(keys.tenant_bucket("t1"))
    await admit(scripts, keys, cls="P2", request_id="late", tenant="t1", input_tokens=50, max_tokens=50,
                tenant_rate=1, tenant_burst=1000)
    await asyncio.sleep(0.2)
    reaped = await scripts.reap(keys)
    assert reaped.expired == 1
    rec = await scripts.client.hgetall(keys.request("late"))
    assert rec[b"state"] == b"expired" and b"max queue wait" in rec[b"reason"]
    assert 0 < await scripts.client.ttl(keys.request("late")) <= 300
    # The client is told, the full charge is refunded, a sample is recorded.
    (_, entry), = await scripts.client.xrange(keys.reply("fe1"))
    assert entry[b"k"] == b"err" and entry[b"code"] == b"expired"
    after = await scripts.client.hgetall(keys.tenant_bucket("t1"))
    assert before == {} and float(after[b"tokens"]) >= 999.0
    (_, sample), = await scripts.client.xrange(keys.samples)
    s = msgpack.unpackb(sample[b"d"])
    assert s["outcome"] == "expired" and s["class"] == "P2" and s["queue_wait_ms"] >= 150
    assert await scripts.client.hget(keys.tenant_inflight, "t1") is None
    # Never handed out afterwards.
    assert (await scripts.claim(keys, "w1", 5)).requests == []


async def test_claim_expires_overdue_requests_instead_of_handing_them_out(scripts, pool):
    await admit(scripts, pool, cls="P0", request_id="old", input_tokens=1, max_tokens=1, max_wait_ms=50)
    await admit(scripts, pool, cls="P1", request_id="fresh", input_tokens=1, max_tokens=1)
    await asyncio.sleep(0.08)
    got = await scripts.claim(pool, "w1", 5)
    assert [c.request_id for c in got.requests] == ["fresh"]
    assert await scripts.client.hget(pool.request("old"), "state") == b"expired"


async def test_requests_of_a_dead_frontend_are_cancelled_not_run(scripts, pool):
    await scripts.client.zadd(pool.frontends, {"gone": 1})  # last heartbeat in 1970
    await admit(scripts, pool, cls="P1", request_id="orphan", frontend="gone", input_tokens=1, max_tokens=1)
    assert (await scripts.claim(pool, "w1", 5)).requests == []
    assert await scripts.client.hget(pool.request("orphan"), "state") == b"cancelled"


async def test_admit_wakes_a_blocked_worker(scripts, pool):
    await scripts.client.delete(pool.wake)

    async def worker():
        return await scripts.client.blpop([pool.wake], timeout=5)

    task = asyncio.create_task(worker())
    await asyncio.sleep(0.05)
    assert not task.done()
    await admit(scripts, pool, cls="P1", input_tokens=1, max_tokens=1)
    assert await asyncio.wait_for(task, 2) is not None
