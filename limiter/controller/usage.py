"""The control law's ``used`` input: what each class is consuming *now*, in weighted tokens/s.

Why not the served rate from samples: a sample arrives when its request *finishes*, seconds
after its work was dispatched, so a completion-based rate lags exactly when it matters (a rising
load), and a lagging ``used`` makes the first cut deeper than one step (docs/control-law.md).

What is measured instead, per class:

    used = claimed requests/s  x  mean work of a recent request of the class

* **claimed requests/s**: the delta of the ``<class>.claimed`` counter in ``qos:{pool}:stats``
  (incremented by ``claim.lua`` when a worker takes a request: shares are decided there, so
  this is what the class gets of the GPU, not what it asks for) over the last ``window_s`` of
  Redis time -- current to within one tick. Claims are Poisson: a second's count of a class
  claimed twice a second is 2 +- 1.4, and the law sizes a cut from it (on a running stack one
  such dip took a class from 0.34 to 0.15 of the pool in one 10 % step). So a class with
  fewer than ``min_claims`` claims in the window is counted as far back as it takes to hold
  them (at most ``max_window_s``) -- unless the last k windows' share of the reach's claims
  (for the smallest such k) is past a tail of where a steady rate puts it (binomial: 1 %
  above, ``RISE_P``, 0.1 % below, ``FALL_P``), which is a change of load, not noise: then the
  last k windows' figure stands. A stop of a busy class, or a rise to ten times the rate, is
  seen at once; a rise by a factor of three within two seconds or so; a fall by one of three
  is followed as the reach slides (read high meanwhile: a cut from it is shallower, never
  deeper, than its step).
  The reach biases the figure up by a few per cent (the count stops at the
  ``min_claims``-th claim back).
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

import math
from collections import deque
from collections.abc import Iterable, Mapping


def _int(value: object) -> int | None:
    try:
        return int(value.decode() if isinstance(value, bytes) else str(value))
    except (TypeError, ValueError, AttributeError):
        return None


# A count past these tails is a change of load, not noise. Tested for each of up to
# max_window / window spans, so they are strict, and the rise's less so: a figure read low
# sizes a cut deeper than its step, one read high a shallower one, which the next verdict
# finishes.
RISE_P = 0.01  # more claims lately than a steady rate puts there
FALL_P = 0.001  # fewer
MAX_WINDOWS = 100  # the reach goes back at most this many windows


def _plausible(n: int, total: int, share: float) -> bool:
    """Whether ``n`` of the reach's ``total`` claims falling in its newest ``share`` of time is
    a likely draw at a steady rate (the claims of a steady rate fall uniformly: binomial
    ``total``, ``share``): P[X >= n] not below ``RISE_P``, P[X <= n] not below ``FALL_P``. Testing
    against the earlier span's rate as if it were exact took noise for a change on two
    ticks in three at 0.5 claims a second (a review). ``n`` is below ``min_claims`` here,
    so the sum is short."""
    if not 0 < share < 1:
        return True
    log_p, log_q = math.log(share), math.log1p(-share)
    log_term = total * log_q  # log P[X = 0]
    below = 0.0  # P[X <= n - 1]
    for i in range(n):
        below += math.exp(log_term)
        log_term += math.log((total - i) / (i + 1)) + log_p - log_q
    return below + math.exp(log_term) >= FALL_P and 1.0 - below >= RISE_P


class UsageMeter:
    def __init__(self, classes: Iterable[str], window_s: float = 1.0, cost_samples: int = 200,
                 min_claims: int = 20, max_window_s: float = 10.0) -> None:
        self.classes = tuple(classes)
        self.window_ms = window_s * 1000.0
        self.min_claims = min_claims
        # no reach (min_claims 0): no snapshots older than the window are kept; at most
        # MAX_WINDOWS windows back (each tick tests every class's count over each of them)
        reach_s = min(max_window_s, MAX_WINDOWS * window_s) if min_claims > 0 else window_s
        self.max_window_ms = max(reach_s, window_s) * 1000.0
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
                            or now_ms < self._snaps[-1][0]
                            or self._gap_past_reach(now_ms)):
            # counters reset, or the clock stepped back: start over rather than report a
            # negative rate (or none at all until the clock caught up with the old stamps);
            # or a gap longer than the reach (a clock stepped forward, a stalled controller):
            # a window over it would read a class's claims spread over time that never was
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

    def _gap_past_reach(self, now_ms: float) -> bool:
        """A gap since the last read longer than the reach and than 4 of the reads' own
        intervals: a clock stepped forward or a stalled controller, not a coarse tick (a
        tick longer than the window is no gap: restarting on it left ``used`` None)."""
        gap = now_ms - self._snaps[-1][0]
        if gap <= self.max_window_ms or len(self._snaps) < 2:
            return False
        return gap > 4 * (self._snaps[-1][0] - self._snaps[-2][0])

    def _rate(self, cls: str, now_ms: float, count: int) -> float | None:
        """Claims/s of ``cls``: over the last ``window_ms``; where that holds fewer than
        ``min_claims`` claims, over as far back as it takes to hold them (the reach, at most
        the oldest snapshot kept) -- unless the last k windows' share of the reach's claims,
        for the smallest such k, is no likely draw at a steady rate (:func:`_plausible`): a
        change of load, whose figure is then the last k windows' rate."""
        ends: list[tuple[float, int]] = []  # (age s, claims since) at each window boundary crossed
        reach = None
        for t0, c0 in reversed(self._snaps):
            if t0 >= now_ms:
                continue
            age_ms, claims = now_ms - t0, count - c0.get(cls, 0)
            reach = (age_ms / 1000.0, claims)
            if age_ms >= self.window_ms * (len(ends) + 1):
                ends.append(reach)
                if claims >= self.min_claims:
                    break
        if reach is None:
            return None
        if not ends:  # the term's first reads: nothing is window_ms old yet
            return reach[1] / reach[0]
        span_s, claims = reach
        for age_s, n in ends:  # the last end may be the reach itself: share 1, plausible
            if not _plausible(n, claims, age_s / span_s):
                return n / age_s
        return claims / span_s

    def claimed_per_s(self, cls: str) -> float | None:
        """Requests/s claimed recently; None before two counter reads."""
        return self._rates.get(cls)

    def used(self, cls: str, served_fallback: float) -> float:
        rate, work = self.claimed_per_s(cls), self.mean_work(cls)
        if rate is None or work is None:
            return max(0.0, served_fallback)
        return max(0.0, rate * work)
