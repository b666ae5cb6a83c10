"""Capacity and served-rate estimation (limiter/controller/capacity.py)."""

from __future__ import annotations

import pytest

from limiter.controller.capacity import CapacityConfig, CapacityEstimator
from limiter.errors import ConfigError, InvalidArgument
from limiter.samples import Sample


def done(
    ts: float, cls: str = "P0", tokens: tuple[int, int] = (600, 400), wait: float = 0.0, outcome: str = "ok"
) -> Sample:
    ttft = None if outcome == "expired" else 100.0
    return Sample(cls, outcome, ts, tokens[0], tokens[1], wait, 1000.0, ttft)


def feed(
    est: CapacityEstimator, seconds: int, per_s: int, wait: float, start_s: int = 0, cls: str = "P0"
) -> None:
    """``per_s`` requests of 1000 tokens each second: ``per_s`` x 1000 tokens/s served."""
    for sec in range(start_s, start_s + seconds):
        for i in range(per_s):
            est.observe_sample(done(sec * 1000.0 + i * (1000.0 / per_s), cls, wait=wait))


def test_initial_until_enough_data() -> None:
    est = CapacityEstimator(CapacityConfig(), 50_000.0)
    assert est.estimate(0.0).value == 50_000.0 and est.estimate(0.0).source == "initial"
    feed(est, seconds=2, per_s=10, wait=500.0)
    est.advance(2000.0)
    assert est.estimate().source == "initial"  # 2 busy intervals < min_busy_intervals (3)


def test_busy_intervals_measure_capacity() -> None:
    est = CapacityEstimator(CapacityConfig(window=5), 50_000.0)
    feed(est, seconds=20, per_s=20, wait=500.0)  # 20 req/s x 1000 tokens, everyone queued
    estimate = est.estimate(20_000.0)
    assert estimate.source == "samples" and estimate.busy_intervals == 20
    assert estimate.value == pytest.approx(20_000.0)
    assert estimate.confidence == pytest.approx(0.5)  # full window, the weaker source


def test_idle_throughput_is_only_a_lower_bound() -> None:
    est = CapacityEstimator(CapacityConfig(window=3), 50_000.0)
    feed(est, seconds=5, per_s=20, wait=500.0)  # busy: capacity 20k
    feed(est, seconds=5, per_s=5, wait=0.0, start_s=5)  # idle at 5k: does not lower it
    assert est.estimate(10_000.0).value == pytest.approx(20_000.0)
    feed(est, seconds=4, per_s=30, wait=0.0, start_s=10)  # 30k, but not yet 5 intervals in a row
    assert est.estimate(14_000.0).value == pytest.approx(20_000.0)
    feed(est, seconds=2, per_s=30, wait=0.0, start_s=14)  # served 30k without queueing: raise
    assert est.estimate(16_000.0).value == pytest.approx(30_000.0)  # median of 20k, 30k, 30k


def test_idle_intervals_swinging_around_their_load_do_not_raise_the_estimate() -> None:
    """Work is counted when a request completes, so an idle interval's figure swings with how
    completions fall; one interval above the estimate raised it, and only the high ones got
    in: an hour at 80 % load with no queueing read 1.5x the pool's capacity (a review). Idle
    time proves capacity only as the least of several intervals in a row."""
    import random

    cap, rng = 10_000.0, random.Random(1)
    est = CapacityEstimator(CapacityConfig(worker_field=""), initial=cap)

    def second(s: int, work: float, wait: float) -> None:
        n = max(0, round(work / 1000))
        for k in range(n):
            est.observe_sample(Sample("P1", "ok", s * 1000.0 + (k + 0.5) * 1000 / n, 500, 500, wait, 1000.0,
                                      ttft_ms=50.0))

    for s in range(10):  # ten busy seconds at capacity
        second(s, cap * rng.gauss(1, 0.15), 200.0)
    for s in range(10, 3610):  # an hour at 80 % load; completions bunch per second (sd 30 %)
        second(s, 0.8 * cap * max(0.0, rng.gauss(1, 0.3)), 0.0)
    assert est.estimate(3_611_000.0).value <= 1.1 * cap


def test_workers_win_and_follow_joins_and_leaves() -> None:
    est = CapacityEstimator(CapacityConfig(window=3, worker_ttl_s=10.0, min_reports=1), 50_000.0)
    feed(est, seconds=5, per_s=20, wait=500.0)
    est.observe_worker("w1", 12_000.0, 5000.0)
    est.observe_worker("w2", 10_000.0, 5000.0)
    assert (est.estimate().value, est.estimate().source, est.estimate().live_workers) == (
        22_000.0,
        "workers",
        2,
    )
    est.observe_worker("w1", 14_000.0, 6000.0)  # median of 12k, 14k: 13k
    assert est.estimate().value == pytest.approx(23_000.0)
    est.observe_worker("w3", 9_000.0, 7000.0)  # a worker joins: counted at once
    assert est.estimate().value == pytest.approx(32_000.0)
    est.remove_worker("w3")  # clean shutdown
    assert est.estimate().value == pytest.approx(23_000.0)
    est.observe_worker("w1", 13_000.0, 15_500.0)
    # w2 last seen at 5 s: silent for more than 10 s at 15.5 s -> gone.
    assert est.estimate(15_500.0).value == pytest.approx(13_000.0)
    est.advance(40_000.0)  # every worker silent: their last sum, newer than the busy intervals
    assert (est.estimate().source, est.estimate().value) == ("workers", pytest.approx(13_000.0))
    feed(est, seconds=4, per_s=20, wait=500.0, start_s=40)  # busy intervals after it: the samples'
    assert est.estimate(45_000.0).source == "samples"


def test_live_workers_without_a_measurement_count_at_the_measured_mean() -> None:
    """At start only some workers have been busy yet: one of four reporting must not quarter
    the pool's capacity (it throttled every class for the first seconds of a run)."""
    est = CapacityEstimator(CapacityConfig(window=3, worker_ttl_s=10.0, min_reports=1), 50_000.0)
    est.set_alive({"w1": 1000.0, "w2": 1000.0, "w3": 1000.0, "w4": 1000.0})
    assert est.estimate(1000.0).source == "initial"  # nobody measured yet
    est.observe_worker("w1", 10_000.0, 1000.0)
    e = est.estimate(1000.0)
    assert (e.value, e.source, e.live_workers) == (40_000.0, "workers", 4)
    est.observe_worker("w2", 6_000.0, 1000.0)
    assert est.estimate(1000.0).value == pytest.approx(16_000.0 + 2 * 8_000.0)
    est.set_alive({"w1": 2000.0, "w2": 2000.0})  # w3 and w4 left the heartbeat set
    assert est.estimate(2000.0).value == pytest.approx(16_000.0)
    est.set_alive({"w1": 3000.0, "w2": 3000.0, "w5": 3000.0})
    est.observe_worker("w1", 10_000.0, 13_000.0)
    # w2's measurement is older than the TTL, but it still heartbeats (idle, reporting
    # nothing): its capacity did not change, so its own figure stays
    est.set_alive({"w1": 13_000.0, "w2": 13_000.0})
    assert est.estimate(13_000.0).value == pytest.approx(16_000.0)
    est.set_alive({"w1": 13_000.0})  # w2 stopped heartbeating: its figure goes
    assert est.estimate(13_000.0).value == pytest.approx(10_000.0)


def test_an_idle_pool_keeps_its_measured_capacity() -> None:
    """After a load ends the workers heartbeat but report nothing (no full steps): the
    estimate stays theirs, not the samples' (which read 2x off in qos bench control)."""
    config = CapacityConfig(window=3, worker_ttl_s=5.0, min_reports=1, min_busy_intervals=1)
    est = CapacityEstimator(config, 50_000.0)
    feed(est, seconds=5, per_s=40, wait=500.0)  # the samples say 40k
    for t in (1000.0, 2000.0, 3000.0):
        est.set_alive({"w1": t, "w2": t})
        est.observe_worker("w1", 10_000.0, t)
        est.observe_worker("w2", 10_000.0, t)
    for t in range(4000, 60_000, 1000):  # a minute of idle heartbeats
        est.set_alive({"w1": float(t), "w2": float(t)})
        e = est.estimate(float(t))
        assert (e.source, e.value) == ("workers", pytest.approx(20_000.0)), t


def test_a_workers_first_reports_do_not_count_yet() -> None:
    """A worker's first heartbeats are taken while it ramps up and read low."""
    est = CapacityEstimator(CapacityConfig(window=4, min_reports=3), 50_000.0)
    est.set_alive({"w1": 1000.0, "w2": 1000.0})
    est.observe_worker("w1", 2_000.0, 1000.0)
    est.observe_worker("w2", 3_000.0, 1000.0)
    est.observe_worker("w1", 8_000.0, 2000.0)
    assert est.estimate(2000.0).source == "initial"
    est.observe_worker("w1", 10_000.0, 3000.0)  # w1's third: its first two left the window
    e = est.estimate(3000.0)
    assert e.value == pytest.approx(2 * 10_000.0)  # w2 counts at w1's figure
    assert e.confidence == pytest.approx(0.25 / 2)  # one of four reports, w2 unmeasured
    est.observe_worker("w1", 11_000.0, 4000.0)
    assert est.estimate(4000.0).value == pytest.approx(2 * 10_500.0)


def test_one_outlying_report_does_not_move_the_estimate() -> None:
    """A heartbeat that timed a long prefill reads several times a decode step's tokens/s:
    the median ignores it (an EWMA moved ~30 % of the jump)."""
    est = CapacityEstimator(CapacityConfig(window=10, min_reports=1), 1.0)
    for i in range(9):
        est.observe_worker("w1", 10_000.0 + 100 * (i % 3), 1000.0 * i)
    before = est.estimate(9000.0).value
    est.observe_worker("w1", 40_000.0, 9000.0)
    assert est.estimate(9000.0).value == pytest.approx(before, rel=0.02)
    assert est.estimate(9000.0).confidence == 1.0
    for i in range(10):  # a real, lasting change shows once it is most of the window
        est.observe_worker("w1", 15_000.0, 10_000.0 + 1000.0 * i)
    assert est.estimate(19_000.0).value == pytest.approx(15_000.0)


def test_work_counts_what_the_pool_actually_did() -> None:
    est = CapacityEstimator(CapacityConfig(), 1.0, {"P2": (0.5, 2.0)})
    assert est.work(done(0.0, "P0", (600, 400))) == 1000.0
    assert est.work(done(0.0, "P2", (600, 400))) == 300.0 + 800.0
    assert est.work(done(0.0, "P0", (600, 0), outcome="expired")) == 0.0  # never ran
    cancelled_in_queue = Sample("P0", "cancelled", 0.0, 600, 0, 50.0, 50.0, None)
    assert est.work(cancelled_in_queue) == 0.0
    cancelled_streaming = Sample("P0", "cancelled", 0.0, 600, 30, 50.0, 900.0, 120.0)
    assert est.work(cancelled_streaming) == 630.0


def test_rejected_samples_are_neither_work_nor_evidence_of_a_busy_pool() -> None:
    est = CapacityEstimator(CapacityConfig(min_busy_intervals=1), 50_000.0)
    for sec in range(5):  # every rejection "waited" 900 ms for tokens at admission
        for i in range(20):
            est.observe_sample(done(sec * 1000.0 + i * 50.0, wait=900.0, outcome="rejected"))
    est.advance(6000.0)
    assert est.estimate().source == "initial" and est.served_rate("P0") == 0.0


def test_served_rate_per_class_over_recent_intervals() -> None:
    est = CapacityEstimator(CapacityConfig(rate_intervals=4), 1.0)
    assert est.served_rate("P0") == 0.0
    feed(est, seconds=4, per_s=10, wait=0.0, cls="P0")
    feed(est, seconds=4, per_s=3, wait=0.0, cls="P2")
    est.advance(4000.0)
    assert est.served_rate("P0") == pytest.approx(10_000.0)
    assert est.served_rate("P2") == pytest.approx(3_000.0)
    est.advance(6000.0)  # two idle seconds: half of the window is zero
    assert est.served_rate("P0") == pytest.approx(5_000.0)
    est.advance(60_000.0)
    assert est.served_rate("P0") == 0.0


def test_late_sample_counts_in_the_open_interval() -> None:
    est = CapacityEstimator(CapacityConfig(rate_intervals=1), 1.0)
    est.observe_sample(done(5000.0))
    est.observe_sample(done(3000.0))  # older timestamp: the work was still done
    est.advance(6000.0)
    assert est.served_rate("P0") == pytest.approx(2000.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("window", 0), ("interval_s", 0.0), ("busy_share", 0.0), ("rate_intervals", 0), ("worker_field", "a b")],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        CapacityConfig(**{field: value}).validate()  # type: ignore[arg-type]
    assert err.value.path == f"controller.capacity.{field}"


def test_bad_initial_weights_and_heartbeats_are_rejected() -> None:
    with pytest.raises(InvalidArgument) as bad_initial:
        CapacityEstimator(CapacityConfig(), 0.0)
    assert bad_initial.value.field == "initial"
    with pytest.raises(InvalidArgument) as bad_weights:
        CapacityEstimator(CapacityConfig(), 1.0, {"P1": (1.0, -1.0)})
    assert bad_weights.value.field == "weights.P1"
    est = CapacityEstimator(CapacityConfig(), 1.0)
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(InvalidArgument):
            est.observe_worker("w1", bad, 0.0)  # type: ignore[arg-type]


def test_a_pool_whose_workers_all_left_keeps_their_last_measure_not_the_configured_guess() -> None:
    """Its one worker restarting, a lightly loaded pool (no busy interval) went back to its
    configured capacity, 180x the measured one, and the law raised every class's rates for
    the worker's return (found by a review of what operators see). It keeps the workers' last
    sum until a worker reports again."""
    est = CapacityEstimator(CapacityConfig(window=3, worker_ttl_s=10.0, min_reports=1), 20_000.0)
    est.observe_worker("w1", 111.6, 1000.0)
    assert est.estimate(1000.0).value == pytest.approx(111.6)
    est.remove_worker("w1")  # stopped (or silent past worker_ttl_s)
    kept = est.estimate(2000.0)
    assert (kept.value, kept.source, kept.live_workers, kept.confidence) == (
        pytest.approx(111.6), "workers", 0, 0.0)
    est.advance(60_000.0)
    assert est.estimate().value == pytest.approx(111.6)
    est.observe_worker("w2", 150.0, 61_000.0)  # a worker reports: its figure
    assert est.estimate().value == pytest.approx(150.0)


def test_when_every_worker_left_busy_intervals_older_than_their_last_sum_do_not_replace_it() -> None:
    """With no measured worker, any busy interval seen this term won over the workers' last
    sum: three busy seconds an hour before the one worker restarted made the estimate 2x the
    measured capacity, and the law rescaled every rate for the worker's return (a review).
    The newer evidence wins: the workers' sum, unless busy intervals came after it."""
    est = CapacityEstimator(CapacityConfig(), initial=20_000.0)
    for s in range(3):  # three busy seconds at the start, completions bunched: 20k "served"
        for j in range(20):
            est.observe_sample(Sample("P1", "ok", s * 1000.0 + j * 50, 500, 500, 500.0, 9000.0, ttft_ms=50.0))
    for s in range(3, 3600):
        est.set_alive({"w1": s * 1000.0})
        est.observe_worker("w1", 10_000.0, s * 1000.0)
    assert est.estimate(3_600_000.0).value == 10_000.0
    est.set_alive({})  # the one worker restarts
    kept = est.estimate(3_600_500.0)
    assert (kept.value, kept.source) == (10_000.0, "workers")
    for s in range(3601, 3605):  # busy intervals after it: they are the newer evidence
        for j in range(30):
            est.observe_sample(Sample("P1", "ok", s * 1000.0 + j * 30, 500, 500, 500.0, 9000.0, ttft_ms=50.0))
    assert est.estimate(3_606_000.0).source == "samples"
