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
  device, the model and the context lengths it runs, without a profile.

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


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve the 3x3 system ``m x = v`` (Gaussian elimination, partial pivoting); None if singular."""
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row)):
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][3] / a[i][i] for i in range(3)]


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

    def observe(self, prefill_tokens: int, decodes: int, ms: float) -> bool:
        """One step; False (and nothing learnt) for an empty step or a non-finite time."""
        if prefill_tokens + decodes <= 0 or not math.isfinite(ms) or ms < 0:
            return False
        f = self.forget
        x = (1.0, float(prefill_tokens), float(decodes))
        for i in range(3):
            self._xy[i] = self._xy[i] * f + x[i] * ms
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * f + x[i] * x[j]
        self._steps = self._steps * f + 1.0
        return True

    def cost(self) -> tuple[float, float, float] | None:
        """(fixed ms, ms per prefill token, ms per decoding sequence), or None while the
        steps seen cannot pin them down (no spread in prefill sizes, or a non-physical fit)."""
        n = self._steps
        if n < 3:
            return None
        mean_p = self._xx[0][1] / n
        var_p = self._xx[1][1] / n - mean_p * mean_p
        if var_p <= (0.05 * max(mean_p, 1.0)) ** 2:
            return None
        sol = _solve3(self._xx, self._xy)
        if sol is None:
            # every step decoded as many sequences: fit the line in prefill tokens alone
            mean_y = self._xy[0] / n
            slope = (self._xy[1] / n - mean_p * mean_y) / var_p
            sol = [mean_y - slope * mean_p, slope, 0.0]
        fixed, per_prefill, per_decode = sol
        if per_prefill <= 0:
            return None
        return max(fixed, 0.0), per_prefill, max(per_decode, 0.0)


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
        fit = self.cost()
        if target is None or (fit is None and self._ms_per_token <= 0):
            return most
        if fit is None:  # still learning the device: err small
            return int(min(most, max(c.min_budget, target / self._ms_per_token)))
        fixed, per_prefill, per_decode = fit
        decodes = len(decoding_ranks)
        prefill = (target - fixed - per_decode * decodes) / per_prefill
        return int(min(most, max(c.min_budget, decodes + max(prefill, 0.0))))
