"""BusyMeter: the heartbeat's capacity counts full steps and the Redis work between them."""

from __future__ import annotations

import pytest

from worker.busy_meter import BusyMeter


def test_time_between_full_steps_counts_as_busy() -> None:
    m = BusyMeter()
    m.step(0.000, 0.030, full=True, work=300)  # first step: nothing before it to time
    m.step(0.040, 0.070, full=True, work=300)  # 10 ms of pushes and claims in between
    m.step(0.080, 0.110, full=True, work=300)
    # 900 weighted tokens in 30 + 40 + 40 ms, not in the 90 ms of engine time alone
    assert m.take() == pytest.approx(900 / 0.110)
    assert m.take() == 0.0  # nothing since: no measurement


def test_light_steps_and_long_pauses_are_left_out() -> None:
    m = BusyMeter(max_pause_s=1.0)
    m.step(0.0, 0.01, full=False, work=0)  # a lightly loaded step: not capacity
    m.step(0.02, 0.05, full=True, work=100)  # 10 ms after the light step: still overhead
    m.step(5.00, 5.03, full=True, work=100)  # ~5 s idle (or Redis down) before: not overhead
    assert m.take() == pytest.approx(200 / (0.04 + 0.03))


def test_no_full_step_means_no_measurement() -> None:
    m = BusyMeter()
    m.step(0.0, 0.01, full=False, work=50)
    assert m.take() == 0.0
