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
fails that call only, and so does an argument redis-py cannot encode (the pipeline is
packed before it is sent, and its calls then go alone); a connection failure, even one in
the middle of the replies, fails every call of the pipeline, as it would have failed each
of them on its own connection. Redis runs a pipeline's scripts one after the other as it
runs those of many connections read in one event-loop pass, so at most :data:`BATCH_LIMIT`
go in one pipeline: no call holds the server longer than that many would anyway.

The standalone client only: redis-py's cluster pipeline refuses ``EVALSHA`` ("Calling
pipelined function evalsha is blocked when running redis in cluster mode"; redis-py 8.1,
tried), so script calls on a Redis Cluster go one by one as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import DataError

BATCH_LIMIT = 32  # calls per pipeline at most
# A call whose arguments are larger goes alone: every reply of a pipeline waits until the
# whole of it is read, and an admit's payload may be up to 8 MiB.
LONE_CALL_BYTES = 64 << 10


@dataclass
class _Call:
    sha: str
    keys: Sequence[str]
    args: Sequence[Any]
    reply: asyncio.Future[Any]


class ScriptBatcher:
    """EVALSHA calls of one loop turn sent as one pipeline on a ``redis.asyncio.Redis``."""

    def __init__(self, client: Any, limit: int = BATCH_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, not {limit}")
        self.client = client
        self.limit = limit
        self._queued: list[_Call] = []
        # The loop whose turn will send the queued calls (None: no flush pending). A loop that
        # stopped before that turn (a process's first asyncio.run, ended abruptly) must not
        # leave every later call queued behind a flush that never comes.
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak refs
        self.round_trips = 0  # pipelines and lone calls sent (for tests and benchmarks)
        self.calls = 0

    async def evalsha(self, sha: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The reply of ``EVALSHA sha`` (raises what the call raised: ``NoScriptError`` for
        the caller to load the script and call again, a script's ``ResponseError``, or the
        connection's failure)."""
        loop = asyncio.get_running_loop()
        call = _Call(sha, keys, args, loop.create_future())
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
        together: list[_Call] = []
        batches: list[list[_Call]] = []
        for c in queued:
            if _arg_bytes(c) > LONE_CALL_BYTES:
                batches.append([c])
            else:
                together.append(c)
        batches += [together[i:i + self.limit] for i in range(0, len(together), self.limit)]
        for calls in batches:
            task = asyncio.ensure_future(self._send(calls))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call]) -> None:
        calls = [c for c in calls if not c.reply.done()]  # cancelled since the flush: not sent
        if not calls:
            return
        self.round_trips += 1
        self.calls += len(calls)
        try:
            if len(calls) == 1:  # a lone call: no pipeline to build
                c = calls[0]
                replies: list[Any] = [await self.client.evalsha(c.sha, len(c.keys), *c.keys, *c.args)]
            else:
                pipe = self.client.pipeline(transaction=False)
                for c in calls:
                    pipe.evalsha(c.sha, len(c.keys), *c.keys, *c.args)
                replies = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:  # the loop is going away: so are the callers
            for c in calls:
                c.reply.cancel()
            raise
        except Exception as exc:  # a lone call's error, or the connection's: every call's
            if isinstance(exc, DataError) and len(calls) > 1:
                # An argument redis-py cannot encode (a None) is found while the pipeline is
                # packed, before a byte is sent: each call goes again alone, so that only the
                # one with that argument fails, as it would have on its own.
                await asyncio.gather(*(self._send([c]) for c in calls))
                return
            for c in calls:
                if not c.reply.done():
                    c.reply.set_exception(_copy(exc) if len(calls) > 1 else exc)
            return
        for c, r in zip(calls, replies, strict=True):
            if c.reply.done():  # its caller was cancelled meanwhile: the script ran, nobody reads it
                continue
            if isinstance(r, Exception):
                c.reply.set_exception(r)
            else:
                c.reply.set_result(r)


def _arg_bytes(call: _Call) -> int:
    return sum(len(a) for a in call.args if isinstance(a, bytes | str))


def _copy(exc: Exception) -> Exception:
    """A fresh instance of ``exc`` per waiting call where one can be made (one instance raised
    in many tasks would collect all their tracebacks), chained to the original."""
    try:
        fresh = type(exc)(*exc.args)
    except Exception:
        return exc
    fresh.__cause__ = exc
    return fresh
