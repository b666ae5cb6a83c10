"""limiter/backoff.py: doubling delays with a cap, and one log line per outage each way."""

from __future__ import annotations

import asyncio
import logging

import pytest

from limiter import backoff as backoff_mod
from limiter.backoff import Backoff


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    delays: list[float] = []

    async def fake_sleep(s: float) -> None:
        delays.append(s)

    monkeypatch.setattr(backoff_mod.asyncio, "sleep", fake_sleep)
    return delays


def test_delays_double_up_to_the_cap_and_restart_after_a_success(slept: list[float]) -> None:
    b = Backoff("loop", first_s=0.1, max_s=0.5)

    async def go() -> None:
        for _ in range(5):
            await b.failed()
        b.succeeded()
        await b.failed()

    asyncio.run(go())
    assert slept == [0.1, 0.2, 0.4, 0.5, 0.5, 0.1]


def test_logs_once_when_it_goes_down_and_once_when_it_comes_back(
        slept: list[float], caplog: pytest.LogCaptureFixture) -> None:
    b = Backoff("reply stream s", first_s=0.05, max_s=2.0, logger=logging.getLogger("t.backoff"))

    async def go() -> None:
        for _ in range(4):
            await b.failed(ConnectionError("refused"))
        b.succeeded()
        b.succeeded()

    with caplog.at_level(logging.INFO, logger="t.backoff"):
        asyncio.run(go())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0][0] == "WARNING" and "reply stream s: refused" in lines[0][1]
    assert lines[1][0] == "INFO" and "working again" in lines[1][1]


def test_next_delay_records_a_failure_without_sleeping(slept: list[float]) -> None:
    b = Backoff("heartbeat", first_s=1.0, max_s=1.0)
    assert [b.next_delay(), b.next_delay()] == [1.0, 1.0]
    b.succeeded()
    assert b.delay_s == 0.0 and slept == []
