"""set_rates with leader fencing; the decision history stream; leader lease take-over."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from limiter.errors import StaleLeader


async def test_leader_writes_rates_atomically_with_a_version_and_history(scripts, pool):
    fence, holder = await scripts.acquire_leader(pool, "ctl-a", 1000)
    assert fence == 1 and holder == ""
    v = await scripts.set_rates(pool, "ctl-a", fence, {"reason": "test", "P0": 0.97},
                                {"P0.rate": 111.5, "P0.burst": 55.75, "capacity": 5000})
    assert v == 1
    policy = await scripts.client.hgetall(pool.policy)
    assert policy[b"P0.rate"] == b"111.5" and policy[b"capacity"] == b"5000" and policy[b"version"] == b"1"
    (_, entry), = await scripts.client.xrange(pool.decisions)
    assert entry[b"version"] == b"1" and json.loads(entry[b"d"])["reason"] == "test"


async def test_standby_cannot_lead_while_the_lease_lives_and_takes_over_after(scripts, pool):
    # Leases long enough for every step below on a loaded machine (at 200 ms, ctl-b's own
    # lease once ran out before its first write); ctl-a's death is its lease running out now.
    fa, _ = await scripts.acquire_leader(pool, "ctl-a", 60_000)
    fb, holder = await scripts.acquire_leader(pool, "ctl-b", 60_000)
    assert fb == 0 and holder == f"ctl-a:{fa}"
    await scripts.client.pexpire(pool.leader, 1)  # ctl-a stops renewing (dies): its lease ends
    deadline = time.monotonic() + 15
    while await scripts.client.exists(pool.leader):
        assert time.monotonic() < deadline, "ctl-a's lease to run out"
        await asyncio.sleep(0.005)
    fb, _ = await scripts.acquire_leader(pool, "ctl-b", 60_000)
    assert fb == fa + 1
    # The old leader wakes up and writes with its stale fence: rejected, nothing changes.
    before = await scripts.client.hgetall(pool.policy)
    with pytest.raises(StaleLeader):
        await scripts.set_rates(pool, "ctl-a", fa, {}, {"P0.rate": 1})
    assert await scripts.client.hgetall(pool.policy) == before
    assert await scripts.set_rates(pool, "ctl-b", fb, {}, {"P0.rate": 2}) == 1


async def test_release_hands_over_immediately(scripts, pool):
    fa, _ = await scripts.acquire_leader(pool, "ctl-a", 10_000)
    assert await scripts.release_leader(pool, "ctl-a", fa) is True
    fb, _ = await scripts.acquire_leader(pool, "ctl-b", 10_000)
    assert fb == fa + 1


async def test_ceiling_is_kept_at_or_above_the_rate(scripts, pool):
    fence, _ = await scripts.acquire_leader(pool, "ctl", 1000)
    await scripts.set_rates(pool, "ctl", fence, {}, {"P2.rate": 50_000})
    p = await scripts.client.hgetall(pool.policy)
    assert float(p[b"P2.ceil"]) >= 50_000


async def test_init_pool_keeps_controller_rates_unless_reset(scripts, pool, cfg):
    from limiter.scripts import policy_document
    fence, _ = await scripts.acquire_leader(pool, "ctl", 1000)
    await scripts.set_rates(pool, "ctl", fence, {}, {"P1.rate": 123})
    await scripts.init_pool(pool, policy_document(cfg, cfg.pool("tiny")))
    assert await scripts.client.hget(pool.policy, "P1.rate") == b"123"
    await scripts.init_pool(pool, policy_document(cfg, cfg.pool("tiny")), reset_rates=True)
    assert await scripts.client.hget(pool.policy, "P1.rate") == b"7000"
