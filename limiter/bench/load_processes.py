"""Closed-loop load from several client processes, for a machine with cores to spare.

One Python process of streaming clients carries a few thousand requests a second: on a
machine with many cores it, not the stack, set ``qos bench scale-out``'s figure once three
pools' frontends and workers had a core each. :func:`run_clients` starts ``processes``
children (``python -m limiter.bench.load_processes``), each running
:func:`limiter.bench.overhead.closed_loop` on every loaded pool with its share of the
clients; they start together at a wall-clock time given to them (a child's start, its
imports, is not in the phase, nor in its CPU), and each prints one JSON line: the requests
each pool completed, the errors, its CPU seconds over the phase and how late it started. A
child that fails, or outlasts the phase by :data:`CHILD_GRACE_S`, is killed with the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from limiter.localstack.loadgen import Result

# A child needs this long to start (interpreter, aiohttp's import) on a loaded machine; the
# phase starts this long after the children were asked to run.
START_ALLOWANCE_S = 3.0
# A child's last requests end within their own 30 s limit after the phase: past this it is stuck.
CHILD_GRACE_S = 45.0


@dataclass(frozen=True)
class ClientLoad:
    """What the children did in one phase, added up."""

    completed: dict[str, int]  # pool -> requests answered 200 with every token
    errors: int
    cpu_s: float  # the children's CPU seconds (they exit before the bench reads /proc)
    late_s: float  # the latest child's start past the agreed time


def shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` clients split over ``processes`` as evenly as they go; no zeros."""
    base, extra = divmod(concurrency, processes)
    return [c for i in range(processes) if (c := base + (i < extra))]


async def run_clients(processes: int, url: str, key: str, pools: Sequence[str], seconds: float,
                      concurrency: int, output_tokens: int, start_at: float) -> ClientLoad:
    """``processes`` children loading ``pools`` (``concurrency`` clients each pool, in all)
    for ``seconds`` from ``start_at`` (``time.time()``); raises naming the first child that
    failed, as soon as it has, the others killed."""
    children: list[asyncio.subprocess.Process] = []
    reads: list[asyncio.Future[tuple[bytes, bytes]]] = []
    try:
        for c in shares(concurrency, processes):
            children.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "limiter.bench.load_processes", "--url", url, "--key", key,
                "--pools", ",".join(pools), "--seconds", str(seconds), "--concurrency", str(c),
                "--output-tokens", str(output_tokens), "--start-at", repr(start_at),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        running = {asyncio.ensure_future(child.communicate()): child for child in children}
        reads = list(running)
        # a child's requests give up after 30 s each: past that it is stuck
        async with asyncio.timeout(max(0.0, start_at - time.time()) + seconds + CHILD_GRACE_S):
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for read in done:
                    child = running.pop(read)
                    if child.returncode != 0:  # (communicate returns once the child has exited)
                        tail = read.result()[1].decode(errors="replace").strip().splitlines()[-1:]
                        raise RuntimeError(f"a load process exited {child.returncode}: "
                                           f"{(tail or ['no output'])[0]}")
    finally:  # raised, timed out or cancelled: no child outlives the phase
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
        await asyncio.gather(*reads, return_exceptions=True)  # their pipes closed with them
    completed = dict.fromkeys(pools, 0)
    errors, cpu_s, late_s = 0, 0.0, 0.0
    for read in reads:
        got = json.loads(read.result()[0])
        for pool, n in got["completed"].items():
            completed[pool] += n
        errors += got["errors"]
        cpu_s += got["cpu_s"]
        late_s = max(late_s, got["late_s"])
    return ClientLoad(completed, errors, cpu_s, late_s)


async def _load(args: argparse.Namespace) -> dict[str, object]:
    from limiter.bench.overhead import closed_loop  # the bench's own loop (imported before the wait)

    pools = args.pools.split(",")
    await asyncio.sleep(max(0.0, args.start_at - time.time()))
    late_s = max(0.0, time.time() - args.start_at)
    cpu0 = _cpu_s()  # not the interpreter's start and the imports: 0.5 s of CPU before the phase
    got = await asyncio.gather(*(closed_loop(args.url, args.key, p, args.seconds, args.concurrency,
                                             args.output_tokens) for p in pools))
    completed, errors = tally(pools, got)
    return {"completed": completed, "errors": errors, "cpu_s": _cpu_s() - cpu0, "late_s": late_s}


def tally(pools: Sequence[str], results: Sequence[Sequence[Result]]) -> tuple[dict[str, int], int]:
    """Each pool's requests answered in full (``results``: each pool's, in ``pools``' order),
    and the requests that were not."""
    return ({p: sum(r.ok for r in rs) for p, rs in zip(pools, results, strict=True)},
            sum(not r.ok for rs in results for r in rs))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m limiter.bench.load_processes",
                                description="one client process of qos bench scale-out")
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--pools", required=True, help="comma-separated model names")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--concurrency", type=int, required=True, help="clients per pool")
    p.add_argument("--output-tokens", type=int, required=True)
    p.add_argument("--start-at", type=float, required=True, help="time.time() to start at")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or args.output_tokens < 1:
        p.error("--seconds must be > 0, --concurrency and --output-tokens >= 1")
    print(json.dumps(asyncio.run(_load(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
