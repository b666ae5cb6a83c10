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


def run(cap: SaturatedCapacity, meter: BusyMeter | None, decoders: tuple[int, int], steps: int,
        rng: random.Random, t: float, target_ms: float | None = None) -> float:
    """``steps`` steps of the sim's cost with ``decoders`` (low, high) sequences decoding and
    a prefill chunk of random size, ``RHO`` prompt tokens per output token on average (what
    any steady workload of the mix processes, however full its batches); a request of the
    mix starts every few steps."""
    for i in range(steps):
        d = rng.randint(*decoders)
        p = rng.randint(0, 2 * RHO * d)
        ms = COST.cost(p, d, context_tokens=d * 700) * 1e3
        start, end = t + GAP_S, t + GAP_S + ms / 1e3
        cap.step(start, end, p, d, target_ms, prefill_work=p * W_IN, outputs=d, output_work=d * W_OUT)
        if meter is not None:
            meter.step(start, end, full=True, work=p * W_IN + d * W_OUT)
        if i % 4 == 0:
            cap.started(PROMPT + 256)
        t = end
    return t


def test_the_figure_does_not_move_with_batch_fill_while_a_full_steps_rate_does() -> None:
    rng = random.Random(7)
    cap, meter = SaturatedCapacity(LIMITS), BusyMeter()
    t = run(cap, meter, (2, 5), 1500, rng, 0.0)
    light, light_measured = cap.value(), meter.take()
    run(cap, meter, (12, 16), 1500, rng, t)
    heavy, heavy_measured = cap.value(), meter.take()
    assert light > 0 and heavy > 0
    # the old figure (full steps' rate) moves with the batch: the reason for this module
    assert heavy_measured / light_measured > 1.15, (light_measured, heavy_measured)
    assert heavy / light == pytest.approx(1.0, abs=0.03), (light, heavy)


def saturated_rate(target_ms: float | None) -> float:
    """Weighted tokens/s of the sim when saturated with this mix: D decoders and RHO D prompt
    tokens per step, D as large as the limits allow (found by search, not by the formula)."""
    best = 0.0
    for d in range(1, LIMITS.max_seqs + 1):
        p = RHO * d
        if p + d > LIMITS.max_budget:
            break
        ms = COST.cost(p, d, context_tokens=d * 700) * 1e3
        if target_ms is not None and ms > target_ms and d > LIMITS.max_seqs / 5:
            break
        best = max(best, (p * W_IN + d * W_OUT) / (ms + GAP_S * 1e3) * 1e3)
    return best


@pytest.mark.parametrize("target_ms", [None, 30.0])
def test_the_figure_is_what_a_saturated_worker_delivers(target_ms: float | None) -> None:
    rng = random.Random(3)
    cap = SaturatedCapacity(LIMITS)
    run(cap, None, (1, 16), 2000, rng, 0.0, target_ms)
    assert cap.value() == pytest.approx(saturated_rate(target_ms), rel=0.05)


def test_a_tighter_target_gives_a_smaller_figure_and_the_share_of_targeted_steps_mixes_them() -> None:
    values = {}
    for name, target in (("none", None), ("tight", 25.0)):
        cap = SaturatedCapacity(LIMITS)
        run(cap, None, (1, 16), 1500, random.Random(5), 0.0, target)
        values[name] = cap.value()
    assert values["tight"] < 0.8 * values["none"]
    mixed = SaturatedCapacity(LIMITS)
    rng = random.Random(5)
    t = 0.0
    for _ in range(750):  # every other step had a P0 stream decoding
        t = run(mixed, None, (1, 16), 1, rng, t, 25.0)
        t = run(mixed, None, (1, 16), 1, rng, t, None)
    assert values["tight"] < mixed.value() < values["none"]


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
        cap.step(i * 0.1, i * 0.1 + 0.05, 256, 4, None, prefill_work=256.0, outputs=4, output_work=80.0)
    cap.started(PROMPT + 256)
    cap.started(PROMPT + 256)
    cap.started(PROMPT + 256)
    assert cap.value() == 0.0
    prefill_only = SaturatedCapacity(LIMITS)  # a fit, but no output yet: no mix
    for i in range(50):
        p = 100 + 10 * i
        prefill_only.step(i * 0.1, i * 0.1 + COST.cost(p, 0, p), p, 0, None, prefill_work=float(p), outputs=0,
                          output_work=0.0)
        prefill_only.started(PROMPT + 256)
    assert prefill_only.value() == 0.0
    run(cap, None, (1, 8), 100, random.Random(2), 10.0)
    assert cap.value() > 0


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="max_seqs"):
        StepLimits(max_seqs=0, max_budget=512, kv_tokens=100)
