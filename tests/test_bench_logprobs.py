"""tests/bench_logprobs.py (a benchmark script, not collected itself): its rows come out for
each endpoint and number of alternatives, and the bytes a token's logprobs add grow with the
alternatives asked for (each one is a token and its logprob more)."""

from __future__ import annotations

from tests import bench_logprobs as bench


def test_the_logprobs_bench_prints_a_row_for_each_endpoint_and_count() -> None:
    rows = bench.main(["--tokens", "50", "--rounds", "1"])
    assert [(r["endpoint"], r["top"]) for r in rows] == [(e, t) for e in ("chat", "completion")
                                                         for t in bench.TOPS]
    for endpoint in ("chat", "completion"):
        sizes = [r["bytes"] for r in rows if r["endpoint"] == endpoint]
        assert 0 < sizes[0] < sizes[1] < sizes[2] < sizes[3], sizes
    assert all(r["worker_us"] > 0 and r["frontend_us"] >= 0 for r in rows)
