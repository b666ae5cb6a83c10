"""The benchmarks' goal verdicts (limiter/bench/report.py, tenants.py): a figure that misses
its goal never reads "met". Found by review: each test failed before its fix (figures rounded
before the check, 0/0 read as 0, every 503 read as an expiry, a zero read as "not measured",
a mostly refused tenant read as served in time). Pure Python, no processes."""

from __future__ import annotations

import dataclasses
from typing import Any

from limiter.bench import tenants as tb
from limiter.bench import trace as tr
from limiter.bench.driver import Record
from limiter.bench.report import class_stats, mode_summary, targets
from limiter.config import DEFAULT_CLASSES
from limiter.localstack.loadgen import Result
from tests.support.helpers import tenant_figures

P0, P1, P2 = DEFAULT_CLASSES


def _rec(cls: str, status: int = 200, ttft: float = 100.0, times: tuple[float, ...] = (1.0, 1.02, 1.04),
         out: int = 3, inp: int = 10, error: str = "", tenant: str = "") -> Record:
    arrival = tr.Arrival(0, 0.0, cls, inp, out, 0.0, tenant)
    ok = status == 200 and not error
    res = Result(cls=cls, sent_s=0.9, status=status, ttft_ms=ttft if ok else None,
                 token_times=list(times) if ok else [], output_tokens=out if ok else 0,
                 input_tokens=inp if ok else 0, error=error if error else ("" if status == 200 else "x"))
    return Record(arrival, res, 0.0)


P2_EXPIRED = "P2 admitted that expired in the queue or were left unresolved (qos)"


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in rows if r["target"] == name)


# --- 1. figures rounded before the goal check: "met" on a miss ---------------------------------------

def test_p0_attainment_is_rounded_before_the_goal_check() -> None:
    """198 of 199 P0 requests inside the SLO is 0.99497 < 0.995, yet slo_attainment is rounded
    to 4 places (0.995) before targets() compares it, so the target reads met."""
    recs = [_rec("P0") for _ in range(198)] + [_rec("P0", status=429)]
    s = class_stats(recs, P0, [])
    assert 198 / 199 < 0.995
    rows = targets({"params": {"load": 1.5}, "modes": {"qos": {"classes": {"P0": s}}}})
    row = _row(rows, "P0 SLO attainment (qos)")
    assert row["met"] is not True, (s["slo_attainment"], row)


def test_p2_served_work_share_is_rounded_before_the_floor_check() -> None:
    """P2 served 49,996 of 1,000,000 weighted tokens (0.049996 < floor 0.05); the share is
    rounded to 4 places (0.05) before the floor check, so the floor target reads met."""
    classes = ["P0", "P1", "P2"]
    recs = [_rec("P0", inp=950_001, out=3), _rec("P2", inp=49_993, out=3)]
    m = mode_summary(recs, classes=classes, slos={"P0": P0, "P1": P1, "P2": None}, samples=[],
                     tenant_of={}, t0=0.0, duration_s=10.0, out_weight=1.0)
    true_share = 49_996 / 1_000_000
    assert true_share < 0.05
    rows = targets({"params": {"load": 1.5, "class_floor": {"P2": 0.05}}, "modes": {"qos": m}})
    row = _row(rows, "P2 served share of work (qos)")
    assert row["met"] is not True, (m["classes"]["P2"]["served_work_share"], row)


def test_tenants_jain_is_rounded_before_the_goal_check() -> None:
    """Jain over (3191, 2000) is 0.949992 < 0.95; jain() rounds to 4 places (0.95) and the
    vtc target reads met."""
    exact = (3191 + 2000) ** 2 / (2 * (3191 ** 2 + 2000 ** 2))
    assert exact < 0.95

    t = tenant_figures
    results: dict[str, Any] = {"modes": {
        "alone": {"tenants": {"steady": t(100.0, 10)}},
        "vtc": {"tenants": {"steady": t(100.0, 10), "heavy": t(1, 3191), "medium": t(1, 2000)}},
    }}
    tb.summarize(results)
    met = {r["target"]: r["met"] for r in results["targets"]}
    assert met["Jain index, backlogged tenants (vtc)"] is not True, results["modes"]["vtc"]["jain_backlogged"]


def test_tenants_steady_ratio_is_rounded_before_the_goal_check() -> None:
    """Steady's TTFT p99 150.04 ms against 100.0 alone is 1.5004x > 1.5; the p99s are rounded
    to 0.1 ms (150.0) before the ratio, so the vtc target reads met."""
    alone = tb.tenant_stats([_rec("P1", ttft=100.0, tenant="steady")], 0.0, 60.0, 1.0)
    vtc = tb.tenant_stats([_rec("P1", ttft=150.04, tenant="steady")], 0.0, 60.0, 1.0)
    assert 150.04 / 100.0 > 1.5
    results: dict[str, Any] = {"modes": {"alone": {"tenants": {"steady": alone}},
                                         "vtc": {"tenants": {"steady": vtc}}}}
    tb.summarize(results)
    met = {r["target"]: r["met"] for r in results["targets"]}
    assert met["steady TTFT p99 / alone (vtc)"] is not True, results["modes"]["vtc"]["steady_p99_over_alone"]


# --- 2. P2 "admitted that expired": 0/0 and refusals counted as expiries ------------------------------

def test_p2_expired_target_is_met_when_no_p2_was_admitted() -> None:
    """Every P2 refused at admission (10 of 10 are 429): 0 admitted, so the share of admitted
    that expired is 0/0; targets() reports 0.0 and 'met', i.e. 'queued rather than refused'
    passes when everything was refused."""
    s = class_stats([_rec("P2", status=429) for _ in range(10)], None, [])
    rows = targets({"params": {"load": 1.5}, "modes": {"qos": {"classes": {"P2": s}}}})
    row = _row(rows, P2_EXPIRED)
    assert row["met"] is not True, row


def test_p2_queue_full_refusal_is_counted_as_admitted_and_expired() -> None:
    """A 503 queue_full is a refusal at admission (outcome 'shed'; the request never entered the
    queue), but the target divides all 503s by sent - 429: 5 shed + 5 completed reads as 50 %
    of admitted P2 requests expiring in the queue (the truth: 0 of 5 admitted expired)."""
    recs = [_rec("P2") for _ in range(5)] + [_rec("P2", status=503, error="queue_full") for _ in range(5)]
    s = class_stats(recs, None, [])
    rows = targets({"params": {"load": 1.5}, "modes": {"qos": {"classes": {"P2": s}}}})
    assert _row(rows, P2_EXPIRED)["value"] == 0.0


# --- 3. a zero measurement turned into "not measured" -------------------------------------------------

def test_work_conservation_target_is_not_na_when_qos_did_no_work() -> None:
    """qos's workers did 0 weighted tokens/s in the window, fifo's 30,000: the ratio is 0,
    a miss; `sq / sf if sq and sf` treats 0.0 as missing and the target reads n/a."""
    results = {"params": {"load": 1.0},
               "modes": {"qos": {"server_work_s": 0.0}, "fifo": {"server_work_s": 30_000.0}}}
    rows = targets(results)
    row = _row(rows, "work done by the workers qos / fifo (weighted tokens/s in the window)")
    assert row["met"] is False, row


# --- 4. the steady tenant's p99 ignores its refused requests --------------------------------------------

def test_tenants_steady_target_is_not_met_when_steady_is_mostly_refused() -> None:
    """vtc refuses 99 of steady's 100 requests (429) and serves one fast: TTFT p99 is taken over
    the one completed request, the ratio is 1.0 and 'steady within 1.5x of alone' reads met."""
    alone = tb.tenant_stats([_rec("P1", ttft=100.0, tenant="steady") for _ in range(100)], 0.0, 60.0, 1.0)
    vtc = tb.tenant_stats([_rec("P1", ttft=100.0, tenant="steady")]
                          + [_rec("P1", status=429, tenant="steady") for _ in range(99)], 0.0, 60.0, 1.0)
    results: dict[str, Any] = {"modes": {"alone": {"tenants": {"steady": alone}},
                                         "vtc": {"tenants": {"steady": vtc}}}}
    tb.summarize(results)
    met = {r["target"]: r["met"] for r in results["targets"]}
    assert met["steady TTFT p99 / alone (vtc)"] is not True, (vtc, results["modes"]["vtc"])


def test_attainment_judges_a_long_prompt_against_its_own_ttft_target() -> None:
    """A class with ``slo_ttft_ms_per_1k_prompt_tokens``: the bench's client-side attainment
    uses the target the controller judges by (base + allowance x prompt tokens / 1,000)."""
    p0 = dataclasses.replace(P0, slo_ttft_ms_per_1k_prompt_tokens=100.0)
    long_prompt = [_rec("P0", ttft=1_200.0, inp=8_000), _rec("P0", ttft=1_400.0, inp=8_000)]
    assert class_stats(long_prompt, p0, [])["slo_attainment"] == 0.5  # target 1,300 ms
    assert class_stats(long_prompt, P0, [])["slo_attainment"] == 0.0  # a fixed 500 ms
    assert class_stats(long_prompt, p0, [])["slo"]["ttft_ms_per_1k_prompt_tokens"] == 100.0
    # the allowance past a base length: 8,000 - 6,000 tokens -> a 700 ms target
    based = dataclasses.replace(p0, slo_ttft_base_prompt_tokens=6_000)
    in_time = [_rec("P0", ttft=690.0, inp=8_000), _rec("P0", ttft=710.0, inp=8_000)]
    assert class_stats(in_time, based, [])["slo_attainment"] == 0.5
    assert class_stats(in_time, based, [])["slo"]["ttft_base_prompt_tokens"] == 6_000


# --- 5. the gap probe's ratio without a long prefill next to the P0 stream ------------------------------

def _stream(sent: float, times: list[float], status: int = 200, error: str = "") -> Result:
    ok = status == 200
    return Result(cls="P0", sent_s=sent, status=status, error=error, token_times=times if ok else [],
                  ttft_ms=(times[0] - sent) * 1000 if times and ok else None,
                  output_tokens=len(times) if ok else 0)


def _probe(why: str) -> dict[str, Any]:
    from limiter.bench.gapprobe import GapProbe

    return GapProbe(60.0, 62.0, 40.0, 41.0, 32_000, None if why else 900.0, 400, 1, why).to_dict()


def test_gap_probe_has_no_ratio_unless_the_long_prefill_ran_beside_the_p0_stream() -> None:
    """Found by review: ratio_client (during / alone) was computed, and could read met, when the
    long P2 request was refused (429) or rejected (400), or prefilled before or after the P0
    stream: nothing stalled the stream, so a gap near its alone figure proved nothing."""
    from limiter.bench.gapprobe import why_no_ratio

    p0 = [_stream(10.0, [10.05 + 0.05 * i for i in range(100)])]  # 10.05-15.0 s
    assert why_no_ratio(p0, _stream(10.5, [12.0, 12.1])) == ""  # prefill 10.5-12.0: inside
    assert "failed (429" in why_no_ratio(p0, _stream(10.5, [], status=429, error="rate_limited"))
    assert "failed (400" in why_no_ratio(p0, _stream(10.5, [], status=400, error="context_length"))
    assert "did not overlap" in why_no_ratio(p0, _stream(15.5, [16.0, 16.1]))  # after the stream
    assert "did not overlap" in why_no_ratio(p0, _stream(8.0, [9.9, 10.0]))  # before its first chunk
    assert "P0 stream" in why_no_ratio([_stream(10.0, [], status=503)], _stream(10.5, [12.0, 12.1]))
    assert _probe("")["ratio_client"] is not None
    failed = _probe("the long request failed (429 rate_limited)")
    assert failed["ratio_client"] is None and failed["ratio_worker"] is None
    assert failed["no_ratio"] == "the long request failed (429 rate_limited)"
    rows = targets({"params": {"load": 1.5}, "modes": {"qos": {"gap_probe": failed}}})
    row = _row(rows, "P0 max gap during long prefill / alone, client (qos)")
    assert row["met"] is False and "429" in row["value"], row
    ok = targets({"params": {"load": 1.5}, "modes": {"qos": {"gap_probe": _probe("")}}})
    assert _row(ok, "P0 max gap during long prefill / alone, client (qos)")["met"] is True


# --- 6. P2 still unresolved at the drain's end read as admitted and served in time ----------------------

def test_p2_unresolved_at_the_drain_s_end_counts_against_the_expired_target() -> None:
    """Found by review: the share was expired_503 / (sent - 429 - shed), so a P2 request still
    open when the drain ran out (``incomplete``, counted as failed) was admitted and not expired:
    10 completed and 10 left open read 0 % expired, met."""
    from limiter.bench.driver import INCOMPLETE

    recs = [_rec("P2") for _ in range(10)] + [_rec("P2", error=INCOMPLETE) for _ in range(10)]
    s = class_stats(recs, None, [])
    assert s["failed"] == 10
    rows = targets({"params": {"load": 1.5}, "modes": {"qos": {"classes": {"P2": s}}}})
    row = _row(rows, P2_EXPIRED)
    assert (row["value"], row["met"]) == (0.5, False), row
    count = _row(rows, "P2 unresolved: failed or still open at the drain's end (qos, count, for reference)")
    assert count["value"] == 10
