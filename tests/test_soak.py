"""Overload soak: a bounded run at twice the stack's capacity, with the sim engine.

The stack (2 frontends, 2 sim workers, a controller, real processes) is first measured: a
closed loop that keeps every batch slot busy gives its capacity in requests/s. Then an
open-loop Poisson load at twice that rate runs for ``QOS_SOAK_S`` seconds (20 in the default
run, 180 in the slow one) and stops by itself. A round that shed nothing (the machine was
slower while the capacity was measured than during the round) runs again at twice what it
answered, up to three rounds: the test waits for the overload it checks, not for a speed.
Every second the test records Redis' ``used_memory`` (and the part of it that is the
samples and decisions streams, capped by MAXLEN rather than by time), the RSS of every
frontend and worker, and every queue's depth.

Checks: every queue stays within its ``queue_cap`` at every sample; Redis memory stays
bounded (no trend between the middle and the last third of the run) and no frontend's or
worker's RSS grows with the requests it served (a bound per request); every request ends
once (answered, or 429/503 with Retry-After); afterwards the ledger holds and zero orphan
keys remain (every per-request key deleted or expired). The curves are printed; with
``QOS_SOAK_OUT=<dir>`` they are also written there as JSON and PNG (docs/img/soak.png).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from limiter.keys import PoolKeys
from tests.support.redis_server import RedisServer
from tests.support.reliability_stack import (
    KEY_P0,
    KEY_P1,
    KEY_P2,
    LiveStack,
    Outcome,
    Recorder,
    base_config,
    call,
    check_charges,
    check_outcomes,
    server_ledger,
    untimed_keys,
    wait_clean,
)

POOL = PoolKeys("tiny")
QUEUE_CAP = 40
CLASSES = ("P0", "P1", "P2")
KEYS = {"P0": KEY_P0, "P1": KEY_P1, "P2": KEY_P2}
SHED = ("max_wait_exceeded", "queue_full", "queue_timeout", "too_many_inflight")
MAX_ROUNDS = 3  # open-loop rounds, each at twice what the last one answered, until one sheds
LEAK_SLACK_MB = 1.5  # a process's RSS may move this much after its warm-up (measured: 0.5-0.8)
LEAK_PER_REQUEST_KB = 4.0  # and this much more for each request it saw (allocator, caches)


@dataclass
class Curve:
    """One sample per second of everything that must stay bounded."""

    t: list[float] = field(default_factory=list)
    redis_mb: list[float] = field(default_factory=list)
    streams_mb: list[float] = field(default_factory=list)  # samples + decisions: capped by MAXLEN
    rss_mb: dict[str, list[float]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # process name -> frontend / worker
    queues: dict[str, list[int]] = field(default_factory=dict)
    inflight: list[int] = field(default_factory=list)

    def row(self, name: str, values: list[float]) -> str:
        n = len(values)
        thirds = [values[: n // 3], values[n // 3 : 2 * n // 3], values[2 * n // 3 :]]
        return (
            f"{name:>22}: start {values[0]:7.1f}  max by third {[round(max(t), 1) for t in thirds if t]} end "
            f"{values[-1]:7.1f}"
        )


def bounded(values: list[float], slack: float, ratio: float = 1.25) -> bool:
    """No upward trend: the last third's peak within ``ratio`` x the middle third's + ``slack``."""
    n = len(values)
    middle, last = values[n // 3 : 2 * n // 3], values[2 * n // 3 :]
    return max(last) <= max(middle) * ratio + slack


async def sample(r: aioredis.Redis, stack: LiveStack, curve: Curve, t0: float) -> None:
    info = await r.info("memory")
    curve.t.append(round(time.monotonic() - t0, 1))
    curve.redis_mb.append(info["used_memory"] / 2**20)
    capped = [await r.memory_usage(k) or 0 for k in (POOL.samples, POOL.decisions)]
    curve.streams_mb.append(sum(capped) / 2**20)
    for p in stack.procs.values():
        if p.role in ("frontend", "worker"):
            curve.rss_mb.setdefault(p.name, []).append(p.rss_kb() / 1024)
            curve.roles[p.name] = p.role
    for c in CLASSES:
        curve.queues.setdefault(c, []).append(int(await r.hget(POOL.queued, c) or 0))
    curve.inflight.append(await r.zcard(POOL.leases))


async def capacity_rps(stack: LiveStack, seconds: float, concurrency: int, spec: dict[str, Any]) -> float:
    """Requests/s the stack completes with every slot busy (a closed loop)."""
    done = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:

        async def loop(i: int) -> None:
            nonlocal done
            n = 0
            while time.monotonic() < stop:
                o = await call(s, stack.base(f"fe{i % 2}"), "cal", KEY_P1, f"cal{i}-{n}", **spec)
                n += 1
                done += o.kind == "ok"

        t0 = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return done / (time.monotonic() - t0)


def soak_seconds(default: float) -> float:
    return float(os.environ.get("QOS_SOAK_S", default))


def write_artifacts(curve: Curve, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(curve.__dict__, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(curve.t, curve.redis_mb, label="Redis used_memory")
    axes[0].plot(curve.t, curve.streams_mb, label="of which the samples + decisions streams (MAXLEN-capped)")
    rest = [a - b for a, b in zip(curve.redis_mb, curve.streams_mb, strict=True)]
    axes[0].plot(curve.t, rest, label="the rest", linestyle="--")
    axes[0].set_ylabel("MiB")
    for name, v in curve.rss_mb.items():
        axes[1].plot(curve.t, v, label=f"{name} RSS")
    axes[1].set_ylabel("MiB")
    for c, v in curve.queues.items():
        axes[2].plot(curve.t, v, label=f"queue {c}")
    axes[2].plot(curve.t, curve.inflight, label="leased", linestyle=":")
    axes[2].axhline(QUEUE_CAP, color="k", linestyle="--", label="queue_cap")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    axes[0].set_title("Overload soak at 2x capacity (sim engine)")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=90)


async def overload_round(stack: LiveStack, r: aioredis.Redis, s: aiohttp.ClientSession, rng: random.Random,
                         spec: dict[str, Any], rate: float, duration: float, curve: Curve,
                         outcomes: list[Outcome], attempt: int) -> None:
    """``duration`` seconds of open-loop Poisson arrivals at ``rate`` (they never wait for
    answers), sampling ``curve`` every second; returns once every request has ended."""
    t0 = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        cls = CLASSES[i % 3]
        kw = {
            **spec,
            "prompt_tokens": rng.randint(40, 200),
            "max_tokens": rng.randint(10, 70),
            "stream": i % 4 != 0,
        }
        fe = f"fe{i % 2}"
        outcomes.append(await call(s, stack.base(fe), fe, KEYS[cls], f"s{attempt}-{i}", **kw))

    async def sampler() -> None:
        while time.monotonic() - t0 < duration + 1:
            await sample(r, stack, curve, t0)
            await asyncio.sleep(1.0)

    sampling = asyncio.create_task(sampler())
    i, next_at = 0, 0.0
    while next_at < duration:
        await asyncio.sleep(max(0.0, t0 + next_at - time.monotonic()))
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    await sampling


def rss_growth_mb(t: list[float], values: list[float]) -> float:
    """How much a process's RSS grew over the last two thirds of a round (the first third
    warms it up): the least-squares slope over that window times its length. A passing peak
    at either end (a burst of buffers) moves a slope little; a leak grows it throughout."""
    start = len(values) // 3
    t, values = t[start:], values[start:]
    if len(values) < 2 or t[-1] == t[0]:
        return 0.0
    mean_t, mean_v = sum(t) / len(t), sum(values) / len(values)
    slope = (sum((a - mean_t) * (v - mean_v) for a, v in zip(t, values, strict=True))
             / sum((a - mean_t) ** 2 for a in t))
    return slope * (t[-1] - t[0])


def check_bounded(curve: Curve, what: str, sent: int, answered: int, duration: float) -> None:
    """Queues within their cap at every sample; Redis memory (less the MAXLEN-capped streams)
    without an upward trend; and no process's RSS growing with the requests it served.

    The RSS bound is per request: a leak grows with the requests a process has seen, noise
    does not. Each frontend sees about half of the round's requests and each worker half of
    those answered; those of the last two thirds fall in the window. On this machine a round
    sends ~790 requests and a process's RSS grows by 0.0-0.3 MiB after its warm-up, so the
    bound (LEAK_SLACK_MB + LEAK_PER_REQUEST_KB a request, ~2.4 MiB) catches a leak of 16 KiB
    a request (3.5-4.3 MiB, planted in a frontend and in a worker); the old trend check (last
    third within 1.25x the middle's + 8 MiB) let it through."""
    assert all(max(v) <= QUEUE_CAP for v in curve.queues.values()), (what, curve.queues)
    redis_wo_samples = [a - b for a, b in zip(curve.redis_mb, curve.streams_mb, strict=True)]
    assert bounded(redis_wo_samples, slack=2.0), (what, redis_wo_samples)
    in_window = max(0.0, duration - curve.t[len(curve.t) // 3]) / duration
    for name, v in curve.rss_mb.items():
        seen = (sent if curve.roles[name] == "frontend" else answered) / 2 * in_window
        allowed = LEAK_SLACK_MB + seen * LEAK_PER_REQUEST_KB / 1024
        grew = rss_growth_mb(curve.t, v)
        assert grew <= allowed, (
            f"{what}: {name}'s RSS grew {grew:.1f} MiB over ~{seen:.0f} requests "
            f"({grew * 1024 / max(seen, 1):.1f} KiB a request; allowed {allowed:.1f} MiB): {v}")


def curve_lines(curve: Curve) -> str:
    return "\n".join([
        curve.row("Redis used_memory MiB", curve.redis_mb),
        curve.row("capped streams MiB", curve.streams_mb),
        *[curve.row(f"{n} RSS MiB", v) + f"  grew {rss_growth_mb(curve.t, v):.1f} after the first third"
          for n, v in curve.rss_mb.items()],
        *[curve.row(f"queue {c} (cap {QUEUE_CAP})", [float(x) for x in v]) for c, v in curve.queues.items()],
        curve.row("leased", [float(x) for x in curve.inflight]),
    ])


@pytest.mark.parametrize(
    "duration", [pytest.param(20.0, id="short"), pytest.param(180.0, id="full", marks=pytest.mark.slow)]
)
async def test_overload_soak_at_twice_capacity(tmp_path: Path, duration: float) -> None:
    duration = soak_seconds(duration)
    server = RedisServer(extra=["--appendonly", "yes", "--appendfsync", "everysec"]).start()
    r = aioredis.from_url(server.url)
    classes = {c: {"queue_cap": QUEUE_CAP, "max_wait_ms": 4000} for c in CLASSES}
    # Finished records live 12 s: the recorder must see each one before it goes (a CI run lost
    # 38 of 730 at 8 s with a scan every 1.0 s, 2026-12-07), and Redis' memory still levels off
    # within the first 20 s round.
    cfg = base_config(server.url, classes=classes, max_inflight=64, record_ttl_s=12)
    stack = LiveStack(tmp_path, cfg)
    spec = {"prompt_tokens": 120, "max_tokens": 40, "stream": True, "timeout_s": 60.0}
    try:
        for i in range(2):
            stack.frontend(f"fe{i}")
            stack.worker(f"w{i}")
        stack.controller("ctl0")
        await stack.wait_ready(r)
        rng = random.Random(3)
        outcomes: list[Outcome] = []
        async with (
            Recorder(r, ["tiny"], period_s=0.5) as rec,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s,
        ):
            cap = await capacity_rps(stack, 4.0, 24, spec)
            rate = 2 * cap
            # The closed loop measures the machine as fast as it is during those 4 s. On a busy
            # CI box that can be half of what it is during the soak (loaded pass 30: 6.0 req/s
            # measured, then 12.0 offered and all of it answered: no overload to test). So a round
            # that shed nothing is run again at twice what it answered, up to MAX_ROUNDS.
            for attempt in range(1, MAX_ROUNDS + 1):
                curve = Curve()
                first = len(outcomes)
                await overload_round(stack, r, s, rng, spec, rate, duration, curve, outcomes, attempt)
                shed = sum(1 for o in outcomes[first:] if o.kind == "http_error")
                ok = sum(1 for o in outcomes[first:] if o.kind == "ok")
                answered = ok / duration
                check_bounded(curve, f"round {attempt} at {rate:.1f} req/s", len(outcomes) - first, ok,
                              duration)
                print(f"\n[soak] round {attempt}: {duration:.0f} s at {rate:.1f} req/s (measured capacity "
                      f"{cap:.1f} req/s): {len(outcomes) - first} sent, {shed} shed, "
                      f"{answered:.1f} answered/s\n" + curve_lines(curve))
                if shed:
                    break
                rate = 2 * max(rate, answered)
            rep = check_outcomes(outcomes, allowed_codes=SHED, rec=rec)
            await rec.scan()
            clean_s = await wait_clean(r, ["tiny"], timeout=30)
            rep.admitted, rep.samples, _ = await server_ledger(r, ["tiny"])
        states = check_charges(rec.records)
        assert sum(states.values()) == rep.admitted, (
            f"{states} != {rep.admitted} admitted; longest scan gap {rec.max_gap_s:.1f} s,"
            f" failed scans {rec.failed_scans[:3]} ({len(rec.failed_scans)})")
        assert not await untimed_keys(r, "tiny")
        print(f"[soak] {rep.line()}; requests by final state {states}; "
              f"zero orphan keys {clean_s:.1f} s after the load")
        if out := os.environ.get("QOS_SOAK_OUT"):
            write_artifacts(curve, Path(out))
        # it was overloaded, and it still served
        assert rep.kinds["ok"] > 0 and rep.kinds["http_error"] > 0, (
            f"never overloaded: {MAX_ROUNDS} rounds up to {rate:.1f} req/s shed nothing")
    finally:
        stack.stop()
        await r.aclose()
        server.stop()
