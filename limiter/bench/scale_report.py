"""``qos bench scale-out``'s tables (terminal or markdown) and its ``--out`` files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from limiter.bench.tables import render_tables

ROLES = ("client", "frontend", "worker", "redis")  # the order of the cores column


def _f(v: float | None, digits: int = 0, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" if pct else f"{v:,.{digits}f}"


def throughput_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    pools = report["pools"]
    head = ["pools", *(f"{p} req/s" for p in pools), "total req/s", "vs one pool", "errors", "machine busy",
            "cores: client / frontends / workers / redis / other"]
    rows = []
    for ph in report["phases"]:
        cores = ph["role_cores"]
        rows.append([str(ph["pools"]), *(_f(ph["requests_s"].get(p)) for p in pools),
                     _f(ph["total_requests_s"]), f"{_f(ph['ratio'], 2)}x", str(ph["errors"]),
                     _f(ph["machine_busy"], pct=True),
                     " / ".join(_f(v, 2) for v in (*(cores[r] for r in ROLES), ph["other_cores"]))])
    return head, rows


def shard_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["pools loaded", "shard (pool)", "requests", "CPU ms / request", "commands / request",
            "EVALSHA / request", "shard busy", "ceiling req/s (1 core)", "cost vs first phase"]
    rows = []
    for i, ph in enumerate(report["phases"]):
        for p in report["pools"]:
            s = ph["shards"][p]
            drift = report["cost_drift"][p][i]
            rows.append([str(ph["pools"]), f"{s['shard']} ({p})", str(s["requests"]),
                         _f(s["cpu_ms_per_request"], 3), _f(s["calls_per_request"], 1),
                         _f(s["evalsha_per_request"], 2), _f(s["busy"], pct=True), _f(s["ceiling_rps"]),
                         "-" if drift is None else f"{drift:.2f}x"])
    return head, rows


def render(report: dict[str, Any], markdown: bool = False) -> list[Any]:
    p = report["params"]
    tables = [throughput_rows(report), shard_rows(report)]
    titles = [f"requests/s as pools are added: {p['frontends']} frontend(s), {p['workers_per_pool']} sim "
              f"worker(s) per pool at time scale 0, {p['concurrency']} streaming clients per pool, "
              f"{p['output_tokens']} output tokens, {p['seconds']:g} s per phase, {p['cpus']} CPUs shared "
              "by everything",
              "per shard, per request of its pool (idle background subtracted)"]
    if report["projection"]:
        tables.append((["pools (one per shard)", "req/s", "vs one pool"],
                       [[str(x["pools"]), _f(x["requests_s"]), f"{_f(x['ratio'], 2)}x"]
                        for x in report["projection"]]))
        titles.append("PROJECTION, not a measurement: each shard at 100 % of one core "
                      "(sum of the last phase's ceilings)")
    if report["sizing"]:
        si = report["sizing_inputs"]
        tables.append((["GPUs", "req/s", "shards", "frontend cores", "max GPUs per pool"],
                       [[f"{x['gpus']:,}", _f(x["requests_s"]), str(x["shards"]), str(x["frontend_cores"]),
                         str(x["max_gpus_per_pool"])] for x in report["sizing"]]))
        titles.append(f"SIZING (projection): {si['requests_s_per_gpu']:g} req/s per GPU, "
                      f"{si['shard_us_per_request']:g} us of shard CPU and "
                      f"{si['frontend_us_per_request']:g} us of frontend CPU per request as measured "
                      f"(this run's requests: {p['output_tokens']} output tokens, time scale 0), "
                      f"every core at {si['headroom']:.0%}")
    iso = report["isolation"]["keys_elsewhere"]
    tables.append((["pool", "keys on its shard", "keys on other shards"],
                   [[pool, str(report["isolation"]["keys_by_shard"][report["home"][pool]][pool]), str(n)]
                    for pool, n in iso.items()]))
    titles.append("isolation: each pool's keys, by shard")
    return render_tables(tables, markdown, titles)


def write_out(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``scale-out.json`` (everything) and ``scale-out.md`` (the tables) in ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    js = d / "scale-out.json"
    js.write_text(json.dumps(report, indent=1))
    md = d / "scale-out.md"
    md.write_text("\n\n".join(render(report, markdown=True)) + "\n")
    return [js, md]
