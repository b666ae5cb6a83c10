"""limiter/status.py's read of every pool (`each_pool`): the pools at the same time, each
within POOL_READ_S, no read left running when the call raises."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from limiter import status
from limiter.errors import RedisUnavailable


@dataclass(frozen=True)
class _Pool:
    name: str


async def test_each_pool_reads_them_together_and_marks_the_one_past_its_bound(monkeypatch) -> None:
    # The healthy reads end once all four have begun (one after another, the first would wait
    # for the others past its bound); the bound only has to outlast that, not a sleep.
    monkeypatch.setattr(status, "POOL_READ_S", 2.0)
    never = asyncio.Event()
    all_begun = asyncio.Event()
    started: list[str] = []

    async def read(pool: _Pool) -> str:
        started.append(pool.name)
        if len(started) == 4:
            all_begun.set()
        if pool.name == "hung":
            await never.wait()  # a shard that does not answer
        if pool.name == "down":
            raise RedisUnavailable("refused")
        await all_begun.wait()
        return f"status of {pool.name}"

    got = await status.each_pool([_Pool("a"), _Pool("hung"), _Pool("down"), _Pool("b")], read)
    assert started == ["a", "hung", "down", "b"]
    assert list(got) == ["a", "hung", "down", "b"]
    assert got["a"] == "status of a" and got["b"] == "status of b"  # all begun before they ended
    assert isinstance(got["hung"], RedisUnavailable) and "within 2 s" in str(got["hung"])
    assert isinstance(got["down"], RedisUnavailable)


async def test_each_pool_raises_a_real_error_once_every_read_has_ended() -> None:
    """A reply no status can be made of (a WRONGTYPE, a parse error) is raised, but not
    while the other pools' reads still run and write into the snapshot being built."""
    ended: list[str] = []

    async def read(pool: _Pool) -> str:
        if pool.name == "bad":
            raise ValueError("not a status")
        await asyncio.sleep(0.1)
        ended.append(pool.name)
        return "ok"

    with pytest.raises(ValueError, match="not a status"):
        await status.each_pool([_Pool("bad"), _Pool("slow")], read)
    assert ended == ["slow"]
