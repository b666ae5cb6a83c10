"""The Redis Cluster clients :func:`limiter.redis_conn.open_redis` builds.

* :class:`CheckedRedisCluster`: connections that check, before each write, that the server
  has not closed them while idle (the standalone pool does this when it hands one out);
* :class:`WaitingRedisCluster`: commands that wait for a turn of their node (up to
  ``pool_wait_s``) instead of failing at once past ``max_connections``, the turns per node so
  that a shard that does not answer holds up only its own pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.utils import str_if_bytes


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
_STREAM_READS = frozenset({"XREAD", "XREADGROUP"})


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
        self._table_lock = asyncio.Lock()

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        if not self.commands_parser.commands:
            # The command table (COMMAND) from the node the client was pointed at, before the
            # first read of the map: redis-py asks the default node for it, the first primary
            # of the map (the owner of slot 0), and with that shard's host not answering every
            # role of every pool waited out the socket timeout at its start (found by a
            # review). redis-py keeps a table it has and points it at the default node after.
            # One fetch for the commands that start together (the reply is ~100 KB).
            async with self._table_lock:
                for node in list(self.startup_nodes) if not self.commands_parser.commands else ():
                    try:
                        await self.commands_parser.initialize(node)
                        break
                    except (RedisConnectionError, OSError):  # the next one; none: redis-py's way
                        continue
        return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize_due():
            # The slot map first: redis-py (8.2) decides how to route a command before it
            # reads the map, and with none yet takes every command for a keyless one, sent
            # to a random primary. A client's first command went to another shard (a MOVED
            # more), or, that shard's host not answering, waited out its socket timeout: a
            # worker's first BLPOP on its wake list sat 600 s on a stopped node of another
            # pool, and the worker claimed nothing (found by a run of a shard-outage test).
            # redis-py's own test of whether a read is under way or due, not "no default
            # node": that is published before the command table is read, and a command sent
            # meanwhile fetched the table again itself (found by a review).
            await self.initialize()
        self._target_stream_read(args, kwargs)
        return await super().execute_command(*args, **kwargs)

    def _target_stream_read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An XREAD or XREADGROUP is sent to its key's node, as redis-py would have sent it:
        redis-py cannot find a stream read's keys itself and asked a server (COMMAND GETKEYS,
        the default node) before every read, a round trip more for each of the frontends'
        reply reads and the controllers' sample reads, and one that waited on whichever
        shard is the default node: with it stopped, every pool's reads failed (found by a
        review)."""
        if kwargs.get("target_nodes") is None and args and str_if_bytes(args[0]).upper() in _STREAM_READS \
                and not self._initialize_due() and (node := self._stream_read_node(args)) is not None:
            # (not while a refresh of the slot map is due: redis-py runs it first and routes
            # by the new map, where the slot's old owner may be gone -- found by a review)
            kwargs["target_nodes"] = node

    def _stream_read_node(self, args: tuple[Any, ...]) -> ClusterNode | None:
        """The node of a stream read's first stream, or None where the slot map does not
        tell. (Streams of several slots in one read: the server refuses it, CROSSSLOT.)"""
        try:
            # XREADGROUP GROUP <group> <consumer> ...: a group or consumer may be called STREAMS
            first = 4 if str_if_bytes(args[0]).upper() == "XREADGROUP" else 1
            key = next(args[i + 1] for i in range(first, len(args))
                       if isinstance(args[i], str | bytes) and str_if_bytes(args[i]).upper() == "STREAMS")
            return self.nodes_manager.get_node_from_slot(self.keyslot(key))
        except Exception:
            return None


# The WaitingRedisCluster clients (by id) whose turn the running task holds for a pipeline.
_PIPELINE_TURNS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "qos_pipeline_turns", default=frozenset())

# The turns of the commands whose node is not known before they are sent: a keyless command
# or one sent to a node flag ("primaries"), one whose keys only the server can find, one
# sent before the client has read the slot map.
UNKNOWN_NODE = ""
_EVAL_COMMANDS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"})
# A pipeline over several nodes waits for the turns after its first at most this long (then
# twice as long, ...) while it holds that first: then it gives its turns back and tries
# again (see _take_turns).
HELD_WAIT_S = 0.05


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
    each node its commands go to.

    The turns bound the connections; redis-py's own cap per node is lifted. A command
    redirected by ``MOVED``/``ASK`` while slots move goes on to the new owner inside its
    first node's turn (redis-py follows it within one call), so a node may have its own
    commands in flight and, during a reshard, those redirected from every node that gave it
    slots, and the commands of unknown node: a cap of twice the turns still failed with
    ``MaxConnectionsError`` once two nodes' slots moved to a third (found by a review).
    """

    def __init__(self, *args: Any, pool_wait_s: float = 5.0, **kwargs: Any) -> None:
        per_node = kwargs.get("max_connections") or 2**31
        kwargs["max_connections"] = 2**31  # the turns bound them (above)
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
        before sending it, without asking a server (:data:`UNKNOWN_NODE` where it does not
        tell); several for a command given several target nodes."""
        if target_nodes is not None:
            nodes = list(target_nodes.values()) if isinstance(target_nodes, dict) else (
                list(target_nodes) if isinstance(target_nodes, list | tuple) else [target_nodes])
            names = [n.name for n in nodes if isinstance(n, ClusterNode)]
            return names if names and len(names) == len(nodes) else UNKNOWN_NODE
        try:
            command = str_if_bytes(args[0]).upper()
            if command in _EVAL_COMMANDS:  # the hot path: no parse of the command
                key = args[3] if int(args[2]) > 0 else None  # no key: redis-py picks a random slot
            elif command in _STREAM_READS:
                node = self._stream_read_node(args)
                return UNKNOWN_NODE if node is None else node.name
            else:
                # a container command ("XGROUP CREATE") is known by its first word
                spec = self.commands_parser.commands.get(command.split(" ", 1)[0].lower())
                if spec is None or "movablekeys" in spec["flags"]:
                    return UNKNOWN_NODE  # its keys are the server's to find
                return self.nodes_manager.get_node_from_slot(await self._determine_slot(*args)).name
            if key is None:
                return UNKNOWN_NODE
            return self.nodes_manager.get_node_from_slot(self.keyslot(key)).name
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
        """A turn of each node of ``names`` (in one order), within ``pool_wait_s``, else an
        outage. A free turn is taken without arming a timer (~5 us a call). With several
        nodes, the turns after the first are waited for at most :data:`HELD_WAIT_S` (twice
        that the next time, and so on) while the first are held, then all are given back and
        taken again: waiting as long as it takes held a healthy node's turn while another
        node did not answer, and giving them back whenever the next was busy let steady
        traffic starve the pipeline (found by a review: five pipelines over two busy nodes
        all failed)."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        held_wait_s = HELD_WAIT_S
        while True:
            held: list[asyncio.Semaphore] = []
            try:
                for turns in map(self.turns_of, names):
                    if turns.locked():
                        if deadline is None:
                            deadline = loop.time() + self.pool_wait_s
                        until = min(deadline, loop.time() + held_wait_s) if held else deadline
                        async with asyncio.timeout_at(until):
                            await turns.acquire()
                    else:
                        await turns.acquire()
                    held.append(turns)
                return held
            except BaseException as exc:
                for turns in held:
                    turns.release()
                if not isinstance(exc, TimeoutError):
                    raise
                if deadline is not None and loop.time() >= deadline:
                    raise RedisConnectionError(f"no free connection within {self.pool_wait_s:g} s") from exc
                # twice as long each time: a node whose line takes longer than the wait (its
                # turns held by slow commands) is reached before pool_wait_s (found by a review)
                held_wait_s *= 2

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize_due():  # the slot map first (above): node_of reads it
            await self.initialize()  # (a new client's first command took the unknown node's turn)
        self._target_stream_read(args, kwargs)
        async with self.turn(await self.node_of(args, kwargs.get("target_nodes"))):
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        # A pipeline holds one connection per node it sends to: one turn of each covers it.
        # Its commands redirected by MOVED/ASK or refused with TRYAGAIN are sent again one by
        # one through execute_command once its connections are released: inside the same turn.
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def execute_in_turn(*args: Any, **kwargs: Any) -> Any:
            if self._initialize_due():  # the slot map first: node_of reads it
                await self.initialize()
            nodes: set[str] = set()
            seen: set[tuple[Any, ...]] = set()  # a script batcher's pipeline: one script, one slot
            for args_, target in _queued(pipe):
                same = args_[:4] if target is None and args_[0] == "EVALSHA" else None
                if same is not None:
                    if same in seen:
                        continue
                    seen.add(same)
                node = await self.node_of(args_, target)
                nodes.update([node] if isinstance(node, str) else node)
            async with self.turn(nodes or UNKNOWN_NODE):
                held = _PIPELINE_TURNS.set(_PIPELINE_TURNS.get() | {id(self)})
                try:
                    return await execute(*args, **kwargs)
                finally:
                    _PIPELINE_TURNS.reset(held)

        pipe.execute = execute_in_turn
        return pipe


def _queued(pipe: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """The (arguments, target nodes) of the commands ``pipe`` holds, read from redis-py's own
    queue: every way of queueing one (``pipe.unlink``, ``mset_nonatomic`` do not go through
    ``pipe.execute_command``) and of emptying it is seen. A redis-py without that queue gives
    one command of unknown node (the pipeline then takes that turn only)."""
    queue = getattr(getattr(pipe, "_execution_strategy", None), "_command_queue", None)
    if queue is None:
        return [(("",), None)]
    return [(c.args, c.kwargs.get("target_nodes")) for c in queue]
