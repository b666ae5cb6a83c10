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
