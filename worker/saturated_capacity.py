"""What this worker would serve if it were saturated, at the mix it serves: the capacity
figure of its heartbeat.

The controller sums this figure over the live workers as the pool's capacity
(limiter/controller/capacity.py) and sets every class's rate as a share of it, so the figure
must hold still while the device and the request mix do, whatever the load. Timing the
"full" steps (worker/busy_meter.py, the figure before this one) does not: under the adaptive
step budget a step is full of *tokens* long before the batch is full of *sequences*, and a
step with 15 decoders delivers more weighted work in the same time than one with 3 (an
output token weighs ~20 prompt tokens, and the step's fixed cost is shared). On a steady
0.8x load its figure climbed 19.6K -> 22.0K weighted tokens/s between 15 s and 45 s while
the batches filled, and the controller followed it (docs/control-law.md).

So the figure is *computed* from things that do not depend on how full the batch is:

* **the device**: the step cost ``ms = fixed + per_prefill x P + per_decode x D`` fitted to
  this worker's own steps (worker/step_budget.py's fit, with a longer memory), plus the
  mean time between two steps while busy (the Redis work the loop awaits between steps);
* **the mix**: over this worker's recent steps, the prompt tokens prefilled per output token
  produced, ``rho``, and the mean weight of a prompt and of an output token (counted as the
  steps process them: counted over *finished* requests, the first tens of seconds saw only
  the short ones, and one worker's figure climbed ~30 % over 45 s as the long ones finished);
* **the limits**: ``max_seqs``, the largest step budget, the KV room, and the step time
  the adaptive budget aims at when a class with a TPOT target is decoding.

Which target binds depends on the batch: a saturated batch of ``D`` decoders holds a
sequence of a class whose share of the decode slots is ``p`` with probability
``1 - (1 - p)^D`` (the share of *steps* that had one grows with the batch, so it cannot be
the input). The figure combines the cases -- the tightest class present, the next, ...,
none -- by their probability, as total work over total time.

At saturation ``D`` sequences decode and ``rho x D`` prompt tokens are prefilled per step
(every request is prefilled once and decodes its outputs), with ``D`` as large as the limits
allow: ``D <= max_seqs``, ``D (1 + rho) <= budget``, ``D <= kv_room / reserved`` and, under a
target ``T``, ``fixed + (per_prefill x rho + per_decode) D <= T`` (never below the budget's
floor of ``max_seqs`` tokens). The figure is the weighted work of that step (recomputed
prompt tokens take time but are no work) over its time plus the gap between steps (counted
only when the step before left work to run: an idle wait is not overhead). Pure: the step
loop feeds it its steps and the requests it starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from limiter.errors import InvalidArgument
from worker.step_budget import StepCostFit

# ~500 steps (25 s at 50 ms a step) behind the fit, ~1,000 behind the mix (a mix is noisier:
# request sizes are heavy-tailed): long enough that one heartbeat's steps do not move them,
# short enough to follow a new device, model or workload.
FIT_FORGET = 0.998
MIX_FORGET = 0.999
MIN_OUTPUTS = 50.0  # output tokens (decayed) before the mix is trusted
MIN_CLAIMS = 3.0  # requests started (decayed) before their KV reservation is


@dataclass(frozen=True)
class StepLimits:
    max_seqs: int
    max_budget: int  # tokens: the largest step the budget allows
    kv_tokens: int  # the worker's KV room

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_budget", "kv_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")


class SaturatedCapacity:
    """The fit, the mix and the rule (module docstring)."""

    def __init__(self, limits: StepLimits, targets_ms: Sequence[float | None] = (),
                 max_pause_s: float = 1.0) -> None:
        """``targets_ms``: per class rank, the step time the budget aims at while that class
        decodes (None: no target; empty: no adaptive budget)."""
        self.limits = limits
        self.targets_ms = tuple(targets_ms)
        self.max_pause_s = max_pause_s
        self._fit = StepCostFit(FIT_FORGET)
        self._prev_end: float | None = None
        self._gap_s = 0.0  # decayed mean time between a step and the next while busy
        self._gap_n = 0.0
        self._slots = [0.0] * len(self.targets_ms)  # decayed decode slots per class rank
        self._slot_total = 0.0
        # decayed sums over steps (the mix) and over started requests (their KV reservation)
        self._n = 0.0
        self._prompt = 0.0
        self._output = 0.0
        self._prompt_work = 0.0
        self._output_work = 0.0
        self._reserved = 0.0

    def step(self, start: float, end: float, prefill_tokens: int, decode_ranks: Sequence[int], *,
             busy_before: bool, fresh_prefill_work: float, outputs: int, output_work: float) -> None:
        """One engine step (monotonic seconds): ``prefill_tokens`` prompt tokens prefilled
        (recomputation included), of which the fresh ones weigh ``fresh_prefill_work``; one
        decoding sequence per entry of ``decode_ranks`` (its class rank); ``outputs`` tokens
        produced (``output_work`` weighted). ``busy_before``: the step before left work to
        run, so the time between the two was the loop's overhead, not an idle wait."""
        prev, self._prev_end = self._prev_end, end
        m = MIX_FORGET
        self._prompt = self._prompt * m + prefill_tokens
        self._output = self._output * m + outputs
        self._prompt_work = self._prompt_work * m + fresh_prefill_work
        self._output_work = self._output_work * m + output_work
        if self._slots:
            self._slots = [x * m for x in self._slots]
            self._slot_total = self._slot_total * m + len(decode_ranks)
            for r in decode_ranks:
                if 0 <= r < len(self._slots):
                    self._slots[r] += 1.0
        if not self._fit.observe(prefill_tokens, len(decode_ranks), (end - start) * 1e3):
            return
        if busy_before and prev is not None and 0.0 <= start - prev <= (end - start) + self.max_pause_s:
            f = FIT_FORGET
            self._gap_s = self._gap_s * f + (start - prev)
            self._gap_n = self._gap_n * f + 1.0

    def started(self, reserved_tokens: int) -> None:
        """A request started here, reserving ``reserved_tokens`` of KV room (prompt +
        max_tokens, at most the worker's room)."""
        if reserved_tokens < 1:
            return
        self._n = self._n * MIX_FORGET + 1.0
        self._reserved = self._reserved * MIX_FORGET + min(reserved_tokens, self.limits.kv_tokens)

    def value(self) -> float:
        """Weighted tokens/s at saturation; 0.0 while the fit or the mix is not known yet."""
        fit = self._fit.cost()
        if fit is None or self._output < MIN_OUTPUTS or self._n < MIN_CLAIMS:
            return 0.0
        # the cases, tightest target first: that class present (and none tighter), ..., none
        cases = sorted((t, r) for r, t in enumerate(self.targets_ms) if t is not None and self._slots[r] > 0)
        work = time = 0.0
        rest = 1.0  # probability that no class with a tighter target is in the batch
        for target, rank in cases:
            d, w, t = self._saturated_step(fit, target)
            present = 1.0 - (1.0 - self._slots[rank] / self._slot_total) ** d
            work += rest * present * w
            time += rest * present * t
            rest *= 1.0 - present
        d, w, t = self._saturated_step(fit, None)
        work += rest * w
        time += rest * t
        if not (work > 0 and time > 0 and math.isfinite(work / time)):
            return 0.0
        return work / time * 1e3

    def _saturated_step(self, fit: tuple[float, float, float], target_ms: float | None
                        ) -> tuple[float, float, float]:
        """(decoders, weighted work, ms including the gap) of the largest step the limits allow."""
        fixed, per_prefill, per_decode = fit
        lim = self.limits
        rho = self._prompt / self._output  # prompt tokens per output token
        per_seq_ms = per_prefill * rho + per_decode  # step time per decoding sequence
        tokens = 1.0 + rho  # step tokens per decoding sequence
        floor = min(lim.max_seqs, lim.max_budget) / tokens  # the budget never goes below max_seqs
        d = min(float(lim.max_seqs), lim.max_budget / tokens)
        if target_ms is not None and per_seq_ms > 0:
            d = min(d, max((target_ms - fixed) / per_seq_ms, floor))
        d = max(min(d, lim.kv_tokens / (self._reserved / self._n)), 0.0)
        work = d * (self._prompt_work + self._output_work) / self._output
        return d, work, fixed + per_seq_ms * d + self._gap_ms()

    def _gap_ms(self) -> float:
        return self._gap_s / self._gap_n * 1e3 if self._gap_n > 0 else 0.0
