"""``qos up --demo-load``: a mixed P0/P1/P2 open-loop load and a live per-class table.

P0 sends short interactive prompts, P1 medium ones, P2 a batch stream of long prompts —
the original problem's scenario in miniature — each class with its own demo key. The table shows what
each class's clients see: requests, p50/p99 TTFT and TPOT, the longest stall, 429/503s.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator

import aiohttp
from rich.live import Live
from rich.table import Table

from limiter.config import QosConfig
from limiter.console import stdout_console
from limiter.localstack.loadgen import (
    ClassLoad,
    Result,
    make_prompt,
    percentile,
    poisson_schedule,
    stream_completion,
)


def demo_loads(engine: str) -> list[ClassLoad]:
    """Sizes that make the point on each engine without drowning a 2-core CPU."""
    if engine == "torch":
        return [
            ClassLoad("P0", "demo-p0", 2.0, (16, 64), 24),
            ClassLoad("P1", "demo-p1", 1.0, (128, 512), 32),
            ClassLoad("P2", "demo-p2", 0.3, (2000, 3000), 16),
        ]
    return [
        ClassLoad("P0", "demo-p0", 8.0, (32, 256), 64),
        ClassLoad("P1", "demo-p1", 3.0, (512, 2048), 64),
        ClassLoad("P2", "demo-p2", 0.5, (8000, 12000), 32),
    ]


def render(results: list[Result], started: float, engine: str) -> Table:
    title = f"demo load, {time.monotonic() - started:.0f} s, engine {engine}" + (
        " (SIMULATED GPU)" if engine == "sim" else ""
    )
    t = Table(title=title)
    for col in (
        "class",
        "sent",
        "ok",
        "429",
        "503",
        "other",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "max stall ms",
    ):
        t.add_column(col, justify="right")
    for cls in ("P0", "P1", "P2"):
        rs = [r for r in results if r.cls == cls]
        ok = [r for r in rs if r.ok]
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
        gaps = [r.max_gap_ms for r in ok if r.max_gap_ms is not None]
        t.add_row(
            cls,
            str(len(rs)),
            str(len(ok)),
            str(sum(r.status == 429 for r in rs)),
            str(sum(r.status == 503 for r in rs)),
            str(sum(1 for r in rs if not r.ok and r.status not in (429, 503))),
            fmt(percentile(ttft, 50)),
            fmt(percentile(ttft, 99)),
            fmt(percentile(tpot, 50)),
            fmt(percentile(tpot, 99)),
            fmt(max(gaps) if gaps else None),
        )
    return t


def demo_arrivals(loads: list[ClassLoad], duration_s: float, seed: int,
                  round_s: float = 3600.0) -> Iterator[tuple[float, ClassLoad, int]]:
    """(offset_s, load, prompt_tokens) in time order: ``duration_s`` of them, or (0) round
    after round of ``round_s`` for as long as they are asked for -- a single hour-long
    schedule stopped the "until Ctrl-C" demo load after an hour."""
    for k in itertools.count():
        horizon = duration_s if duration_s > 0 else round_s
        for offset, load, tokens in poisson_schedule(loads, horizon, seed + k):
            yield k * round_s + offset, load, tokens
        if duration_s > 0:
            return


async def run_demo_load(
    base_url: str,
    cfg: QosConfig,
    engine: str,
    duration_s: float,
    should_stop: Callable[[], bool],
    seed: int = 7,
) -> list[Result]:
    """Send the demo load until ``duration_s`` (0 = until stopped); returns every result."""
    model = cfg.pools[0].model_name
    schedule = demo_arrivals(demo_loads(engine), duration_s, seed)
    results: list[Result] = []
    tasks: set[asyncio.Task[None]] = set()
    started = time.monotonic()
    console = stdout_console()

    async def one(session: aiohttp.ClientSession, load: ClassLoad, tokens: int, i: int) -> None:
        res = await stream_completion(
            session, base_url, load.key, model, make_prompt(tokens, i), load.max_tokens, load.cls
        )
        results.append(res)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        with Live(render(results, started, engine), console=console, refresh_per_second=2) as live:
            for i, (offset, load, tokens) in enumerate(schedule):
                while time.monotonic() - started < offset:
                    if should_stop():
                        break
                    live.update(render(results, started, engine))
                    await asyncio.sleep(min(0.25, offset - (time.monotonic() - started)))
                if should_stop():
                    break
                task = asyncio.create_task(one(session, load, tokens, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            # The schedule is sent: let the open streams finish (up to 30 s), but look for a stop
            # all the while (a Ctrl-C there was only acted on once the 30 s were over).
            deadline = time.monotonic() + 30
            while tasks and not should_stop() and time.monotonic() < deadline:
                await asyncio.wait(tasks, timeout=0.25)
                live.update(render(results, started, engine))
            if tasks and should_stop():
                # Stopped (Ctrl-C, or the stack is going down): do not hold the stop up for the
                # streams still open; cancelling them cancels their requests.
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks, timeout=5)
            live.update(render(results, started, engine))
    return results
