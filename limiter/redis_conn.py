"""Opening Redis: one client per process (a connection pool of O(1) size), standalone or
Cluster, with TLS via ``rediss://`` and credentials from the URL; and what counts as
"Redis is unreachable" (:data:`CONNECTION_ERRORS`, :func:`map_redis_errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
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


class CheckedConnection(Connection):
    """A connection that, before each command it sends, checks the server has not closed it
    meanwhile and connects again if it has, as the standalone pool does when it hands one
    out (``ensure_connection``). Nothing of the command has been sent at that point, so
    connecting again cannot run it twice. Not while connecting: the handshake sends several
    commands before it reads their replies."""

    _handshaking = False

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        self._handshaking = True
        try:
            await super().connect_check_health(*args, **kwargs)
        finally:
            self._handshaking = False

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and not self._handshaking and await self._closed_by_server():
            await self.disconnect()
        await super().send_packed_command(command, check_health)

    async def _closed_by_server(self) -> bool:
        try:
            await self.can_read()  # raises on EOF (closed) or a reset; True: unread bytes
        except (RedisConnectionError, OSError):
            return True
        return False


class CheckedSSLConnection(CheckedConnection, SSLConnection):
    pass


_CHECKED = {Connection: CheckedConnection, SSLConnection: CheckedSSLConnection}


class CheckedRedisCluster(RedisCluster):
    """A cluster client whose connections survive the server closing them while idle.

    redis-py's cluster nodes hand out a free connection as it is: one the server closed while
    it sat idle (Redis' ``timeout``, a managed service's idle limit, a restart of a proxy)
    failed its next command with "Connection closed by server", one per node, which a
    frontend answered 503 and a worker took for an outage and backed off. The standalone pool
    checks each connection it hands out; these connections check themselves before writing.
    ``RedisCluster`` takes no connection class, so the one it would use is swapped for its
    checked kind in the kwargs every node is built from.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        checked = _CHECKED.get(self.connection_kwargs["connection_class"])
        if checked is None:
            raise TypeError(f"no checked kind of {self.connection_kwargs['connection_class']!r}")
        self.connection_kwargs["connection_class"] = checked  # every node made from now on
        for node in self.startup_nodes:  # and the ones made already
            node.connection_class = checked


# The WaitingRedisCluster clients (by id) whose turn the running task holds for a pipeline.
_PIPELINE_TURNS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "qos_pipeline_turns", default=frozenset())

# The turns of the commands whose node is not known before they are sent: a keyless command
# sent to a node flag ("primaries"), one sent before the client has read the slot map.
UNKNOWN_NODE = ""
_EVAL_COMMANDS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"})


class WaitingRedisCluster(CheckedRedisCluster):
    """A cluster client whose commands wait (up to ``pool_wait_s``) for a free connection.

    redis-py's cluster client fails a command at once (``MaxConnectionsError``) when the
    node's ``max_connections`` are all busy, where the standalone client here waits for one:
    a worker with more requests in flight than connections then took its own cap for an
    outage and backed off. This lets at most ``max_connections`` commands and pipelines be
    in flight to each node, and the rest wait their turn; one that waits longer than
    ``pool_wait_s`` fails as an outage, as on a standalone Redis.

    The turns are per node: a node that does not answer (a host gone without a reset, a
    stopped process) holds each call for the socket timeout, and with one set of turns for
    the whole client its calls took every turn and the other shards' pools waited too
    (found 2026-12-06: a frontend's second pool stalled ~5 s). A pipeline takes a turn of
    each node its commands go to, and holds none while it waits for another.

    A command redirected by ``MOVED``/``ASK`` while a slot moves goes on to the new owner
    inside its first node's turn (redis-py follows it within one call): each node's pool is
    made twice ``max_connections`` so that such commands (at most the old owner's turns)
    find a connection there even when the new owner's turns are all taken.
    """

    def __init__(self, *args: Any, pool_wait_s: float = 5.0, **kwargs: Any) -> None:
        per_node = kwargs.get("max_connections") or 2**31
        kwargs["max_connections"] = 2 * per_node  # room for the redirected (above)
        super().__init__(*args, **kwargs)
        self.pool_wait_s = pool_wait_s
        self.turns_per_node = per_node
        self._turns: dict[str, asyncio.Semaphore] = {}

    def turns_of(self, node_name: str) -> asyncio.Semaphore:
        """The turns of the node named ``node_name`` (host:port; :data:`UNKNOWN_NODE`)."""
        turns = self._turns.get(node_name)
        if turns is None:
            turns = self._turns[node_name] = asyncio.Semaphore(self.turns_per_node)
        return turns

    async def node_of(self, args: tuple[Any, ...], target_nodes: Any = None) -> str | list[str]:
        """The name of the node a command will go to, as far as the client's slot map tells
        before sending it (a node flag, a keyless command, no slot map yet:
        :data:`UNKNOWN_NODE`); several for a command given several target nodes."""
        if target_nodes is not None:
            nodes = list(target_nodes.values()) if isinstance(target_nodes, dict) else (
                list(target_nodes) if isinstance(target_nodes, list | tuple) else [target_nodes])
            names = [n.name for n in nodes if isinstance(n, ClusterNode)]
            return names if names and len(names) == len(nodes) else UNKNOWN_NODE
        try:
            command = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
            if command.upper() in _EVAL_COMMANDS and int(args[2]) > 0:
                slot = self.keyslot(args[3])  # the hot path: no parse of the command
            else:
                slot = await self._determine_slot(*args)  # as redis-py routes it
            return self.nodes_manager.get_node_from_slot(slot).name
        except Exception:  # sent anyway: redis-py routes it, or refuses it, as it would have
            return UNKNOWN_NODE

    @contextlib.asynccontextmanager
    async def turn(self, nodes: str | list[str] | set[str]) -> AsyncIterator[None]:
        """A turn of each of ``nodes`` (names), waited for up to ``pool_wait_s`` in all."""
        if id(self) in _PIPELINE_TURNS.get():
            # a pipeline's command sent again alone (MOVED/ASK/TRYAGAIN) inside the pipeline's
            # turn, its connections released by then: a turn of its own would wait on the
            # pipelines holding the others, which after a reshard all wait so (pool_wait_s)
            yield
            return
        held = await self._take_turns((nodes,) if isinstance(nodes, str) else sorted(set(nodes)))
        try:
            yield
        finally:
            for turns in held:
                turns.release()

    async def _take_turns(self, names: Sequence[str]) -> list[asyncio.Semaphore]:
        """A turn of each node of ``names``; raises an outage after ``pool_wait_s``. Never
        holds a turn while it waits for another: a pipeline over two nodes held the first's
        turn while the second did not answer, and the first node's other calls waited too."""
        held: dict[str, asyncio.Semaphore] = {}
        deadline: float | None = None
        try:
            while True:
                blocked: tuple[str, asyncio.Semaphore] | None = None
                for name in names:
                    if name in held:
                        continue
                    turns = self.turns_of(name)
                    if turns.locked():
                        blocked = name, turns
                        break
                    await turns.acquire()  # free: taken at once, no timer armed (~5 us a call)
                    held[name] = turns
                if blocked is None:
                    return list(held.values())
                for turns in held.values():
                    turns.release()
                held.clear()
                if deadline is None:
                    deadline = asyncio.get_running_loop().time() + self.pool_wait_s
                async with asyncio.timeout_at(deadline):
                    await blocked[1].acquire()
                held[blocked[0]] = blocked[1]
        except BaseException as exc:
            for turns in held.values():
                turns.release()
            if isinstance(exc, TimeoutError):
                raise RedisConnectionError(f"no free connection within {self.pool_wait_s:g} s") from exc
            raise

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn(await self.node_of(args, kwargs.get("target_nodes"))):
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        # A pipeline holds one connection per node it sends to: one turn of each covers it.
        # Its commands redirected by MOVED/ASK or refused with TRYAGAIN are sent again one by
        # one through execute_command once its connections are released: inside the same turn.
        pipe = super().pipeline(transaction, shard_hint)
        execute, queue, reset = pipe.execute, pipe.execute_command, pipe.reset
        queued: list[tuple[tuple[Any, ...], Any]] = []  # since the last execute: (args, target)

        def queue_command(*args: Any, **kwargs: Any) -> Any:
            queued.append((args, kwargs.get("target_nodes")))
            return queue(*args, **kwargs)

        async def execute_in_turn(*args: Any, **kwargs: Any) -> Any:
            try:
                nodes: set[str] = set()
                for command, target in queued:
                    node = await self.node_of(command, target)
                    nodes.update([node] if isinstance(node, str) else node)
                async with self.turn(nodes or UNKNOWN_NODE):
                    held = _PIPELINE_TURNS.set(_PIPELINE_TURNS.get() | {id(self)})
                    try:
                        return await execute(*args, **kwargs)
                    finally:
                        _PIPELINE_TURNS.reset(held)
            finally:
                queued.clear()  # redis-py empties the pipeline after execute, raised or not

        async def reset_queued(*args: Any, **kwargs: Any) -> Any:
            queued.clear()
            return await reset(*args, **kwargs)

        pipe.execute_command = queue_command  # the command methods (pipe.get) call it too
        pipe.execute = execute_in_turn
        pipe.reset = reset_queued
        return pipe


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
