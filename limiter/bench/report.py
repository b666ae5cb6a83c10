"""From what the client saw to ``results.json``, the terminal tables and the target check.

Definitions (docs/benchmarks.md repeats them with the schema):

* Per class, by the class the client *assigned* (in fifo the system sees one class).
* ``completed``: HTTP 200 streams that ended with ``[DONE]``; ``rejected_429`` /
  ``rejected_503``: throttled / shed or expired in the queue; ``failed``: anything else
  (transport errors, and ``incomplete`` requests still open when the drain ran out).
* Latencies are client-side, over completed requests: TTFT = send to first content chunk;
  TPOT = (last chunk - first chunk) / (output tokens - 1); ``max_gap_ms`` = the longest wait
  between two chunks of any one request (the 32K-prefill stall).
* ``slo_attainment`` = share of *sent* requests that completed within the class's SLO
  (TTFT and TPOT targets from the config, the TTFT one with its allowance per prompt token
  where the class sets one); a rejection or failure is a miss. A class
  without SLO (P2): share of sent requests that completed.
* ``max_queue_wait_ms``: the longest admission-to-first-claim wait in the latency samples
  of that class's tenant (expired requests included: their wait is their max wait).
* ``served_tokens``: prompt + output tokens of completed requests (usage chunk);
  ``served_share`` = that over all classes'. ``served_work`` / ``served_work_share``: the
  same with output tokens at the cost weight -- the unit the buckets and the floors count
  in, so the P2 floor is checked against ``served_work_share``.
* ``throughput_tokens_s``: prompt + output tokens delivered *inside* the arrival window
  ``[0, duration]``, over its length -- a prompt's tokens count when its first token comes
  back, output tokens when their chunk does -- so a backlog drained after the window does
  not inflate it and a mode that rejects work shows it. ``throughput_work_s``: the same with
  output tokens at the cost weight (weighted tokens/s, the unit of capacity: GPU work, which
  does not depend on the class mix the way plain tokens do -- a mode that serves more 32K
  prompts moves many more, cheaper, tokens); ``utilisation`` = that over the capacity: the
  work served as a share of capacity (at overload the physical limit is 100 %).
  ``output_tokens_s``: the output tokens alone, delivered inside the same window, over its length.
* ``slo_goodput_rps``: requests that completed within their class's SLO (P2: that
  completed), over the window's length -- the useful part of the throughput.
* ``server_work_s`` / ``server_utilisation``: the useful work the *workers* did inside the
  window (their heartbeats' ``work_done``: prompt tokens prefilled for the first time x
  weight + generated tokens x out_weight; recomputation after a pause does not count), over
  its length and over the capacity. The work-conservation figure: the client-side
  ``throughput_work_s`` counts a prompt only when its first token comes back, so a mode
  that defers a 32K prompt past the window's end shows less there though its GPU worked.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from limiter.bench.driver import Record
from limiter.config import ClassConfig
from limiter.localstack.loadgen import percentile
from limiter.slo import ClassSLO


def _r(v: float | None, nd: int = 1) -> float | None:
    return None if v is None else round(v, nd)


def meets_slo(rec: Record, slo: ClassConfig | None) -> bool:
    res = rec.result
    if not res.ok:
        return False
    if slo is None:
        return True
    ttft_target = ClassSLO.of(slo).ttft_target_ms(rec.arrival.prompt_tokens)
    if ttft_target is not None and (res.ttft_ms is None or res.ttft_ms > ttft_target):
        return False
    tpot = res.tpot_ms
    return not (slo.slo_tpot_ms is not None and tpot is not None and tpot > slo.slo_tpot_ms)


def class_stats(recs: Sequence[Record], slo: ClassConfig | None,
                queue_waits: Sequence[float], out_weight: float = 1.0) -> dict[str, Any]:
    ok = [r.result for r in recs if r.result.ok]
    ttft = [x.ttft_ms for x in ok if x.ttft_ms is not None]
    tpot = [x.tpot_ms for x in ok if x.tpot_ms is not None]
    gaps = [x.max_gap_ms for x in ok if x.max_gap_ms is not None]
    sent = len(recs)
    n429 = sum(r.result.status == 429 for r in recs)
    n503 = sum(r.result.status == 503 for r in recs)
    return {
        "sent": sent, "completed": len(ok), "rejected_429": n429, "rejected_503": n503,
        # of the 503s: refused at admission for a full queue, and admitted but expired there
        "shed_503": sum(r.result.status == 503 and r.result.error == "queue_full" for r in recs),
        "expired_503": sum(r.result.status == 503 and r.result.error == "queue_timeout" for r in recs),
        "failed": sent - len(ok) - n429 - n503,
        "ttft_p50_ms": _r(percentile(ttft, 50)), "ttft_p99_ms": _r(percentile(ttft, 99)),
        "tpot_p50_ms": _r(percentile(tpot, 50), 2), "tpot_p99_ms": _r(percentile(tpot, 99), 2),
        "max_gap_ms": _r(max(gaps) if gaps else None),
        # not rounded: the goal check must see 198 of 199 as 0.99497, not 0.995 (the tables round)
        "slo_attainment": sum(meets_slo(r, slo) for r in recs) / sent if sent else None,
        "slo": {"ttft_ms": slo.slo_ttft_ms, "tpot_ms": slo.slo_tpot_ms,
                "ttft_ms_per_1k_prompt_tokens": slo.slo_ttft_ms_per_1k_prompt_tokens,
                "ttft_base_prompt_tokens": slo.slo_ttft_base_prompt_tokens} if slo else None,
        "max_queue_wait_ms": _r(max(queue_waits) if queue_waits else None),
        "served_tokens": sum(x.input_tokens + x.output_tokens for x in ok),
        "served_work": round(sum(x.input_tokens + x.output_tokens * out_weight for x in ok)),
    }


def window_tokens(recs: Sequence[Record], t0: float, duration_s: float, out_weight: float = 1.0, *,
                  prompts: bool = True) -> int:
    """Tokens delivered inside ``[t0, t0 + duration_s]`` (module docstring), output tokens
    counted ``out_weight`` times (1: plain tokens; the cost weight: GPU work); without
    ``prompts``, the output tokens alone."""
    end = t0 + duration_s
    total = 0.0
    for rec in recs:
        res = rec.result
        if not res.ok or not res.token_times:
            continue
        if prompts and res.token_times[0] <= end:
            total += res.input_tokens
        per_chunk = out_weight * res.output_tokens / len(res.token_times)
        total += per_chunk * sum(1 for t in res.token_times if t <= end)
    return int(total)


def server_work_s(timeline: Sequence[Mapping[str, Any]], duration_s: float) -> float | None:
    """Weighted tokens/s of useful work the workers did inside ``[0, duration_s]``, from the
    probe's samples of their ``work_done`` counters (linear between samples; the first
    sample, taken as the load starts, stands for t = 0); None without a sample past the end."""
    pts = [(float(r["t_s"]), float(r["work_done"])) for r in timeline if r.get("work_done") is not None]
    for (t1, w1), (t2, w2) in itertools.pairwise(pts):
        if t1 <= duration_s <= t2:
            end = w1 + (w2 - w1) * (duration_s - t1) / (t2 - t1) if t2 > t1 else w2
            return (end - pts[0][1]) / duration_s
    return None


def mode_summary(recs: Sequence[Record], *, classes: Sequence[str], slos: Mapping[str, ClassConfig | None],
                 samples: Sequence[Mapping[str, Any]], tenant_of: Mapping[str, str], t0: float,
                 duration_s: float, out_weight: float = 1.0, capacity: float | None = None,
                 timeline: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    waits: dict[str, list[float]] = {c: [] for c in classes}
    for s in samples:
        cls = tenant_of.get(str(s.get("tenant")))
        if s.get("outcome") == "rejected":  # turned away at admission: never queued
            continue
        if cls in waits and isinstance(s.get("queue_wait_ms"), int | float):
            waits[cls].append(float(s["queue_wait_ms"]))
    per = {c: class_stats([r for r in recs if r.arrival.cls == c], slos.get(c), waits[c], out_weight)
           for c in classes}
    served = sum(v["served_tokens"] for v in per.values())
    work = sum(v["served_work"] for v in per.values())
    for v in per.values():
        v["served_share"] = v["served_tokens"] / served if served else None  # unrounded: goals
        v["served_work_share"] = v["served_work"] / work if work else None
    ok = [r.result for r in recs if r.result.ok]
    lags = [r.send_lag_ms for r in recs]
    done = window_tokens(recs, t0, duration_s, out_weight) / duration_s
    return {
        "classes": per,
        "throughput_tokens_s": round(window_tokens(recs, t0, duration_s) / duration_s, 1),
        "throughput_work_s": round(done, 1),
        "utilisation": round(done / capacity, 3) if capacity else None,
        "server_work_s": _r(server := server_work_s(timeline, duration_s)),
        "server_utilisation": round(server / capacity, 3) if capacity and server is not None else None,
        # requests that met their class's SLO (P2: that completed), per second of the window
        "slo_goodput_rps": round(sum(meets_slo(r, slos.get(r.arrival.cls)) for r in recs) / duration_s, 3),
        # inside the window too, as throughput_tokens_s: the drain's answers are not in its length
        "output_tokens_s": round(window_tokens(recs, t0, duration_s, prompts=False) / duration_s, 1),
        "sent": len(recs), "completed": len(ok),
        "max_send_lag_ms": _r(max(lags) if lags else None),
        "p99_send_lag_ms": _r(percentile(lags, 99)),
    }


# --- targets ------------------------------------------------------------------------------------

def _get(results: Mapping[str, Any], mode: str, *path: str) -> Any:
    v: Any = results.get("modes", {}).get(mode)
    for p in path:
        if not isinstance(v, Mapping):
            return None
        v = v.get(p)
    return v


def targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured figure and whether it is met (None = not
    measured in this run, e.g. a mode left out). The overload targets apply at load >= 1.5,
    the work-conserving one at load <= 1.0; both are listed, labelled with the run's load."""
    load = results.get("params", {}).get("load")
    p2_wait = results.get("params", {}).get("class_max_wait_ms", {}).get("P2")
    p2_floor = results.get("params", {}).get("class_floor", {}).get("P2")
    out = []

    def add(name: str, value: Any, goal: str, ok: bool | None, applies: bool = True) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": ok if applies else None,
                    "applies_at_this_load": applies})

    att = _get(results, "qos", "classes", "P0", "slo_attainment")
    add("P0 SLO attainment (qos)", att, ">= 0.995", None if att is None else att >= 0.995)
    fifo_att = _get(results, "fifo", "classes", "P0", "slo_attainment")
    add("P0 SLO attainment (fifo, for reference)", fifo_att, "report", None, False)
    q99 = _get(results, "qos", "classes", "P0", "ttft_p99_ms")
    f99 = _get(results, "fifo", "classes", "P0", "ttft_p99_ms")
    ratio = f99 / q99 if q99 and f99 else None
    add("P0 TTFT p99 fifo / qos", _r(ratio, 2), ">= 10", None if ratio is None else ratio >= 10,
        (load or 0) >= 1.5)
    p2 = _get(results, "qos", "classes", "P2") or {}
    if p2.get("sent"):
        # admitted: not refused (429, or 503 queue_full); expired: a 503 queue_timeout (other
        # 503s, a failed worker or an outage, are neither); none admitted: not measured
        admitted = p2["sent"] - p2["rejected_429"] - p2.get("shed_503", 0)
        # unresolved: neither completed nor refused nor a 503 (a failure, or still open when the
        # drain ran out): it may yet have expired, so it counts as one (it counted as served in time)
        unresolved = p2.get("failed", 0)
        expired = (p2.get("expired_503", p2["rejected_503"]) + unresolved) / admitted if admitted else None
        # queued rather than refused: a 429 only when its max wait could not be met, i.e. the
        # admitted ones (nearly) all start in time instead of expiring in the queue
        add("P2 admitted that expired in the queue or were left unresolved (qos)", _r(expired, 3), "<= 0.05",
            None if expired is None else expired <= 0.05)
        add("P2 unresolved: failed or still open at the drain's end (qos, count, for reference)", unresolved,
            "report", None, False)
        add("P2 refused at admission (qos, for reference)", _r(p2["rejected_429"] / p2["sent"], 3), "report",
            None, False)
    w = _get(results, "qos", "classes", "P2", "max_queue_wait_ms")
    add("P2 max queue wait (qos), ms", w, f"<= {p2_wait}",
        None if w is None or p2_wait is None else w <= p2_wait)
    share = _get(results, "qos", "classes", "P2", "served_work_share")
    add("P2 served share of work (qos)", share, f">= floor {p2_floor}",
        None if share is None or p2_floor is None else share >= p2_floor)
    sq = _get(results, "qos", "server_work_s")
    sf = _get(results, "fifo", "server_work_s")
    sr = sq / sf if sq is not None and sf else None  # qos at 0 is a miss, not "not measured"
    add("work done by the workers qos / fifo (weighted tokens/s in the window)", _r(sr, 3), ">= 0.97",
        None if sr is None else sr >= 0.97, (load or 9) <= 1.0)
    sc = _get(results, "fifo-chunked", "server_work_s")
    if sc:  # the reference mode ran: split the gap into chunking's cost and the scheduling's
        add("work done by the workers fifo-chunked / fifo (what chunked prefill costs, for reference)",
            _r(sc / sf, 3) if sf else None, "report", None, False)
        add("work done by the workers qos / fifo-chunked (what the scheduling costs, for reference)",
            _r(sq / sc, 3) if sq is not None else None, "report", None, False)
    tq = _get(results, "qos", "throughput_work_s")
    tf = _get(results, "fifo", "throughput_work_s")
    tr = tq / tf if tq is not None and tf else None
    add("work delivered to clients qos / fifo (weighted tokens/s, for reference)", _r(tr, 3), "report", None,
        False)
    tq = _get(results, "qos", "throughput_tokens_s")
    tf = _get(results, "fifo", "throughput_tokens_s")
    tr = tq / tf if tq is not None and tf else None
    add("throughput qos / fifo (plain tokens/s, for reference)", _r(tr, 3), "report", None, False)
    for mode in ("fifo", "fifo-chunked", "priority", "qos"):
        g = _get(results, mode, "gap_probe")
        if g:
            rc = g.get("ratio_client")
            ref = "" if mode == "qos" else ", for reference"
            # the probe ran but measured nothing (no_ratio says why): a miss, not "not measured"
            why = g.get("no_ratio") or ("no ratio" if rc is None else "")
            add(f"P0 max gap during long prefill / alone, client ({mode}{ref})",
                f"none: {why}" if why else _r(rc, 2), "<= 1.5", rc is not None and not why and rc <= 1.5,
                mode == "qos")
    return out


# --- terminal -----------------------------------------------------------------------------------

def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def mode_table(mode: str, summary: Mapping[str, Any], engine: str) -> Table:
    label = " (SIMULATED GPU)" if engine == "sim" else " (real compute, CPU)"
    util = summary.get("utilisation")
    t = Table(title=f"{mode} -- engine {engine}{label}; throughput {summary['throughput_tokens_s']:,.0f} "
                    f"tokens/s, {summary['throughput_work_s']:,.0f} weighted tokens/s"
                    f"{f' ({100 * util:.0f}% of capacity)' if util else ''}; workers did "
                    f"{_fmt(summary.get('server_utilisation'), True)} of capacity; SLO goodput "
                    f"{summary.get('slo_goodput_rps', 0):.2f} req/s; "
                    f"{summary['completed']}/{summary['sent']} completed", title_justify="left")
    cols = ("class", "sent", "ok", "429", "503", "fail", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "max gap", "SLO att.", "max qwait", "work")
    for c in cols:
        t.add_column(c, justify="right")
    for cls, s in summary["classes"].items():
        t.add_row(cls, str(s["sent"]), str(s["completed"]), str(s["rejected_429"]), str(s["rejected_503"]),
                  str(s["failed"]), _fmt(s["ttft_p50_ms"]), _fmt(s["ttft_p99_ms"]), _fmt(s["tpot_p50_ms"]),
                  _fmt(s["tpot_p99_ms"]), _fmt(s["max_gap_ms"]), _fmt(s["slo_attainment"], True),
                  _fmt(s["max_queue_wait_ms"]), _fmt(s["served_work_share"], True))
    return t


def targets_table(rows: Sequence[Mapping[str, Any]], load: float) -> Table:
    t = Table(title=f"targets (this run: load {load:g}x)", title_justify="left")
    for c in ("target", "measured", "goal", "met"):
        t.add_column(c)
    for r in rows:
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "[dim]n/a[/]"}[r["met"]]
        if not r["applies_at_this_load"] and r["met"] is None and r["value"] is not None:
            met = "[dim]-[/]" if "for reference" in r["target"] else "[dim]other load[/]"
        t.add_row(r["target"], _fmt(r["value"]), r["goal"], met)
    return t


# --- markdown (for docs/benchmarks.md and the README) ----------------------------------------------

def _md(v: Any, pct: bool = False) -> str:
    return _fmt(v, pct).replace("[dim]", "").replace("[/]", "")


def markdown(results: Mapping[str, Any]) -> str:
    """The run's per-mode tables, gap probes and targets as GitHub markdown."""
    p = results["params"]
    cap = p["capacity"]
    label = " (SIMULATED GPU)" if p["engine"] == "sim" else " (real compute, CPU)"
    out = [f"engine **{p['engine']}**{label}, "
           f"load {p['load']:g}x of {cap['weighted_tokens_s']:,.0f} weighted tokens/s "
           f"({cap['requests_s']:.2f} req/s, {cap['source']}; output token = {cap['out_weight']:g}), "
           f"{p['workers']} workers (token budget {p['token_budget']}, max_seqs {p['max_seqs']}), "
           f"{p['arrivals']} arrivals in {p['duration_s']:g} s, seed {p['seed']}", ""]
    out += ["| mode | class | sent | ok | 429 | 503 | failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| max gap | SLO att. | max queue wait | work share |", "|---|---|" + "---:|" * 13]
    for mode, m in results["modes"].items():
        for cls, s in m["classes"].items():
            out.append(f"| {mode} | {cls} | {s['sent']} | {s['completed']} | {s['rejected_429']} | "
                       f"{s['rejected_503']} | {s['failed']} | {_md(s['ttft_p50_ms'])} | "
                       f"{_md(s['ttft_p99_ms'])} | {_md(s['tpot_p50_ms'])} | {_md(s['tpot_p99_ms'])} | "
                       f"{_md(s['max_gap_ms'])} | "
                       f"{_md(s['slo_attainment'], True)} | {_md(s['max_queue_wait_ms'])} | "
                       f"{_md(s.get('served_work_share'), True)} |")
    out += ["", "| mode | throughput, tokens/s | weighted tokens/s delivered | of capacity "
            "| work done by the workers, of capacity | SLO goodput, req/s "
            "| completed | P0 gap alone → during a long prefill (client) | (worker) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, m in results["modes"].items():
        g = m.get("gap_probe") or {}
        gap = (f"{_md(g.get('alone_client_ms'))} → {_md(g.get('during_client_ms'))} ms "
               f"({_md(g.get('ratio_client'))}x)") if g else "-"
        wgap = (f"{_md(g.get('alone_worker_ms'))} → {_md(g.get('during_worker_ms'))} ms "
                f"({_md(g.get('ratio_worker'))}x)") if g else "-"
        out.append(f"| {mode} | {_md(m['throughput_tokens_s'])} | {_md(m['throughput_work_s'])} | "
                   f"{_md(m.get('utilisation'), True)} | {_md(m.get('server_utilisation'), True)} | "
                   f"{_md(m.get('slo_goodput_rps'))} | "
                   f"{m['completed']}/{m['sent']} | {gap} | {wgap} |")
    out += ["", "| target | measured | goal | met |", "|---|---:|---|---|"]
    for t in results["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        if t["met"] is None and not t["applies_at_this_load"] and t["value"] is not None:
            met = "-" if "for reference" in t["target"] else "(other load)"
        out.append(f"| {t['target']} | {_md(t['value'])} | {t['goal']} | {met} |")
    return "\n".join(out) + "\n"
