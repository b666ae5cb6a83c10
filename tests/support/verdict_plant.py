"""A plant of verdicts only, driving the real control law in simulated time (no sleeping).

tests/support/plant.py models *why* a class misses (the lower classes' load); this one says
*how often* it misses, from a function the test gives: ``p0(t, allowances)`` is the chance a
P0 request finishing in second ``t`` meets its SLO, so a test can hold P0 at a steady level
that no cut changes (its own TPOT misses, say), or make it depend on the lower classes.

Each second ``rates[i]`` requests of P0 and P1 finish, each a Bernoulli draw; the law sees
what the controller's SLO windows give it: compliance over the *fresh* samples (finished
after the last change's ``evidence_from_ms``) and over the whole window (``cfg.window``
samples). Each class uses ``min(demand_i, a_i)`` of capacity; ``used_per_s`` makes the
``used`` the law reads a measurement, as limiter/controller/usage.py makes it: the class's
claims over the last second (Poisson, that many a second) times their mean work.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from limiter.controller.control_law import ClassInputs, ControlConfig, ControlState, Decision, Inputs, decide

C = 100_000.0
Compliance = Callable[[int, Sequence[float]], float]


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method: lam stays small here)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


@dataclass
class _Window:
    """One class's SLO window: the fresh and whole-window compliance, in O(log n) a tick."""

    size: int
    times: list[float] = field(default_factory=list)
    met: list[int] = field(default_factory=lambda: [0])  # prefix sums of met samples

    def add(self, t: float, ok: bool) -> None:
        self.times.append(t)
        self.met.append(self.met[-1] + ok)

    def stats(self, mark_s: float) -> tuple[float | None, int, float | None]:
        n = len(self.times)
        first = max(0, n - self.size)
        fresh = max(first, bisect_right(self.times, mark_s))
        q = (self.met[n] - self.met[fresh]) / (n - fresh) if n > fresh else None
        whole = (self.met[n] - self.met[first]) / (n - first) if n > first else None
        return q, n - fresh, whole


@dataclass(frozen=True)
class Run:
    state: ControlState
    changes: list[tuple[int, tuple[str, ...], tuple[float, ...]]]  # (t, reasons, allowances)
    allowances: list[tuple[float, ...]]  # after each second's decision
    decisions: list[Decision]  # every decision (each second)

    def changes_after(self, t: int) -> int:
        return sum(1 for c in self.changes if c[0] > t)


def run(
    p0: Compliance,
    seconds: int,
    *,
    p1: Compliance = lambda t, a: 0.999,
    demand: tuple[float, float, float] = (0.45, 0.30, 0.25),
    rates: tuple[int, int] = (200, 100),
    used_per_s: float = 0.0,
    seed: int = 1,
    cfg: ControlConfig | None = None,
) -> Run:
    """Drive the law once a simulated second for ``seconds``; see the module docstring."""
    rng = random.Random(seed)
    cfg = cfg or ControlConfig()
    state = ControlState.initial(cfg, C)
    windows = [_Window(cfg.window), _Window(cfg.window)]
    mark_s = -1.0
    changes, trace, decisions = [], [], []
    for t in range(1, seconds + 1):
        alw = [c.allowance for c in state.classes]
        for w, rate, fn in zip(windows, rates, (p0, p1), strict=True):
            p = fn(t, alw)
            for k in range(rate):
                w.add(t - 1 + (k + 0.5) / rate, rng.random() < p)
        used = [min(d, a) * C for d, a in zip(demand, alw, strict=True)]
        if used_per_s > 0:
            used = [u * poisson(rng, used_per_s) / used_per_s for u in used]
        ins = {}
        for i, (name, w) in enumerate(zip(("P0", "P1"), windows, strict=True)):
            q, n, whole = w.stats(mark_s)
            ins[name] = ClassInputs(q, n, used[i], True, whole)
        ins["P2"] = ClassInputs(None, 0, used[2], False)
        d = decide(state, Inputs(C, ins), t * 1000.0)
        if d.evidence_from_ms is not None:
            mark_s = d.evidence_from_ms / 1000.0
            reasons = tuple(c.reason for c in d.classes)
            changes.append((t, reasons, tuple(round(c.allowance, 4) for c in d.classes)))
        state = d.state
        trace.append(tuple(c.allowance for c in state.classes))
        decisions.append(d)
    return Run(state, changes, trace, decisions)


def steady(level: float) -> Compliance:
    return lambda t, a: level


def transient(level: float, low: float, start: int, seconds: int) -> Compliance:
    """``level``, but ``low`` for ``seconds`` from ``start``: a short problem of the class's own."""
    return lambda t, a: low if start <= t < start + seconds else level

