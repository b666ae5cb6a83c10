"""`qos bench control` (limiter/bench/control.py): the figures are computed as documented, and
the controller on a running stack follows a lost and restarted worker (short form, by
default); the four full scenarios are a slow test."""

from __future__ import annotations

from collections import Counter

import pytest

from limiter.bench import control as cb
from limiter.bench.calibrate import Capacity

CAP = Capacity("sim", 2, 300, 20.2, 10_000.0, 5_000.0, "given")


def test_each_phase_offers_its_load() -> None:
    rows = cb.class_rows("sim")
    s = cb.scenarios()["p2_flood"]
    arrivals = cb.scenario_arrivals(s, rows, CAP)
    assert [a.index for a in arrivals] == list(range(len(arrivals)))
    assert all(0 <= a.at_s <= s.duration_s for a in arrivals)
    assert s.step_s is not None

    def offered(cls: str, start: float, end: float) -> float:
        work = sum(CAP.cost(a) for a in arrivals if a.cls == cls and start <= a.at_s < end)
        return work / (end - start) / CAP.weighted_tokens_s

    assert offered("P2", 0, s.step_s) == pytest.approx(cb.MIX["P2"] * 0.6, rel=0.35)
    assert offered("P2", s.step_s, s.duration_s) == pytest.approx(3.0, rel=0.2)  # the flood
    assert offered("P0", s.step_s, s.duration_s) == pytest.approx(cb.MIX["P0"] * 0.6, rel=0.35)
    counts = Counter(a.cls for a in arrivals)
    assert set(counts) == {"P0", "P1", "P2"}


def test_recovery_is_when_every_later_bin_meets_the_goal() -> None:
    bins = [1.0, 1.0, 1.0, 1.0, 0.5, 0.9, None, 1.0, 0.995]  # 5 s bins, step at 20 s
    assert cb.recovery_s(bins, 20.0) == 10.0  # bad until the bin ending at 30 s
    assert cb.recovery_s([1.0] * 9, 20.0) == 0.0
    assert cb.recovery_s(bins[:6], 20.0) is None  # never recovered


def _row(t: float, capacity: float, p0_rate: float = 100.0, p2_ceil: float = 50.0) -> dict:
    return {"t_s": t, "capacity": capacity, "rates": {"P0": p0_rate}, "ceilings": {"P2": p2_ceil}}


def test_worker_loss_figures_catch_a_slow_or_oscillating_follow() -> None:
    s = cb.Scenario("worker_loss", 120, (cb.Phase(0, {}),), kill_s=40, restart_s=80)
    good = [_row(t, 20_000 if t < 45 or t >= 85 else 10_000) for t in range(120)]
    change = {"classes": {"P0": {"reason": "capacity_change"}}}
    decisions = [{"now_ms": 45_000.0, **change}, {"now_ms": 85_000.0, **change}]
    f = cb.loss_figures(s, good, decisions, 0.0)
    assert (f["follow_down_s"], f["follow_up_s"], f["met"]) == (5.0, 5.0, True)
    slow = [_row(t, 20_000 if t < 75 or t >= 85 else 10_000) for t in range(120)]
    assert cb.loss_figures(s, slow, decisions, 0.0)["met"] is False  # 35 s to follow the loss
    wobbly = decisions + [{"now_ms": ms, **change} for ms in (50_000.0, 55_000.0, 60_000.0)]
    assert cb.loss_figures(s, good, wobbly, 0.0)["met"] is False  # four moves while down
    # "before" is the capacity in force at the kill: a correction (25,000 -> 21,000 at 33 s) is
    # not held against a full return to 21,000 (it was: the median over 25-40 s, 25,000)
    corrected = [_row(t, 25_000 if t < 33 else 21_000 if t < 45 or t >= 85 else 10_000) for t in range(120)]
    f = cb.loss_figures(s, corrected, decisions, 0.0)
    assert (f["capacity_before"], f["follow_up_s"], f["met"]) == (21_000, 5.0, True)


def test_steady_figures_count_changes_and_p0_swing_after_the_settle_time() -> None:
    s = cb.Scenario("steady", 120, (cb.Phase(0, {}),), settle_s=45)
    still = [_row(t, 20_000, p0_rate=100.0 + (t % 3)) for t in range(120)]
    early = [{"now_ms": 10_000.0, "classes": {}}]
    f = cb.steady_figures(s, still, early, 0.0)
    assert (f["changes_after_settle"], f["met"]) == (0, True)
    swinging = [_row(t, 20_000, p0_rate=100.0 if t % 20 else 120.0) for t in range(120)]
    assert cb.steady_figures(s, swinging, early, 0.0)["met"] is False
    busy = [{"now_ms": 50_000.0 + 9_000 * i, "classes": {}} for i in range(8)]
    assert cb.steady_figures(s, still, busy, 0.0)["met"] is False


def test_surge_figures_see_a_cut_to_p1() -> None:
    s = cb.scenarios()["p1_surge"]
    ok = [{"now_ms": 1.0, "classes": {"P1": {"reason": "hold"}, "P2": {"reason": "tighten_lower_for_P0"}}}]
    assert cb.surge_figures(s, ok, 0.0)["met"] is True
    cut = [{"now_ms": 1.0, "classes": {"P1": {"reason": "tighten_self"}}}]
    assert cb.surge_figures(s, cut, 0.0)["met"] is False


@pytest.mark.slow
async def test_capacity_follows_a_killed_and_restarted_worker_on_a_running_stack(tmp_path) -> None:
    """The short worker_loss scenario: one of two sim workers is killed at 20 s and started
    again at 40 s. The policy's capacity must follow each step (it is a real one, taken at
    once) and not wander in between. A benchmark with goals in seconds (72 s of a stack on 2
    cores): it runs with ``make test-slow``; the default run covers the estimator in
    test_capacity.py and the controller loop in test_controller_loop.py."""
    p = cb.ControlParams(scenarios=("worker_loss",), short=True, calibrate="engine", drain_s=5.0,
                         out_dir=str(tmp_path))
    results = await cb.run_control(p)
    sc = results["scenarios"]["worker_loss"]
    f = sc["figures"]
    assert [e["event"].split()[0] for e in sc["events"]] == ["killed", "restarted"], sc["events"]
    assert f["follow_down_s"] is not None and f["follow_down_s"] <= 15, f
    assert f["follow_up_s"] is not None and f["follow_up_s"] <= 15, f
    assert f["capacity_moves_while_down"] <= 2 and f["capacity_moves_after_restart"] <= 2, f
    assert (tmp_path / "control-worker_loss.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole bench: a calibration and four scenarios, 5-10 min on 2 cores
async def test_the_four_scenarios_meet_their_goals(tmp_path) -> None:
    results = await cb.run_control(cb.ControlParams(out_dir=str(tmp_path)))
    for name, sc in results["scenarios"].items():
        assert sc["figures"]["met"], (name, sc["figures"])


def test_scenario_figures_leave_out_the_drain_after_the_load() -> None:
    """The load ends at duration_s; the timeline and the decisions go on through the drain (up
    to drain_s more), where the load is gone. A figure of the scenario is of its load window:
    a change per minute is counted over the minutes it is divided by, P2's final ceiling is
    where the flood left it, and a cut to P1 after the surge ended is not the surge's."""
    s = cb.Scenario("steady", 120, (cb.Phase(0, {}),), settle_s=45)
    drained = [_row(t, 20_000, p0_rate=100.0 if t < 120 else 150.0) for t in range(140)]
    after_load = [{"now_ms": 1000.0 * t, "classes": {}} for t in (121, 125, 130)]
    f = cb.steady_figures(s, drained, after_load, 0.0)
    assert (f["changes_after_settle"], f["p0_rate_max_dev"], f["met"]) == (0, 0.0, True), f
    flood = cb.scenarios()["p2_flood"]
    # the ceiling settles at 50 under the flood, and opens to 200 once the flood is over
    ceil = [_row(t, 20_000, p2_ceil=50.0 if t < flood.duration_s else 200.0) for t in range(120)]
    bins = {"P0": [1.0] * 21}
    g = cb.flood_figures(flood, ceil, bins)
    assert g["p2_ceiling_overshoot"] == 0.0 and g["met"], g
    surge = cb.scenarios()["p1_surge"]
    late_cut = [{"now_ms": 1000.0 * (surge.duration_s + 5), "classes": {"P1": {"reason": "tighten_self"}}}]
    assert cb.surge_figures(surge, late_cut, 0.0) == {"p1_cuts": 0, "met": True}
