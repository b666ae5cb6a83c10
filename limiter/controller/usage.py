"""The control law's ``used`` input: what each class is consuming *now*, in weighted tokens/s.

Why not the served rate from samples: a sample arrives when its request *finishes*, seconds
after its work was dispatched, so a completion-based rate lags exactly when it matters (a rising
load), and a lagging ``used`` makes the first cut deeper than one step (docs/control-law.md).

What is measured instead, per class:

    used = claimed requests/s  x  mean work of a recent request of the class

* **claimed requests/s**: the delta of the ``<class>.claimed`` counter in ``qos:{pool}:stats``
  (incremented by ``claim.lua`` when a worker takes a request: shares are decided there, so
  this is what the class gets of the GPU, not what it asks for) over the last ``window_s`` of
  Redis time -- current to within one tick -- or, for a class with fewer than
  ``min_claims`` claims in that window, as far back as it takes to count them (at most
  ``max_window_s``). Claims are Poisson: a second's count of a class claimed twice a second
  is 2 +- 1.4, and the law sizes a cut from it -- on a running stack one such dip took a
  class from 0.34 to 0.15 of the pool in one 10 % step. Twenty claims read +- 22 %; a busy
  class (20 claims a second and more) keeps its one-second figure, so a flood is seen at once.
* **mean work**: the mean over the class's last ``cost_samples`` samples of the weighted work
  the request actually caused (:meth:`CapacityEstimator.work`: prefill if it ran, plus the
  output), i.e. the same units as capacity and rates. Claim charges an *estimate* with
  reserved output tokens that is refunded later, so the charged amount would overstate use;
  the request mix changes much more slowly than the request rate, so this mean may lag.

Until a class has a sample this term the estimator's served rate stands in (0 at start).
A counter that went backwards (Redis restarted without persistence), or a clock that did
(an NTP step, a failover to a Redis whose clock is behind), restarts the baseline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping


def _int(value: object) -> int | None:
    try:
        return int(value.decode() if isinstance(value, bytes) else str(value))
    except (TypeError, ValueError, AttributeError):
        return None


class UsageMeter:
    def __init__(self, classes: Iterable[str], window_s: float = 1.0, cost_samples: int = 200,
                 min_claims: int = 20, max_window_s: float = 10.0) -> None:
        self.classes = tuple(classes)
        self.window_ms = window_s * 1000.0
        self.min_claims = min_claims
        self.max_window_ms = max(max_window_s, window_s) * 1000.0
        self._snaps: deque[tuple[float, dict[str, int]]] = deque()
        self._costs: dict[str, deque[float]] = {c: deque(maxlen=cost_samples) for c in self.classes}
        self._cost_sum = dict.fromkeys(self.classes, 0.0)
        self._rates: dict[str, float] = {}

    def observe_work(self, cls: str, work: float) -> None:
        """One claimed request of ``cls`` finished, having caused ``work`` weighted tokens (the
        caller leaves out requests no claim ever took, or the mean is diluted: ``used``
        multiplies it by the rate of claims)."""
        costs = self._costs.get(cls)
        if costs is None:
            return
        if len(costs) == costs.maxlen:
            self._cost_sum[cls] -= costs[0]
        costs.append(work)
        self._cost_sum[cls] += work

    def mean_work(self, cls: str) -> float | None:
        costs = self._costs.get(cls)
        return self._cost_sum[cls] / len(costs) if costs else None

    def observe_counters(self, now_ms: float, stats: Mapping[object, object]) -> None:
        """A read of the stats hash at Redis time ``now_ms``: updates claimed requests/s."""
        fields = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in stats.items()}
        counts = {c: _int(fields.get(f"{c}.claimed", 0)) or 0 for c in self.classes}
        if self._snaps and (any(counts[c] < self._snaps[-1][1].get(c, 0) for c in self.classes)
                            or now_ms < self._snaps[-1][0]):
            # counters reset, or the clock stepped back: start over rather than report a
            # negative rate (or none at all until the clock caught up with the old stamps)
            self._snaps.clear()
        self._snaps.append((now_ms, counts))
        # keep the newest snapshot that is at least max_window_ms old, and everything after it
        while len(self._snaps) > 2 and now_ms - self._snaps[1][0] >= self.max_window_ms:
            self._snaps.popleft()
        self._rates = {}
        for c in self.classes:
            rate = self._rate(c, now_ms, counts[c])
            if rate is not None:
                self._rates[c] = rate

    def _rate(self, cls: str, now_ms: float, count: int) -> float | None:
        """Claims/s of ``cls`` since the newest snapshot at least ``window_ms`` old that is
        ``min_claims`` behind now; else since the oldest kept (``max_window_ms``)."""
        start = None
        for t0, c0 in reversed(self._snaps):
            if t0 >= now_ms:
                continue
            start = (t0, c0.get(cls, 0))
            if now_ms - t0 >= self.window_ms and count - start[1] >= self.min_claims:
                break
        if start is None:
            return None
        return (count - start[1]) / ((now_ms - start[0]) / 1000.0)

    def claimed_per_s(self, cls: str) -> float | None:
        """Requests/s claimed recently; None before two counter reads."""
        return self._rates.get(cls)

    def used(self, cls: str, served_fallback: float) -> float:
        rate, work = self.claimed_per_s(cls), self.mean_work(cls)
        if rate is None or work is None:
            return max(0.0, served_fallback)
        return max(0.0, rate * work)
