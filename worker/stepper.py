"""An in-process driver: engine + batch builder over a list of timed requests, no Redis.

:func:`run_local` is the worker's scheduling loop with the network taken out: requests
arrive at given offsets, are admitted, preempted and resumed by the pure policy of
:mod:`worker.batching`, and every engine step really runs. It records, per request, the
wall-clock time each token came out of the engine (step end: when a worker would stream
it) and, per step, what ran and how long it took. Tests use it to show the seed's decode
stall and its cure with real compute; benchmarks use it for throughput and TPOT.

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
from worker.batching import Candidate, Limits, SeqState, build_plan, choose_admissions, choose_preemption
from worker.engines.base import Engine, SamplingParams
from worker.tokenizer import IncrementalDecoder


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
    finish_reason: str | None = None  # 'stop' (EOS) or 'length' (max_tokens)

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


@dataclass
class _Live:
    """Loop-side state of one admitted or waiting request."""

    req: LocalRequest
    trace: RequestTrace
    decoder: IncrementalDecoder
    generated: list[int] = field(default_factory=list)
    kv_tokens: int = 0
    to_prefill: int = 0

    @property
    def context(self) -> list[int]:
        return [*self.req.prompt_ids, *self.generated]

    def state(self) -> SeqState:
        return SeqState(
            request_id=self.req.request_id,
            class_rank=self.req.class_rank,
            arrival=self.req.arrival_s,
            to_prefill=self.to_prefill,
            decoding=self.to_prefill == 0,
            kv_tokens=self.kv_tokens,
        )

    def candidate(self) -> Candidate:
        return Candidate(self.req.request_id, self.req.class_rank, self.req.arrival_s, len(self.context))


async def run_local(engine: Engine, requests: Sequence[LocalRequest], limits: Limits) -> LocalRun:
    """Serve ``requests`` on ``engine`` under ``limits``; return per-request traces and steps.

    Each iteration: take arrivals, pause sequences :func:`choose_preemption` picks (their
    KV is freed; they re-prefill prompt + generated tokens when readmitted), admit what
    :func:`choose_admissions` allows, run one :func:`build_plan` step, record its tokens.
    A sequence finishes on the engine's EOS or at ``max_tokens``.
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("requests", "request ids must be unique")
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    waiting: dict[str, _Live] = {}
    running: dict[str, _Live] = {}
    traces: dict[str, RequestTrace] = {}
    steps: list[StepRecord] = []
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    while pending or waiting or running:
        while pending and pending[0].arrival_s <= now():
            r = pending.pop(0)
            trace = RequestTrace(r.request_id, r.class_rank, r.arrival_s, len(r.prompt_ids))
            traces[r.request_id] = trace
            waiting[r.request_id] = _Live(r, trace, engine.new_decoder())
        if not waiting and not running:
            await asyncio.sleep(max(0.0, pending[0].arrival_s - now()))
            continue

        while (
            victim := choose_preemption(
                [x.state() for x in running.values()], [x.candidate() for x in waiting.values()], limits
            )
        ) is not None:
            live = running.pop(victim)
            engine.remove(victim)
            live.kv_tokens, live.to_prefill = 0, 0
            live.trace.preemptions += 1
            waiting[victim] = live

        admit = choose_admissions(
            [x.candidate() for x in waiting.values()], [x.state() for x in running.values()], limits
        )
        if not admit and not running:
            head = min(waiting.values(), key=lambda x: x.candidate().priority)
            raise InvalidArgument(
                "requests", f"{head.req.request_id}: {len(head.context)} tokens can never fit under {limits}"
            )
        for rid in admit:
            live = waiting.pop(rid)
            engine.add(rid, live.context, live.req.params)
            live.kv_tokens, live.to_prefill = 0, len(live.context)
            if live.trace.admitted_s is None:
                live.trace.admitted_s = now()
            running[rid] = live

        plan = build_plan([x.state() for x in running.values()], limits)
        if plan.empty:  # cannot happen: admission and preemption keep KV demand within capacity
            raise RuntimeError(f"no progress possible under {limits} with {len(running)} running")

        start = now()
        produced = await engine.step(plan)
        end = now()
        steps.append(StepRecord(start, end - start, len(plan.decode), plan.prefill_tokens))

        for rid in plan.decode:
            running[rid].kv_tokens += 1
        for chunk in plan.prefill:
            live = running[chunk.request_id]
            live.kv_tokens += chunk.length
            live.to_prefill -= chunk.length
        for rid, token in produced.items():
            live = running[rid]
            live.generated.append(token)
            live.trace.tokens.append(token)
            live.trace.token_times.append(end)
            live.trace.text += live.decoder.feed([token])
            reason = None
            if engine.eos_id is not None and token == engine.eos_id:
                reason = "stop"
            elif len(live.generated) >= live.req.params.max_tokens:
                reason = "length"
            if reason is not None:
                live.trace.finish_reason = reason
                live.trace.text += live.decoder.flush()
                engine.remove(rid)
                del running[rid]
    return LocalRun(traces, steps, now())
