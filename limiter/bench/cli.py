"""``qos bench``: benchmarks, one sub-subcommand per mode (``qos bench admission``, ...).

Each mode registers itself on the ``bench`` parser's subparsers in :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

from limiter.cli import common_args, load_config
from limiter.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: fifo vs priority vs qos on a trace (run, plot), tenants, "
                                      "control, overhead, admission, janitor, redis-budget, lua-profile, "
                                      "scale-out")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="MODE")
    _add_admission(bsub)
    _add_janitor(bsub)
    _add_redis_budget(bsub)
    _add_lua_profile(bsub)
    _add_scale_out(bsub)
    from limiter.bench import cli_run

    cli_run.add_parsers(bsub)


def mode_parser(bsub: argparse._SubParsersAction, func: Callable[[argparse.Namespace], int], *,
                help: str) -> argparse.ArgumentParser:
    """The parser of the ``qos bench`` mode that ``func`` (``_<mode>``, ``-`` spelt ``_``) runs;
    its docstring is the mode's ``--help`` description. Its output paths are checked before it
    runs (:func:`check_output_paths`)."""
    name = func.__name__.lstrip("_").replace("_", "-")
    p = bsub.add_parser(name, help=help, description=inspect.getdoc(func))

    def checked(args: argparse.Namespace) -> int:
        check_output_paths(args)
        return func(args)

    p.set_defaults(func=checked)
    return p


# A mode's output flags: a directory it writes into (made if missing), files it writes.
OUTPUT_DIRS = ("out",)
OUTPUT_FILES = ("json", "noise_out")


def check_output_paths(args: argparse.Namespace) -> None:
    """A ConfigError naming the flag of an output path the mode could not write, before it
    runs: found when it wrote its figures, a run of minutes ended in a traceback and lost
    them (``--out /proc/x``, ``--json`` into a missing directory)."""
    for name in (*OUTPUT_DIRS, *OUTPUT_FILES):
        value = getattr(args, name, None)
        if not value:
            continue
        flag, path = "--" + name.replace("_", "-"), Path(value)
        try:
            if name in OUTPUT_DIRS:
                path.mkdir(parents=True, exist_ok=True)
                where = path
            else:
                if path.is_dir():
                    raise ConfigError(flag, f"{value!r} is a directory; name a file")
                where = path.parent
            with tempfile.TemporaryFile(dir=where):
                pass  # (a write test: access() says yes to root where a write still fails)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            what = f"into {value[:200]!r}" if name in OUTPUT_DIRS else repr(value[:200])
            raise ConfigError(flag, f"cannot write {what}: {why}") from None


def check_flag(flag: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """Refuse ``value`` of ``flag`` unless it is finite and in ``[low, high]`` (``(low, high]``
    with ``low_open``): a ConfigError naming the flag and the range (exit 2). A check written
    ``x < 0`` or ``x <= 0`` lets NaN through, and no upper bound lets inf through."""
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        raise ConfigError(flag, f"must be in {'(' if low_open else '['}{num(low)}, {num(high)}], got {value}")


def _bench_common_args(p: argparse.ArgumentParser) -> None:
    """--config / --redis-url as everywhere, except that a benchmark floods its target, so
    the server must be named explicitly: QOS_REDIS_URL is ignored, the default is a private
    redis-server started for the run."""
    common_args(p)
    for action in p._actions:
        if action.dest == "redis_url":
            action.default = None
            action.help = ("benchmark this Redis instead of a private redis-server (only the "
                           "benchmark's own keys are written and deleted; QOS_REDIS_URL is ignored)")


def _add_admission(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import admission as adm

    p = mode_parser(bsub, _admission,
                    help="admit+enqueue decisions/s and p50/p99 vs SET and the limits library")
    _bench_common_args(p)
    p.add_argument("--quick", action="store_true",
                   help=f"short runs (~10 s in all): {adm.QUICK_OPS} ops, {adm.QUICK_RB_SECONDS} s each")
    p.add_argument("--ops", type=int, default=None,
                   help=f"redis-py operations per measured run (default {adm.DEFAULT_OPS})")
    p.add_argument("--rb-seconds", type=float, default=None,
                   help=f"target length of one redis-benchmark run (default {adm.DEFAULT_RB_SECONDS})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"repeat everything N times, keep each figure's best run (default "
                        f"{adm.DEFAULT_ROUNDS}, 1 with --quick)")
    p.add_argument("--no-redis-benchmark", action="store_true", help="skip the redis-benchmark driver")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")


def _admission(args: argparse.Namespace) -> int:
    """Admit+enqueue decisions/s and p50/p99 latency at concurrency 1 and 50, side by side with a plain
    SET (the one-round-trip floor) and the limits library's moving-window limiter on the same Redis;
    driven by redis-py (asyncio) and by redis-benchmark (server-side view)."""
    from limiter.bench import admission as adm
    from limiter.console import stdout_console

    console = stdout_console()
    base = load_config(args) if args.config else None
    # a flag given is the figure used (``x or default`` took --ops 0 for the default)
    ops = args.ops if args.ops is not None else adm.QUICK_OPS if args.quick else adm.DEFAULT_OPS
    rb_seconds = (args.rb_seconds if args.rb_seconds is not None
                  else adm.QUICK_RB_SECONDS if args.quick else adm.DEFAULT_RB_SECONDS)
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else adm.DEFAULT_ROUNDS
    check_flag("--ops", ops, 1, 100_000_000)
    check_flag("--rb-seconds", rb_seconds, 0, 3600, low_open=True)
    check_flag("--rounds", rounds, 1, 1000)
    target = args.redis_url or "a private redis-server"
    console.print(f"[dim]qos bench admission: {target}, {ops} ops per redis-py run, "
                  f"~{rb_seconds:g} s per redis-benchmark run, best of {rounds}[/]")

    def progress(m: adm.Measurement) -> None:
        console.print(f"[dim]  {m.driver:15s} {m.op:6s} c={m.concurrency:<3d} {m.per_s:>9,.0f}/s "
                      f"p50 {m.p50_ms:.3f} ms  p99 {m.p99_ms:.3f} ms[/]")

    report = asyncio.run(adm.run_admission(ops=ops, rb_seconds=rb_seconds, redis_url=args.redis_url,
                                           redis_benchmark=not args.no_redis_benchmark, base=base,
                                           rounds=rounds, progress=progress))
    console.print(adm.render(report))
    if args.json:
        adm.write_json(report, args.json)
        console.print(f"[dim]wrote {args.json}[/]")
    return 0


def _add_janitor(bsub: argparse._SubParsersAction) -> None:
    p = mode_parser(bsub, _janitor, help="Redis time of one script call while thousands of entries are dead")
    _bench_common_args(p)
    p.add_argument("--entries", type=int, default=10_000, help="requests per pile (default 10000)")


def _janitor(args: argparse.Namespace) -> int:
    """Piles of dead entries (a dead frontend's queued requests, overdue requests, a dead worker's
    leases) cleared by claim / reap_expired: calls needed, largest and median Redis time of one call
    (SLOWLOG)."""
    from limiter.bench import janitor
    from limiter.console import stdout_console

    console = stdout_console()
    if not 1 <= args.entries <= 1_000_000:
        console.print("[red]--entries must be in [1, 1000000][/]")
        return 2
    piles = asyncio.run(janitor.run_janitor(args.entries, args.redis_url))
    console.print(janitor.render(piles))
    return 0


def _add_redis_budget(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import redis_budget as rb

    p = mode_parser(bsub, _redis_budget, help="Redis us per request, script by script (admit, claim, "
                                              "push_tokens, renew_leases, complete) and the goal check")
    _bench_common_args(p)
    p.add_argument("--requests", type=int, default=rb.DEFAULT_REQUESTS,
                   help=f"requests measured, a multiple of 16 (default {rb.DEFAULT_REQUESTS})")
    p.add_argument("--step-ms", type=float, default=rb.DEFAULT_STEP_MS,
                   help=f"one decode step: sets the tokens per push and the renewals "
                        f"(default {rb.DEFAULT_STEP_MS})")
    p.add_argument("--tokens-per-push", type=int, default=None,
                   help="tokens per push after the first (default: what the worker's flush_ms / flush_tokens "
                        "give at --step-ms)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(rb.TOKENS),
                   help=f"output tokens of the per-request budgets (default {' '.join(map(str, rb.TOKENS))})")
    p.add_argument("--rounds", type=int, default=rb.DEFAULT_ROUNDS,
                   help=f"measure everything N times, keep each script's best round "
                        f"(default {rb.DEFAULT_ROUNDS})")
    p.add_argument("--baseline", metavar="LUA_DIR", type=Path,
                   help="also measure the scripts of this lua/ directory (e.g. from git archive <commit> "
                        "lua), in the same rounds, and print the change; its scripts must take the same "
                        "keys and arguments, and answer alike, as the installed ones (a lua/ from before "
                        "the key list's reorder of 2026-12-04, push_tokens' keys first, does not; nor one "
                        "whose push_tokens answers {'ok', cancel}, before 2026-12-05's thirty-third stop)")
    p.add_argument("--instructions", action="store_true",
                   help="run the private server under valgrind's callgrind and also count the instructions "
                        "it runs per call and per request: figures that do not move with the machine's load "
                        "(to compare with --baseline; about 50x slower, so fewer --requests and --rounds 1)")
    p.add_argument("--frontends", type=int, default=1,
                   help="the requests come from this many frontends in turn, so a push of 8 requests "
                        "carries min(8, N) of them (default 1)")
    p.add_argument("--reply-entries", choices=("grouped", "each"), default="grouped",
                   help="a push's reply entries: one per frontend (grouped, this release's frontends) or "
                        "one per request (each, what a frontend of an older release reads); default grouped")
    p.add_argument("--push-batch", type=int, default=rb.PUSH_BATCH,
                   help=f"requests per push_tokens call in the batched push phases, as a GPU's step of N "
                        f"running sequences pushes them (in [8, {rb.MAX_PUSH_BATCH}], dividing half of "
                        f"--requests; admits, claims and completions stay 8 a call; default {rb.PUSH_BATCH})")
    p.add_argument("--binding-ceiling", choices=rb.BINDING_CEILINGS, default="none",
                   help="whose ceiling binds (just below the capacity: nothing is held back): none; the "
                        "class of the measured requests (bench: claims, renewals and ends charge it); "
                        "another class (other: every renewal looks whether to mark the requests). "
                        "Default none")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")


def _redis_budget(args: argparse.Namespace) -> int:
    """Redis microseconds per request for the whole lifecycle: admit, claim (batches of 1 and 8),
    push_tokens as the worker batches them, renew_leases' share and the worker's cancel checks' (an
    SMISMEMBER), complete with its sample. Each script runs alone between two CONFIG RESETSTATs (INFO
    commandstats mean; SLOWLOG median), then the per-request budget at each --tokens, the requests/s
    one shard carries, and the goal check (admit <= 50 us, the lifecycle <= 150 us + 2 us per output
    token)."""
    from limiter.bench import callgrind
    from limiter.bench import redis_budget as rb
    from limiter.console import stdout_console

    console = stdout_console()
    check_flag("--step-ms", args.step_ms, 0, 60_000, low_open=True)  # NaN passed `<= 0`
    if args.tokens_per_push is not None:  # 0 was `or 1`: the default, silently
        check_flag("--tokens-per-push", args.tokens_per_push, 1, rb.MAX_TOKENS)
    if args.requests < 16 or args.requests % 16 \
            or args.rounds < 1 or min(args.tokens) < 1 or max(args.tokens) > rb.MAX_TOKENS \
            or not 1 <= args.frontends <= 64:
        console.print("[red]--requests: a positive multiple of 16; --rounds: > 0; "
                      f"--tokens in [1, {rb.MAX_TOKENS}]; --frontends in [1, 64][/]")
        return 2
    if not rb.PUSH_BATCH <= args.push_batch <= rb.MAX_PUSH_BATCH or (args.requests // 2) % args.push_batch:
        console.print(f"[red]--push-batch {args.push_batch}: must be in [{rb.PUSH_BATCH}, "
                      f"{rb.MAX_PUSH_BATCH}] and divide half of --requests ({args.requests // 2})[/]")
        return 2
    if args.baseline and not (args.baseline / "admit.lua").is_file():
        console.print(f"[red]--baseline {args.baseline}: no admit.lua there[/]")
        return 2
    if args.instructions and (why := callgrind.why_not(args.redis_url)):
        console.print(f"[red]--instructions: {why}[/]")
        return 2
    report = asyncio.run(rb.run_budget(args.requests, args.step_ms, args.tokens_per_push,
                                       redis_url=args.redis_url, tokens=args.tokens, rounds=args.rounds,
                                       baseline=args.baseline, instructions=args.instructions,
                                       frontends=args.frontends, grouped=args.reply_entries == "grouped",
                                       push_batch=args.push_batch, binding_ceiling=args.binding_ceiling))
    console.print(rb.render(report))
    if args.json:
        rb.write_json(report, args.json)
        console.print(f"[dim]wrote {args.json}[/]")
    return 0


def _add_lua_profile(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import lua_profile as lp

    p = mode_parser(bsub, _lua_profile, help="where a script's Redis time goes: the script cut short "
                                             "at its main steps, each cut measured")
    _bench_common_args(p)
    p.add_argument("--script", nargs="+", choices=sorted(lp.CUTS), default=["admit"],
                   help="the scripts to profile (default admit)")
    p.add_argument("--requests", type=int, default=lp.DEFAULT_REQUESTS,
                   help=f"calls per cut and round, a multiple of 8 (default {lp.DEFAULT_REQUESTS})")
    p.add_argument("--rounds", type=int, default=lp.DEFAULT_ROUNDS,
                   help=f"measure every cut N times, keep each one's best (default {lp.DEFAULT_ROUNDS})")
    p.add_argument("--instructions", action="store_true",
                   help="run the private server under valgrind's callgrind and also count the instructions "
                        "each cut runs per call: figures that do not move with the machine's load (about 50x "
                        "slower: --rounds 1)")


def _lua_profile(args: argparse.Namespace) -> int:
    """Where a script's Redis time goes. Redis has no Lua profiler (and TIME does not move inside a
    script), so the script is cut short: a copy returns before each of its main steps, every copy is
    measured over the same calls as the whole script (INFO commandstats, round-robin, each cut's best
    round), and the difference between consecutive cuts is what the lines between them cost. The
    first cut is the fixed part every call pays (keys, arguments, the helpers' definitions)."""
    from limiter.bench import callgrind
    from limiter.bench import lua_profile as lp
    from limiter.console import stdout_console

    console = stdout_console()
    if args.requests < 8 or args.requests % 8 or args.rounds < 1:
        console.print("[red]--requests: a positive multiple of 8; --rounds: at least 1[/]")
        return 2
    if args.instructions and (why := callgrind.why_not(args.redis_url)):
        console.print(f"[red]--instructions: {why}[/]")
        return 2
    for script in args.script:
        segments = asyncio.run(lp.profile(script, args.requests, args.rounds, redis_url=args.redis_url,
                                          instructions=args.instructions))
        console.print(lp.render(script, segments))
    return 0


def _add_scale_out(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import scale_out as so

    p = mode_parser(bsub, _scale_out, help="requests/s per pool and in total as pools (one per shard of a "
                                           "local 3-master Redis Cluster) are added; each shard's cost")
    d = so.ScaleSpec()
    # (flag, type, default, what it is): "(default X)" is added to each help
    for flag, kind, default, what in (
        ("--pools", int, d.pools, f"add pools up to this many, one per master (at most {so.MASTERS})"),
        ("--frontends", int, d.frontends, "frontend processes serving every pool"),
        ("--workers", int, d.workers_per_pool, "sim workers per pool"),
        ("--seconds", float, d.seconds, "length of each phase"),
        ("--idle-seconds", float, d.idle_s, "the idle interval that measures each shard's background"),
        ("--concurrency", int, d.concurrency, "closed-loop streaming clients per loaded pool"),
        ("--output-tokens", int, d.output_tokens, "max_tokens of each request"),
        ("--max-seqs", int, d.max_seqs, "each worker's batch"),
        ("--rps-per-gpu", float, d.rps_per_gpu, "the sizing table's requests/s per GPU (docs/scaling.md)"),
        ("--headroom", float, d.headroom, "the sizing table's use of each core, 0-1"),
        ("--client-processes", int, d.client_processes,
         "processes the clients run in (1: this one; more on a machine with cores to spare)"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    p.add_argument("--out", metavar="DIR", help="write scale-out.json and scale-out.md here")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")


def _scale_out(args: argparse.Namespace) -> int:
    """A local 3-master Redis Cluster (private redis-servers), three pools whose hash tags land on
    three different masters, frontends serving all of them and sim workers (time scale 0: the null
    engine) per pool. Phases load 1, 2, 3 pools with closed-loop streaming clients: requests/s per pool,
    in total and over one pool's; per shard the main thread's CPU and the commands per request of its
    pool and the requests/s that implies at one core; the CPU of every process and of the machine; a
    projection and a fleet sizing from the measured costs. See docs/scaling.md."""
    from limiter.bench import scale_out as so
    from limiter.bench import scale_report
    from limiter.bench.tables import print_markdown
    from limiter.console import stdout_console

    console = stdout_console()
    spec = so.ScaleSpec(pools=args.pools, frontends=args.frontends, workers_per_pool=args.workers,
                        seconds=args.seconds, idle_s=args.idle_seconds, concurrency=args.concurrency,
                        output_tokens=args.output_tokens, max_seqs=args.max_seqs,
                        rps_per_gpu=args.rps_per_gpu, headroom=args.headroom,
                        client_processes=args.client_processes)
    try:
        spec.check()
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    report = asyncio.run(so.run_scale_out(spec, log=console.print))
    if args.markdown:
        print_markdown(scale_report.render(report, markdown=True))
    else:
        for t in scale_report.render(report):
            console.print(t)
    if args.out:
        for path in scale_report.write_out(report, args.out):
            console.print(f"[dim]wrote {path}[/]")
    return 0
