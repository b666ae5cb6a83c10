"""Private redis-server processes for tests: never the shared instance on 6379.

RedisServer, free_port and the local cluster live in limiter.localstack.redis_server (qos up
and the benchmarks use them too); they are re-exported here under their old names.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.crc import key_slot

from limiter.localstack.redis_server import (
    LocalRedisCluster,
    RedisServer,
    free_port,
    pools_on_distinct_shards,
)

__all__ = ["RedisClusterServers", "RedisServer", "free_port", "move_slot", "pools_on_different_shards",
           "refused_port", "unread_requests_at"]

RedisClusterServers = LocalRedisCluster  # a local 3-master Redis Cluster (no replicas)


def pools_on_different_shards(client: Any, prefix: str = "pool") -> list[str]:
    """Two pool names whose hash tags land on different masters of ``client``'s cluster."""
    return pools_on_distinct_shards(lambda key: client.get_node_from_key(key).name, 2, prefix)


def move_slot(cluster: LocalRedisCluster, key: str, *, batch: int = 10, first: Sequence[str] = (),
              midway: Callable[[], None] | None = None, fresh_target: bool = False
              ) -> tuple[RedisServer, RedisServer]:
    """Move ``key``'s slot to another master as ``redis-cli --cluster reshard`` does: the
    target IMPORTING, the source MIGRATING, its keys MIGRATEd ``batch`` at a time, then
    SETSLOT NODE on every master (target first). ``first``: keys MIGRATEd before the others.
    ``midway`` runs while the slot is open, after the first batch (its keys then split between
    the two nodes: scripts get TRYAGAIN, single-key commands ASK). ``fresh_target``: the
    target's script cache is flushed first, as on a node just added to the cluster (a call
    redirected there by ASK then meets NOSCRIPT). Returns (source, target).
    Blocking: run it in a thread beside a stack."""
    slot = key_slot(key.encode())
    src = cluster.owner(key)
    dst = next(n for n in cluster.nodes if n is not src)
    with src.client() as s, dst.client() as d:
        src_id, dst_id = (c.execute_command("CLUSTER MYID").decode() for c in (s, d))
        if fresh_target:
            d.execute_command("SCRIPT FLUSH")
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        if first:
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *first)
            moved += 1
            if midway is not None:
                midway()
        while keys := s.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
            moved += 1
            if moved == 1 and midway is not None:
                midway()
        if moved == 0 and midway is not None:
            midway()
        for node in [dst, src, *(n for n in cluster.nodes if n not in (src, dst))]:
            with node.client() as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        deadline = time.monotonic() + 10
        while cluster.owner(key) is not dst:  # (the seed node answers CLUSTER SLOTS)
            assert time.monotonic() < deadline, "the slot's new owner was not announced"
            time.sleep(0.01)
    return src, dst


def unread_requests_at(port: int) -> int:
    """How many TCP connections to the local server on ``port`` hold bytes the server has not
    read yet (Linux' /proc/net/tcp: established, receive queue > 0): for a stopped server,
    the calls its clients have sent and wait on."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)  # the header
        for line in table:
            fields = line.split()
            local_port, state, unread = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[4]
            if local_port == port and state == "01" and int(unread.split(":")[1], 16) > 0:
                count += 1
    return count


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A local port that refuses connections for the duration of the block: bound here and
    never listening. A free_port() is free only when it is looked at: another process may
    take it meanwhile and answer what was meant to find nothing there."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]
