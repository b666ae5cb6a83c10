"""The workers' heartbeats as the controller reads them (limiter/controller/observe.py): a
beat stamped ahead of Redis's clock counts from when the controller first saw it. Each test
drives the real pool loop against a private redis-server."""

from __future__ import annotations

import asyncio

import pytest

from limiter.controller.capacity import CapacityConfig
from tests.support.controller_helpers import pool_controller, wait_for
from tests.support.helpers import redis_ms

SHORT_TTL = CapacityConfig(interval_s=0.5, min_reports=1, worker_ttl_s=3.0)


async def test_a_dead_worker_whose_beats_were_stamped_ahead_leaves_the_capacity_after_its_ttl(
        aredis, pool, cfg):
    """A worker stamps its heartbeat with its own estimate of Redis's clock (local wall clock
    plus an offset taken at its last claim). An idle worker whose host clock stepped an hour
    ahead beats an hour in the future; killed then, it counted in the capacity -- and every
    rate -- for the hour, not for ``worker_ttl_s``."""
    pc = pool_controller(cfg, aredis, capacity=SHORT_TTL)
    await pc.renew_once()
    now = await redis_ms(aredis)
    for w, ahead in (("w1", 0), ("w2", 3_600_000)):
        await aredis.zadd(pool.workers, {w: now + ahead})
        await aredis.hset(pool.worker(w), mapping={"capacity_tokens_s": 15000.0})
    decision = await pc.tick(pc.term)
    assert decision.capacity == pytest.approx(30000.0)

    async def w2_gone() -> bool:  # w1 beats on (Redis clock); w2 was killed after its last beat
        await aredis.zadd(pool.workers, {"w1": await redis_ms(aredis)})
        await pc.renew_once()  # (the lease: this test drives the loops by hand)
        await pc.tick(pc.term)
        return pc.term.state.capacity == pytest.approx(15000.0)

    await wait_for(w2_gone, timeout=8.0, every=0.2)
    assert pc.term.estimator.estimate().live_workers == 1


async def test_a_live_worker_whose_beats_are_stamped_ahead_stays_counted(aredis, pool, cfg):
    """The same worker beating on (a new, still future, stamp each beat) is alive."""
    pc = pool_controller(cfg, aredis, capacity=SHORT_TTL)
    await pc.renew_once()
    for w in ("w1", "w2"):
        await aredis.hset(pool.worker(w), mapping={"capacity_tokens_s": 15000.0})
    for _ in range(25):  # 5 s, past the TTL
        now = await redis_ms(aredis)
        await aredis.zadd(pool.workers, {"w1": now, "w2": now + 3_600_000})
        await pc.renew_once()
        await pc.tick(pc.term)
        await asyncio.sleep(0.2)
    assert pc.term.estimator.estimate().live_workers == 2
    assert pc.term.state.capacity == pytest.approx(30000.0)
