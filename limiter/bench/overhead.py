"""``qos bench overhead``: what the QoS path costs per request, against a bare aiohttp server.

Two targets, one load generator (:func:`limiter.localstack.loadgen.stream_completion`, streaming):

* **echo**: :mod:`limiter.bench.echo`, its own process, answers at once;
* **full path**: a private Redis, frontend(s) and worker(s), started like ``qos bench run``'s
  priority stack (no buckets or controller in the way: the path itself is measured):
  frontend -> admit (Redis) -> worker claim -> token pushes -> reply stream -> frontend ->
  client. The worker's engine is one of two:

  - ``sim`` (default): the worker is the engine's driver, a sim engine at ``--time-scale 0``
    (steps cost nothing), so each output token is one step of the worker's own batch
    scheduler, counted in the added latency;
  - ``openai``: the worker fronts a model server, which is a second echo process: the QoS
    path in front of a server against that server alone, as an operator puts it in front of
    vLLM (and as LiteLLM's proxy overhead is measured, against a fake OpenAI endpoint). The
    added latency is then the path's own: the frontend, Redis, the worker's relay and one
    more HTTP hop, with no step loop. ``chunk_tokens`` is the echo's chunking, the same for
    both targets (1 streams one token a chunk, as vLLM does), and ``step_ms`` its pacing: a
    decode step every that many ms at which every open stream gets its next chunk, as from
    a continuous-batching server (0: all at once).

Two phases per target, each ``seconds`` long:

1. **throughput**: ``concurrency`` closed-loop clients (each sends its next request when the
   last one ends) -- the most the target completes per second on this machine;
2. **latency**: open-loop Poisson arrivals at ``rate`` (default 0.3 x the full path's
   throughput, so neither target is near saturation) -- added latency = full path minus
   echo at p50 and p99, for TTFT and end to end.

Redis commands per request (full path only), in a third phase at ``min(rate, 50)`` req/s:
the commands clients sent (counted with ``MONITOR``, which tells a client's command from
one a Lua script runs inside Redis -- ``INFO commandstats`` counts both), divided by the
requests completed in it; EVALSHA is broken down by script. MONITOR makes Redis slower and
its reader shares the load generator's CPU, so it is kept out of the latency phase. The
background (heartbeats, blocked reads of idle roles), counted over an idle interval of the
same length, is reported and also subtracted.

Everything shares one machine: the client, the server(s) and Redis compete for its cores,
which this benchmark cannot separate (say so when quoting it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from rich.table import Table

from limiter.bench.echo import CHUNK_TOKENS
from limiter.bench.modes import POOL, UNLIMITED, api_key, mode_spec
from limiter.bench.procstat import MachineTicks, busy_share, cpu_by_role
from limiter.bench.stack import CommandMonitor, StackSpec, role_pids, start_stack
from limiter.localstack.launcher import stop_process
from limiter.localstack.loadgen import Result, make_prompt, percentile, stream_completion
from limiter.localstack.redis_server import free_port

DEFAULT_SECONDS = 10.0
DEFAULT_CONCURRENCY = 32
DEFAULT_OUTPUT_TOKENS = 16
PROMPT_TOKENS = 16
ENGINES = ("sim", "openai")
RATE_SHARE = 0.3  # latency phase: this share of the full path's throughput (well below saturation)
ECHO_START_TRIES = 3  # free_port() then the child's bind: another process may take the port between
MONITOR_RATE = 50.0  # the command count runs at most this many req/s (MONITOR slows Redis down)
# The goals (README, "Overhead"): one frontend process carries >= 1,000 req/s of null-engine
# requests; at 200 req/s the path adds p50 <= 2 ms and p99 <= 10 ms.
GOAL_REQUESTS_S = 1_000
GOAL_ADDED_MS = {"p50": 2.0, "p99": 10.0}


async def closed_loop(url: str, key: str, model: str, seconds: float, concurrency: int,
                      output_tokens: int) -> list[Result]:
    prompt = make_prompt(PROMPT_TOKENS, 1)
    out: list[Result] = []
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            while time.monotonic() < end:
                out.append(await stream_completion(session, url, key, model, prompt, output_tokens, "P0",
                                                   timeout_s=30))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def open_loop(url: str, key: str, model: str, seconds: float, rate: float, output_tokens: int,
                    seed: int = 3) -> list[Result]:
    prompt = make_prompt(PROMPT_TOKENS, 1)
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        t = rng.expovariate(rate)
        while t < seconds:
            delay = start + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(  # timed from its slot, not from when it ran
                stream_completion(session, url, key, model, prompt, output_tokens, "P0", timeout_s=30,
                                  scheduled_s=start + t)))
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def summarise(results: list[Result], seconds: float, until: float | None = None) -> dict[str, Any]:
    """``until`` (monotonic): a closed loop's end. Its clients wait for their last requests
    after it; those answers are counted as answered but not in ``requests_s``, the rate of
    the ``seconds`` before it."""
    ok = [r for r in results if r.ok]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    inside = ok if until is None else [r for r in ok if r.e2e_ms is not None
                                       and r.sent_s + r.e2e_ms / 1000 <= until]
    return {"sent": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "requests_s": round(len(inside) / seconds, 1),
            "e2e_p50_ms": _r(percentile(e2e, 50)), "e2e_p99_ms": _r(percentile(e2e, 99)),
            "ttft_p50_ms": _r(percentile(ttft, 50)), "ttft_p99_ms": _r(percentile(ttft, 99))}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


async def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> bool:
    """Wait for ``url``'s /readyz to answer 200; False when ``proc`` exited first (its port was
    taken between free_port() and its bind)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:g} s")


def cpu_split(pids: dict[str, list[int]], before: dict[str, float], after: dict[str, float],
              ticks: tuple[MachineTicks, MachineTicks], wall_s: float, completed: int) -> dict[str, Any]:
    """Where the cores went during a phase: CPU ms per completed request and cores used, per
    role; how busy the machine was. ``ceiling_requests_s``: what a role's process(es) would
    complete on a core each of their own (1 / CPU s per request x processes) -- a projection,
    for the machine is shared."""
    used = {r: after[r] - before[r] for r in pids}
    n = max(1, completed)
    return {"cpu_ms_per_request": {r: round(v / n * 1e3, 3) for r, v in used.items()},
            "cores": {r: round(v / wall_s, 2) for r, v in used.items()},
            "ceiling_requests_s": {r: round(len(pids[r]) * n / v) if v > 0 else None
                                   for r, v in used.items()},
            "machine_busy": _r(busy_share(*ticks))}


@contextlib.asynccontextmanager
async def echo_server(chunk_tokens: int, step_ms: float = 0.0) -> AsyncIterator[tuple[str, int]]:
    """A :mod:`limiter.bench.echo` process on a free port: yields its URL and pid. A port
    another process took before the echo server bound it costs a try, not the run."""
    for attempt in range(ECHO_START_TRIES):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "limiter.bench.echo", "--port", str(port),
                                 "--chunk-tokens", str(chunk_tokens), "--step-ms", repr(step_ms)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            if not await _wait_http(url, proc):
                if attempt + 1 == ECHO_START_TRIES:
                    raise RuntimeError(f"the echo server exited at start {ECHO_START_TRIES} times "
                                       f"(status {proc.returncode})")
                continue
            yield url, proc.pid
            return
        finally:
            stop_process(proc, timeout_s=5.0)


async def measure_echo(seconds: float, concurrency: int, rate: float | None, output_tokens: int,
                       log: Callable[[str], None], chunk_tokens: int = CHUNK_TOKENS,
                       step_ms: float = 0.0) -> dict[str, Any]:
    async with echo_server(chunk_tokens, step_ms) as (url, _pid):
        end = time.monotonic() + seconds
        thr = summarise(await closed_loop(url, "echo", "echo", seconds, concurrency, output_tokens), seconds,
                        until=end)
        log(f"[dim]  echo      throughput {thr['requests_s']:,.0f} req/s (c={concurrency})[/]")
        lat = None
        if rate:
            lat = summarise(await open_loop(url, "echo", "echo", seconds, rate, output_tokens), seconds)
            log(f"[dim]  echo      latency at {rate:g} req/s: e2e p50 {lat['e2e_p50_ms']} ms, "
                f"p99 {lat['e2e_p99_ms']} ms[/]")
        return {"throughput": thr, "latency": lat}


async def measure_full(seconds: float, concurrency: int, rate: float | None, output_tokens: int, workers: int,
                       frontends: int, log: Callable[[str], None], work_dir: Path,
                       max_seqs: int = 64, engine: str = "sim",
                       chunk_tokens: int = CHUNK_TOKENS, step_ms: float = 0.0) -> dict[str, Any]:
    args = (seconds, concurrency, rate, output_tokens, workers, frontends, log, work_dir, max_seqs, engine)
    if engine != "openai":
        return await _measure_stack(*args, None)
    async with echo_server(chunk_tokens, step_ms) as upstream:  # the model server the workers front
        return await _measure_stack(*args, upstream)


async def _measure_stack(seconds: float, concurrency: int, rate: float | None, output_tokens: int,
                         workers: int, frontends: int, log: Callable[[str], None], work_dir: Path,
                         max_seqs: int, engine: str, upstream: tuple[str, int] | None) -> dict[str, Any]:
    spec = mode_spec("priority", capacity_tokens_s=UNLIMITED, context_tokens=4096)
    sspec = StackSpec(engine=engine, workers=workers, frontends=frontends, time_scale=0.0, token_budget=512,
                      max_seqs=max_seqs, upstream_url=upstream[0] if upstream else None)
    stack = await start_stack(sspec, spec, work_dir)
    key = api_key("P0")
    try:
        await closed_loop(stack.base_url, key, POOL, min(2.0, seconds), 4, output_tokens)  # warm up
        redis_proc = getattr(stack.redis, "proc", None)
        pids = role_pids(stack, [redis_proc.pid] if redis_proc is not None else [])
        if upstream is not None:
            pids["upstream"] = [upstream[1]]
        cpu0, ticks0, t0 = cpu_by_role(pids), MachineTicks.read(), time.monotonic()
        results = await closed_loop(stack.base_url, key, POOL, seconds, concurrency, output_tokens)
        split = cpu_split(pids, cpu0, cpu_by_role(pids), (ticks0, MachineTicks.read()), time.monotonic() - t0,
                          sum(r.ok for r in results))
        thr = {**summarise(results, seconds, until=t0 + seconds), **split}
        log(f"[dim]  full path throughput {thr['requests_s']:,.0f} req/s (c={concurrency}); CPU ms per "
            f"request {thr['cpu_ms_per_request']}, machine {thr['machine_busy'] or 0:.0%} busy[/]")
        rate = rate or max(1.0, round(thr["requests_s"] * RATE_SHARE))
        await asyncio.sleep(1.0)
        lat = summarise(await open_loop(stack.base_url, key, POOL, seconds, rate, output_tokens), seconds)
        log(f"[dim]  full path latency at {rate:g} req/s: e2e p50 {lat['e2e_p50_ms']} ms, "
            f"p99 {lat['e2e_p99_ms']} ms; {lat['errors']} of {lat['sent']} failed[/]")
        await asyncio.sleep(1.0)
        mon = CommandMonitor(stack.redis_url)
        await mon.start()
        await asyncio.sleep(seconds)
        idle = await mon.stop()
        mon = CommandMonitor(stack.redis_url)
        await mon.start()
        counted = summarise(await open_loop(stack.base_url, key, POOL, seconds, min(rate, MONITOR_RATE),
                                            output_tokens, seed=4), seconds)
        top = await mon.stop()
        n = max(1, counted["completed"])
        total, background = sum(top.values()), sum(idle.values())
        commands = {"per_request": round(total / n, 2),
                    "per_request_minus_background": round((total - background) / n, 2),
                    "background_per_s": round(background / seconds, 1),
                    "in_scripts_per_request": round(mon.in_scripts / n, 2),
                    "by_command_per_request": {k: round(v / n, 3) for k, v in top.items()},
                    "background_by_command_per_s": {k: round(v / seconds, 2) for k, v in idle.items()},
                    "rate": min(rate, MONITOR_RATE), "completed": counted["completed"],
                    "target": round(8 + output_tokens / 16, 2)}
        return {"throughput": thr, "latency": lat, "rate": rate, "redis_commands": commands}
    finally:
        await asyncio.to_thread(stack.stop, 10.0)


async def run_overhead(*, seconds: float = DEFAULT_SECONDS, concurrency: int = DEFAULT_CONCURRENCY,
                       rate: float | None = None, output_tokens: int = DEFAULT_OUTPUT_TOKENS,
                       workers: int = 1, frontends: int = 1, max_seqs: int = 64, engine: str = "sim",
                       chunk_tokens: int = CHUNK_TOKENS, step_ms: float = 0.0,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Both targets, both phases; the full path first so its throughput sets the rate."""
    import tempfile

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if step_ms and engine != "openai":
        raise ValueError("step_ms paces the echo server as a model server: it needs engine openai")
    with tempfile.TemporaryDirectory(prefix="qos-overhead-") as d:
        full = await measure_full(seconds, concurrency, rate, output_tokens, workers, frontends, log, Path(d),
                                  max_seqs, engine, chunk_tokens, step_ms)
    echo = await measure_echo(seconds, concurrency, full["rate"], output_tokens, log, chunk_tokens, step_ms)
    ft, et = full["throughput"]["requests_s"], echo["throughput"]["requests_s"]
    fl, el = full["latency"], echo["latency"] or {}
    added = {f"{m}_{q}_ms": _r(fl[f"{m}_{q}_ms"] - el[f"{m}_{q}_ms"])
             if fl.get(f"{m}_{q}_ms") is not None and el.get(f"{m}_{q}_ms") is not None else None
             for m in ("e2e", "ttft") for q in ("p50", "p99")}
    return {"params": {"seconds": seconds, "concurrency": concurrency, "rate": full["rate"],
                       "output_tokens": output_tokens, "prompt_tokens": PROMPT_TOKENS, "workers": workers,
                       "frontends": frontends, "max_seqs": max_seqs, "engine": engine,
                       "chunk_tokens": chunk_tokens, "step_ms": step_ms, "cpus": os.cpu_count()},
            "echo": echo, "full": full, "throughput_ratio": round(ft / et, 3) if et else None,
            "added_latency": added, "targets": {
                "requests_s_one_frontend": GOAL_REQUESTS_S, "added_p50_ms": GOAL_ADDED_MS["p50"],
                "added_p99_ms": GOAL_ADDED_MS["p99"],
                "commands_per_request": full["redis_commands"]["target"]}}


def render(report: dict[str, Any]) -> Table:
    p = report["params"]
    if p.get("engine", "sim") == "sim":
        workers = f"{p['workers']} sim worker(s) at time scale 0"
    else:
        paced = f" stepping every {p['step_ms']:g} ms" if p.get("step_ms") else ""
        workers = f"{p['workers']} openai worker(s) in front of an echo server{paced}"
    t = Table(title=f"overhead: {p['prompt_tokens']}-token prompts, {p['output_tokens']} output tokens in "
                    f"chunks of {p.get('chunk_tokens', CHUNK_TOKENS)}, {workers}, {p['cpus']} CPUs shared by "
                    "everything", title_justify="left")
    for c in ("figure", "echo", "full path", "full - echo / ratio", "target"):
        t.add_column(c, justify="right")
    e, f = report["echo"], report["full"]
    t.add_row(f"throughput, req/s (c={p['concurrency']})", f"{e['throughput']['requests_s']:,.0f}",
              f"{f['throughput']['requests_s']:,.0f}", f"{report['throughput_ratio']:.2f}x",
              f">= {GOAL_REQUESTS_S:,} (one frontend)")
    added_goal = {q: f"added <= {ms:g}" for q, ms in GOAL_ADDED_MS.items()}
    for m in ("ttft", "e2e"):
        for q in ("p50", "p99"):
            k = f"{m}_{q}_ms"
            t.add_row(f"{m.upper()} {q} at {p['rate']:g} req/s, ms", _fmt((e["latency"] or {}).get(k)),
                      _fmt(f["latency"].get(k)), _fmt(report["added_latency"][k]), added_goal[q])
    t.add_row("errors / sent: throughput, latency phases", _errors(e["throughput"], e["latency"]),
              _errors(f["throughput"], f["latency"]), "", "0 (the figures count the answered only)")
    rc = f["redis_commands"]
    t.add_row("Redis commands / request", "-", f"{rc['per_request']:.2f}",
              f"{rc['per_request_minus_background']:.2f} w/o background", f"<= {rc['target']:g}")
    thr = f["throughput"]
    if "cpu_ms_per_request" in thr:
        busy = thr["machine_busy"]
        t.add_row(f"throughput phase: machine busy {'-' if busy is None else f'{busy:.0%}'}", "", "", "", "")
        for role, ms in thr["cpu_ms_per_request"].items():
            ceiling = thr["ceiling_requests_s"][role]
            t.add_row(f"  {role}: CPU ms / request (cores)", "", f"{ms:.3f} ({thr['cores'][role]:.2f})",
                      f"{ceiling:,} req/s alone" if ceiling else "-", "")
    return t


def _errors(*phases: dict[str, Any] | None) -> str:
    """``errors/sent`` of each phase, red where any failed: the latency figures leave them out."""
    out = [f"{p['errors']}/{p['sent']}" if p else "-" for p in phases]
    text = ", ".join(out)
    return f"[red]{text}[/]" if any(p and p["errors"] for p in phases) else text


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
