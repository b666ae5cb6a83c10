"""Smoke test of `qos bench admission`: tiny runs, result structure only (never speed)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from limiter.bench import admission as adm
from limiter.cli import build_parser
from tests.support.helpers import refused_by_name


async def test_admission_report_structure(tmp_path) -> None:
    seen = []
    report = await adm.run_admission(ops=200, rb_seconds=0.05, rounds=1, progress=seen.append)
    has_rb = shutil.which("redis-benchmark") is not None
    drivers = ["redis-py", "redis-benchmark"] if has_rb else ["redis-py"]
    expected = {(d, op, c) for d in drivers for op in adm.OPS for c in adm.CONCURRENCY}
    assert {(m.driver, m.op, m.concurrency) for m in report.measurements} == expected
    assert seen == report.measurements
    for m in report.measurements:
        assert m.ops > 0 and m.seconds > 0 and m.per_s > 0, m
        assert 0 < m.p50_ms <= m.p99_ms, m
        if m.driver == "redis-py":
            assert m.ops == 200 and m.rejected == 0, m  # nothing throttled, no duplicates
    for r in report.ratios():
        assert r["admit_over_set"] > 0 and r["admit_over_limits"] > 0
    assert report.meta["private_server"] is True
    path = tmp_path / "bench.json"
    adm.write_json(report, str(path))
    data = json.loads(path.read_text())
    assert len(data["measurements"]) == len(expected)
    assert data["targets"] == {"admit_over_set": 0.7, "admit_over_limits": 1.0}


async def test_rounds_keep_the_best_run() -> None:
    report = await adm.run_admission(ops=100, rounds=2, redis_benchmark=False)
    assert len(report.runs) == 2 * len(report.measurements) == 2 * len(adm.OPS) * len(adm.CONCURRENCY)
    for m in report.measurements:
        same = [r for r in report.runs if (r.driver, r.op, r.concurrency) == (m.driver, m.op, m.concurrency)]
        assert len(same) == 2 and m.per_s == max(r.per_s for r in same)


def test_percentile() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert adm.percentile(xs, 0.5) == 50.0
    assert adm.percentile(xs, 0.99) == 99.0
    assert adm.percentile([3.0], 0.99) == 3.0
    assert math.isnan(adm.percentile([], 0.5))


def test_bench_policy_never_throttles() -> None:
    cfg = adm.bench_config()
    pool = cfg.pool(adm.POOL)
    assert pool.capacity_tokens_s >= 1e12
    assert all(c.queue_cap >= 100_000_000 for c in cfg.classes)


def test_cli_parses() -> None:
    args = build_parser().parse_args(["bench", "admission", "--quick", "--json", "x.json", "--ops", "50"])
    assert args.quick and args.json == "x.json" and args.ops == 50
    assert args.redis_url is None  # never an env-provided server by default


@pytest.mark.parametrize(("flags", "named"), [
    (["--ops", "0"], "--ops: must be in [1, "),  # found by review: `ops or default` ran the default
    (["--quick", "--ops", "0"], "--ops: must be in [1, "),
    (["--rb-seconds", "nan"], "--rb-seconds: must be in (0, 3600]"),
    (["--rb-seconds", "0"], "--rb-seconds: must be in (0, 3600]"),
    (["--rounds", "0"], "--rounds: must be in [1, 1000]"),
])
def test_a_bad_admission_flag_is_refused_by_name_not_replaced_by_the_default(
        flags: list[str], named: str, capsys, monkeypatch) -> None:
    refused_by_name(monkeypatch, capsys, adm, "run_admission", ["bench", "admission", *flags], named)
