"""How many tokens the next engine step may take: sized from the tightest TPOT target among
the classes decoding in it and the measured cost of a step (Sarathi-Serve's rule, online).

A fixed token budget protects P0 only on the device it was tuned for: 512 tokens per step is
~50 ms on a GPU and ~0.5 s on this project's CPU, where a P0 stream stalled 11x its gap next
to a long prefill. So the budget follows two things the worker knows:

* **The target.** A decoding sequence gets one token per step, so its time per output token
  is the step time. The step may take ``safety x`` the smallest ``slo_tpot_ms`` among the
  classes that have a sequence *decoding* in the batch. With no such class (only prefills,
  or only classes without a TPOT target) it may take the configured maximum: larger steps
  prefill a long prompt with fewer repeated context reads and per-step costs.
* **The cost.** A step's time is close to linear in its prefill tokens and its decoding
  sequences: ``ms = fixed + per_prefill_token x P + per_decode x D``. The worker fits that
  plane to its own steps by least squares with exponential forgetting, so it follows the
  device, the model and the context lengths it runs, without a profile. No coefficient may
  be negative: where the plain solution has one, the best fit with it held at zero is
  taken (a full worker's steps all decode 15 or 16 sequences, and the plain solution then
  splits the fixed and per-decoder costs arbitrarily).

For the next step, with ``D`` sequences decoding: ``P = (target - fixed - per_decode x D) /
per_prefill_token`` and the budget is ``D + P``, clamped to ``[min_budget, max_budget]``: the
minimum is the batch size (every decoder must fit a step), the maximum the configured
``token_budget``. Until the fit stands on steps of different prefill sizes, the budget is the
target over the highest cost per token seen lately (decoding costs more per token than
prefill, so this errs small: a first long prefill next to a P0 stream does not stall it while
the worker is still learning its device); before any step at all, the maximum. Pure: no
clock, no engine; the scheduler feeds it each step's counts and duration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from limiter.errors import InvalidArgument


@dataclass(frozen=True)
class BudgetConfig:
    tpot_ms: Sequence[float | None]  # per class rank (0 = highest): its TPOT target, None = none
    min_budget: int
    max_budget: int
    safety: float = 0.9  # aim the step at this share of the tightest target
    forget: float = 0.97  # weight of the past in the fit, per step

    def __post_init__(self) -> None:
        if not 1 <= self.min_budget <= self.max_budget:
            raise InvalidArgument("min_budget", f"need 1 <= min_budget <= max_budget, got {self.min_budget}, "
                                  f"{self.max_budget}")
        if not 0 < self.safety <= 1:
            raise InvalidArgument("safety", f"must be in (0, 1], got {self.safety}")
        if not 0 < self.forget < 1:
            raise InvalidArgument("forget", f"must be in (0, 1), got {self.forget}")
        for t in self.tpot_ms:
            if t is not None and not t > 0:
                raise InvalidArgument("tpot_ms", f"targets must be > 0, got {t}")


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve the square system ``m x = v`` (Gaussian elimination, partial pivoting); None if
    singular."""
    size = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    scale = max(1.0, max(abs(x) for row in m for x in row))
    for col in range(size):
        piv = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(size):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][size] / a[i][i] for i in range(size)]


# The coefficients a fit may solve for: per prefill token always; the fixed cost and the
# per-decoder cost each unless the data puts it below zero (then it is held at zero). Where
# two sets fit as well (every step decoded as many sequences), the earlier one is kept: the
# decoders' cost goes into the fixed cost rather than the other way round.
_FREE_SETS = ((0, 1, 2), (0, 1), (1, 2), (1,))


class StepCostFit:
    """``ms = fixed + per_prefill_token x P + per_decode x D``, fitted by least squares to the
    steps seen, each weighing ``forget`` times the one after it."""

    def __init__(self, forget: float) -> None:
        if not 0 < forget < 1:
            raise InvalidArgument("forget", f"must be in (0, 1), got {forget}")
        self.forget = forget
        self._xx = [[0.0] * 3 for _ in range(3)]  # weighted sums of x x^T, x = (1, prefill, decodes)
        self._xy = [0.0] * 3
        self._steps = 0.0
        # cost() as last solved, until the next observation: a step may ask several times
        # (its budget, a prompt's size beyond it, the look-ahead claim's timing)
        self._cost: tuple[float, float, float] | None = None
        self._cost_known = False

    def observe(self, prefill_tokens: int, decodes: int, ms: float) -> bool:
        """One step; False (and nothing learnt) for an empty step or a non-finite time."""
        if prefill_tokens + decodes <= 0 or not math.isfinite(ms) or ms < 0:
            return False
        # x = (1, prefill, decodes): the decayed sums of x x^T and x ms, written out (a loop
        # over the nine entries was a tenth of a one-sequence step's own CPU, and two fits
        # observe every step: this one and worker/saturated_capacity.py's)
        f, p, d = self.forget, float(prefill_tokens), float(decodes)
        xy, (r0, r1, r2) = self._xy, self._xx
        xy[0], xy[1], xy[2] = xy[0] * f + ms, xy[1] * f + p * ms, xy[2] * f + d * ms
        pp, pd = p * p, p * d
        r0[0], r0[1], r0[2] = r0[0] * f + 1.0, r0[1] * f + p, r0[2] * f + d
        r1[0], r1[1], r1[2] = r1[0] * f + p, r1[1] * f + pp, r1[2] * f + pd
        r2[0], r2[1], r2[2] = r2[0] * f + d, r2[1] * f + pd, r2[2] * f + d * d
        self._steps = self._steps * f + 1.0
        self._cost_known = False
        return True

    def cost(self) -> tuple[float, float, float] | None:
        """(fixed ms, ms per prefill token, ms per decoding sequence), or None while the
        steps seen cannot pin them down (no spread in prefill sizes, or a non-physical fit)."""
        if not self._cost_known:
            self._cost, self._cost_known = self._solved(), True
        return self._cost

    def _solved(self) -> tuple[float, float, float] | None:
        n = self._steps
        if n < 3:
            return None
        mean_p = self._xx[0][1] / n
        var_p = self._xx[1][1] / n - mean_p * mean_p
        if var_p <= (0.05 * max(mean_p, 1.0)) ** 2:
            return None
        sol = self._constrained()
        return None if sol is None else (sol[0], sol[1], sol[2])

    def _constrained(self) -> list[float] | None:
        """The least-squares plane with no coefficient below zero (and a positive cost per
        prefill token), or None. Where the unconstrained solution breaks that, each smaller
        set of free coefficients is solved with the others held at zero and the one that
        fits best wins. A full worker decodes 15 or 16 sequences every step: the fixed cost
        and the per-decoder cost are then nearly collinear, and the plain solution came out
        as, e.g., 66.8 ms fixed and -2.3 ms per decoder. Clamping that coefficient to zero
        on its own left the rest as solved: a decode step of 30 ms was predicted at 67 ms,
        and the look-ahead claim timed by it slept past the step's end (docs/worker.md)."""
        best: tuple[float, list[float]] | None = None
        for free in _FREE_SETS:
            sub = _solve([[self._xx[i][j] for j in free] for i in free], [self._xy[i] for i in free])
            if sub is None:
                continue
            beta = [0.0, 0.0, 0.0]
            for i, b in zip(free, sub, strict=True):
                beta[i] = b
            if beta[1] <= 0 or beta[0] < 0 or beta[2] < 0:
                continue
            if len(free) == 3:
                return beta  # the unconstrained optimum is feasible: nothing fits better
            # the weighted squared error, less the constant sum of weighted y^2
            loss = sum(beta[i] * self._xx[i][j] * beta[j] for i in range(3) for j in range(3)) \
                - 2 * sum(beta[i] * self._xy[i] for i in range(3))
            if best is None or loss < best[0] - 1e-9 * max(1.0, abs(best[0])):
                best = (loss, beta)
        return None if best is None else best[1]


class StepBudget:
    """The online fit and the rule (module docstring)."""

    def __init__(self, config: BudgetConfig) -> None:
        self.config = config
        self._fit = StepCostFit(config.forget)
        self._ms_per_token = 0.0  # decayed maximum of a step's ms / tokens: the cold-start bound
        self.last = config.max_budget  # the budget chosen last (for the heartbeat)

    def observe(self, prefill_tokens: int, decodes: int, ms: float) -> None:
        """One step: ``prefill_tokens`` prompt tokens and ``decodes`` decoding sequences took
        ``ms`` milliseconds."""
        if self._fit.observe(prefill_tokens, decodes, ms):
            self._ms_per_token = max(self._ms_per_token * self.config.forget, ms / (prefill_tokens + decodes))

    def cost(self) -> tuple[float, float, float] | None:
        """The fit's (fixed ms, ms per prefill token, ms per decoding sequence), or None."""
        return self._fit.cost()

    def expected_ms(self, prefill_tokens: int, decodes: int) -> float | None:
        """A step's time as the fit predicts it (the plane above), or None before it stands."""
        if (fit := self.cost()) is None:
            return None
        fixed, per_prefill, per_decode = fit
        return fixed + per_prefill * prefill_tokens + per_decode * decodes

    def target_ms(self, decoding_ranks: Iterable[int]) -> float | None:
        """The step time the decoding classes allow, or None when none of them has a target."""
        targets = [t for r in set(decoding_ranks) if 0 <= r < len(self.config.tpot_ms)
                   and (t := self.config.tpot_ms[r]) is not None]
        return self.config.safety * min(targets) if targets else None

    def budget(self, decoding_ranks: Sequence[int]) -> int:
        """Tokens for the next step, ``decoding_ranks`` being the classes of its decoders."""
        self.last = self.size(decoding_ranks, self.config.max_budget)
        return self.last

    def size(self, decoding_ranks: Sequence[int], most: int) -> int:
        """The step the decoders' targets allow, at most ``most`` tokens (the rule above with
        ``most`` for the configured maximum; :meth:`budget` is this at that maximum). The
        scheduler asks with a larger ``most`` for a prompt that may go beyond the maximum
        (worker/batch_scheduler.py), still held to the targets."""
        c = self.config
        target = self.target_ms(decoding_ranks)
        if target is None:  # the fit would go unused: not solved (an idle worker's first step solved it)
            return most
        fit = self.cost()
        if fit is None and self._ms_per_token <= 0:
            return most
        if fit is None:  # still learning the device: err small
            return int(min(most, max(c.min_budget, target / self._ms_per_token)))
        fixed, per_prefill, per_decode = fit
        decodes = len(decoding_ranks)
        prefill = (target - fixed - per_decode * decodes) / per_prefill
        return int(min(most, max(c.min_budget, decodes + max(prefill, 0.0))))
