"""The pushes of one event-loop turn in one ``push_tokens`` call, for a worker whose requests
each run in a task of their own (the openai engine).

A step worker pushes the tokens of every request a step produced in one call
(:meth:`~worker.runtime.WorkerRuntime.push_batches`), because each call costs Redis a fixed
~40 us however little it carries (a request's push 42 us alone, 11 in calls of 8: `qos bench
redis-budget`). The openai engine has no step: a stream's task pushes when its chunk comes.
But a model server does step: one decode step gives every sequence its next token, and the
server writes them to their streams together, so the worker reads many streams' chunks in
the same turn of its event loop. :class:`MergedPushes` lets those tasks ask for a push each
and sends them, once the turn's ready callbacks have run, as one call (or as few as
``PUSH_LIMIT`` and the frontends' reply format allow); each task gets its own request's
news. A push asked for alone goes out alone, one loop iteration later.

Each :meth:`MergedPushes.push` behaves as ``WorkerRuntime.push`` did for its request: it
raises LeaseLost, the InvalidArgument Redis refused its batch
with (past its max_tokens), or RedisUnavailable (its batch stays pending: the next push's
offset check settles a batch that did land). The tokens pushed are those pending when the
call is sent, so a chunk that came in the same turn rides along.

A task cancelled while it waits (its client cancelled, the worker drains) does not stop the
call, which carries the other streams' tokens too; it waits for the call's reply before it
goes on being cancelled. What it does next is offset-checked against the tokens it knows
were delivered (``complete``, or ``release``'s push): sent before this reply was applied, the
check met the tokens this call delivered, which the reply then counted a second time, and
the request was taken for lost (dropped, its record left leased until its lease ran out).

Where it differs from a push alone: a reply ``offset`` (an earlier push whose reply was lost
did land) takes the tokens Redis has as delivered and leaves the rest for the stream's next
push or its completion, where ``Delivery.push`` read the count and pushed the rest at once;
when a turn's pushes need several calls (more than ``PUSH_LIMIT``, or frontends of two
releases) and a later one meets an outage, every stream of the turn hears RedisUnavailable,
those an earlier call settled too (their tokens landed; a lost lease they would have heard
comes again from the lease renewal or the next push); and an
error that is not one request's (a bug) fails every stream of the call, not one.
"""

from __future__ import annotations

import asyncio
import contextlib

from limiter.errors import RedisUnavailable
from worker.delivery import Delivery
from worker.runtime import WorkerRuntime


class MergedPushes:
    """Pushes asked for in one event-loop turn, sent in one call (module docstring)."""

    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self._waiting: list[tuple[Delivery, asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None  # the next call's, not yet started
        self._sending: set[asyncio.Task[None]] = set()  # every call's task until it ends
        self.calls = 0  # sends made (each one push_tokens call or more), for tests and stats

    async def push(self, d: Delivery) -> None:
        """Push ``d``'s pending tokens with the others of this turn (module docstring)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((d, fut))
        if self._sender is None:
            # A task's first step runs in the loop's next iteration: after every callback
            # ready in this one, so the streams whose chunks came in this turn are all in.
            self._sender = task = asyncio.create_task(self._send())
            self._sending.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._sending.discard)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            # Cancelled: first the call's reply (module docstring), whatever it says.
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)
            raise

    async def _send(self) -> None:
        waiting, self._waiting, self._sender = self._waiting, [], None
        self.calls += 1
        todo = self.rt.batches(list({id(d): d for d, _ in waiting}.values()))
        try:
            news = {id(d): n for d, n in await self.rt.push_batches(todo)} if todo else {}
        except asyncio.CancelledError:  # the worker stops: its batches stay pending
            _fail(waiting, RedisUnavailable("the worker stopped before the push was sent"))
            raise
        except Exception as exc:  # RedisUnavailable, or a bug: every waiting task hears of it
            _fail(waiting, exc)
            return
        for d, fut in waiting:
            if fut.done():
                continue
            result = news.get(id(d))  # None: delivered, or not in the call (nothing was pending)
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(None)


def _fail(waiting: list[tuple[Delivery, asyncio.Future[None]]], exc: Exception) -> None:
    for _, fut in waiting:
        if not fut.done():
            fut.set_exception(exc)
