"""A binding ceiling charged as its class is served (lua/include/ceiling.lua), from a review of
that change: every way a request ends settles its ceiling charge once, to what it used, and
the bucket's ledger equals the sum of its requests' c_ceil / r_ceil; a redeploy that removes
the class and a ceiling that stops binding mid-request; the same on a Redis Cluster (the
renewal's charge touches the class's bucket in the pool's slot)."""
from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest

from limiter.scripts import Scripts, lua_dir, policy_document
from tests.support.helpers import admit, ceil_mark, charge_of, class_cfg, init_pool, wait_for

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
    """The request's ceiling charge was settled to what it used (helpers.charge_of) -- marked
    late (helpers.ceil_mark), the output it delivered after its mark (its prompt, all of it,
    whatever its engine counted, was read before its ceiling bound): charged the rest
    where it used more than it held, else given back the difference -- less where
    the credit would have lifted the bucket past its burst (then the bucket is at its burst:
    it was the bucket's last write); never more than it was charged."""
    r = rec(sync_redis, keys, rid)
    used = charge_of(r)
    _, late = ceil_mark(r)
    if late is not None:
        used = max(int(r.get("out_tokens") or 0) - late, 0) * float(r["w_out"])
    c, back = float(r["c_ceil"]), float(r.get("r_ceil") or 0)
    assert back <= c + 1e-9, (r, back, c)
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
    it (binding) while the request runs: its next renewal marks it after its 5th token
    (``ceil_out`` "5@5") -- what it used until then (its prompt, 5 tokens) is never charged,
    and the output ahead is charged -- and from then on it is charged as served, settled at
    its end to the output it delivered after its mark.
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
    w_out = float(r["w_out"])
    assert r["ceil_out"] == "5@5", r
    assert float(r["c_ceil"]) == pytest.approx(256 * w_out), r  # the output ahead, no more
    check_ledger(sync_redis, keys, ["a"])
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=5,
                              token_ids=list(range(300)), text="x" * 300)
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    assert (r["ceil_out"], float(r["c_ceil"])) == ("305@5", pytest.approx((300 + 256) * w_out)), r
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
    assert "ceil_out" not in r and float(r["c_ceil"]) == 0, r
    assert not sync_redis.exists(keys.ceil_bucket("P2"))


@pytest.mark.parametrize("how", ["cancelled_unstarted", "release_cancelled", "handed_back_then_cancelled",
                                 "engine_counted_less"])
async def test_a_request_marked_late_is_never_given_back_more_than_its_ceiling_was_charged(
        scripts, sync_redis, how):
    """A review of the late mark: request "a" (a 200-token prompt) is claimed while P2's
    ceiling does not bind and has delivered nothing when the controller cuts it; its next
    renewal marks it (what it used then, its prompt, never charged: its base). Its end then
    counts less than its base (a first version took the base from what the end counted): stopped
    before its prefill (a worker's look-ahead, complete's usage_in 0: worker/claim_step_loop.py),
    handed back unstarted and cancelled, or an engine that counted fewer prompt tokens than
    the frontend. ``used - base`` went negative and the settle gave the ceiling back its
    charge *and* the part of the base it did not use (r_ceil > c_ceil): the bucket gained
    what no request had paid (here the other request "b", charged after the cut, held the
    bucket below its burst, so the credit was not capped)."""
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=200, max_tokens=1000)
    (a,) = (await scripts.claim(keys, "w1", 1)).requests
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 500}) == 1
    await admit(scripts, keys, cls="P2", request_id="b", tenant="t2", input_tokens=400, max_tokens=100)
    assert len((await scripts.claim(keys, "w2", 1)).requests) == 1
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    r = rec(sync_redis, keys, "a")
    w_out = float(r["w_out"])
    assert r["ceil_out"] == "0@0", r
    if how == "cancelled_unstarted":
        await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="cancelled",
                               usage_in=0, finish_reason="cancelled")
    elif how == "release_cancelled":
        await scripts.cancel(keys, "a", "t1")
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "cancelled"
    elif how == "handed_back_then_cancelled":
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "requeued"
        assert await scripts.cancel(keys, "a", "t1") == "cancelled"
    else:  # its engine counted 150 prompt tokens where the frontend counted 200, and 10 were delivered
        await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok",
                               usage_in=150, token_ids=list(range(10)), text="x" * 10, offset=0)
    r = rec(sync_redis, keys, "a")
    assert r["state"] in ("done", "cancelled"), r
    c, back = float(r["c_ceil"]), float(r["r_ceil"])
    assert back <= c + 1e-9, f"given back {back}, charged {c}: {r}"
    # what it used after its mark (the output delivered since; its prompt, whatever the engine
    # counted, was used before the ceiling bound) is what it is charged
    assert c - back == pytest.approx(int(r.get("out_tokens") or 0) * w_out), r
    check_ledger(sync_redis, keys, ["a", "b"])


async def test_a_request_marked_late_is_not_charged_the_prompt_its_engine_counted_beyond_the_frontend(
        scripts, sync_redis):
    """As above, but its engine counted 300 prompt tokens where the frontend counted 200 (an
    overrun): the whole prompt was read before the ceiling bound -- the base is "what it used
    until then" -- yet the settle charged the ceiling the 100 tokens beyond the frontend's
    count, as if they had been served under it."""
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=200, max_tokens=1000)
    (a,) = (await scripts.claim(keys, "w1", 1)).requests
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=0,
                              token_ids=list(range(5)), text="x" * 5)
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 500}) == 1
    await scripts.renew_leases(keys, "w1", [("a", a.fence)])
    await scripts.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok", usage_in=300,
                           token_ids=list(range(10)), text="x" * 10, offset=5)
    r = rec(sync_redis, keys, "a")
    w_out = float(r["w_out"])
    # the 10 tokens since its mark
    assert float(r["c_ceil"]) - float(r.get("r_ceil") or 0) == pytest.approx(10 * w_out), r
    check_ledger(sync_redis, keys, ["a"])


# lua/ as the release before the late mark (6688f24) ran it: a renewal never marks, and
# ceil_out is a number (include/record.lua parse_ceil_out)
PREVIOUS_RELEASE = (
    ("renew_leases.lua", "      elseif ceiling_binds_now(cls) then\n", "      elseif false then\n"),
    ("include/record.lua", "  if n then return n, nil end\n", "  if true then return n, nil end\n"),
)


@pytest.mark.parametrize("previous_does", ["renew", "requeue", "complete"])
async def test_a_previous_releases_scripts_do_not_charge_a_late_marked_requests_base(
        scripts, aredis, sync_redis, tmp_path, previous_does):
    """A rolling deploy or a rollback: a role of this release marks request "a" late (3,000
    tokens delivered before the cut, a 200-token prompt), then a role of the release before
    it renews its lease (the request requeued to a worker not yet upgraded), requeues it (an
    older janitor reaps its lapsed lease) or completes it. A review of the late mark's first
    version (its mark a number in ceil_out and a base in ceil_base): those scripts read
    ``ceil_out`` as "charged as served since the claim" and c_ceil as all it holds, and each
    charged the whole base, 3,200, into the bucket at once (the class held back ~3.2 s at its
    ceiling of 1,000 tokens/s; at the stack's 40 tokens/s with a 16k-token generation, ~7
    minutes). Marked '3000@3000', it reads as no mark to them: nothing more is charged (its end
    gives back at most what was charged, as for a request an older claim charged)."""
    shutil.copytree(lua_dir(), tmp_path / "lua")
    for rel, old, new in PREVIOUS_RELEASE:
        path = tmp_path / "lua" / rel
        assert path.read_text().count(old) == 1, (rel, old)
        path.write_text(path.read_text().replace(old, new))
    previous = Scripts(aredis, lua=tmp_path / "lua")
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    lease_ms = 100 if previous_does == "requeue" else 0
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=200, max_tokens=4000)
    (a,) = (await scripts.claim(keys, "w1", 1, lease_ms=lease_ms)).requests
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=0,
                              token_ids=list(range(3000)), text="x" * 3000, lease_ms=lease_ms)
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 500}) == 1
    await scripts.renew_leases(keys, "w1", [("a", a.fence)], lease_ms=lease_ms)
    r = rec(sync_redis, keys, "a")
    w_out = float(r["w_out"])
    assert (r["ceil_out"], float(r["c_ceil"])) == ("3000@3000", pytest.approx(256 * w_out)), r
    held = bucket(sync_redis, keys)
    await scripts.push_tokens(keys, request_id="a", worker_id="w1", fence=a.fence, offset=3000,
                              token_ids=list(range(10)), text="x" * 10, lease_ms=lease_ms)
    if previous_does == "renew":
        await previous.renew_leases(keys, "w1", [("a", a.fence)])
    elif previous_does == "requeue":
        await wait_for(lambda: _requeued_by_reap(previous, keys), "the lease to lapse and be reaped")
    else:
        await previous.complete(keys, request_id="a", worker_id="w1", fence=a.fence, outcome="ok",
                                usage_in=200, token_ids=[1], text="a", offset=3010)
    b = bucket(sync_redis, keys)
    net = (b["debited"] - b["refunded"]) - (held["debited"] - held["refunded"])
    # 10 tokens delivered since the mark (an 11th with the completion, whose end gives back
    # the output charged ahead): never the 3,200 of its base
    assert net <= 11 * w_out + 1e-9, (net, rec(sync_redis, keys, "a"), b)
    check_ledger(sync_redis, keys, ["a"])


@pytest.mark.parametrize("how", ["handed_back_unstarted", "lease_lost_unstarted"])
async def test_a_request_requeued_unstarted_before_a_cut_is_charged_its_prompt_when_reclaimed_under_it(
        scripts, sync_redis, how):
    """A second review of the late mark: request "a" (a 2,000-token prompt, 20 tokens out) is
    claimed while P2's ceiling does not bind, then handed back unstarted by a draining worker
    (or its worker dies before its first token: its lease reaped); the controller cuts the
    ceiling; another worker claims it under the binding ceiling and serves all of it, prompt
    and output. A re-claim charged nothing (claimed_ms set) and its first renewal marked it
    late ('0@0'): its whole prompt, read under the binding ceiling, was never charged
    (its ceiling charged 20 for the 2,020 it used) -- not "used before the ceiling bound"."""
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    lease_ms = 100 if how == "lease_lost_unstarted" else 0
    await admit(scripts, keys, cls="P2", request_id="a", input_tokens=2000, max_tokens=20)
    (a,) = (await scripts.claim(keys, "w1", 1, lease_ms=lease_ms)).requests
    if how == "handed_back_unstarted":
        assert await scripts.release(keys, request_id="a", worker_id="w1", fence=a.fence) == "requeued"
    else:
        await wait_for(lambda: _requeued_by_reap(scripts, keys), "the lease to lapse and be reaped")
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 5000}) == 1
    (b,) = (await scripts.claim(keys, "w2", 1)).requests
    await scripts.renew_leases(keys, "w2", [("a", b.fence)])
    await scripts.complete(keys, request_id="a", worker_id="w2", fence=b.fence, outcome="ok", usage_in=2000,
                           token_ids=list(range(20)), text="x" * 20, offset=0)
    r = rec(sync_redis, keys, "a")
    assert r["state"] == "done", r
    # all it used, it used under the binding ceiling
    assert float(r["c_ceil"]) - float(r.get("r_ceil") or 0) == pytest.approx(charge_of(r)), r
    check_ledger(sync_redis, keys, ["a"])


async def test_a_request_requeued_after_tokens_before_a_cut_is_marked_when_reclaimed_under_it(
        scripts, sync_redis):
    """As above, but its first worker delivered 5 tokens before its lease lapsed: the re-claim
    under the binding ceiling marks it late after them ('5@5', the output ahead charged), so
    the output its new worker delivers before its first renewal is charged too (left to that
    renewal, the 10 tokens delivered by then were never charged: marked '15@15')."""
    keys = await init_pool(scripts, class_cfg(P2={**P2C, "ceil_share": 1.0}), capacity=10_000)
    a = await claimed_with_tokens(scripts, keys, max_tokens=1000, lease_ms=100)
    await wait_for(lambda: _requeued_by_reap(scripts, keys), "the lease to lapse and be reaped")
    fence, _ = await scripts.acquire_leader(keys, "ctl", 10_000)
    assert await scripts.set_rates(keys, "ctl", fence, {}, {"P2.ceil": 1000, "P2.ceil_burst": 500}) == 1
    (b,) = (await scripts.claim(keys, "w2", 1)).requests
    assert b.request_id == a.request_id and b.delivered == 5
    await scripts.push_tokens(keys, request_id="a", worker_id="w2", fence=b.fence, offset=5,
                              token_ids=list(range(10)), text="x" * 10)
    await scripts.renew_leases(keys, "w2", [("a", b.fence)])
    r = rec(sync_redis, keys, "a")
    w_out = float(r["w_out"])
    assert (r["ceil_out"], float(r["c_ceil"])) == ("15@5", pytest.approx((10 + 256) * w_out)), r
    await scripts.complete(keys, request_id="a", worker_id="w2", fence=b.fence, outcome="ok", usage_in=10,
                           token_ids=[1], text="a", offset=15)
    r = assert_settled(sync_redis, keys, "a")
    assert float(r["c_ceil"]) - float(r["r_ceil"]) == pytest.approx(11 * w_out), r
    check_ledger(sync_redis, keys, ["a"])
