"""A Redis outage never kills the controller: it backs off, its lease lapses locally, and
when Redis is back (empty: no persistence) it leads again, re-creating the policy and the
samples group. Uses its own redis-server, since it kills it."""

from __future__ import annotations

import asyncio
import dataclasses

from limiter.config import RedisConfig, demo_config
from limiter.controller.service import Controller
from limiter.keys import PoolKeys
from tests.support.controller_helpers import fast_settings, metric, push, sample, wait_for
from tests.support.helpers import redis_ms
from tests.support.redis_server import RedisServer


async def test_the_controller_rides_out_a_redis_restart() -> None:
    server = RedisServer().start()
    cfg = dataclasses.replace(demo_config(), redis=RedisConfig(url=server.url))
    ctl = Controller(fast_settings(cfg), cfg)  # its own client, from the config's URL
    keys = PoolKeys("tiny")
    try:
        await ctl.start()
        pc = ctl.pools["tiny"]
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None))
        server.kill()
        await wait_for(lambda: asyncio.sleep(0, pc.term is None), timeout=5)  # the lease lapsed locally
        await asyncio.sleep(0.5)
        assert metric(ctl.metrics, "qos_controller_redis_errors_total", loop="lease") > 0
        assert not any(t.done() for t in ctl._tasks)  # every loop is still alive
        assert ctl.health()["pools"]["tiny"]["redis_ok"] is False
        server.start()  # same port, no data: no policy, no stream, no group, fence from 1
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None), timeout=15)
        await push(ctl.client, keys, [sample("P0", await redis_ms(ctl.client)) for _ in range(3)])
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None and pc.term.consumed == 3), timeout=15)
        assert await ctl.client.hget(keys.policy, "classes") == b"P0,P1,P2"
        await wait_for(lambda: ctl.client.hget(keys.compliance, "P0"), timeout=5)
    finally:
        await ctl.stop()
        server.stop()


async def test_a_cluster_that_cannot_serve_the_slot_is_an_outage_in_the_sample_loop(aredis, pool, cfg):
    """CLUSTERDOWN and TRYAGAIN (a cluster failover, a reshard) are ResponseErrors in redis-py:
    the sample loop took them for a bad reply -- an error line on every retry, no
    qos_controller_redis_errors, redis_ok still true -- where the lease and tick loops count
    them as the outage they are."""
    from redis.exceptions import ClusterDownError

    from limiter.tasks import stop_tasks
    from tests.support.controller_helpers import pool_controller

    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert pc.term is not None

    async def down(_block_ms: int) -> None:
        raise ClusterDownError("CLUSTERDOWN The cluster is down")

    pc.consumer.read_new = down
    loop = asyncio.create_task(pc.sample_loop())
    try:
        errors = lambda: metric(pc, "qos_controller_redis_errors_total", loop="samples")  # noqa: E731
        await wait_for(lambda: asyncio.sleep(0, errors()), timeout=5)
        assert pc.redis_ok is False
    finally:
        assert await stop_tasks([loop], "sample loop", wait_s=1.0)


async def test_each_loop_says_once_that_redis_is_out_while_another_loop_reaches_it(
        aredis, pool, cfg, caplog):
    """While a reshard held the tick's key on another node, the lease loop's renewals kept
    working and set the one "Redis ok" flag again each time: the tick loop warned "Redis
    unavailable" at every tick (a review). Each loop now warns once when its own outage starts,
    and says when it is over."""
    import logging

    from redis.exceptions import ConnectionError as RedisConnectionError

    from limiter.tasks import stop_tasks
    from tests.support.controller_helpers import pool_controller

    caplog.set_level(logging.INFO, logger="qos.controller")
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert pc.term is not None
    real_tick, failing = pc.tick, {"on": True}

    async def tick(term):
        if failing["on"]:
            raise RedisConnectionError("TTL exhausted.")
        return await real_tick(term)

    pc.tick = tick
    loops = [asyncio.create_task(pc.tick_loop())]
    try:
        ticks = lambda: metric(pc, "qos_controller_redis_errors_total", loop="tick")  # noqa: E731
        for n in range(1, 4):  # three failed ticks, each followed by a lease renewal that works
            await wait_for(lambda n=n: asyncio.sleep(0, ticks() >= n), timeout=10)
            await pc.renew_once()
            assert pc.redis_ok
        warned = [r for r in caplog.records if "Redis unavailable in tick loop" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        failing["on"] = False
        await wait_for(lambda: asyncio.sleep(0, any("reachable again in tick" in r.getMessage()
                                                    for r in caplog.records)), timeout=10)
    finally:
        assert await stop_tasks(loops, "tick loop", wait_s=1.0)
