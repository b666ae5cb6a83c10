"""``qos bench redis-budget``: Redis microseconds per request, script by script.

Every state transition of a request is one Lua script, and a shard runs one script at a
time: the Redis time a request's whole lifecycle costs bounds the requests/s one shard can
carry. This measures it against a private redis-server, with no frontend nor worker
process: the scripts are driven through :class:`~limiter.scripts.Scripts` as the worker
drives them --

* ``admit``, one request a call, and eight (``admit x8``: a loaded frontend's admits of one
  event-loop turn, which its script batcher sends as one call);
* ``claim`` in batches of 1 and of 8 (a worker claims as many as it has free slots);
* ``push_tokens``: an attempt's first token at once, then one push per request every
  ``flush_ms`` with the tokens made meanwhile (``ceil(flush_ms / step_ms)``, at most
  ``flush_tokens``; worker/delivery.py); the last tokens ride on ``complete``. Measured one
  request per call, and eight per call (``push_tokens (first) x8`` and ``push_tokens x8``:
  the step worker sends every request due at a step in one call, and requests claimed
  together make their first tokens at the same step; ``--push-batch N``: N to a call, as a
  GPU's step of N running sequences pushes them, its worker's push clock keeping them in
  step, worker/push_clock.py). Each call appends one reply entry per
  frontend of its requests, as it does for this release's frontends (``--reply-entries
  each``: one per request, as for a frontend of an older release); the requests come from
  ``--frontends`` frontends in turn, so a call of 8 carries min(8, frontends) of them. A
  request whose client does not stream is pushed every ``unstreamed_flush_ms`` (1 s) after
  its first token, however many tokens that is (``push_tokens x8 unstreamed``, 80 tokens
  each at 12.5 ms steps): the budget's "unstreamed" columns;
* ``complete`` with a latency sample, one request per call, and eight (``complete x8``: a
  step worker's completions of one step, which its script batcher sends as one call);
* ``renew_leases``: every ``lease_ms / 3`` over every held request (worker/runtime.py): a
  request's share is its time on the worker (tokens x step_ms) over that period;
* ``cancel check``: the worker's ``SMISMEMBER`` of the cancels set over every held request,
  every ``flush_ms`` (worker/claim_step_loop.py; a push does not say whether its client
  cancelled): a request's share is its time on the worker over ``flush_ms``. Not a script:
  its ``SMISMEMBER`` row of ``INFO commandstats``.

Each script runs alone between two ``CONFIG RESETSTAT``; its ``EVALSHA`` row of ``INFO
commandstats`` gives the mean Redis time of one call (the script's inner commands are
counted there too, and also on rows of their own: the inner calls per script call are
reported), and ``SLOWLOG`` the median (calls slower than 10 us only: logging every inner
command would slow the scripts down; limiter/bench/slowlog.py). The per-request budget at a
number of output tokens is then arithmetic (:func:`budget`), as is the goal check: admit
<= 50 us, the whole lifecycle <= 150 us + 2 us per output token (issue 17). Printed (and
optionally written as JSON), never asserted.

With ``instructions``, the private server runs under valgrind's callgrind and every phase
also gets the instructions the server ran per call (limiter/bench/callgrind.py): figures
that do not move with the machine's load, to compare two versions of the scripts with
(``--baseline``). Its times are callgrind's (tens of times slower) and SLOWLOG is off (its
entries would be counted as the calls' work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import platform
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from limiter.bench import callgrind
from limiter.bench.admission import bench_config, request_payload, unlink_matching
from limiter.bench.slowlog import SLOWLOG_US, log_slow_calls, quantile_us, script_durations
from limiter.config import QosConfig
from limiter.keys import PoolKeys
from limiter.samples import build_sample, pack_sample
from limiter.scripts import PUSH_LIMIT, Claimed, Scripts, TokenBatch, policy_document
from worker.settings import WorkerSettings

POOL = "budget"
WORKER = "budget-w1"
FRONTEND = "budget-fe"
ALIVE = 4102444800000  # a heartbeat in 2100: the frontend is alive throughout
TENANTS = 8
INPUT_TOKENS = 100
MAX_TOKENS = 256
TOKENS = (8, 256)  # output tokens of the per-request budgets
CLAIM_BATCHES = (1, 8)
PUSH_BATCH = 8  # requests per push_tokens call in the batched phases (--push-batch)
MAX_PUSH_BATCH = PUSH_LIMIT  # push_tokens' own limit
DEFAULT_REQUESTS = 1024
DEFAULT_ROUNDS = 3  # every phase's best round is kept (other processes' CPU use only adds)
FLOOR_SCRIPT = "return redis.call('HGET', KEYS[1], 'pool')"  # the one-command floor
DEFAULT_STEP_MS = 12.5  # one decode step (80 tokens/s per stream): 4 tokens per 50 ms push
RENEW_HELD = 64  # requests per renew_leases call, and per cancel check
DEFAULT_FLUSH_MS = WorkerSettings.flush_ms  # the worker's cancel check period (a field's default)
CANCELLED = 8  # ids in the cancels set while the cancel checks are measured (clients gone)
ADMIT_GOAL_US = 50.0
BASE_GOAL_US = 150.0
PER_TOKEN_GOAL_US = 2.0


def phase_names(push_batch: int = PUSH_BATCH) -> tuple[str, ...]:
    """The rows of the table, in its order (not quite the order measured: admit x8 runs first,
    on a pool emptied again after it): what one call of each phase is."""
    n = push_batch
    return ("floor (1-command script)", "admit", "admit x8", "claim x1", "claim x8", "push_tokens (first)",
            f"push_tokens (first) x{n}", "push_tokens", f"push_tokens x{n}", f"push_tokens x{n} unstreamed",
            "renew_leases", "cancel check", "complete", "complete x8")


PHASES = phase_names()


@dataclass(frozen=True)
class Phase:
    name: str
    calls: int
    usec_per_call: float  # INFO commandstats: the EVALSHA row's usec / calls
    p50_us: float | None  # SLOWLOG: the median call; None: under SLOWLOG_US (not logged)
    max_us: float | None
    inner: dict[str, float]  # inner command -> calls per script call (commandstats)
    # the server's main-thread CPU time (INFO cpu) per call: the script and its request's
    # network I/O, not inflated when other processes take the CPU from Redis
    cpu_us_per_call: float = 0.0
    # the instructions the server ran per call (callgrind), when counted
    instructions_per_call: float | None = None


@dataclass
class BudgetReport:
    phases: list[Phase] = field(default_factory=list)
    budgets: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    baseline: list[Phase] = field(default_factory=list)  # the --baseline Lua's phases, if any
    baseline_budgets: list[dict[str, Any]] = field(default_factory=list)

    def us(self, baseline: bool = False) -> dict[str, float]:
        """Phase -> Redis us per call (of the baseline Lua's phases with ``baseline``)."""
        return {p.name: p.usec_per_call for p in (self.baseline if baseline else self.phases)}

    def cpu_us(self) -> dict[str, float]:
        """Phase -> the server's main-thread CPU us per call: the script and its call's network
        I/O (reading the request, writing the reply), one call at a time."""
        return {p.name: p.cpu_us_per_call for p in self.phases}

    def instructions(self, baseline: bool = False) -> dict[str, float]:
        """Phase -> instructions per call, for the phases counted ({} when none were)."""
        return {p.name: p.instructions_per_call for p in (self.baseline if baseline else self.phases)
                if p.instructions_per_call is not None}

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "phases": [dataclasses.asdict(p) for p in self.phases],
                "budgets": self.budgets, "baseline": [dataclasses.asdict(p) for p in self.baseline],
                "baseline_budgets": self.baseline_budgets,
                "goals": {"admit_us": ADMIT_GOAL_US, "lifecycle_us": f"{BASE_GOAL_US:g} + "
                          f"{PER_TOKEN_GOAL_US:g} x output tokens"}}


# --- the arithmetic ---------------------------------------------------------------------

def tokens_per_push(step_ms: float, flush_ms: float, flush_tokens: int) -> int:
    """Tokens in one push after the first: the worker pushes a request's pending tokens
    before the oldest would wait ``flush_ms`` (worker/delivery.py Delivery.due), so every
    ``ceil(flush_ms / step_ms)`` steps, or at ``flush_tokens``."""
    return max(1, min(flush_tokens, math.ceil(flush_ms / step_ms - 1e-9)))


def unstreamed_tokens_per_push(step_ms: float, flush_ms: float, unstreamed_flush_ms: float) -> int:
    """Tokens in one push after the first for a request whose client does not stream: every
    ``max(flush_ms, unstreamed_flush_ms)`` however many are pending (WorkerRuntime.push_due)."""
    return max(1, math.ceil(max(flush_ms, unstreamed_flush_ms) / step_ms - 1e-9))


def pushes_per_request(tokens: int, per_push: int) -> tuple[int, int]:
    """(first pushes, later pushes) of a request with ``tokens`` output tokens: the first
    token alone at once, then the rest in groups of ``per_push``, the last group on
    ``complete`` (so a one-token request pushes nothing)."""
    if tokens <= 1:
        return 0, 0
    return 1, math.ceil((tokens - 1) / per_push) - 1


def renews_per_request(tokens: int, step_ms: float, lease_ms: int) -> float:
    """renew_leases entries one request gets: its time on the worker over the renewal period."""
    return tokens * step_ms / (lease_ms / 3)


def cancel_checks_per_request(tokens: int, step_ms: float, flush_ms: float) -> float:
    """Cancel checks (SMISMEMBER entries) one request gets: its time on the worker over flush_ms."""
    return tokens * step_ms / flush_ms


def renew_held(requests: int) -> int:
    """Requests per measured renew_leases call: RENEW_HELD, or all of them when fewer."""
    return min(RENEW_HELD, requests)


def budget(us: dict[str, float], tokens: int, per_push: int, claim_batch: int, step_ms: float,
           lease_ms: int, renew_held: int = RENEW_HELD, unstreamed_per_push: int | None = None,
           push_batch: int = PUSH_BATCH, flush_ms: float = DEFAULT_FLUSH_MS) -> dict[str, Any]:
    """Redis microseconds one request costs with ``tokens`` output tokens, by script, from
    ``us`` (phase -> usec per call): a worker running ``claim_batch`` requests together
    claims them in one call and, when ``claim_batch`` is 8 (and ``us`` has the phase), sends
    their pushes 8 to a call (``push_tokens (first) x8``: their first tokens come at the
    same step; ``push_tokens x8``) and completes them 8 to a call (``complete x8``: they
    finish at the same step, as requests of one length claimed together do), and their
    frontends' admits came 8 to a call too (``admit x8``: a loaded frontend); a renew call,
    and a cancel check every ``flush_ms``, cover ``renew_held`` requests.
    ``unstreamed_per_push`` (with ``claim_batch`` 8): the request's client does not stream,
    and its pushes after the first carry that many tokens (``push_tokens x8 unstreamed``).
    ``push_batch``: the batched pushes are that many requests a call (``push_tokens
    x<push_batch>``, and its ``(first)`` and ``unstreamed`` phases), the rest still 8. With
    the goal check and what one shard carries."""
    streamed = unstreamed_per_push is None
    first, later = pushes_per_request(tokens, per_push if streamed else unstreamed_per_push)
    first_us, later_us = us["push_tokens (first)"], us["push_tokens"]
    admit_us = us["admit"]
    complete_us = us["complete"]
    n = push_batch
    if claim_batch == 8 and f"push_tokens (first) x{n}" in us:
        first_us = us[f"push_tokens (first) x{n}"] / n
    if claim_batch == 8 and f"push_tokens x{n}" in us:
        later_us = us[f"push_tokens x{n}"] / n
    if not streamed:
        if claim_batch != 8:
            raise ValueError(f"the unstreamed budget is of batches of 8 (push_tokens x{n} unstreamed)")
        later_us = us[f"push_tokens x{n} unstreamed"] / n
    if claim_batch == 8 and "admit x8" in us:
        admit_us = us["admit x8"] / 8
    if claim_batch == 8 and "complete x8" in us:
        complete_us = us["complete x8"] / 8
    by = {
        "admit": admit_us,
        "claim": us[f"claim x{claim_batch}"] / claim_batch,
        "push_tokens": first * first_us + later * later_us,
        "renew_leases": renews_per_request(tokens, step_ms, lease_ms) * us["renew_leases"] / renew_held,
        "cancel_check": cancel_checks_per_request(tokens, step_ms, flush_ms) * us["cancel check"]
        / renew_held,
        "complete": complete_us,
    }
    total = sum(by.values())
    goal = BASE_GOAL_US + PER_TOKEN_GOAL_US * tokens
    return {"tokens": tokens, "claim_batch": claim_batch, "push_batch": push_batch if claim_batch == 8 else 1,
            "streamed": streamed, "pushes": first + later, "us": by,
            "total_us": total, "goal_us": goal, "meets_goal": total <= goal,
            "admit_meets_goal": admit_us <= ADMIT_GOAL_US, "requests_per_s": 1e6 / total}


def main_thread_cpu_us(info: dict[str, Any]) -> float:
    """``INFO cpu`` -> the main thread's user + system CPU time, in microseconds."""
    return (float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])) * 1e6


def parse_commandstats(info: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """``INFO commandstats`` (as redis-py parses it) -> command -> (calls, usec)."""
    out = {}
    for k, v in info.items():
        if k.startswith("cmdstat_") and isinstance(v, dict):
            out[k.removeprefix("cmdstat_")] = (int(v["calls"]), float(v["usec"]))
    return out


# --- the run ----------------------------------------------------------------------------

# Whose ceiling binds in the bench's pool: none (the default: no request is charged to a
# ceiling); the class of the bench's requests ("bench": each claim charges its prompt and the
# output ahead, each renewal what it delivered since, each end settles); another class
# ("other": the bench's requests are never charged, and every renewal looks whether to mark
# them: include/ceiling.lua). Either ceiling binds just below the pool's capacity (1e12
# tokens/s: its burst of half a second is never emptied), so nothing is held back: the
# scripts' cost is what is measured.
BINDING_CEILINGS = ("none", "bench", "other")


def with_binding_ceiling(cfg: QosConfig, cls: str) -> QosConfig:
    """``cfg`` with class ``cls``'s ceiling just below the pool's capacity: it binds."""
    classes = tuple(dataclasses.replace(c, ceil_share=0.99) if c.name == cls else c for c in cfg.classes)
    return dataclasses.replace(cfg, classes=classes)


class Driver:
    """The private Redis, the pool and the requests in flight."""

    def __init__(self, client: aioredis.Redis, per_push: int, private: bool, lua: Path | None = None,
                 scripts: Scripts | None = None, unstreamed_per_push: int = 80,
                 max_tokens: int = MAX_TOKENS, counter: callgrind.InstructionCounter | None = None,
                 frontends: int = 1, grouped: bool = True, binding_ceiling: str = "none") -> None:
        """``scripts``: a registry of the caller's (default: one over ``lua``); ``max_tokens``:
        each request's, at least what the phases push into it; ``counter``: the server runs
        under callgrind, and every phase counts its instructions; ``frontends``: request i
        comes from frontend ``i % frontends``; ``grouped``: pushes append one reply entry per
        frontend (False: one per request); ``binding_ceiling``: whose ceiling binds
        (:data:`BINDING_CEILINGS`)."""
        if binding_ceiling not in BINDING_CEILINGS:
            raise ValueError(f"binding_ceiling must be one of {', '.join(BINDING_CEILINGS)}, "
                             f"got {binding_ceiling!r}")
        self.client = client
        self.private = private
        self.scripts = scripts or Scripts(client, lua=lua)
        self.keys = PoolKeys(POOL)
        self.per_push = per_push
        self.unstreamed_per_push = unstreamed_per_push
        self.max_tokens = max_tokens
        self.payload = request_payload()
        self.claimed: list[Claimed] = []
        self.offset: dict[str, int] = {}
        self.floor_script = client.register_script(FLOOR_SCRIPT)
        self.counter = counter
        self.frontends = [FRONTEND] if frontends == 1 else [f"{FRONTEND}{k}" for k in range(frontends)]
        self.grouped = grouped
        self.binding_ceiling = binding_ceiling

    async def setup(self) -> tuple[str, int]:
        if self.private:
            await self.client.flushall()
        else:  # a server given with --redis-url: only our keys (its commandstats are reset, though)
            await unlink_matching(self.client, self.keys.pattern())
        if self.counter is None:
            await log_slow_calls(self.client)
        else:  # its entries would be counted as the calls' work
            await self.client.config_set("slowlog-log-slower-than", -1)
        await self.scripts.load_all()
        await self.client.script_load(FLOOR_SCRIPT)
        cfg = bench_config()
        cls = "P1" if "P1" in cfg.class_names() else cfg.class_names()[0]
        if self.binding_ceiling != "none":
            cfg = with_binding_ceiling(cfg, cls if self.binding_ceiling == "bench" else
                                       next(c for c in reversed(cfg.class_names()) if c != cls))
        pool = dataclasses.replace(cfg.pools[0], name=POOL)
        await self.scripts.init_pool(self.keys, policy_document(cfg, pool), reset_rates=True)
        await self.client.zadd(self.keys.frontends, dict.fromkeys(self.frontends, ALIVE))
        return cls, pool.lease_ms

    async def measure(self, name: str, calls: Sequence[Callable[[], Awaitable[Any]]],
                      command: str = "evalsha") -> Phase:
        """Run ``calls`` one after another between two RESETSTATs (and a SLOWLOG RESET), each
        one ``command`` (a script's ``EVALSHA``, or a plain command: its own inner command)."""
        await self.client.config_resetstat()
        await self.client.slowlog_reset()
        cpu0 = main_thread_cpu_us(await self.client.info("cpu"))
        if self.counter is not None:
            await self.counter.zero()
        for call in calls:
            await call()
        instructions = await self.counter.read() if self.counter is not None else None
        cpu = main_thread_cpu_us(await self.client.info("cpu")) - cpu0
        stats = parse_commandstats(await self.client.info("commandstats"))
        durations = await script_durations(self.client, command)
        n, usec = stats.get(command, (0, 0.0))
        if n != len(calls):
            raise RuntimeError(f"{name}: {n} {command.upper()} calls counted, {len(calls)} made")
        skip = {"evalsha", "config", "slowlog", "info", "client", "hello"}
        inner = {c: k / n for c, (k, _) in sorted(stats.items()) if c.partition("|")[0] not in skip}
        return Phase(name, n, usec / n, quantile_us(durations, n, 0.5), quantile_us(durations, n, 1.0), inner,
                     cpu / n, None if instructions is None else instructions / n)

    def floor(self) -> Callable[[], Awaitable[Any]]:
        return lambda: self.floor_script(keys=[self.keys.policy])

    def admit_group(self, ids: Sequence[int], cls: str) -> Callable[[], Awaitable[Any]]:
        async def call() -> None:
            await asyncio.gather(*(self.admit(i, cls)() for i in ids))
        return call

    def admit(self, i: int, cls: str) -> Callable[[], Awaitable[Any]]:
        return lambda: self.scripts.admit(
            self.keys, request_id=f"r{i}", tenant=f"t{i % TENANTS}", cls=cls, input_tokens=INPUT_TOKENS,
            max_tokens=self.max_tokens, tenant_rate=1e12, tenant_burst=1e15, tenant_max_inflight=0,
            max_wait_ms=0, frontend_id=self.frontends[i % len(self.frontends)], payload=self.payload)

    def claim(self, batch: int) -> Callable[[], Awaitable[Any]]:
        async def call() -> None:
            res = await self.scripts.claim(self.keys, WORKER, batch)
            if len(res.requests) != batch:
                raise RuntimeError(f"claim of {batch} got {len(res.requests)}")
            self.claimed += res.requests
            self.offset.update((c.request_id, 0) for c in res.requests)
        return call

    def push(self, c: Claimed, n: int) -> Callable[[], Awaitable[Any]]:
        async def call() -> None:
            off = self.offset[c.request_id]
            await self.scripts.push_tokens(self.keys, request_id=c.request_id, worker_id=WORKER,
                                           fence=c.fence, offset=off, text=" tok" * n,
                                           token_ids=range(1000 + off, 1000 + off + n), grouped=self.grouped)
            self.offset[c.request_id] = off + n
        return call

    def push_many(self, cs: Sequence[Claimed], n: int) -> Callable[[], Awaitable[Any]]:
        """One push_tokens call with ``n`` tokens for each of ``cs`` (a worker's step)."""
        async def call() -> None:
            offsets = [self.offset[c.request_id] for c in cs]
            batches = [TokenBatch(c.request_id, c.fence, off, range(1000 + off, 1000 + off + n),
                                  " tok" * n, n) for c, off in zip(cs, offsets, strict=True)]
            replies = await self.scripts.push_tokens_many(self.keys, WORKER, batches, grouped=self.grouped)
            if any(r.status != "ok" for r in replies):
                raise RuntimeError(f"push_tokens x{len(cs)}: {replies}")
            for c in cs:
                self.offset[c.request_id] += n
        return call

    def renew(self, held: Sequence[Claimed]) -> Callable[[], Awaitable[Any]]:
        return lambda: self.scripts.renew_leases(self.keys, WORKER, [(c.request_id, c.fence) for c in held])

    def cancel_check(self, held: Sequence[Claimed]) -> Callable[[], Awaitable[Any]]:
        """The worker's cancel check over ``held`` (WorkerRuntime.cancelled)."""
        return lambda: self.client.smismember(self.keys.cancels, [c.request_id for c in held])

    def complete_group(self, cs: Sequence[Claimed]) -> Callable[[], Awaitable[Any]]:
        async def call() -> None:
            await asyncio.gather(*(self.complete(c)() for c in cs))
        return call

    def complete(self, c: Claimed) -> Callable[[], Awaitable[Any]]:
        n = self.per_push
        sample = pack_sample(build_sample(
            pool=POOL, cls=c.cls, tenant=c.tenant, outcome="ok", request_id=c.request_id, worker=WORKER,
            input_tokens=INPUT_TOKENS, output_tokens=self.offset[c.request_id] + n,
            queue_wait_ms=float(c.claimed_ms - c.enq_ms), e2e_ms=1234.5, ts_ms=c.claimed_ms + 1234,
            engine="sim", simulated=True, attempt=c.attempt, ttft_ms=12.5, tpot_mean_ms=12.5,
            tpot_max_ms=20.0))
        return lambda: self.scripts.complete(
            self.keys, request_id=c.request_id, worker_id=WORKER, fence=c.fence, outcome="ok",
            usage_in=INPUT_TOKENS, token_ids=range(n), text=" tok" * n, finish_reason="stop", sample=sample)


async def measure_round(d: Driver, requests: int, push_rounds: int, push_batch: int = PUSH_BATCH
                        ) -> tuple[list[Phase], int]:
    """Every phase once, on an emptied server: (phases, the pool's lease_ms). The batched
    pushes carry ``push_batch`` requests a call (half of ``requests`` must be a multiple)."""
    names = phase_names(push_batch)  # (the order of the table, not of the measurements)
    cls, lease_ms = await d.setup()
    d.claimed, d.offset = [], {}
    phases = [await d.measure(PHASES[0], [d.floor() for _ in range(requests)])]
    if "admit" in d.scripts.merge_limits:  # not with an admit.lua of one request a call
        # a frontend's 8 admits of one event-loop turn, merged into one call by the batcher;
        # then the pool is emptied, so that the admits one by one see the queue they always did
        phases.append(await d.measure("admit x8", [d.admit_group(range(i, i + 8), cls)
                                                   for i in range(0, requests, 8)]))
        cls, lease_ms = await d.setup()
    phases.append(await d.measure("admit", [d.admit(i, cls) for i in range(requests)]))
    half = requests // 2
    phases.append(await d.measure("claim x1", [d.claim(1) for _ in range(half)]))
    phases.append(await d.measure("claim x8", [d.claim(8) for _ in range(half // 8)]))
    # the requests claimed 8 at a time, in those eights (for the completions), and in calls
    # of push_batch for their first tokens (requests claimed together make theirs at one step)
    together = [d.claimed[i:i + 8] for i in range(half, len(d.claimed), 8)]
    firsts = [d.claimed[i:i + push_batch] for i in range(half, len(d.claimed), push_batch)]
    # half alone, half as requests claimed together push their first tokens (one call)
    phases.append(await d.measure("push_tokens (first)", [d.push(c, 1) for c in d.claimed[:half]]))
    phases.append(await d.measure(names[6], [d.push_many(g, 1) for g in firsts]))
    phases.append(await d.measure("push_tokens", [d.push(c, d.per_push) for _ in range(push_rounds)
                                                  for c in d.claimed]))
    groups = [d.claimed[i:i + push_batch] for i in range(0, len(d.claimed), push_batch)]
    phases.append(await d.measure(names[8], [d.push_many(g, d.per_push) for _ in range(push_rounds)
                                             for g in groups]))
    phases.append(await d.measure(names[9], [d.push_many(g, d.unstreamed_per_push) for g in groups]))
    size = renew_held(requests)
    held = [d.claimed[i:i + size] for i in range(0, len(d.claimed) - size + 1, size)]
    phases.append(await d.measure("renew_leases", [d.renew(h) for h in held]))
    # a few clients gone (ids of requests of no worker here): the set exists, as it does
    # while cancels are pending, and every id asked is looked up in it
    await d.client.sadd(d.keys.cancels, *(f"gone{i}" for i in range(CANCELLED)))
    phases.append(await d.measure("cancel check", [d.cancel_check(h) for h in held], command="smismember"))
    if "complete" not in d.scripts.merge_limits:  # a complete.lua of one request a call
        phases.append(await d.measure("complete", [d.complete(c) for c in d.claimed]))
        return phases, lease_ms
    # half one by one, half as a step worker's 8 completions of one step (one call)
    phases.append(await d.measure("complete", [d.complete(c) for c in d.claimed[:half]]))
    phases.append(await d.measure("complete x8", [d.complete_group(g) for g in together]))
    return phases, lease_ms


def best_phases(rounds: Sequence[Sequence[Phase]], names: Sequence[str] = PHASES) -> list[Phase]:
    """Each phase's round with the least Redis time per call, in the table's order (``names``)."""
    best: dict[str, Phase] = {}
    for phases in rounds:
        for p in phases:
            if p.name not in best or p.usec_per_call < best[p.name].usec_per_call:
                best[p.name] = p
    return [best[n] for n in names if n in best]


async def run_budget(requests: int = DEFAULT_REQUESTS, step_ms: float = DEFAULT_STEP_MS,
                     per_push: int | None = None, push_rounds: int = 2, redis_url: str | None = None,
                     tokens: Sequence[int] = TOKENS, rounds: int = DEFAULT_ROUNDS,
                     baseline: Path | None = None, instructions: bool = False, frontends: int = 1,
                     grouped: bool = True, push_batch: int = PUSH_BATCH,
                     binding_ceiling: str = "none") -> BudgetReport:
    """Measure every phase over ``requests`` requests (a multiple of 16: half claimed one
    at a time, half eight at a time), ``rounds`` times, and the per-request budgets at
    ``tokens`` from each phase's best round. ``baseline``: another ``lua/`` directory (e.g.
    ``git archive <commit> lua``), measured in the same rounds, alternating with the
    installed scripts, so that both see the same machine load. ``instructions``: count each
    phase's instructions too (a private server under callgrind; not with ``redis_url``).
    ``frontends``, ``grouped`` and ``binding_ceiling``: see :class:`Driver`. ``push_batch``:
    requests a call in the batched push phases (8 to 64; half of ``requests`` a multiple of it)."""
    if requests < 16 or requests % 16:
        raise ValueError("requests must be a positive multiple of 16")
    if not 8 <= push_batch <= MAX_PUSH_BATCH or (requests // 2) % push_batch:
        raise ValueError(f"push_batch must be in [8, {MAX_PUSH_BATCH}] and divide half the requests "
                         f"({requests // 2}), got {push_batch}")
    if instructions and (why := callgrind.why_not(redis_url)):
        raise ValueError(why)
    s = WorkerSettings()
    per_push = per_push if per_push is not None else tokens_per_push(step_ms, s.flush_ms, s.flush_tokens)
    unstreamed = unstreamed_tokens_per_push(step_ms, s.flush_ms, s.unstreamed_flush_ms)
    # a request's max_tokens holds what its phases push (first token, pushes, the unstreamed
    # push) and complete's tokens: 256 at the defaults, more at short steps
    max_tokens = max(MAX_TOKENS, 1 + (2 * push_rounds + 1) * per_push + unstreamed)
    profiles = Path(tempfile.mkdtemp(prefix="qos-callgrind-")) if instructions else None
    server = counter = client = None
    try:  # (a server that fails to start leaves no profiles dir behind)
        if not redis_url:
            server, counter = callgrind.start_server(profiles)
        client = aioredis.from_url(redis_url or (server.url if server else ""))
        d = Driver(client, per_push, private=server is not None, unstreamed_per_push=unstreamed,
                   max_tokens=max_tokens, counter=counter, frontends=frontends, grouped=grouped,
                   binding_ceiling=binding_ceiling)
        base = None if baseline is None else Driver(
            client, per_push, private=server is not None, lua=baseline, unstreamed_per_push=unstreamed,
            max_tokens=max_tokens, counter=counter, frontends=frontends, grouped=grouped,
            binding_ceiling=binding_ceiling)
        all_rounds, base_rounds = [], []
        for _ in range(rounds):
            if base:
                base_rounds.append((await measure_round(base, requests, push_rounds, push_batch))[0])
            phases, lease_ms = await measure_round(d, requests, push_rounds, push_batch)
            all_rounds.append(phases)
        if server is None:
            await unlink_matching(client, d.keys.pattern())
        names = phase_names(push_batch)
        report = BudgetReport(best_phases(all_rounds, names), baseline=best_phases(base_rounds, names))

        def budgets(us: dict[str, float]) -> list[dict[str, Any]]:
            return [budget(us, t, per_push, b, step_ms, lease_ms, renew_held(requests), push_batch=push_batch,
                           flush_ms=s.flush_ms) for t in tokens for b in CLAIM_BATCHES] + \
                [budget(us, t, per_push, 8, step_ms, lease_ms, renew_held(requests), unstreamed, push_batch,
                        s.flush_ms) for t in tokens]
        report.budgets = budgets(report.us())
        if base:
            report.baseline_budgets = budgets(report.us(baseline=True))
        # the same arithmetic over the CPU per call (I/O included): what a shard spends on a
        # request's scripts, and the requests/s that leaves (the scripts' time alone flatters it)
        for x, y in zip(report.budgets, budgets(report.cpu_us()), strict=True):
            x["cpu_us"] = y["total_us"]
            x["requests_per_s_cpu"] = y["requests_per_s"]
        # the same arithmetic over instructions per call: instructions per request
        for out, counted in ((report.budgets, report.instructions()),
                             (report.baseline_budgets, report.instructions(baseline=True))):
            for x, y in zip(out, budgets(counted) if counted else [], strict=False):
                x["instructions"] = y["total_us"]
        info = await client.info("server")
        report.meta = {"requests": requests, "rounds": rounds, "step_ms": step_ms,
                       "tokens_per_push": per_push, "unstreamed_tokens_per_push": unstreamed,
                       "max_tokens": max_tokens,
                       "unstreamed_flush_ms": s.unstreamed_flush_ms,
                       "flush_ms": s.flush_ms, "flush_tokens": s.flush_tokens, "push_rounds": push_rounds,
                       "lease_ms": lease_ms, "renew_held": renew_held(requests), "tenants": TENANTS,
                       "redis_version": info.get("redis_version"), "private_server": server is not None,
                       "machine": platform.machine(), "python": platform.python_version(),
                       "baseline": str(baseline) if baseline else None, "instructions": instructions,
                       "frontends": frontends, "reply_entries": "grouped" if grouped else "each",
                       "push_batch": push_batch, "binding_ceiling": binding_ceiling}
        return report
    finally:
        if client is not None:
            await client.aclose()
        if server:
            server.stop()
        if profiles:
            shutil.rmtree(profiles, ignore_errors=True)


# --- output -----------------------------------------------------------------------------

def _us(v: float | None) -> str:
    return f"<{SLOWLOG_US}" if v is None else f"{v:.0f}"


def _k(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e3:,.1f}"


def render(report: BudgetReport) -> Any:
    from rich.console import Group
    from rich.table import Table

    m = report.meta
    counted = bool(report.instructions())
    t = Table(title="Redis time of one script call (INFO commandstats mean, SLOWLOG median)"
              + (" under callgrind, and the instructions the server ran" if counted else ""))
    for col in ("script", "calls", "us/call", "p50 us", "max us", "CPU us/call", "inner commands",
                *(["k instructions/call"] if counted else [])):
        t.add_column(col, justify="left" if col == "script" else "right")
    for p in report.phases:
        inner = sum(p.inner.values())
        t.add_row(p.name, f"{p.calls:,}", f"{p.usec_per_call:.1f}", _us(p.p50_us), _us(p.max_us),
                  f"{p.cpu_us_per_call:.1f}", f"{inner:.1f}",
                  *([_k(p.instructions_per_call)] if counted else []))
    b = Table(title=f"Redis us per request ({m['tokens_per_push']} tokens per push, unstreamed "
                    f"{m['unstreamed_tokens_per_push']}; step {m['step_ms']:g} ms; renewals every "
                    f"{m['lease_ms'] / 3:.0f} ms; {m['frontends']} frontend(s), reply entries "
                    f"{m['reply_entries']}"
                    + ("" if m.get("binding_ceiling", "none") == "none"
                       else f"; a binding ceiling: {m['binding_ceiling']}") + ")"
              + ("; the times are callgrind's, not this machine's: no goal check" if counted else ""))
    if not counted:
        b.caption = ("per shard: the scripts of a request alone, the goal's measure (INFO commandstats); "
                     "then with each call's I/O (the server's CPU, one call at a time). A shard also "
                     "serves what no script does (the frontends' reply reads, the wake list, heartbeats): "
                     "`qos bench scale-out` counts the whole shard. Each script's best round of "
                     f"{m['rounds']}; {m['frontends']} frontend(s): more make a push append more entries.")
    b.add_column("per request")
    for x in report.budgets:
        b.add_column(f"{x['tokens']} tokens\nbatches of {x['claim_batch']}"
                     + (f",\npushes of {x['push_batch']}" if x["push_batch"] not in (1, 8) else "")
                     + ("" if x["streamed"] else "\nunstreamed"), justify="right")
    for part in ("admit", "claim", "push_tokens", "renew_leases", "cancel_check", "complete"):
        b.add_row(part, *(f"{x['us'][part]:.1f}" + (f" ({x['pushes']})" if part == "push_tokens" else "")
                          for x in report.budgets))
    b.add_row("total", *(f"[bold]{x['total_us']:.0f}[/]" for x in report.budgets))
    if report.baseline_budgets:
        merged = {p.name for p in report.baseline} >= {"admit x8", "complete x8"}
        b.add_row("baseline total" if merged else "baseline total\n(some scripts one request a call)",
                  *(f"{x['total_us']:.0f}" for x in report.baseline_budgets))
    if not counted:
        b.add_row("goal", *(f"{x['goal_us']:.0f} " + ("[green]met[/]" if x["meets_goal"]
                                                        else "[red]missed[/]") for x in report.budgets))
        b.add_row("admit <= 50", *(("[green]met[/]" if x["admit_meets_goal"] else "[red]missed[/]")
                                   for x in report.budgets))
        b.add_row("requests/s per shard,\nscripts' time alone", *(f"{x['requests_per_s']:,.0f}"
                                                               for x in report.budgets))
        b.add_row("CPU us, the calls'\nI/O included", *(f"{x['cpu_us']:.0f}" for x in report.budgets))
        b.add_row("requests/s per shard,\nI/O included", *(f"{x['requests_per_s_cpu']:,.0f}"
                                                         for x in report.budgets))
    else:
        b.add_row("k instructions", *(_k(x.get("instructions")) for x in report.budgets))
    if report.instructions(baseline=True):
        b.add_row("baseline k instructions", *(_k(x.get("instructions")) for x in report.baseline_budgets))
    if not report.baseline:
        return Group(t, b)
    c = Table(title=f"against the baseline Lua in {m['baseline']} (same rounds, alternating)")
    for col in ("script", "baseline us/call", "us/call", "change", "baseline p50", "p50", "inner commands",
                *(["baseline k instr.", "k instr.", "change"] if counted else [])):
        c.add_column(col, justify="left" if col == "script" else "right")
    now = {p.name: p for p in report.phases}
    for was in report.baseline:
        p = now[was.name]
        instr = []
        if counted and was.instructions_per_call and p.instructions_per_call is not None:
            instr = [_k(was.instructions_per_call), _k(p.instructions_per_call),
                     f"{(p.instructions_per_call / was.instructions_per_call - 1) * 100:+.1f}%"]
        c.add_row(was.name, f"{was.usec_per_call:.1f}", f"{p.usec_per_call:.1f}",
                  f"{(p.usec_per_call / was.usec_per_call - 1) * 100:+.0f}%", _us(was.p50_us),
                  _us(p.p50_us),
                  f"{sum(was.inner.values()):.1f} -> {sum(p.inner.values()):.1f}", *instr)
    return Group(t, b, c)


def write_json(report: BudgetReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=2)
