"""`qos bench control` (limiter/bench/control.py): the figures are computed as documented, and
the controller on a running stack follows a lost and restarted worker (short form, by
default); the four full scenarios, and the two of long P0 prompts, are slow tests."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from limiter.bench import control as cb
from limiter.bench import trace as tr
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


def test_no_requests_after_the_step_is_no_recovery() -> None:
    """Found by review: with no bin after the step holding requests, nothing was bad after it,
    and that read as "recovered at once" (0.0): a run whose P0 traffic died at the step met."""
    assert cb.recovery_s([1.0] * 8 + [None] * 12, 40.0) is None
    assert cb.recovery_s([1.0] * 8 + [None] * 3 + [1.0], 40.0) == 0.0  # a bin with requests: measured


def test_a_verdict_needs_the_controller_to_have_judged_the_class() -> None:
    """Found by review: a dead controller makes no changes and holds every rate still, so the
    steady verdict (<= 2 changes a minute, P0's rate within 5 %) and the no-cut verdicts
    (p1_surge, p0_long_allowance: an empty decision list has no cut) all read met. Each now
    needs the controller's compliance of the judged class in the window it judges."""
    steady = cb.Scenario("steady", 120, (cb.Phase(0, {}),), settle_s=45)
    alive = [_row(t, 20_000) for t in range(120)]
    dead = [_row(t, 20_000, compliance={}) for t in range(120)]
    # figures only before the settle time: the window judged had none
    died = [_row(t, 20_000, compliance=None if t < 40 else {}) for t in range(120)]
    assert cb.steady_figures(steady, alive, [], 0.0)["met"] is True
    f = cb.steady_figures(steady, dead, [], 0.0)
    assert (f["p0_judged_samples"], f["met"]) == (0, False), f
    assert cb.steady_figures(steady, died, [], 0.0)["met"] is False
    surge = cb.scenarios()["p1_surge"]
    assert cb.surge_figures(surge, alive, [], 0.0) == {"p1_cuts": 0, "p1_judged_samples": 50, "met": True}
    assert cb.surge_figures(surge, dead, [], 0.0)["met"] is False
    p0_only = [_row(t, 20_000, compliance={"P0": 1.0}) for t in range(120)]  # P1 never judged
    assert cb.surge_figures(surge, p0_only, [], 0.0)["met"] is False
    allowance = cb.scenarios(short=True)["p0_long_allowance"]
    spec = cb.mode_config(CAP, "sim", allowance)

    def rows(comp: dict) -> list[dict]:
        return [{"t_s": float(t), "capacity": 1_000.0, "compliance": comp,
                 "ceilings": {"P1": 100.0, "P2": 50.0}} for t in range(60)]

    assert cb.long_prompt_figures(allowance, rows({"P0": 1.0}), [], 0.0, [], spec)["met"] is True
    g = cb.long_prompt_figures(allowance, rows({}), [], 0.0, [], spec)
    assert (g["p0_judged_samples"], g["met"]) == (0, False), g


def test_the_flood_verdict_leaves_out_the_last_bin_of_the_load() -> None:
    """Found by review: attainment_bins made int(duration // 5) + 1 bins, the last past the
    load's end and always empty, so flood_figures' ``[:-1]`` dropped that one and kept the
    95-100 s bin it meant to leave out (its requests are answered in the drain)."""
    from limiter.bench import trace as tr
    from limiter.bench.driver import Record
    from limiter.localstack.loadgen import Result

    def rec(at_s: float, ttft: float) -> Record:
        res = Result(cls="P0", sent_s=0.0, status=200, ttft_ms=ttft, token_times=[1.0, 1.01], output_tokens=2,
                     input_tokens=10)
        return Record(tr.Arrival(0, at_s, "P0", 10, 2, 0.0), res, 0.0)

    flood = cb.scenarios()["p2_flood"]
    spec = cb.mode_config(CAP, "sim")
    # P0 meets its 500 ms target all along, except what is sent in the last 5 s of the load
    recs = [rec(t + 0.5, 100.0 if t < 95 else 5_000.0) for t in range(100)]
    bins = cb.attainment_bins(recs, spec, 0.0, flood.duration_s)
    assert len(bins["P0"]) == 20 and bins["P0"][-1] == 0.0, bins["P0"]
    timeline = [_row(t, 20_000) for t in range(120)]
    assert cb.flood_figures(flood, timeline, bins)["p0_recovery_s"] == 0.0
    # a load that ends inside a bin: that bin is the last (45-47 s), none past it
    assert len(cb.attainment_bins(recs[:47], spec, 0.0, 47.0)["P0"]) == 10


def _row(t: float, capacity: float, p0_rate: float = 100.0, p2_ceil: float = 50.0,
         compliance: dict | None = None) -> dict:
    """A timeline sample; the controller's compliance of each class 1.0 unless given (``{}``:
    no controller figures, as when it is not running)."""
    return {"t_s": t, "capacity": capacity, "rates": {"P0": p0_rate}, "ceilings": {"P2": p2_ceil},
            "compliance": {"P0": 1.0, "P1": 1.0} if compliance is None else compliance}


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
    timeline = [_row(t, 20_000) for t in range(90)]
    ok = [{"now_ms": 1.0, "classes": {"P1": {"reason": "hold"}, "P2": {"reason": "tighten_lower_for_P0"}}}]
    assert cb.surge_figures(s, timeline, ok, 0.0)["met"] is True
    cut = [{"now_ms": 1.0, "classes": {"P1": {"reason": "tighten_self"}}}]
    assert cb.surge_figures(s, timeline, cut, 0.0)["met"] is False


def test_long_p0_prompts_come_from_a_second_tenant_at_the_share_asked() -> None:
    rows = cb.class_rows("sim")
    s = cb.scenarios()["p0_long_allowance"]
    arrivals = cb.scenario_arrivals(s, rows, CAP)
    p0 = [a for a in arrivals if a.cls == "P0"]
    long = [a for a in p0 if a.tenant == cb.LONG_P0_TENANT]
    # every fifth P0 request, from the scenario's first on (a seeded draw per row gave 9-14 %
    # of the first minute's P0 requests where 5 % was asked: a review)
    assert cb.LONG_P0_SHARE == 0.2
    assert [i for i, a in enumerate(p0) if a.tenant == cb.LONG_P0_TENANT] == list(range(4, len(p0), 5))
    assert len({a.prompt_tokens for a in long}) == len(long)  # not one text: no prefix cache hit
    assert all(a.prompt_tokens <= cb.LONG_P0_PROMPT and a.max_tokens <= cb.LONG_P0_OUTPUT for a in long)
    assert min(a.prompt_tokens for a in long) > 4_000  # long: the trace's long prompts
    assert all(a.tenant == "" for a in p0 if a not in long)
    assert not any(a.tenant for a in cb.scenario_arrivals(cb.scenarios()["steady"], rows, CAP))


def test_a_long_prompt_scenario_s_config_has_their_tenant_and_p0_s_allowance() -> None:
    from limiter.bench.modes import api_key
    from limiter.config import hash_key

    table = cb.scenarios()
    for name, per_1k in (("p0_long", 0.0), ("p0_long_allowance", cb.P0_TTFT_MS_PER_1K)):
        cfg = cb.mode_config(CAP, "sim", table[name]).cfg
        p0 = cfg.class_config("P0")
        assert p0 is not None and p0.slo_ttft_ms_per_1k_prompt_tokens == per_1k
        docs = [t for t in cfg.tenants if hash_key(api_key(cb.LONG_P0_TENANT)) in t.key_sha256]
        assert [(t.default_class, t.max_class) for t in docs] == [("P0", "P0")]
    assert cb.mode_config(CAP, "sim", table["steady"]).cfg == cb.mode_config(CAP, "sim").cfg


def test_long_prompt_figures_count_the_cuts_below_p0_and_split_p0_s_attainment() -> None:
    from limiter.bench import trace as tr
    from limiter.bench.driver import Record
    from limiter.localstack.loadgen import Result

    def rec(tenant: str, prompt: int, ttft: float) -> Record:
        res = Result(cls="P0", sent_s=0.0, status=200, ttft_ms=ttft, token_times=[1.0, 1.01], output_tokens=2,
                     input_tokens=prompt)
        return Record(tr.Arrival(0, 1.0, "P0", prompt, 2, 0.0, tenant), res, 0.0)

    recs = [rec(cb.LONG_P0_TENANT, 8_000, 1_500.0), rec("", 200, 100.0), rec("", 200, 600.0)]
    # P2's ceiling halves at 30 s; the capacity (and every ceiling with it) rises 25 % at 40 s,
    # which is no cut: the figures are ceilings as shares of the policy's capacity
    def row(t: int) -> dict:
        grown = 1.0 if t < 40 else 1.25
        return {"t_s": float(t), "capacity": 1_000.0 * grown, "compliance": {"P0": 0.9 if t < 35 else 0.8},
                "ceilings": {"P1": 100.0 * grown, "P2": (50.0 if t < 30 else 25.0) * grown}}

    rows = [row(t) for t in range(60)]
    cut = {"now_ms": 20_000.0, "classes": {"P2": {"reason": "tighten_lower_for_P0"}}}
    late = {"now_ms": 70_000.0, "classes": {"P1": {"reason": "tighten_lower_for_P0"}}}  # after the load
    table = cb.scenarios(short=True)
    fixed, allowance = table["p0_long"], table["p0_long_allowance"]
    f = cb.long_prompt_figures(fixed, rows, [cut, late], 0.0, recs, cb.mode_config(CAP, "sim", fixed))
    assert f == {"lower_cuts": 1, "p1_ceiling_end": 1.0, "p2_ceiling_end": 0.5, "p0_compliance_end": 0.8,
                 "p0_long_attainment": 0.0, "p0_short_attainment": 0.5, "p0_judged_samples": 60, "met": None}
    spec = cb.mode_config(CAP, "sim", allowance)
    g = cb.long_prompt_figures(allowance, rows, [cut], 0.0, recs, spec)
    assert (g["lower_cuts"], g["p0_long_attainment"], g["met"]) == (1, 1.0, False)  # 1,500 <= 500 + 8 x 250
    assert cb.long_prompt_figures(allowance, rows, [late], 0.0, recs, spec)["met"] is True


def test_control_cli_names_an_unknown_scenario_and_lists_the_long_prompt_ones(capsys) -> None:
    from limiter.cli import main

    assert main(["bench", "control", "--scenarios", "p0_long,p0_loong"]) == 2
    err = capsys.readouterr().err
    assert "--scenarios" in err and "p0_loong" in err and "p0_long_allowance" in err


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
@pytest.mark.timeout(900)  # a calibration and two 60 s scenarios: ~4 min on 2 cores
async def test_long_p0_prompts_cut_the_classes_below_unless_the_ttft_target_grows_with_the_prompt(
        tmp_path) -> None:
    """On a running stack: one P0 request in five with an 8,000-token prompt. With P0's
    target fixed, the controller sees P0 violating for misses no cut can mend (and cut below
    it in each 120 s run); with the target growing by 250 ms per 1,000 prompt tokens, P0 is
    compliant, no cut, and the long prompts meet their own target."""
    p = cb.ControlParams(scenarios=cb.LONG_PROMPT_SCENARIOS, short=True, drain_s=5.0, out_dir=str(tmp_path))
    results = await cb.run_control(p)
    fixed = results["scenarios"]["p0_long"]["figures"]
    allowance = results["scenarios"]["p0_long_allowance"]["figures"]
    # The controller reads the long prompts' own prefill as a violation (whether its cut comes
    # inside 60 s depends on when a warm-up capacity correction restarts the evidence: 26 s in
    # one run, 69 s in another of 120 s), and no cut could mend them: they all miss.
    assert fixed["p0_compliance_end"] < 0.95 and fixed["p0_long_attainment"] == 0.0, fixed
    assert allowance["met"] and allowance["lower_cuts"] == 0, allowance
    assert allowance["p0_compliance_end"] >= 0.99, allowance
    assert allowance["p0_long_attainment"] >= 0.9 and allowance["p0_short_attainment"] >= 0.9, allowance


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
    assert cb.surge_figures(surge, drained, late_cut, 0.0) == {"p1_cuts": 0, "p1_judged_samples": 50,
                                                               "met": True}


@pytest.mark.parametrize("drain", ["nan", "inf", "-1"])
def test_a_drain_that_is_not_a_finite_time_is_refused_by_name(drain: str, capsys, monkeypatch) -> None:
    """Found by review: `--drain nan` passed the `< 0` check (a comparison with NaN is false)."""
    from tests.support.helpers import refused_by_name

    refused_by_name(monkeypatch, capsys, cb, "run_control", ["bench", "control", "--drain", drain],
                    "--drain: must be in [0, 3600]")


@pytest.mark.parametrize("share,longs", [(0.2, 20), (0.3, 30), (0.05, 5), (1.0, 100)])
def test_the_long_prompts_take_the_share_named_in_every_stretch(share: float, longs: int) -> None:
    """``with_long_p0``: the share of P0's rows that are long prompts is the one named, over
    the whole mix and within any stretch of it (``round(1 / share)`` made 0.3 a third), and
    no two long prompts are the same length in a row (a prefix cache would prefill one once)."""
    p0 = [tr.Arrival(i, i * 0.1, "P0", 50, 8, 0.0) for i in range(100)]
    p2 = [tr.Arrival(1000 + i, i * 0.1, "P2", 20_000, 4_000, 0.0) for i in range(200)]
    mixed = cb.with_long_p0({"P0": p0, "P2": p2}, share)["P0"]
    is_long = [a.tenant == cb.LONG_P0_TENANT for a in mixed]
    assert len(mixed) == 100 and sum(is_long) == longs
    for start in range(0, 100, 10):  # every stretch of ten: the share within one request
        assert abs(sum(is_long[start:start + 10]) - 10 * share) < 1 + 1e-9, (start, is_long)
    lengths = [a.prompt_tokens for a in mixed if a.tenant == cb.LONG_P0_TENANT]
    assert all(x != y for x, y in itertools.pairwise(lengths))
    with pytest.raises(ValueError, match="share"):
        cb.with_long_p0({"P0": p0, "P2": p2}, 0.0)
