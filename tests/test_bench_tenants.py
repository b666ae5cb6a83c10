"""``qos bench tenants``: the workload, Jain's index, the summary, and a short real run."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from limiter.bench import tenants as tb
from limiter.bench.calibrate import Capacity
from tests.support.helpers import refused_by_name, tenant_figures


def test_jain_index_is_one_for_an_equal_split_and_half_for_one_taker() -> None:
    assert tb.jain([5.0, 5.0]) == 1.0
    assert tb.jain([10.0, 0.0]) == 0.5
    assert tb.jain([3.0, 1.0]) == pytest.approx(0.8)
    assert tb.jain([0.0, 0.0]) is None


def test_each_tenant_offers_its_share_of_capacity() -> None:
    p = tb.TenantParams(duration_s=20.0)
    chat = tb.chat_arrivals(p)
    assert all(a.cls == "P1" and a.prompt_tokens <= tb.CHAT_PROMPT_MAX for a in chat)
    cap = Capacity(engine="sim", workers=4, sample_requests=1, out_weight=10.0,
                   weighted_tokens_s_per_worker=5000.0, mean_weighted_tokens=2000.0, source="test")
    arrivals = tb.tenant_arrivals(p, chat, cap, tb.TENANTS)
    assert [a.index for a in arrivals] == list(range(len(arrivals)))
    assert all(b.at_s >= a.at_s for a, b in itertools.pairwise(arrivals))
    for tenant in tb.TENANTS:
        work = sum(a.prompt_tokens + a.max_tokens * cap.out_weight for a in arrivals if a.tenant == tenant)
        want = getattr(p, tenant) * cap.weighted_tokens_s * p.duration_s
        assert 0.9 * want <= work <= 1.1 * want + 50_000, (tenant, work, want)


def test_summary_computes_ratios_jain_and_targets() -> None:
    t = tenant_figures
    results: dict[str, Any] = {"modes": {
        "alone": {"tenants": {"steady": t(100.0, 10)}},
        "fifo": {"tenants": {"steady": t(900.0, 10), "heavy": t(1, 300), "medium": t(1, 100)}},
        "vtc": {"tenants": {"steady": t(120.0, 10), "heavy": t(1, 200), "medium": t(1, 200)}},
    }}
    tb.summarize(results)
    assert results["modes"]["fifo"]["steady_p99_over_alone"] == 9.0
    assert results["modes"]["vtc"]["steady_p99_over_alone"] == 1.2
    assert results["modes"]["fifo"]["jain_backlogged"] == pytest.approx(0.8)
    assert results["modes"]["vtc"]["jain_backlogged"] == 1.0
    met = {r["target"]: r["met"] for r in results["targets"]}
    assert met["steady TTFT p99 / alone (vtc)"] is True
    assert met["Jain index, backlogged tenants (vtc)"] is True
    assert any("|" in table for table in tb.render(results, markdown=True))


def test_a_short_real_run(tmp_path: Path) -> None:
    p = tb.TenantParams(duration_s=6.0, drain_s=6.0, workers=2, max_seqs=6, calibrate="engine",
                        out_dir=str(tmp_path))
    results = asyncio.run(tb.run_tenants(p))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["schema"] == "qos-bench-tenants/1" and set(on_disk["modes"]) == set(tb.MODES)
    assert set(on_disk["modes"]["alone"]["tenants"]) == {"steady"}
    for mode in ("fifo", "vtc"):
        per = on_disk["modes"][mode]["tenants"]
        assert set(per) == set(tb.TENANTS)
        assert per["steady"]["completed"] > 0 and per["heavy"]["sent"] > per["steady"]["sent"]
        assert on_disk["modes"][mode]["jain_backlogged"] is not None
    assert results["targets"] and {"tenants_service.png", "tenants_ttft.png"} <= {
        f.name for f in tmp_path.iterdir()}


@pytest.mark.parametrize("value", ["0", "-256"])
def test_a_step_budget_below_one_token_is_refused_before_any_stack_starts(
        value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from limiter import cli

    started: list[object] = []
    monkeypatch.setattr(tb, "run_tenants", lambda *a, **k: started.append(a))
    assert cli.main(["bench", "tenants", "--token-budget", value]) == 2
    assert "--token-budget: must be >= 1" in capsys.readouterr().err
    assert started == []


def test_the_step_budget_flag_reaches_the_stack(monkeypatch) -> None:
    from limiter import cli

    seen: list[tb.TenantParams] = []

    async def run(p: tb.TenantParams, console: object = None) -> dict[str, Any]:
        seen.append(p)
        raise SystemExit(0)
    monkeypatch.setattr(tb, "run_tenants", run)
    for argv in (["--token-budget", "256"], [], ["--engine", "torch"]):
        with pytest.raises(SystemExit):
            cli.main(["bench", "tenants", *argv])
    # the default: vLLM's own for the sim (limiter/bench/modes.py), a CPU-sized one for torch
    assert [p.token_budget for p in seen] == [256, 2048, 64]


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--drain", "nan", "--drain: must be in [0, 3600]"),  # found by review: passed `<= 0`
    ("--duration", "nan", "--duration: must be in (0, 3600]"),
    ("--duration", "inf", "--duration: must be in (0, 3600]"),
    ("--heavy", "nan", "--heavy: must be in (0, 20]"),
    ("--steady", "0", "--steady: must be in (0, 20]"),
    ("--medium", "-1", "--medium: must be in [0, 20]"),
])
def test_a_tenants_flag_that_is_not_a_finite_figure_in_range_is_refused_by_name(
        flag: str, value: str, named: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    refused_by_name(monkeypatch, capsys, tb, "run_tenants", ["bench", "tenants", flag, value], named)


def _a_run_of_three_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    """``qos bench tenants`` prints the figures of a made-up run (steady alone, then beside two
    heavy tenants) instead of running one."""
    t = tenant_figures
    results: dict[str, Any] = {"modes": {
        "alone": {"tenants": {"steady": t(100.0, 10)}},
        "vtc": {"tenants": {"steady": t(120.0, 10), "heavy": t(1, 200), "medium": t(1, 200)}},
    }}
    tb.summarize(results)

    async def run(p: tb.TenantParams, console: object = None) -> dict[str, Any]:
        return results
    monkeypatch.setattr(tb, "run_tenants", run)


def test_the_markdown_tables_stay_tables_in_a_narrow_pipe(capsys, monkeypatch) -> None:
    """`qos bench tenants --markdown | tee` (not a terminal: rich's 80 columns) wrapped the
    targets' rows mid-row, and printed the three tables with no blank line between them, so
    a markdown reader took the second and third headers for rows of the first."""
    from limiter import cli

    _a_run_of_three_tenants(monkeypatch)
    monkeypatch.setenv("COLUMNS", "60")
    assert cli.main(["bench", "tenants", "--markdown"]) == 0
    blocks = [b.strip().splitlines() for b in capsys.readouterr().out.strip().split("\n\n")]
    assert [len(b[0].split("|")) - 2 for b in blocks] == [9, 3, 4]  # three tables, by their columns
    for block in blocks:
        assert block[1].startswith("|---")
        assert all(line.startswith("|") and line.endswith("|") for line in block), block


def test_the_terminal_tables_keep_every_column_whole_in_a_pipe(capsys, monkeypatch) -> None:
    """Piped (`qos bench ... | tee run.log`), rich cut every cell to fit 80 columns: the
    tables read "cl…", "se…", "TT…". A pipe gets 200, as `qos status` did already."""
    from limiter import cli

    _a_run_of_three_tenants(monkeypatch)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["bench", "tenants"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "work in window" in out and "steady TTFT p99 / alone (vtc)" in out
