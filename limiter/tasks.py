"""Stopping background tasks without ever hanging on one.

``task.cancel(); await task`` waits for ever when the task swallows its cancellation -- as
redis-py can inside a blocking read (redis/redis-py#2028) and Python 3.11's
``asyncio.wait_for`` does when the cancel lands in the turn its step finishes -- and then
the process that is stopping never exits. :func:`stop_tasks` asks again a few times and
then leaves the task behind with an error in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("qos")


def raise_if_cancelled() -> None:
    """Raise the cancellation of the current task that a callee swallowed.

    redis-py sends every command through ``asyncio.wait_for`` when the client has a socket
    timeout; on Python 3.11 that returns normally when the cancellation lands as the send
    finishes, and a loop whose steps never block (a busy stream) can lose every cancellation.
    The request still shows in ``Task.cancelling()``: a loop calls this after each step."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_tasks(tasks: Iterable[asyncio.Task], what: str, wait_s: float = 2.0, rounds: int = 3) -> bool:
    """Cancel ``tasks`` and wait for them, re-cancelling stragglers every ``wait_s`` up to
    ``rounds`` times. True when every one ended; their exceptions are consumed."""
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    for _ in range(rounds):
        if not pending:
            break
        _, pending = await asyncio.wait(pending, timeout=wait_s)
        for t in pending:
            t.cancel()  # it swallowed the first cancellation: ask again
    for t in tasks:
        if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
            # retrieved (no "exception was never retrieved" at exit), and said: a background
            # task that died of an error before its stop is worth a line, not silence
            log.warning("%s: task %s had ended with an error: %r", what, t.get_name(), exc,
                        exc_info=exc)
    if pending:
        log.error("%s: %d task(s) ignored cancellation for %.0f s; leaving them behind: %s", what,
                  len(pending), wait_s * rounds, ", ".join(t.get_name() for t in pending))
    return not pending
