"""The frontend runtime: its reply readers and its Redis connection budget."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from limiter.config import RedisConfig, demo_config, validate
from limiter.errors import RedisUnavailable
from limiter.frontend.metrics import FrontendMetrics
from limiter.frontend.runtime import Frontend
from limiter.frontend.settings import FrontendSettings
from limiter.keys import PoolKeys


async def test_a_frontend_with_as_many_pools_as_redis_connections_becomes_ready(redis_server, sync_redis):
    """The blocking XREAD loops, one per pool, shared the frontend's connection pool with
    everything else: with as many pools as redis_max_connections (4 and the minimum 4, both
    valid) the readers held every connection for ever (each took its own back before a
    waiting command could), bootstrap and every heartbeat failed with 'No connection
    available', and the frontend was never ready. They have connections of their own now."""
    cfg = demo_config()
    tiny = cfg.pools[0]
    pools = (tiny, *(dataclasses.replace(tiny, name=f"p{i}") for i in range(1, 4)))
    cfg = validate(dataclasses.replace(cfg, redis=RedisConfig(url=redis_server.url), pools=pools))
    fe = Frontend(FrontendSettings(redis_max_connections=4), cfg, FrontendMetrics())
    await fe.start()
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 10.0
        while not fe.ready() and loop.time() < end:
            await asyncio.sleep(0.1)
        assert fe.ready(), (f"never ready in 10 s: bootstrapped={fe.bootstrapped}, "
                            f"reply readers healthy={fe.router.healthy}, "
                            f"frontends zset={sync_redis.zrange(PoolKeys('tiny').frontends, 0, -1)}")
    finally:
        await fe.stop()


async def test_a_frontend_whose_reply_reader_cannot_read_is_not_ready(redis_server):
    """The reply readers have connections of their own: when those fail (here: pointed at a
    closed port) while the command connections work, the frontend would admit requests whose
    answers it never reads. /readyz says so, and says ready again once the reader reads."""
    from limiter.localstack.redis_server import free_port
    from limiter.redis_conn import open_redis
    from tests.support.helpers import wait_until

    cfg = validate(dataclasses.replace(demo_config(), redis=RedisConfig(url=redis_server.url)))
    fe = Frontend(FrontendSettings(), cfg, FrontendMetrics())
    await fe.start()
    good = fe.router.reader
    broken = open_redis(RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0"), max_connections=1)
    try:
        await wait_until(fe.ready, "the frontend to be ready")
        fe.router.reader = broken
        await wait_until(lambda: not fe.ready(), "the frontend to see its reply reader fail")
        assert fe.not_ready_because() == "the reply stream of pool tiny cannot be read"
        assert fe.heartbeat.fresh(5.0) and fe.bootstrapped  # only the reader is down
        fe.router.reader = good
        await wait_until(fe.ready, "the frontend to be ready again")
    finally:
        fe.router.reader = good
        await fe.stop()
        await broken.aclose()


async def test_a_config_error_met_once_redis_answers_is_the_readiness_reason(redis_server, sync_redis,
                                                                            monkeypatch):
    """Redis out of reach at the start, then answering as a node of a Redis Cluster named
    without redis.cluster: the heartbeat loop's bootstrap met the configuration error and
    logged it each beat, while /readyz said "not connected to Redis yet". /readyz now gives
    the error (it names no address), logged once."""
    from limiter.errors import ConfigError, RedisUnavailable
    from tests.support.frontend_helpers import frontend, make_cfg

    calls = {"n": 0}

    async def set_up(self, pool) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RedisUnavailable("Redis unavailable")  # at the start: left to the loop
        raise ConfigError("redis.cluster", "redis.url is a node of a Redis Cluster: set redis.cluster = true")

    monkeypatch.setattr(Frontend, "_set_up", set_up)
    async with frontend(make_cfg(redis_server.url), heartbeat_s=0.1) as client:
        deadline = time.monotonic() + 20
        while True:
            r = await client.get("/readyz")
            body = await r.json()
            if body["reason"].startswith("redis.cluster:"):
                break
            assert time.monotonic() < deadline, f"waiting for /readyz to give the configuration error: {body}"
            await asyncio.sleep(0.05)
    assert r.status == 503 and "set redis.cluster = true" in body["reason"] and calls["n"] >= 2


async def test_a_config_error_met_by_one_pool_is_that_pool_s_readiness_reason(redis_server, sync_redis,
                                                                             monkeypatch):
    """Two pools; the second's set-up meets Redis out of reach at the start, then a
    configuration error (a node of a Redis Cluster named without redis.cluster: only the
    keys of another node's slots are MOVED). The first pool set up made the frontend
    bootstrapped, and /readyz listed the second as degraded for "its Redis server has not
    answered since the start", the configuration error only logged once. It now gives that
    error, for that pool."""
    from limiter.errors import ConfigError, RedisUnavailable
    from tests.support.frontend_helpers import frontend, make_cfg

    cfg = make_cfg(redis_server.url)
    tiny = cfg.pools[0]
    cfg = validate(dataclasses.replace(cfg, pools=(tiny, dataclasses.replace(tiny, name="p1"))))
    real_set_up = Frontend._set_up
    calls = {"n": 0}

    async def set_up(self, pool) -> None:
        if pool.name != "p1":
            return await real_set_up(self, pool)
        calls["n"] += 1
        if calls["n"] == 1:
            raise RedisUnavailable("Redis unavailable")  # at the start: left to the loop
        raise ConfigError("redis.cluster", "redis.url is a node of a Redis Cluster: set redis.cluster = true")

    monkeypatch.setattr(Frontend, "_set_up", set_up)
    async with frontend(cfg, heartbeat_s=0.1) as client:
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "waiting for the second pool's set-up to meet the error"
            if calls["n"] >= 2:
                r = await client.get("/readyz")
                body = await r.json()
                if r.status == 200 and "p1" in body.get("degraded", {}):
                    break
            await asyncio.sleep(0.05)
        assert body["degraded"]["p1"].startswith("pool p1: redis.cluster:"), body
        r = await client.get("/readyz?pool=p1")
        body = await r.json()
        assert r.status == 503 and "set redis.cluster = true" in body["reason"], body
        assert (await client.get("/readyz?pool=tiny")).status == 200


async def test_one_pool_s_outage_at_the_start_does_not_hide_another_pool_s_real_fault(redis_server,
                                                                                     monkeypatch):
    """The start lets an outage pass (the heartbeat loops retry) and stops at a real fault (a
    policy Redis rejects, a script that does not load). With the pools set up together, only
    the first failure was raised: the first pool's outage let the process start with the
    second pool's fault, retried for ever under "not set up yet"."""
    from limiter.errors import InvalidArgument, RedisUnavailable
    from tests.support.frontend_helpers import make_cfg

    cfg = make_cfg(redis_server.url)
    tiny = cfg.pools[0]
    cfg = validate(dataclasses.replace(cfg, pools=(tiny, dataclasses.replace(tiny, name="p1"))))

    async def set_up(self, pool) -> None:
        if pool.name == "p1":
            raise InvalidArgument("policy", "the pool's policy is refused")
        raise RedisUnavailable("Redis unavailable")

    monkeypatch.setattr(Frontend, "_set_up", set_up)
    fe = Frontend(FrontendSettings(), cfg, FrontendMetrics())
    try:
        with pytest.raises(InvalidArgument, match="refused"):
            await fe.start()
    finally:
        await fe.stop()


async def test_readiness_that_cannot_read_the_cluster_s_layout_is_a_503(redis_server, monkeypatch) -> None:
    """A slot map that cannot be read (or a slot no node covers) made /readyz a 500."""
    from redis.exceptions import SlotNotCoveredError

    from limiter.frontend import readiness
    from tests.support.frontend_helpers import frontend, make_cfg

    async def no_layout(client, key):
        raise SlotNotCoveredError("Slot 1 is not covered by the cluster.")

    async with frontend(make_cfg(redis_server.url)) as client:
        assert (await client.get("/readyz")).status == 200
        monkeypatch.setattr(readiness, "shard_of", no_layout)
        r = await client.get("/readyz")
        assert r.status == 503 and (await r.json())["reason"] == "Redis unavailable"


async def test_a_pool_whose_set_up_hangs_at_the_start_is_left_to_its_heartbeat_loop(redis_server, sync_redis,
                                                                                    monkeypatch) -> None:
    """One pool's set-up does not end (its shard's host does not answer: each call waits out
    a socket timeout an operator may set to minutes). Once the other pool is set up, the start
    waits START_OTHERS_S more, cancels that set-up and serves; the pool's heartbeat loop sets
    it up once its server answers. Nothing of the cancelled task is left unretrieved."""
    from limiter.frontend import runtime
    from tests.support.frontend_helpers import make_cfg
    from tests.support.helpers import wait_until

    cfg = make_cfg(redis_server.url)
    tiny = cfg.pools[0]
    cfg = validate(dataclasses.replace(cfg, pools=(tiny, dataclasses.replace(tiny, name="p1"))))
    real_set_up = Frontend._set_up
    answers = asyncio.Event()  # the hung shard answers again
    seen = {"calls": 0, "cancelled": 0}

    async def set_up(self, pool) -> None:
        if pool.name == "p1":
            seen["calls"] += 1
            try:
                await answers.wait()
            except asyncio.CancelledError:
                seen["cancelled"] += 1
                raise
        await real_set_up(self, pool)

    monkeypatch.setattr(Frontend, "_set_up", set_up)
    monkeypatch.setattr(runtime, "START_OTHERS_S", 0.2)
    loop = asyncio.get_running_loop()
    unhandled: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    fe = Frontend(FrontendSettings(heartbeat_s=0.1), cfg, FrontendMetrics())
    try:
        # a bound on a hang (the set-up never ends by itself), not a speed check
        await asyncio.wait_for(fe.start(), timeout=30)
        assert fe.set_up == {"tiny"} and fe.bootstrapped
        await wait_until(lambda: seen["cancelled"] == 1, "the start's set-up of p1 cancelled")
        await wait_until(lambda: seen["calls"] >= 2, "p1's heartbeat loop to set it up")
        assert fe.pool_problem("p1").startswith("pool p1 is not set up yet")
        answers.set()
        await wait_until(lambda: "p1" in fe.set_up, "p1 set up by its heartbeat loop once it answers")
        await wait_until(lambda: not fe.pool_problem("p1"), "p1 servable")
    finally:
        await fe.stop()
        loop.set_exception_handler(None)
    assert seen["cancelled"] == 1 and not unhandled, unhandled


async def test_a_fault_in_a_set_up_left_to_the_heartbeat_loop_is_logged_and_told_by_readiness(
        redis_server, sync_redis, monkeypatch, caplog) -> None:
    """A pool's set-up slower than START_OTHERS_S at the start is left to its heartbeat loop,
    where a fault that is no outage (a script or a policy the server refuses) would have stopped
    the process at the start. It is logged once, at ERROR, and readiness says the set-up failed
    (not that its Redis never answered); both clear once the set-up succeeds."""
    import logging

    from limiter.frontend import runtime
    from tests.support.frontend_helpers import make_cfg
    from tests.support.helpers import wait_until

    cfg = make_cfg(redis_server.url)
    tiny = cfg.pools[0]
    cfg = validate(dataclasses.replace(cfg, pools=(tiny, dataclasses.replace(tiny, name="p1"))))
    real_set_up = Frontend._set_up
    state: dict[str, Any] = {"calls": 0, "fails": ValueError("the server refused the policy")}

    async def set_up(self, pool) -> None:
        if pool.name == "p1":
            state["calls"] += 1
            if state["calls"] == 1:
                await asyncio.Event().wait()  # the start's: never ends, cancelled
            if state["fails"] is not None:
                raise state["fails"]
        await real_set_up(self, pool)

    monkeypatch.setattr(Frontend, "_set_up", set_up)
    monkeypatch.setattr(runtime, "START_OTHERS_S", 0.2)
    fe = Frontend(FrontendSettings(heartbeat_s=0.05), cfg, FrontendMetrics())
    try:
        with caplog.at_level(logging.ERROR, logger="qos.frontend"):
            await asyncio.wait_for(fe.start(), timeout=30)  # a bound on a hang, not a speed check
            await wait_until(lambda: state["calls"] >= 4, "p1's heartbeat loop to try its set-up again")
            assert fe.pool_problem("p1") == ("pool p1 is not set up yet: its set-up failed (the frontend's "
                                             "log says why)")
            errors = [r for r in caplog.records if "cannot set up pool p1" in r.getMessage()]
            assert len(errors) == 1 and "refused the policy" in errors[0].getMessage()
            # an outage since: the reason is the outage again, and no ERROR is logged for it
            state["fails"] = RedisUnavailable("Redis unavailable: connection refused")
            await wait_until(lambda: "has not answered" in fe.pool_problem("p1"), "the outage told as such")
            # another fault: logged too
            state["fails"] = ValueError("the server refused a script")
            await wait_until(lambda: "set-up failed" in fe.pool_problem("p1"), "the second fault told")
            errors = [r for r in caplog.records if "cannot set up pool p1" in r.getMessage()]
            assert [("script" in r.getMessage()) for r in errors] == [False, True]
            state["fails"] = None
            await wait_until(lambda: not fe.pool_problem("p1"), "p1 set up once the fault is gone")
    finally:
        await fe.stop()


async def test_a_cluster_out_of_reach_during_a_set_up_is_an_outage_not_a_fault(redis_server,
                                                                               monkeypatch) -> None:
    """redis-py raises "Redis Cluster cannot be connected" (RedisClusterUnreachableError, no
    connection error) for a command whose refresh of the slot map reached no node. Met by the
    set-up's beat, which calls Redis directly, it stopped the start as a real fault (and in the
    heartbeat loop it read as "its set-up failed"). It is an outage: the frontend starts, says
    its Redis has not answered, and sets the pool up once it does."""
    from redis.exceptions import RedisClusterUnreachableError

    from limiter.frontend.replies import Heartbeat
    from tests.support.frontend_helpers import make_cfg
    from tests.support.helpers import wait_until

    real_beat = Heartbeat.beat_pool
    down = {"on": True}

    async def beat_pool(self, keys) -> None:
        if down["on"]:
            raise RedisClusterUnreachableError("Redis Cluster cannot be connected. Please provide at least "
                                               "one reachable node: Timeout connecting to server")
        await real_beat(self, keys)

    monkeypatch.setattr(Heartbeat, "beat_pool", beat_pool)
    fe = Frontend(FrontendSettings(heartbeat_s=0.05), make_cfg(redis_server.url), FrontendMetrics())
    try:
        await asyncio.wait_for(fe.start(), timeout=30)  # a bound on a hang, not a speed check
        assert "has not answered" in fe.pool_problem("tiny") and not fe.setup_failures
        down["on"] = False
        await wait_until(lambda: not fe.pool_problem("tiny"), "the pool set up once its Redis answers")
    finally:
        await fe.stop()
