"""Private redis-server processes for tests: never the shared instance on 6379.

RedisServer, free_port and the local cluster live in limiter.localstack.redis_server (qos up
and the benchmarks use them too); they are re-exported here under their old names.
"""

from __future__ import annotations

from typing import Any

from limiter.localstack.redis_server import (
    LocalRedisCluster,
    RedisServer,
    free_port,
    pools_on_distinct_shards,
)

__all__ = ["RedisClusterServers", "RedisServer", "free_port", "pools_on_different_shards"]

RedisClusterServers = LocalRedisCluster  # a local 3-master Redis Cluster (no replicas)


def pools_on_different_shards(client: Any, prefix: str = "pool") -> list[str]:
    """Two pool names whose hash tags land on different masters of ``client``'s cluster."""
    return pools_on_distinct_shards(lambda key: client.get_node_from_key(key).name, 2, prefix)
