"""``qos bench run`` / ``qos bench plot`` / ``qos bench overhead``: argument parsing only.

The work is in :mod:`limiter.bench.runner` and :mod:`limiter.bench.overhead`; this module
turns flags into their parameters and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from limiter.bench.cli import check_flag, mode_parser
from limiter.bench.modes import ALL_MODES, MODES, SIM_TOKEN_BUDGET
from limiter.bench.trace import DEFAULT_TRACE
from limiter.errors import ConfigError
from limiter.extras import require


def add_parsers(bsub: argparse._SubParsersAction) -> None:
    _add_run(bsub)
    _add_plot(bsub)
    _add_overhead(bsub)
    _add_tenants(bsub)
    _add_control(bsub)


def _scenario_stack_args(p: argparse.ArgumentParser, d: Any, *, out: str, workers_help: str = "") -> None:
    """The stack flags ``control`` and ``tenants`` share; ``d``: their parameters' defaults."""
    a = p.add_argument
    a("--workers", type=int, default=d.workers, help=f"worker processes (default {d.workers}{workers_help})")
    a("--drain", type=float, default=d.drain_s,
      help=f"seconds to wait for answers after (default {d.drain_s:g})")
    a("--calibrate", choices=("stack", "engine"), default=d.calibrate, help="capacity source (default stack)")
    a("--out", metavar="DIR", help=f"write {out} here")


def _add_control(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import control as cb

    d = cb.ControlParams()
    p = mode_parser(bsub, _control,
                    help="the controller on a running stack: steady load, a P2 flood, a lost worker, "
                         "a P1 surge")
    a = p.add_argument
    a("--scenarios", default=",".join(cb.SCENARIOS),
      help=f"comma-separated, in run order (default {','.join(cb.SCENARIOS)}; also "
           f"{','.join(cb.LONG_PROMPT_SCENARIOS)}: long P0 prompts, a fixed TTFT target and one "
           "per prompt token)")
    a("--short", action="store_true", help="each scenario at about half its length (the default test's form)")
    _scenario_stack_args(p, d, workers_help="; worker_loss kills one", out="results.json, PNG plots and logs")
    a("--noise-out", metavar="FILE", help="write the steady scenario's heartbeat noise (JSON) here")


def _control(args: argparse.Namespace) -> int:
    """Each scenario on a private stack with the controller on (sim workers): policy changes at steady
    load, P0's recovery from a P2 flood, capacity following a killed and restarted worker, no cut to a
    P1 surge inside its guarantee. See docs/control-law.md."""
    from limiter.bench import control as cb
    from limiter.console import stdout_console

    names = tuple(n.strip() for n in args.scenarios.split(",") if n.strip())
    unknown = [n for n in names if n not in cb.ALL_SCENARIOS]
    if not names or unknown:
        raise ConfigError("--scenarios",
                          f"unknown {unknown or 'empty list'}; choose from {', '.join(cb.ALL_SCENARIOS)}")
    if args.workers < 2 and "worker_loss" in names:
        raise ConfigError("--workers", "worker_loss needs at least 2 workers")
    if args.workers < 1:
        raise ConfigError("--workers", "must be >= 1")
    check_flag("--drain", args.drain, 0, 3600)  # `< 0` let NaN through
    if args.noise_out and "steady" not in names:
        raise ConfigError("--noise-out", "needs the steady scenario")
    p = cb.ControlParams(scenarios=names, short=args.short, workers=args.workers, drain_s=args.drain,
                         calibrate=args.calibrate, out_dir=args.out, noise_out=args.noise_out)
    console = stdout_console()
    results = asyncio.run(cb.run_control(p, console))
    console.print(cb.markdown(results))
    return 0


def _add_tenants(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import tenants as tb

    d = tb.TenantParams()
    p = mode_parser(bsub, _tenants,
                    help="fairness between the tenants of one class: a light tenant next to two floods")
    a = p.add_argument
    a("--engine", choices=("sim", "torch"), default=d.engine, help="sim (default) or torch")
    a("--duration", type=float, default=d.duration_s,
      help=f"seconds of arrivals per mode (default {d.duration_s:g})")
    for t in ("steady", "heavy", "medium"):
        a(f"--{t}", type=float, default=getattr(d, t),
          help=f"the {t} tenant's load, a multiple of capacity (default {getattr(d, t):g})")
    a("--token-budget", type=int, default=None,
      help="most worker tokens per step, sized below it from the TPOT targets "
           f"(default {d.token_budget} sim, as vLLM's; 64 torch)")
    _scenario_stack_args(p, d, out="results.json, requests.jsonl, PNG plots and logs")
    a("--markdown", action="store_true", help="print the tables as markdown")


def _tenants(args: argparse.Namespace) -> int:
    """Three P1 tenants (steady, heavy, medium) on a private stack, alone / arrival order / virtual token
    counters: the steady tenant's TTFT against its figure alone, and Jain's index over the backlogged
    tenants' weighted service. See docs/benchmarks.md."""
    from limiter.bench import tenants as tb
    from limiter.bench.tables import print_markdown
    from limiter.console import stdout_console

    console = stdout_console()
    # `<= 0` let NaN through (a drain of NaN never ends); medium 0 leaves that tenant out
    for name, low, high, low_open in (("duration", 0, 3600, True), ("drain", 0, 3600, False),
                                      ("steady", 0, 20, True), ("heavy", 0, 20, True),
                                      ("medium", 0, 20, False)):
        check_flag(f"--{name}", getattr(args, name), low, high, low_open=low_open)
    if args.workers < 1:
        raise ConfigError("--workers", "must be >= 1")
    if args.token_budget is not None and args.token_budget < 1:
        raise ConfigError("--token-budget", "must be >= 1")
    if args.out:
        require("matplotlib", "qos bench tenants --out (the plots)")
    if args.engine == "torch":
        require("torch", "qos bench tenants --engine torch")
    p = tb.TenantParams(engine=args.engine, duration_s=args.duration, drain_s=args.drain,
                        workers=args.workers, steady=args.steady, heavy=args.heavy, medium=args.medium,
                        calibrate=args.calibrate, out_dir=args.out)
    if args.token_budget is not None or args.engine == "torch":
        p = tb.dataclasses.replace(p, token_budget=default_token_budget(args))
    results = asyncio.run(tb.run_tenants(p, console))
    if args.markdown:
        print_markdown(tb.render(results, markdown=True))
        return 0
    for t in tb.render(results):
        console.print(t)
    return 0


def _add_run(bsub: argparse._SubParsersAction) -> None:
    p = mode_parser(bsub, _run,
                    help="fifo vs priority vs qos on the Azure trace: open-loop load, tables, JSON, plots")
    a = p.add_argument
    a("--engine", choices=("sim", "torch"), default="sim",
      help="sim: GPU cost model, full-scale prompts (default); torch: tiny real model on CPU, scaled prompts")
    a("--modes", default=",".join(MODES), help=f"comma-separated, in run order (default {','.join(MODES)}; "
      "fifo-chunked: fifo with chunked prefill, a reference for what chunking costs)")
    a("--load", type=float, default=1.5, help="offered load, a multiple of the pool's capacity (default 1.5)")
    a("--duration", type=float, default=60.0, help="seconds of arrivals per mode (default 60)")
    a("--drain", type=float, default=None,
      help="seconds to wait for answers after the arrivals (default = duration)")
    a("--trace", default=str(DEFAULT_TRACE),
      help="CSV in the Azure format (default: the shipped conversation trace)")
    a("--trace-start", type=float, default=0.0, help="skip this many seconds of the trace (default 0)")
    a("--seed", type=int, default=1, help="seed of the class-assignment rule (default 1)")
    a("--workers", type=int, default=None, help="worker processes (default 4 sim, 1 torch)")
    a("--frontends", type=int, default=1, help="frontend processes (default 1)")
    a("--time-scale", type=float, default=1.0, help="sim: multiply modelled step times (default 1)")
    a("--token-budget", type=int, default=None,
      help="most worker tokens per step, sized below it from the TPOT targets "
           f"(default {SIM_TOKEN_BUDGET} sim, as vLLM's; 64 torch)")
    a("--max-seqs", type=int, default=16, help="worker batch size (default 16)")
    a("--torch-threads", type=int, default=1, help="torch CPU threads per worker (default 1)")
    a("--calibrate", choices=("stack", "engine"), default="stack",
      help="capacity measured on a stack like the run's (default; ~35 s) or of the engine alone (faster, "
           "optimistic: no Redis, no HTTP)")
    a("--capacity-rps", type=float, default=None,
      help="skip calibration: the pool serves this many requests/s of the mix (required with --url)")
    a("--no-gap-probe", action="store_true", help="skip the P0-gap-during-a-long-prefill probe")
    a("--controller", action="append", default=[], metavar="FIELD=VALUE",
      help="qos: a [controller] setting for the run, e.g. min_samples=50 or capacity.worker_field= "
           "(repeatable; default: none, the shipped defaults)")
    a("--out", metavar="DIR", help="write results.json, requests.jsonl, PNG plots and logs here")
    a("--url", help="benchmark an existing stack at this base URL instead (one run, mode 'external')")
    a("--model", help="with --url: the model name (default: the pool 'bench')")
    a("--key", action="append", default=[], metavar="CLASS=KEY",
      help="with --url: API key per class (default demo-p0/demo-p1/demo-p2)")
    a("--quiet", action="store_true", help="no progress bar")


def params_from_args(args: argparse.Namespace):  # -> BenchParams (import kept lazy)
    from limiter.bench.runner import BenchParams

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    for m in modes:
        if m not in ALL_MODES:
            raise ConfigError("--modes", f"unknown mode {m!r}; known: {', '.join(ALL_MODES)}")
    if not modes:
        raise ConfigError("--modes", "name at least one mode")
    if not 0 < args.load <= 20:
        raise ConfigError("--load", "must be in (0, 20]")
    if not 1 <= args.duration <= 3600:
        raise ConfigError("--duration", "must be in [1, 3600]")
    if args.url and not args.capacity_rps:
        raise ConfigError("--capacity-rps", "is required with --url (the bench cannot calibrate a stack it "
                                            "did not start)")
    keys = {"P0": "demo-p0", "P1": "demo-p1", "P2": "demo-p2"}
    for kv in args.key:
        cls, sep, key = kv.partition("=")
        if not sep or not key:
            raise ConfigError("--key", f"expected CLASS=KEY, got {kv!r}")
        keys[cls] = key
    controller = controller_overrides(args.controller)
    if controller:
        # checked now, as the controller will (a bad one ended the run once its stack was up,
        # the start-up spent, with the controller process's exit as a traceback)
        import dataclasses

        from limiter.config import demo_config
        from limiter.controller.settings import load_settings

        try:
            load_settings(dataclasses.replace(demo_config(), controller=controller))
        except ConfigError as exc:
            raise ConfigError("--controller", str(exc)) from None
    workers = args.workers if args.workers is not None else (4 if args.engine == "sim" else 1)
    if not 1 <= workers <= 64:
        raise ConfigError("--workers", "must be in [1, 64]")
    check_run_limits(args)
    check_trace_start(args.trace, args.trace_start)
    budget = default_token_budget(args)
    return BenchParams(
        engine=args.engine, modes=modes, load=args.load, duration_s=args.duration,
        drain_s=args.drain if args.drain is not None else args.duration, seed=args.seed, trace=args.trace,
        trace_start_s=args.trace_start, workers=workers, frontends=args.frontends, time_scale=args.time_scale,
        token_budget=budget, max_seqs=args.max_seqs, torch_threads=args.torch_threads,
        capacity_rps=args.capacity_rps, calibrate=args.calibrate,
        gap_probe=not args.no_gap_probe and not args.url, out_dir=args.out,
        url=args.url.rstrip("/") if args.url else None, model=args.model, keys=keys if args.url else {},
        controller=controller)


def default_token_budget(args: argparse.Namespace) -> int:
    """``--token-budget``, or its default for the engine."""
    if args.token_budget is not None:
        return int(args.token_budget)
    return SIM_TOKEN_BUDGET if args.engine == "sim" else 64


def check_run_limits(args: argparse.Namespace) -> None:
    """The stack flags of ``qos bench run``, checked before anything starts: a bad one used to
    start Redis and the calibration first (or, for ``--token-budget 0``, fall back silently to
    the default), and the workers then refused it one by one."""
    if args.token_budget is not None and args.token_budget < 1:
        raise ConfigError("--token-budget", "must be >= 1")
    if not 1 <= args.max_seqs <= 1024:
        raise ConfigError("--max-seqs", "must be in [1, 1024]")
    budget = default_token_budget(args)
    if budget < args.max_seqs:
        raise ConfigError("--token-budget", f"must be >= --max-seqs ({args.max_seqs}): a step serves every "
                                            "decoder first, and a prompt must still get a token")
    if not 1 <= args.frontends <= 64:
        raise ConfigError("--frontends", "must be in [1, 64]")
    # 0 (no step takes time) made the calibration divide by zero
    check_flag("--time-scale", args.time_scale, 0, 1000, low_open=True)
    if args.drain is not None and not 0 <= args.drain <= 3600:
        raise ConfigError("--drain", "must be in [0, 3600]")
    if args.torch_threads < 1:
        raise ConfigError("--torch-threads", "must be >= 1")
    if args.capacity_rps is not None and not args.capacity_rps > 0:
        raise ConfigError("--capacity-rps", "must be > 0")


def check_trace_start(trace: str, start_s: float) -> None:
    """``--trace-start``: finite, >= 0 and before the trace's last arrival (NaN, or a start past
    the end, left no arrival to send)."""
    from limiter.bench.trace import load_trace

    try:
        rows = load_trace(trace)
    except (OSError, ValueError) as exc:
        raise ConfigError("--trace", str(exc)) from exc
    last = rows[-1].t_s if rows else 0.0
    check_flag("--trace-start", start_s, 0, last)


def controller_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs into a ``[controller]`` table; ``capacity.x=`` goes to the nested
    ``[controller.capacity]``; numbers stay numbers, anything else is a string (checked by the
    controller's own settings validation when the stack starts)."""
    out: dict[str, Any] = {}
    for kv in items:
        name, sep, raw = kv.partition("=")
        if not sep or not name.strip():
            raise ConfigError("--controller", f"expected FIELD=VALUE, got {kv!r}")
        value: Any = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                continue
        table = out
        *parents, leaf = name.strip().split(".")
        for part in parents:
            table = table.setdefault(part, {})
        table[leaf] = value
    return out


def _run(args: argparse.Namespace) -> int:
    """Start a private stack per mode (Redis, frontends, workers; controller for qos), send the same
    open-loop trace arrivals through the HTTP API with streaming, and measure on the client side. See
    docs/benchmarks.md."""
    from limiter.bench.report import mode_table, targets_table
    from limiter.bench.runner import run_bench
    from limiter.console import stdout_console

    params = params_from_args(args)
    if params.out_dir:
        require("matplotlib", "qos bench run --out (the plots)")
    if params.engine == "torch":
        require("torch", "qos bench run --engine torch")
    console = stdout_console()
    results = asyncio.run(run_bench(params, console, quiet=args.quiet))
    for name, m in results["modes"].items():
        console.print(mode_table(name, m, params.engine))
        if m.get("gap_probe"):
            g = m["gap_probe"]
            console.print(f"  gap probe ({name}): P0 max gap alone {_ms(g['alone_client_ms'])}, during a "
                          f"{g['long_prompt_tokens']}-token prefill {_ms(g['during_client_ms'])} (client); "
                          f"worker view {_ms(g['alone_worker_ms'])} -> {_ms(g['during_worker_ms'])}"
                          + (f"; no ratio: {g['no_ratio']}" if g.get("no_ratio") else ""))
    console.print(targets_table(results["targets"], params.load))
    if params.out_dir:
        console.print(f"[dim]wrote {Path(params.out_dir) / 'results.json'} and plots[/]")
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _add_plot(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("plot", help="redraw the PNG plots of a finished `qos bench run --out DIR`")
    p.add_argument("dir", help="the run's --out directory (results.json, requests.jsonl)")
    p.add_argument("--markdown", action="store_true", help="print the run's tables as markdown instead")
    p.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    if not args.markdown:  # (what is missing to draw is said first, as by every mode that plots)
        require("matplotlib", "qos bench plot")
    # a directory without the run's files was a FileNotFoundError traceback
    for name in ("results.json",) if args.markdown else ("results.json", "requests.jsonl"):
        if not (Path(args.dir) / name).is_file():
            raise ConfigError("dir", f"{args.dir!r} holds no {name}: name a `qos bench run --out DIR` "
                              "directory")
    if args.markdown:
        import json

        from limiter.bench.report import markdown

        print(markdown(json.loads((Path(args.dir) / "results.json").read_text())), end="")
        return 0
    from limiter.bench.runner import redraw

    for path in redraw(Path(args.dir)):
        print(path)
    return 0


def _add_overhead(bsub: argparse._SubParsersAction) -> None:
    from limiter.bench import overhead as ov

    p = mode_parser(bsub, _overhead,
                    help="null-cost requests through the full path vs a bare aiohttp echo server")
    a = p.add_argument
    a("--seconds", type=float, default=ov.DEFAULT_SECONDS,
      help=f"per measurement (default {ov.DEFAULT_SECONDS})")
    a("--concurrency", type=int, default=ov.DEFAULT_CONCURRENCY,
      help=f"closed-loop clients for the throughput phase (default {ov.DEFAULT_CONCURRENCY})")
    a("--rate", type=float, default=None,
      help="open-loop requests/s for the latency phase (default: 0.3 x the full path's throughput)")
    a("--output-tokens", type=int, default=ov.DEFAULT_OUTPUT_TOKENS,
      help=f"max_tokens per request (default {ov.DEFAULT_OUTPUT_TOKENS})")
    a("--workers", type=int, default=1, help="workers (default 1)")
    a("--frontends", type=int, default=1, help="frontend processes (default 1)")
    a("--max-seqs", type=int, default=64, help="worker batch size (default 64)")
    a("--engine", choices=ov.ENGINES, default="sim",
      help="the workers' engine: sim (time scale 0: each token one step of the worker's scheduler) or "
           "openai (in front of a second echo server: the QoS path's own cost) (default sim)")
    a("--chunk-tokens", type=int, default=ov.CHUNK_TOKENS,
      help=f"tokens per SSE chunk the echo server sends, as baseline and as upstream (default "
           f"{ov.CHUNK_TOKENS}; 1 = one a chunk, as vLLM streams)")
    a("--step-ms", type=float, default=0.0,
      help="with --engine openai: the echo server steps every this many ms, every open stream's next "
           "chunk at each, as a continuous-batching server (default 0: all at once)")
    a("--json", metavar="PATH", help="also write the figures as JSON")


def _overhead(args: argparse.Namespace) -> int:
    """The same load generator against (a) a bare aiohttp server that streams tokens at once and (b) the
    full stack (frontend -> Redis -> worker -> frontend; the worker a sim engine at time scale 0, or in
    front of a second such server): throughput ratio, added latency p50/p99, Redis commands per request."""
    from limiter.bench import overhead as ov
    from limiter.console import stdout_console

    check_flag("--seconds", args.seconds, 0, 3600, low_open=True)  # inf: a phase without end
    if args.rate is not None:
        check_flag("--rate", args.rate, 0, 1_000_000, low_open=True)  # inf: the sender spun forever
    for name, low, high in (("concurrency", 1, 10_000), ("output_tokens", 1, 100_000), ("workers", 1, 64),
                            ("frontends", 1, 64), ("max_seqs", 1, 1024), ("chunk_tokens", 1, 100_000)):
        if not low <= getattr(args, name) <= high:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be in [{low}, {high}]")
    if not 0 <= args.step_ms <= 10_000:
        raise ConfigError("--step-ms", "must be in [0, 10000]")
    if args.step_ms and args.engine != "openai":
        raise ConfigError("--step-ms", "paces the echo server as a model server: it needs --engine openai")
    console = stdout_console()
    report = asyncio.run(ov.run_overhead(seconds=args.seconds, concurrency=args.concurrency, rate=args.rate,
                                         output_tokens=args.output_tokens, workers=args.workers,
                                         frontends=args.frontends, max_seqs=args.max_seqs, engine=args.engine,
                                         chunk_tokens=args.chunk_tokens, step_ms=args.step_ms,
                                         log=console.print))
    console.print(ov.render(report))
    if args.json:
        Path(args.json).write_text(__import__("json").dumps(report, indent=1))
        console.print(f"[dim]wrote {args.json}[/]")
    return 0
