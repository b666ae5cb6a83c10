"""Leases, requeue, attempts, fencing of stale workers, completion refunds, cancel in every state."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limiter.config import demo_config
from limiter.errors import LeaseLost
from limiter.scripts import REAP_LIMIT, policy_document
from tests.support.helpers import admit, redis_ms


async def _claim_one(scripts, pool, worker="w1", lease_ms=0):
    got = await scripts.claim(pool, worker, 1, lease_ms=lease_ms)
    assert len(got.requests) == 1
    return got.requests[0]


async def test_expired_lease_requeues_at_the_head_and_another_worker_resumes(scripts, pool):
    await admit(scripts, pool, cls="P1", request_id="first", input_tokens=5, max_tokens=10)
    await admit(scripts, pool, cls="P1", request_id="second", input_tokens=5, max_tokens=10)
    c = await _claim_one(scripts, pool, "w1", lease_ms=100)
    assert c.request_id == "first"
    await scripts.push_tokens(pool, request_id="first", worker_id="w1", fence=c.fence, offset=0,
                              token_ids=[104, 105], text="hi", lease_ms=100)
    await asyncio.sleep(0.15)
    reaped = await scripts.reap(pool)
    assert reaped.requeued == 1
    # requeued, its token string lives as long as its record: until its queue deadline + a week
    # (P1's max wait is 10 s, its last lease was 0.1 s: a string left at the lease's TTL is
    # ~10 s short; both TTLs are read in one round trip)
    async with scripts.client.pipeline(transaction=False) as pipe:
        ttl_record, ttl_tokens = await pipe.pttl(pool.request("first")).pttl(pool.tokens("first")).execute()
    assert ttl_record > 7 * 86400 * 1000 and abs(ttl_tokens - ttl_record) < 2_000
    c2 = await _claim_one(scripts, pool, "w2")
    assert c2.request_id == "first" and c2.attempt == 2  # head of its queue, ahead of "second"
    assert c2.fence > c.fence  # a new lease token, never one handed out before
    assert c2.delivered == 2 and c2.generated == [104, 105]  # what the new worker re-prefills
    # The dead worker's late writes are fenced off.
    with pytest.raises(LeaseLost):
        await scripts.push_tokens(pool, request_id="first", worker_id="w1", fence=c.fence, offset=2,
                                  token_ids=[33], text="!")
    with pytest.raises(LeaseLost):
        await scripts.complete(pool, request_id="first", worker_id="w1", fence=c.fence, outcome="ok",
                               usage_in=5)
    await scripts.push_tokens(pool, request_id="first", worker_id="w2", fence=c2.fence, offset=2,
                              token_ids=[33], text="!")
    await scripts.complete(pool, request_id="first", worker_id="w2", fence=c2.fence, outcome="ok", usage_in=5)
    entries = [e for _, e in await scripts.client.xrange(pool.reply("fe1"))]
    text = "".join(e[b"t"].decode() for e in entries if e[b"k"] in (b"tok", b"done"))
    assert text == "hi!"
    assert entries[-1][b"out"] == b"3"
    # resumed while running (its payload read by the second claim), dropped once done
    assert await scripts.client.hget(pool.request("first"), "payload") is None
    assert await scripts.client.hget(pool.request("second"), "payload") is not None  # still queued


async def test_max_attempts_fails_with_a_clear_reason(scripts, pool):
    await admit(scripts, pool, cls="P0", request_id="doomed", input_tokens=5, max_tokens=5)
    for attempt in (1, 2, 3):
        c = await _claim_one(scripts, pool, f"w{attempt}", lease_ms=50)
        assert c.attempt == attempt
        await asyncio.sleep(0.07)
        await scripts.reap(pool)
    rec = await scripts.client.hgetall(pool.request("doomed"))
    assert rec[b"state"] == b"failed"
    assert b"3 attempts" in rec[b"reason"]
    _, last = (await scripts.client.xrange(pool.reply("fe1")))[-1]
    assert last[b"code"] == b"exhausted"  # failed on every attempt: its client is told not to resend
    assert b"payload" not in rec  # an ended request's prompt is not kept (uncharged memory)
    assert await scripts.client.zcard(pool.leases) == 0
    assert await scripts.client.hget(pool.inflight, "P0") is None


async def test_a_spent_release_on_the_last_attempt_fails_it_as_exhausted(scripts, pool):
    """A worker hands a request back because the model server broke on it (``spent``): on
    the last attempt it fails, its client told ``exhausted`` (not to send it again); on an
    earlier one it is requeued."""
    await admit(scripts, pool, cls="P0", request_id="breaks", input_tokens=5, max_tokens=5)
    for attempt in (1, 2, 3):
        c = await _claim_one(scripts, pool, f"w{attempt}")
        assert c.attempt == attempt
        got = await scripts.release(pool, request_id="breaks", worker_id=f"w{attempt}", fence=c.fence,
                                    spent=True)
        assert got == ("failed" if attempt == 3 else "requeued")
    _, last = (await scripts.client.xrange(pool.reply("fe1")))[-1]
    assert last[b"code"] == b"exhausted" and b"all 3 attempts" in last[b"msg"]


async def test_renew_extends_and_reports_lost_and_cancelled(scripts, pool):
    # Leases far longer than the test: a renewal is seen in the lease index (each sets the
    # lease's end to the server's now + the lease asked for), not by the lease surviving a
    # sleep (200 ms leases renewed every 100 ms lapsed on a machine that stalled 100 ms).
    await admit(scripts, pool, cls="P1", request_id="keep", input_tokens=1, max_tokens=5)
    await admit(scripts, pool, cls="P1", request_id="cancelme", input_tokens=1, max_tokens=5)
    got = await scripts.claim(pool, "w1", 2, lease_ms=60_000)
    fences = {c.request_id: c.fence for c in got.requests}
    for i in range(4):
        lease_ms = 120_000 + 60_000 * i  # each renewal asks for longer: its end moves on
        ends = await scripts.client.zmscore(pool.leases, ["keep", "cancelme"])
        now = await redis_ms(scripts.client)
        held = [("keep", fences["keep"]), ("cancelme", fences["cancelme"]), ("ghost", 1)]
        res = await scripts.renew_leases(pool, "w1", held, lease_ms=lease_ms)
        assert res.lost == ["ghost"]
        renewed = await scripts.client.zmscore(pool.leases, ["keep", "cancelme"])
        for before, after in zip(ends, renewed, strict=True):
            assert after > before and after >= now + lease_ms, (i, before, after, now)
    assert await scripts.client.zscore(pool.leases, "ghost") is None  # a lost one is not leased by a renewal
    assert (await scripts.reap(pool)).requeued == 0  # renewed leases did not expire
    assert await scripts.cancel(pool, "cancelme", "t1") == "cancelling"
    res = await scripts.renew_leases(pool, "w1", [("keep", fences["keep"]), ("cancelme", fences["cancelme"])])
    assert res.stop == ["cancelme"]
    # A push does not say it (lua/push_tokens.lua): the worker asks the cancels set.
    assert await scripts.client.smismember(pool.cancels, ["keep", "cancelme"]) == [0, 1]


async def test_renew_covers_more_leases_than_one_call_may_carry(scripts, pool):
    """An openai worker may hold up to max_inflight (<= 100,000) requests, but renew_leases
    takes at most 4,096 entries a call: the worker's one call for all of them was refused
    (BADARG), so with more than 4,096 held no lease was ever renewed (each lapsed and was
    requeued under the streams still running)."""
    await admit(scripts, pool, cls="P1", request_id="keep", input_tokens=1, max_tokens=5)
    (got,) = (await scripts.claim(pool, "w1", 1, lease_ms=60_000)).requests
    held = [(f"ghost{i}", 1) for i in range(5000)] + [("keep", got.fence)]
    res = await scripts.renew_leases(pool, "w1", held, lease_ms=60_000)
    assert len(res.lost) == 5000 and "keep" not in res.lost and res.stop == []


async def test_completion_refunds_the_unused_reservation_never_more(scripts, pool):
    b = pool.tenant_bucket("refund")
    await admit(scripts, pool, cls="P1", request_id="r", tenant="refund", input_tokens=100, max_tokens=400,
                tenant_rate=1e-9, tenant_burst=1000)
    assert float(await scripts.client.hget(b, "tokens")) == pytest.approx(500, abs=1e-3)
    c = await _claim_one(scripts, pool)
    await scripts.push_tokens(pool, request_id="r", worker_id="w1", fence=c.fence, offset=0,
                              token_ids=list(range(30)), text="x" * 30)
    refunded = await scripts.complete(pool, request_id="r", worker_id="w1", fence=c.fence, outcome="ok",
                                      usage_in=100, token_ids=list(range(20)), text="y" * 20)
    assert refunded == pytest.approx(350)  # 400 reserved - 50 generated
    assert float(await scripts.client.hget(b, "tokens")) == pytest.approx(850, abs=1e-3)
    rec = await scripts.client.hgetall(pool.request("r"))
    assert rec[b"usage_out"] == b"50" and rec[b"state"] == b"done"
    # The ledger cannot be gamed: claiming more usage than reserved is refused, unchanged.
    await admit(scripts, pool, cls="P1", request_id="r2", tenant="refund", input_tokens=1, max_tokens=2,
                tenant_rate=1e-9, tenant_burst=1000)
    c2 = await _claim_one(scripts, pool)
    from limiter.errors import InvalidArgument
    with pytest.raises(InvalidArgument):
        await scripts.complete(pool, request_id="r2", worker_id="w1", fence=c2.fence, outcome="ok",
                               usage_in=1, token_ids=[1, 2, 3], text="abc")


async def test_a_refund_goes_to_the_tenants_bucket_under_its_current_quota(scripts, pool, sync_redis):
    """A refund read the tenant's bucket with the quota its request was admitted under and
    capped it at that burst: a tenant whose quota was raised meanwhile (burst 100 -> 1e6) was
    cut back to 100 by the old request's completion, and the refund itself was lost (a
    review). The bucket keeps the quota it was last written under, and the refund uses it."""
    await admit(scripts, pool, tenant="t1", request_id="old", input_tokens=10, max_tokens=10,
                tenant_rate=1, tenant_burst=100)
    c = (await scripts.claim(pool, "w1", 1)).requests[0]
    # Redis' clock moves on a few ms first: within one ms the new rate refilled nothing (a
    # fast run read 60 tokens here, the old request's burst less two charges)
    since = await redis_ms(scripts.client)
    deadline = asyncio.get_running_loop().time() + 15
    while await redis_ms(scripts.client) < since + 5:
        assert asyncio.get_running_loop().time() < deadline, "Redis' clock to move on by 5 ms"
        await asyncio.sleep(0.001)
    await admit(scripts, pool, tenant="t1", request_id="new", input_tokens=10, max_tokens=10,
                tenant_rate=1e6, tenant_burst=1e6)  # the quota raised: the bucket refills to it
    before = float(sync_redis.hget(pool.tenant_bucket("t1"), "tokens"))
    assert before > 1000
    refund = await scripts.complete(pool, request_id="old", worker_id="w1", fence=c.fence, outcome="ok",
                                    usage_in=0)
    assert refund == 20
    assert float(sync_redis.hget(pool.tenant_bucket("t1"), "tokens")) >= before
    assert float(sync_redis.hget(pool.request("old"), "r_tenant")) == 20


async def test_model_tokens_are_counted_apart_from_the_resume_ids(scripts, pool):
    """The openai engine counts the upstream's tokens (count) and stores the text's bytes as
    the ids a resuming worker primes itself with: out_tokens, max_tokens, usage and the refund
    follow count; the generated blob holds the ids; a resumed attempt gets both back."""
    await admit(scripts, pool, cls="P1", request_id="m", tenant="model", input_tokens=10, max_tokens=4,
                tenant_rate=1e-9, tenant_burst=1000)
    c = await _claim_one(scripts, pool, lease_ms=100)
    text = "Hello, wörld"  # 3 model tokens, 13 bytes
    await scripts.push_tokens(pool, request_id="m", worker_id="w1", fence=c.fence, offset=0,
                              token_ids=list(text.encode()), text=text, count=3, lease_ms=100)
    rec = await scripts.client.hgetall(pool.request("m"))
    assert rec[b"out_tokens"] == b"3"
    from limiter.errors import InvalidArgument
    before = await scripts.client.get(pool.tokens("m"))
    with pytest.raises(InvalidArgument, match="max_tokens"):  # 3 + 2 model tokens > 4, however few ids
        await scripts.push_tokens(pool, request_id="m", worker_id="w1", fence=c.fence, offset=3,
                                  token_ids=[33], text="!", count=2)
    assert await scripts.client.get(pool.tokens("m")) == before
    await asyncio.sleep(0.15)
    assert (await scripts.reap(pool)).requeued == 1
    c2 = await _claim_one(scripts, pool, "w2")
    assert c2.delivered == 3 and bytes(c2.generated).decode() == text  # resume text and count
    refunded = await scripts.complete(pool, request_id="m", worker_id="w2", fence=c2.fence, outcome="ok",
                                      usage_in=9, token_ids=[], text="", count=1)  # a token with no text
    assert refunded == pytest.approx(14 - 13)  # reserved 10 + 4, used 9 + 4
    rec = await scripts.client.hgetall(pool.request("m"))
    assert rec[b"usage_out"] == b"4" and rec[b"usage_in"] == b"9"
    assert await scripts.client.get(pool.tokens("m")) == before


async def test_cancel_in_each_state(scripts, pool):
    # queued: removed and fully refunded
    await admit(scripts, pool, cls="P2", request_id="q", tenant="c", input_tokens=10, max_tokens=10,
                tenant_rate=1e-9, tenant_burst=100)
    assert await scripts.cancel(pool, "q", "c") == "cancelled"
    assert await scripts.client.zcard(pool.queue("P2", "c")) == 0
    assert float(await scripts.client.hget(pool.tenant_bucket("c"), "tokens")) == pytest.approx(100, abs=1e-3)
    # another tenant cannot cancel (or even see) someone's request
    await admit(scripts, pool, cls="P2", request_id="mine", tenant="owner", input_tokens=1, max_tokens=1)
    assert await scripts.cancel(pool, "mine", "intruder") == "not_found"
    # leased: flagged for the worker, which completes it as cancelled
    c = await _claim_one(scripts, pool)
    assert await scripts.cancel(pool, "mine", "owner") == "cancelling"
    assert await scripts.client.sismember(pool.cancels, "mine")
    await scripts.complete(pool, request_id="mine", worker_id="w1", fence=c.fence, outcome="cancelled",
                           usage_in=1, finish_reason="cancelled")
    assert not await scripts.client.sismember(pool.cancels, "mine")
    # finished and unknown
    assert await scripts.cancel(pool, "mine", "owner") == "final:cancelled"
    assert await scripts.cancel(pool, "nope", "owner") == "not_found"
    # expired-reason on a leased request leaves it running
    await admit(scripts, pool, cls="P1", request_id="run", tenant="owner", input_tokens=1, max_tokens=1)
    await _claim_one(scripts, pool)
    assert await scripts.cancel(pool, "run", "owner", reason="expired") == "running"


@pytest.mark.parametrize("end", ["client_gone", "expired", "too_large"])
async def test_a_requeued_request_ended_while_queued_is_charged_what_it_delivered(scripts, pool, end):
    """A request handed back after delivering 30 tokens (a worker drained), then ended while
    queued -- its client gone, its max wait passed, no live worker able to hold it -- is
    charged its prompt and those 30 tokens, as the end of that lease would have charged
    them: it was refunded as if nothing had been used (the tenant got its client's 30 tokens
    free, and its counter in a fair class went back as far)."""
    b = pool.tenant_bucket("served")
    await admit(scripts, pool, cls="P1", request_id="r", tenant="served", input_tokens=100, max_tokens=400,
                tenant_rate=1e-9, tenant_burst=1000)
    c = await _claim_one(scripts, pool)
    await scripts.push_tokens(pool, request_id="r", worker_id="w1", fence=c.fence, offset=0,
                              token_ids=list(range(30)), text="x" * 30)
    assert await scripts.release(pool, request_id="r", worker_id="w1", fence=c.fence) == "requeued"
    if end == "too_large":
        await scripts.client.zadd(pool.workers, {"w1": await redis_ms(scripts.client)})
        assert (await scripts.claim(pool, "w1", 1, kv_room=50, kv_total=50)).requests == []
    else:
        assert await scripts.cancel(pool, "r", "served", reason=end) == ("cancelled" if end == "client_gone"
                                                                           else "expired")
    rec = await scripts.client.hgetall(pool.request("r"))
    assert rec[b"state"] in (b"cancelled", b"expired", b"failed")
    assert float(rec[b"refund"]) == pytest.approx(500 - (100 + 30))  # reserved 100 + 400, used 100 + 30
    assert float(await scripts.client.hget(b, "tokens")) == pytest.approx(1000 - 130, abs=1e-3)


@pytest.mark.parametrize("end", ["client_gone", "expired", "at_the_hand_back"])
async def test_a_request_handed_back_unstarted_and_then_ended_is_refunded_in_full(scripts, pool, end):
    """A draining worker hands back work it never started (the attempt is given back); the
    request is then cancelled or expires while queued, or its client was gone at the hand-back
    itself: nothing was used, all is refunded, and it ended as a queued request. Charging its
    prompt once any worker had claimed it (this stop's first rule), or while it was leased at
    the hand-back (a review's find), charged it for nothing."""
    await admit(scripts, pool, cls="P1", request_id="r", tenant="unstarted", input_tokens=100, max_tokens=400,
                tenant_rate=1e-9, tenant_burst=1000)
    c = await _claim_one(scripts, pool)
    if end == "at_the_hand_back":
        assert await scripts.cancel(pool, "r", "unstarted") == "cancelling"
        assert await scripts.release(pool, request_id="r", worker_id="w1", fence=c.fence) == "cancelled"
    else:
        assert await scripts.release(pool, request_id="r", worker_id="w1", fence=c.fence) == "requeued"
        await scripts.cancel(pool, "r", "unstarted", reason=end)
    rec = await scripts.client.hgetall(pool.request("r"))
    assert float(rec[b"refund"]) == pytest.approx(500) and rec[b"ended"] == b"queued"
    bucket = float(await scripts.client.hget(pool.tenant_bucket("unstarted"), "tokens"))
    assert bucket == pytest.approx(1000, abs=1e-3)


@pytest.mark.parametrize("end", ["complete", "complete_writes_the_ids", "failed", "requeued_then_cancelled"])
async def test_a_finished_requests_token_string_goes_with_its_record(scripts, pool, end):
    """A request's token string lives a week while the request may still be resumed; once
    it is finished it must go with its record (record_ttl_s). Kept at its week, every
    answered request's ids stayed in Redis seven days: the memory of a week of traffic."""
    await admit(scripts, pool, cls="P1", request_id="r", input_tokens=5, max_tokens=50)
    c = await _claim_one(scripts, pool)
    if end != "complete_writes_the_ids":
        await scripts.push_tokens(pool, request_id="r", worker_id="w1", fence=c.fence, offset=0,
                                  token_ids=[1, 2], text="ab")
    offset = 0 if end == "complete_writes_the_ids" else 2
    if end == "requeued_then_cancelled":
        assert await scripts.release(pool, request_id="r", worker_id="w1", fence=c.fence) == "requeued"
        assert await scripts.cancel(pool, "r", "t1") == "cancelled"
    else:
        await scripts.complete(pool, request_id="r", worker_id="w1", fence=c.fence,
                               outcome="failed" if end == "failed" else "ok", usage_in=5, token_ids=[3],
                               text="c", offset=offset)
    async with scripts.client.pipeline(transaction=False) as pipe:
        ttl_record, ttl_tokens = await pipe.pttl(pool.request("r")).pttl(pool.tokens("r")).execute()
    record_ttl_ms = demo_config().pool("tiny").record_ttl_s * 1000
    assert 0 < ttl_record <= record_ttl_ms and 0 < ttl_tokens <= record_ttl_ms, (ttl_record, ttl_tokens)


async def test_a_cancelled_request_whose_worker_died_is_finished_by_the_reaper(scripts, pool):
    await admit(scripts, pool, cls="P1", request_id="zombie", input_tokens=1, max_tokens=5)
    await _claim_one(scripts, pool, lease_ms=50)
    await scripts.cancel(pool, "zombie", "t1")
    await asyncio.sleep(0.07)
    assert (await scripts.reap(pool)).cancelled == 1
    rec = await scripts.client.hgetall(pool.request("zombie"))
    assert rec[b"state"] == b"cancelled" and rec[b"ended"] == b"leased"
    # a worker held it (its prompt taken in), nothing delivered: charged its prompt (1 of 6)
    assert float(rec[b"refund"]) == pytest.approx(5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(input_tokens=st.integers(0, 500), max_tokens=st.integers(1, 300), data=st.data())
async def test_refunds_never_exceed_charges(scripts, pool, input_tokens, max_tokens, data):
    """Whatever the usage, the buckets end at (before - true cost): never above where they began."""
    used = data.draw(st.integers(0, max_tokens))
    cfg = demo_config()  # a roomy pool: only the tenant bucket is under test here
    await scripts.init_pool(pool, policy_document(cfg, cfg.pool("tiny"), capacity=1e9), reset_rates=True)
    tenant = f"prop-{uuid.uuid4().hex[:12]}"  # hypothesis may replay an example: fresh ids
    b = pool.tenant_bucket(tenant)
    rid = f"r-{tenant}"
    await admit(scripts, pool, cls="P1", request_id=rid, tenant=tenant, input_tokens=input_tokens,
                max_tokens=max_tokens, tenant_rate=1e-9, tenant_burst=10_000)
    got = await scripts.claim(pool, "w1", 50)
    (c,) = [x for x in got.requests if x.request_id == rid]
    refunded = await scripts.complete(pool, request_id=rid, worker_id="w1", fence=c.fence, outcome="ok",
                                      usage_in=input_tokens, token_ids=list(range(used)), text="x" * used)
    assert 0 <= refunded <= input_tokens + max_tokens
    assert refunded == pytest.approx(max_tokens - used)
    level = float(await scripts.client.hget(b, "tokens"))
    assert level == pytest.approx(10_000 - input_tokens - used, abs=1e-3)
    assert level <= 10_000


async def _lease_then_drop_its_class(scripts, pool, cfg, request_id: str, lease_ms: int):
    """A P2 request is leased; then a deploy's config drops class P2 (every role rewrites the
    policy from its config at start-up)."""
    await admit(scripts, pool, cls="P2", tenant="t2", request_id=request_id, input_tokens=5, max_tokens=5)
    c = await _claim_one(scripts, pool, "w1", lease_ms=lease_ms)
    doc = policy_document(cfg, cfg.pool("tiny"))
    doc["classes"] = [x for x in doc["classes"] if x["name"] != "P2"]
    await scripts.init_pool(pool, doc)
    return c


async def _assert_failed_for_its_class(scripts, pool, request_id: str) -> None:
    r = scripts.client
    rec = await r.hgetall(pool.request(request_id))
    assert rec[b"state"] == b"failed", rec
    assert b"class P2 is no longer in the pool configuration" in rec[b"reason"]
    _, last = (await r.xrange(pool.reply("fe1")))[-1]
    assert last[b"code"] == b"failed" and b"P2" in last[b"msg"]  # its client is told why
    # out of every index and counter; what it did not use given back, never more
    assert await r.zscore(pool.leases, request_id) is None
    assert await r.zscore(pool.deadlines, request_id) is None
    assert await r.exists(pool.queue("P2", "t2")) == 0
    assert await r.hget(pool.tenant_inflight, "t2") is None
    assert await r.hget(pool.inflight, "P2") is None
    assert 0 < await r.ttl(pool.request(request_id)) <= 300
    assert 0 <= float(rec[b"r_tenant"]) <= float(rec[b"c_tenant"])


async def test_a_lease_whose_class_left_the_policy_fails_with_its_reason_when_it_expires(scripts, pool, cfg):
    # Requeueing it put it in a queue no claim reads, after a crash halfway (a nil class): the
    # record said queued, in no index, and its tenant stayed in flight for good.
    await _lease_then_drop_its_class(scripts, pool, cfg, "orphan", lease_ms=50)
    await asyncio.sleep(0.08)
    reaped = await scripts.reap(pool)
    assert (reaped.requeued, reaped.failed) == (0, 1)
    await _assert_failed_for_its_class(scripts, pool, "orphan")


async def test_a_release_of_a_request_whose_class_left_the_policy_fails_it(scripts, pool, cfg):
    c = await _lease_then_drop_its_class(scripts, pool, cfg, "handed-back", lease_ms=0)
    state = await scripts.release(pool, request_id="handed-back", worker_id="w1", fence=c.fence)
    assert state == "failed"
    await _assert_failed_for_its_class(scripts, pool, "handed-back")


@pytest.mark.parametrize("leased", [False, True], ids=["queued", "leased"])
async def test_a_live_record_outlasts_record_ttl_so_a_late_janitor_still_ends_it(scripts, pool, cfg, leased):
    """record_ttl_s is how long a *finished* record is kept. When every role was down for
    longer than that, the records of queued and leased requests used to expire first: the
    janitor then only dropped their index entries, and their tenants' in-flight counts and
    queued costs stayed up for good (a capped tenant was refused as busy for ever)."""
    await scripts.init_pool(pool, {**policy_document(cfg, cfg.pool("tiny")), "record_ttl_s": 1},
                            reset_rates=True)
    # a max wait of 1 s: one of 50 ms had passed on a loaded machine before the claim, which
    # then expired the request instead (claim.lua ends the overdue requests it meets)
    await admit(scripts, pool, cls="P1", tenant="t1", request_id="late", max_wait_ms=1000)
    if leased:
        await _claim_one(scripts, pool, "w1", lease_ms=50)
    r = scripts.client
    await asyncio.sleep(1.3)  # past the deadline and the lease, and past record_ttl_s
    assert await r.pttl(pool.request("late")) > 6 * 86400 * 1000  # alive for days yet
    await scripts.reap(pool)
    if leased:  # requeued by the late janitor, with its max wait afresh: a later pass ends it
        assert await r.hget(pool.request("late"), "state") == b"queued"
        end = time.monotonic() + 15
        while (await scripts.reap(pool)).expired == 0:
            assert time.monotonic() < end, "the requeued request did not expire at its max wait"
            await asyncio.sleep(0.05)
    rec = await r.hgetall(pool.request("late"))
    assert rec[b"state"] == b"expired"
    assert await r.hget(pool.tenant_inflight, "t1") is None
    assert await r.hget(pool.queued, "P1:t1") is None
    assert await r.zcard(pool.deadlines) == 0 and await r.zcard(pool.leases) == 0
    assert 0 < await r.pttl(pool.request("late")) <= 1000  # finished: record_ttl_s from now


async def test_a_long_non_ascii_failure_message_is_cut_to_what_complete_takes(scripts, pool):
    """complete.lua takes a message of at most 4 KiB; the worker cut messages at 4,000
    characters, and 3,000 'é' are 6,000 bytes: a BADARG no finish path handles."""
    await admit(scripts, pool, cls="P1", request_id="e", input_tokens=5, max_tokens=5)
    c = await _claim_one(scripts, pool)
    await scripts.complete(pool, request_id="e", worker_id="w1", fence=c.fence, outcome="failed",
                           usage_in=5, finish_reason="error", message="é" * 3000)
    rec = await scripts.client.hgetall(pool.request("e"))
    assert rec[b"state"] == b"failed"
    reason = rec[b"reason"].decode()  # whole characters only
    assert set(reason) == {"é"} and len(reason.encode()) <= 4096


@pytest.mark.parametrize("index", ["deadlines", "leases"])
async def test_a_janitor_pass_goes_on_past_a_sweep_of_stale_entries(scripts, pool, index):
    """A sweep reads at most 16 index entries. Sixteen stale ones (their records gone, as
    after a restore or a flush of records) ended nothing, so reap_all took the pass for
    the last and stopped, with a due entry behind them left to the next tick. A sweep that
    read its limit now says there may be more, whatever it ended."""
    # leased: a max wait far past the test (claim.lua expires a request it finds overdue, as
    # one of 50 ms was on a loaded machine before the claim); its lease is what falls due
    await admit(scripts, pool, cls="P1", tenant="t1", request_id="due",
                max_wait_ms=50 if index == "deadlines" else 60_000)
    if index == "leases":
        await _claim_one(scripts, pool, "w1", lease_ms=50)
    key = pool.deadlines if index == "deadlines" else pool.leases
    # older than the real entry's deadline, so a sweep reads them first
    await scripts.client.zadd(key, {f"gone-{i}": 1000 + i for i in range(REAP_LIMIT)})
    await asyncio.sleep(0.08)  # past the due entry's deadline or lease
    first = await scripts.reap(pool)
    assert first.full and (first.expired, first.requeued) == (0, 0)  # the stale ones alone
    await scripts.client.zadd(key, {f"gone-{i}": 1000 + i for i in range(REAP_LIMIT)})
    res = await scripts.reap_all(pool)
    assert (res.expired, res.requeued) == ((1, 0) if index == "deadlines" else (0, 1)), res
    assert await scripts.client.zcard(key) == 0 and not res.full
