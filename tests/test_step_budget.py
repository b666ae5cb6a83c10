"""worker/step_budget.py: the step's token budget from the decoders' TPOT targets and the
measured step cost."""

from __future__ import annotations

import random

import pytest

from limiter.errors import InvalidArgument
from worker.step_budget import BudgetConfig, StepBudget

TARGETS = (50.0, 150.0, None)  # P0, P1, P2 (no TPOT target)


def fed(cost, steps: int = 60, seed: int = 1, min_budget: int = 16) -> StepBudget:
    """A budget that watched ``steps`` steps of varied sizes costing ``cost(prefill, decodes)`` ms."""
    rng = random.Random(seed)
    b = StepBudget(BudgetConfig(TARGETS, min_budget=min_budget, max_budget=2048))
    for _ in range(steps):
        p, d = rng.randint(0, 1500), rng.randint(0, 16)
        b.observe(p, d, cost(p, d) * (1 + rng.uniform(-0.02, 0.02)))
    return b


def test_the_fit_recovers_the_step_cost_of_the_device() -> None:
    fixed, per_prefill, per_decode = fed(lambda p, d: 10 + 0.06 * p + 1.0 * d).cost()
    assert fixed == pytest.approx(10, abs=1.0)
    assert per_prefill == pytest.approx(0.06, rel=0.05)
    assert per_decode == pytest.approx(1.0, rel=0.15)


def test_the_step_fits_the_tightest_decoding_target() -> None:
    b = fed(lambda p, d: 10 + 0.06 * p + 1.0 * d)
    # a P0 decodes: 0.9 x 50 = 45 ms; 16 decoders cost 26 ms; (45 - 26) / 0.06 = 317 prefill tokens
    assert b.budget([0] * 4 + [2] * 12) == pytest.approx(16 + 317, abs=15)
    # only P1 (150 ms) and P2 (none) decode: a bigger step
    assert b.budget([1] * 4 + [2] * 12) == pytest.approx(16 + (135 - 26) / 0.06, abs=60)
    # nobody decoding has a target (or nobody decodes at all): the most the config allows
    assert b.budget([2] * 16) == 2048 and b.budget([]) == 2048
    assert b.last == 2048


def test_a_slow_device_gets_small_steps_never_below_the_batch() -> None:
    cpu = fed(lambda p, d: 20 + 1.0 * p + 3.0 * d, min_budget=4)  # ~0.5 s for a 512-token chunk
    assert cpu.budget([0] * 4) == pytest.approx(4 + (45 - 20 - 12) / 1.0, abs=2)
    assert cpu.budget([0] * 9) == 9  # decoding alone takes 47 ms: one token each, no prefill


def test_it_follows_a_device_that_gets_slower() -> None:
    b = fed(lambda p, d: 10 + 0.06 * p + 1.0 * d)
    before = b.budget([0] * 8)
    rng = random.Random(2)
    for _ in range(150):  # the same steps now cost twice as much (another model, a throttled GPU)
        p, d = rng.randint(0, 1500), rng.randint(0, 16)
        b.observe(p, d, 2 * (10 + 0.06 * p + 1.0 * d))
    assert b.budget([0] * 8) < 0.5 * before


def test_while_it_cannot_fit_the_cost_it_errs_small() -> None:
    b = StepBudget(BudgetConfig(TARGETS, min_budget=8, max_budget=512))
    assert b.budget([0] * 8) == 512  # nothing seen at all yet
    for _ in range(20):
        b.observe(0, 8, 18.0)  # decode-only steps say nothing about prefill cost...
    assert b.cost() is None
    assert b.budget([0] * 8) == int(45 / (18.0 / 8))  # ...so the target at their cost per token
    assert b.budget([1, 2]) == int(135 / (18.0 / 8)) and b.budget([2]) == 512
    b2 = StepBudget(BudgetConfig(TARGETS, min_budget=16, max_budget=512))
    for p in range(100, 2000, 100):  # every step decoded 8: the line in prefill tokens alone
        b2.observe(p, 8, 18 + 0.05 * p)
    fixed, per_prefill, _ = b2.cost()
    assert fixed == pytest.approx(18, abs=0.5) and per_prefill == pytest.approx(0.05, rel=0.01)


def test_bad_config_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        BudgetConfig(TARGETS, min_budget=64, max_budget=32)
    with pytest.raises(InvalidArgument):
        BudgetConfig(TARGETS, min_budget=1, max_budget=32, safety=0)
    with pytest.raises(InvalidArgument):
        BudgetConfig((0.0,), min_budget=1, max_budget=32)


def test_a_full_worker_s_steps_are_predicted_where_it_runs() -> None:
    """A full worker decodes 15 or 16 sequences every step, and now and then prefills a
    prompt beside them: the fixed cost and the per-decoder cost are nearly collinear. Each
    step's time, as the fit predicts it before the step, is within a few ms of what it took
    (a plain least-squares solution with a negative per-decoder cost clamped to zero
    predicted 30 ms decode steps at ~67 ms), and no coefficient is negative."""
    rng = random.Random(3)
    b = StepBudget(BudgetConfig(TARGETS, min_budget=16, max_budget=2048))
    errors = []
    for i in range(3000):
        p, d = (rng.randint(800, 1400), 15) if rng.random() < 0.08 else (0, 16)
        context = d * rng.randint(1200, 1800) + p  # KV read, which the plane does not model
        ms = (10 + 0.06 * p + 1.0 * d + 0.0002 * context) * (1 + rng.uniform(-0.02, 0.02))
        if i >= 200 and (expected := b.expected_ms(p, d)) is not None:
            errors.append(abs(expected - ms))
        b.observe(p, d, ms)
        if (fit := b.cost()) is not None:
            assert min(fit) >= 0 and fit[1] > 0
    assert len(errors) > 2500
    assert max(errors) < 5.0, f"worst prediction {max(errors):.1f} ms off"


def test_the_fit_is_solved_once_between_two_steps_and_anew_after_each() -> None:
    """cost() keeps its answer until the next observation (a step asks up to three times),
    and an observation makes it solve again: the answer is always that of a fit fed the same
    steps from scratch."""
    rng = random.Random(5)
    cached = StepBudget(BudgetConfig(TARGETS, min_budget=16, max_budget=2048))
    solves = 0
    solve = cached._fit._solved

    def counted() -> tuple[float, float, float] | None:
        nonlocal solves
        solves += 1
        return solve()

    cached._fit._solved = counted  # type: ignore[method-assign]
    seen: list[tuple[int, int, float]] = []
    for i in range(40):
        p, d = rng.randint(0, 1500), rng.randint(0, 16)
        ms = 10 + 0.06 * p + 1.0 * d + rng.uniform(-0.5, 0.5)
        cached.observe(p, d, ms)
        seen.append((p, d, ms))
        fresh = StepBudget(BudgetConfig(TARGETS, min_budget=16, max_budget=2048))
        for step in seen:
            fresh.observe(*step)
        assert cached.cost() == fresh.cost() == cached.cost()
        assert cached.budget([0]) == fresh.budget([0])
        assert solves == i + 1  # once for the three asks since the last step


def test_a_step_whose_decoders_have_no_tpot_target_is_sized_without_solving_the_fit() -> None:
    """Without a TPOT target among the decoders (none decoding: an idle worker's first step,
    every first token's) the answer is the most allowed whatever the fit says: it is not
    solved for (up to four 3x3 solves, most of that step's CPU)."""
    budget = StepBudget(BudgetConfig((50.0, None), min_budget=8, max_budget=64))
    for p in (0, 100, 300, 50, 200):  # a fit that stands
        budget.observe(p, 4, 2.0 + 0.01 * p + 0.5 * 4)
    solves = []
    real = budget._fit._solved
    budget._fit._solved = lambda: solves.append(1) or real()  # type: ignore[method-assign]
    assert budget.size([], 64) == 64 and budget.size([1, 1], 200) == 200 and solves == []
    budget.size([0, 1], 64)  # a P0 decodes: its target sizes the step
    assert solves == [1]
