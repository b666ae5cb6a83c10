"""The hang watch's clock (worker/stall_clock.py), on explicit times: each rule a review
found missing, and the cases a watch must leave alone."""

from __future__ import annotations

from worker.stall_clock import StallClock

STALL = 10.0


def test_an_idle_worker_s_next_stream_gets_the_whole_stall_s() -> None:
    c = StallClock(STALL, now=0.0)
    c.opened("a", 1, now=500.0)  # idle for 500 s before it: no silence
    assert c.stalled(now=509.9) == []
    assert c.stalled(now=510.1) == ["a"]
    assert c.stalled(now=510.2) == []  # the clock starts again once it fired


def test_an_event_on_any_stream_keeps_every_stream_off_the_watch() -> None:
    c = StallClock(STALL, now=0.0)
    c.opened("prefill", 1, now=0.0)
    c.opened("decoding", 2, now=1.0)
    for t in range(2, 40, 2):
        c.heard(now=float(t))  # the decoding stream's tokens
        assert c.stalled(now=t + 1.0) == [], t


def test_silence_is_carried_over_short_spells_with_no_stream_open() -> None:
    """Streams cancelled before the first event, one after another, on a hung server."""
    c = StallClock(STALL, now=0.0)
    t = 0.0
    for n in range(3):
        c.opened(f"r{n}", n, now=t)
        assert c.stalled(now=t + 3.0) == []
        c.closed(f"r{n}", n, now=t + 3.0)  # its client gave up after 3 s
        t += 3.5  # the next one opens half a second later
    c.opened("r3", 3, now=t)
    assert c.stalled(now=t + 0.9) == []  # 9.9 s of silence in all
    assert c.stalled(now=t + 1.1) == ["r3"]  # 10.1


def test_silence_is_dropped_after_a_spell_longer_than_stall_s() -> None:
    c = StallClock(STALL, now=0.0)
    c.opened("gone", 1, now=0.0)
    c.closed("gone", 1, now=8.0)  # 8 s silent, then cancelled
    c.opened("later", 2, now=3600.0)  # an hour later: a long prefill of its own
    assert c.stalled(now=3609.0) == []
    assert c.stalled(now=3610.5) == ["later"]


def test_an_event_ends_the_carried_silence() -> None:
    c = StallClock(STALL, now=0.0)
    c.opened("a", 1, now=0.0)
    c.closed("a", 1, now=8.0)
    c.opened("b", 2, now=8.5)
    c.heard(now=9.0)
    c.closed("b", 2, now=9.5)
    c.opened("c", 3, now=10.0)
    assert c.stalled(now=18.9) == []  # silent since 9.0 only


def test_an_old_attempt_ending_late_leaves_the_new_one_on_the_watch() -> None:
    c = StallClock(STALL, now=0.0)
    old, new = object(), object()
    c.opened("r", old, now=0.0)
    c.opened("r", new, now=1.0)  # the request claimed back after its lease lapsed
    c.closed("r", old, now=2.0)
    assert c.streaming == {"r": new}
    assert c.stalled(now=11.0) == ["r"]


def test_a_clock_of_zero_watches_nothing() -> None:
    c = StallClock(0.0, now=0.0)
    c.opened("a", 1, now=0.0)
    assert c.stalled(now=1e9) == []
