"""Admission micro-benchmark: admit+enqueue decisions/s and p50/p99 latency.

Three operations on the same Redis, side by side in one run, each at concurrency 1 and 50:

* ``SET`` of a random key with a ~100-byte value: the one-round-trip floor;
* ``admit``: ``admit.lua`` (tenant quota + wait estimate + enqueue), a unique request
  id per call and a ~100-byte msgpack payload, through :meth:`Scripts.admit`;
* ``limits``: the ``limits`` library's moving-window limiter (``MovingWindowRateLimiter``
  on ``limits.aio.storage.RedisStorage``, redis-py implementation), with a limit so
  generous that it always says yes.

Two drivers measure them:

* ``redis-py``: one ``redis.asyncio`` client (one connection pool, shared by the limits
  storage), N asyncio tasks issuing a fixed number of operations; latency is what an
  awaiting caller sees, Python client overhead included;
* ``redis-benchmark``: the C load generator, no Python in the path, so it shows what the
  server spends per decision. ``admit`` runs as ``EVALSHA <sha> 22 <keys> ...`` with
  request id ``r__rand_int__`` (``-r 100000000``), ``limits`` as ``EVALSHA`` of its
  ``acquire_moving_window`` script with a fixed timestamp.

Before every measured run the server is emptied (``FLUSHALL`` on the private server; on a
server given with ``--redis-url`` only the benchmark's own keys are deleted) and the pool
policy is written again, so the queue and the moving-window list stay bounded.
Figures are printed (and optionally written as JSON), never asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import random
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis

from limiter.config import QosConfig, demo_config
from limiter.keys import PoolKeys
from limiter.localstack.redis_server import RedisServer
from limiter.scripts import Scripts, lifecycle_keys, policy_document, script_source

POOL = "bench"
CLASS = "P1"
TENANT = "bench-t1"
FRONTEND = "bench-fe"
SET_PREFIX = "qosbench:set:"
LIMITS_PREFIX = "qosbench-limits"
LIMIT_PER_SECOND = 1_000_000_000  # so generous that the moving window always says yes
TENANT_RATE = 1e12  # admit.lua's maxima for the tenant bucket: never throttles
TENANT_BURST = 1e15
INPUT_TOKENS = 100
MAX_TOKENS = 64
OPS = ("SET", "admit", "limits")
CONCURRENCY = (1, 50)
RB_KEYSPACE = 100_000_000

DEFAULT_OPS = 10000  # redis-py driver: operations per measured run
DEFAULT_RB_SECONDS = 2.5  # redis-benchmark: target length of one run
QUICK_OPS = 800
QUICK_RB_SECONDS = 0.4
DEFAULT_ROUNDS = 2  # best of 2, interleaved


def request_payload() -> bytes:
    """A realistic ~100-byte msgpack payload (prompt + sampling params), no NUL bytes so
    that redis-benchmark can pass it as an argument."""
    payload = msgpack.packb({"prompt": "Summarise the quarterly report in three bullet points.",
                             "max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.95})
    assert b"\0" not in payload
    return payload


def bench_config(base: QosConfig | None = None) -> QosConfig:
    """The base (demo) config with a pool ``bench`` that never throttles nor fills a queue."""
    base = base or demo_config()
    pool = dataclasses.replace(base.pools[0], name=POOL, model=POOL, capacity_tokens_s=1e12)
    classes = tuple(dataclasses.replace(c, queue_cap=100_000_000, max_wait_ms=86_400_000)
                    for c in base.classes)
    return dataclasses.replace(base, pools=(pool,), classes=classes)


# --- results ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    driver: str  # "redis-py" | "redis-benchmark"
    op: str  # "SET" | "admit" | "limits"
    concurrency: int
    ops: int
    seconds: float
    per_s: float  # decisions (or SETs) per second
    p50_ms: float
    p99_ms: float
    rejected: int = 0  # limits said no / admit did not queue (should be 0)


@dataclass
class AdmissionReport:
    measurements: list[Measurement] = field(default_factory=list)  # the best run of each
    runs: list[Measurement] = field(default_factory=list)  # every run, in order
    meta: dict[str, Any] = field(default_factory=dict)

    def get(self, driver: str, op: str, concurrency: int) -> Measurement | None:
        for m in self.measurements:
            if (m.driver, m.op, m.concurrency) == (driver, op, concurrency):
                return m
        return None

    def ratios(self) -> list[dict[str, Any]]:
        """admit/SET and admit/limits throughput per driver and concurrency."""
        out = []
        for driver in dict.fromkeys(m.driver for m in self.measurements):
            for c in dict.fromkeys(m.concurrency for m in self.measurements if m.driver == driver):
                set_, admit, lim = (self.get(driver, op, c) for op in OPS)
                if admit is None:
                    continue
                out.append({
                    "driver": driver, "concurrency": c,
                    "admit_over_set": admit.per_s / set_.per_s if set_ else None,
                    "admit_over_limits": admit.per_s / lim.per_s if lim else None,
                })
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "measurements": [dataclasses.asdict(m) for m in self.measurements],
                "ratios": self.ratios(), "runs": [dataclasses.asdict(m) for m in self.runs],
                "targets": {"admit_over_set": 0.7, "admit_over_limits": 1.0}}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..1)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def unlink_matching(client: aioredis.Redis, *patterns: str) -> None:
    """Delete the keys matching ``patterns`` (SCAN + UNLINK in batches): a benchmark's own keys
    on a server it does not own."""
    for pattern in patterns:
        batch = []
        async for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                await client.unlink(*batch)
                batch = []
        if batch:
            await client.unlink(*batch)


# --- the redis-py driver ----------------------------------------------------------------

async def drive(op: Callable[[], Awaitable[bool]], ops: int,
                concurrency: int) -> tuple[float, list[float], int]:
    """Run ``op`` ``ops`` times from ``concurrency`` tasks; (seconds, latencies s, rejected)."""
    latencies: list[float] = []
    remaining = ops
    rejected = 0
    clock = time.perf_counter

    async def worker() -> None:
        nonlocal remaining, rejected
        while remaining > 0:
            remaining -= 1
            t0 = clock()
            ok = await op()
            latencies.append(clock() - t0)
            if not ok:
                rejected += 1

    start = clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return clock() - start, latencies, rejected


class Target:
    """The Redis under test: resets it between runs and builds the three operations."""

    def __init__(self, client: aioredis.Redis, private: bool, cfg: QosConfig) -> None:
        self.client = client
        self.private = private
        self.cfg = cfg
        self.keys = PoolKeys(POOL)
        names = cfg.class_names()
        self.cls = CLASS if CLASS in names else names[0]  # a --config may name its classes otherwise
        self.scripts = Scripts(client)
        self.payload = request_payload()
        self.value = b"v" * len(self.payload)
        self._ids = itertools.count()
        self._run = 0
        self.limiter: Any = None
        try:
            from limits import RateLimitItemPerSecond
            from limits.aio.storage import RedisStorage
            from limits.aio.strategies import MovingWindowRateLimiter
        except ImportError:  # limits is a dev dependency; without it the row is left out
            return
        # The storage shares our connection pool; the URI is parsed but not used to connect.
        kw = client.connection_pool.connection_kwargs
        uri = f"async+redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        self.limits_storage = RedisStorage(uri, implementation="redispy",
                                           key_prefix=LIMITS_PREFIX, connection_pool=client.connection_pool)
        self.limiter = MovingWindowRateLimiter(self.limits_storage)
        self.limit = RateLimitItemPerSecond(LIMIT_PER_SECOND)

    def ops(self) -> tuple[str, ...]:
        return OPS if self.limiter is not None else OPS[:2]

    async def prepare(self) -> None:
        await self.scripts.load_all()
        if self.limiter is not None:
            await self.client.script_load(self.limits_storage.bridge.lua_acquire_moving_window.script)
        await self.reset()

    async def reset(self) -> None:
        """Empty the server (or our keys on a shared one) and write the pool policy again."""
        if self.private:
            await self.client.flushall()
        else:
            await unlink_matching(self.client, self.keys.pattern(), SET_PREFIX + "*", LIMITS_PREFIX + ":*")
        cfg = self.cfg
        await self.scripts.init_pool(self.keys, policy_document(cfg, cfg.pool(POOL)), reset_rates=True)
        self._run += 1

    async def admitted(self) -> int:
        return int(await self.client.hget(self.keys.stats, f"{self.cls}.admitted") or 0)

    def op(self, name: str) -> Callable[[], Awaitable[bool]]:
        if name == "SET":
            client, value, rnd = self.client, self.value, random.getrandbits

            async def do_set() -> bool:
                return bool(await client.set(f"{SET_PREFIX}{rnd(48)}", value))
            return do_set
        if name == "admit":
            scripts, keys, payload, ids, run, cls = (self.scripts, self.keys, self.payload, self._ids,
                                                     self._run, self.cls)

            async def do_admit() -> bool:
                a = await scripts.admit(
                    keys, request_id=f"b{run}-{next(ids)}", tenant=TENANT, cls=cls,
                    input_tokens=INPUT_TOKENS, max_tokens=MAX_TOKENS, tenant_rate=TENANT_RATE,
                    tenant_burst=TENANT_BURST, tenant_max_inflight=0, max_wait_ms=0,
                    frontend_id=FRONTEND, payload=payload)
                return a.duplicate_state is None
            return do_admit
        if name == "limits":
            limiter, item = self.limiter, self.limit

            async def do_limits() -> bool:
                return await limiter.hit(item, TENANT)
            return do_limits
        raise ValueError(name)


async def measure_py(target: Target, name: str, ops: int, concurrency: int) -> Measurement:
    await target.reset()
    warm = max(concurrency * 4, ops // 10)
    await drive(target.op(name), warm, concurrency)  # opens the pool's connections
    gc.collect()
    seconds, lat, rejected = await drive(target.op(name), ops, concurrency)
    lat.sort()
    return Measurement("redis-py", name, concurrency, ops, seconds, ops / seconds,
                       percentile(lat, 0.50) * 1e3, percentile(lat, 0.99) * 1e3, rejected)


# --- the redis-benchmark driver ---------------------------------------------------------

def rb_command(target: Target, name: str) -> list[bytes]:
    """The command line redis-benchmark sends for one operation."""
    if name == "SET":
        return [b"SET", f"{SET_PREFIX}__rand_int__".encode(), target.value]
    if name == "admit":
        keys = [k.encode() for k in lifecycle_keys(target.keys)]
        args = [b"r__rand_int__", TENANT.encode(), target.cls.encode(), str(INPUT_TOKENS).encode(),
                str(MAX_TOKENS).encode(), repr(TENANT_RATE).encode(), repr(TENANT_BURST).encode(),
                b"0", b"0", FRONTEND.encode(), target.payload]
        sha = hashlib.sha1(script_source("admit").encode()).hexdigest().encode()
        return [b"EVALSHA", sha, str(len(keys)).encode(), *keys, *args]
    if name == "limits":
        script = target.limits_storage.bridge.lua_acquire_moving_window
        key = f"{LIMITS_PREFIX}:{target.limit.key_for(TENANT)}".encode()
        return [b"EVALSHA", script.sha.encode(), b"1", key, repr(time.time()).encode(),
                str(LIMIT_PER_SECOND).encode(), str(target.limit.get_expiry()).encode(), b"1"]
    raise ValueError(name)


def run_redis_benchmark(url: str, command: list[bytes], requests: int, concurrency: int) -> dict[str, float]:
    """One redis-benchmark run; returns its CSV figures (rps, p50_latency_ms, p99_latency_ms, ...)."""
    argv = [b"redis-benchmark", b"-u", url.encode(), b"-c", str(concurrency).encode(), b"-n",
            str(requests).encode(), b"-r", str(RB_KEYSPACE).encode(), b"--csv", *command]
    proc = subprocess.run(argv, capture_output=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.strip()]
    try:
        # The first column echoes the command (binary payload included, unescaped), so take
        # the numeric columns from the right.
        names = [n.strip('"') for n in lines[0].split(",")][1:]
        values = [float(v.strip('"')) for v in lines[-1].rsplit(",", len(names))[1:]]
        return dict(zip(names, values, strict=True))
    except (IndexError, ValueError) as exc:
        err = proc.stderr.decode(errors="replace").strip() or "\n".join(lines)
        raise RuntimeError(f"redis-benchmark failed (rc {proc.returncode}): {err[-500:]}") from exc


async def check_command(target: Target, name: str, command: list[bytes]) -> None:
    """Send the redis-benchmark command once ourselves: an error reply would otherwise be
    counted by redis-benchmark as a fast 'request'."""
    args = [a.replace(b"__rand_int__", b"000000000000") for a in command]
    reply = await target.client.execute_command(*args)
    ok = {"SET": lambda r: r is True or r == b"OK", "admit": lambda r: r[0] == b"queued",
          "limits": lambda r: r == 1}[name](reply)
    if not ok:
        raise RuntimeError(f"{name}: unexpected reply {reply!r} to the redis-benchmark command")


async def measure_rb(target: Target, url: str, name: str, concurrency: int, seconds: float) -> Measurement:
    command = rb_command(target, name)
    await target.reset()
    await check_command(target, name, command)
    probe_n = max(2000, concurrency * 40)  # ~0.1-0.3 s: enough to size the real run
    probe = await asyncio.to_thread(run_redis_benchmark, url, command, probe_n, concurrency)
    requests = max(probe_n, int(probe["rps"] * seconds))
    await target.reset()
    before = await target.admitted()
    t0 = time.perf_counter()
    row = await asyncio.to_thread(run_redis_benchmark, url, command, requests, concurrency)
    wall = time.perf_counter() - t0
    rejected = 0
    if name == "admit":  # random-id collisions get the cheap 'duplicate' reply
        rejected = requests - (await target.admitted() - before)
    return Measurement("redis-benchmark", name, concurrency, requests, wall, row["rps"],
                       row["p50_latency_ms"], row["p99_latency_ms"], rejected)


# --- the whole run ----------------------------------------------------------------------

async def run_admission(*, ops: int = DEFAULT_OPS, rb_seconds: float = DEFAULT_RB_SECONDS,
                        concurrency: Sequence[int] = CONCURRENCY, redis_url: str | None = None,
                        redis_benchmark: bool = True, base: QosConfig | None = None,
                        rounds: int = DEFAULT_ROUNDS,
                        progress: Callable[[Measurement], None] | None = None) -> AdmissionReport:
    """Run the benchmark; a private redis-server unless ``redis_url`` is given.

    With ``rounds`` > 1 every measurement is repeated (interleaved, round after round) and
    the report keeps, per (driver, op, concurrency), the run with the highest throughput:
    on a shared machine, the least disturbed one. ``report.runs`` keeps them all."""
    server = None if redis_url else RedisServer().start()
    url = redis_url or server.url
    client = aioredis.from_url(url)
    report = AdmissionReport()
    started = time.perf_counter()
    try:
        target = Target(client, private=server is not None, cfg=bench_config(base))
        await target.prepare()
        info = await client.info("server")
        use_rb = redis_benchmark and shutil.which("redis-benchmark") is not None
        report.meta = {
            "redis_version": info.get("redis_version"), "private_server": server is not None,
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "limits_version": _limits_version(), "ops_per_run": ops, "rb_seconds": rb_seconds,
            "payload_bytes": len(target.payload), "redis_benchmark": use_rb,
            "limits_item": f"{LIMIT_PER_SECOND}/second moving window, one key", "rounds": rounds,
        }
        for _ in range(rounds):
            for c in concurrency:
                for name in target.ops():
                    m = await measure_py(target, name, ops, c)
                    report.runs.append(m)
                    if progress:
                        progress(m)
            if use_rb:
                for c in concurrency:
                    for name in target.ops():
                        m = await measure_rb(target, url, name, c, rb_seconds)
                        report.runs.append(m)
                        if progress:
                            progress(m)
        best: dict[tuple[str, str, int], Measurement] = {}
        for m in report.runs:
            k = (m.driver, m.op, m.concurrency)
            if k not in best or m.per_s > best[k].per_s:
                best[k] = m
        report.measurements = list(best.values())
        await target.reset()
        if not target.private:  # leave a shared server as we found it (minus the policy)
            await client.unlink(target.keys.policy)
    finally:
        await client.aclose()
        if server is not None:
            server.stop()
    report.meta["total_seconds"] = round(time.perf_counter() - started, 1)
    return report


def _limits_version() -> str | None:
    try:
        import limits
    except ImportError:
        return None
    return limits.__version__


# --- output -----------------------------------------------------------------------------

def render(report: AdmissionReport) -> Any:
    """A rich renderable: the measurements table and the ratio table."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title="Admission: decisions/s and latency (same Redis, same run)")
    for col, just in (("driver", "left"), ("op", "left"), ("conc", "right"), ("ops", "right"),
                      ("per s", "right"), ("p50 ms", "right"), ("p99 ms", "right"), ("no", "right")):
        table.add_column(col, justify=just)
    for m in report.measurements:
        table.add_row(m.driver, m.op, str(m.concurrency), f"{m.ops:,}", f"{m.per_s:,.0f}",
                      f"{m.p50_ms:.3f}", f"{m.p99_ms:.3f}", str(m.rejected))
    ratios = Table(title="Ratios (targets: admit/SET >= 0.7, admit/limits >= 1)")
    for col in ("driver", "conc", "admit/SET", "admit/limits"):
        ratios.add_column(col, justify="left" if col == "driver" else "right")

    def fmt(v: float | None, target: float) -> str:
        if v is None:
            return "-"
        return f"[{'green' if v >= target else 'red'}]{v:.2f}[/]"

    for r in report.ratios():
        ratios.add_row(r["driver"], str(r["concurrency"]), fmt(r["admit_over_set"], 0.7),
                       fmt(r["admit_over_limits"], 1.0))
    m = report.meta
    note = (f"redis {m.get('redis_version')} ({'private' if m.get('private_server') else 'given'} server), "
            f"{m.get('cpus')} CPUs, python {m.get('python')}, limits {m.get('limits_version')}, "
            f"payload {m.get('payload_bytes')} B, best of {m.get('rounds')} round(s), "
            f"{m.get('total_seconds')} s in all. "
            "'no' = limits said no / admit got a 'duplicate' (redis-benchmark random-id collisions).")
    return Group(table, ratios, note)


def write_json(report: AdmissionReport, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report.to_dict(), fh, indent=2)
        fh.write("\n")
