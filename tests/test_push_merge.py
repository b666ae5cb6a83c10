"""worker.push_merge: the pushes the streams of an openai worker ask for in one event-loop
turn go in one call, and each stream hears its own request's news. The runtime here is a
stand-in that records what it is asked to send; tests/test_worker_openai.py drives the real
one against Redis."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from limiter.errors import InvalidArgument, LeaseLost, RedisUnavailable
from worker.push_merge import MergedPushes


@dataclass(eq=False)
class Stream:
    """What MergedPushes needs of a Delivery: its tokens pending, taken at send time."""

    name: str
    pending: int = 1


@dataclass
class Runtime:
    """Records each push_batches call; answers with ``news`` per stream name (default None:
    delivered)."""

    news: dict[str, Any] = field(default_factory=dict)
    calls: list[list[tuple[str, int]]] = field(default_factory=list)
    outage: bool = False

    def batches(self, ds: list[Stream]) -> list[tuple[Stream, int]]:
        return [(d, d.pending) for d in ds if d.pending]

    async def push_batches(self, todo: list[tuple[Stream, int]]) -> list[tuple[Stream, Any]]:
        self.calls.append([(d.name, n) for d, n in todo])
        await asyncio.sleep(0)  # a round trip: the reply comes in a later turn
        if self.outage:
            raise RedisUnavailable("connection refused")
        return [(d, self.news.get(d.name)) for d, _ in todo]


def merged(rt: Runtime) -> MergedPushes:
    return MergedPushes(rt)  # type: ignore[arg-type]


async def test_the_pushes_of_one_turn_go_in_one_call_and_each_hears_its_own_news() -> None:
    rt = Runtime(news={"lost": LeaseLost("lost"), "past": InvalidArgument("count", "past")})
    pushes = merged(rt)
    names = ["a", "lost", "past", "b"]
    results = await asyncio.gather(*(pushes.push(Stream(n)) for n in names), return_exceptions=True)
    assert rt.calls == [[(n, 1) for n in names]] and pushes.calls == 1
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], LeaseLost) and isinstance(results[2], InvalidArgument)


async def test_pushes_of_later_turns_make_calls_of_their_own() -> None:
    rt = Runtime()
    pushes = merged(rt)
    first = asyncio.create_task(pushes.push(Stream("a")))
    await asyncio.sleep(0)  # the call for "a" is on its way
    await asyncio.sleep(0)
    second = asyncio.create_task(pushes.push(Stream("b")))
    assert await first is None and await second is None
    assert rt.calls == [[("a", 1)], [("b", 1)]]


async def test_tokens_that_come_in_the_same_turn_ride_along() -> None:
    """The batch is taken when the call is sent, not when the push was asked for."""
    rt = Runtime()
    pushes = merged(rt)
    s = Stream("a")
    task = asyncio.create_task(pushes.push(s))
    s.pending = 3  # a chunk more, read before the call went out
    assert await task is None
    assert rt.calls == [[("a", 3)]]


async def test_a_stream_with_nothing_pending_hears_no_news_and_costs_nothing() -> None:
    rt = Runtime()
    pushes = merged(rt)
    assert await pushes.push(Stream("idle", pending=0)) is None
    assert rt.calls == []


async def test_an_outage_reaches_every_stream_of_the_call() -> None:
    rt = Runtime(outage=True)
    pushes = merged(rt)
    results = await asyncio.gather(*(pushes.push(Stream(n)) for n in "abc"), return_exceptions=True)
    assert all(isinstance(r, RedisUnavailable) for r in results) and len(rt.calls) == 1


async def test_a_stream_cancelled_while_it_waits_does_not_stop_the_others_call() -> None:
    """...and goes on being cancelled only once the call's reply came: what it does next
    (complete, release) is offset-checked against the tokens it knows were delivered."""
    reply = asyncio.Event()

    class Slow(Runtime):
        async def push_batches(self, todo: list[tuple[Stream, int]]) -> list[tuple[Stream, Any]]:
            self.calls.append([(d.name, n) for d, n in todo])
            await reply.wait()
            return [(d, self.news.get(d.name)) for d, _ in todo]

    rt = Slow(news={"b": LeaseLost("lost")})
    pushes = merged(rt)
    a = asyncio.create_task(pushes.push(Stream("a")))
    b = asyncio.create_task(pushes.push(Stream("b")))
    while not rt.calls:  # both asked; the call went out
        await asyncio.sleep(0)
    a.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not a.done()  # waiting for the reply, though cancelled
    reply.set()
    with pytest.raises(asyncio.CancelledError):
        await a
    with pytest.raises(LeaseLost):  # b hears its own news
        await b
    assert rt.calls == [[("a", 1), ("b", 1)]]  # a's tokens went too
