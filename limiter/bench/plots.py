"""PNG figures of one run (matplotlib, Agg backend: no display needed).

Everything is drawn from ``results.json`` and ``requests.jsonl`` (see :func:`plot_all`), so
the figures can be redrawn from a finished run's files without running it again.

* ``latency_cdf.png`` -- TTFT and TPOT CDFs, one panel per class, one line per mode;
* ``ttft_over_time.png`` -- every completed request's TTFT against its send time, per mode;
* ``rates.png`` -- per mode, the work served for each class over time (weighted tokens/s:
  prompt + output x out_weight, the unit of the rates); for modes with a controller also
  the class rates it set (dashed, from the policy), the capacity and its decisions;
* ``served_share.png`` -- each class's share of the served work (weighted tokens, the unit
  of the buckets and floors) per mode, next to the share offered, with the P2 floor marked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

CLASS_COLORS = {"P0": "#d62728", "P1": "#1f77b4", "P2": "#2ca02c"}
MODE_STYLES = {"fifo": ("#7f7f7f", ":"), "fifo-chunked": ("#8c564b", ":"), "priority": ("#ff7f0e", "--"),
               "qos": ("#9467bd", "-"),
               "external": ("#17becf", "-")}
DPI = 90
NOT_COMPLETED_Y = 5.0  # ms: where ttft_over_time puts the requests that got no answer


def _title(results: Mapping[str, Any]) -> str:
    p = results["params"]
    sim = " (SIMULATED GPU)" if p["engine"] == "sim" else " (real compute, CPU)"
    return (f"engine {p['engine']}{sim}, load {p['load']:g}x, {p['workers']} workers, "
            f"{p['duration_s']:g} s per mode, seed {p['seed']}")


def _cdf(ax: Any, values: Sequence[float], **kw: Any) -> None:
    v = sorted(x for x in values if x is not None and x > 0)
    if not v:
        return
    ys = [(i + 1) / len(v) for i in range(len(v))]
    ax.step(v, ys, where="post", **kw)


def latency_cdf(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    classes = results["params"]["classes"]
    fig, axes = plt.subplots(2, len(classes), figsize=(4.2 * len(classes), 7), squeeze=False)
    for j, cls in enumerate(classes):
        slo = results["params"]["class_slo"].get(cls) or {}
        for i, (metric, label) in enumerate((("ttft_ms", "TTFT, ms"), ("tpot_ms", "TPOT, ms"))):
            ax = axes[i][j]
            for mode in results["modes"]:
                color, ls = MODE_STYLES.get(mode, ("k", "-"))
                vals = [r[metric] for r in rows if r["mode"] == mode and r["cls"] == cls and r["ok"]]
                _cdf(ax, vals, color=color, linestyle=ls, label=f"{mode} ({len(vals)})")
            target = slo.get("ttft_ms" if i == 0 else "tpot_ms")
            if target:
                ax.axvline(target, color="k", lw=0.8, alpha=0.6)
                ax.text(target, 0.02, " SLO", fontsize=8)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0, 1.02)
            ax.set_xlabel(label)
            ax.set_title(f"{cls}: {label.split(',')[0]} CDF (completed)", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            if j == 0:
                ax.set_ylabel("share of requests")
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def ttft_over_time(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    modes = list(results["modes"])
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 2.6 * len(modes)), sharex=True, squeeze=False)
    for i, mode in enumerate(modes):
        ax = axes[i][0]
        for cls, color in CLASS_COLORS.items():
            pts = [(r["sent_s"], r["ttft_ms"]) for r in rows
                   if r["mode"] == mode and r["cls"] == cls and r["ok"] and r["ttft_ms"]]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=6, color=color, alpha=0.6, label=cls)
            bad = [r["sent_s"] for r in rows if r["mode"] == mode and r["cls"] == cls and not r["ok"]]
            if bad:
                ax.scatter(bad, [NOT_COMPLETED_Y] * len(bad), marker="x", s=12, color=color, alpha=0.7)
        ax.set_yscale("log")
        ax.set_ylim(bottom=NOT_COMPLETED_Y / 2)
        ax.axhline(NOT_COMPLETED_Y * 1.6, color="k", lw=0.5, alpha=0.4)
        ax.set_ylabel("TTFT, ms")
        ax.set_title(f"{mode}: TTFT by send time (x on the bottom line: rejected or not completed)",
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left", markerscale=2)
    axes[-1][0].set_xlabel("send time, s since the run's start")
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def served_series(rows: Sequence[Mapping[str, Any]], mode: str, cls: str, bin_s: float,
                  horizon_s: float, out_weight: float = 1.0) -> tuple[list[float], list[float]]:
    """Weighted tokens/s served per ``bin_s`` bin: a prompt's tokens at its first token, the
    output (x ``out_weight``, the unit of the class rates) spread evenly from first to last
    token."""
    n = max(1, math.ceil(horizon_s / bin_s))
    bins = [0.0] * n
    for r in rows:
        if r["mode"] != mode or r["cls"] != cls or not r["ok"] or r["first_token_s"] is None:
            continue
        first, last = r["first_token_s"], r["last_token_s"]
        k = int(first // bin_s)
        if 0 <= k < n:
            bins[k] += r["input_tokens"]
        out = r["output_tokens"] * out_weight
        if out <= 0:
            continue
        span = max(last - first, 1e-6)
        t = first
        while t < last + 1e-9:  # split the output over the bins it spans
            b = int(t // bin_s)
            nxt = min(last, (b + 1) * bin_s) if last > first else last
            share = out * (nxt - t) / span if last > first else out
            if 0 <= b < n:
                bins[b] += share
            if nxt <= t:
                break
            t = nxt
    return [(i + 0.5) * bin_s for i in range(n)], [b / bin_s for b in bins]


def rates(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: Path,
          bin_s: float = 5.0) -> Path:
    modes = list(results["modes"])
    horizon = max((r["last_token_s"] or 0) for r in rows) if rows else 1.0
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 2.8 * len(modes)), sharex=True, squeeze=False)
    for i, mode in enumerate(modes):
        ax = axes[i][0]
        m = results["modes"][mode]
        w = results["params"]["capacity"].get("out_weight", 1.0)
        for cls, color in CLASS_COLORS.items():
            xs, ys = served_series(rows, mode, cls, bin_s, horizon, w)
            ax.plot(xs, ys, color=color, label=f"{cls} served")
        timeline = m.get("timeline") or []
        if m.get("controller"):
            for cls, color in CLASS_COLORS.items():
                pts = [(row["t_s"], row["rates"].get(cls)) for row in timeline if row["rates"].get(cls)]
                if pts:
                    ax.step(*zip(*pts, strict=True), where="post", color=color, ls="--", lw=1,
                            label=f"{cls} rate (controller)")
            cap = [(row["t_s"], row["capacity"]) for row in timeline if row.get("capacity")]
            if cap:
                ax.step(*zip(*cap, strict=True), where="post", color="k", ls=":", lw=1,
                        label="capacity (policy)")
            for d in m.get("decisions") or []:
                if d.get("t_s") is not None:
                    ax.axvline(d["t_s"], color="k", alpha=0.15, lw=0.8)
        ax.axvline(results["params"]["duration_s"], color="k", lw=1, alpha=0.5)
        ax.set_ylabel("weighted tokens/s")
        what = "served work per class; dashed: class rates the controller set" if m.get("controller") \
            else "served work per class (no controller)"
        ax.set_title(f"{mode}: {what}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1][0].set_xlabel(f"time, s since the run's start ({bin_s:g} s bins; "
                           "vertical line: end of arrivals)")
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _work_share(c: Mapping[str, Any]) -> float:
    return c.get("served_work_share", c.get("served_share")) or 0.0


def served_share(results: Mapping[str, Any], path: Path) -> Path:
    classes = results["params"]["classes"]
    offered = results["params"].get("offered_work_share") or results["params"]["offered_token_share"]
    labels = ["offered", *results["modes"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(labels)
    for cls in reversed(classes):  # P2 at the bottom, so its floor line reads against it
        vals = [offered.get(cls, 0.0)] + [_work_share(results["modes"][m]["classes"][cls])
                                          for m in results["modes"]]
        ax.bar(labels, vals, bottom=bottoms, color=CLASS_COLORS.get(cls), label=cls)
        for k, (v, b) in enumerate(zip(vals, bottoms, strict=True)):
            if v >= 0.03:
                ax.text(k, b + v / 2, f"{100 * v:.0f}%", ha="center", va="center", fontsize=8, color="w")
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    floor = results["params"]["class_floor"].get("P2")
    if floor:
        ax.axhline(floor, color="k", ls="--", lw=0.8)
        ax.text(len(labels) - 0.5, floor, f" P2 floor {100 * floor:.0f}%", fontsize=8, va="bottom",
                ha="right")
    ax.set_ylabel("share of served work\n(prompt + output x out_weight)")
    ax.set_ylim(0, 1.0)
    ax.set_title("served share per class (stacked; P2 at the bottom)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.18, 1))
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_all(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """Every figure of the run into ``out_dir``; returns their paths."""
    return [latency_cdf(results, rows, out_dir / "latency_cdf.png"),
            ttft_over_time(results, rows, out_dir / "ttft_over_time.png"),
            rates(results, rows, out_dir / "rates.png"),
            served_share(results, out_dir / "served_share.png")]


# --- qos bench tenants ---------------------------------------------------------------------------

TENANT_COLORS = {"steady": "#d62728", "heavy": "#7f7f7f", "medium": "#1f77b4"}


def plot_tenants(results: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """``tenants_service.png``: weighted work served per tenant over time, one panel per mode;
    ``tenants_ttft.png``: the steady tenant's TTFT CDF per mode."""
    p = results["params"]
    out_weight = p["capacity"]["out_weight"]
    modes = list(results["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), sharey=True, squeeze=False)
    bin_s = 2.0
    n_bins = math.ceil((p["duration_s"] + p["drain_s"]) / bin_s)
    for ax, mode in zip(axes[0], modes, strict=True):
        for tenant, color in TENANT_COLORS.items():
            work = [0.0] * n_bins
            for r in rows:
                if r["mode"] != mode or r["tenant"] != tenant or not r["token_times"]:
                    continue
                times = r["token_times"]
                work[min(n_bins - 1, int(times[0] / bin_s))] += r["input_tokens"]
                per_chunk = out_weight * r["output_tokens"] / len(times)
                for t in times:
                    work[min(n_bins - 1, int(t / bin_s))] += per_chunk
            if any(work):
                ax.plot([(i + 0.5) * bin_s for i in range(n_bins)], [w / bin_s for w in work], color=color,
                        label=tenant)
        ax.axvline(p["duration_s"], color="black", lw=0.5, ls=":")
        jain = results["modes"][mode].get("jain_backlogged")
        ax.set_title(f"{mode}" + (f" (Jain {jain:.3f})" if jain is not None else ""), fontsize=10)
        ax.set_xlabel("time since start, s")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("weighted tokens/s served")
    fig.suptitle(f"qos bench tenants: P1 tenants steady {p['steady']:g}x, heavy {p['heavy']:g}x, "
                 f"medium {p['medium']:g}x capacity ({p['engine']})", fontsize=10)
    fig.tight_layout()
    service = out_dir / "tenants_service.png"
    fig.savefig(service, dpi=DPI)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    styles = (("#2ca02c", "-"), ("#7f7f7f", ":"), ("#9467bd", "-"))
    for mode, (color, style) in zip(modes, styles, strict=False):
        _cdf(ax, [r["ttft_ms"] for r in rows if r["mode"] == mode and r["tenant"] == "steady" and r["ok"]],
             color=color, ls=style, label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("steady tenant's TTFT, ms (log)")
    ax.set_ylabel("share of its completed requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    ttft = out_dir / "tenants_ttft.png"
    fig.savefig(ttft, dpi=DPI)
    plt.close(fig)
    return [service, ttft]


def plot_control(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """``control-<scenario>.png`` per scenario, four panels over time: each class's rate
    (solid) and ceiling (dotted); the policy's capacity, the controller's measured estimate and
    each worker's heartbeat figure; client-side SLO attainment per bin; queue depths.
    Decisions are grey lines, the scenario's step a black one."""
    paths = []
    classes = ("P0", "P1", "P2")
    colors = {"P0": "#d62728", "P1": "#1f77b4", "P2": "#2ca02c"}
    for name, sc in results["scenarios"].items():
        tl = sc["timeline"]
        t = [r["t_s"] for r in tl]
        fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
        ax = axes[0]
        for c in classes:
            ax.plot(t, [r["rates"].get(c) for r in tl], color=colors[c], label=f"{c} rate")
            ax.plot(t, [r["ceilings"].get(c) for r in tl], color=colors[c], ls=":", lw=0.8)
        ax.set_ylabel("weighted tokens/s")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1]
        ax.plot(t, [r["capacity"] for r in tl], color="black", label="policy capacity")
        ax.plot(t, [r["measured_capacity"] for r in tl], color="#ff7f0e", label="measured (median)")
        workers = sorted({w for r in tl for w in (r.get("capacity_figures") or {})})
        for w in workers:
            pts = [(r["t_s"], r["capacity_figures"][w]) for r in tl if w in (r.get("capacity_figures") or {})]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=4, alpha=0.5, label=f"{w} heartbeat")
        ax.set_ylabel("capacity")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[2]
        bin_s = sc["bin_s"]
        for c in ("P0", "P1"):
            bins = sc["attainment_bins"].get(c, [])
            ys = [b if b is not None else float("nan") for b in bins]
            ax.step([(i + 1) * bin_s for i in range(len(bins))], ys, color=colors[c], where="pre",
                    label=f"{c} SLO attainment")
        ax.axhline(0.99, color="black", lw=0.5, ls=":")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(f"met, per {bin_s:g} s")
        ax.legend(fontsize=7, loc="lower right")
        ax = axes[3]
        for c in classes:
            ax.plot(t, [r["queue_depth"].get(c) for r in tl], color=colors[c], label=f"{c} queued")
        ax.set_ylabel("queued requests")
        ax.set_xlabel("time since the load started, s")
        ax.legend(fontsize=7, loc="upper right")
        for ax in axes:
            for d in sc["decisions"]:
                ax.axvline(d["t_s"], color="k", alpha=0.15, lw=0.8)
            for x in [sc.get("step_s")] + [e["t_s"] for e in sc.get("events", [])]:
                if x is not None:
                    ax.axvline(x, color="k", lw=1.0)
            ax.grid(alpha=0.3)
        figs = ", ".join(f"{k} {v}" for k, v in sc["figures"].items())
        fig.suptitle(f"qos bench control: {name} ({len(sc['decisions'])} decisions)\n{figs}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"control-{name}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths
