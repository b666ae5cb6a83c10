"""Private redis-server processes for tests: never the shared instance on 6379.

RedisServer and free_port live in limiter.localstack.redis_server (qos up uses them too);
they are re-exported here under their old names.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from limiter.localstack.redis_server import RedisServer, free_port

__all__ = ["RedisClusterServers", "RedisServer", "free_port", "pools_on_different_shards"]


@dataclass
class RedisClusterServers:
    """A local 3-master Redis Cluster (no replicas)."""

    nodes: list[RedisServer] = field(default_factory=list)

    def start(self, masters: int = 3) -> RedisClusterServers:
        for _ in range(masters):
            # The bus port defaults to port + 10000, which may not exist: name a free one.
            node = RedisServer(extra=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                                      "--cluster-config-file", "nodes.conf",
                                      "--cluster-port", str(free_port())])
            self.nodes.append(node.start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = self.nodes[0].client().execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" in info:
                return self
            time.sleep(0.1)
        raise RuntimeError("cluster did not become ok")

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def pools_on_different_shards(client, prefix: str = "pool") -> list[str]:
    """Two pool names whose hash tags land on different masters of ``client``'s cluster."""
    from limiter.keys import PoolKeys

    chosen: list[str] = []
    nodes: set[str] = set()
    for i in range(200):
        name = f"{prefix}{i}"
        node = client.get_node_from_key(PoolKeys(name).policy)
        if node.name not in nodes:
            nodes.add(node.name)
            chosen.append(name)
        if len(chosen) == 2:
            return chosen
    raise AssertionError("could not spread two pools over two shards")
