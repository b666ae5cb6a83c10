"""One mode's stack, started the way ``qos up`` starts one, and what Redis tells us about it.

Each role is its own OS process (``qos frontend|worker|controller --config <mode>.toml``)
on a private ``redis-server``, built by :func:`limiter.localstack.launcher.build_commands` and
stopped by :meth:`limiter.localstack.launcher.Stack.stop`; the benchmark only adds the worker flags
of the mode and sends each child's output to a log file, so the progress bar stays readable and a failed
run can be diagnosed from ``<out>/logs/``.

:class:`Probe` samples the pool while the load runs (policy rates, capacity, queue depths)
and reads, after it, the controller's decision stream, the latency samples (queue waits
per tenant) and ``INFO commandstats``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis.asyncio as aioredis

from limiter.bench.modes import POOL, ModeSpec, write_config
from limiter.config import QosConfig
from limiter.keys import PoolKeys, policy_text
from limiter.lifecycle import listen_socket
from limiter.localstack.launcher import Child, Stack, build_commands, wait_ready
from limiter.localstack.redis_server import RedisServer, free_port


class LoggedStack(Stack):
    """A :class:`Stack` whose children write to ``log_dir/<child>.log``."""

    label = "bench stack"

    def __init__(self, *args: Any, log_dir: Path, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.log_dir = log_dir
        self.env: dict[str, str] = {}  # what the children were started with (a restart reuses it)

    def start(self, child: Child, env: dict[str, str], **popen: Any) -> None:
        child.log = self.log_dir / f"{child.name}.log"  # a restarted child appends
        super().start(child, env, **popen)

    def stop(self, timeout_s: float = 20.0) -> None:  # type: ignore[override]
        super().stop({"frontend": timeout_s, "worker": timeout_s, "controller": timeout_s})


@dataclass(frozen=True)
class StackSpec:
    """How many of each role, and the worker flags shared by every mode."""

    engine: str = "sim"
    workers: int = 4
    frontends: int = 1
    time_scale: float = 1.0
    token_budget: int = 256
    max_seqs: int = 16
    torch_threads: int = 1
    ready_timeout_s: float = 120.0
    upstream_url: str | None = None  # the openai engine's model server


def worker_flags(spec: StackSpec, mode: ModeSpec) -> list[str]:
    flags = ["--token-budget", str(spec.token_budget), "--max-seqs", str(spec.max_seqs),
             "--chunked-prefill" if mode.chunked_prefill else "--no-chunked-prefill"]
    if spec.engine == "sim":
        flags += ["--time-scale", repr(spec.time_scale)]
    elif spec.engine == "torch":
        flags += ["--torch-threads", str(spec.torch_threads)]
    return flags


async def start_stack(spec: StackSpec, mode: ModeSpec, work_dir: Path) -> LoggedStack:
    """Private Redis + the mode's roles; returns once /readyz answers and every worker beat."""
    log_dir = work_dir / "logs" / mode.name
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_config(mode.cfg, work_dir / f"{mode.name}.toml")
    server = RedisServer(extra=["--appendonly", "no"]).start()
    port = free_port()
    stack = LoggedStack(redis_url=server.url, base_url=f"http://127.0.0.1:{port}", redis=server,
                        log_dir=log_dir)
    await launch_roles(stack, mode.cfg, config_path, port, frontends=spec.frontends, workers=spec.workers,
                       engine=spec.engine, worker_argv=worker_flags(spec, mode), controller=mode.controller,
                       threads=spec.torch_threads, ready_timeout_s=spec.ready_timeout_s,
                       upstream_url=spec.upstream_url)
    return stack


async def launch_roles(stack: LoggedStack, cfg: QosConfig, config_path: Path, port: int, *, frontends: int,
                       workers: int, engine: str, worker_argv: Sequence[str], controller: bool,
                       threads: int = 1, ready_timeout_s: float = 120.0,
                       pools: Sequence[str] = (), upstream_url: str | None = None) -> dict[str, str]:
    """Start a benchmark stack's roles with ``qos up``'s command lines (the frontends inherit
    ``port``, bound here) on ``stack.redis_url``; return once /readyz answers and every worker
    beat. ``worker_argv`` goes to every worker; with ``pools`` the workers are spread over
    them in turn (``--pool``); ``upstream_url`` is the openai engine's model server. Returns
    worker id -> pool (empty without ``pools``). On any failure the stack, its Redis included,
    is stopped."""
    args = argparse.Namespace(frontends=frontends, host="127.0.0.1", port=port, workers=workers,
                              engine=engine, device="cpu", upstream_url=upstream_url, standby=False,
                              config=str(config_path))
    env = dict(os.environ, QOS_REDIS_URL=stack.redis_url, OMP_NUM_THREADS=str(threads))
    env.pop("QOS_CONFIG", None)
    stack.env = env
    pool_of: dict[str, str] = {}
    try:
        children = build_commands(args)
        for child in children:
            if child.role == "controller" and not controller:
                continue
            if child.role == "worker":
                child.argv += worker_argv
                if pools:
                    pool_of[child.worker_id] = pool = pools[len(pool_of) % len(pools)]
                    child.argv += ["--pool", pool]
            if child.role == "frontend":  # the port is bound here, the frontend inherits it
                child.sock = listen_socket("127.0.0.1", port, reuse_port=frontends > 1)
            stack.start(child, env)
        await wait_ready(stack, cfg, [c.worker_id for c in children if c.role == "worker"], 0,
                         ready_timeout_s, pool_of=pool_of or None)
    except BaseException:
        stack.stop(5.0)
        raise
    return pool_of


def role_pids(stack: Stack, redis_pids: Sequence[int]) -> dict[str, list[int]]:
    """The processes a request crosses, by role: this process (the load generator), the
    stack's children (frontend, worker, controller) and its Redis server(s)."""
    pids: dict[str, list[int]] = {"client": [os.getpid()], "redis": list(redis_pids)}
    for c in stack.children:
        if c.proc is not None:
            pids.setdefault(c.role, []).append(c.proc.pid)
    return pids


# --- what Redis says ----------------------------------------------------------------------------

def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class Probe:
    """Samples the pool every ``interval_s`` during a run; reads the streams after it."""

    redis_url: str
    classes: tuple[str, ...]
    interval_s: float = 1.0
    t0: float = field(default_factory=time.monotonic)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = PoolKeys(POOL)
        self.client = aioredis.from_url(self.redis_url)

    async def work_done(self) -> float:
        """Weighted tokens of useful work the live workers did since they started (the sum of
        their heartbeats' ``work_done``: first-time prefill and generated tokens, no
        recomputation), as of their last heartbeat."""
        total = 0.0
        for w in await self.client.zrange(self.keys.workers, 0, -1):
            total += _float(_s(await self.client.hget(self.keys.worker(_s(w)), "work_done") or b"0")) or 0.0
        return total

    async def sample(self) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.policy)
            pipe.hgetall(self.keys.compliance)
            pipe.hgetall(self.keys.queued)
            policy, compliance, queued = await pipe.execute()
        work = await self.work_done()
        workers = await self.worker_states()
        pol = policy_text(policy)
        comp = {_s(k): _s(v) for k, v in compliance.items()}
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 2), "work_done": round(work, 1),
                               "capacity": _float(pol.get("capacity")),
                               "measured_capacity": _float(comp.get(".capacity")),
                               "rates": {c: _float(pol.get(f"{c}.rate")) for c in self.classes},
                               "ceilings": {c: _float(pol.get(f"{c}.ceil")) for c in self.classes},
                               "compliance": {c: _float(comp.get(c)) for c in self.classes},
                               "queue_depth": {c: int(_float(_s(queued.get(c.encode(), b"0"))) or 0)
                                               for c in self.classes},
                               "workers": workers}
        self.timeline.append(row)

    WORKER_FIELDS = ("batch_size", "running", "waiting", "kv_use", "token_budget", "step_ms", "step_gap_ms",
                     "capacity_tokens_s", "tokens_s")

    async def worker_states(self) -> dict[str, dict[str, float | None]]:
        """Each live worker's heartbeat figures (batch, waiting, KV use, step budget, step time)."""
        out = {}
        for w in await self.client.zrange(self.keys.workers, 0, -1):
            got = await self.client.hmget(self.keys.worker(_s(w)), list(self.WORKER_FIELDS))
            out[_s(w)] = {k: _float(_s(v)) if v is not None else None
                          for k, v in zip(self.WORKER_FIELDS, got, strict=True)}
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set; a Redis hiccup skips one sample, nothing more."""
        while not stop.is_set():
            with contextlib.suppress(Exception):
                await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def decisions(self) -> list[dict[str, Any]]:
        """The controller's rate changes (``qos:{pool}:decisions``), oldest first."""
        import json

        out = []
        for _id, fields in await self.client.xrange(self.keys.decisions):
            f = {_s(k): v for k, v in fields.items()}
            try:
                d = json.loads(f["d"])
            except (KeyError, ValueError):
                continue
            out.append({"version": int(f.get("version", 0)), "now_ms": d.get("now_ms"),
                        "capacity": d.get("capacity", {}).get("new"),
                        "classes": {c: {"reason": v.get("reason"), "rate": v.get("new", {}).get("rate"),
                                        "ceil": v.get("new", {}).get("ceil"),
                                        "compliance": v.get("compliance")}
                                    for c, v in d.get("classes", {}).items()}})
        return out

    async def preemptions(self) -> dict[str, int]:
        """Sequences paused for a higher class, and the KV tokens those pauses threw away,
        summed over the live workers' heartbeats (each counts since its start)."""
        out = {"preemptions": 0, "recompute_tokens": 0}
        for w in await self.client.zrange(self.keys.workers, 0, -1):
            got = await self.client.hmget(self.keys.worker(_s(w)), list(out))
            for k, v in zip(list(out), got, strict=True):
                out[k] += int(float(v)) if v is not None else 0
        return out

    async def samples(self) -> list[dict[str, Any]]:
        """Every latency sample of the run (the stream keeps the last 100 000)."""
        out = []
        last = "-"
        while True:
            batch = await self.client.xrange(self.keys.samples, min=last, count=5000)
            if last != "-" and batch:
                batch = batch[1:]
            if not batch:
                return out
            for _id, fields in batch:
                raw = fields.get(b"d")
                if raw is not None:
                    with contextlib.suppress(Exception):
                        out.append(msgpack.unpackb(raw, raw=False))
            last = _s(batch[-1][0])

    async def reset(self) -> None:
        """Full buckets, fresh tenant counters, an empty floor ledger and no decision history:
        what the gap probe spent must not tilt the load that follows."""
        keys = []
        for prefix in (self.keys.bucket_prefix, self.keys.vtime_prefix):
            keys += [k async for k in self.client.scan_iter(match=prefix + "*", count=1000)]
        await self.client.delete(*keys, self.keys.served, self.keys.decisions)

    async def redis_time_ms(self) -> float:
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) / 1000

    async def commandstats(self) -> dict[str, int]:
        info = await self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if isinstance(v, dict)}

    async def close(self) -> None:
        await self.client.aclose()


class CommandMonitor:
    """Counts the commands *clients* send (``MONITOR``), by name, EVALSHA by script name.

    ``INFO commandstats`` (and ``total_commands_processed``) also count the commands a Lua
    script calls inside Redis, so they cannot tell one EVALSHA round trip from the ten
    HSETs it runs; MONITOR tags those ``lua`` and they are counted apart here. MONITOR costs
    Redis some throughput, so it is only switched on for a measurement at a fixed rate.
    """

    IGNORED = frozenset({"INFO", "MONITOR", "HELLO", "CLIENT", "PING"})

    def __init__(self, redis_url: str) -> None:
        import hashlib

        from limiter.scripts import SCRIPT_NAMES, script_source

        self.client = aioredis.from_url(redis_url)
        self.sha = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in SCRIPT_NAMES}
        self.top: dict[str, int] = {}
        self.in_scripts = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def _read(self) -> None:
        async with self.client.monitor() as mon:
            self._ready.set()
            async for info in mon.listen():
                words = str(info.get("command", "")).split(" ", 2)
                name = words[0].upper()
                if info.get("client_type") == "lua":
                    self.in_scripts += 1
                    continue
                if name in self.IGNORED:
                    continue
                if name == "EVALSHA" and len(words) > 1:
                    name = f"EVALSHA {self.sha.get(words[1], words[1][:8])}"
                self.top[name] = self.top.get(name, 0) + 1

    async def start(self) -> None:
        self._task = asyncio.create_task(self._read())
        await asyncio.wait_for(self._ready.wait(), 5)
        await asyncio.sleep(0.05)

    async def stop(self) -> dict[str, int]:
        await asyncio.sleep(0.2)  # the last replies' commands are still on their way
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self.client.aclose()
        return dict(sorted(self.top.items(), key=lambda kv: -kv[1]))


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None
