"""A binding ceiling charged as its class is served (lua/include/ceiling.lua), from a review of
that change: every way a request ends settles its ceiling charge once, to what it used, and
the bucket's ledger equals the sum of its requests' c_ceil / r_ceil; a redeploy that removes
the class and a ceiling that stops binding mid-request; the same on a Redis Cluster (the
renewal's charge touches the class's bucket in the pool's slot)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from limiter.scripts import policy_document
from tests.support.helpers import admit, charge_of, class_cfg, init_pool, wait_for

P2C = {"ceil_share": 0.1, "floor": 0.0, "max_wait_ms": 600_000}
CFG = class_cfg(P2=P2C)  # at capacity 10,000: P2's ceiling 1,000/s, its burst 500 (binding)


async def p2_pool(scripts):
    return await init_pool(scripts, CFG, capacity=10_000)


async def claimed_with_tokens(scripts, keys, *, tokens=5, max_tokens=100, lease_ms=0, max_wait_ms=0):
    """P2 request "a" (a 10-token prompt) admitted, claimed by w1 (its ceiling charged: it
    binds), and ``tokens`` delivered; its claim."""
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=10, max_tokens=max_tokens,
                max_wait_ms=max_wait_ms)
    (a,) = (await scripts.claim(keys, "w1", 1, lease_ms=lease_ms)).requests
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=0,
                              token_ids=list(range(tokens)), text="x" * tokens, lease_ms=lease_ms)
    return a


def rec(sync_redis, keys, rid):
    got = sync_redis.hgetall(keys.request(rid))
    return {k.decode(): v.decode() for k, v in got.items() if k != b"payload"}


def bucket(sync_redis, keys, cls="P2"):
    return {k.decode(): float(v) for k, v in sync_redis.hgetall(keys.ceil_bucket(cls)).items()}


def check_ledger(sync_redis, keys, rids, cls="P2"):
    b = bucket(sync_redis, keys, cls)
    assert b["tokens"] == pytest.approx(b["start"] + b["refilled"] - b["debited"] + b["refunded"])
    assert b["refunded"] <= b["debited"] + 1e-9
    c = sum(float(rec(sync_redis, keys, r).get("c_ceil") or 0) for r in rids)
    r_ = sum(float(rec(sync_redis, keys, r).get("r_ceil") or 0) for r in rids)
    assert (c, r_) == (pytest.approx(b["debited"]), pytest.approx(b["refunded"])), (b, c, r_)
    return b


def assert_settled(sync_redis, keys, rid, cls="P2"):
    """The request's ceiling charge was settled to what it used (helpers.charge_of) beyond
    its base (what it used before a ceiling bound: ``ceil_base``): charged the rest where it
    used more than it held, else given back the difference -- less where
    the credit would have lifted the bucket past its burst (then the bucket is at its burst:
    it was the bucket's last write)."""
    r = rec(sync_redis, keys, rid)
    used = charge_of(r) - float(r.get("ceil_base") or 0)
    c, back = float(r["c_ceil"]), float(r.get("r_ceil") or 0)
    if c - back == pytest.approx(used):
        return r
    b = bucket(sync_redis, keys, cls)
    assert back < c - used and b["tokens"] == pytest.approx(b["burst"]), (r, b, used)
    return r


async def test_overrun_of_a_marked_request_record_says_what_bucket_took(scripts, sync_redis):
    keys = await p2_pool(scripts)
    a = await claimed_with_tokens(scripts, keys, max_tokens=20)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    # engine read 200 prompt tokens (overrun)
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=200,
                           token_ids=[1, 2, 3], text="abc", offset=5)
    r = rec(sync_redis, keys, "a")
    used = charge_of(r)
    assert used > float(sync_redis.hget(keys.request("a"), "cost"))  # an overrun: charged the rest
    assert float(r["c_ceil"]) - float(r["r_ceil"]) == pytest.approx(used), r
    check_ledger(sync_redis, keys, ["a"])


async def test_requeued_after_tokens_then_reclaimed_and_completed(scripts, sync_redis):
    keys = await p2_pool(scripts)
    a = await claimed_with_tokens(scripts, keys, lease_ms=50)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)], lease_ms=50)
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=5,
                              token_ids=list(range(7)), text="x" * 7, lease_ms=50)
    await asyncio.sleep(0.2)
    res = await scripts.reap(keys)
    assert res.requeued == 1
    (b,) = (await scripts.claim(keys, "w2", 1)).requests
    assert b.delivered == 12 and b.attempt == 2
    await scripts.renew_leases(keys, "w2", [("a", b.fence)])
    r = rec(sync_redis, keys, "a")
    assert r["ceil_out"] == "12"
    await scripts.complete(keys, request_id="a", worker_id="w2", fence=b.fence, outcome="ok", usage_in=10,
                           token_ids=[1, 2], text="ab", offset=12)
    r = rec(sync_redis, keys, "a")
    assert_settled(sync_redis, keys, r["id"])
    check_ledger(sync_redis, keys, ["a"])


@pytest.mark.parametrize("how", ["reap_fail", "expire_queued", "cancel_queued", "release_cancel",
                                 "release_spent_last", "orphan"])
async def test_every_end_settles_once(scripts, sync_redis, how):
    keys = await p2_pool(scripts)
    max_wait_ms = 300 if how == "expire_queued" else 0
    a = await claimed_with_tokens(scripts, keys, lease_ms=100, max_wait_ms=max_wait_ms)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)], lease_ms=100)
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=5,
                              token_ids=list(range(7)), text="x" * 7, lease_ms=100)
    if how == "reap_fail":
        sync_redis.hset(keys.request("a"), "attempts", 99)
        await asyncio.sleep(0.2)
        assert (await scripts.reap(keys)).failed == 1
    elif how in ("expire_queued", "cancel_queued"):
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "requeued"
        if how == "expire_queued":
            await asyncio.sleep(0.5)
            assert (await scripts.reap(keys)).expired == 1
        else:
            assert await scripts.cancel(keys, "a", "t1") == "cancelled"
    elif how == "release_cancel":
        await scripts.cancel(keys, "a", "t1")
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "cancelled"
    elif how == "release_spent_last":
        sync_redis.hset(keys.request("a"), "attempts", 99)
        got = await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence, spent=True)
        assert got == "failed"
    elif how == "orphan":
        assert await scripts.cancel(keys, "a", "t1") == "cancelling"
        await asyncio.sleep(0.2)
        assert (await scripts.reap(keys)).cancelled == 1
    r = rec(sync_redis, keys, "a")
    assert r["state"] in ("failed", "expired", "cancelled"), r
    assert_settled(sync_redis, keys, r["id"])
    check_ledger(sync_redis, keys, ["a"])


async def test_class_removed_by_redeploy_mid_request(scripts, sync_redis):
    keys = await p2_pool(scripts)
    a = await claimed_with_tokens(scripts, keys)
    cfg2 = dataclasses.replace(CFG, classes=tuple(c for c in CFG.classes if c.name != "P2"))
    await scripts.init_pool(keys, policy_document(cfg2, cfg2.pool("tiny"), 1000), reset_rates=False)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=10,
                           token_ids=[1], text="a", offset=5)
    r = rec(sync_redis, keys, "a")
    assert r["state"] == "done"
    check_ledger(sync_redis, keys, ["a"])


async def test_ceiling_stops_binding_mid_request(scripts, sync_redis):
    keys = await p2_pool(scripts)
    a = await claimed_with_tokens(scripts, keys)
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 5000, "P2.ceil_burst": 2500}) == 1
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=10,
                           token_ids=[1], text="a", offset=5)
    r = rec(sync_redis, keys, "a")
    assert_settled(sync_redis, keys, r["id"])
    check_ledger(sync_redis, keys, ["a"])


async def test_cluster_renew_charges_a_binding_ceiling(redis_cluster):
    from redis.asyncio.cluster import RedisCluster

    from limiter.keys import PoolKeys
    from limiter.scripts import Scripts
    from tests.support.redis_server import pools_on_different_shards
    client = RedisCluster.from_url(redis_cluster.url)
    await client.initialize()
    try:
        scripts = Scripts(client)
        cfg = CFG
        # pools of its own: the cluster is the session's, and test_cluster.py's pools keep
        # their records (a request id met again is the request met again)
        for name in pools_on_different_shards(client, prefix="ceil"):
            keys = PoolKeys(name)
            await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny"), 10_000), reset_rates=True)
            await client.zadd(keys.frontends, {"fe1": 4102444800000})
            await admit(scripts, keys, cls="P2", request_id=f"{name}-b", input_tokens=5, max_tokens=50)
            (c,) = (await scripts.claim(keys, "w1", 1)).requests
            await scripts.push_tokens(keys, request_id=c.request_id, worker_id="w1", fence=c.fence, offset=0,
                                      token_ids=[65, 66], text="AB")
            await scripts.renew_leases(keys, "w1", [(c.request_id, c.fence)])
            assert await client.hget(keys.request(c.request_id), "ceil_out") == b"2"
            await scripts.complete(keys, request_id=c.request_id, worker_id="w1", fence=c.fence, outcome="ok",
                                   usage_in=5, token_ids=[67], text="C", offset=2)
            r = {k.decode(): v.decode() for k, v in (await client.hgetall(keys.request(c.request_id))).items()
                 if k != b"payload"}
            c, back = float(r["c_ceil"]), float(r["r_ceil"])
            assert charge_of(r) == 8 and c == 55, r  # 5 + 3 tokens used; its whole reservation held
            b = {k.decode(): float(v) for k, v in (await client.hgetall(keys.ceil_bucket("P2"))).items()}
            # given back the rest, less where the bucket would pass its burst (see assert_settled)
            assert back == c - 8 or (back < c - 8 and b["tokens"] == b["burst"]), (r, b)
    finally:
        await client.aclose()


async def test_a_charge_ahead_a_deploy_lowered_mid_request_is_kept_until_the_end(scripts, sync_redis):
    """A redeploy lowers ceiling_ahead_tokens (256 -> 0) while a request runs: its next
    renewal finds it holding more than its new hold (due < 0). Nothing is charged and nothing
    given back then (ceil_out moves on, c_ceil stays); its end settles to what it used."""
    cfg = CFG
    keys = await p2_pool(scripts)
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=10, max_tokens=1000)
    (a,) = (await scripts.claim(keys, "w1", 1)).requests
    held = float(rec(sync_redis, keys, "a")["c_ceil"])
    pools = tuple(dataclasses.replace(p, ceiling_ahead_tokens=0) for p in cfg.pools)
    lowered = dataclasses.replace(cfg, pools=pools)
    await scripts.init_pool(keys, policy_document(lowered, lowered.pool("tiny"), 10_000), reset_rates=False)
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=0,
                              token_ids=list(range(5)), text="x" * 5)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    assert (float(r["c_ceil"]), r["ceil_out"]) == (held, "5"), r
    check_ledger(sync_redis, keys, ["a"])
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=10,
                           token_ids=[1], text="a", offset=5)
    assert_settled(sync_redis, keys, "a")
    check_ledger(sync_redis, keys, ["a"])


@pytest.mark.parametrize("how", ["lease_lost", "handed_back"])
async def test_a_requeue_charges_what_its_worker_delivered_since_its_last_renewal(scripts, sync_redis, how):
    """A dead worker's tokens (its lease reaped) or a draining worker's (handed back) since its
    last renewal are charged to the ceiling at the requeue: left to the next worker's first
    renewal, the class could start what its ceiling had no room for meanwhile (a review)."""
    keys = await p2_pool(scripts)
    a = await claimed_with_tokens(scripts, keys, tokens=300, max_tokens=1000, lease_ms=100)
    if how == "lease_lost":
        await wait_for(lambda: _requeued_by_reap(scripts, keys), "the lease to lapse and be reaped",
                       timeout=30)
    else:
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "requeued"
    r = rec(sync_redis, keys, "a")
    w_in, w_out = float(r["w_in"]), float(r["w_out"])
    assert (r["state"], r["ceil_out"]) == ("queued", "300"), r
    assert float(r["c_ceil"]) == 10 * w_in + (300 + 256) * w_out, r
    check_ledger(sync_redis, keys, ["a"])


async def _requeued_by_reap(scripts, keys) -> bool:
    return (await scripts.reap(keys)).requeued == 1



async def test_a_ceiling_that_starts_binding_mid_request_charges_what_it_serves_from_then(
        scripts, sync_redis):
    """P2 is claimed while its ceiling does not bind (at capacity), then the controller cuts
    it (binding) while the request runs: its next renewal marks it -- what it used until then
    (its prompt, 5 tokens) is its base, never charged, and the output ahead is charged -- and
    from then on it is charged as served, settled at its end to what it used beyond its base.
    Left unmarked, a running request was never charged (the fifty-fourth stop's note): a cut
    ceiling held only the class's new requests, and its running ones (a long generation runs
    for minutes) ran past it until they ended."""
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    a = await claimed_with_tokens(scripts, keys, max_tokens=1000)
    assert "ceil_out" not in rec(sync_redis, keys, "a")  # not binding at the claim: not charged
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 500}) == 1
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    w_in, w_out = float(r["w_in"]), float(r["w_out"])
    assert (r["ceil_out"], float(r["ceil_base"])) == ("5", 10 * w_in + 5 * w_out), r
    assert float(r["c_ceil"]) == pytest.approx(256 * w_out), r  # the output ahead, no more
    check_ledger(sync_redis, keys, ["a"])
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=5,
                              token_ids=list(range(300)), text="x" * 300)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    assert (r["ceil_out"], float(r["c_ceil"])) == ("305", pytest.approx((300 + 256) * w_out)), r
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=10,
                           token_ids=[1], text="a", offset=305)
    r = assert_settled(sync_redis, keys, "a")
    assert float(r["c_ceil"]) - float(r["r_ceil"]) == pytest.approx(301 * w_out), r  # not its base
    check_ledger(sync_redis, keys, ["a"])


async def test_a_ceiling_that_never_binds_marks_nothing_at_renewals(scripts, sync_redis):
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    a = await claimed_with_tokens(scripts, keys, max_tokens=1000)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    assert "ceil_out" not in r and "ceil_base" not in r and float(r["c_ceil"]) == 0, r
    assert not sync_redis.exists(keys.ceil_bucket("P2"))
