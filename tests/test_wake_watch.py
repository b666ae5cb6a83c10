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
    """A WakeWatch on a real list: BLPOP (``timeout_s``) and LPUSH, counted."""

    def __init__(self, client: Any, timeout_s: float = 30.0) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.reads = 0
        self.put_backs = 0
        self.watch = WakeWatch(self.read, self.put_back)

    async def read(self) -> bool:
        self.reads += 1
        return await self.client.blpop([WAKE], timeout=self.timeout_s) is not None

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


async def test_take_never_waits_and_a_marker_is_taken_once(aredis, blocking) -> None:
    r = _Reads(blocking)
    assert r.watch.take() is False and r.watch.parked  # a read is parked, the answer not waited for
    await r.client.lpush(WAKE, "1", "1")
    await wait_until(lambda: not r.watch.parked, "the parked read to take a marker")
    assert r.watch.take() is True  # taken: and a read parked again at once
    assert r.watch.parked
    await wait_until(lambda: not r.watch.parked, "the second marker")
    assert r.watch.take() is True and r.watch.take() is False
    assert await aredis.llen(WAKE) == 0 and r.reads == 3 and r.put_backs == 0
    await r.watch.close()
    assert not r.watch.parked


async def test_a_marker_taken_while_no_work_is_wanted_goes_back_on_the_list(aredis, blocking) -> None:
    """A full or backing-off worker must not sit on a marker another worker could act on:
    the parked read's marker goes back at once, and no read is parked again until asked."""
    r = _Reads(blocking)
    r.watch.take()
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
    # wanted again: the marker put back is there for this worker too
    assert r.watch.take() is False
    await wait_until(lambda: not r.watch.parked, "the read to take the marker put back")
    assert r.watch.take() is True
    await r.watch.close()


async def test_a_marker_held_when_work_stops_being_wanted_goes_back(aredis, blocking) -> None:
    """Taken while wanted, never asked for since (the worker filled up meanwhile): pausing
    puts it back."""
    r = _Reads(blocking)
    r.watch.take()
    await aredis.lpush(WAKE, "1")
    await wait_until(lambda: not r.watch.parked, "the read to take the marker")
    await r.watch.pause()
    assert r.put_backs == 1 and await aredis.llen(WAKE) == 1 and not r.watch.parked


async def test_the_idle_wait_is_the_parked_read_and_stops_on_the_drain(aredis, blocking) -> None:
    r = _Reads(blocking)
    stop = asyncio.Event()
    r.watch.take()  # parked while busy ...
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

    async def put_back() -> None:
        raise AssertionError("nothing to put back")

    watch = WakeWatch(read, put_back)
    assert watch.take() is False
    await wait_until(lambda: not watch.parked, "the read to fail")
    with pytest.raises(RedisUnavailable):
        watch.take()
    assert watch.take() is False and watch.parked
    await watch.close()
    assert not watch.parked
