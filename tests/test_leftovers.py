"""What dead or stopped processes leave in Redis: heartbeat entries of processes killed
without leaving are pruned (bounded work per beat, never during an outage's grace), and a
frontend's reply stream never outlives it without a TTL."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import redis.asyncio as aioredis

from limiter.frontend.replies import REPLY_TTL_S
from limiter.heartbeats import PRUNE_BATCH, prune_stale
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, fe_of, frontend, make_cfg
from tests.support.helpers import redis_ms
from tests.support.worker_helpers import worker

LUA = Path(__file__).resolve().parent.parent / "lua"


async def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_prune_is_bounded_and_spares_the_living(aredis):
    now = await redis_ms(aredis)
    await aredis.zadd("hb", {f"dead-{i}": now - 600_000 - i for i in range(100)})
    await aredis.zadd("hb", {"alive-a": now, "alive-b": now - 1000})
    await aredis.hset("kv", mapping={**{f"dead-{i}": 1 for i in range(100)}, "alive-a": 1})
    first = await prune_stale(aredis, "hb", now - 60_000, also_hdel="kv")
    assert len(first) == PRUNE_BATCH  # one call does bounded work, however many died
    assert await aredis.zcard("hb") == 102 - PRUNE_BATCH
    assert not any(await aredis.hmget("kv", first))
    while await prune_stale(aredis, "hb", now - 60_000, also_hdel="kv"):
        pass
    assert sorted(m.decode() for m in await aredis.zrange("hb", 0, -1)) == ["alive-a", "alive-b"]
    assert [k.decode() for k in await aredis.hkeys("kv")] == ["alive-a"]
    # While the outage marker exists an old beat may still count as alive: nothing goes.
    await aredis.zadd("hb", {"old": now - 600_000})
    await aredis.set("marker", 1)
    assert await prune_stale(aredis, "hb", now - 60_000, skip_while="marker") == []
    assert await aredis.zscore("hb", "old") is not None


async def test_a_worker_prunes_workers_killed_without_leaving(worker_env):
    cfg, client = worker_env
    r = client.client
    now = await redis_ms(r)
    dead = {f"killed-{i}": now - 120_000 for i in range(2 * PRUNE_BATCH + 5)}
    await r.zadd(POOL.workers, dead)
    async with worker(cfg, engine="sim", worker_id="w-live", heartbeat_ttl_s=1) as rt:
        async def only_me() -> bool:
            return [m.decode() for m in await r.zrange(POOL.workers, 0, -1)] == [rt.worker_id]
        await _until(only_me, 30, "the dead workers' heartbeat entries to be pruned")


async def test_a_frontend_prunes_dead_frontends_but_not_during_an_outage(redis_server, sync_redis):
    cfg = make_cfg(redis_server.url, pool={"frontend_ttl_ms": 300})  # pruned after 4 x 300 ms
    r = aioredis.from_url(redis_server.url)
    try:
        async with frontend(cfg, heartbeat_s=0.05) as client:
            fe = fe_of(client)
            now = await redis_ms(r)
            await r.set(POOL.outage, now - 10_000, px=60_000)
            await r.zadd(POOL.frontends, {"fe-killed": now - 30_000})

            async def beats(n: int) -> None:  # n more complete heartbeats of this frontend
                seen = fe.heartbeat.last_ok
                for _ in range(n):
                    await _until(lambda s=seen: _gt(fe.heartbeat.last_ok, s), 10, "a heartbeat")
                    seen = fe.heartbeat.last_ok
            await beats(3)
            assert await r.zscore(POOL.frontends, "fe-killed") is not None  # outage grace: kept
            await r.delete(POOL.outage)

            async def pruned() -> bool:
                return await r.zscore(POOL.frontends, "fe-killed") is None
            await _until(pruned, 10, "the dead frontend's entry to be pruned")
            assert await r.zscore(POOL.frontends, fe.frontend_id) is not None
    finally:
        await r.aclose()


async def _gt(a: float, b: float) -> bool:
    return a > b


async def _reply_keys_without_ttl(r) -> list[str]:
    keys = [k async for k in r.scan_iter(match=POOL.reply_prefix + "*")]
    return [k.decode() for k in keys if await r.ttl(k) == -1]


async def test_a_stopped_frontend_leaves_no_reply_stream_without_a_ttl(redis_server, sync_redis):
    cfg = make_cfg(redis_server.url)
    r = aioredis.from_url(redis_server.url)
    try:
        # One that served a request, and one that never got a reply (its stop's wake-up
        # entry alone would have created the stream).
        async with FakeWorker(r, POOL, fixed_text="hello"):
            async with frontend(cfg) as client:
                rid = fe_of(client).frontend_id
                resp = await client.post("/v1/completions", headers=auth(),
                                         json={"model": "tiny", "prompt": "hi", "max_tokens": 5})
                assert resp.status == 200
                assert await r.exists(POOL.reply(rid))
        async with frontend(cfg) as client:
            idle = fe_of(client).frontend_id
        assert await _reply_keys_without_ttl(r) == []
        assert not await r.exists(POOL.reply(rid)) and not await r.exists(POOL.reply(idle))
        # Even when the wake-up entry is the last thing it could write (Redis went away before
        # it could leave): the stream it creates carries the scripts' TTL.
        async with frontend(cfg) as client:
            fe = fe_of(client)
            await fe.router.stop()
            assert 0 < await r.ttl(POOL.reply(fe.frontend_id)) <= REPLY_TTL_S
    finally:
        await r.aclose()


def test_the_reply_ttl_is_the_scripts_one():
    lua = (LUA / "include" / "pool_keys.lua").read_text()
    assert int(re.search(r"local REPLY_TTL_S = (\d+)", lua).group(1)) == REPLY_TTL_S


async def test_a_frontend_started_during_an_outage_does_not_make_the_others_dead(redis_server, scripts):
    """After an outage every frontend's beat is as old as it. A frontend whose process started
    during the outage had never beaten, so it did not count as interrupted and set no outage
    marker; its first beat made "some frontend beat within the TTL" true, and until the
    others beat again every script took them for dead: a worker's claim cancelled their queued
    requests (found by a review of the shared core). Its first beat now records the newest
    old beat as when the frontends lost Redis."""
    from tests.support.helpers import admit, init_pool

    cfg = make_cfg(redis_server.url, pool={"frontend_ttl_ms": 300})
    keys = await init_pool(scripts, cfg)
    r = scripts.client
    await r.delete(keys.frontends)  # (init_pool's helper lists a frontend alive until 2100)
    now = await redis_ms(r)
    await r.zadd(keys.frontends, {"fe-through-the-outage": now - 5_000})  # its beat, as old as the outage
    await admit(scripts, keys, frontend="fe-through-the-outage", request_id="queued-before")
    async with frontend(cfg, heartbeat_s=0.05) as client:
        fe = fe_of(client)

        async def beaten() -> bool:
            return fe.heartbeat.last_ok > 0
        await _until(beaten, 10, "the new frontend's first beat")
        assert await r.get(keys.outage) == str(now - 5_000).encode()
        got = await scripts.claim(keys, "w1", 8)
        assert [c.request_id for c in got.requests] == ["queued-before"]  # served, not cancelled
