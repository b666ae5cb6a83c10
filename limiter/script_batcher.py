"""Script calls made in the same event-loop turn share one round trip (auto-pipelining).

A frontend admits many requests at once, each from its own handler task, and a worker's
step completes several requests beside its push. Sent one by one, every ``EVALSHA`` takes a
pooled connection, a write and a read on both sides. Redis's cost of that is per call, not
per script: on this project's 2-core box a one-command script cost the server ~34 us of CPU
sent alone, ~20 us from 8-32 concurrent connections and ~12 us in pipelines of 8 (issue 17).

So :class:`ScriptBatcher` queues the calls made during one turn of the loop and sends them,
once that turn's ready callbacks have run, as one non-transactional pipeline (one write,
one read, one connection). Nothing waits for company: a call alone goes out alone in the
same turn, and a pipeline in flight does not hold up the calls of later turns, which form
their own. A call whose arguments pass :data:`LONE_CALL_BYTES` (an admit with a large
prompt) goes alone too: a pipeline's replies all wait until the whole of it is read.

Each call keeps its own reply or error: a script's error reply (OOM, READONLY included)
fails that call only; a connection failure, even one in the middle of the replies, fails
every call of the pipeline, as it would have failed each of them on its own connection. A
call with an argument redis-py may refuse to encode (a None) goes alone: the refusal comes
while a pipeline is packed, and would fail every call in it. Redis runs a pipeline's
scripts one after the other as it runs those of many connections read in one event-loop
pass, so at most :data:`BATCH_LIMIT` calls go in one pipeline: no call holds the server
longer than that many would anyway.

Calls of a script that takes several calls' arguments in one call (``merge_limit``: admit,
complete) with the same keys are merged: one ``EVALSHA`` of up to ``merge_limit`` of them, whose
arguments stay under :data:`LONE_CALL_BYTES`, counted call by call against
:data:`BATCH_LIMIT`. The script answers with one reply per call. An error reply to a merged
call (a bad argument of one of them; the script checks them all before it writes) sends
each of its calls again on its own, once; a connection's failure does not (it may have
run).

On a Redis Cluster the pipeline is redis-py's cluster pipeline, one per hash slot: it fails
every call in it when one of its nodes cannot be reached, those another node ran included,
so calls of two shards never share one. A call that meets ``MOVED``/``ASK``/``TRYAGAIN`` (a
resharding) goes again alone, which follows the redirection. Its ``evalsha`` method is
blocked ("Calling pipelined function evalsha is blocked when running redis in cluster
mode", redis-py 8.1), so the command is queued by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, MaxConnectionsError, ResponseError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

BATCH_LIMIT = 32  # calls per pipeline at most
# A call whose arguments are larger goes alone: every reply of a pipeline waits until the
# whole of it is read, and an admit's payload may be up to 8 MiB.
LONE_CALL_BYTES = 64 << 10
# a cluster pipeline's reply that means its node is gone or moved (see ScriptBatcher._send)
TOPOLOGY_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError)


@dataclass
class _Call:
    sha: str
    keys: Sequence[str]
    args: Sequence[Any]
    reply: asyncio.Future[Any]
    # > 0: ``args`` are one item of a script that takes up to this many in one call (the
    # items' arguments one after the other; the reply of a call of n > 1 items is a list of
    # n replies, of one item its reply): the calls of one turn with the same script and keys
    # are sent as one such call
    merge_limit: int = 0


# What one EVALSHA sends: calls of one script and keys, merged when there are several.
_Unit = list[_Call]


class ScriptBatcher:
    """EVALSHA calls of one loop turn sent as one pipeline on a ``redis.asyncio.Redis``."""

    def __init__(self, client: Any, limit: int = BATCH_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, not {limit}")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.limit = limit
        self._queued: list[_Call] = []
        # The loop whose turn will send the queued calls (None: no flush pending). A loop that
        # stopped before that turn (a process's first asyncio.run, ended abruptly) must not
        # leave every later call queued behind a flush that never comes.
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak refs
        self.round_trips = 0  # pipelines and lone calls sent (for tests and benchmarks)
        self.calls = 0  # EVALSHAs sent
        self.merged = 0  # calls that went inside another's EVALSHA

    async def evalsha(self, sha: str, keys: Sequence[str], args: Sequence[Any], merge_limit: int = 0) -> Any:
        """The reply of ``EVALSHA sha`` (raises what the call raised: ``NoScriptError`` for
        the caller to load the script and call again, a script's ``ResponseError``, or the
        connection's failure). ``merge_limit`` > 0: the script takes up to that many calls'
        arguments in one call (see ``_Call``), and this call may go in one with others."""
        loop = asyncio.get_running_loop()
        call = _Call(sha, keys, args, loop.create_future(), merge_limit)
        self._queued.append(call)
        if self._flush_loop is not loop:  # none pending, or pending on a loop that has stopped
            self._flush_loop = loop
            loop.call_soon(self._flush, loop)
        return await call.reply

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._flush_loop = None
        # Not sent: a call whose caller was cancelled before the turn ended (its client
        # left), and one left queued by a loop that has stopped (nobody awaits its reply).
        queued = [c for c in self._queued if not c.reply.done() and c.reply.get_loop() is loop]
        self._queued = []
        # On a cluster, one pipeline per hash slot: redis-py's cluster pipeline fails every
        # call in it when one node cannot be reached, those another node ran included.
        together: dict[int, list[_Unit]] = {}
        batches: list[list[_Unit]] = []
        merging: dict[tuple[Any, ...], _Unit] = {}  # the open unit of each script and keys
        merged_bytes: dict[tuple[Any, ...], int] = {}  # its calls' argument bytes
        for c in queued:
            size = _arg_size(c)
            if size is None or size > LONE_CALL_BYTES:
                batches.append([[c]])
                continue
            group = together.setdefault(key_slot(c.keys[0].encode()) if self.cluster and c.keys else 0, [])
            if c.merge_limit <= 0:
                group.append([c])
                continue
            key = (c.sha, tuple(c.keys))
            unit = merging.get(key)
            if unit is None or len(unit) >= c.merge_limit or merged_bytes[key] + size > LONE_CALL_BYTES:
                # a merged call's arguments stay under LONE_CALL_BYTES too
                unit = merging[key] = []
                merged_bytes[key] = 0
                group.append(unit)
            unit.append(c)
            merged_bytes[key] += size
        for group in together.values():
            batches += _by_calls(group, self.limit)
        for units in batches:
            task = asyncio.ensure_future(self._send(units))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, units: list[_Unit]) -> None:
        """Send ``units``. An error reply to a merged call sends each of its calls again on
        its own, once: a call on its own is never split again."""
        # cancelled since the flush: not sent
        units = [live for u in units if (live := [c for c in u if not c.reply.done()])]
        if not units:
            return
        self.round_trips += 1
        self.calls += len(units)
        self.merged += sum(len(u) - 1 for u in units)
        try:
            if len(units) == 1:  # one EVALSHA: no pipeline to build
                sha, keys, args = _evalsha_of(units[0])
                replies: list[Any] = [await self.client.evalsha(sha, len(keys), *keys, *args)]
            else:
                replies = await self._pipeline(units)
        except asyncio.CancelledError:  # the loop is going away: so are the callers
            for u in units:
                for c in u:
                    c.reply.cancel()
            raise
        except Exception as exc:  # a lone call's error, or the connection's: every call's
            self._after_cluster_failure([exc])
            if len(units) == 1 and len(units[0]) > 1 and _script_refused(exc):
                await self._send([[c] for c in units[0]])  # see below
                return
            calls = [c for u in units for c in u]
            for c in calls:
                if not c.reply.done():
                    c.reply.set_exception(_copy(exc) if len(calls) > 1 else exc)
            return
        self._after_cluster_failure(replies)
        again: list[_Unit] = []
        for u, r in zip(units, replies, strict=True):
            if len(u) > 1 and _script_refused(r):
                # An error reply to merged calls (a bad argument of one of them, the script
                # cache lost): nothing was written, as the script checks every argument
                # first; each goes again on its own and gets its own answer. Not after a
                # connection's failure: the merged call may have run.
                again += [[c] for c in u]
                continue
            items = r if len(u) > 1 else [r]
            if len(u) > 1 and isinstance(r, Exception):
                # A cluster pipeline returns a connection's failure while its replies were read
                # as each command's reply: an outage of every call merged in it (it may have
                # run), as a lone call gets it; not the "not a list of replies" below, which
                # became a ScriptError (a 500, a step worker stopped) instead of an outage.
                items = [_copy(r) for _ in u]
            elif len(u) > 1 and (not isinstance(r, list) or len(r) != len(u)
                                 or not all(isinstance(x, list) for x in r)):
                # not a list of replies: never from a script that takes several calls
                bad = ResponseError(f"a merged call of {len(u)} got the reply {r!r}")
                items = [_copy(bad) for _ in u]
            for c, item in zip(u, items, strict=True):
                if c.reply.done():  # its caller was cancelled meanwhile: the script ran, nobody reads it
                    continue
                if isinstance(item, Exception):
                    c.reply.set_exception(item)
                else:
                    c.reply.set_result(item)
        if again:
            await self._send(again)

    async def _pipeline(self, units: list[_Unit]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for u in units:
            sha, keys, args = _evalsha_of(u)
            # not pipe.evalsha: redis-py's cluster pipeline blocks that method, yet routes
            # the command by its keys' slot (every key of a pool shares one)
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    def _after_cluster_failure(self, outcomes: list[Any]) -> None:
        """A cluster client reads the cluster's layout again before its next command after a
        command of its own failed so (a failover moved a shard: the old node is gone); its
        pipeline, which returns such a failure as a reply or raises it without a retry, does
        not before redis-py 8.2 (8.2 asks itself). Without this, pipelines went on to the gone
        node until some call went alone."""
        if self.cluster and any(isinstance(o, TOPOLOGY_ERRORS) and not isinstance(o, MaxConnectionsError)
                                for o in outcomes):
            self.client._initialize = True  # what RedisCluster.execute_command sets then


def _evalsha_of(unit: _Unit) -> tuple[str, Sequence[str], list[Any]]:
    """The script, keys and arguments of the one EVALSHA that sends ``unit``."""
    return unit[0].sha, unit[0].keys, [a for c in unit for a in c.args]


def _arg_size(call: _Call) -> int | None:
    """The bytes of ``call``'s str and bytes arguments, or None when one is of a type other
    than str, bytes, int and float: redis-py may refuse such an argument (a None, a bool:
    ``DataError``) while it packs a pipeline, which fails every call in it; alone, only that
    call fails, before anything is sent."""
    size = 0
    for a in call.args:
        kind = type(a)
        if kind is str or kind is bytes:
            size += len(a)
        elif kind is not int and kind is not float:
            return None
    return size


def _by_calls(units: list[_Unit], limit: int) -> list[list[_Unit]]:
    """``units`` in pipelines of at most ``limit`` calls, merged ones counted call by call."""
    out: list[list[_Unit]] = []
    n = limit
    for u in units:
        if n + len(u) > limit:
            out.append([])
            n = 0
        out[-1].append(u)
        n += len(u)
    return out


def _script_refused(outcome: Any) -> bool:
    """An error reply a script's call got from Redis (a bad argument, NOSCRIPT, OOM): the
    call did not run. Not a connection's failure, after which it may have run."""
    return isinstance(outcome, ResponseError) and not isinstance(outcome, TOPOLOGY_ERRORS)


def _copy(exc: Exception) -> Exception:
    """A fresh instance of ``exc`` per waiting call where one can be made (one instance raised
    in many tasks would collect all their tracebacks), chained to the original."""
    try:
        fresh = type(exc)(*exc.args)
    except Exception:
        return exc
    fresh.__cause__ = exc
    return fresh
