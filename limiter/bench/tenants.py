"""``qos bench tenants``: fairness between the tenants of one class, on a running stack.

Three tenants send P1 requests of the trace's chat sizes (prompts up to 2,000 tokens), each
inside its own quota (no tenant limit binds), open-loop, through the HTTP API:

* ``steady``: a light tenant, ``steady`` x the pool's capacity (default 0.2);
* ``heavy``: floods at ``heavy`` x capacity (default 3.0);
* ``medium``: ``medium`` x capacity (default 1.0); 0 leaves it out (a flood and a steady
  tenant only: Jain's index then has nothing to compare).

Heavy and medium together ask for several times what the pool can do, so both stay
backlogged for the whole window; steady is light and should not notice them. Modes, each a
fresh stack of the qos config (controller off, so the class rates stay where the config
puts them and only the order inside P1 differs):

* ``alone``: steady only: its latency without company;
* ``fifo``: all three, P1 served in arrival order (``fair = false``);
* ``vtc``: all three, P1's tenants by virtual token counters (the default).

Figures per mode and tenant: sent, completed, 429s, TTFT p50/p99, and the weighted work
served inside the window; per mode: steady's TTFT p99 over its figure alone, and Jain's
fairness index over the backlogged tenants' (heavy, medium) weighted service,
``(x_h + x_m)^2 / (2 (x_h^2 + x_m^2))`` with x = work served / tenant weight (1 and 1):
1.0 is an equal split, 0.5 one tenant taking everything. Targets (vtc): steady's p99 within
1.5x of alone, Jain >= 0.95.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from limiter.bench import trace as tr
from limiter.bench.calibrate import Capacity
from limiter.bench.driver import Record, drive
from limiter.bench.modes import POOL, SIM_TOKEN_BUDGET, api_key, mode_spec
from limiter.bench.report import window_tokens
from limiter.bench.runner import CONTEXT_TOKENS, speedup_for, tempfile_dir
from limiter.bench.stack import StackSpec, start_stack
from limiter.bench.stackcal import calibrate_and_report
from limiter.bench.tables import render_tables
from limiter.config import TenantConfig, hash_key, validate
from limiter.localstack.loadgen import percentile

TENANTS = ("steady", "heavy", "medium")
BACKLOGGED = ("heavy", "medium")
MODES = ("alone", "fifo", "vtc")
CHAT_PROMPT_MAX = 2000
OFFSETS = {"steady": 0, "heavy": 2000, "medium": 6000}  # each tenant its own stretch of the trace


@dataclass
class TenantParams:
    engine: str = "sim"
    duration_s: float = 60.0
    drain_s: float = 30.0
    workers: int = 4
    steady: float = 0.2
    heavy: float = 3.0
    medium: float = 1.0
    token_budget: int = SIM_TOKEN_BUDGET  # the most a step may take; each is sized below it (TPOT targets)
    max_seqs: int = 16
    calibrate: str = "stack"
    out_dir: str | None = None


def chat_arrivals(p: TenantParams) -> list[tr.Arrival]:
    rows = tr.assign_classes(tr.load_trace())
    chat = [dataclasses.replace(a, cls="P1") for a in rows if a.prompt_tokens <= CHAT_PROMPT_MAX]
    return tr.scale_sizes(chat, tr.ENGINE_SCALE[p.engine])


def tenant_arrivals(p: TenantParams, chat: Sequence[tr.Arrival], cap: Capacity,
                    which: Sequence[str]) -> list[tr.Arrival]:
    """Each tenant's stream, time-scaled to its share of the capacity, merged by send time."""
    out: list[tr.Arrival] = []
    for tenant in which:
        load = getattr(p, tenant)
        rows = list(chat[OFFSETS[tenant]:])
        speedup = speedup_for(rows, load * cap.weighted_tokens_s, p.duration_s, cap.out_weight)
        out += [dataclasses.replace(a, tenant=tenant) for a in tr.time_scaled(rows, speedup, p.duration_s)]
    out.sort(key=lambda a: a.at_s)
    return [dataclasses.replace(a, index=i) for i, a in enumerate(out)]


def mode_config(mode: str, cap: Capacity, engine: str) -> Any:
    spec = mode_spec("qos", capacity_tokens_s=cap.weighted_tokens_s, out_weight=cap.out_weight,
                     context_tokens=CONTEXT_TOKENS[engine])
    classes = tuple(dataclasses.replace(c, fair=mode != "fifo") if c.name == "P1" else c
                    for c in spec.cfg.classes)
    tenants = tuple(TenantConfig(name=f"bench-{t}", key_sha256=(hash_key(api_key(t)),), default_class="P1",
                                 max_class="P1", rate_tokens_s=1e12) for t in TENANTS)
    cfg = validate(dataclasses.replace(spec.cfg, classes=classes, tenants=tenants))
    return dataclasses.replace(spec, name=mode, cfg=cfg, controller=False)


def tenant_stats(recs: Sequence[Record], t0: float, duration_s: float, out_weight: float) -> dict[str, Any]:
    ok = [r.result for r in recs if r.result.ok]
    ttft = [x.ttft_ms for x in ok if x.ttft_ms is not None]
    return {
        "sent": len(recs), "completed": len(ok), "rejected_429": sum(r.result.status == 429 for r in recs),
        "rejected_503": sum(r.result.status == 503 for r in recs),
        # not rounded: the ratio's goal check sees 150.04 / 100 as over 1.5 (the tables round)
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "work_in_window": window_tokens(recs, t0, duration_s, out_weight),
    }


def jain(values: Sequence[float]) -> float | None:
    total, sq = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * sq) if sq > 0 else None


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


async def run_tenants(p: TenantParams, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    out_dir = Path(p.out_dir) if p.out_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    chat = chat_arrivals(p)
    sspec = StackSpec(engine=p.engine, workers=p.workers, token_budget=p.token_budget, max_seqs=p.max_seqs)
    results: dict[str, Any] = {"schema": "qos-bench-tenants/1", "params": dataclasses.asdict(p), "modes": {}}
    rows: list[dict[str, Any]] = []
    with tempfile_dir(out_dir) as work:
        cap = await calibrate_and_report(
            "tenants", p.engine, chat, sspec, how=p.calibrate, context_tokens=CONTEXT_TOKENS[p.engine],
            work_dir=work, results=results, console=console,
            detail=f"; steady {p.steady:g}x, heavy {p.heavy:g}x, medium {p.medium:g}x, "
                   f"{p.duration_s:g} s per mode")
        for mode in MODES:
            active = tuple(t for t in TENANTS if getattr(p, t) > 0)  # --medium 0: the two tenants
            arrivals = tenant_arrivals(p, chat, cap, ("steady",) if mode == "alone" else active)
            spec = mode_config(mode, cap, p.engine)
            stack = await start_stack(sspec, spec, work)
            try:
                console.print(f"[dim]  {mode}: {len(arrivals)} arrivals[/]")
                t0 = time.monotonic()
                recs = await drive(stack.base_url, POOL, arrivals, duration_s=p.duration_s, drain_s=p.drain_s,
                                   t0=t0)
            finally:
                await asyncio.to_thread(stack.stop, 10.0)
            per = {t: tenant_stats([r for r in recs if r.arrival.tenant == t], t0, p.duration_s,
                                   cap.out_weight)
                   for t in TENANTS if any(r.arrival.tenant == t for r in recs)}
            results["modes"][mode] = {"tenants": per}
            for r in recs:
                x = r.result
                rows.append({"mode": mode, "tenant": r.arrival.tenant, "at_s": round(r.arrival.at_s, 4),
                             "status": x.status, "ok": x.ok, "ttft_ms": _r(x.ttft_ms),
                             "input_tokens": x.input_tokens, "output_tokens": x.output_tokens,
                             "token_times": [round(t - t0, 4) for t in x.token_times] if x.ok else []})
    summarize(results)
    if out_dir:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
        with open(out_dir / "requests.jsonl", "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        from limiter.bench.plots import plot_tenants

        plot_tenants(results, rows, out_dir)
    return results


def summarize(results: dict[str, Any]) -> None:
    """Ratios, Jain's index and the targets, from the per-tenant figures."""
    modes = results["modes"]
    alone = modes.get("alone", {}).get("tenants", {}).get("steady", {}).get("ttft_p99_ms")
    for m in modes.values():
        per = m["tenants"]
        steady = per.get("steady", {}).get("ttft_p99_ms")
        m["steady_p99_over_alone"] = steady / alone if steady and alone else None
        if all(t in per for t in BACKLOGGED):
            m["jain_backlogged"] = jain([per[t]["work_in_window"] for t in BACKLOGGED])
    vtc = modes.get("vtc", {})
    ratio = vtc.get("steady_p99_over_alone")
    # the p99 is over completed requests: a steady request refused or failed misses outright
    steady = vtc.get("tenants", {}).get("steady", {})
    all_served = steady.get("completed") == steady.get("sent")
    results["targets"] = [
        {"target": "steady TTFT p99 / alone (vtc)", "value": ratio,
         "goal": "<= 1.5, every steady request served",
         "met": None if ratio is None else ratio <= 1.5 and all_served},
        {"target": "Jain index, backlogged tenants (vtc)", "value": vtc.get("jain_backlogged"),
         "goal": ">= 0.95",
         "met": None if vtc.get("jain_backlogged") is None else vtc["jain_backlogged"] >= 0.95},
        {"target": "steady TTFT p99 / alone (fifo, for reference)",
         "value": modes.get("fifo", {}).get("steady_p99_over_alone"), "goal": "report", "met": None},
        {"target": "Jain index, backlogged tenants (fifo, for reference)",
         "value": modes.get("fifo", {}).get("jain_backlogged"), "goal": "report", "met": None},
    ]


def render(results: Mapping[str, Any], markdown: bool = False) -> list[Any]:
    head = ["mode", "tenant", "sent", "ok", "429", "503", "TTFT p50", "TTFT p99", "work in window"]
    body = []
    for mode, m in results["modes"].items():
        for t, v in m["tenants"].items():
            body.append([mode, t, v["sent"], v["completed"], v["rejected_429"], v["rejected_503"],
                         _fmt(v["ttft_p50_ms"]), _fmt(v["ttft_p99_ms"]), f"{v['work_in_window']:,}"])
    summary = [[mode, _fmt(m.get("steady_p99_over_alone"), 2), _fmt(m.get("jain_backlogged"), 3)]
               for mode, m in results["modes"].items()]
    targets = [[t["target"], _fmt(t["value"], 3), t["goal"],
                "-" if t["met"] is None else ("yes" if t["met"] else "**no**" if markdown else "NO")]
               for t in results["targets"]]
    tables = [(head, body), (["mode", "steady p99 / alone", "Jain (heavy, medium)"], summary),
              (["target", "measured", "goal", "met"], targets)]
    return render_tables(tables, markdown)


def _fmt(v: float | None, nd: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{nd}f}"
