"""worker/wake_watch.py: the wake list watched by one parked BLPOP, against a private
redis-server (the blocking reads, the put-back and the cancel are Redis behaviour)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from limiter.errors import RedisUnavailable
from tests.support.helpers import wait_until
from worker.wake_watch import WakeWatch

WAKE = "{wake-test}:wake"


class _Reads:
    """A WakeWatch on a real list: BLPOP (``timeout_s``), LPOP and LPUSH, counted."""

    def __init__(self, client: Any, timeout_s: float = 30.0) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.reads = 0
        self.looks = 0
        self.put_backs = 0
        self.watch = WakeWatch(self.read, self.look, self.put_back)

    async def read(self) -> bool:
        self.reads += 1
        return await self.client.blpop([WAKE], timeout=self.timeout_s) is not None

    async def look(self) -> bool:
        self.looks += 1
        return await self.client.lpop(WAKE) is not None

    async def put_back(self) -> None:
        self.put_backs += 1
        await self.client.lpush(WAKE, "1")


@pytest.fixture
async def blocking(redis_server) -> Any:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def _blocked_clients(client: Any) -> int:
    return int((await client.info("clients"))["blocked_clients"])


async def test_a_marker_is_taken_once_and_a_parked_read_is_asked_without_a_command(aredis, blocking) -> None:
    r = _Reads(blocking)
    await aredis.lpush(WAKE, "1")
    assert await r.watch.take() is True  # no read was parked: one LPOP looks ...
    assert r.looks == 1 and r.watch.parked  # ... and a read is parked for what comes next
    for _ in range(3):
        assert await r.watch.take() is False  # asked while parked: no command at all
    assert r.looks == 1
    await wait_until(lambda: r.reads == 1, "the parked read to be sent")
    await aredis.lpush(WAKE, "1", "1")
    await wait_until(lambda: not r.watch.parked, "the parked read to take a marker")
    assert await r.watch.take() is True and r.watch.parked  # taken, and a read parked again at once
    await wait_until(lambda: not r.watch.parked, "the second marker")
    assert await r.watch.take() is True and await r.watch.take() is False
    assert await aredis.llen(WAKE) == 0 and r.looks == 1 and r.reads == 3 and r.put_backs == 0
    await r.watch.close()
    assert not r.watch.parked


async def test_a_read_that_ended_without_a_marker_is_followed_by_a_look(aredis, blocking) -> None:
    """No read was parked after this one timed out: a marker pushed since is found by the
    next ask at once (an LPOP), not one step later by a read parked then."""
    r = _Reads(blocking, timeout_s=0.05)
    assert await r.watch.take() is False
    await wait_until(lambda: not r.watch.parked, "the read to time out")
    await aredis.lpush(WAKE, "1")
    assert await r.watch.take() is True and r.looks == 2
    await r.watch.close()


async def test_a_marker_taken_while_no_work_is_wanted_goes_back_on_the_list(aredis, blocking) -> None:
    """A full or backing-off worker must not sit on a marker another worker could act on:
    the parked read's marker goes back at once, and no read is parked again until asked."""
    r = _Reads(blocking)
    await r.watch.take()
    await wait_until(lambda: r.watch.parked, "a parked read")
    await r.watch.pause()
    assert r.watch.parked  # left parked (a cancel could lose a marker the server popped)
    await aredis.lpush(WAKE, "1")
    await wait_until(lambda: not r.watch.parked, "the read to take the marker")
    await wait_until(lambda: r.put_backs == 1, "the marker put back")
    assert await aredis.llen(WAKE) == 1
    assert await _blocked_clients(aredis) == 0  # nothing parked again while no work is wanted
    await r.watch.pause()
    assert await aredis.llen(WAKE) == 1 and r.reads == 1
    # wanted again: the marker put back is there for this worker too (its read ended without
    # one for it, so the ask looks)
    assert await r.watch.take() is True and r.watch.parked
    await r.watch.close()


async def test_a_marker_held_when_work_stops_being_wanted_goes_back(aredis, blocking) -> None:
    """Taken while wanted, never asked for since (the worker filled up meanwhile): pausing
    puts it back."""
    r = _Reads(blocking)
    await r.watch.take()
    await aredis.lpush(WAKE, "1")
    await wait_until(lambda: not r.watch.parked, "the read to take the marker")
    await r.watch.pause()
    assert r.put_backs == 1 and await aredis.llen(WAKE) == 1 and not r.watch.parked


async def test_the_idle_wait_is_the_parked_read_and_stops_on_the_drain(aredis, blocking) -> None:
    r = _Reads(blocking)
    stop = asyncio.Event()
    await r.watch.take()  # parked while busy ...
    await aredis.lpush(WAKE, "1")
    assert await asyncio.wait_for(r.watch.wait(stop), 30) is True  # ... and the idle wait takes its answer
    assert r.reads == 1 and not r.watch.parked
    waiting = asyncio.create_task(r.watch.wait(stop))
    await wait_until(lambda: r.watch.parked, "the idle wait's read")
    stop.set()
    assert await asyncio.wait_for(waiting, 30) is False and not r.watch.parked
    assert await aredis.llen(WAKE) == 0


async def test_the_idle_wait_times_out_with_no_marker(blocking) -> None:
    r = _Reads(blocking, timeout_s=0.05)
    assert await asyncio.wait_for(r.watch.wait(asyncio.Event()), 30) is False
    assert r.reads == 1 and not r.watch.parked


async def test_a_failed_read_is_raised_once_then_a_read_is_parked_again() -> None:
    fails = [True]

    async def read() -> bool:
        if fails.pop(0) if fails else False:
            raise RedisUnavailable("connection refused")
        await asyncio.Event().wait()  # parked for ever
        return False

    async def look() -> bool:
        return False

    async def put_back() -> None:
        raise AssertionError("nothing to put back")

    watch = WakeWatch(read, look, put_back)
    assert await watch.take() is False
    await wait_until(lambda: not watch.parked, "the read to fail")
    with pytest.raises(RedisUnavailable):
        await watch.take()
    assert await watch.take() is False and watch.parked
    await watch.close()
    assert not watch.parked
