"""run_local: arrivals, priority admission, preemption with recompute-resume, finish reasons."""

from __future__ import annotations

import asyncio

import pytest
import torch

from limiter.errors import InvalidArgument
from tests.support.torch_device import DEVICE
from worker.batch_policy import Limits, StepPlan
from worker.engines.base import SamplingParams
from worker.engines.sim import SimEngine
from worker.engines.torch_engine import TorchEngine
from worker.local_run import LocalRequest, run_local
from worker.tokenizer import BOS_ID, EOS_ID

torch.set_num_threads(2)


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return (BOS_ID, *(32 + (i * 13 + salt) % 95 for i in range(n - 1)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_preempted_request_resumes_to_the_same_output(temperature: float) -> None:
    """One slot: a P0 arrival pauses the running P2 request, which later resumes (keeping its
    KV: only the slot was short) and must finish with exactly its solo output."""
    low = LocalRequest(
        "low", prompt(30, 1), SamplingParams(temperature, seed=5, max_tokens=120), class_rank=2
    )
    high = LocalRequest(
        "high", prompt(20, 2), SamplingParams(temperature, seed=6, max_tokens=5), class_rank=0, arrival_s=0.03
    )
    limits = Limits(token_budget=64, max_seqs=1)
    engine = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, dtype=torch.float32,
                                     kv_capacity_tokens=4096)
    solo = asyncio.run(run_local(engine, [low], limits)).traces["low"]
    run = asyncio.run(run_local(engine, [low, high], limits))
    lo, hi = run.traces["low"], run.traces["high"]
    assert lo.preemptions == 1 and hi.preemptions == 0
    assert lo.tokens == solo.tokens and lo.finish_reason == "length" and len(lo.tokens) == 120
    # the high-class request finished while the low one was paused
    assert hi.token_times[-1] < lo.token_times[-1]
    paused = [b - a for a, b in zip(lo.token_times, lo.token_times[1:], strict=False)]
    assert max(paused) >= hi.token_times[-1] - hi.token_times[0]


def test_arrivals_admission_order_and_step_records() -> None:
    engine = SimEngine(time_scale=0.01)
    reqs = [
        LocalRequest("b", prompt(100, 1), SamplingParams(max_tokens=3), class_rank=2, arrival_s=0.0),
        LocalRequest("a", prompt(100, 2), SamplingParams(max_tokens=3), class_rank=0, arrival_s=0.0),
        LocalRequest("late", prompt(10, 3), SamplingParams(max_tokens=2), class_rank=1, arrival_s=0.1),
    ]
    run = asyncio.run(run_local(engine, reqs, Limits(token_budget=128, max_seqs=1)))
    a, b, late = run.traces["a"], run.traces["b"], run.traces["late"]
    assert a.admitted_s is not None and b.admitted_s is not None and late.admitted_s is not None
    assert a.admitted_s <= b.admitted_s  # same arrival, higher class first
    assert late.admitted_s >= 0.1
    assert all(len(t.tokens) == len(t.token_times) for t in run.traces.values())
    assert run.generated_tokens == 8 and run.tokens_per_s > 0
    assert all(s.decode_seqs + s.prefill_tokens <= 128 for s in run.steps)
    assert a.text == "".join(chr(t) for t in a.tokens)


def test_eos_finishes_a_request() -> None:
    class EosSim(SimEngine):
        async def step(self, plan: StepPlan) -> dict[str, int]:
            out = await super().step(plan)
            return dict.fromkeys(out, EOS_ID)

    run = asyncio.run(
        run_local(
            EosSim(time_scale=0), [LocalRequest("x", prompt(5, 0), SamplingParams(max_tokens=50))], Limits()
        )
    )
    assert run.traces["x"].finish_reason == "stop" and run.traces["x"].tokens == [EOS_ID]


def test_duplicate_request_ids_are_rejected() -> None:
    r = LocalRequest("x", prompt(5, 0), SamplingParams())
    with pytest.raises(InvalidArgument):
        asyncio.run(run_local(SimEngine(time_scale=0), [r, r], Limits()))


def test_a_request_that_can_never_fit_is_an_error_not_a_hang() -> None:
    r = LocalRequest("huge", prompt(500, 0), SamplingParams())
    with pytest.raises(InvalidArgument, match="never fit"):
        asyncio.run(run_local(SimEngine(time_scale=0), [r], Limits(kv_capacity=100)))


def test_decode_growth_past_kv_capacity_pauses_the_lowest_class() -> None:
    """Two sequences whose decodes outgrow the KV capacity: the P2 one is paused, P0 runs on,
    and the paused one resumes and still produces its full, identical output."""
    reqs = [
        LocalRequest("p0", prompt(20, 1), SamplingParams(max_tokens=60), class_rank=0),
        LocalRequest("p2", prompt(20, 2), SamplingParams(max_tokens=60), class_rank=2),
    ]
    run = asyncio.run(run_local(SimEngine(time_scale=0), reqs, Limits(kv_capacity=120, max_seqs=2)))
    solo = asyncio.run(run_local(SimEngine(time_scale=0), reqs[1:], Limits(kv_capacity=120)))
    assert run.traces["p2"].preemptions >= 1 and run.traces["p0"].preemptions == 0
    assert run.traces["p2"].tokens == solo.traces["p2"].tokens and len(run.traces["p2"].tokens) == 60
