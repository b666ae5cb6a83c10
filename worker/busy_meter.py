"""What a worker serves per second while it is full: the capacity figure of its heartbeat.

The controller sums this over live workers as the pool's capacity (limiter/controller/capacity.py), so
it must be what the worker *delivers* when busy, not what its engine does in isolation:

* only **full** steps count (``FULL_SHARE``, 80 % of the token budget or of the batch): a
  lightly loaded step runs far below capacity, and counting it would tell the controller
  the GPU is slow (the openai engine likewise counts only time with 80 % of its
  ``max_inflight`` requests open upstream);
* each full step is timed from the **end of the step before it**, so the Redis work between
  steps (token pushes, completions, claims), which the worker awaits before it steps again,
  is in the figure. Engine time alone overstated what a stack serves by ~1.4x on the
  benchmark machine (docs/benchmarks.md). A pause longer than the step plus ``max_pause_s``
  is idleness or an outage, not overhead, and is left out.
"""

from __future__ import annotations

# A step at least this full (token budget or batch) measures capacity. A decode step's cost
# barely grows with its batch, so a half-full batch runs at ~60 % of the full rate: counting
# such steps made the controller's capacity dip ~2x while a run ramped up.
FULL_SHARE = 0.8


class BusyMeter:
    """Weighted tokens per busy second, over the steps recorded since the last ``take``."""

    def __init__(self, max_pause_s: float = 1.0) -> None:
        self.max_pause_s = max_pause_s
        self._work = 0.0
        self._time = 0.0
        self._prev_end: float | None = None

    def step(self, start: float, end: float, *, full: bool, work: float) -> None:
        """One engine step on a monotonic clock; ``work`` in weighted tokens (counted only
        when ``full``)."""
        prev, self._prev_end = self._prev_end, end
        if not full:
            return
        duration = max(end - start, 0.0)
        between = start - prev if prev is not None else 0.0
        if not 0.0 <= between <= duration + self.max_pause_s:
            between = 0.0
        self._time += duration + between
        self._work += work

    def take(self) -> float:
        """Weighted tokens/s since the last call (0.0 = no full step: no measurement)."""
        rate = self._work / self._time if self._time > 0 else 0.0
        self._work = self._time = 0.0
        return rate
