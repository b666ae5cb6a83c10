"""Per-class SLO compliance over a sliding window of latency samples.

Workers, the frontend (rejections) and the Lua scripts (outcomes decided inside Redis) push
one sample per finished request to the samples stream (schema: limiter/samples.py). The
controller decodes each with :func:`limiter.samples.decode_sample` -- a bad sample raises
:class:`InvalidArgument` naming the field, so the role can count it, ack it and move on --
and feeds it to a :class:`SloMonitor`.

Compliance of a class = share of its judged samples that met the class SLO, over the last
``size`` judged samples (default 1000, the original problem's window), optionally also limited to the
last ``max_age_s`` seconds so an idle class's verdict does not live forever.

Judging (see :meth:`limiter.slo.ClassSLO.judge`, shared with the frontend and the benchmarks):

* ``cancelled`` samples are ignored: the client left, the system did not fail it; so are
  ``refused`` ones: failed for what the request is (a prompt past any worker's context, a
  model server's 400), no sign of the class's service.
* ``expired``, ``failed`` and ``rejected`` samples are violations: the request got no
  answer in time, or none at all (a 429 of the class budget or a full queue: without these
  a class could miss its attainment on rejections while its window read ~100 %). Except
  one that ended for a max wait its client set below the class's (``ttft_at_least_ms``):
  a violation only when that wait already passed the class's TTFT target, else not
  counted -- any client could otherwise steer the controller with a short
  ``X-QoS-Max-Wait-Ms``.
* ``ok`` samples meet the SLO when every latency the class has a target for is within it:
  TTFT against ``ttft_ms``, plus ``ttft_ms_per_1k_prompt_tokens`` per 1,000 of the
  request's prompt tokens where the class sets it (a long prompt's own prefill is no
  interference the law could remove by cutting the classes below); the mean time per
  output token against ``tpot_ms`` (the mean, because the target is about the stream's
  pace; one slow step shows up in the mean of a short answer anyway). A metric the sample
  lacks (a 1-token answer has no TPOT) is not judged.
* A class without any target (P2 by default) has no compliance: ``None``, never 1.0, so a
  dashboard does not show a perfect score for something nobody measured, and the control
  law ignores it.

The window also keeps a *fresh* subset: samples newer than the last :meth:`SloWindow.mark`.
Whenever it changes the rates the role marks the windows (at ``Decision.evidence_from_ms``,
a little after the change), and the control law judges only fresh evidence, so it never
reacts twice to latency caused by rates it already changed.
Updates are O(1) amortised: a deque used as a ring buffer plus running counts; only
``mark`` (once per rate change) rescans.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from limiter.errors import InvalidArgument
from limiter.samples import Sample
from limiter.slo import ClassSLO

DEFAULT_WINDOW = 1000


# P0 interactive: first token within 500 ms, 50 ms/token (20 tokens/s, faster than reading).
# P1 normal: looser. P2 batch: no latency target (its bound is the queue's max wait).
DEFAULT_SLOS: dict[str, ClassSLO] = {
    "P0": ClassSLO(ttft_ms=500.0, tpot_ms=50.0),
    "P1": ClassSLO(ttft_ms=2000.0, tpot_ms=150.0),
    "P2": ClassSLO(),
}


@dataclass(frozen=True)
class WindowStats:
    """A window's counts at one moment; ``compliance`` is None without a target or samples."""

    count: int
    met: int
    fresh_count: int
    fresh_met: int
    has_target: bool

    @property
    def compliance(self) -> float | None:
        return self.met / self.count if self.has_target and self.count else None

    @property
    def fresh_compliance(self) -> float | None:
        return self.fresh_met / self.fresh_count if self.has_target and self.fresh_count else None


class SloWindow:
    """The last ``size`` judged samples of one class (and at most ``max_age_s`` old)."""

    def __init__(self, slo: ClassSLO, size: int = DEFAULT_WINDOW, max_age_s: float | None = None) -> None:
        if size < 1:
            raise InvalidArgument("size", f"window must hold at least 1 sample, got {size}")
        if max_age_s is not None and not max_age_s > 0:
            raise InvalidArgument("max_age_s", f"must be > 0, got {max_age_s}")
        self.slo = slo
        self.size = size
        self.max_age_ms = None if max_age_s is None else max_age_s * 1000.0
        self._buf: deque[tuple[float, bool]] = deque()
        self._met = 0
        self._mark = -math.inf
        self._fresh = 0
        self._fresh_met = 0

    def add(self, sample: Sample) -> bool | None:
        """Judge and record one sample; returns the verdict (None = not recorded)."""
        verdict = self.slo.judge(sample)
        if verdict is None:
            return None
        self._buf.append((sample.ts_ms, verdict))
        self._met += verdict
        if sample.ts_ms > self._mark:
            self._fresh += 1
            self._fresh_met += verdict
        if len(self._buf) > self.size:
            self._drop()
        # No expiry by the sample's own time: one stamped far ahead (a writer on a clock that
        # stepped) forgot every other sample. stats(now) expires by the controller's now.
        return verdict

    def _drop(self) -> None:
        ts, verdict = self._buf.popleft()
        self._met -= verdict
        if ts > self._mark:
            self._fresh -= 1
            self._fresh_met -= verdict

    def expire(self, now_ms: float) -> None:
        """Forget samples older than ``max_age_s`` (oldest first; samples arrive ~in order)."""
        if self.max_age_ms is None:
            return
        cutoff = now_ms - self.max_age_ms
        while self._buf and self._buf[0][0] < cutoff:
            self._drop()

    def mark(self, ts_ms: float) -> None:
        """Start a new fresh subset: only samples with ``ts_ms`` after this count as fresh."""
        self._mark = ts_ms
        self._fresh = self._fresh_met = 0
        for ts, verdict in self._buf:
            if ts > ts_ms:
                self._fresh += 1
                self._fresh_met += verdict

    def stats(self, now_ms: float | None = None) -> WindowStats:
        if now_ms is not None:
            self.expire(now_ms)
        return WindowStats(len(self._buf), self._met, self._fresh, self._fresh_met, self.slo.has_target)


class SloMonitor:
    """One :class:`SloWindow` per class."""

    def __init__(
        self,
        slos: Mapping[str, ClassSLO] | None = None,
        size: int = DEFAULT_WINDOW,
        max_age_s: float | None = None,
    ) -> None:
        self.windows = {name: SloWindow(slo, size, max_age_s) for name, slo in (slos or DEFAULT_SLOS).items()}

    def add(self, sample: Sample) -> bool | None:
        window = self.windows.get(sample.cls)
        if window is None:
            raise InvalidArgument("sample.class", f"no SLO window for class {sample.cls!r}")
        return window.add(sample)

    def mark(self, ts_ms: float) -> None:
        for window in self.windows.values():
            window.mark(ts_ms)

    def stats(self, now_ms: float | None = None) -> dict[str, WindowStats]:
        return {name: window.stats(now_ms) for name, window in self.windows.items()}
