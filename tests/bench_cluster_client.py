"""The cluster client's own CPU per command and per pipeline: ``python tests/bench_cluster_client.py``.

The waiting client the frontends and workers use on a Redis Cluster
(``limiter/cluster_client.py``: a turn of the command's node, the node looked up from the
slot map) on a local 3-master cluster, with redis-py's send stubbed out so that only what
the client does before sending is timed: an ``EVALSHA`` alone, and a pipeline of 8 of one
script and key as the script batcher sends them. Prints microseconds of wall time (one
process, no I/O: its CPU) per call, best of ``--rounds``. Not collected by pytest (no
``test_`` prefix); docs/reliability.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from limiter.config import RedisConfig
from limiter.localstack.redis_server import LocalRedisCluster
from limiter.redis_conn import open_redis

ARGS = ("EVALSHA", "a" * 40, 1, "qos:{pool}:k", "x")


async def measure(url: str, calls: int, rounds: int) -> dict[str, float]:
    client = open_redis(RedisConfig(url=url, cluster=True), max_connections=16, pool_wait_s=5.0)
    await client.initialize()

    async def sent(*_args: object, **_kwargs: object) -> None:
        return None

    async def pipeline_sent(*_args: object, **_kwargs: object) -> list[object]:
        return []

    stubbed = RedisCluster.execute_command, ClusterPipeline.execute
    RedisCluster.execute_command = sent  # type: ignore[method-assign]  # put back below
    ClusterPipeline.execute = pipeline_sent  # type: ignore[method-assign]
    best = {"command": float("inf"), "pipeline of 8": float("inf")}
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(calls):
                await client.execute_command(*ARGS)
            best["command"] = min(best["command"], (time.perf_counter() - t) / calls * 1e6)
            t = time.perf_counter()
            for _ in range(calls // 4):
                pipe = client.pipeline(transaction=False)
                for _ in range(8):
                    pipe.execute_command(*ARGS)
                await pipe.execute()
            best["pipeline of 8"] = min(best["pipeline of 8"], (time.perf_counter() - t) / (calls // 4) * 1e6)
    finally:
        RedisCluster.execute_command, ClusterPipeline.execute = stubbed  # type: ignore[method-assign]
        await client.aclose()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.calls < 4 or args.rounds < 1:
        p.error("--calls must be >= 4 and --rounds >= 1")
    cluster = LocalRedisCluster().start()
    try:
        best = asyncio.run(measure(cluster.url, args.calls, args.rounds))
    finally:
        cluster.stop()
    for what, us in best.items():
        print(f"cluster client, {what}: best {us:.1f} us of CPU (send stubbed)")


if __name__ == "__main__":
    main()
