"""Retrying through an outage: one back-off policy for every role's loops.

A loop that keeps going while Redis (or another dependency) is down must neither spin nor
flood the log: :class:`Backoff` sleeps a doubling delay with a cap between attempts, and
logs one warning when the outage starts and one line when the next attempt succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time


class Backoff:
    """Delays of ``first_s``, doubling up to ``max_s``; back to ``first_s`` after a success.

    ``what`` names the loop in the log lines (e.g. ``"reply stream qos:{tiny}:r:fe-1"``).
    Without a ``logger`` it only sleeps (the caller logs for itself)."""

    def __init__(self, what: str, *, first_s: float, max_s: float,
                 logger: logging.Logger | None = None) -> None:
        self.what = what
        self.first_s = first_s
        self.max_s = max_s
        self.log = logger
        self.delay_s = 0.0  # the last delay slept; 0 while the loop is healthy
        self._down_since: float | None = None  # time.monotonic() of the first failure in a row

    async def failed(self, exc: BaseException | None = None) -> float:
        """Sleep before the next attempt; returns the delay slept."""
        await asyncio.sleep(self.next_delay(exc))
        return self.delay_s

    def next_delay(self, exc: BaseException | None = None) -> float:
        """Record a failure and return the delay before the next attempt, without sleeping
        (for a loop that waits on its own, e.g. for a stop event meanwhile)."""
        self.delay_s = min(self.max_s, max(self.first_s, self.delay_s * 2))
        if self._down_since is None:
            self._down_since = time.monotonic()
            if self.log and self.max_s > 0:
                self.log.warning("%s: %s; retrying every %.2g-%.2g s until it answers", self.what, exc,
                                 self.delay_s, self.max_s)
            elif self.log:  # a loop that keeps its own period
                self.log.warning("%s: %s; retrying until it answers", self.what, exc)
        return self.delay_s

    def succeeded(self) -> None:
        """The attempt worked: the next failure starts again at ``first_s``."""
        if self._down_since is not None and self.log:
            self.log.info("%s: working again after %.1f s", self.what, time.monotonic() - self._down_since)
        self._down_since = None
        self.delay_s = 0.0
