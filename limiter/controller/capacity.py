"""Estimate the pool's capacity (weighted tokens/s when busy) and each class's served rate.

The control law expresses every budget as a share of capacity, so capacity must follow
reality: workers join and leave, models and prompt mixes change. Two sources, best first:

1. **Worker heartbeats.** Each worker reports the weighted tokens/s it would serve
   saturated, at the mix it serves (same units as the rates; worker/saturated_capacity.py,
   or its full steps' measured rate until it knows its step cost and mix). Capacity = sum
   over *live* workers of the median of their last ``window`` reports. A worker silent for
   ``worker_ttl_s`` is gone and its share leaves the sum at once -- the drop is visible the
   moment it happens, not after an EWMA catches up. A live worker with no measurement yet
   (it has not been busy: just started, or lightly loaded) counts at the mean of the
   measured ones, so the first worker to report does not stand for the whole pool (one of
   four workers reporting used to quarter the estimate at start). A worker's reports count
   once it has made ``min_reports`` of them: its first ones are taken while it ramps up
   (claims, first prefills) and read low. The median, not a mean or an EWMA: one
   heartbeat's figure can still swing (a fresh worker's first fits, a run of unusual
   prompts), and the control law must see the plant's capacity, not that noise. A worker
   joining or leaving still moves the sum at once: that is a real step.
2. **Samples.** Completed work is bucketed into ``interval_s`` intervals by the sample's
   Redis timestamp. Throughput measured in an interval is only a capacity measurement if
   the pool was *busy* then (otherwise it measures demand): an interval counts as busy
   when at least ``busy_share`` of its samples waited ``busy_queue_ms`` or more in the queue
   -- with a work-conserving scheduler, queued work means every worker was occupied. The
   estimate is the median of the last ``window`` busy intervals; idle time counts only when
   each of the last ``IDLE_PROOF_INTERVALS`` intervals served more than that, as the least
   of them (serving X proves capacity >= X; one interval alone proved nothing: work is
   counted when a request completes, so an interval's figure swings with how completions
   fall, and the high ones alone raised the estimate, 50 % above capacity after an hour at
   80 % load). Idle time never lowers it: throughput while the pool is not full measures
   demand, not capacity.

Until either source has data (``min_busy_intervals`` busy intervals, or one heartbeat),
the estimate is the configured ``initial`` capacity. Once the workers have measured it, a
pool with none live keeps their last sum (source ``workers``, no live worker, confidence
0), not the configured guess, unless busy intervals came after it: the newer evidence wins
(busy intervals an hour older beat the workers' last sum when their one worker restarted).

Each estimate carries a **confidence** in [0, 1]: how full the windows behind it are (for
heartbeats, averaged over the live workers, an unmeasured one counting 0; busy intervals
count half, being the weaker source; ``initial`` is 0). ``qos top`` shows it;
docs/control-law.md says how the law follows the estimate.

A request's work is ``input_tokens x w_in + output_tokens x w_out`` with the class's
weights (the same cost admission charges). Prefill is counted only if it happened (outcome
``ok``, or a first token was produced); a request that expired in the queue did no work.

The same intervals give each class's *served rate* over the last ``rate_intervals``
intervals -- the "used" input of the control law (a class that does not use its budget
must not be given more).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from limiter.errors import ConfigError, InvalidArgument
from limiter.samples import Sample

HASH_FIELD_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Idle intervals in a row that must each serve more than the estimate to raise it.
IDLE_PROOF_INTERVALS = 5


@dataclass(frozen=True)
class CapacityConfig:
    """The estimator's tunables: the ``[controller.capacity]`` table of the settings."""

    interval_s: float = 1.0
    window: int = 10  # reports per worker (and busy intervals) behind the median
    busy_queue_ms: float = 100.0
    busy_share: float = 0.1
    min_busy_intervals: int = 3
    worker_ttl_s: float = 5.0  # five missed heartbeats: a crashed worker leaves the sum soon
    min_reports: int = 3  # a worker's reports count once it has made this many (its first are ramp-up)
    rate_intervals: int = 5
    # Heartbeat field (qos:{pool}:worker:<id>) carrying weighted tokens/s while busy; "" = do
    # not use heartbeats. Not ``tokens_s``: that counts output tokens only, idle time included.
    worker_field: str = "capacity_tokens_s"

    def validate(self, prefix: str = "controller.capacity") -> CapacityConfig:
        checks = [
            # bounded above too: an interval of 1e-300 s overflowed int(ts // interval)
            ("interval_s", 0.01 <= self.interval_s <= 3600, "must be in [0.01, 3600]"),
            ("window", 1 <= self.window <= 1000, "must be in [1, 1000]"),
            ("busy_queue_ms", 0 <= self.busy_queue_ms <= 3_600_000, "must be in [0, 3600000]"),
            ("busy_share", 0 < self.busy_share <= 1, "must be in (0, 1]"),
            ("min_busy_intervals", 1 <= self.min_busy_intervals <= 1000, "must be in [1, 1000]"),
            ("worker_ttl_s", 0 < self.worker_ttl_s <= 3600, "must be in (0, 3600]"),
            ("min_reports", 1 <= self.min_reports <= 1000, "must be in [1, 1000]"),
            ("rate_intervals", 1 <= self.rate_intervals <= 1000, "must be in [1, 1000]"),
            ("worker_field", not self.worker_field or bool(HASH_FIELD_RE.fullmatch(self.worker_field)),
             "must be a hash field name or ''"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ConfigError(f"{prefix}.{name}", f"{message}, got {getattr(self, name)!r}")
        return self


@dataclass(frozen=True)
class CapacityEstimate:
    value: float  # weighted tokens/s
    source: str  # 'workers' | 'samples' | 'initial'
    live_workers: int
    busy_intervals: int
    confidence: float = 0.0  # 0..1: how full the windows behind the value are


@dataclass
class _Worker:
    reports: deque[float]  # the last ``window`` figures
    seen_ms: float
    count: int = 1  # every report so far (the first ``min_reports`` do not count)

    @property
    def value(self) -> float:
        return statistics.median(self.reports)


class CapacityEstimator:
    """Feed samples and heartbeats; read :meth:`estimate` and :meth:`served_rate`."""

    def __init__(self, config: CapacityConfig, initial: float,
                 weights: Mapping[str, tuple[float, float]] | None = None) -> None:
        """``initial``: the estimate until a source has data (the pool's configured capacity);
        ``weights``: each class's (w_in, w_out), the cost admission charges (default 1, 1)."""
        self.config = config.validate()
        if not (initial > 0 and math.isfinite(initial)):
            raise InvalidArgument("initial", f"must be a finite number > 0, got {initial!r}")
        for cls, pair in (weights or {}).items():
            if len(pair) != 2 or any(w < 0 for w in pair):
                raise InvalidArgument(f"weights.{cls}", f"expected (w_in, w_out) >= 0, got {pair!r}")
        self.initial = initial
        self.weights = dict(weights or {})
        self._interval_ms = config.interval_s * 1000.0
        self._workers: dict[str, _Worker] = {}
        self._last_measured: float | None = None  # the workers' last sum, while none is live
        self._last_measured_ms = -math.inf  # the newest report behind it
        self._last_busy_ms = -math.inf  # when the newest busy interval ended
        self._recent: deque[float] = deque(maxlen=IDLE_PROOF_INTERVALS)  # intervals' tokens/s
        self._alive: dict[str, float] = {}  # every live worker (measured or not) -> last seen ms
        self._busy_figures: deque[float] = deque(maxlen=config.window)  # busy intervals' tokens/s
        self._busy_intervals = 0
        self._index: int | None = None  # interval being filled
        self._work: dict[str, float] = {}
        self._n = 0
        self._waited = 0
        self._history: deque[dict[str, float]] = deque(maxlen=config.rate_intervals)

    # --- inputs -----------------------------------------------------------------------
    def work(self, sample: Sample) -> float:
        """Weighted tokens the pool actually processed for this request."""
        w_in, w_out = self.weights.get(sample.cls, (1.0, 1.0))
        prefilled = sample.outcome == "ok" or sample.ttft_ms is not None
        return (sample.input_tokens * w_in if prefilled else 0.0) + sample.output_tokens * w_out

    def observe_sample(self, sample: Sample) -> None:
        if sample.outcome == "rejected":
            return  # turned away at admission: no work done, no evidence the pool was busy
        index = int(sample.ts_ms // self._interval_ms)
        if self._index is None:
            self._index = index
        elif index > self._index:
            self._close_until(index)
        # A late sample (older interval) is counted in the current one: the work was done.
        self._work[sample.cls] = self._work.get(sample.cls, 0.0) + self.work(sample)
        self._n += 1
        self._waited += sample.queue_wait_ms >= self.config.busy_queue_ms

    def observe_worker(self, worker: str, tokens_per_s: float, now_ms: float) -> None:
        """A heartbeat: ``worker`` processed ``tokens_per_s`` weighted tokens/s while busy."""
        if isinstance(tokens_per_s, bool) or not math.isfinite(tokens_per_s) or tokens_per_s < 0:
            raise InvalidArgument("tokens_per_s", f"must be a finite number >= 0, got {tokens_per_s!r}")
        state = self._workers.get(worker)
        if state is None:
            self._workers[worker] = _Worker(deque([float(tokens_per_s)], maxlen=self.config.window), now_ms)
        else:
            if state.count < self.config.min_reports:
                state.reports.clear()  # ramp-up figures read low: they leave the window
            state.reports.append(float(tokens_per_s))
            state.seen_ms = now_ms
            state.count += 1

    def set_alive(self, workers: Mapping[str, float]) -> None:
        """The live workers (name -> last heartbeat ms), measured or not; the rest are gone."""
        self._alive = dict(workers)
        for name in [n for n in self._workers if n not in self._alive]:
            del self._workers[name]

    def remove_worker(self, worker: str) -> None:
        """A worker said goodbye (clean shutdown): drop it now rather than after the TTL."""
        self._workers.pop(worker, None)
        self._alive.pop(worker, None)

    def advance(self, now_ms: float) -> None:
        """Close intervals that ended before ``now_ms`` (idle time counts) and expire workers."""
        index = int(now_ms // self._interval_ms)
        if self._index is not None and index > self._index:
            self._close_until(index)
        ttl_ms = self.config.worker_ttl_s * 1000.0
        for name in [n for n, seen in self._alive.items() if now_ms - seen > ttl_ms]:
            del self._alive[name]
        # A worker that still heartbeats keeps its measurement however long it idles (an idle
        # worker reports nothing, and its capacity did not change; dropping it put the pool
        # back on the samples' estimate, 2x off, 5 s after a load ended); a silent one loses it.
        stale = [n for n, w in self._workers.items() if now_ms - w.seen_ms > ttl_ms and n not in self._alive]
        for name in stale:
            del self._workers[name]

    def _close_until(self, index: int) -> None:
        assert self._index is not None
        seconds = self.config.interval_s
        total = sum(self._work.values())
        self._recent.append(total / seconds)
        if self._n and self._waited >= self.config.busy_share * self._n:
            self._busy_intervals += 1
            self._busy_figures.append(total / seconds)
            self._last_busy_ms = (self._index + 1) * self._interval_ms
        elif (self._busy_figures and len(self._recent) == IDLE_PROOF_INTERVALS
              and min(self._recent) > statistics.median(self._busy_figures)):
            # Served more than the estimate in each of the last intervals: it is at least that.
            self._busy_figures.append(min(self._recent))
        self._history.append({cls: work / seconds for cls, work in self._work.items()})
        # Intervals with no samples at all: nothing was served (bounded by the history length).
        for _ in range(min(index - self._index - 1, self.config.rate_intervals)):
            self._history.append({})
        if index - self._index > 1:
            self._recent.append(0.0)  # an empty interval breaks a run of high ones
        self._index = index
        self._work = {}
        self._n = self._waited = 0

    # --- outputs ----------------------------------------------------------------------
    def estimate(self, now_ms: float | None = None) -> CapacityEstimate:
        if now_ms is not None:
            self.advance(now_ms)
        busy, window = self._busy_intervals, self.config.window
        measured = {n: w for n, w in self._workers.items() if w.count >= self.config.min_reports}
        if measured:
            total = sum(w.value for w in measured.values())
            live = len(set(self._alive) | set(self._workers))
            total += (live - len(measured)) * total / len(measured)
            confidence = sum(min(1.0, len(w.reports) / window) for w in measured.values()) / live
            self._last_measured = total
            self._last_measured_ms = max(w.seen_ms for w in measured.values())
            return CapacityEstimate(total, "workers", live, busy, confidence)
        workers_newer = self._last_measured is not None and self._last_measured_ms >= self._last_busy_ms
        if self._busy_figures and busy >= self.config.min_busy_intervals and not workers_newer:
            confidence = 0.5 * min(1.0, len(self._busy_figures) / window)
            return CapacityEstimate(statistics.median(self._busy_figures), "samples", 0, busy, confidence)
        if self._last_measured is not None:
            # Every measured worker gone (a restart, a lost node) and no newer busy interval to
            # go by: the pool's last measured capacity, not the configured guess. Falling back to
            # it took a 111.6 tokens/s pool to its configured 20,000 when its one worker
            # restarted, and the law raised every class's rates for the worker's return.
            return CapacityEstimate(self._last_measured, "workers", 0, busy, 0.0)
        return CapacityEstimate(self.initial, "initial", 0, busy, 0.0)

    def served_rate(self, cls: str) -> float:
        """Weighted tokens/s served for ``cls`` over the last closed intervals (0 if none)."""
        if not self._history:
            return 0.0
        return sum(h.get(cls, 0.0) for h in self._history) / len(self._history)
