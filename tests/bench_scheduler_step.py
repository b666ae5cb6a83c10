"""The worker's scheduling CPU per step, measured: ``python tests/bench_scheduler_step.py``.

A :class:`BatchScheduler` over the sim engine at time scale 0 (a step costs no model time)
with ``--running`` sequences decoding (16-token prompts, three classes, four tenants, no
stop before ``--steps``): what a null-engine worker spends in Python per step, on top of
its Redis calls. The scheduler is built as the worker builds it by default (the adaptive
budget over the default classes' TPOT targets, ``top_prefill_tokens``); ``--fixed-budget``
leaves both out. Prints the best and every one of ``--rounds`` rounds. Not collected by
pytest (no ``test_`` prefix); docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter.config import DEFAULT_CLASSES
from worker.batch_policy import Limits
from worker.batch_scheduler import BatchScheduler
from worker.claim_step_loop import build_scheduler
from worker.engines.base import SamplingParams
from worker.engines.sim import SimEngine
from worker.settings import WorkerSettings

WARM_UP_STEPS = 50


def scheduler(running: int, fixed_budget: bool) -> BatchScheduler:
    """The scheduler a worker with the default settings builds (claim_step_loop.build_scheduler)."""
    limits = Limits(token_budget=512, max_seqs=max(64, running))
    plain = {"adaptive_budget": False, "top_prefill_tokens": 0} if fixed_budget else {}
    settings = WorkerSettings(**plain)
    return build_scheduler(SimEngine(time_scale=0), limits, settings, DEFAULT_CLASSES)


async def one_round(running: int, steps: int, fixed_budget: bool = False, output_tokens: int = 0) -> float:
    """Microseconds per step over ``steps`` steps with ``running`` sequences held. With
    ``output_tokens``, each ends after that many tokens and a new one takes its place (its
    prompt prefilled in the next step): the overhead bench's requests, one step's prefill in
    ``output_tokens`` for each sequence; without, they all decode throughout."""
    sched = scheduler(running, fixed_budget)
    made = 0

    def add() -> None:
        nonlocal made
        params = SamplingParams(max_tokens=output_tokens or 10 * (steps + WARM_UP_STEPS), seed=made)
        sched.add(f"r{made}", list(range(1, 17)), params, class_rank=made % 3, arrival=made,
                  tenant=f"t{made % 4}")
        made += 1

    async def step() -> None:
        res = await sched.step()
        for em in res.emissions.values():
            if em.finish_reason is not None:
                add()

    for _ in range(running):
        add()
    for _ in range(WARM_UP_STEPS):
        await step()
    t0 = time.perf_counter()
    for _ in range(steps):
        await step()
    took = time.perf_counter() - t0
    if len(sched) != running:
        raise SystemExit(f"{running - len(sched)} sequences finished early: the figure would mix batch sizes")
    return took / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=32, help="sequences decoding (default 32)")
    ap.add_argument("--steps", type=int, default=2000, help="steps timed per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5; the best is the figure)")
    ap.add_argument("--output-tokens", type=int, default=0,
                    help="each sequence ends after this many tokens and a new one replaces it "
                         "(default 0: none ends)")
    ap.add_argument("--fixed-budget", action="store_true",
                    help="no adaptive budget and no top-class prefill beyond it "
                         "(the worker's defaults have both)")
    a = ap.parse_args()
    for name in ("running", "steps", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.output_tokens < 0:
        ap.error("--output-tokens must be >= 0")
    us = [asyncio.run(one_round(a.running, a.steps, a.fixed_budget, a.output_tokens))
          for _ in range(a.rounds)]
    budget = "a fixed budget" if a.fixed_budget else "the adaptive budget"
    ending = f", each replaced after {a.output_tokens} tokens" if a.output_tokens else " decoding"
    print(f"scheduler step, {a.running} sequences{ending}, {budget}: best {min(us):.1f} us "
          f"(rounds: {', '.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    main()
