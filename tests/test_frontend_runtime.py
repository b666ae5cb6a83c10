"""The frontend runtime: its reply readers and its Redis connection budget."""

from __future__ import annotations

import asyncio
import dataclasses

from limiter.config import RedisConfig, demo_config, validate
from limiter.frontend.metrics import FrontendMetrics
from limiter.frontend.runtime import Frontend
from limiter.frontend.settings import FrontendSettings
from limiter.keys import PoolKeys


async def test_a_frontend_with_as_many_pools_as_redis_connections_becomes_ready(redis_server, sync_redis):
    """The blocking XREAD loops, one per pool, shared the frontend's connection pool with
    everything else: with as many pools as redis_max_connections (4 and the minimum 4, both
    valid) the readers held every connection for ever (each took its own back before a
    waiting command could), bootstrap and every heartbeat failed with 'No connection
    available', and the frontend was never ready. They have connections of their own now."""
    cfg = demo_config()
    tiny = cfg.pools[0]
    pools = (tiny, *(dataclasses.replace(tiny, name=f"p{i}") for i in range(1, 4)))
    cfg = validate(dataclasses.replace(cfg, redis=RedisConfig(url=redis_server.url), pools=pools))
    fe = Frontend(FrontendSettings(redis_max_connections=4), cfg, FrontendMetrics())
    await fe.start()
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 10.0
        while not fe.ready() and loop.time() < end:
            await asyncio.sleep(0.1)
        assert fe.ready(), (f"never ready in 10 s: bootstrapped={fe.bootstrapped}, "
                            f"reply readers healthy={fe.router.healthy}, "
                            f"frontends zset={sync_redis.zrange(PoolKeys('tiny').frontends, 0, -1)}")
    finally:
        await fe.stop()


async def test_a_frontend_whose_reply_reader_cannot_read_is_not_ready(redis_server):
    """The reply readers have connections of their own: when those fail (here: pointed at a
    closed port) while the command connections work, the frontend would admit requests whose
    answers it never reads. /readyz says so, and says ready again once the reader reads."""
    from limiter.localstack.redis_server import free_port
    from limiter.redis_conn import open_redis
    from tests.support.helpers import wait_until

    cfg = validate(dataclasses.replace(demo_config(), redis=RedisConfig(url=redis_server.url)))
    fe = Frontend(FrontendSettings(), cfg, FrontendMetrics())
    await fe.start()
    good = fe.router.reader
    broken = open_redis(RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0"), max_connections=1)
    try:
        await wait_until(fe.ready, "the frontend to be ready")
        fe.router.reader = broken
        await wait_until(lambda: not fe.ready(), "the frontend to see its reply reader fail")
        assert fe.not_ready_because() == "the reply stream of pool tiny cannot be read"
        assert fe.heartbeat.fresh(5.0) and fe.bootstrapped  # only the reader is down
        fe.router.reader = good
        await wait_until(fe.ready, "the frontend to be ready again")
    finally:
        fe.router.reader = good
        await fe.stop()
        await broken.aclose()
