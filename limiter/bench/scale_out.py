"""``qos bench scale-out``: requests/s as pools are added, one pool per shard of a local
3-master Redis Cluster, and what each shard spends per request.

One stack serves every phase: ``frontends`` frontend processes (one port, SO_REUSEPORT) and
``workers_per_pool`` sim workers per pool at ``--time-scale 0`` (the null engine: steps cost
nothing, as in ``qos bench overhead``), ``redis.cluster = true``, three pools named so that
their hash tags land on three different masters (:func:`pools_on_distinct_shards`), each pool
its own model name. Strict priority, unbounded capacity and no controller: the path itself
is measured, nothing throttles it.

Phases: an idle interval (each shard's background: heartbeats, blocked reads), then pools
1..n, phase k loading the first k pools with ``concurrency`` closed-loop streaming clients
each. Per phase: requests/s per pool and in total (and over one pool's); per shard the
main thread's CPU seconds (``INFO cpu``) and the commands (``INFO commandstats``, a script's
inner commands included) per request of its pool, background subtracted, and the ceiling
that implies (one core at 100 %); the CPU seconds per request of every process of the
stack and of this load generator (``/proc``), and how busy the machine was. After the last
phase, each shard's keyspace is scanned: a pool's keys must all be on its own shard.

On a small machine the throughput is bounded by the cores the clients, frontends and
workers share, not by Redis: the report says how busy the machine was, and gives the
shard-side projection (sum of the shards' ceilings) separately.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from limiter.bench import scale_math as sm
from limiter.bench.load_processes import START_ALLOWANCE_S, ClientLoad, run_clients, tally
from limiter.bench.modes import UNLIMITED, api_key, mode_spec, write_config
from limiter.bench.overhead import closed_loop
from limiter.bench.procstat import MachineTicks, busy_share, cpu_by_role
from limiter.bench.redis_budget import main_thread_cpu_us, parse_commandstats
from limiter.bench.stack import LoggedStack, StackSpec, launch_roles, role_pids, worker_flags
from limiter.config import QosConfig, RedisConfig, validate
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import LocalRedisCluster, free_port, pools_on_distinct_shards

MASTERS = 3
POOL_PREFIX = "scale"
DEFAULT_SECONDS = 10.0
DEFAULT_IDLE_S = 3.0
DEFAULT_CONCURRENCY = 16  # per loaded pool (a frontend holds at most 32 connections per shard)
DEFAULT_OUTPUT_TOKENS = 16
DEFAULT_FRONTENDS = 2
MAX_SECONDS = 3600.0  # --seconds, --idle-seconds
MAX_RPS_PER_GPU = 1e6  # --rps-per-gpu
DEFAULT_RPS_PER_GPU = 10.0  # the sizing's stated request mix (docs/scaling.md says why)
DEFAULT_HEADROOM = 0.5  # the sizing runs shards and frontend cores at this share of their ceiling
FLEETS = (100, 1_000, 10_000)
RATIO_GOAL = 2.7  # three pools over one (issue 17)
ROLES = ("client", "frontend", "worker", "redis")


@dataclass(frozen=True)
class ScaleSpec:
    pools: int = MASTERS
    frontends: int = DEFAULT_FRONTENDS
    workers_per_pool: int = 1
    seconds: float = DEFAULT_SECONDS
    idle_s: float = DEFAULT_IDLE_S
    concurrency: int = DEFAULT_CONCURRENCY
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    max_seqs: int = 64
    rps_per_gpu: float = DEFAULT_RPS_PER_GPU
    headroom: float = DEFAULT_HEADROOM
    # > 1: the clients run in this many processes of their own (limiter/bench/load_processes.py):
    # one process of clients is the ceiling on a machine whose stack has a core per process
    client_processes: int = 1

    def check(self) -> None:
        if not 1 <= self.pools <= MASTERS:
            raise ValueError(f"pools must be in [1, {MASTERS}] (one per master)")
        counts = (self.frontends, self.workers_per_pool, self.concurrency, self.output_tokens, self.max_seqs,
                  self.client_processes)
        if min(counts) < 1:
            raise ValueError("frontends, workers per pool, concurrency, output tokens, max seqs, "
                             "client processes: >= 1")
        # each finite: NaN passed `<= 0` (an idle interval of NaN never ended), and inf has no end
        for flag, value, high in (("--seconds", self.seconds, MAX_SECONDS),
                                  ("--idle-seconds", self.idle_s, MAX_SECONDS),
                                  ("--rps-per-gpu", self.rps_per_gpu, MAX_RPS_PER_GPU),
                                  ("--headroom", self.headroom, 1)):
            if not (math.isfinite(value) and 0 < value <= high):
                raise ValueError(f"{flag}: must be in (0, {high:g}], got {value}")


def scale_config(pools: Sequence[str], redis_url: str) -> QosConfig:
    """``qos bench overhead``'s config (strict priority, nothing throttles) with one pool per
    name, each its own model name, on a cluster."""
    base = mode_spec("priority", capacity_tokens_s=UNLIMITED, context_tokens=4096).cfg
    one = base.pools[0]
    return validate(dataclasses.replace(
        base, redis=RedisConfig(url=redis_url, cluster=True),
        pools=tuple(dataclasses.replace(one, name=p, model=p) for p in pools)))


async def start_scale_stack(cluster: LocalRedisCluster, pools: Sequence[str], spec: ScaleSpec,
                            work_dir: Path) -> tuple[LoggedStack, dict[str, str]]:
    """The stack's processes; returns it and worker id -> pool once every one is ready."""
    cfg = scale_config(pools, cluster.url)
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_config(cfg, work_dir / "scale-out.toml")
    port = free_port()
    stack = LoggedStack(redis_url=cluster.url, base_url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    flags = worker_flags(StackSpec(engine="sim", time_scale=0.0, token_budget=512, max_seqs=spec.max_seqs),
                         mode_spec("priority", capacity_tokens_s=UNLIMITED, context_tokens=4096))
    # no controller: nothing to control (no capacity limit, no SLO loop)
    pool_of = await launch_roles(stack, cfg, config_path, port, frontends=spec.frontends,
                                 workers=spec.workers_per_pool * len(pools), engine="sim", worker_argv=flags,
                                 controller=False, pools=pools)
    return stack, pool_of


# --- what the shards and the processes spent ---------------------------------------------------

async def shard_counters(client: aioredis.Redis) -> sm.ShardDelta:
    """The shard's totals so far (the INFO calls of the bench itself are left out)."""
    cpu = main_thread_cpu_us(await client.info("cpu")) / 1e6
    stats = parse_commandstats(await client.info("commandstats"))
    calls = sum(n for c, (n, _) in stats.items() if c != "info")
    return sm.ShardDelta(cpu, calls, stats.get("evalsha", (0, 0.0))[0])


def minus(a: sm.ShardDelta, b: sm.ShardDelta) -> sm.ShardDelta:
    return sm.ShardDelta(a.cpu_s - b.cpu_s, a.calls - b.calls, a.evalsha - b.evalsha)


@dataclass
class Meters:
    """Every counter a phase is the difference of."""

    shards: dict[str, sm.ShardDelta]
    roles: dict[str, float]
    ticks: MachineTicks
    t: float


class Probe:
    """Direct connections to each master (INFO is per node) and the pids of each role."""

    def __init__(self, cluster: LocalRedisCluster, stack: LoggedStack) -> None:
        self.clients = {f"127.0.0.1:{n.port}": aioredis.from_url(n.url) for n in cluster.nodes}
        self.pids = role_pids(stack, [n.proc.pid for n in cluster.nodes if n.proc])

    async def read(self) -> Meters:
        shards = {a: await shard_counters(c) for a, c in self.clients.items()}
        roles = cpu_by_role({r: self.pids.get(r, []) for r in ROLES})
        return Meters(shards, roles, MachineTicks.read(), time.monotonic())

    async def keys_by_shard(self, pools: Sequence[str]) -> dict[str, dict[str, int]]:
        """shard -> pool -> keys of that pool stored there."""
        out: dict[str, dict[str, int]] = {}
        for addr, c in self.clients.items():
            out[addr] = {}
            for p in pools:
                out[addr][p] = len([k async for k in c.scan_iter(match=PoolKeys(p).pattern(), count=1000)])
        return out

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()


def phase_report(pools: Sequence[str], home: Mapping[str, str], loaded: Sequence[str],
                 completed: Mapping[str, int], errors: int, before: Meters, after: Meters,
                 background: Meters | None, idle: Meters | None, client_cpu_s: float = 0.0) -> dict[str, Any]:
    """One phase's figures from the meters read around it (and around the idle interval);
    ``client_cpu_s``: the CPU of client processes that had exited by the second read."""
    wall = after.t - before.t
    total = sum(completed.values())
    bg_s = (idle.t - background.t) if background and idle else 0.0
    shards = {}
    for p in pools:
        addr = home[p]
        bg = minus(idle.shards[addr], background.shards[addr]) if background and idle else None
        shards[p] = {"shard": addr, **sm.shard_figures(minus(after.shards[addr], before.shards[addr]), wall,
                                                       completed.get(p, 0), bg, bg_s or 1.0)}
    role_cpu = {r: after.roles[r] - before.roles[r] for r in ROLES}
    role_cpu["client"] += client_cpu_s
    busy = busy_share(before.ticks, after.ticks)
    # the cores the rest of the machine took meanwhile (other users' processes)
    other = None if busy is None else max(0.0, busy * (os.cpu_count() or 1) - sum(role_cpu.values()) / wall)
    return {"pools": len(loaded), "loaded": list(loaded), "wall_s": round(wall, 2),
            "completed": dict(completed), "errors": errors,
            "requests_s": {p: round(completed.get(p, 0) / wall, 1) for p in loaded},
            "total_requests_s": round(total / wall, 1),
            "machine_busy": _r(busy), "other_cores": _r(other),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "role_cpu_ms_per_request": {r: round(v / total * 1e3, 3) if total else None
                                        for r, v in role_cpu.items()},
            "role_cores": {r: round(v / wall, 2) for r, v in role_cpu.items()},
            "shards": shards}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def summarise(report: dict[str, Any], spec: ScaleSpec) -> None:
    """Ratios, cost drift, the projection and the sizing, added to ``report`` in place."""
    phases, pools = report["phases"], report["pools"]
    totals = [ph["total_requests_s"] for ph in phases]
    for ph, r in zip(phases, sm.ratios(totals), strict=True):
        ph["ratio"] = r
    report["cost_drift"] = {p: sm.cost_drift([ph["shards"][p]["cpu_ms_per_request"] for ph in phases])
                            for p in pools}
    last = phases[-1]
    ceilings = [last["shards"][p]["ceiling_rps"] or 0.0 for p in pools]
    report["projection"] = sm.projection(ceilings) if all(ceilings) else []
    shard_ms = [ms for p in pools if (ms := last["shards"][p]["cpu_ms_per_request"])]
    fe_ms = last["role_cpu_ms_per_request"]["frontend"]
    report["sizing"] = []
    if shard_ms and fe_ms:
        shard_us = sum(shard_ms) / len(shard_ms) * 1e3
        report["sizing_inputs"] = {"shard_us_per_request": round(shard_us, 1),
                                   "frontend_us_per_request": round(fe_ms * 1e3, 1),
                                   "requests_s_per_gpu": spec.rps_per_gpu, "headroom": spec.headroom}
        report["sizing"] = [sm.size_fleet(g, spec.rps_per_gpu, shard_us, fe_ms * 1e3, spec.headroom)
                            for g in FLEETS]


async def start_cluster(cluster: LocalRedisCluster, masters: int) -> None:
    """``cluster.start`` in a thread. A cancel cannot stop the thread midway, and a stop of the
    caller's while it runs would miss the nodes it starts after: so a cancel here waits for
    the start to end (its own failure stops what it started) before it goes on up, to a
    ``finally`` that stops every node."""
    start = asyncio.ensure_future(asyncio.to_thread(cluster.start, masters))
    try:
        await asyncio.shield(start)
    finally:
        if not start.done():
            await asyncio.wait([start])


async def run_scale_out(spec: ScaleSpec, log: Callable[[str], None] = print,
                        work_dir: Path | None = None) -> dict[str, Any]:
    """Start the cluster and the stack, measure the idle interval and each phase."""
    spec.check()
    with tempfile.TemporaryDirectory(prefix="qos-scale-out-") as tmp:
        wd = work_dir or Path(tmp)
        cluster = LocalRedisCluster(extra=["--appendonly", "no"])
        try:
            await start_cluster(cluster, MASTERS)
            pools = pools_on_distinct_shards(lambda k: f"127.0.0.1:{cluster.owner(k).port}", spec.pools,
                                             POOL_PREFIX)
            home = {p: f"127.0.0.1:{cluster.owner(PoolKeys(p).policy).port}" for p in pools}
            where = ", ".join(f"{p} on {a}" for p, a in home.items())
            log(f"[dim]  cluster of {MASTERS} masters; pools {where}[/]")
            stack, pool_of = await start_scale_stack(cluster, pools, spec, wd)
            try:
                return await _measure(spec, cluster, stack, pools, home, pool_of, log)
            finally:
                await asyncio.to_thread(stack.stop, 10.0)
        finally:
            await asyncio.to_thread(cluster.stop)


async def _measure(spec: ScaleSpec, cluster: LocalRedisCluster, stack: LoggedStack, pools: list[str],
                   home: dict[str, str], pool_of: dict[str, str],
                   log: Callable[[str], None]) -> dict[str, Any]:
    key = api_key("P0")
    probe = Probe(cluster, stack)
    try:
        # warm up: scripts loaded, connections open
        await asyncio.gather(*(closed_loop(stack.base_url, key, p, min(2.0, spec.seconds), 4,
                                           spec.output_tokens) for p in pools))
        await asyncio.sleep(0.5)
        quiet0 = await probe.read()
        await asyncio.sleep(spec.idle_s)
        quiet1 = await probe.read()
        phases = []
        for k in range(1, len(pools) + 1):
            loaded = pools[:k]
            before, after, load = await _phase(spec, stack.base_url, key, loaded, probe)
            ph = phase_report(pools, home, loaded, load.completed, load.errors, before, after, quiet0, quiet1,
                              client_cpu_s=load.cpu_s)
            phases.append(ph)
            if load.late_s > 0.5:
                log(f"[yellow]  a client process started {load.late_s:.1f} s late: the phase is "
                    f"partly unloaded[/]")
            log(f"[dim]  {k} pool(s): {ph['total_requests_s']:,.0f} req/s "
                f"({', '.join(f'{v:,.0f}' for v in ph['requests_s'].values())}), {load.errors} errors, "
                f"machine {ph['machine_busy'] or 0:.0%} busy[/]")
            await asyncio.sleep(0.5)
        keys = await probe.keys_by_shard(pools)
        report: dict[str, Any] = {
            "params": {**dataclasses.asdict(spec), "cpus": os.cpu_count(), "masters": MASTERS,
                       "workers": pool_of},
            "pools": pools, "home": home, "phases": phases,
            "background": {home[p]: sm.shard_figures(minus(quiet1.shards[home[p]], quiet0.shards[home[p]]),
                                                     quiet1.t - quiet0.t, 0) for p in pools},
            "isolation": {"keys_by_shard": keys, "keys_elsewhere": sm.pools_elsewhere(keys, home)},
            "goals": {"ratio_3_pools": RATIO_GOAL}}
        summarise(report, spec)
        return report
    finally:
        await probe.close()


async def _phase(spec: ScaleSpec, url: str, key: str, loaded: Sequence[str],
                 probe: Probe) -> tuple[Meters, Meters, ClientLoad]:
    """One phase's load on ``loaded``, in this process or in client processes of their own
    (started first, the phase beginning when they all begin), and the meters read around it."""
    if spec.client_processes == 1:
        before = await probe.read()
        got = await asyncio.gather(*(closed_loop(url, key, p, spec.seconds, spec.concurrency,
                                                 spec.output_tokens) for p in loaded))
        after = await probe.read()
        return before, after, ClientLoad(*tally(loaded, got), cpu_s=0.0, late_s=0.0)
    start_at = time.time() + START_ALLOWANCE_S
    running = asyncio.ensure_future(run_clients(spec.client_processes, url, key, loaded, spec.seconds,
                                                spec.concurrency, spec.output_tokens, start_at))
    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        before = await probe.read()
        load = await running
    finally:
        if not running.done():  # the probe failed, or this was cancelled: the children are killed
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    return before, await probe.read(), load
