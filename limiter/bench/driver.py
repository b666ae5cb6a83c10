"""The open-loop client: every arrival is sent at its scheduled time, whatever the server does.

Requests go through the public HTTP API with streaming (:func:`limiter.localstack.loadgen.stream_completion`),
one task per request, so a slow server never slows the arrivals down (a closed loop would
hide overload by sending less). How late each send was against its schedule is recorded,
so a client that could not keep up shows in the results instead of silently changing the load.

After the last arrival the run waits up to ``drain_s`` for outstanding answers, then
disconnects the rest (the frontends cancel them); those count as ``incomplete``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from limiter.bench.modes import api_key
from limiter.bench.trace import Arrival
from limiter.localstack.loadgen import Result, make_prompt, stream_completion

INCOMPLETE = "incomplete"  # Result.error of a request still open when the drain ran out


@dataclass
class Record:
    """One request of a run: what was scheduled and what the client saw."""

    arrival: Arrival
    result: Result
    send_lag_ms: float  # how late the send was against the schedule


def prompts_for(arrivals: Sequence[Arrival]) -> dict[int, str]:
    """Every prompt, built before the clock starts (a 32K prompt is not free to make)."""
    cache: dict[int, str] = {}
    return {a.index: cache.setdefault(a.prompt_tokens, make_prompt(a.prompt_tokens, a.prompt_tokens))
            for a in arrivals}


async def drive(base_url: str, model: str, arrivals: Sequence[Arrival], *, duration_s: float,
                drain_s: float, progress: Callable[[int, int], None] | None = None,
                t0: float | None = None, keys: Mapping[str, str] | None = None) -> list[Record]:
    """Send ``arrivals`` open-loop from ``t0`` (monotonic; default now) with the API key of
    each one's tenant, else its class (``keys``, default the benchmark's own); returns one
    :class:`Record` per arrival, in arrival order."""
    prompts = prompts_for(arrivals)
    records: list[Record | None] = [None] * len(arrivals)
    tasks: dict[int, asyncio.Task[Result]] = {}
    done = 0

    def key_of(a: Arrival) -> str:
        who = a.tenant or a.cls
        return keys[who] if keys is not None else api_key(who)

    def finished(_task: asyncio.Task[Result]) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(len(tasks), done)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic() if t0 is None else t0
        for i, a in enumerate(arrivals):
            delay = start + a.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lag_ms = max(0.0, (time.monotonic() - start - a.at_s) * 1000)
            task = asyncio.create_task(stream_completion(session, base_url, key_of(a), model,
                                                         prompts[a.index], a.max_tokens, a.cls,
                                                         timeout_s=duration_s + drain_s + 60,
                                                         scheduled_s=start + a.at_s))
            task.add_done_callback(finished)
            tasks[i] = task
            records[i] = Record(a, Result(cls=a.cls, sent_s=time.monotonic(), error=INCOMPLETE), lag_ms)
            if progress:
                progress(len(tasks), done)
        deadline = start + duration_s + drain_s
        pending = [t for t in tasks.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        for t in tasks.values():
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    out = []
    for i, rec in enumerate(records):
        assert rec is not None
        t = tasks[i]
        if not t.cancelled() and t.exception() is None:
            res = t.result()
            rec.result = res
        out.append(rec)
    return out
