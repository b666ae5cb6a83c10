"""open_redis on a cluster: more commands in flight than connections wait their turn (as on a
standalone Redis) instead of failing at once with redis-py's MaxConnectionsError."""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import ConnectionError as RedisConnectionError

from limiter.config import RedisConfig
from limiter.redis_conn import WaitingRedisCluster, open_redis

HOLD_S = 0.2  # each command holds its connection this long (BLPOP on an empty list)


async def _hold(client, n: int) -> list[object]:
    return await asyncio.gather(*(client.blpop(["qos:{conn}:empty"], HOLD_S) for _ in range(n)),
                                return_exceptions=True)


async def test_commands_beyond_max_connections_wait_for_a_turn(redis_cluster) -> None:
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=2, pool_wait_s=5.0)
    assert isinstance(client, WaitingRedisCluster)
    try:
        t0 = time.monotonic()
        got = await _hold(client, 6)
        took = time.monotonic() - t0
        assert got == [None] * 6  # every one answered: none failed for want of a connection
        assert took >= 3 * HOLD_S * 0.9  # two at a time: three turns
        async with client.pipeline(transaction=False) as pipe:  # pipelines take a turn too
            pipe.get("qos:{conn}:x")
            assert await pipe.execute() == [None]
    finally:
        await client.aclose()


async def test_a_turn_not_given_within_pool_wait_is_an_outage(redis_cluster) -> None:
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=1, pool_wait_s=0.05)
    try:
        got = await _hold(client, 3)
        assert got[0] is None
        assert any(isinstance(g, RedisConnectionError) for g in got[1:])
    finally:
        await client.aclose()


async def test_without_pool_wait_the_cluster_client_fails_at_once(redis_cluster) -> None:
    """What the waiting client is for: redis-py's own refuses a command past max_connections."""
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=1)
    assert not isinstance(client, WaitingRedisCluster)
    try:
        got = await _hold(client, 3)
        assert any(isinstance(g, RedisConnectionError) for g in got)
    finally:
        await client.aclose()
