"""The whole worker's CPU per step, measured: ``python tests/bench_worker_step.py``.

The real runtime and step loop (``tests.support.worker_helpers.start_worker``) on a private
redis-server, the sim engine at time scale 0, ``--running`` requests decoding throughout
(5-token prompts, outputs that outlast the rounds): the worker process's CPU per step, its
pushes, cancel checks, heartbeats and Redis client included, Redis' own CPU not.
``tests/bench_scheduler_step.py`` times the scheduler alone; this adds what the worker does
around it. It runs on the event loop the worker role runs on (``QOS_EVENT_LOOP``: uvloop
where installed). Prints the best and every one of ``--rounds`` rounds of ``--seconds``
each. Not collected by pytest (no ``test_`` prefix); docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis

from limiter.event_loop import install_event_loop
from limiter.localstack.redis_server import RedisServer
from tests.support.worker_helpers import Client, config, start_worker, stop_worker
from worker.batch_scheduler import StepResult
from worker.engines.sim import SimEngine

# A request outlasts any sensible run (one request alone steps every ~50 us): the batch never moves.
MAX_TOKENS = 10_000_000
START_TIMEOUT_S = 60.0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(running: int, seconds: float, rounds: int, max_seqs: int = 0) -> list[float]:
    """CPU microseconds per step of a worker holding ``running`` decoding requests, one
    figure per round. ``max_seqs``: the worker's batch size (0: ``running``, a full batch,
    whose worker makes a look-ahead claim beside every step, as a saturated GPU's does)."""
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        cfg = config(Path(tmp) / "qos.toml", server.url)
        client = aioredis.from_url(server.url)
        c = Client(client, cfg)
        await c.setup()
        for i in range(running):
            await c.admit("hello", max_tokens=MAX_TOKENS, seed=i)
        engine = SimEngine(time_scale=0, kv_capacity_tokens=running * (MAX_TOKENS + 64),
                           max_seq_len=MAX_TOKENS + 64)
        rt, loop, task = await start_worker(cfg, engine, max_seqs=max_seqs or running, claim_ahead=0)
        steps = 0
        step = loop.sched.step

        async def counted() -> StepResult:
            nonlocal steps
            steps += 1
            return await step()

        loop.sched.step = counted  # type: ignore[method-assign]
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(loop.sched.running) < running:
                if time.monotonic() > deadline or task.done():
                    raise SystemExit(f"the worker ran {len(loop.sched.running)} of {running} requests "
                                     f"after {START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.05)
            out = []
            for _ in range(rounds):
                steps0, cpu0, end = steps, _cpu_s(), time.monotonic() + seconds
                while time.monotonic() < end:
                    # nobody reads the replies: keep the stream short, as a frontend's reads would
                    await client.xtrim(c.keys.reply("fe1"), maxlen=1000, approximate=True)
                    await asyncio.sleep(0.1)
                if steps == steps0:
                    raise SystemExit("no step in a round")
                out.append((_cpu_s() - cpu0) / (steps - steps0) * 1e6)
            if len(loop.sched.running) != running:
                raise SystemExit(f"{running - len(loop.sched.running)} requests left the batch: "
                                 "the figure would mix batch sizes")
            return out
        finally:
            await stop_worker(rt, task)
            await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=128, help="requests decoding (default 128)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds a round (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3; the best is the figure)")
    ap.add_argument("--max-seqs", type=int, default=0,
                    help="the worker's batch size (default 0: --running, a full batch; more leaves "
                         "room, as the overhead bench's worker has)")
    a = ap.parse_args()
    for name in ("running", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.max_seqs and a.max_seqs < a.running:
        ap.error("--max-seqs must be 0 or >= --running")
    if not a.seconds > 0:
        ap.error("--seconds must be > 0")
    loop = install_event_loop()  # as the worker role's entry point does
    us = asyncio.run(measure(a.running, a.seconds, a.rounds, a.max_seqs))
    room = f" of {a.max_seqs} slots" if a.max_seqs > a.running else ""
    print(f"worker step, {a.running} requests decoding{room}, {loop} loop: best {min(us):.1f} us of CPU "
          f"(rounds: {', '.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    main()
