"""A Redis that may delete keys under memory pressure (a maxmemory and a maxmemory-policy
other than noeviction) is named where an operator looks: `qos status` / `qos top` and the
controller's log at start. Against a private redis-server, its settings put back after."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator

import pytest
import redis

from limiter.cli import main
from limiter.config import RedisConfig, demo_config
from limiter.controller.service import Controller
from limiter.keys import PoolKeys
from limiter.redis_conn import eviction_risk
from tests.support.controller_helpers import fast_settings


@contextlib.contextmanager
def memory_policy(client: redis.Redis, maxmemory: str, policy: str) -> Iterator[None]:
    before = client.config_get("maxmemory"), client.config_get("maxmemory-policy")
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", policy)
    try:
        yield
    finally:
        client.config_set("maxmemory", before[0]["maxmemory"])
        client.config_set("maxmemory-policy", before[1]["maxmemory-policy"])


@pytest.mark.parametrize(("maxmemory", "policy", "risky"), [
    ("0", "allkeys-lru", False),          # no maxmemory: nothing is ever evicted
    ("1gb", "noeviction", False),         # writes refused when full: an outage, nothing lost
    ("1gb", "volatile-lru", True),        # every unfinished record has a TTL: taken first
    ("1gb", "allkeys-random", True),
])
async def test_status_names_a_redis_that_may_evict_the_pools_keys(
        redis_server, sync_redis, aredis, maxmemory, policy, risky, capsys):
    with memory_policy(sync_redis, maxmemory, policy):
        risk = await eviction_risk(aredis, PoolKeys("tiny"))
        rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", redis_server.url])
        snap = json.loads(capsys.readouterr().out)
        rc_text = await asyncio.to_thread(main, ["status", "--redis-url", redis_server.url])
        text = capsys.readouterr().out
    assert rc == rc_text == 0
    if risky:
        assert risk is not None and policy in risk and "noeviction" in risk
        assert snap["pools"]["tiny"]["redis_eviction"] == risk
        assert f"maxmemory-policy {policy}" in " ".join(text.split())
    else:
        assert risk is None and snap["pools"]["tiny"]["redis_eviction"] is None
        assert "maxmemory-policy" not in text


async def test_a_redis_user_without_info_reads_no_risk_and_status_still_answers(
        redis_server, sync_redis, capsys):
    sync_redis.acl_setuser("noinfo", enabled=True, nopass=True, keys=["*"], channels=["*"],
                           commands=["+@all", "-info"])
    try:
        with memory_policy(sync_redis, "1gb", "allkeys-lru"):
            url = redis_server.url.replace("redis://", "redis://noinfo@", 1)
            rc = await asyncio.to_thread(main, ["status", "--json", "--redis-url", url])
            snap = json.loads(capsys.readouterr().out)
    finally:
        sync_redis.acl_deluser("noinfo")
    assert rc == 0 and snap["pools"]["tiny"]["redis_eviction"] is None


async def test_the_controller_logs_the_risk_at_start(redis_server, sync_redis, caplog):
    cfg = dataclasses.replace(demo_config(), redis=RedisConfig(url=redis_server.url))
    ctl = Controller(fast_settings(cfg), cfg)
    with memory_policy(sync_redis, "1gb", "volatile-ttl"), caplog.at_level(logging.WARNING, "qos.controller"):
        try:
            await ctl.start()
        finally:
            await ctl.stop()
    warned = [r.getMessage() for r in caplog.records if "maxmemory-policy volatile-ttl" in r.getMessage()]
    assert warned and all(m.startswith("pool tiny: ") for m in warned)
