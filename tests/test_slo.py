"""SLO judging and the sliding compliance window (limiter/controller/slo_window.py)."""

from __future__ import annotations

import random

import pytest

from limiter.controller.slo_window import DEFAULT_SLOS, SloMonitor, SloWindow
from limiter.errors import InvalidArgument
from limiter.samples import Sample
from limiter.slo import ClassSLO


def sample(
    cls: str = "P0",
    outcome: str = "ok",
    ts: float = 0.0,
    ttft: float | None = 100.0,
    tpot: float | None = None,
) -> Sample:
    return Sample(cls, outcome, ts, 10, 10, 0.0, 1.0, ttft, tpot, tpot)


# --- judging ----------------------------------------------------------------------------
def test_judge_rules() -> None:
    p0 = DEFAULT_SLOS["P0"]
    assert p0.judge(sample(ttft=500.0)) is True  # the target itself is met
    assert p0.judge(sample(ttft=500.1)) is False
    assert p0.judge(sample(ttft=100.0, tpot=50.1)) is False
    assert p0.judge(sample(ttft=100.0, tpot=None)) is True  # no TPOT: judged on TTFT alone
    assert p0.judge(sample(outcome="expired", ttft=None)) is False
    assert p0.judge(sample(outcome="failed", ttft=10.0)) is False
    assert p0.judge(sample(outcome="rejected", ttft=None)) is False  # a 429 of the class budget
    assert p0.judge(sample(outcome="cancelled", ttft=9999.0)) is None  # the client left
    # failed for what it is (a prompt past any context): no sign of the class's service
    assert p0.judge(sample(outcome="refused", ttft=None)) is None
    assert DEFAULT_SLOS["P2"].judge(sample("P2", ttft=99999.0)) is None
    assert ClassSLO(tpot_ms=30.0).judge(sample(ttft=99999.0, tpot=20.0)) is True


def test_a_wait_its_client_shortened_is_a_miss_only_past_the_ttft_target() -> None:
    """An expiry or a refusal at admission for a max wait the client set below its class's
    (``ttft_at_least_ms``): not counted while that wait is within the TTFT target; a miss
    past it (the first token could not have met it either)."""
    from dataclasses import replace

    p0 = DEFAULT_SLOS["P0"]
    for outcome in ("expired", "rejected"):
        own = replace(sample(outcome=outcome, ttft=None), ttft_at_least_ms=50.0)
        assert p0.judge(own) is None
        assert p0.judge(replace(own, ttft_at_least_ms=500.0)) is None
        assert p0.judge(replace(own, ttft_at_least_ms=500.1)) is False
        assert ClassSLO(tpot_ms=30.0).judge(replace(own, ttft_at_least_ms=9999.0)) is None  # no TTFT target
    assert p0.judge(replace(sample(outcome="failed", ttft=None), ttft_at_least_ms=5.0)) is False  # not a wait


def test_a_ttft_target_per_prompt_token_grows_with_the_prompt() -> None:
    """``ttft_ms_per_1k_prompt_tokens``: the target is the base plus so much per 1,000 prompt
    tokens, for a first token that came and for a client's own shorter wait alike."""
    from dataclasses import replace

    p0 = ClassSLO(ttft_ms=500.0, tpot_ms=50.0, ttft_ms_per_1k_prompt_tokens=100.0)
    assert p0.ttft_target_ms(0) == 500.0
    assert p0.ttft_target_ms(8_000) == pytest.approx(1_300.0)
    assert ClassSLO(tpot_ms=50.0, ttft_ms_per_1k_prompt_tokens=100.0).ttft_target_ms(8_000) is None
    long = replace(sample(ttft=1_299.0), input_tokens=8_000)
    assert p0.judge(long) is True
    assert p0.judge(replace(long, ttft_ms=1_300.1)) is False
    assert DEFAULT_SLOS["P0"].judge(long) is False  # a fixed target: the same request misses
    assert p0.judge(replace(long, tpot_mean_ms=50.1)) is False  # the TPOT target is unchanged
    short = replace(sample(ttft=520.5), input_tokens=200)  # target 520 ms
    assert p0.judge(short) is False
    # an openai worker's sample: input_tokens is the model server's count (2,000), the
    # target is set by admission's (8,000 of the pool's tokens), as for the other writers
    upstream = replace(long, input_tokens=2_000, prompt_tokens=8_000)
    assert p0.judge(upstream) is True
    assert p0.judge(replace(upstream, prompt_tokens=2_000)) is False
    waited = replace(sample(outcome="expired", ttft=None), input_tokens=8_000, ttft_at_least_ms=1_000.0)
    assert p0.judge(waited) is None  # within this prompt's target: the client's own short wait
    assert p0.judge(replace(waited, ttft_at_least_ms=1_300.1)) is False


def test_a_base_prompt_length_keeps_short_prompts_on_the_fixed_target() -> None:
    """``ttft_base_prompt_tokens``: the allowance counts only the tokens past it, so a prompt
    within it is judged against ``ttft_ms`` alone and a long one by what lies beyond."""
    from dataclasses import replace

    p0 = ClassSLO(ttft_ms=500.0, ttft_ms_per_1k_prompt_tokens=250.0, ttft_base_prompt_tokens=1_000)
    assert p0.ttft_target_ms(400) == 500.0  # within the base: no allowance (was 600 without it)
    assert p0.ttft_target_ms(1_000) == 500.0
    assert p0.ttft_target_ms(9_000) == pytest.approx(2_500.0)  # 8,000 past the base
    short = replace(sample(ttft=520.0), input_tokens=400)
    assert p0.judge(short) is False
    assert replace(p0, ttft_base_prompt_tokens=0).judge(short) is True
    assert p0.judge(replace(sample(ttft=2_499.0), input_tokens=9_000)) is True


# --- window -----------------------------------------------------------------------------
def test_window_counts_only_the_last_n_judged_samples() -> None:
    w = SloWindow(DEFAULT_SLOS["P0"], size=4)
    for ttft in (900, 900, 100, 100, 100):  # two violations, then three met
        w.add(sample(ttft=ttft))
    w.add(sample(outcome="cancelled"))  # ignored: does not push a met sample out
    stats = w.stats()
    assert (stats.count, stats.met) == (4, 3)
    assert stats.compliance == pytest.approx(0.75)


def test_window_running_counts_match_brute_force() -> None:
    rng = random.Random(7)
    w = SloWindow(DEFAULT_SLOS["P0"], size=50, max_age_s=2.0)
    kept: list[tuple[float, bool]] = []
    mark = float("-inf")
    for i in range(3000):
        ts = i * 10.0
        if rng.random() < 0.01:
            mark = ts
            w.mark(ts)
        outcome = rng.choice(["ok", "ok", "ok", "expired", "cancelled"])
        verdict = w.add(sample(outcome=outcome, ts=ts, ttft=rng.choice([100.0, 800.0])))
        if verdict is not None:
            kept.append((ts, verdict))
        kept = [(t, v) for t, v in kept[-50:] if t >= ts - 2000.0]
        stats = w.stats(now_ms=ts)
        fresh = [v for t, v in kept if t > mark]
        assert (stats.count, stats.met) == (len(kept), sum(v for _, v in kept))
        assert (stats.fresh_count, stats.fresh_met) == (len(fresh), sum(fresh))


def test_max_age_forgets_an_idle_class() -> None:
    w = SloWindow(DEFAULT_SLOS["P0"], size=1000, max_age_s=60.0)
    w.add(sample(ts=0.0, ttft=900.0))
    assert w.stats(now_ms=59_000).count == 1
    assert w.stats(now_ms=61_000).compliance is None


def test_mark_starts_fresh_evidence() -> None:
    w = SloWindow(DEFAULT_SLOS["P0"])
    for i in range(10):
        w.add(sample(ts=float(i), ttft=900.0))
    w.mark(9.0)
    assert w.stats().fresh_compliance is None and w.stats().compliance == 0.0
    w.add(sample(ts=10.0, ttft=100.0))
    assert (w.stats().fresh_count, w.stats().fresh_compliance) == (1, 1.0)


def test_class_without_slo_has_no_compliance() -> None:
    m = SloMonitor()
    m.add(sample("P2", ttft=99999.0))
    assert m.stats()["P2"].compliance is None
    assert m.stats()["P2"].has_target is False


def test_monitor_routes_by_class_and_marks_all() -> None:
    m = SloMonitor(size=10)
    m.add(sample("P0", ttft=100.0, ts=1.0))
    m.add(sample("P1", ttft=2500.0, ts=1.0))
    m.mark(1.0)
    stats = m.stats()
    assert (stats["P0"].compliance, stats["P1"].compliance) == (1.0, 0.0)
    assert stats["P0"].fresh_count == stats["P1"].fresh_count == 0
    with pytest.raises(InvalidArgument, match="no SLO window for class 'P7'"):
        m.add(sample("P7"))


def test_window_rejects_bad_sizes() -> None:
    with pytest.raises(InvalidArgument):
        SloWindow(DEFAULT_SLOS["P0"], size=0)
    with pytest.raises(InvalidArgument):
        SloWindow(DEFAULT_SLOS["P0"], max_age_s=0)
