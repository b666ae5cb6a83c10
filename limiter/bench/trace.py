"""The benchmark's workload: arrivals and sizes from a real trace, classes by a seeded rule.

The Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``) gives arrival
times and prompt/output token counts, but no tenant or priority. :func:`assign_classes`
adds them with a documented, seeded rule (docs/benchmarks.md, "Class assignment"):

* a request whose trace prompt has at least ``long_prompt`` tokens (the trace's long
  documents, most of them at its 4K context limit) joins the **P2 batch stream** with
  probability ``p2_long_share``; its prompt is stretched ``p2_stretch`` times, capped so
  that prompt + output fit ``max_prompt`` (32K by default): the original problem's 32K-token prompt;
* any other request with a prompt of at most ``short_prompt`` tokens is **P0**
  (interactive) with probability ``p0_short_share``, else P1;
* any other, longer request is **P1** with probability ``p1_long_share``, else P0.

One ``random.Random(seed)`` draws once per trace row, in trace order, so the same seed
gives the same classes whatever the load or duration. The engine then scales sizes
(:func:`scale_sizes`: the tiny torch model gets prompts 8x and outputs 4x smaller) and
:func:`time_scaled` compresses the trace's clock so the offered load is ``load`` times the
pool's capacity. Arrivals stay open-loop: they are fixed before the run starts.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_TRACE = DATA_DIR / "AzureLLMInferenceTrace_conv.csv"
CLASSES = ("P0", "P1", "P2")


@dataclass(frozen=True)
class TraceRow:
    """One trace line: seconds since the trace's first arrival, prompt and output tokens."""

    t_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Arrival:
    """One request of the run: when (seconds since the run's start), class and sizes."""

    index: int  # position in the trace window: also the prompt's seed
    at_s: float
    cls: str
    prompt_tokens: int  # pool tokens (UTF-8 bytes + BOS)
    max_tokens: int
    trace_t_s: float  # the unscaled trace time, for the record
    tenant: str = ""  # who sends it ('' = the benchmark tenant of its class)


@dataclass(frozen=True)
class ClassRule:
    """The seeded class-assignment rule (module docstring); defaults are documented."""

    seed: int = 1
    long_prompt: int = 4000
    p2_long_share: float = 1.0
    p2_stretch: float = 8.0
    max_prompt: int = 32768
    short_prompt: int = 1024
    p0_short_share: float = 0.8
    p1_long_share: float = 0.9


def _parse_time(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than fromisoformat takes.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def load_trace(path: str | Path = DEFAULT_TRACE) -> list[TraceRow]:
    """Rows sorted by time, times relative to the first row; raises ValueError naming the
    line of a malformed row (a benchmark on silently skipped rows would be a different load)."""
    rows: list[tuple[datetime, int, int]] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
        for n, rec in enumerate(reader, start=2):
            try:
                rows.append((_parse_time(rec["TIMESTAMP"]), int(rec["ContextTokens"]),
                             int(rec["GeneratedTokens"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: bad row {rec!r}: {exc}") from exc
    if not rows:
        raise ValueError(f"{path}: no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRow((t - t0).total_seconds(), max(1, c), max(1, g)) for t, c, g in rows]


def assign_classes(rows: Sequence[TraceRow], rule: ClassRule = ClassRule()) -> list[Arrival]:
    """Classes and full-scale sizes for every row (times still the trace's own)."""
    rng = random.Random(rule.seed)
    out = []
    for i, row in enumerate(rows):
        draw = rng.random()
        prompt, output = row.context_tokens, row.generated_tokens
        if row.context_tokens >= rule.long_prompt and draw < rule.p2_long_share:
            cls = "P2"
            output = min(output, rule.max_prompt // 4)
            prompt = min(int(prompt * rule.p2_stretch), rule.max_prompt - output)
        elif row.context_tokens <= rule.short_prompt:
            cls = "P0" if draw < rule.p0_short_share else "P1"
        else:
            cls = "P1" if draw < rule.p1_long_share else "P0"
        out.append(Arrival(i, row.t_s, cls, max(2, prompt), max(1, output), row.t_s))
    return out


@dataclass(frozen=True)
class SizeScale:
    """How an engine shrinks the trace's sizes (the tiny torch model cannot take 32K at
    full speed on a CPU); sim runs at full scale (1, 1)."""

    prompt_div: float = 1.0
    output_div: float = 1.0
    min_prompt: int = 2
    min_output: int = 1


ENGINE_SCALE = {"sim": SizeScale(), "torch": SizeScale(8.0, 4.0, 4, 2)}


def scale_sizes(arrivals: Sequence[Arrival], scale: SizeScale) -> list[Arrival]:
    return [replace(a, prompt_tokens=max(scale.min_prompt, round(a.prompt_tokens / scale.prompt_div)),
                    max_tokens=max(scale.min_output, round(a.max_tokens / scale.output_div)))
            for a in arrivals]


def trace_rate(arrivals: Sequence[Arrival]) -> float:
    """The trace's own request rate over the given rows (requests per trace-second)."""
    if len(arrivals) < 2:
        return 1.0
    span = arrivals[-1].trace_t_s - arrivals[0].trace_t_s
    return (len(arrivals) - 1) / span if span > 0 else float(len(arrivals))


def time_scaled(arrivals: Sequence[Arrival], speedup: float, duration_s: float) -> list[Arrival]:
    """Arrivals with the trace clock sped up ``speedup`` times, from the window's first row,
    keeping those that fall inside ``duration_s``; indexes renumbered from 0."""
    if not arrivals:
        return []
    t0 = arrivals[0].trace_t_s
    out = []
    for a in arrivals:
        at = (a.trace_t_s - t0) / speedup
        if at >= duration_s:
            break
        out.append(replace(a, index=len(out), at_s=at))
    return out


def class_mix(arrivals: Sequence[Arrival]) -> dict[str, dict[str, float]]:
    """Per class: share of requests, mean prompt and output tokens (for the report)."""
    n = max(1, len(arrivals))
    mix = {}
    for cls in CLASSES:
        rs = [a for a in arrivals if a.cls == cls]
        if rs:
            mix[cls] = {"share": len(rs) / n, "requests": len(rs),
                        "mean_prompt_tokens": sum(a.prompt_tokens for a in rs) / len(rs),
                        "mean_output_tokens": sum(a.max_tokens for a in rs) / len(rs)}
    return mix
