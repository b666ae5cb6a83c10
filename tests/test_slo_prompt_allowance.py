"""A TTFT target that grows with the prompt keeps the law from cutting for a prompt's own prefill.

The simulated pool (tests/support/plant.py, the real SLO window and control law) is offered
the steady load of tests/test_plant_stability.py, with one P0 request in twenty carrying an
8,000-token prompt whose own prefill takes 700 ms: past P0's 500 ms first-token target on an
idle pool, whatever the classes below do. A fixed target reads those misses as interference
and cuts P1 and P2 for nothing; ``slo_ttft_ms_per_1k_prompt_tokens`` (here 100 ms per 1,000
prompt tokens: the long prompts' target 1,300 ms, a short prompt's 520) leaves the rates
alone, and still protects P0 from a real flood of P2.
"""

from __future__ import annotations

import dataclasses

import pytest

from limiter.controller.control_law import ControlConfig
from limiter.controller.slo_window import DEFAULT_SLOS
from limiter.slo import ClassSLO
from tests.support.plant import (
    DEFAULT_PLANT_CLASSES,
    LongPrompts,
    PlantConfig,
    Trace,
    simulate,
    step_load,
    step_metrics,
)

C = 100_000.0
STEADY = {"P0": 0.45 * C, "P1": 0.30 * C, "P2": 0.05 * C}
P2_FLOOD = {**STEADY, "P2": 3.0 * C}
LONG = LongPrompts(share=0.05, input_tokens=8_000, prefill_ms=700.0)
MIXED_P0 = (dataclasses.replace(DEFAULT_PLANT_CLASSES[0], long=LONG), *DEFAULT_PLANT_CLASSES[1:])
P0_FIXED = DEFAULT_SLOS["P0"]  # TTFT <= 500 ms whatever the prompt
P0_PER_PROMPT = dataclasses.replace(P0_FIXED, ttft_ms_per_1k_prompt_tokens=100.0)


def plant(p0: ClassSLO, seed: int = 1) -> PlantConfig:
    return PlantConfig(classes=MIXED_P0, slos={**DEFAULT_SLOS, "P0": p0}, seed=seed)


def cuts(trace: Trace) -> list[tuple[float, str]]:
    return [(d.now_ms, c.reason) for d in trace.decisions for c in d.classes
            if c.reason.startswith("tighten")]


def test_a_fixed_target_cuts_the_classes_below_for_a_long_prompt_s_own_prefill() -> None:
    """The problem, shown so the next test's check can fail: with a fixed target the long
    prompts hold P0 near 95 %, and the law cuts P1 and P2 down towards their floors."""
    trace = simulate(ControlConfig(), lambda t: STEADY, 300.0, plant(P0_FIXED))
    assert len(cuts(trace)) >= 5, cuts(trace)
    floors = ControlConfig().min_shares  # P1 and P2 end at their floors: every cut was for nothing
    assert trace.ceils["P1"][-1] == pytest.approx(floors[1] * C)
    assert trace.ceils["P2"][-1] == pytest.approx(floors[2] * C)


def test_a_target_per_prompt_token_leaves_the_rates_alone() -> None:
    for seed in (1, 2):
        trace = simulate(ControlConfig(), lambda t: STEADY, 300.0, plant(P0_PER_PROMPT, seed))
        assert cuts(trace) == [], f"seed {seed}: {cuts(trace)}"
        late = [c for c in trace.compliance["P0"][300:] if c is not None]
        assert min(late) >= 0.99  # the long prompts meet their own target


def test_a_target_per_prompt_token_still_protects_p0_from_a_flood() -> None:
    """The allowance is for the prompt's own prefill only: queueing behind a P2 flood still
    makes P0's short prompts miss, and the law still cuts P2's borrowing to mend it."""
    trace = simulate(ControlConfig(), step_load(STEADY, P2_FLOOD, 20.0), 120.0, plant(P0_PER_PROMPT))
    m = step_metrics(trace, 20.0)
    assert m.min_compliance < 0.95  # the flood really hurt P0
    assert cuts(trace) and all(t > 20_000 for t, _ in cuts(trace))
    assert m.recovery_s is not None and m.recovery_s <= 30.0
    assert m.final_min_compliance >= 0.95
    assert trace.rates["P1"][-1] >= 0.35 * C * 0.999  # P2's borrowing went, not P1's guarantee
