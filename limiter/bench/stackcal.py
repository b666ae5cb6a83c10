"""Capacity of the stack itself: what ``--load 1.0`` is relative to.

:func:`limiter.bench.calibrate.measure_capacity` gives the engine's capacity: steps back to
back, nothing else. A worker also waits for Redis between steps (claims, token pushes,
completions), shares the CPU with the frontend, Redis and the client, and refills a slot
only when the next request has been claimed; on this benchmark's 2-core machine that costs
a quarter or more of the engine figure. A load "relative to capacity" relative to the
engine alone would overload the stack at 1.0x and make "work-conserving at 1.0x"
meaningless, so by default (``calibrate="stack"``) the capacity is measured on the stack:

1. a stack like fifo's but with chunked prefill (one class, no limits -- plain FIFO over
   the mix; the priority and qos workers prefill in chunks too) and the run's workers;
2. the first ``n`` requests of the workload, ``n`` enough for 1.5x the engine capacity
   over the calibration, all sent at t=0, so the queue never empties;
3. capacity = the weighted tokens (usage: prompt + output x ``out_weight``) of the requests
   that *completed* between ``warm_s`` and ``warm_s + window_s``, over ``window_s`` -- in a
   steady state the departures carry work at the service rate (what was in flight at
   either end of the window roughly cancels); then every open request is cancelled.

``calibrate="engine"`` keeps the engine figure (faster; the tests use it), and
``capacity_rps`` gives the capacity outright (an existing stack at ``--url``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from limiter.bench.calibrate import Capacity, measure_capacity
from limiter.bench.driver import drive
from limiter.bench.modes import POOL, mode_spec
from limiter.bench.stack import StackSpec, start_stack
from limiter.bench.trace import Arrival

CALIBRATION_SAMPLE = {"sim": 300, "torch": 40}  # requests behind the engine profile
WARM_S, WINDOW_S = 5.0, 25.0


async def stack_capacity(engine: Capacity, arrivals: Sequence[Arrival], sspec: StackSpec,
                         context_tokens: int, work_dir: Path, warm_s: float = WARM_S,
                         window_s: float = WINDOW_S) -> Capacity:
    """Measure the stack's capacity (module docstring); ``engine`` sizes the sample."""
    base = mode_spec("fifo", capacity_tokens_s=1e12, context_tokens=context_tokens,
                     out_weight=engine.out_weight)
    spec = dataclasses.replace(base, name="calibration", chunked_prefill=True)
    n = min(len(arrivals), max(8, math.ceil(1.5 * engine.requests_s * (warm_s + window_s))))
    burst = [dataclasses.replace(a, at_s=0.0) for a in arrivals[:n]]
    stack = await start_stack(sspec, spec, work_dir)
    try:
        t0 = time.monotonic()
        recs = await drive(stack.base_url, POOL, burst, duration_s=warm_s + window_s, drain_s=0.0, t0=t0)
    finally:
        await asyncio.to_thread(stack.stop, 10.0)
    work = 0.0
    for rec in recs:
        res = rec.result
        done_s = res.sent_s - t0 + (res.e2e_ms or 0) / 1000
        if res.ok and warm_s <= done_s <= warm_s + window_s:
            work += res.input_tokens + res.output_tokens * engine.out_weight
    per_worker = work / window_s / sspec.workers
    if per_worker <= 0:
        raise RuntimeError(f"the calibration stack served nothing in {window_s:g} s; see {work_dir}/logs")
    return dataclasses.replace(engine, weighted_tokens_s_per_worker=per_worker, sample_requests=n,
                               source=f"measured on the stack ({window_s:g} s, FIFO, chunked prefill)")


async def calibrate(engine_name: str, arrivals: Sequence[Arrival], sspec: StackSpec, *, how: str,
                    context_tokens: int, work_dir: Path, capacity_rps: float | None = None
                    ) -> tuple[Capacity, dict[str, Any]]:
    """Cost weights and capacity; returns (capacity, the engine figure for the record)."""
    n = CALIBRATION_SAMPLE[engine_name] // (4 if capacity_rps else 1)
    engine = await measure_capacity(engine_name, arrivals[:n], workers=sspec.workers,
                                    token_budget=sspec.token_budget, max_seqs=sspec.max_seqs,
                                    time_scale=sspec.time_scale, torch_threads=sspec.torch_threads)
    record = {"engine_weighted_tokens_s": engine.weighted_tokens_s, "engine_requests_s": engine.requests_s}
    if capacity_rps:
        mean = sum(engine.cost(a) for a in arrivals[:500]) / max(1, len(arrivals[:500]))
        given = dataclasses.replace(engine, weighted_tokens_s_per_worker=capacity_rps * mean / sspec.workers,
                                    mean_weighted_tokens=mean, source="given (--capacity-rps)")
        return given, record
    if how == "engine":
        return engine, record
    cap = await stack_capacity(engine, arrivals, sspec, context_tokens, work_dir / "calibration")
    record["stack_over_engine"] = round(cap.weighted_tokens_s / engine.weighted_tokens_s, 3)
    return cap, record


async def calibrate_and_report(title: str, engine_name: str, arrivals: Sequence[Arrival], sspec: StackSpec, *,
                               how: str, context_tokens: int, work_dir: Path, results: dict[str, Any],
                               console: Console, detail: str, source: bool = False) -> Capacity:
    """:func:`calibrate`, the capacity recorded in ``results["params"]``, and the run's header
    line printed (``qos bench <title>: engine, workers, capacity[ (source)]<detail>``)."""
    cap, engine_fig = await calibrate(engine_name, arrivals, sspec, how=how, context_tokens=context_tokens,
                                      work_dir=work_dir)
    results["params"]["capacity"] = cap.to_dict() | engine_fig
    shown = f" ({cap.source})" if source else ""
    console.print(f"[bold]qos bench {title}[/]: engine {engine_name}, {sspec.workers} workers, capacity "
                  f"{cap.weighted_tokens_s:,.0f} weighted tokens/s{shown}{detail}")
    return cap
