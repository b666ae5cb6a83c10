"""worker/saturated_capacity.py: the heartbeat's capacity figure holds still while the
device and the mix do, however full the batches are, and equals what a saturated worker
delivers."""

from __future__ import annotations

import random

import pytest

from limiter.errors import InvalidArgument
from worker.busy_meter import BusyMeter
from worker.engines.sim import CostModel
from worker.saturated_capacity import SaturatedCapacity, StepLimits

COST = CostModel()  # the sim engine's: 10 ms + 60 us/prompt token + 1 ms/decoder (+ context)
W_IN, W_OUT = 1.0, 20.0
PROMPT, RHO = 600, 4  # the mix: 600-token prompts, 4 prompt tokens per output token
LIMITS = StepLimits(max_seqs=32, max_budget=512, kv_tokens=1 << 20)
GAP_S = 0.002  # Redis work between steps
TARGETS = (25.0, None)  # rank 0 aims its steps at 25 ms; rank 1 has no TPOT target
TIGHT, LOOSE = 0, 1


def run(cap: SaturatedCapacity, meter: BusyMeter | None, decoders: tuple[int, int], steps: int,
        rng: random.Random, t: float, *, tight_share: float = 0.0, idle_every: int = 0,
        recompute: int = 0) -> float:
    """``steps`` steps of the sim's cost with ``decoders`` (low, high) sequences decoding, each
    of the tight class with probability ``tight_share``, and a prefill chunk of random size,
    ``RHO`` prompt tokens per output token on average (what any steady workload of the mix
    processes, however full its batches); a request of the mix starts every few steps. Every
    ``idle_every``-th step follows a 0.4 s idle wait; each step also re-prefills ``recompute``
    tokens of preempted work."""
    for i in range(steps):
        d = rng.randint(*decoders)
        ranks = [TIGHT if rng.random() < tight_share else LOOSE for _ in range(d)]
        p = rng.randint(0, 2 * RHO * d)
        ms = COST.cost(p + recompute, d, context_tokens=d * 700) * 1e3
        idle = bool(idle_every) and i % idle_every == 0
        start = t + (0.4 if idle else GAP_S)
        end = start + ms / 1e3
        cap.step(start, end, p + recompute, ranks, busy_before=not idle, fresh_prefill_work=p * W_IN,
                 outputs=d, output_work=d * W_OUT)
        if meter is not None:
            meter.step(start, end, full=True, work=p * W_IN + d * W_OUT)
        if i % 4 == 0:
            cap.started(PROMPT + 256)
        t = end
    return t


def test_the_figure_does_not_move_with_batch_fill_while_a_full_steps_rate_does() -> None:
    rng = random.Random(7)
    cap, meter = SaturatedCapacity(LIMITS, TARGETS), BusyMeter()
    t = run(cap, meter, (2, 5), 1500, rng, 0.0)
    light, light_measured = cap.value(), meter.take()
    run(cap, meter, (12, 16), 1500, rng, t)
    heavy, heavy_measured = cap.value(), meter.take()
    assert light > 0 and heavy > 0
    # the old figure (full steps' rate) moves with the batch: the reason for this module
    assert heavy_measured / light_measured > 1.15, (light_measured, heavy_measured)
    assert heavy / light == pytest.approx(1.0, abs=0.03), (light, heavy)


def test_nor_with_how_often_a_small_batch_holds_a_class_with_a_target() -> None:
    """10 % of the decoders are of a class with a TPOT target: a batch of 2-5 holds one in
    ~30 % of its steps, a batch of 12-16 in ~75 %. The figure follows the share of *slots*,
    not of steps, so it does not move."""
    rng = random.Random(11)
    cap = SaturatedCapacity(LIMITS, TARGETS)
    t = run(cap, None, (2, 5), 1500, rng, 0.0, tight_share=0.1)
    light = cap.value()
    run(cap, None, (12, 16), 1500, rng, t, tight_share=0.1)
    assert cap.value() / light == pytest.approx(1.0, abs=0.03), (light, cap.value())


def saturated_rate(target_ms: float | None) -> float:
    """Weighted tokens/s of the sim when saturated with this mix: D decoders and RHO D prompt
    tokens per step, D as large as the limits allow (found by search, not by the formula)."""
    best = 0.0
    for d in range(1, LIMITS.max_seqs + 1):
        p = RHO * d
        if p + d > LIMITS.max_budget:
            break
        ms = COST.cost(p, d, context_tokens=d * 700) * 1e3
        if target_ms is not None and ms > target_ms and d > LIMITS.max_seqs / (1 + RHO):
            break
        best = max(best, (p * W_IN + d * W_OUT) / (ms + GAP_S * 1e3) * 1e3)
    return best


@pytest.mark.parametrize("tight_share", [0.0, 1.0])
def test_the_figure_is_what_a_saturated_worker_delivers(tight_share: float) -> None:
    cap = SaturatedCapacity(LIMITS, TARGETS)
    run(cap, None, (1, 16), 2000, random.Random(3), 0.0, tight_share=tight_share)
    assert cap.value() == pytest.approx(saturated_rate(TARGETS[0] if tight_share else None), rel=0.05)


def test_a_class_with_a_target_in_some_batches_gives_a_figure_between() -> None:
    values = {}
    for share in (0.0, 0.02, 1.0):
        cap = SaturatedCapacity(LIMITS, TARGETS)
        run(cap, None, (1, 16), 1500, random.Random(5), 0.0, tight_share=share)
        values[share] = cap.value()
    assert values[1.0] < 0.8 * values[0.0]
    assert values[1.0] < values[0.02] < values[0.0]


def test_idle_waits_are_not_overhead_and_recomputed_prompts_are_not_work() -> None:
    base = SaturatedCapacity(LIMITS, TARGETS)
    run(base, None, (1, 16), 1500, random.Random(9), 0.0)
    idle = SaturatedCapacity(LIMITS, TARGETS)  # every 30th step after a 0.4 s wait for work
    run(idle, None, (1, 16), 1500, random.Random(9), 0.0, idle_every=30)
    assert idle.value() == pytest.approx(base.value(), rel=0.01)
    recomputing = SaturatedCapacity(LIMITS, TARGETS)  # 40 tokens a step prefilled again
    run(recomputing, None, (1, 16), 1500, random.Random(9), 0.0, recompute=40)
    assert recomputing.value() < 0.97 * base.value()


def test_kv_room_bounds_the_batch() -> None:
    small = StepLimits(max_seqs=32, max_budget=512, kv_tokens=4 * (PROMPT + 256))  # room for 4 requests
    roomy, tight = SaturatedCapacity(LIMITS), SaturatedCapacity(small)
    for cap in (roomy, tight):
        run(cap, None, (1, 4), 1000, random.Random(1), 0.0)
    assert tight.value() < 0.6 * roomy.value()


def test_nothing_is_claimed_before_the_fit_and_the_mix_are_known() -> None:
    cap = SaturatedCapacity(LIMITS)
    assert cap.value() == 0.0
    for i in range(50):  # steps of one prefill size: the fit cannot separate fixed from per-token
        cap.step(i * 0.1, i * 0.1 + 0.05, 256, [LOOSE] * 4, busy_before=True, fresh_prefill_work=256.0,
                 outputs=4, output_work=80.0)
    for _ in range(3):
        cap.started(PROMPT + 256)
    assert cap.value() == 0.0
    prefill_only = SaturatedCapacity(LIMITS)  # a fit, but no output yet: no mix
    for i in range(50):
        p = 100 + 10 * i
        prefill_only.step(i * 0.1, i * 0.1 + COST.cost(p, 0, p), p, [], busy_before=True,
                          fresh_prefill_work=float(p), outputs=0, output_work=0.0)
        prefill_only.started(PROMPT + 256)
    assert prefill_only.value() == 0.0
    run(cap, None, (1, 8), 100, random.Random(2), 10.0)
    assert cap.value() > 0


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="max_seqs"):
        StepLimits(max_seqs=0, max_budget=512, kv_tokens=100)
