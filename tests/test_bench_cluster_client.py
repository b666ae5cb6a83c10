"""tests/bench_cluster_client.py runs (a quick form): its figures are positive and redis-py's
send is put back afterwards (the client works again)."""

from __future__ import annotations

from limiter.config import RedisConfig
from limiter.redis_conn import open_redis
from tests.bench_cluster_client import measure


async def test_the_cluster_client_bench_runs_and_puts_the_send_back(redis_cluster) -> None:
    best = await measure(redis_cluster.url, calls=8, rounds=1)
    assert set(best) == {"command", "pipeline of 8"} and all(0 < us < 1e6 for us in best.values())
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), max_connections=2, pool_wait_s=5.0)
    try:
        assert await client.set("qos:{bench}:k", "1") is True
        async with client.pipeline(transaction=False) as pipe:
            pipe.get("qos:{bench}:k")
            assert await pipe.execute() == [b"1"]
    finally:
        await client.aclose()
