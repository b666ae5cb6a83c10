"""The pool's capacity for the trace's request mix, so that ``--load X`` means X x capacity.

**Cost weights.** The buckets charge ``prompt x weight + output x out_weight``. A prompt
token and an output token cost a GPU very different amounts (the sim engine: ~60 us of a
prefill step against ~1 ms of a decode slot plus its share of the step), so with both
weights at 1 a bucket "full" of P0 chat tokens and one full of P2 document tokens stand for
very different GPU time, and no capacity in tokens/s holds for both. The benchmark profiles
the engine (:func:`profile_weight`): a full decode step (``max_seqs`` sequences) and a
full prefill step (``token_budget`` prompt tokens), both at the mix's mean prompt length of
context; an output token costs ``out_weight`` = (decode step / max_seqs) / (prefill step /
token_budget) prompt tokens -- what an operator would configure from a profile of the
model. All three modes get the same weights (fifo and priority have no limits, so only qos
is affected).

**Capacity.** A sample of the run's requests, all queued at once, is served by the
worker's own scheduler (:class:`worker.batch_scheduler.BatchScheduler`, the code the Redis
worker runs) on the engine; capacity = weighted tokens processed / time of those steps,
counted while the queue was non-empty (the draining tail, a half-empty batch, would
understate it).

* ``sim``: time is the cost model's (``engine.last_step_cost_s`` x ``time_scale``), so the
  figure is exact for the modelled GPU and costs seconds of CPU, not minutes.
* ``torch``: real steps on this CPU with the worker's settings; the benchmark's workers run
  the same steps, plus Redis and streaming, on a shared machine.

Capacity is measured with chunked prefill on (the priority and qos workers); fifo's workers
prefill whole prompts, a little cheaper in total, so at ``--load 1.0`` fifo runs just below
saturation. The result is per worker; the pool's capacity is that times the worker count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from limiter.bench.trace import Arrival
from worker.batch_policy import Limits, PrefillChunk, StepPlan
from worker.batch_scheduler import BatchScheduler
from worker.engines.base import Engine, SamplingParams


@dataclass(frozen=True)
class Capacity:
    """Saturated throughput of one worker on the mix (weighted tokens/s), and of the pool."""

    engine: str
    workers: int
    sample_requests: int
    out_weight: float  # an output token costs this many prompt tokens
    weighted_tokens_s_per_worker: float  # prompt + output x out_weight, per second, saturated
    mean_weighted_tokens: float  # per request of the mix
    source: str  # 'cost model' | 'measured on this CPU' | 'given'

    @property
    def weighted_tokens_s(self) -> float:
        return self.weighted_tokens_s_per_worker * self.workers

    @property
    def requests_s(self) -> float:
        return self.weighted_tokens_s / self.mean_weighted_tokens

    def cost(self, a: Arrival) -> float:
        return a.prompt_tokens + a.max_tokens * self.out_weight

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"weighted_tokens_s": self.weighted_tokens_s, "requests_s": self.requests_s}


@dataclass(frozen=True)
class StepSample:
    prefill_tokens: int
    decode_tokens: int
    seconds: float


async def _timed(engine: Engine, plan: StepPlan, modelled: bool, time_scale: float) -> float:
    t = time.perf_counter()
    await engine.step(plan)
    if modelled:
        return engine.last_step_cost_s * time_scale  # type: ignore[attr-defined]
    return time.perf_counter() - t


async def _prefill(engine: Engine, seq_id: str, prompt: int, upto: int, chunk: int) -> None:
    """Add a ``prompt``-token sequence and prefill its first ``upto`` tokens, untimed."""
    engine.add(seq_id, [1] * prompt, SamplingParams(max_tokens=1 << 20, seed=1))
    for start in range(0, upto, chunk):
        await engine.step(StepPlan((), (PrefillChunk(seq_id, start, min(chunk, upto - start)),)))


async def profile_weight(engine: Engine, limits: Limits, context: int, modelled: bool,
                         time_scale: float = 1.0, repeats: int = 5) -> tuple[float, float, float]:
    """(seconds per output token in a full decode step, seconds per prompt token in a full
    prefill step, their ratio = out_weight), both at ``context`` tokens of context: the
    profile an operator takes of a model before writing its cost weights."""
    chunk = limits.token_budget
    ids = [f"d{i}" for i in range(limits.max_seqs)]
    for sid in ids:
        await _prefill(engine, sid, context, context, chunk)
    plan = StepPlan(tuple(ids), ())
    dec = sorted([await _timed(engine, plan, modelled, time_scale) for _ in range(repeats)])
    for sid in ids:
        engine.remove(sid)
    pre = []
    for i in range(repeats):
        sid = f"p{i}"
        await _prefill(engine, sid, context + chunk, context, chunk)
        plan = StepPlan((), (PrefillChunk(sid, context, chunk),))
        pre.append(await _timed(engine, plan, modelled, time_scale))
        engine.remove(sid)
    per_out = dec[len(dec) // 2] / len(ids)
    per_in = sorted(pre)[len(pre) // 2] / chunk
    return per_out, per_in, per_out / per_in


async def saturated_steps(engine: Engine, limits: Limits, sample: Sequence[Arrival], modelled: bool,
                          time_scale: float = 1.0) -> list[StepSample]:
    """The steps one engine runs with ``sample`` all queued at t=0, while some still wait."""
    sched = BatchScheduler(engine, limits)
    for a in sample:
        ids = [1] * a.prompt_tokens  # token values do not matter to the cost
        sched.add(f"c{a.index}", ids, SamplingParams(max_tokens=a.max_tokens, seed=a.index),
                  class_rank=0, arrival=float(a.index))
    steps = []
    while len(sched) and sched.waiting:
        res = await sched.step()
        seconds = res.duration_s
        if modelled:
            seconds = engine.last_step_cost_s * time_scale  # type: ignore[attr-defined]
        steps.append(StepSample(res.plan.prefill_tokens, len(res.plan.decode), seconds))
    return steps


def _engine(engine_name: str, torch_threads: int) -> Engine:
    if engine_name == "sim":
        from worker.engines.sim import SimEngine

        return SimEngine(time_scale=0.0)
    import torch

    from worker.engines.torch_engine import TorchEngine

    torch.set_num_threads(torch_threads)
    return TorchEngine.from_preset("tiny", seed=0, device="cpu")


async def measure_capacity(engine_name: str, sample: Sequence[Arrival], *, workers: int, token_budget: int,
                           max_seqs: int, time_scale: float = 1.0, torch_threads: int = 1) -> Capacity:
    """Cost weights and capacity of ``workers`` workers of ``engine_name`` for ``sample``'s mix."""
    engine = _engine(engine_name, torch_threads)
    limits = Limits(token_budget=token_budget, max_seqs=max_seqs, kv_capacity=engine.kv_capacity_tokens)
    steps = await saturated_steps(engine, limits, sample, modelled=engine_name == "sim",
                                  time_scale=time_scale)
    context = int(sum(x.prompt_tokens for x in sample) / max(1, len(sample)))
    _, _, ratio = await profile_weight(engine, limits, context, modelled=engine_name == "sim",
                                       time_scale=time_scale)
    out_weight = round(ratio, 1)
    seconds = sum(s.seconds for s in steps)
    work = sum(s.prefill_tokens + s.decode_tokens * out_weight for s in steps)
    mean = sum(x.prompt_tokens + x.max_tokens * out_weight for x in sample) / max(1, len(sample))
    return Capacity(engine_name, workers, len(sample), out_weight, work / seconds, mean,
                    "cost model" if engine_name == "sim" else "measured on this CPU")
