"""When the step loop pushes: one clock per push period, shared by every request held.

A request's tokens are pushed at least every period (``flush_ms``, a class's
``stream_flush_ms``, ``unstreamed_flush_ms``: :meth:`worker.delivery.Delivery.due`). Timed
from each request's own oldest token, requests claimed at different times were pushed at
different steps, each step's due requests in a call of their own -- and a ``push_tokens``
call costs Redis ~190k instructions before its requests' ~75k each (lua/push_tokens.lua,
callgrind). A :class:`PushClock` times each period once for the whole worker, as that rule
times one request that always has tokens pending: the step after a push step starts the
period, and the period's next push step is the first whose next step would end a period
after that. At a push step every request of the period with tokens pending (and its first
push made) is pushed, in one call: pushed there, its tokens are never older than the
clock's oldest, so none waits longer than the period. A request's first push still goes at
once; from its second on it keeps the clock's steps.

Pure: no time source of its own; the step loop hands each step's end time in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Period:
    since: float | None = None  # the period's start: the end of the step after its last push step
    step_end: float | None = None  # the step the answer below is for
    fires: bool = False


class PushClock:
    def __init__(self) -> None:
        self._periods: dict[float, _Period] = {}
        self._step_end: float | None = None

    def step_ended(self, t: float) -> None:
        """The step loop's last step ended at ``t``: the time its tokens carry (a request's
        oldest pending token is such a time), and the step the answers of :meth:`fires` are
        for. Called once a step, before any of them."""
        self._step_end = t

    def fires(self, period_ms: float, now: float, step_s: float) -> bool:
        """Is the last step a push step of ``period_ms``? ``now``: the time it is decided at
        (the one a request's own rule compares its oldest token with); ``step_s``: how long
        until the next chance to push (the last step's length). Asked any number of times
        for one step, the answer is the same."""
        p = self._periods.get(period_ms)
        if p is None:  # (not setdefault: its default would be made at every call)
            p = self._periods[period_ms] = _Period()
        if p.step_end != self._step_end:
            p.step_end = self._step_end
            if p.since is None:  # the step after a push step (or the first one): a period starts
                p.since, p.fires = self._step_end, False
            else:
                # timed as Delivery.due times a request's oldest token (its step's end) from
                # now: a request pushed at the clock's steps is due on its own at the same ones
                p.fires = (now - p.since + step_s) * 1e3 >= period_ms
                if p.fires:
                    p.since = None
        return p.fires
