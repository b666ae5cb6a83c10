"""The worker's scheduling CPU per step, measured: ``python tests/bench_scheduler_step.py``.

A :class:`BatchScheduler` over the sim engine at time scale 0 (a step costs no model time)
with ``--running`` sequences decoding (16-token prompts, three classes, four tenants, no
stop before ``--steps``): what a null-engine worker spends in Python per step, on top of
its Redis calls. Prints the best and every one of ``--rounds`` rounds. Not collected by
pytest (no ``test_`` prefix); docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.batch_policy import Limits
from worker.batch_scheduler import BatchScheduler
from worker.engines.base import SamplingParams
from worker.engines.sim import SimEngine

WARM_UP_STEPS = 50


async def one_round(running: int, steps: int) -> float:
    """Microseconds per step over ``steps`` steps with ``running`` sequences decoding."""
    sched = BatchScheduler(SimEngine(time_scale=0), Limits(token_budget=512, max_seqs=max(64, running)))
    for i in range(running):
        params = SamplingParams(max_tokens=10 * (steps + WARM_UP_STEPS), seed=i)
        sched.add(f"r{i}", list(range(1, 17)), params, class_rank=i % 3, arrival=i, tenant=f"t{i % 4}")
    for _ in range(WARM_UP_STEPS):
        await sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        await sched.step()
    took = time.perf_counter() - t0
    if len(sched) != running:
        raise SystemExit(f"{running - len(sched)} sequences finished early: the figure would mix batch sizes")
    return took / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=32, help="sequences decoding (default 32)")
    ap.add_argument("--steps", type=int, default=2000, help="steps timed per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5; the best is the figure)")
    a = ap.parse_args()
    for name in ("running", "steps", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    us = [asyncio.run(one_round(a.running, a.steps)) for _ in range(a.rounds)]
    print(f"scheduler step, {a.running} sequences decoding: best {min(us):.1f} us "
          f"(rounds: {', '.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    main()
