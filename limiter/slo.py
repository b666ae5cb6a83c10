"""A class's latency targets and the one rule for whether a request met them.

Shared by every role that judges: the controller's SLO window (its compliance drives the
control law), the frontend (its ``qos_frontend_ttft_target`` counter, what clients saw) and
``qos bench`` (client-side attainment). One formula, so the three cannot disagree on what a
long prompt's first-token target is.
"""

from __future__ import annotations

from dataclasses import dataclass

from limiter.config import ClassConfig
from limiter.samples import Sample


@dataclass(frozen=True)
class ClassSLO:
    """A class's latency targets in ms; ``None`` = no target for that metric.

    ``ttft_ms_per_1k_prompt_tokens``: the TTFT target of a request is ``ttft_ms`` plus this
    per 1,000 of its prompt tokens past ``ttft_base_prompt_tokens`` (the prompt a fixed
    ``ttft_ms`` already covers), counted as admission counted them
    (``Sample.pool_prompt_tokens``: the pool tokenizer's units, whichever role or engine
    wrote the sample)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ttft_ms_per_1k_prompt_tokens: float = 0.0
    ttft_base_prompt_tokens: int = 0

    @classmethod
    def of(cls, c: ClassConfig) -> ClassSLO:
        """The targets ``[[classes]]`` sets for class ``c``."""
        return cls(c.slo_ttft_ms, c.slo_tpot_ms, c.slo_ttft_ms_per_1k_prompt_tokens,
                   c.slo_ttft_base_prompt_tokens)

    @property
    def has_target(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def ttft_target_ms(self, prompt_tokens: int) -> float | None:
        """The first-token target of a request with ``prompt_tokens`` prompt tokens."""
        if self.ttft_ms is None:
            return None
        past_base = max(prompt_tokens - self.ttft_base_prompt_tokens, 0)
        return self.ttft_ms + self.ttft_ms_per_1k_prompt_tokens * past_base / 1000.0

    def judge(self, sample: Sample) -> bool | None:
        """True = met, False = violated, None = not counted (cancelled, refused for what the
        request is -- a client's too-long prompt is no sign of the class's service -- or no
        target at all)."""
        if sample.outcome in ("cancelled", "refused") or not self.has_target:
            return None
        ttft_target = self.ttft_target_ms(sample.pool_prompt_tokens)
        if sample.ttft_at_least_ms is not None and sample.outcome in ("expired", "rejected"):
            # Ended by its client's own shorter wait: a miss only if even that wait was past
            # the first-token target (any longer wait would have missed it too).
            if ttft_target is None or sample.ttft_at_least_ms <= ttft_target:
                return None
            return False
        if sample.outcome != "ok":
            return False
        if ttft_target is not None and sample.ttft_ms is not None and sample.ttft_ms > ttft_target:
            return False
        tpot = sample.tpot_mean_ms
        return not (self.tpot_ms is not None and tpot is not None and tpot > self.tpot_ms)
