"""The controller's edges (found by review; each test failed before its fix): a failover, a
rescale during a violation, samples stamped ahead, a Redis clock stepped back, requests that
expired before any claim. Pure Python, no Redis."""

from __future__ import annotations

import dataclasses

import pytest

from limiter.config import demo_config
from limiter.controller.capacity import CapacityConfig, CapacityEstimator
from limiter.controller.control_law import (
    ClassInputs,
    ClassState,
    ControlConfig,
    ControlState,
    Inputs,
    decide,
)
from limiter.controller.loop import written_by
from limiter.controller.settings import ControllerSettings
from limiter.controller.slo_window import SloWindow
from limiter.controller.term import new_term
from limiter.controller.usage import UsageMeter
from limiter.samples import Sample
from limiter.slo import ClassSLO

C = 100_000.0
CFG = ControlConfig()


def steady(capacity: float, workers: int, p0: tuple[float | None, int] = (0.97, 1000)) -> Inputs:
    return Inputs(capacity, {
        "P0": ClassInputs(p0[0], p0[1], 0.45 * capacity, True, p0[0]),
        "P1": ClassInputs(0.995, 1000, 0.30 * capacity, True, 0.995),
        "P2": ClassInputs(None, 0, 0.05 * capacity, False),
    }, workers)


# --- 1. a failover turns heartbeat noise into an immediate rescale ---------------------------
def test_a_new_leader_does_not_rescale_on_heartbeat_noise_of_an_unchanged_pool() -> None:
    """docs/controller.md: "A new leader continues; it does not restart" and the policy's
    capacity is the estimator's initial value "so the first tick does not see a capacity
    change". The pool (2 workers, 20 000 tok/s) is unchanged; the new leader's estimate is
    3 % off (inside the 10 % dead band) and the old leader changed the rates 1 s ago."""
    cfg = demo_config()
    pool = cfg.pools[0]
    settings = ControllerSettings()
    now = 1_000_000.0
    policy = {"capacity": "20000", "updated_ms": str(now - 1000.0),
              "P0.ceil": "20000", "P1.ceil": "20000", "P2.ceil": "10000"}
    term = new_term(1, policy, cfg, pool, settings, now_ms=now)
    est = term.estimator
    est.set_alive({"w1": now, "w2": now})
    for k in range(3):  # min_reports heartbeats of each worker, same figures as before
        est.observe_worker("w1", 10_300.0, now + 1000.0 * k)
        est.observe_worker("w2", 10_300.0, now + 1000.0 * k)
    t = now + 2000.0  # still inside the old leader's 5 s cooldown
    e = est.estimate(t)
    assert (e.source, e.live_workers) == ("workers", 2)
    assert abs(e.value / term.state.capacity - 1) < settings.capacity_deadband  # noise, not a move
    d = decide(term.state, steady(e.value, e.live_workers, p0=(0.995, 1000)), t)
    assert not d.changed, [c.reason for c in d.classes]


# --- 2. a rescale forgets a violation episode ---------------------------------------------
def test_a_rescale_does_not_end_a_violation_episode() -> None:
    """docs/control-law.md: an episode "ends only when q_k >= T"; "Episode hysteresis
    ensures a real violation is not left parked at 96 %". A worker leaving mid-episode
    (P0 still at 97 %) must not reset it to the dead band."""
    classes = (ClassState("P0", 1.0, recovering=True), ClassState("P1", 1.0), ClassState("P2", 0.5))
    s = dataclasses.replace(ControlState.initial(CFG, C), classes=classes, workers=8)
    d = decide(s, steady(0.9 * C, 7), 0.0)  # a worker left: rescale at once
    assert d.changed and d.classes[0].reason == "capacity_change"
    assert d.state.classes[0].recovering  # P0 has not reached 99 % yet
    # the next verdict, after the cooldown, on fresh samples still at 97 %: keep cutting
    d2 = decide(d.state, steady(0.9 * C, 7), 10_000.0)
    assert d2.classes[2].reason == "tighten_lower_for_P0", [c.reason for c in d2.classes]


# --- 3. one future-stamped sample wipes the SLO window ------------------------------------
def test_one_future_stamped_sample_does_not_wipe_the_slo_window() -> None:
    """decode_sample accepts any ts_ms up to 1e13; SloWindow.add expires by the *sample's*
    ts, so one sample stamped an hour ahead forgets every other sample at once (and blocks
    expiry behind it afterwards)."""
    w = SloWindow(ClassSLO(ttft_ms=500.0), size=1000, max_age_s=600.0)
    now = 1_000_000_000.0
    for i in range(500):
        w.add(Sample("P0", "ok", now - 60_000.0 + i * 100.0, 10, 10, 0.0, 1.0, 100.0))
    assert w.stats(now).count == 500
    w.add(Sample("P0", "ok", now + 3_600_000.0, 10, 10, 0.0, 1.0, 100.0))  # one bad clock
    assert w.stats(now).count == 501  # the 500 samples of the last minute are still in age


# --- 4. one future-stamped sample freezes the capacity intervals --------------------------
def test_one_future_stamped_sample_does_not_freeze_served_rate_and_intervals() -> None:
    """The estimator jumped its open interval to a future sample's and counted every later
    sample there; advance(now) closed nothing until the clock reached it: the served rate (the
    law's `used` fallback) read 0 for the size of the skew. The controller now reads a
    sample's time as no later than its stream entry's (written_by), so it cannot be ahead."""
    est = CapacityEstimator(CapacityConfig(), 50_000.0)
    t0 = 1_000_000_000.0

    def feed(ts: float, written: float) -> None:
        est.observe_sample(written_by(Sample("P0", "ok", ts, 600, 400, 0.0, 1.0, 100.0), f"{int(written)}-0"))

    for sec in range(10):  # 10 requests of 1000 tokens a second: 10 000 tok/s of P0
        for i in range(10):
            feed(t0 + sec * 1000.0 + i * 100.0, t0 + sec * 1000.0 + i * 100.0)
    est.advance(t0 + 10_000.0)
    assert est.served_rate("P0") == pytest.approx(10_000.0)
    # one sample stamped 30 s ahead of when it was written (a writer on a clock that stepped)
    feed(t0 + 40_000.0, t0 + 10_000.0)
    for sec in range(10, 20):  # the same load continues
        for i in range(10):
            feed(t0 + sec * 1000.0 + i * 100.0, t0 + sec * 1000.0 + i * 100.0)
    est.advance(t0 + 20_000.0)
    assert est.served_rate("P0") == pytest.approx(10_000.0, rel=0.2)
    plain = Sample("P0", "ok", t0, 600, 400, 0.0, 1.0, 100.0)
    assert written_by(plain, f"{int(t0) + 500}-3") is plain  # on time (or early): unchanged


# --- 5. a Redis clock step back blinds the usage meter for the size of the step ------------
def test_a_clock_stepped_back_does_not_blind_the_claim_rate_for_the_size_of_the_step() -> None:
    """usage.py restarts the baseline on a counter reset (one read later the rate is back);
    on a Redis clock stepped back (handled by the law for its cooldown, and by the loop only
    when the step passes the last change) it keeps the future-stamped snapshots: the rate is
    None until the clock catches up, and the law's `used` falls back on the lagging served
    rate for that long."""
    m = UsageMeter(["P1"], window_s=1.0)
    m.observe_work("P1", 1000.0)
    for i in range(30):  # 100 claims/s, read every 100 ms
        m.observe_counters(100_000.0 + i * 100.0, {"P1.claimed": str(i * 10)})
    assert m.claimed_per_s("P1") == pytest.approx(100.0)
    base = 100_000.0 - 60_000.0  # the clock steps back a minute; the load goes on
    for i in range(1, 31):  # three more seconds of reads
        m.observe_counters(base + i * 100.0, {"P1.claimed": str(290 + i * 10)})
    assert m.claimed_per_s("P1") == pytest.approx(100.0)


# --- 6. a clock step back holds a persistent capacity move for the size of the step -------
def test_a_clock_stepped_back_does_not_hold_a_capacity_drift() -> None:
    """decide() takes a last change "in the future" for a clock step, "not a reason to hold
    for the size of the step"; the drift timer has no such guard. Last change 2 h ago (so the
    loop's new-term-on-step-back does not fire), the estimate drops 40 % with no worker count
    change, then Redis's clock steps back 10 min: the move is not followed for ~10 min, not
    capacity_persist_s (10 s)."""
    t = 1_000_000_000.0
    s = dataclasses.replace(ControlState.initial(CFG, C), last_change_ms=t - 7_200_000.0)
    low = steady(0.6 * C, 0, p0=(0.995, 1000))
    d = decide(s, low, t)  # the drift starts
    assert not d.changed and d.state.drift_since_ms == t
    stepped = t - 600_000.0 + 1000.0
    for k in range(60):  # a minute of ticks on the stepped-back clock, estimate still -40 %
        d = decide(d.state, low, stepped + 1000.0 * k)
        if d.changed:
            break
    assert d.changed and d.capacity == pytest.approx(0.6 * C), d.state.drift_since_ms


# --- 7. docs: "guarantees sum to exactly C" --------------------------------------------------
def test_guarantees_never_exceed_capacity_and_fill_it_while_p0_allowance_covers_the_rest() -> None:
    """docs/control-law.md said the guarantees "sum to exactly C"; with the top class's ceiling
    below 1 and a lower class cut they sum to less (the rest goes by priority as spare). The
    docs now say so: at most C, exactly C while P0's allowance covers what the others leave."""
    capped = dataclasses.replace(CFG, ceilings=(0.6, 1.0, 0.5)).validate()
    classes = (ClassState("P0", 0.6), ClassState("P1", 0.2), ClassState("P2", 0.05))
    s = dataclasses.replace(ControlState.initial(capped, C), classes=classes)
    assert sum(r.rate for r in s.rates().values()) == pytest.approx(0.85 * C)
    full = (ClassState("P0", 1.0), ClassState("P1", 0.2), ClassState("P2", 0.05))
    s = dataclasses.replace(ControlState.initial(CFG, C), classes=full)
    assert sum(r.rate for r in s.rates().values()) == pytest.approx(C)


# --- 8. requests that expired in the queue dilute `used` --------------------------------
# (and those ended in the queue otherwise: cancelled there, or refused by claim -- a prompt no
# worker can hold -- whose samples name no worker)
@pytest.mark.parametrize("unclaimed", ["expired", "cancelled", "refused"])
def test_used_is_not_diluted_by_requests_no_claim_took(unclaimed: str) -> None:
    """usage.py: used = claimed requests/s x mean work of a recent request. loop.feed gives
    the mean every non-rejected sample, including `expired` ones that never were claimed
    (max wait passed in the queue: work 0), while the rate counts claims only. Under a
    flood, half of P2's requests expiring halves its measured use: a cut sized from it is
    twice a step, and relax sees 'unused'."""
    from types import SimpleNamespace

    from limiter.controller.loop import PoolController

    cfg = demo_config()
    pool = cfg.pools[0]
    term = new_term(1, {}, cfg, pool, ControllerSettings(), now_ms=0.0)
    counter = SimpleNamespace(inc=lambda *a, **k: None)
    metrics = SimpleNamespace(samples=SimpleNamespace(labels=lambda *a: counter))
    fake = SimpleNamespace(pool=pool, metrics=metrics)
    claimed = 0
    t = 1_000_000.0
    ok = Sample("P2", "ok", t, 600, 400, 50.0, 4000.0, 300.0, 20.0, 30.0, "w1")
    for sec in range(10):  # each second: 10 requests claimed and served, 10 expire unclaimed
        for i in range(10):
            PoolController.feed(fake, term, dataclasses.replace(ok, ts_ms=t + sec * 1000 + i * 100))
            PoolController.feed(fake, term, Sample("P2", unclaimed, t + sec * 1000 + i * 100 + 50,
                                                   600, 0, 30_000.0, 30_000.0))
            claimed += 1
            term.usage.observe_counters(t + sec * 1000 + i * 100, {"P2.claimed": str(claimed)})
    per_request = term.estimator.work(ok)
    assert term.usage.claimed_per_s("P2") == pytest.approx(10.0, rel=0.05)
    assert term.usage.used("P2", 0.0) == pytest.approx(10 * per_request, rel=0.05)
