"""tests/bench_script_batcher.py (a benchmark script, not collected itself): its figures are
of the admits it measures."""

from __future__ import annotations

import pytest

from limiter.config import RedisConfig
from limiter.localstack.redis_server import RedisServer
from limiter.redis_conn import open_redis
from tests import bench_script_batcher as bench


@pytest.mark.parametrize(("way", "concurrency", "per_trip"), [("pipelined", 8, 8.0), ("merged", 32, 32.0),
                                                               ("alone", 8, 1.0)])
async def test_admits_a_round_trip_counts_the_admits_only(way: str, concurrency: int,
                                                          per_trip: float) -> None:
    """The figure printed as "admits a round trip": the claim that empties the queue after
    each block of 128 (and the pool's setup) is no admit, and its round trip is not one of
    theirs (counted in, 8 at once read 7.6 and 32 at once 25.8)."""
    with RedisServer() as server:
        client = open_redis(RedisConfig(url=server.url), pool_wait_s=5)
        try:
            _cpu, _wall, trip = await bench.one_round(client, lambda _key: server.client(), way, concurrency,
                                                      2 * bench.BLOCK, f"t{concurrency}-{way}")
        finally:
            await client.aclose()
    assert trip == pytest.approx(per_trip)
