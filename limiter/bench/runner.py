"""``qos bench run``: the original problem's scenario, fifo vs priority vs qos, same arrivals, one run.

For each mode in turn: an optional gap probe on a one-worker stack of the mode
(:mod:`limiter.bench.gapprobe`); then a fresh private Redis and the mode's stack
(:mod:`limiter.bench.stack`), the same open-loop trace arrivals (:mod:`limiter.bench.driver`)
while :class:`~limiter.bench.stack.Probe` samples the policy; then the stack is stopped.
Modes run one after the other, never at the same time, so they share the machine the same
way. Results go to ``results.json`` (schema in
docs/benchmarks.md), ``requests.jsonl`` (one line per request) and PNG figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from limiter.bench import trace as tr
from limiter.bench.calibrate import Capacity
from limiter.bench.driver import Record, drive
from limiter.bench.gapprobe import run_gap_probe
from limiter.bench.modes import FIFO_CLASS, MODES, POOL, SIM_TOKEN_BUDGET, ModeSpec, mode_spec, tenant_name
from limiter.bench.stack import Probe, StackSpec, start_stack
from limiter.bench.stackcal import calibrate
from limiter.config import DEFAULT_CLASSES, ClassConfig

CONTEXT_TOKENS = {"sim": 40960, "torch": 16384}  # the tiny model's max_seq_len is 16384


@dataclass
class BenchParams:
    """Everything that defines a run (written to ``results.json`` as ``params``)."""

    engine: str = "sim"
    modes: tuple[str, ...] = MODES
    load: float = 1.5
    duration_s: float = 60.0
    drain_s: float = 60.0
    seed: int = 1
    trace: str = str(tr.DEFAULT_TRACE)
    trace_start_s: float = 0.0
    workers: int = 4
    frontends: int = 1
    time_scale: float = 1.0
    token_budget: int = SIM_TOKEN_BUDGET  # the most a step may take; each is sized below it (TPOT targets)
    max_seqs: int = 16
    torch_threads: int = 1
    capacity_rps: float | None = None  # skip the calibration: the pool serves this many req/s
    calibrate: str = "stack"  # 'stack': measure the stack (limiter/bench/stackcal.py); 'engine': engine only
    gap_probe: bool = True
    gap_long_prompt: int | None = None  # default: the largest P2 prompt of the engine's scale
    out_dir: str | None = None
    url: str | None = None  # an existing stack: only the load, labelled mode "external"
    model: str | None = None  # with url: the model name to send
    keys: dict[str, str] = field(default_factory=dict)  # with url: class -> API key
    controller: dict[str, Any] = field(default_factory=dict)  # qos: [controller] overrides
    prompt_div: float | None = None  # override the engine's size scale
    output_div: float | None = None


@dataclass
class ModeRun:
    name: str
    records: list[Record]
    t0: float
    timeline: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    gap: dict[str, Any] | None
    commands: dict[str, int]
    controller: bool
    chunked_prefill: bool | None  # the workers'; None: an external server's, not known
    preemptions: dict[str, int] = dataclasses.field(default_factory=dict)


def size_scale(p: BenchParams) -> tr.SizeScale:
    base = tr.ENGINE_SCALE[p.engine]
    return dataclasses.replace(base, prompt_div=p.prompt_div or base.prompt_div,
                               output_div=p.output_div or base.output_div)


def workload(p: BenchParams) -> list[tr.Arrival]:
    """The trace from ``trace_start_s`` on, classes assigned, sizes scaled (times unscaled)."""
    rows = tr.load_trace(p.trace)
    arrivals = tr.assign_classes(rows, tr.ClassRule(seed=p.seed))
    arrivals = [a for a in arrivals if a.trace_t_s >= p.trace_start_s]
    return tr.scale_sizes(arrivals, size_scale(p))


def speedup_for(arrivals: Sequence[tr.Arrival], tokens_s: float, duration_s: float,
                out_weight: float = 1.0) -> float:
    """How much to speed the trace up so that it offers ``tokens_s`` weighted tokens/s over
    ``duration_s``: the trace time T whose cumulative cost matches, over ``duration_s``."""
    want = tokens_s * duration_s
    t0 = arrivals[0].trace_t_s
    cum = 0.0
    for a in arrivals:
        cum += a.prompt_tokens + a.max_tokens * out_weight
        if cum >= want:
            return max((a.trace_t_s - t0) / duration_s, 1e-6)
    raise ValueError(f"the trace holds {cum:.0f} tokens, less than the {want:.0f} this load and duration "
                     f"need; lower --load or --duration")


def class_configs(p: BenchParams) -> tuple[ClassConfig, ...]:
    return DEFAULT_CLASSES


def tenant_classes(classes: Sequence[str]) -> dict[str, str]:
    return {tenant_name(c): c for c in classes}


def request_rows(mode: str, recs: Sequence[Record], t0: float) -> list[dict[str, Any]]:
    """One JSON-able row per request (``requests.jsonl``); times in s since the mode's start."""
    rows = []
    for r in recs:
        x = r.result
        rows.append({
            "mode": mode, "index": r.arrival.index, "cls": r.arrival.cls, "at_s": round(r.arrival.at_s, 4),
            "sent_s": round(x.sent_s - t0, 4), "prompt_tokens": r.arrival.prompt_tokens,
            "max_tokens": r.arrival.max_tokens, "status": x.status, "error": x.error, "ok": x.ok,
            "ttft_ms": _r(x.ttft_ms), "tpot_ms": _r(x.tpot_ms), "max_gap_ms": _r(x.max_gap_ms),
            "e2e_ms": _r(x.e2e_ms), "input_tokens": x.input_tokens, "output_tokens": x.output_tokens,
            "first_token_s": round(x.token_times[0] - t0, 4) if x.token_times else None,
            "last_token_s": round(x.token_times[-1] - t0, 4) if x.token_times else None,
            "retry_after_s": x.retry_after_s, "send_lag_ms": round(r.send_lag_ms, 2),
        })
    return rows


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


class Ui:
    """The progress bar (one task per mode) and status lines, on one rich console."""

    def __init__(self, console: Console, quiet: bool = False) -> None:
        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[state]}"), TimeElapsedColumn(), console=console,
                                 disable=quiet, transient=False)

    def __enter__(self) -> Ui:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def log(self, text: str) -> None:
        self.progress.console.print(text)

    def task(self, mode: str, total: int) -> Callable[..., None]:
        tid = self.progress.add_task(f"{mode:9s}", total=total, state="starting")

        def update(sent: int | None = None, done: int | None = None, state: str | None = None) -> None:
            kw: dict[str, Any] = {}
            if done is not None:
                kw["completed"] = done
            if state is not None or sent is not None:
                kw["state"] = state or f"sent {sent}"
            self.progress.update(tid, **kw)
        return update


def stack_spec(p: BenchParams) -> StackSpec:
    return StackSpec(engine=p.engine, workers=p.workers, frontends=p.frontends, time_scale=p.time_scale,
                     token_budget=p.token_budget, max_seqs=p.max_seqs, torch_threads=p.torch_threads)


async def gap_probe(p: BenchParams, spec: ModeSpec, sspec: StackSpec, work_dir: Path,
                    long_prompt: int) -> dict[str, Any]:
    """The gap probe on its own one-worker stack of the mode, so the long prompt and the P0
    streams share a worker and the main run starts from fresh buckets and windows."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stack = await start_stack(sspec, spec, work_dir)
    probe = Probe(stack.redis_url, tuple(spec.cfg.class_names()))
    try:
        res = await run_gap_probe(stack.base_url, POOL, probe, long_prompt_tokens=long_prompt, streams=1,
                                  p0_tokens=400 if p.engine == "sim" else 300)
        return res.to_dict()
    finally:
        await probe.close()
        await asyncio.to_thread(stack.stop, 10.0)


async def run_mode(p: BenchParams, mode: str, arrivals: Sequence[tr.Arrival], capacity: Capacity,
                   work_dir: Path, ui: Ui) -> ModeRun:
    update = ui.task(mode, len(arrivals))
    if p.url:
        return await _run_external(p, arrivals, update)
    spec = mode_spec(mode, capacity_tokens_s=capacity.weighted_tokens_s, out_weight=capacity.out_weight,
                     context_tokens=CONTEXT_TOKENS[p.engine], classes=class_configs(p),
                     controller=p.controller)
    sspec = stack_spec(p)
    gap = None
    if p.gap_probe:
        update(state="gap probe")
        long = p.gap_long_prompt or max((a.prompt_tokens for a in arrivals if a.cls == "P2"), default=4096)
        gap = await gap_probe(p, spec, dataclasses.replace(sspec, workers=1), work_dir / "gap-probe", long)
    update(state="starting the stack")
    stack = await start_stack(sspec, spec, work_dir)
    probe = Probe(stack.redis_url, tuple(spec.cfg.class_names()))
    try:
        before = await probe.commandstats()
        stop = asyncio.Event()
        t0 = time.monotonic()
        redis_t0 = await probe.redis_time_ms()
        probe.t0 = t0
        sampler = asyncio.create_task(probe.run(stop))
        update(state="load")
        records = await drive(stack.base_url, POOL, arrivals, duration_s=p.duration_s, drain_s=p.drain_s,
                              t0=t0, progress=lambda sent, done: update(sent=sent, done=done))
        stop.set()
        await sampler
        after = await probe.commandstats()
        decisions = await probe.decisions()
        for d in decisions:
            d["t_s"] = round((d["now_ms"] - redis_t0) / 1000, 2) if d.get("now_ms") else None
        samples = [s for s in await probe.samples() if s.get("ts_ms", 0) >= redis_t0]
        preempted = await probe.preemptions()
        update(state="done")
        commands = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        return ModeRun(mode, records, t0, probe.timeline, decisions, samples, gap, commands, spec.controller,
                       spec.chunked_prefill, preempted)
    finally:
        await probe.close()
        await asyncio.to_thread(stack.stop, 10.0)


async def _run_external(p: BenchParams, arrivals: Sequence[tr.Arrival],
                        update: Callable[..., None]) -> ModeRun:
    t0 = time.monotonic()
    update(state="load")
    records = await drive(p.url or "", p.model or POOL, arrivals, duration_s=p.duration_s, drain_s=p.drain_s,
                          t0=t0, keys=p.keys, progress=lambda sent, done: update(sent=sent, done=done))
    return ModeRun("external", records, t0, [], [], [], None, {}, False, None)


def offered_share(arrivals: Sequence[tr.Arrival], classes: Sequence[str], out_weight: float = 1.0
                  ) -> dict[str, float]:
    tot = {c: 0.0 for c in classes}
    for a in arrivals:
        tot[a.cls] = tot.get(a.cls, 0) + a.prompt_tokens + a.max_tokens * out_weight
    s = sum(tot.values()) or 1
    return {c: round(v / s, 4) for c, v in tot.items()}


def build_results(p: BenchParams, runs: Sequence[ModeRun], arrivals: Sequence[tr.Arrival], capacity: Capacity,
                  speedup: float) -> dict[str, Any]:
    from limiter.bench.report import mode_summary, targets

    cfgs = {c.name: c for c in class_configs(p)}
    classes = list(cfgs)
    modes: dict[str, Any] = {}
    for run in runs:
        summary = mode_summary(run.records, classes=classes,
                               slos={c: cfg if (cfg.slo_ttft_ms or cfg.slo_tpot_ms) else None
                                     for c, cfg in cfgs.items()},
                               samples=run.samples, tenant_of=tenant_classes(classes), t0=run.t0,
                               duration_s=p.duration_s, out_weight=capacity.out_weight,
                               capacity=capacity.weighted_tokens_s, timeline=run.timeline)
        modes[run.name] = {
            "engine": p.engine, "simulated": p.engine == "sim", **summary,
            "internal_classes": [FIFO_CLASS] if run.name.startswith("fifo") else classes,
            "chunked_prefill": run.chunked_prefill, "controller": run.controller,
            "gap_probe": run.gap, "redis_commandstats": run.commands, **run.preemptions,
            "decisions": run.decisions, "timeline": run.timeline,
        }
    params = dataclasses.asdict(p) | {
        "modes": list(p.modes), "classes": classes, "capacity": capacity.to_dict(),
        "trace_speedup": round(speedup, 4), "arrivals": len(arrivals),
        "offered_requests_s": round(len(arrivals) / p.duration_s, 3),
        "offered_tokens_s": round(sum(a.prompt_tokens + a.max_tokens for a in arrivals) / p.duration_s, 1),
        "class_mix": tr.class_mix(arrivals), "offered_token_share": offered_share(arrivals, classes),
        "offered_work_share": offered_share(arrivals, classes, capacity.out_weight),
        "offered_weighted_tokens_s": round(sum(capacity.cost(a) for a in arrivals) / p.duration_s, 1),
        "class_rule": dataclasses.asdict(tr.ClassRule(seed=p.seed)),
        "size_scale": dataclasses.asdict(size_scale(p)),
        "class_slo": {c: {"ttft_ms": v.slo_ttft_ms, "tpot_ms": v.slo_tpot_ms,
                          "ttft_ms_per_1k_prompt_tokens": v.slo_ttft_ms_per_1k_prompt_tokens,
                          "ttft_base_prompt_tokens": v.slo_ttft_base_prompt_tokens}
                      for c, v in cfgs.items()},
        "class_max_wait_ms": {c: v.max_wait_ms for c, v in cfgs.items()},
        "class_floor": {c: v.floor for c, v in cfgs.items()},
        "class_share": {c: v.share for c, v in cfgs.items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    params.pop("keys", None)
    results = {"schema": "qos-bench-run/1", "params": params, "modes": modes}
    results["targets"] = targets(results)
    return results


async def run_bench(p: BenchParams, console: Console | None = None, quiet: bool = False) -> dict[str, Any]:
    """The whole run; returns the results (also written under ``out_dir`` when given)."""
    console = console or Console()
    out_dir = Path(p.out_dir) if p.out_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    full = workload(p)
    with tempfile_dir(out_dir) as cal_dir:
        capacity, engine_figures = await calibrate(p.engine, full, stack_spec(p), how=p.calibrate,
                                                   context_tokens=CONTEXT_TOKENS[p.engine], work_dir=cal_dir,
                                                   capacity_rps=p.capacity_rps)
    speedup = speedup_for(full, p.load * capacity.weighted_tokens_s, p.duration_s, capacity.out_weight)
    arrivals = tr.time_scaled(full, speedup, p.duration_s)
    if not arrivals:
        raise ValueError("no arrivals fall inside --duration")
    label = "SIMULATED GPU (cost model)" if p.engine == "sim" else "real compute (tiny torch model, CPU)"
    console.print(f"[bold]qos bench run[/]: engine {p.engine} -- {label}; {p.workers} workers; capacity "
                  f"{capacity.weighted_tokens_s:,.0f} weighted tokens/s (output token = "
                  f"{capacity.out_weight:g}) = {capacity.requests_s:.2f} req/s ({capacity.source}); "
                  f"load {p.load:g}x -> {len(arrivals)} arrivals in {p.duration_s:g} s "
                  f"(trace sped up {speedup:.2f}x); modes {', '.join(p.modes)}")
    modes = ("external",) if p.url else p.modes
    runs: list[ModeRun] = []
    with tempfile_dir(out_dir) as work_dir, Ui(console, quiet) as ui:
        for mode in modes:
            runs.append(await run_mode(p, mode, arrivals, capacity, work_dir, ui))
    results = build_results(p, runs, arrivals, capacity, speedup)
    results["params"]["capacity"] |= engine_figures
    if out_dir:
        write_outputs(results, runs, out_dir)
    return results


@contextlib.contextmanager
def tempfile_dir(out_dir: Path | None) -> Any:
    """Configs and logs go to ``out_dir`` when there is one (kept for diagnosis), else a temp dir."""
    if out_dir is not None:
        yield out_dir
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="qos-bench-") as d:
        yield Path(d)


def write_outputs(results: Mapping[str, Any], runs: Sequence[ModeRun], out_dir: Path) -> list[Path]:
    from limiter.bench.plots import plot_all

    rows = [row for run in runs for row in request_rows(run.name, run.records, run.t0)]
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    with open(out_dir / "requests.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return plot_all(results, rows, out_dir)


def redraw(out_dir: Path) -> list[Path]:
    """Figures again from a finished run's ``results.json`` and ``requests.jsonl``."""
    from limiter.bench.plots import plot_all

    results = json.loads((out_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines() if line]
    return plot_all(results, rows, out_dir)

