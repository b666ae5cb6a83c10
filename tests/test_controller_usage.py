"""The law's ``used`` input: claimed requests/s from the stats counters x mean work."""

from __future__ import annotations

import pytest

from limiter.controller.usage import UsageMeter


def test_used_is_the_claimed_rate_times_the_mean_work_of_a_request():
    m = UsageMeter(["P0", "P1"], window_s=1.0, cost_samples=3)
    assert m.used("P1", served_fallback=123.0) == 123.0  # nothing measured yet
    m.observe_counters(0.0, {b"P1.admitted": b"900", b"P1.claimed": b"100"})
    assert m.claimed_per_s("P1") is None
    for work in (100.0, 200.0, 300.0, 400.0):  # only the last 3 count
        m.observe_work("P1", work)
    assert m.mean_work("P1") == pytest.approx(300.0)
    m.observe_counters(500.0, {b"P1.admitted": b"990", b"P1.claimed": b"105"})  # demand is not use
    assert m.claimed_per_s("P1") == pytest.approx(10.0)
    assert m.used("P1", served_fallback=0.0) == pytest.approx(3000.0)
    assert m.used("P0", served_fallback=7.0) == 7.0  # no sample of P0 yet: the fallback


def test_the_rate_covers_about_the_last_window_and_survives_a_counter_reset():
    m = UsageMeter(["P1"], window_s=1.0)
    m.observe_work("P1", 10.0)
    for i in range(30):  # 100/s for 3 s, sampled every 0.1 s
        m.observe_counters(i * 100.0, {"P1.claimed": str(i * 10)})
    assert m.claimed_per_s("P1") == pytest.approx(100.0)
    m.observe_counters(3100.0, {"P1.claimed": "290"})  # then nothing for 0.2 s ...
    m.observe_counters(3200.0, {"P1.claimed": "290"})
    assert m.claimed_per_s("P1") == pytest.approx(70.0)  # ... shows within one window (2.2 s .. 3.2 s)
    m.observe_counters(3300.0, {"P1.claimed": "3"})  # Redis restarted without persistence
    assert m.claimed_per_s("P1") is None  # a new baseline, not a negative rate
    m.observe_counters(3400.0, {"P1.claimed": "13"})
    assert m.claimed_per_s("P1") == pytest.approx(100.0)


def test_a_class_claimed_a_few_times_a_second_is_measured_over_enough_claims():
    """Two claims a second: a second's count is Poisson noise (on a running stack a dip of it
    took P1 from 0.34 to 0.15 of the pool in one 10 % cut). The window reaches back until it
    holds ``min_claims`` claims, at most ``max_window_s``."""
    m = UsageMeter(["P1"], window_s=1.0, min_claims=20, max_window_s=10.0)
    for s in range(12):  # 2 claims/s for 11 s, then a second with one claim
        m.observe_counters(s * 1000.0, {"P1.claimed": str(2 * s)})
    m.observe_counters(12_000.0, {"P1.claimed": "23"})
    assert m.claimed_per_s("P1") == pytest.approx(2.0, rel=0.1)  # 20 claims back: 10 s, not 1 s
    old = UsageMeter(["P1"], window_s=1.0, min_claims=0)
    for s in range(12):
        old.observe_counters(s * 1000.0, {"P1.claimed": str(2 * s)})
    old.observe_counters(12_000.0, {"P1.claimed": "23"})
    assert old.claimed_per_s("P1") == pytest.approx(1.0)  # the second's dip, as before


def test_a_rare_class_is_measured_over_at_most_the_longest_window():
    m = UsageMeter(["P2"], window_s=1.0, min_claims=20, max_window_s=10.0)
    for s in range(40):  # one claim every 2 s
        m.observe_counters(s * 1000.0, {"P2.claimed": str(s // 2)})
    assert m.claimed_per_s("P2") == pytest.approx(0.5, rel=0.15)
    assert len(m._snaps) <= 12  # snapshots older than the longest window are dropped


def test_a_flood_is_seen_within_a_second_and_a_busy_class_keeps_its_one_second_window():
    m = UsageMeter(["P2"], window_s=1.0, min_claims=20, max_window_s=10.0)
    count = 0
    for tick in range(100):  # 0.5 claims/s for 10 s, read every 100 ms ...
        count += tick % 20 == 0
        m.observe_counters(tick * 100.0, {"P2.claimed": str(count)})
    for tick in range(100, 111):  # ... then 50/s for 1 s
        count += 5
        m.observe_counters(tick * 100.0, {"P2.claimed": str(count)})
    assert m.claimed_per_s("P2") == pytest.approx(50.0, rel=0.1)  # 50 claims in the last second


def test_the_measured_rate_of_a_slow_class_is_steadier_than_a_second_s_count():
    """Poisson claims at 2/s, read every second for 300 s: the relative spread of the figure
    the law sizes its cuts from is about a third of a second's count's."""
    import random
    import statistics

    rng = random.Random(7)

    def spread(meter: UsageMeter) -> float:
        count, rates = 0, []
        for s in range(300):
            t = 0.0
            while True:  # this second's arrivals
                t += rng.expovariate(2.0)
                if t >= 1.0:
                    break
                count += 1
            meter.observe_counters(s * 1000.0, {"P1.claimed": str(count)})
            if s >= 15:
                rates.append(meter.claimed_per_s("P1"))
        return statistics.pstdev(rates) / statistics.mean(rates)

    one_second = spread(UsageMeter(["P1"], window_s=1.0, min_claims=0))
    enough = spread(UsageMeter(["P1"], window_s=1.0, min_claims=20, max_window_s=10.0))
    assert one_second > 0.5  # 1 / sqrt(2) in theory
    assert enough < 0.3, (one_second, enough)  # ~1 / sqrt(20)


def test_a_term_s_meter_takes_the_controller_s_settings():
    from limiter.config import demo_config
    from limiter.controller.settings import ControllerSettings
    from limiter.controller.term import new_term

    cfg = demo_config()
    settings = ControllerSettings(used_min_claims=5, used_max_window_s=30.0)
    term = new_term(1, {}, cfg, cfg.pools[0], settings, now_ms=0.0)
    assert (term.usage.min_claims, term.usage.max_window_ms) == (5, 30_000.0)
