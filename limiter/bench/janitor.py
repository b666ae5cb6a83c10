"""``qos bench janitor``: Redis time of one script call when thousands of entries are dead.

Every script call does bounded work (claim finishes at most 16 requests and sweeps 4 + 4
entries per call; reap_expired at most 16 of each kind), so a pile of dead entries is
cleared by many short calls instead of one long one that stalls every pool on the shard.
This measures it: a private redis-server, ``SLOWLOG`` recording every command (threshold 0),
and three piles of ``entries`` requests each:

* ``dead frontend``: queued requests whose frontend stopped heartbeating; workers claim;
* ``overdue``: queued requests past their max wait; workers claim;
* ``expired leases``: leased requests whose worker died; the janitor (reap_expired) runs.

Each pile is drained by calling the script until it is gone; the figures are the number of
calls and the largest and median Redis-side duration of one call (SLOWLOG, microseconds).
Printed, never asserted (timed tests do not belong in the suite).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from limiter.bench.slowlog import log_slow_calls, quantile_us, script_durations
from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import RedisServer
from limiter.scripts import Scripts, policy_document

KEYS = PoolKeys("janitor")
ALIVE = 4102444800000  # a heartbeat in 2100


@dataclass(frozen=True)
class Pile:
    name: str
    entries: int
    calls: int
    finished: int
    max_us: int
    p50_us: int
    total_ms: float


async def _admit_many(scripts: Scripts, n: int, frontend: str, max_wait_ms: int, tag: str) -> None:
    batch = 32  # concurrent admits (the client opens one connection each)
    for start in range(0, n, batch):
        await asyncio.gather(*(scripts.admit(
            KEYS, request_id=f"{tag}{i}", tenant=f"t{i % 10}", cls="P1", input_tokens=10, max_tokens=10,
            tenant_rate=1e12, tenant_burst=1e12, tenant_max_inflight=0, max_wait_ms=max_wait_ms,
            frontend_id=frontend, payload=b"x") for i in range(start, min(n, start + batch))))


async def _drain(client: Any, call: Callable[[], Awaitable[Any]], left: Callable[[], Awaitable[int]],
                 name: str, entries: int) -> Pile:
    await client.slowlog_reset()
    calls = 0
    t0 = time.perf_counter()
    while await left() > 0:
        await call()
        calls += 1
        if calls > 100 * entries:
            raise RuntimeError(f"{name}: the pile is not shrinking")
    total_ms = (time.perf_counter() - t0) * 1000
    durations = await script_durations(client)
    # a call under SLOWLOG_US is not logged: counted as 0
    return Pile(name, entries, calls, entries, int(quantile_us(durations, calls, 1.0) or 0),
                int(quantile_us(durations, calls, 0.5) or 0), round(total_ms, 1))


async def run_janitor(entries: int = 10_000, redis_url: str | None = None) -> list[Pile]:
    server = None if redis_url else RedisServer(extra=["--appendonly", "no"]).start()
    url = redis_url or (server.url if server else "")
    client = aioredis.from_url(url)
    try:
        await log_slow_calls(client)
        scripts = Scripts(client)
        await scripts.load_all()
        cfg = demo_config()
        classes = tuple(dataclasses.replace(c, max_wait_ms=86_400_000, queue_cap=10 * entries)
                        for c in cfg.classes)
        cfg = dataclasses.replace(cfg, classes=classes)
        pool = dataclasses.replace(cfg.pool("tiny"), name=KEYS.pool, capacity_tokens_s=1e12, lease_ms=100)
        await scripts.init_pool(KEYS, policy_document(cfg, pool), reset_rates=True)
        piles = []

        async def queued() -> int:
            return int(await client.hget(KEYS.queued, "P1") or 0)

        async def leased() -> int:
            return int(await client.zcard(KEYS.leases))

        # 1. a frontend with `entries` queued requests dies
        await client.zadd(KEYS.frontends, {"fe-dead": ALIVE, "fe-live": ALIVE})
        await _admit_many(scripts, entries, "fe-dead", 0, "d")
        sec, _ = await client.time()
        await client.zadd(KEYS.frontends, {"fe-dead": int(sec) * 1000 - 3_600_000})
        piles.append(await _drain(client, lambda: scripts.claim(KEYS, "w1", 16), queued, "dead frontend",
                                  entries))
        # 2. `entries` queued requests pass their max wait
        await _admit_many(scripts, entries, "fe-live", 1, "o")
        await asyncio.sleep(0.01)
        piles.append(await _drain(client, lambda: scripts.claim(KEYS, "w1", 16), queued, "overdue", entries))
        # 3. a worker holding `entries` leases dies
        await _admit_many(scripts, entries, "fe-live", 0, "l")
        while await queued():
            await scripts.claim(KEYS, "w-dead", 1024, lease_ms=100)
        await asyncio.sleep(0.15)
        piles.append(await _drain(client, lambda: scripts.reap(KEYS), leased, "expired leases (requeued)",
                                  entries))
        return piles
    finally:
        await client.aclose()
        if server:
            server.stop()


def render(piles: list[Pile]) -> Any:
    from rich.table import Table

    t = Table(title="one script call with thousands of dead entries (Redis time, SLOWLOG)")
    for col in ("pile", "entries", "calls to clear it", "largest call, ms", "median call, ms", "wall, ms"):
        t.add_column(col, justify="left" if col == "pile" else "right")
    for p in piles:
        t.add_row(p.name, f"{p.entries:,}", f"{p.calls:,}", f"{p.max_us / 1000:.2f}",
                  f"{p.p50_us / 1000:.3f}", f"{p.total_ms:,.0f}")
    return t
