"""The control law, pure: given compliance, use and capacity, the decision is as documented."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from limiter.controller.control_law import (
    ClassInputs,
    ClassState,
    ControlConfig,
    ControlState,
    Decision,
    Inputs,
    decide,
)
from limiter.errors import ConfigError, InvalidArgument

C = 100_000.0
CFG = ControlConfig()
Obs = tuple[float | None, int, float]  # (fresh compliance, fresh samples, used share of C)


def inputs(
    p0: Obs = (0.995, 1000, 0.45),
    p1: Obs = (0.995, 1000, 0.30),
    p2: Obs = (None, 0, 0.05),
    capacity: float = C,
    workers: int = 0,
) -> Inputs:
    def one(obs: Obs, has_slo: bool = True) -> ClassInputs:
        return ClassInputs(obs[0], obs[1], obs[2] * C, has_slo)

    return Inputs(capacity, {"P0": one(p0), "P1": one(p1), "P2": one(p2, has_slo=False)}, workers)


def state(
    allowances: tuple[float, float, float] = (1.0, 1.0, 0.5), cfg: ControlConfig = CFG, **kw
) -> ControlState:
    classes = tuple(ClassState(n, a) for n, a in zip(cfg.classes, allowances, strict=True))
    return dataclasses.replace(ControlState.initial(cfg, C), classes=classes, **kw)


def allowances(d: Decision) -> tuple[float, ...]:
    return tuple(round(c.allowance, 6) for c in d.state.classes)


def reasons(d: Decision) -> tuple[str, ...]:
    return tuple(c.reason for c in d.classes)


def limits(s: ControlState) -> list[tuple[float, float | None, bool]]:
    """What a decision may change about a class: allowance, remembered limit, episode (the
    smoothed loads move every tick)."""
    return [(c.allowance, c.cap, c.recovering) for c in s.classes]


# --- configuration ----------------------------------------------------------------------
def test_defaults_are_the_original_problems_numbers() -> None:
    assert (CFG.target, CFG.low, CFG.relax_step, CFG.tighten_step) == (0.99, 0.95, 0.05, 0.10)
    assert (CFG.cooldown_s, CFG.window, CFG.shares, CFG.burst_s) == (5.0, 1000, (0.60, 0.35, 0.05), 0.5)
    rates = ControlState.initial(CFG, C).rates()
    assert [r.rate for r in rates.values()] == pytest.approx([60_000.0, 35_000.0, 5_000.0])
    assert [r.ceil for r in rates.values()] == pytest.approx([100_000.0, 100_000.0, 50_000.0])
    assert rates["P0"].burst == pytest.approx(30_000.0)  # 0.5 s of rate
    assert rates["P2"].ceil_burst == pytest.approx(25_000.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("classes", ("P0", "P0", "P2")),
        ("classes", ("P0", "P{1}", "P2")),
        ("shares", (0.6, 0.35, 0.1)),
        ("shares", (0.6, 0.4)),
        ("min_shares", (0.3, 0.4, 0.01)),
        ("min_shares", (0.0, 0.1, 0.01)),
        ("ceilings", (1.0, 0.3, 0.5)),
        ("ceilings", (1.0, 1.0, 1.5)),
        ("low", 0.995),
        ("target", 1.5),
        ("tighten_step", 1.0),
        ("relax_step", 0.0),
        ("cooldown_s", -1.0),
        ("cooldown_s", float("inf")),  # froze the rates after their first change
        ("cooldown_s", 1e30),
        ("settle_s", 6.0),
        ("window", 10**9),
        ("burst_s", float("inf")),
        ("class_bursts", (0.5, float("inf"), 0.5)),
        ("reset_load_change", float("inf")),
        ("load_smoothing_s", -1.0),
        ("load_smoothing_s", float("inf")),
        ("min_samples", 2000),
        ("burst_s", 0.0),
        ("use_threshold", 0.0),
        ("capacity_deadband", 1.0),
        ("min_change", 0.05),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(CFG, **{field: value}).validate()
    assert err.value.path == f"controller.{field}"
    assert CFG.validate() is CFG


# --- tighten ----------------------------------------------------------------------------
def test_hold_in_the_band() -> None:
    d = decide(state(), inputs(p0=(0.97, 1000, 0.45)), 0.0)
    assert not d.changed
    assert reasons(d) == ("hold", "hold", "hold")
    assert limits(d.state) == limits(state())


def test_p0_violation_cuts_lower_borrowing_first() -> None:
    # P2 floods and borrows (uses 25 % with a 5 % share); P1 is inside its guarantee.
    d = decide(state(), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25)), 0.0)
    assert d.changed
    # tighten_step of the lower load (0.30 + 0.25) = 0.055, all of it from P2's borrowing.
    assert allowances(d) == (1.0, 1.0, 0.195)
    assert reasons(d) == ("hold", "hold", "tighten_lower_for_P0")
    new = {c.name: c.new for c in d.classes}
    assert new["P2"].ceil == pytest.approx(19_500.0) and new["P2"].rate == pytest.approx(5_000.0)
    assert new["P1"].rate == pytest.approx(35_000.0)  # P1's guarantee untouched while P2 borrows


def test_a_last_change_after_now_is_a_clock_stepped_back_not_a_cooldown() -> None:
    """last_change_ms is Redis time: with Redis's clock stepped back an hour (an NTP step, a
    failover to a node behind), now - last < cooldown held the law for the hour."""
    now = 1_800_000_000_000.0
    violating = inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25))
    d = decide(state(last_change_ms=now + 3_600_000), violating, now)
    assert d.changed and reasons(d) == ("hold", "hold", "tighten_lower_for_P0")
    cooling = decide(state(last_change_ms=now - 1000), violating, now)  # a real cooldown holds
    assert not cooling.changed


def test_then_guarantees_lowest_first_by_at_most_a_step_each() -> None:
    d = decide(state((1.0, 1.0, 0.05)), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.05)), 0.0)
    # need 0.1 x 0.35 = 0.035: P2 gives 10 % of its use (0.005), P1 the remaining 0.030.
    assert allowances(d) == (1.0, 0.27, 0.045)
    assert reasons(d) == ("rebalance", "tighten_lower_for_P0", "tighten_lower_for_P0")
    rates = [c.new.rate for c in d.classes]
    assert rates == pytest.approx([68_500.0, 27_000.0, 4_500.0])  # freed guarantee returns to P0
    assert sum(rates) == pytest.approx(C)


def test_p0_never_cuts_itself_when_lower_classes_are_at_their_floors() -> None:
    """Rates apply at claim time: cutting P0's own ceiling would only queue P0 longer. The
    law holds and says why; admission refuses what cannot start in time."""
    floors = (1.0, CFG.min_shares[1], CFG.min_shares[2])
    d = decide(state(floors), inputs(p0=(0.80, 1000, 0.45), p1=(0.99, 1000, 0.105), p2=(None, 0, 0.015)), 0.0)
    assert not d.changed
    assert reasons(d) == ("overloaded", "floor", "floor")
    assert allowances(d) == pytest.approx(floors)


def test_p1_violation_tightens_p2() -> None:
    d = decide(state(), inputs(p1=(0.90, 1000, 0.30), p2=(None, 0, 0.20)), 0.0)
    assert reasons(d) == ("hold", "hold", "tighten_lower_for_P1")
    assert allowances(d) == (1.0, 1.0, 0.18)
    d = decide(state((1.0, 1.0, CFG.min_shares[2])), inputs(p1=(0.90, 1000, 0.30), p2=(None, 0, 0.015)), 0.0)
    assert reasons(d) == ("hold", "overloaded", "floor") and not d.changed  # P1 keeps its ceiling


def test_a_violation_episode_lasts_until_the_target_is_back() -> None:
    flood = {"p2": (None, 0, 0.25)}
    d = decide(state(), inputs(p0=(0.90, 1000, 0.45), **flood), 0.0)
    assert d.state.classes[0].recovering
    # 97 % is inside the hold band, but P0 has not recovered yet: keep cutting.
    d = decide(d.state, inputs(p0=(0.97, 1000, 0.45), p2=(None, 0, 0.195)), 5000.0)
    assert reasons(d)[2] == "tighten_lower_for_P0" and d.state.classes[0].recovering
    waiting = decide(d.state, inputs(p0=(0.999, 50, 0.45), p2=(None, 0, 0.15)), 10_000.0)
    assert waiting.state.classes[0].recovering  # too few samples to end the episode
    d = decide(d.state, inputs(p0=(0.992, 1000, 0.45), p2=(None, 0, 0.15)), 10_000.0)
    assert not d.state.classes[0].recovering
    # Outside an episode the band holds.
    d = decide(d.state, inputs(p0=(0.97, 1000, 0.45), p2=(None, 0, 0.15)), 15_000.0)
    assert not d.changed and reasons(d) == ("hold", "hold", "hold")


def test_written_bursts_are_per_class_seconds_of_the_new_rates() -> None:
    law = dataclasses.replace(ControlConfig(), class_bursts=(2.0, 1.0, 4.0)).validate()
    d = decide(state(cfg=law), inputs(p2=(None, 0, 0.25), capacity=C / 2, workers=1), 0.0)
    assert d.changed  # a worker left, capacity halved: every rate is rewritten
    f = d.policy_fields()
    for name, b in zip(law.classes, law.class_bursts, strict=True):
        assert f[f"{name}.burst"] == pytest.approx(f[f"{name}.rate"] * b)
        assert f[f"{name}.ceil_burst"] == pytest.approx(f[f"{name}.ceil"] * b)
    with pytest.raises(ConfigError, match="class_bursts"):
        dataclasses.replace(law, class_bursts=(1.0,)).validate()


def test_no_verdict_without_enough_fresh_samples() -> None:
    d = decide(state(), inputs(p0=(0.90, 90, 0.45), p2=(None, 0, 0.25)), 0.0)
    assert not d.changed  # 90 < min_samples, and 90 % of 90 could still be a 95 % class


def test_a_class_with_almost_no_load_is_not_the_interference() -> None:
    d = decide(state(), inputs(p0=(0.90, 1000, 0.45), p1=(0.99, 1000, 0.01), p2=(None, 0, 0.0)), 0.0)
    assert reasons(d) == ("overloaded", "unused", "unused")


# --- relax ------------------------------------------------------------------------------
def test_relax_grows_a_class_that_used_its_allowance() -> None:
    d = decide(state((1.0, 1.0, 0.2)), inputs(p2=(None, 0, 0.2)), 0.0)
    assert reasons(d) == ("ceiling", "ceiling", "relax")
    assert allowances(d) == (1.0, 1.0, 0.21)


def test_relax_anti_windup_and_blockers() -> None:
    low_use = decide(state((1.0, 1.0, 0.2)), inputs(p2=(None, 0, 0.1)), 0.0)
    assert reasons(low_use)[2] == "unused" and not low_use.changed
    p1_in_band = decide(state((1.0, 1.0, 0.2)), inputs(p1=(0.97, 1000, 0.3), p2=(None, 0, 0.2)), 0.0)
    assert reasons(p1_in_band)[2] == "hold" and not p1_in_band.changed
    p0_waiting = decide(state((1.0, 1.0, 0.2)), inputs(p0=(1.0, 50, 0.45), p2=(None, 0, 0.2)), 0.0)
    assert reasons(p0_waiting)[2] == "waiting" and not p0_waiting.changed
    # No P0 traffic at all: nothing to protect, so it does not block.
    p0_idle = decide(state((1.0, 1.0, 0.2)), inputs(p0=(None, 0, 0.0), p2=(None, 0, 0.2)), 0.0)
    assert reasons(p0_idle)[2] == "relax"


def test_relax_stops_at_the_ceiling() -> None:
    d = decide(state((1.0, 1.0, 0.49)), inputs(p2=(None, 0, 0.49)), 0.0)
    assert allowances(d)[2] == 0.5
    d = decide(state((1.0, 1.0, 0.5)), inputs(p2=(None, 0, 0.5)), 0.0)
    assert reasons(d)[2] == "ceiling" and not d.changed


def test_relax_restores_in_reverse_order_of_cuts() -> None:
    # P0 cut itself, P1 lost guarantee, P2 borrows: P0 first, then guarantees, then borrowing.
    s = state((0.5, 0.2, 0.1))
    obs = {"p0": (1.0, 1000, 0.5), "p1": (1.0, 1000, 0.2), "p2": (None, 0, 0.1)}
    d = decide(s, inputs(**obs), 0.0)
    assert reasons(d) == ("relax", "priority", "priority")
    assert allowances(d) == (0.525, 0.2, 0.1)
    d = decide(state((1.0, 0.2, 0.1)), inputs(**obs), 0.0)
    assert reasons(d) == ("rebalance", "relax", "priority")
    d = decide(state((1.0, 0.2, 0.04)), inputs(p1=(1.0, 1000, 0.2), p2=(None, 0, 0.04)), 0.0)
    assert reasons(d) == ("rebalance", "relax", "relax")  # both restoring guarantees


# --- memory, cooldown, capacity ---------------------------------------------------------
def with_history(s: ControlState, p0_load: float = 0.45) -> ControlState:
    """P0's smoothed load has a long history at ``p0_load`` (a term running for an hour)."""
    p0 = dataclasses.replace(s.classes[0], load=p0_load, load_weight=12.0, load_since_ms=-3_600_000.0)
    return dataclasses.replace(s, classes=(p0, *s.classes[1:]), ticked_ms=-5000.0)


def test_relax_returns_at_most_one_step_toward_where_p0_broke() -> None:
    flood = {"p2": (None, 0, 0.25)}
    d = decide(with_history(state()), inputs(p0=(0.90, 1000, 0.45), **flood), 0.0)
    assert allowances(d)[2] == pytest.approx(0.195)
    cap = d.state.classes[2].cap
    assert cap == pytest.approx(0.195 * 1.05)  # one step, less than halfway back to 0.25
    d = decide(d.state, inputs(p2=(None, 0, 0.195)), 5000.0)
    assert reasons(d)[2] == "relax" and allowances(d)[2] == pytest.approx(cap)
    d = decide(d.state, inputs(p2=(None, 0, cap)), 10_000.0)
    assert reasons(d)[2] == "capped" and not d.changed
    # P0's load falls by a third. A tick of it is no reason (a second's claims are Poisson):
    # the limit holds...
    capped = d.state
    d = decide(capped, inputs(p0=(1.0, 1000, 0.30), p2=(None, 0, cap)), 15_000.0)
    assert reasons(d)[2] == "capped" and d.state.classes[2].cap is not None
    # ...until P0's smoothed load has been a quarter lower for half a smoothing period: the
    # reason for the limit is gone, relaxing resumes.
    t = 15_000.0
    while d.state.classes[2].cap is not None and t < 300_000:
        t += 5000
        d = decide(d.state, inputs(p0=(1.0, 1000, 0.30), p2=(None, 0, cap)), t)
    assert 60_000 <= t - 15_000 <= 180_000 and reasons(d)[2] == "relax"
    # With no smoothing (load_smoothing_s = 0) one tick did it, as before.
    raw = dataclasses.replace(capped, config=dataclasses.replace(CFG, load_smoothing_s=0.0))
    d = decide(raw, inputs(p0=(1.0, 1000, 0.30), p2=(None, 0, cap)), 15_000.0)
    assert reasons(d)[2] == "relax" and d.state.classes[2].cap is None


def test_cooldown_allows_one_change_per_period() -> None:
    violating = inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25))
    first = decide(state(), violating, 1000.0)
    assert first.changed and first.state.last_change_ms == 1000.0
    early = decide(first.state, violating, 5999.0)
    assert not early.changed and reasons(early)[2] == "cooldown"
    assert limits(early.state) == limits(first.state)
    later = decide(first.state, violating, 6000.0)
    assert later.changed and reasons(later)[2] == "tighten_lower_for_P0"


def test_a_worker_step_rescales_at_once_and_clears_memory() -> None:
    cut = decide(state(workers=2), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25), workers=2), 0.0)
    d = decide(cut.state, inputs(capacity=50_000.0, workers=1), 100.0)  # inside the cooldown: still applied
    assert d.changed and set(reasons(d)) == {"capacity_change"}
    assert (d.old_capacity, d.capacity, d.state.workers) == (C, 50_000.0, 1)
    assert [c.new.rate for c in d.classes] == pytest.approx([0.5 * c.old.rate for c in d.classes])
    assert all(c.cap is None for c in d.state.classes)
    assert d.state.last_change_ms == 100.0  # a rescale counts against the cooldown
    back = decide(d.state, inputs(capacity=C, workers=2), 200.0)  # the worker is back
    assert back.changed and back.capacity == C


@pytest.mark.parametrize("side", [1.0, -1.0], ids=["above", "below"])
def test_noise_inside_the_dead_band_never_moves_the_rates(side: float) -> None:
    """Within 10 % on ONE side for six times capacity_persist_s: a move the persistence clock
    alone would follow (noise that switched sides every tick, as this test's first version
    had, restarts that clock and proved nothing about the band: found by a review)."""
    s = state(workers=2)
    ticks = int(6 * CFG.capacity_persist_s)
    for tick in range(ticks):
        factor = 1.0 + side * (0.05 + 0.045 * (tick % 3) / 2)  # 5 % to 9.5 % off, the same side
        d = decide(s, inputs(capacity=C * factor, workers=2), tick * 1000.0)
        assert not d.changed and d.capacity == C, (tick, factor)
        s = d.state


def test_a_large_move_is_followed_only_once_it_persisted_and_nothing_cools_down() -> None:
    persist = CFG.capacity_persist_s * 1000
    s = state(workers=2)
    d = decide(s, inputs(capacity=0.8 * C, workers=2), 0.0)  # 20 % lower: the clock starts
    assert not d.changed and d.state.drift_since_ms == 0.0
    d = decide(d.state, inputs(capacity=1.2 * C, workers=2), 4000.0)  # the other side: restarts
    assert not d.changed and (d.state.drift_since_ms, d.state.drift_up) == (4000.0, True)
    d = decide(d.state, inputs(capacity=1.25 * C, workers=2), 4000.0 + persist - 1)
    assert not d.changed
    d = decide(d.state, inputs(capacity=1.25 * C, workers=2), 4000.0 + persist)
    assert d.changed and d.capacity == 1.25 * C and set(reasons(d)) == {"capacity_change"}
    # back in the band: the clock stops
    assert decide(d.state, inputs(capacity=1.2 * C, workers=2), 20_000.0).state.drift_since_ms is None
    # a rescale counts against the cooldown: a violation right after it waits
    v = decide(d.state, inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25), capacity=1.25 * C, workers=2),
               4000.0 + persist + 1000)
    assert not v.changed and reasons(v)[2] == "cooldown"
    # and a persistent move waits for a cooldown started by a tighten
    t = decide(state(workers=2), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25), workers=2), 0.0)
    assert t.changed
    m = decide(t.state, inputs(capacity=0.7 * C, workers=2), 1000.0)
    m = decide(m.state, inputs(capacity=0.7 * C, workers=2), 1000.0 + persist)
    assert m.changed  # the tighten's cooldown (5 s) is long over
    t2 = decide(m.state, inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25), capacity=0.7 * C, workers=2),
                1000.0 + persist + 5000.0)
    assert t2.changed
    m2 = decide(t2.state, inputs(capacity=0.5 * C, workers=2), 1000.0 + persist + 5000.0)
    m2 = decide(m2.state, inputs(capacity=0.5 * C, workers=2), 1000.0 + 2 * persist + 5000.0 - 1)
    assert not m2.changed


def test_evidence_starts_after_the_pool_settled_on_a_change() -> None:
    d = decide(state(), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25)), 1000.0)
    assert d.evidence_from_ms == 1000.0 + CFG.settle_s * 1000
    assert decide(d.state, inputs(), 2000.0).evidence_from_ms is None  # nothing changed


def test_decision_is_loggable_and_writable() -> None:
    d = decide(state(), inputs(p0=(0.90, 1000, 0.45), p2=(None, 0, 0.25)), 0.0)
    record = json.loads(json.dumps(d.record()))
    p2 = record["classes"]["P2"]
    assert p2["reason"] == "tighten_lower_for_P0" and p2["old"]["ceil"] == 50_000.0
    assert record["classes"]["P0"]["compliance"] == 0.90
    fields = d.policy_fields()
    assert fields["P2.ceil"] == pytest.approx(19_500.0) and fields["capacity"] == C
    assert set(fields) >= {"P0.rate", "P1.burst", "P2.ceil_burst", "capacity"}


@pytest.mark.parametrize(
    "bad",
    [
        Inputs(0.0, inputs().classes),
        Inputs(C, {"P0": ClassInputs(1.0, 10, 1.0)}),
        Inputs(C, inputs().classes, -1),
        inputs(p0=(1.5, 1000, 0.45)),
        inputs(p1=(1.0, 1000, -0.1)),
    ],
)
def test_bad_inputs_are_rejected(bad: Inputs) -> None:
    with pytest.raises(InvalidArgument):
        decide(state(), bad, 0.0)


# --- no limit cycle on the steepest plant -----------------------------------------------

def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's method: lam stays small here): a second's claims of a class."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1

def run_step_plant(cfg: ControlConfig, decisions: int = 120, p0_per_s: float = 0.0,
                   seed: int = 1) -> list[int]:
    """P2 floods; P0 is fine iff P2 gets <= 12 % of capacity. Returns the tick of each change.

    ``p0_per_s`` > 0: P0's ``used`` is measured as usage.py does, that many claims a second
    over one second (Poisson) times their mean work; else it is exact."""
    s = ControlState.initial(cfg, C)
    rng = random.Random(seed)
    changes = []
    for tick in range(decisions):
        p2 = min(s.classes[2].allowance, 0.25)
        p0_ok = 0.999 if p2 <= 0.12 else 0.90
        used0 = 0.45 * (_poisson(rng, p0_per_s) / p0_per_s if p0_per_s > 0 else 1.0)
        d = decide(s, inputs(p0=(p0_ok, 1000, used0), p2=(None, 0, p2)), tick * cfg.cooldown_s * 1000)
        if d.changed:
            changes.append(tick)
        s = d.state
    return changes


def test_memory_prevents_a_limit_cycle_even_on_a_step_plant() -> None:
    settled = run_step_plant(CFG)
    assert settled and max(settled) < 20  # a finite number of changes, then none
    cycling = run_step_plant(dataclasses.replace(CFG, memory=False))
    assert max(cycling) > 100  # without it: tighten, relax, ... forever


# --- invariants under arbitrary inputs --------------------------------------------------
obs = st.tuples(st.one_of(st.none(), st.floats(0.0, 1.0)), st.integers(0, 1000), st.floats(0.0, 1.0))


# Any inputs; or a steady, quiet fleet (the worker count fixed, so no step skips the checks
# below; no SLO evidence) whose capacity moves near the dead band's edge: drawn only from the
# first, the dead-band check ran in none of three runs and the cooldown check in some only
# (found by a review).
any_steps = st.lists(st.tuples(obs, obs, obs, st.floats(0.5, 2.0), st.integers(0, 8000), st.integers(0, 3)),
                     min_size=1, max_size=40)
near_the_band = st.sampled_from([0.8, 0.85, 0.93, 0.97, 1.04, 1.09, 1.15, 1.3])
quiet = st.tuples(st.none(), st.just(0), st.floats(0.0, 1.0))  # no SLO evidence: only capacity moves
steady_steps = st.lists(st.tuples(quiet, quiet, quiet, near_the_band, st.integers(500, 12_000), st.just(2)),
                        min_size=1, max_size=40)


QUIET = (None, 0, 0.3)


@settings(max_examples=120, deadline=None)
@given(st.one_of(any_steps, steady_steps))
# ... and always: a 5 % move held on one side for 16 s by a steady fleet (the dead band's
# case), and a 30 % move that has persisted 10.5 s just 1.5 s after a tighten (the cooldown's)
@example([(QUIET, QUIET, QUIET, 1.0, 1000, 2)] + [(QUIET, QUIET, QUIET, 1.05, 4000, 2)] * 4)
@example([(QUIET, QUIET, QUIET, 1.0, 1000, 2), (QUIET, QUIET, QUIET, 1.3, 1000, 2),
          ((0.5, 40, 0.45), QUIET, (None, 0, 0.25), 1.3, 9000, 2), (QUIET, QUIET, QUIET, 1.3, 1500, 2)])
# ... and a violation that goes on 1 s after the tighten it caused
@example([(QUIET, QUIET, QUIET, 1.0, 1000, 2)] + [((0.5, 40, 0.45), QUIET, (None, 0, 0.25), 1.0, 1000, 2)]
         * 2)
def test_invariants_hold_for_any_input_sequence(steps: list) -> None:
    s, now, last_change = ControlState.initial(CFG, C), 0.0, None
    for p0, p1, p2, cap_factor, dt, workers in steps:
        now += dt
        step = workers != s.workers
        d = decide(s, inputs(p0, p1, p2, capacity=C * cap_factor, workers=workers), now)
        cap = d.capacity
        rates = {c.name: c.new for c in d.classes}
        assert sum(r.rate for r in rates.values()) <= cap * (1 + 1e-9)
        for i, r in enumerate(rates.values()):
            assert CFG.min_shares[i] * cap * (1 - 1e-9) <= r.rate <= r.ceil <= cap * (1 + 1e-9)
            assert r.burst == pytest.approx(r.rate * CFG.burst_s)
        if d.changed and not step:  # only a worker joining or leaving skips the cooldown
            if last_change is not None:
                event("cooldown checked")
            assert last_change is None or now - last_change >= CFG.cooldown_s * 1000
        if d.changed and "capacity_change" in reasons(d) and not step:  # a persistent, large move
            event("dead band checked")
            assert abs(cap / s.capacity - 1) > CFG.capacity_deadband
        if d.changed:
            last_change = now
        s = d.state


def test_strong_evidence_is_a_verdict_before_min_samples() -> None:
    """20 fresh samples at 50 %: even the 99 % upper bound is far below 95 %, so the law acts
    at once; 20 at 90 % could still be a 95 % class, so it waits for min_samples."""
    d = decide(state(), inputs(p0=(0.50, 20, 0.45), p2=(None, 0, 0.25)), 0.0)
    assert d.changed and reasons(d)[2] == "tighten_lower_for_P0"
    d = decide(state(), inputs(p0=(0.90, 20, 0.45), p2=(None, 0, 0.25)), 0.0)
    assert not d.changed and reasons(d)[0] != "overloaded"
    d = decide(state(), inputs(p0=(0.0, 19, 0.45), p2=(None, 0, 0.25)), 0.0)
    assert not d.changed  # below STRONG_MIN_SAMPLES: nothing is strong


# --- the memory under a measured load -----------------------------------------------------
def test_a_state_without_smoothed_loads_starts_them_at_the_first_tick_and_a_rescale_keeps_the_work() -> None:
    """term.py builds ``ClassState(name, allowance)``: no load yet. The first tick's use is the
    load; a rescale keeps the same work as a share of the new capacity."""
    d = decide(state(workers=2), inputs(workers=2), 0.0)
    assert [c.load for c in d.state.classes] == pytest.approx([0.45, 0.30, 0.05])
    d = decide(d.state, inputs(capacity=C / 2, workers=1), 1000.0)  # a worker left: half the pool
    assert d.changed and d.capacity == C / 2
    assert [c.load for c in d.state.classes] == pytest.approx([0.90, 0.60, 0.10])


def test_memory_still_prevents_the_limit_cycle_when_used_is_measured_at_a_realistic_rate() -> None:
    """The step plant with P0's ``used`` as usage.py measures it: claims over ~1 s (Poisson,
    20 a second: +-22 %) times their mean work. Each such move past 25 % of the cut's
    reference used to forget the remembered limit (~40 % of ticks): 248 changes in the last
    300 decisions, where the noiseless plant makes none (a review, 2026-12-06)."""
    noiseless = run_step_plant(CFG, decisions=360)
    assert max(noiseless) < 20
    for seed in (1, 2, 3):
        changes = run_step_plant(CFG, decisions=360, p0_per_s=20, seed=seed)
        late = [t for t in changes if t > 60]
        assert len(late) <= 2, f"seed {seed}: {len(late)} changes after settling (of 300 decisions)"
