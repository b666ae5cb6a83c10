"""``qos bench lua-profile``: where a script's Redis time goes, by cutting it short.

Redis has no Lua profiler, and timing inside a script reads a clock that does not move
(``TIME`` is frozen for a script's run). So the script is measured whole and cut short:
for each cut, a copy of the ``lua/`` directory whose script returns at that line (``do
return {'cut'} end`` inserted before it), run over the same requests as the whole script,
each between two ``CONFIG RESETSTAT`` (the ``EVALSHA`` row of ``INFO commandstats``, as
``qos bench redis-budget`` reads it). The difference between two consecutive cuts is what
the lines between them cost; the first cut (before the argument checks) is the fixed part
every call pays: the keys and arguments, and the helpers' definitions (EVALSHA runs the
whole script body on every call). Variants run round-robin, on a server emptied before
each, so that all of them see the same machine load; each cut's best round is reported.

With ``instructions`` the private server runs under valgrind's callgrind and every cut also
gets the instructions the server ran per call (limiter/bench/callgrind.py): the same from
one run to the next, where the times move with the machine's load. ``push_tokens`` is cut
only before its per-request loop (each request is read, checked and written in turn: a cut
inside the loop would return at its first request); its calls carry 8 requests of 4
tokens, each request's first push made beforehand by the whole script.

Cuts after a script's first write leave partial state behind; every call works on its
own request, so that only makes the copy's later calls see a little more of it. Printed,
never asserted.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from limiter.bench import callgrind
from limiter.bench.redis_budget import Driver
from limiter.scripts import Scripts, lua_dir

CUT_REPLY = "do return {'cut'} end"
# Per script, the lines a cut returns before (each must appear exactly once in the script's
# own file), in the order they run.
CUTS: dict[str, tuple[str, ...]] = {
    "admit": (
        "  local n = arg_items(ITEM, MAX_ITEMS)",
        "  local p = load_policy(K_POLICY)",
        "  local now = now_ms()",
        "  local key = P_REQUEST .. r.id",
        "  local cost = r.input_tokens * c.weight + r.max_tokens * c.out_weight",
        "  local wait = c.max_wait_ms",
        "  local charged = bucket_debit(tb, cost, nil)",
        "  local seq = redis.call('HINCRBY', K_STATS, 'seq', 1)",
        "  keep_alive(p, r.id, deadline, now, true)",
        "  enqueue(p, {id = r.id, class = r.cls, tenant = r.tenant, seq = seq, deadline_ms = deadline,",
        "  redis.call('HINCRBY', K_TENANT_INFLIGHT, r.tenant, 1)",
        "  if queued > 0 then wake_workers(queued) end  -- a marker each, as separate calls push",
    ),
    "claim": (
        "  local worker_id = arg_name(ARGV[1], 'worker_id')",
        "  local p = load_policy(K_POLICY)",
        "  local now = now_ms()",
        "  local expired = expire_overdue(p, now, SWEEP)",
        "  local ledger = served_open_ledger(p, now)",
        "  local q = queued_counts(p)",
        "  local quantum = p.floor_quantum or 0",
        "  if #out > 2 or ledger.dirty then",
    ),
    "complete": (
        "  local n = arg_items(ITEM, MAX_ITEMS)",
        "  local p = load_policy(K_POLICY)",
        "  local now = now_ms()",
        "  append_token_ids(c.request_id, c.token_ids, c.n_ids)",
        "  local given = finalize(p, r, state, reason, actual_cost(r, c.usage_in, usage_out), now, fields)",
        "  if c.outcome == 'ok' then",
        "  if c.sample ~= '' then append_sample(c.sample) end",
    ),
    "push_tokens": (
        "  local worker_id = arg_name(ARGV[1], 'worker_id')",
        "  local p = load_pool_fields(K_POLICY, {'lease_ms'})",
        "  local replies, expired, groups = {}, {}, {}",
    ),
}
WHOLE = "(whole script)"
DEFAULT_REQUESTS = 512
DEFAULT_ROUNDS = 5


class _Cut(Exception):
    """A cut script's reply: the call ran up to its cut."""


class _CutScripts(Scripts):
    """The registry, for a copy of the scripts that may return at a cut."""

    async def _run(self, name: str, keys: Sequence[str], args: list[Any]) -> Any:
        reply = await super()._run(name, keys, args)
        if reply == [b"cut"]:
            raise _Cut(name)
        return reply


def cut_copies(script: str, into: Path, source: Path | None = None) -> dict[str, Path]:
    """A copy of the ``lua/`` directory per cut of ``script`` (the cut's line -> its copy),
    and the whole script last (-> ``source`` itself). A cut line that is not in the script
    exactly once is refused: the script changed and CUTS must follow it."""
    source = source or lua_dir()
    if script not in CUTS:
        raise ValueError(f"lua-profile: no cuts for {script!r} (known: {', '.join(CUTS)})")
    path = source / f"{script}.lua"
    text = path.read_text()
    out: dict[str, Path] = {}
    for i, line in enumerate(CUTS[script]):
        if text.count(line + "\n") != 1:
            raise ValueError(f"lua-profile: {path.name} does not hold the line {line.strip()!r} exactly once")
        copy = into / f"{script}-{i}"
        shutil.copytree(source, copy)
        indent = line[:len(line) - len(line.lstrip())]
        (copy / path.name).write_text(text.replace(line + "\n", f"{indent}{CUT_REPLY}\n{line}\n"))
        out[line.strip()] = copy
    out[WHOLE] = source
    return out


@dataclass
class Segment:
    """One cut: the Redis us per call of the script run up to it (every round's, and the
    best), and what the lines since the previous cut added (best against best); with
    instructions counted, the same in instructions per call (the least of the rounds)."""

    until: str
    rounds: list[float]
    best: float = 0.0
    added: float = 0.0
    instructions: list[float] = field(default_factory=list)
    best_instructions: float | None = None
    added_instructions: float | None = None


async def _prepare(d: Driver, script: str, requests: int) -> list[Callable[[], Awaitable[Any]]]:
    """An emptied pool with what ``requests`` calls of ``script`` need, and those calls."""
    cls, _ = await d.setup()
    d.claimed, d.offset = [], {}
    if script == "admit":
        return [d.admit(i, cls) for i in range(requests)]
    for i in range(requests):
        await d.admit(i, cls)()
    if script == "claim":
        return [d.claim(1) for _ in range(requests)]
    for _ in range(requests // 8):
        await d.claim(8)()
    if script == "push_tokens":
        # each request's first push by the whole script (it creates the token string): the
        # measured pushes are the later ones, 8 requests a call, as a step worker's
        whole = Driver(d.client, d.per_push, d.private)
        whole.claimed, whole.offset = d.claimed, d.offset
        groups = [d.claimed[i:i + 8] for i in range(0, len(d.claimed), 8)]
        for g in groups:
            await whole.push_many(g, 1)()
        return [d.push_many(g, d.per_push) for g in groups]
    return [d.complete(c) for c in d.claimed]


def _tolerating_cuts(call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    async def run() -> None:
        try:
            await call()
        except _Cut:
            pass
    return run


async def profile(script: str, requests: int = DEFAULT_REQUESTS, rounds: int = DEFAULT_ROUNDS,
                  redis_url: str | None = None, instructions: bool = False) -> list[Segment]:
    """Every cut of ``script`` (and the whole script) measured ``rounds`` times over
    ``requests`` calls (a multiple of 8); with ``instructions``, on a private server under
    callgrind, their instructions too (not with ``redis_url``)."""
    if requests < 8 or requests % 8:
        raise ValueError("requests must be a positive multiple of 8")
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    if instructions and (why := callgrind.why_not(redis_url)):
        raise ValueError(why)
    tmp = Path(tempfile.mkdtemp(prefix="qos-lua-profile-"))
    server = client = counter = None
    try:
        if not redis_url:
            server, counter = callgrind.start_server(tmp if instructions else None)
        client = aioredis.from_url(redis_url or (server.url if server else ""))
        copies = cut_copies(script, tmp)
        drivers = {}
        for until, lua in copies.items():
            drivers[until] = Driver(client, per_push=4, private=server is not None,
                                    scripts=_CutScripts(client, lua=lua), counter=counter)
        segments = {until: Segment(until, []) for until in copies}
        for _ in range(rounds):
            for until, d in drivers.items():
                calls = await _prepare(d, script, requests)
                phase = await d.measure(until, [_tolerating_cuts(c) for c in calls])
                segments[until].rounds.append(phase.usec_per_call)
                if phase.instructions_per_call is not None:
                    segments[until].instructions.append(phase.instructions_per_call)
        out = list(segments.values())
        previous = previous_instructions = 0.0
        for s in out:
            s.best = min(s.rounds)
            s.added, previous = s.best - previous, s.best
            if s.instructions:
                s.best_instructions = min(s.instructions)
                s.added_instructions = s.best_instructions - previous_instructions
                previous_instructions = s.best_instructions
        return out
    finally:
        if client is not None:
            await client.aclose()
        if server:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def render(script: str, segments: Sequence[Segment]) -> Any:
    from rich.table import Table

    counted = segments[0].best_instructions is not None
    t = Table(title=f"{script}: Redis us per call, run up to each line (best of {len(segments[0].rounds)} "
                    "rounds; the first row is the fixed part: keys, arguments, helper definitions)"
                    + ("; times under callgrind, and the instructions the server ran" if counted else ""))
    for col in ("runs up to (not including)", "us/call", "added", "every round",
                *(["k instructions/call", "added"] if counted else [])):
        t.add_column(col, justify="left" if col.startswith("runs") else "right")
    for s in segments:
        t.add_row(s.until, f"{s.best:.1f}", f"{s.added:+.1f}", " ".join(f"{x:.1f}" for x in s.rounds),
                  *([f"{(s.best_instructions or 0) / 1e3:,.1f}", f"{(s.added_instructions or 0) / 1e3:+,.1f}"]
                    if counted else []))
    return t
