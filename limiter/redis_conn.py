"""Opening Redis: one client per process (a connection pool of O(1) size), standalone or
Cluster, with TLS via ``rediss://`` and credentials from the URL; and what counts as
"Redis is unreachable" (:data:`CONNECTION_ERRORS`, :func:`map_redis_errors`)."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter.cluster_client import CheckedRedisCluster, WaitingRedisCluster
from limiter.config import RedisConfig
from limiter.errors import ConfigError, RedisUnavailable
from limiter.keys import PoolKeys

# Connection-level failures of a redis-py call: the server is down, out of reach, or too
# slow; or a cluster that cannot serve the slot now (CLUSTERDOWN / MASTERDOWN during a
# failover, TRYAGAIN during a reshard, a slot no master covers). A script's error reply is a
# ResponseError: an answer, not an outage -- but ClusterDownError and TryAgainError are
# ResponseErrors too, so whoever maps replies checks for these first (scripts.py).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, ClusterError, TryAgainError, SlotNotCoveredError)
# A new connection (TCP, TLS handshake, AUTH) gets this long: go-redis's default. At 2 s a
# TLS handshake on a loaded host timed out and turned requests away with Redis answering.
CONNECT_TIMEOUT_S = 5.0
# A command whose reply does not come within this long fails as an outage (a Redis that
# accepts connections and never answers: stopped, or hung). Set here rather than left to
# redis-py's default, because a client whose commands block (BLPOP, XREAD BLOCK) needs its
# blocking time on top: at the bare 5 s, a worker with idle_block_s = 10 took every idle
# BLPOP for an outage and backed off (open_redis's ``blocking_s``).
SOCKET_TIMEOUT_S = 5.0
# redis-py's cluster client raises a bare RedisClusterException when, building its slot map,
# no node answers or some slot has no master (a failover in progress); the same type also
# reports misconfiguration and misuse, which must stay errors: only these messages are outages.
_CLUSTER_UNREACHABLE = ("Redis Cluster cannot be connected", "All slots are not covered")
# ...except this one, which redis-py raises when a node answered CLUSTER SLOTS with an error:
# the node is no cluster (a standalone Redis), or the user may not run the command. Inside the
# "cannot be connected" message when it is every node's answer.
_CLUSTER_NOT_ENABLED = "Cluster mode is not enabled on this node"
# What a loop that keeps going through outages catches: the raw failures above, or the same
# outage already mapped by a lower layer (scripts.py). TimeoutError (e.g. a controller step
# that overran its own deadline) is an OSError: handled like an outage.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisUnavailable, *CONNECTION_ERRORS)


# Replies of a store that cannot take a command now, whatever the command: its state, not a
# bug, so an outage. redis-py has classes for OOM (maxmemory, noeviction) and READONLY (a
# failover made it a replica) (MASTERDOWN is a ClusterError, above); these come as bare
# ResponseErrors, their code the message's first word: NOREPLICAS (min-replicas-to-write not
# met), UNBLOCKED (a blocked BLPOP released as the server became a replica: an idle worker
# died of it), BUSY (a script ran past busy-reply-threshold: every other command waits for it)
# and MISCONF (a failed snapshot: stop-writes-on-bgsave-error refuses every write). A worker
# died of the last two too (its wake-list LPOP).
_STORE_REFUSALS = frozenset({"NOREPLICAS", "UNBLOCKED", "BUSY", "MISCONF"})
# redis-py rewrites an error of a pipeline's command: "Command # 2 (ZADD ...) of pipeline
# caused error: <the reply>".
_PIPELINE_ERROR = " of pipeline caused error: "


def store_refused(exc: ResponseError) -> bool:
    """Whether ``exc`` is Redis refusing for its own state (an outage) rather than the call,
    alone or as a pipeline's command."""
    if isinstance(exc, OutOfMemoryError | ReadOnlyError):
        return True
    message = str(exc)
    if message.startswith("Command # ") and _PIPELINE_ERROR in message:
        message = message.partition(_PIPELINE_ERROR)[2]
    return message.partition(" ")[0] in _STORE_REFUSALS


def cluster_misconfigured(exc: ResponseError) -> ConfigError | None:
    """The error to raise for ``exc`` when it is a MOVED or ASK redirection (alone or as a
    pipeline's command), else None. Only a client that does not speak cluster sees one (the
    cluster client follows them): ``redis.url`` names a node of a Redis Cluster while
    ``redis.cluster`` is false. Its bare text was all an operator read ("2789
    127.0.0.1:22896", the slot and another node), or a controller's traceback every second."""
    if not isinstance(exc, AskError):  # MovedError is an AskError
        return None
    return ConfigError("redis.cluster", "redis.url is a node of a Redis Cluster (it sent a command on "
                       "to another node): set redis.cluster = true (env QOS_REDIS_CLUSTER=1)")


def cluster_not_enabled(exc: RedisClusterException) -> ConfigError | None:
    """The error to raise for ``exc`` when the cluster client found no cluster at
    ``redis.url``, else None: ``redis.cluster`` is true and the server is a standalone Redis
    (the mirror of :func:`cluster_misconfigured`). It was read as an outage: every role
    retried it for ever, the frontend answering 503 "not connected to Redis yet"."""
    if _CLUSTER_NOT_ENABLED not in str(exc):
        return None
    # redis-py raises it for any ResponseError to CLUSTER SLOTS: a real cluster's node refusing
    # for its state (BUSY: a script past busy-reply-threshold) is an outage, not this mistake
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ResponseError) and store_refused(cause):
            return None
        cause = cause.__cause__ or cause.__context__
    return ConfigError("redis.cluster", "redis.url is not a Redis Cluster (CLUSTER SLOTS was refused: a "
                       "standalone Redis, or a Redis user without +cluster|slots): set redis.cluster = "
                       "false (env QOS_REDIS_CLUSTER=0) for a standalone Redis")


# redis-py's ClusterError once a command's redirections (MOVED, ASK, TRYAGAIN) ran out
_REDIRECTS_EXHAUSTED = "TTL exhausted"


@contextlib.contextmanager
def map_redis_errors() -> Iterator[None]:
    """Turn a connection-level failure inside the block, or a refusal for the store's own
    state (:func:`store_refused`), into :class:`RedisUnavailable`, the one outage type every
    layer above handles (503 in the frontend, back-off elsewhere); a cluster's redirection
    into the configuration error it is (:func:`cluster_misconfigured`)."""
    try:
        yield
    except CONNECTION_ERRORS as exc:
        if isinstance(exc, ClusterError) and str(exc).startswith(_REDIRECTS_EXHAUSTED):
            # redis-py's whole message: an operator read "Redis unavailable: TTL exhausted." alone
            raise RedisUnavailable("Redis unavailable: the cluster kept redirecting the command "
                                   "(TTL exhausted: a reshard or a failover under way?)") from exc
        raise RedisUnavailable(f"Redis unavailable: {exc}") from exc
    except ResponseError as exc:
        if (wrong := cluster_misconfigured(exc)) is not None:
            raise wrong from exc
        if not store_refused(exc):
            raise
        raise RedisUnavailable(f"Redis refused the command: {exc}") from exc
    except RedisClusterException as exc:
        if (wrong := cluster_not_enabled(exc)) is not None:
            raise wrong from exc
        if not str(exc).startswith(_CLUSTER_UNREACHABLE):
            raise
        raise RedisUnavailable(f"Redis unavailable: {exc}") from exc


def open_redis(cfg: RedisConfig, *, max_connections: int = 16, decode_responses: bool = False,
               pool_wait_s: float | None = None, blocking_s: float = 0.0) -> Any:
    """Build an async client; nothing connects until the first command.

    The client does not retry by itself: a command either answers or raises at once, and
    each role decides what an outage means (the frontend answers 503 with Retry-After,
    workers and controllers back off and retry their loop). Silent client-side retries
    would hide an outage from those decisions and stretch a request past its deadline;
    redis-py's cluster client still follows MOVED/ASK redirections.

    With ``pool_wait_s`` a command that finds all ``max_connections`` busy waits up to that
    long for one instead of failing at once: a server with many concurrent requests keeps
    O(1) connections. (On a cluster, :class:`WaitingRedisCluster`.)

    ``blocking_s``: the longest a command of this client blocks on the server by design
    (BLPOP's timeout, XREAD's BLOCK); a reply may take that much longer than
    :data:`SOCKET_TIMEOUT_S` before the client gives up.
    """
    retry = Retry(NoBackoff(), retries=0)
    common: dict[str, Any] = {
        "decode_responses": decode_responses,
        "retry": retry,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S + blocking_s,
        "health_check_interval": 15,
    }
    url = cfg.url
    if blocking_s:
        # redis-py lets the URL's query replace any argument: `?socket_timeout=1` took the
        # blocking time away, and every idle BLPOP / XREAD BLOCK timed out as an outage.
        url, own = _without_query_option(url, "socket_timeout")
        if own is not None:
            common["socket_timeout"] = float(own) + blocking_s
    if cfg.cluster:
        if pool_wait_s is not None:
            return WaitingRedisCluster.from_url(url, max_connections=max_connections,
                                                pool_wait_s=pool_wait_s, **common)
        return CheckedRedisCluster.from_url(url, max_connections=max_connections, **common)
    if pool_wait_s is not None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, socket_keepalive=True, **common)
        return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool
    return aioredis.from_url(url, max_connections=max_connections, socket_keepalive=True, **common)


def _without_query_option(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without the query option ``name``, and its value (the first, as redis-py reads
    it; None when absent). The rest of the URL is left as it is."""
    # split as urlsplit does (the fragment first, then the query), but keep the rest as written:
    # urlunsplit turned unix:///path into unix:/path, which redis-py refuses
    base, hash_sep, fragment = url.partition("#")
    head, _, raw_query = base.partition("?")
    query = urllib.parse.parse_qsl(raw_query, keep_blank_values=True)
    values = [v for k, v in query if k == name]
    if not values:
        return url, None
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != name])
    return head + ("?" + rest if rest else "") + hash_sep + fragment, values[0]


async def shard_of(client: Any, key: str) -> Any | None:
    """The cluster node holding ``key`` (for a keyless command meant for that shard: TIME,
    PING, SCRIPT LOAD), or None for a single server."""
    if not isinstance(client, RedisCluster):
        return None
    # the slot map is read at the client's first command: a new client (`qos status`) had
    # none, and every slot read as not covered (found by a review)
    await client.initialize()
    return client.get_node_from_key(key)


async def redis_now_ms(client: Any, keys: PoolKeys) -> float:
    """Redis TIME -- on a cluster, of the shard holding this pool (the clock its scripts stamp
    everything with: hosts' clocks differ); cluster pipelines refuse keyless commands, hence a
    call of its own."""
    node = await shard_of(client, keys.policy)
    if node is not None:
        sec, usec = await client.execute_command("TIME", target_nodes=node)
    else:
        sec, usec = await client.time()
    return int(sec) * 1000 + int(usec) / 1000


# Under `maxmemory`, any policy but noeviction lets Redis delete keys to make room: a request's
# record (every unfinished one has a TTL, so the volatile-* policies take them first), a
# queue, a pool's policy. What a deleted record held (its tenant's unfinished count, its
# class's leased count) cannot be given back, the record being what named it: a tenant with a
# max_inflight cap loses a turn for good. noeviction refuses writes instead (an outage the
# roles ride out: 503, back-off), which loses nothing.
EVICTION_RISK = ("Redis may delete this pool's keys under memory pressure (maxmemory-policy {policy}, "
                 "maxmemory {maxmemory} bytes): a deleted request record leaks its tenant's and class's "
                 "counts; set maxmemory-policy noeviction")


async def eviction_risk(client: Any, keys: PoolKeys) -> str | None:
    """The warning to give when the shard holding ``keys``' pool may evict keys (a maxmemory
    set and a policy but noeviction), else None. None too where INFO is refused (an ACL user
    without +info): nothing is known, and the roles work without it."""
    node = await shard_of(client, keys.policy)
    try:
        info = await (client.info("memory", target_nodes=node) if node is not None else client.info("memory"))
    except ResponseError:
        return None
    policy, maxmemory = info.get("maxmemory_policy", "noeviction"), int(info.get("maxmemory", 0) or 0)
    if policy == "noeviction" or maxmemory <= 0:
        return None
    return EVICTION_RISK.format(policy=policy, maxmemory=maxmemory)
