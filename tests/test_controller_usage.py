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


def _meter(**kw: float) -> UsageMeter:
    return UsageMeter(["P1"], window_s=1.0, **({"min_claims": 20, "max_window_s": 10.0} | kw))


def _feed(m: UsageMeter, rates: list[float], tick_ms: float = 1000.0, start_ms: float = 0.0,
          count: float = 0.0) -> tuple[list[float | None], float, float]:
    """Claims at ``rates`` (per second, one a second of time), read every ``tick_ms``; the
    figure at the end of each second, the time and the count reached."""
    out, t = [], start_ms
    for r in rates:
        for _ in range(round(1000 / tick_ms)):
            count += r * tick_ms / 1000
            t += tick_ms
            m.observe_counters(t, {"P1.claimed": str(int(count))})
        out.append(m.claimed_per_s("P1"))
    return out, t, count


def test_a_class_claimed_a_few_times_a_second_is_measured_over_enough_claims():
    """Two claims a second: a second's count is Poisson noise (on a running stack a dip of it
    took P1 from 0.34 to 0.15 of the pool in one 10 % cut). The window reaches back until it
    holds ``min_claims`` claims, at most ``max_window_s``."""
    m = _meter()
    for s in range(12):  # 2 claims/s for 11 s, then a second with one claim
        m.observe_counters(s * 1000.0, {"P1.claimed": str(2 * s)})
    m.observe_counters(12_000.0, {"P1.claimed": "23"})
    assert m.claimed_per_s("P1") == pytest.approx(2.0, rel=0.1)  # 20 claims back: 10 s, not 1 s
    old = _meter(min_claims=0)
    for s in range(12):
        old.observe_counters(s * 1000.0, {"P1.claimed": str(2 * s)})
    old.observe_counters(12_000.0, {"P1.claimed": "23"})
    assert old.claimed_per_s("P1") == pytest.approx(1.0)  # the second's dip, as before
    assert len(old._snaps) <= 3  # no reach: nothing older than the window is kept


def test_a_rare_class_is_measured_over_at_most_the_longest_window():
    m = _meter()
    for s in range(40):  # one claim every 2 s
        m.observe_counters(s * 1000.0, {"P1.claimed": str(s // 2)})
    assert m.claimed_per_s("P1") == pytest.approx(0.5, rel=0.15)
    assert len(m._snaps) <= 12  # snapshots older than the longest window are dropped


@pytest.mark.parametrize("new", [5.0, 10.0, 19.0, 50.0])
def test_a_rise_is_seen_within_a_second(new):
    """Reaching back over a quiet past read a rise to 5 claims a second as 1.0 at +1 s, 1.4
    at +2 s (a review): the new second's count is no draw of the rate before it, so it
    stands alone."""
    m = _meter()
    _, t, count = _feed(m, [0.5] * 20, tick_ms=100.0)
    after, _, _ = _feed(m, [new] * 5, tick_ms=100.0, start_ms=t, count=count)
    assert after == pytest.approx([new] * 5, rel=0.1)


@pytest.mark.parametrize(("before", "tick_ms"), [(50.0, 50.0), (5.0, 100.0)])
def test_a_stop_is_seen_within_seconds(before, tick_ms):
    """A class at 50 claims a second that stops read 14.3 at +1 s and 2.2 at +9 s with the
    reach alone (a review); the change test sees it in the first second at 50/s, the second
    at 5/s."""
    m = _meter()
    _, t, count = _feed(m, [before] * 20, tick_ms=tick_ms)
    after, _, _ = _feed(m, [0.0] * 10, tick_ms=tick_ms, start_ms=t, count=count)
    seen_by_s = 1 if before >= 50 else 2
    assert after[seen_by_s - 1:] == [0.0] * (10 - seen_by_s + 1), after


def test_a_slow_class_that_stops_reads_at_most_a_fifth_of_its_rate_from_five_seconds_on():
    """At 2 claims a second a quiet second or two is ordinary: the stop is read down as the
    reach slides (high meanwhile, which sizes a cut shallower, never deeper), and is 0 once
    the reach holds none of the old claims."""
    m = _meter()
    _, t, count = _feed(m, [2.0] * 20)
    after, _, _ = _feed(m, [0.0] * 11, start_ms=t, count=count)
    assert all(x <= 0.4 for x in after[4:]) and after[-1] == 0.0, after


def test_a_rise_by_three_is_followed_within_three_seconds_and_a_fall_read_high_meanwhile():
    m = _meter()
    _, t, count = _feed(m, [2.0] * 20)
    up, t, count = _feed(m, [6.0] * 5, start_ms=t, count=count)
    assert up[2] >= 0.8 * 6.0 and up[-1] == pytest.approx(6.0, rel=0.1), up
    _, t, count = _feed(m, [6.0] * 15, start_ms=t, count=count)
    down, _, _ = _feed(m, [2.0] * 10, start_ms=t, count=count)
    assert all(x >= 2.0 * 0.9 for x in down), down  # never below the new rate: a shallower cut
    assert down[-1] == pytest.approx(2.0, rel=0.1), down


def test_reads_a_little_over_the_window_apart_keep_their_figure():
    """``used_min_claims`` 0 (no reach) with reads 1000.3 ms apart, as a 1 s tick's sleep
    overshoots: the restart on a gap past the reach (meant for a clock stepped forward) fired
    on every read and left the figure None (a review)."""
    m = _meter(min_claims=0)
    figures = []
    for k in range(6):
        m.observe_counters(1000.3 * (k + 1), {"P1.claimed": str(5 * k)})
        figures.append(m.claimed_per_s("P1"))
    assert figures[0] is None and figures[1:] == pytest.approx([5.0] * 5, rel=0.01)


def test_a_fall_is_seen_within_a_second():
    m = _meter()
    _, t, count = _feed(m, [50.0] * 20, tick_ms=50.0)
    after, _, _ = _feed(m, [2.0] * 5, tick_ms=50.0, start_ms=t, count=count)
    assert after == pytest.approx([2.0] * 5, rel=0.1)  # 14.8 at +1 s with the reach alone


def test_a_forward_clock_step_starts_over_rather_than_spread_claims_over_time_that_never_was():
    """Redis time jumps 60 s ahead: a window reaching over the jump read a 2/s class at
    0.03-0.29 for ten ticks (a review); a gap longer than the reach restarts the baseline."""
    m = _meter()
    _, t, count = _feed(m, [2.0] * 20)
    m.observe_counters(t + 60_000.0, {"P1.claimed": str(int(count) + 2)})
    assert m.claimed_per_s("P1") is None  # one read: a new baseline (the law's fallback stands in)
    after, _, _ = _feed(m, [2.0] * 3, start_ms=t + 60_000.0, count=count + 2)
    assert after == pytest.approx([2.0] * 3, rel=0.1)


def test_a_busy_class_keeps_its_one_second_window():
    m = _meter()
    for tick in range(100):  # 100 claims/s for 10 s, then 30/s for 1 s (a fall, seen at once)
        m.observe_counters(tick * 100.0, {"P1.claimed": str(10 * tick)})
    for tick in range(100, 111):
        m.observe_counters(tick * 100.0, {"P1.claimed": str(990 + 3 * (tick - 99))})
    assert m.claimed_per_s("P1") == pytest.approx(30.0, rel=0.1)


@pytest.mark.parametrize("rate", [2.0, 5.0])
def test_the_measured_rate_of_a_slow_class_is_steadier_than_a_second_s_count(rate):
    """Poisson claims at 2 (5) a second, read every second for 600 s: the relative spread of
    the figure the law sizes its cuts from is well under a second's count's, and its mean
    within a few per cent of the true rate."""
    import random
    import statistics

    def figures(meter: UsageMeter) -> list[float]:
        rng, count, rates = random.Random(7), 0, []
        for s in range(600):
            t = rng.expovariate(rate)
            while t < 1.0:  # this second's arrivals
                count += 1
                t += rng.expovariate(rate)
            meter.observe_counters(s * 1000.0, {"P1.claimed": str(count)})
            if s >= 15:
                rates.append(meter.claimed_per_s("P1"))
        return rates

    one_second, enough = figures(_meter(min_claims=0)), figures(_meter())
    spread = [statistics.pstdev(xs) / statistics.mean(xs) for xs in (one_second, enough)]
    assert spread[0] > 0.4 and spread[1] < 0.7 * spread[0], spread
    assert statistics.mean(enough) == pytest.approx(rate, rel=0.1)  # reads 4-7 % high
    assert sum(x < rate / 2 for x in enough) < 0.2 * sum(x < rate / 2 for x in one_second)


def test_a_term_s_meter_takes_the_controller_s_settings():
    from limiter.config import demo_config
    from limiter.controller.settings import ControllerSettings
    from limiter.controller.term import new_term

    cfg = demo_config()
    settings = ControllerSettings(used_min_claims=5, used_max_window_s=30.0)
    term = new_term(1, {}, cfg, cfg.pools[0], settings, now_ms=0.0)
    assert (term.usage.min_claims, term.usage.max_window_ms) == (5, 30_000.0)


def test_the_reach_is_at_most_a_hundred_windows():
    """Each tick tests every class's count over each window of the reach: bounded."""
    assert _meter(max_window_s=60.0).max_window_ms == 60_000.0
    assert UsageMeter(["P1"], window_s=0.05, min_claims=20, max_window_s=60.0).max_window_ms == 5_000.0
