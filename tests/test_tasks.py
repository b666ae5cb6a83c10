"""stop_tasks: a task that swallows its cancellation (as redis-py can in a blocking read)
neither hangs whoever stops it nor survives a second request."""

from __future__ import annotations

import asyncio
import time

from limiter.tasks import stop_tasks


async def _swallows(times: int, log: list[str]) -> None:
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if times == 0:
                raise
            times -= 1
            log.append("swallowed")


async def test_a_task_that_swallows_one_cancellation_is_stopped_by_the_second():
    log: list[str] = []
    polite = asyncio.create_task(asyncio.sleep(3600))
    stubborn = asyncio.create_task(_swallows(1, log))
    await asyncio.sleep(0)
    assert await stop_tasks([polite, stubborn], "test", wait_s=0.2)
    assert polite.cancelled() and stubborn.cancelled() and log == ["swallowed"]


async def test_a_task_that_never_stops_is_left_behind_in_bounded_time(caplog):
    log: list[str] = []
    forever = asyncio.create_task(_swallows(10, log), name="forever")  # more than stop_tasks asks
    await asyncio.sleep(0)
    t0 = time.monotonic()
    assert not await stop_tasks([forever], "test", wait_s=0.1, rounds=3)
    assert time.monotonic() - t0 < 10  # three rounds of 0.1 s asked; the task would swallow ten
    assert "forever" in caplog.text and "ignored cancellation" in caplog.text
    while not forever.done():  # the test's own cleanup: ask until it gives in
        forever.cancel()
        await asyncio.wait({forever}, timeout=0.05)


async def test_a_task_that_had_died_of_an_error_is_said_not_swallowed(caplog):
    """Its exception is retrieved (no "never retrieved" at exit) and logged: stop_tasks once
    consumed it in silence, so a background loop dead of a bug left no trace at shutdown."""
    async def fails() -> None:
        raise RuntimeError("the loop's bug")

    dead = asyncio.create_task(fails(), name="heartbeat")
    await asyncio.wait({dead})
    assert await stop_tasks([dead], "test", wait_s=0.1)
    assert "heartbeat" in caplog.text and "the loop's bug" in caplog.text
