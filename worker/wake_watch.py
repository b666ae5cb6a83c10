"""The wake list watched without polling: one ``BLPOP`` kept parked while the worker wants work.

Queued work is always announced on the pool's wake list (admit, a requeue and a claim that
leaves work behind push a marker; a claim that empties the queue clears the list). An idle
worker blocks on it. A busy step worker with room used to look with an ``LPOP`` every
``wake_check_ms`` (2 ms; once a step on a GPU): ~34 us of the shard's main thread each (the
read, the reply, the dispatch), 2.1-3.0 of them a request in the overhead bench, the most
frequent command left, and once a step per worker in a fleet, whether work came or not.

:class:`WakeWatch` keeps one ``BLPOP`` parked on the worker's blocking connection instead.
The step loop asks it between steps (:meth:`take`), without a round trip while a read is
parked; the wait of an idle worker is the same read (:meth:`wait`), and the shard answers
once per marker. When no read was parked since the last look (the worker was idle, backed
off or full; the last read timed out) nothing is known of what came meanwhile, and the look
is one ``LPOP`` as before (then a read is parked): a busy worker never learns of work later
than the ``LPOP`` at each look told it, and it polls no more while its read is parked.

A marker is a hint that another worker may act on, so this watch never sits on one it will
not act on: a marker the read takes while the worker does not want work (its batch is full,
it backs off, it drains) goes back on the list at once (:meth:`pause`), and no read is parked
again until the worker asks. A worker that stops holds back at most one marker, for one round
trip; with ``LPOP`` it held none, but it looked once a step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from limiter.tasks import stop_tasks


class WakeWatch:
    """``read``: one ``BLPOP`` of the wake list with its timeout, True when it took a marker;
    ``look``: one ``LPOP`` of it, the same answer at once; ``put_back``: push one marker back
    (:meth:`WorkerRuntime.announce_work`)."""

    def __init__(self, read: Callable[[], Awaitable[bool]], look: Callable[[], Awaitable[bool]],
                 put_back: Callable[[], Awaitable[None]]) -> None:
        self._read = read
        self._look = look
        self._put_back = put_back
        self._task: asyncio.Task[bool] | None = None
        self.wanted = False  # a marker the read takes is kept for the worker (else put back)

    @property
    def parked(self) -> bool:
        """A read is on the wake list now (for tests and the docs' claims)."""
        return self._task is not None and not self._task.done()

    async def take(self) -> bool:
        """Was work announced since the last look? The parked read's answer, with no round
        trip; when no read was parked all along (none, or it ended without a marker), an
        ``LPOP``. The worker wants work from now on: a read is kept parked. Raises the
        read's failure (e.g. RedisUnavailable), once."""
        self.wanted = True
        task = self._task
        if task is not None and not task.done():
            return False
        self._task = None
        got = task.result() if task is not None else False
        if not got:
            got = await self._look()
        self._park()
        return got

    async def wait(self, stop: asyncio.Event) -> bool:
        """Block until the read takes a marker (True), times out (False), or ``stop`` is set
        (False; the read is cancelled). No read is left parked after it."""
        self.wanted = True
        if self._task is None:
            self._park()
        task = self._task
        assert task is not None
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
        if not task.done():
            await self.close()
            return False
        self._task = None
        return task.result()

    async def pause(self) -> None:
        """The worker will not claim on a marker for now: one the read holds or takes goes back
        on the list, and no read is parked again until :meth:`take` or :meth:`wait`."""
        self.wanted = False
        task = self._task
        if task is not None and task.done():
            self._task = None
            if task.result():  # taken while wanted, and never asked for since
                await self._put_back()

    async def close(self) -> None:
        """Cancel a parked read. (A marker the server popped as the read was cancelled is lost;
        idle workers' reads time out after ``idle_block_s`` and claim: the list's safety net.)"""
        self.wanted = False
        task, self._task = self._task, None
        if task is not None:  # (a failure it ended with is read there: no "never retrieved")
            await stop_tasks([task], "the wake-list read", wait_s=1.0)

    def _park(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="wake-watch")

    async def _watch(self) -> bool:
        got = await self._read()
        if got and not self.wanted:
            await self._put_back()
            return False
        return got
