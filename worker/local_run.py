"""An in-process driver: engine + batch builder over a list of timed requests, no Redis.

The in-process twin of :mod:`worker.claim_step_loop`: both drive the same
:class:`~worker.batch_scheduler.BatchScheduler` (which applies :mod:`worker.batch_policy`).

:func:`run_local` is the worker's scheduling loop with the network taken out: requests
arrive at given offsets, are admitted, preempted and resumed by the pure policy of
:mod:`worker.batch_policy`, and every engine step really runs. It records, per request, the
wall-clock time each token came out of the engine (step end: when a worker would stream
it) and, per step, what ran and how long it took. Tests use it to show the long-prefill
decode stall and its cure with real compute; benchmarks use it for throughput and TPOT.

The timestamps are honest: they are ``time.perf_counter()`` readings around the awaited
``engine.step`` calls, with no modelled or adjusted time.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from limiter.errors import InvalidArgument
from worker.batch_policy import Limits
from worker.batch_scheduler import BatchScheduler
from worker.engines.base import Engine, SamplingParams


@dataclass(frozen=True)
class LocalRequest:
    """A request for :func:`run_local`: arrives ``arrival_s`` after the run starts."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    class_rank: int = 1
    arrival_s: float = 0.0


@dataclass
class RequestTrace:
    """What happened to one request; times are seconds since the run started."""

    request_id: str
    class_rank: int
    arrival_s: float
    prompt_tokens: int
    admitted_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    preemptions: int = 0
    finish_reason: str | None = None  # 'stop' (EOS, stop string) or 'length' (max_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token gaps (the per-token TPOT samples)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def max_gap_s(self) -> float:
        return max(self.gaps_s, default=0.0)

    @property
    def median_gap_s(self) -> float:
        gaps = self.gaps_s
        return statistics.median(gaps) if gaps else 0.0


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when it started (since run start), how long, and what it ran."""

    start_s: float
    duration_s: float
    decode_seqs: int
    prefill_tokens: int


@dataclass
class LocalRun:
    traces: dict[str, RequestTrace]
    steps: list[StepRecord]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.traces.values())

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (prefill work not counted as output)."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


async def run_local(engine: Engine, requests: Sequence[LocalRequest], limits: Limits) -> LocalRun:
    """Serve ``requests`` on ``engine`` under ``limits``; return per-request traces and steps.

    Arrivals are added to a :class:`~worker.batch_scheduler.BatchScheduler` when their time comes;
    each :meth:`~worker.batch_scheduler.BatchScheduler.step` preempts, admits, runs one planned
    step and books its tokens (finish on EOS, ``max_tokens`` or a stop string) - the same
    state machine the Redis worker drives, with the network taken out.
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("requests", "request ids must be unique")
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    sched = BatchScheduler(engine, limits)
    traces: dict[str, RequestTrace] = {}
    steps: list[StepRecord] = []
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    while pending or len(sched):
        while pending and pending[0].arrival_s <= now():
            r = pending.pop(0)
            traces[r.request_id] = RequestTrace(r.request_id, r.class_rank, r.arrival_s, len(r.prompt_ids))
            sched.add(r.request_id, r.prompt_ids, r.params, class_rank=r.class_rank, arrival=r.arrival_s)
        if not len(sched):
            await asyncio.sleep(max(0.0, pending[0].arrival_s - now()))
            continue

        res = await sched.step()
        start, end = res.start - t0, res.end - t0
        steps.append(StepRecord(start, end - start, len(res.plan.decode), res.plan.prefill_tokens))
        for rid in res.preempted:
            traces[rid].preemptions += 1
        for rid in res.admitted:
            if traces[rid].admitted_s is None:
                traces[rid].admitted_s = start
        for rid, token in res.produced.items():
            traces[rid].tokens.append(token)
            traces[rid].token_times.append(end)
        for rid, em in res.emissions.items():
            traces[rid].text += em.text
            if em.finish_reason is not None:
                traces[rid].finish_reason = em.finish_reason
    return LocalRun(traces, steps, now())
