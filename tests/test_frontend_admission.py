"""Honest throttling and the request lifecycle through the frontend: 429 with a Retry-After
that works (a tenant's quota, or a wait past the max wait), admission waits, 503 for a full
queue / queue timeout / Redis down, client disconnects that cancel everywhere and reconcile
the buckets, the safety timeout."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import msgpack
import pytest

from limiter.errors import Throttled
from limiter.frontend.generation import Generation
from limiter.localstack.redis_server import RedisServer
from limiter.samples import decode_sample
from limiter.scripts import Scripts, policy_document
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, bucket_tokens, fe_of, frontend, make_cfg, tenant
from tests.support.helpers import wait_until

# Tenant "slow": 5 weighted tokens/s, burst 20. A request "ab" with max_tokens 7 costs
# 3 (2 bytes + BOS) + 7 = 10, and the fixed-text worker uses all 7: no refund blurs the math.
# WHOLE_BURST costs 20 (12 bytes + BOS + 7): it empties the bucket in one request, and a SLOW
# one after it finds it short for 2 s less the time between them (the bucket refills while
# the test runs: two requests of 10 at 20/s left it 0.5 s, which a busy machine overran).
SLOW = {"model": "tiny", "prompt": "ab", "max_tokens": 7}
WHOLE_BURST = {"model": "tiny", "prompt": "abcdefghijkl", "max_tokens": 7}
TENANTS = [
    tenant("slow-p0", "key-slow-p0", "P0", rate=5, burst_s=4.0),
    tenant("slow-p1", "key-slow-p1", "P1", rate=5, burst_s=4.0),
    tenant("frugal", "key-frugal", "P1", rate=1, burst_s=1000.0),  # burst 1000, ~no refill
    tenant("single", "key-single", "P1", max_inflight=1),
]
CLASSES = {"P0": {"admission_wait_ms": 0, "max_wait_ms": 400},
           "P1": {"admission_wait_ms": 3000},
           "P2": {"queue_cap": 0}}


@pytest.fixture
async def cfg(redis_server, sync_redis):
    return make_cfg(redis_server.url, classes=CLASSES, tenants=TENANTS)


@pytest.fixture
async def client(cfg):
    async with frontend(cfg) as c:
        yield c


async def test_429_retry_after_is_honest(client, aredis):
    async with FakeWorker(aredis, POOL, fixed_text="z" * 7):
        h = auth("key-slow-p0")
        r = await client.post("/v1/completions", json=WHOLE_BURST, headers=h)
        assert r.status == 200
        r = await client.post("/v1/completions", json=SLOW, headers=h)
        assert r.status == 429
        err = (await r.json())["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        # the exact wait for clients that read it (the OpenAI SDKs, before Retry-After): 10
        # tokens at 5/s, 2 s less what refilled since the bucket was emptied
        retry_ms = int(r.headers["retry-after-ms"])
        assert 0 < retry_ms <= 2000
        assert int(r.headers["Retry-After"]) == math.ceil(retry_ms / 1000)  # rounded up to whole seconds
        await asyncio.sleep((retry_ms + 1) / 1000)  # +1 ms: the frontend's own rounding margin
        r = await client.post("/v1/completions", json=SLOW, headers=h)
        assert r.status == 200


async def test_short_bucket_wait_is_slept_not_rejected(client, aredis, monkeypatch):
    """P1 may wait up to 3 s for tokens: the second request sleeps for the bucket (the wait
    the frontend computed, under 2 s), then succeeds."""
    waits: list[int] = []  # each bucket wait the frontend was told, ms
    admit_once = Generation._admit_once

    async def told(self: Generation, payload: bytes) -> object:
        try:
            return await admit_once(self, payload)
        except Throttled as exc:
            waits.append(exc.retry_after_ms)
            raise

    monkeypatch.setattr(Generation, "_admit_once", told)
    async with FakeWorker(aredis, POOL, fixed_text="z" * 7):
        h = auth("key-slow-p1")
        assert (await client.post("/v1/completions", json=WHOLE_BURST, headers=h)).status == 200
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=SLOW, headers=h)
        assert r.status == 200
        slept_s = time.monotonic() - t0
    assert len(waits) == 1 and 0 < waits[0] <= 2000, waits  # one wait, for the bucket
    assert slept_s >= waits[0] / 1000  # it slept that wait, not a 429
    text = await (await client.get("/metrics")).text()
    assert 'qos_frontend_admission_retries_total{class="P1",pool="tiny"} 1.0' in text


async def test_a_bucket_wait_past_the_request_timeout_is_429_at_once(cfg, aredis, sync_redis):
    """The bucket wait is slept only when it ends before request_timeout_s: a wait (here up
    to 2 s, within P1's 3 s admission wait) under a 300 ms timeout was slept, admitted, and
    then timed out as a 503 -- the tokens spent and the client told to retry, when the
    honest answer was a 429 at once."""
    async with frontend(cfg, request_timeout_s=0.3) as client, \
            FakeWorker(aredis, POOL, fixed_text="z" * 7):
        h = auth("key-slow-p1")
        assert (await client.post("/v1/completions", json=WHOLE_BURST, headers=h)).status == 200
        before = sync_redis.hget(POOL.stats, "P1.admitted")
        r = await client.post("/v1/completions", json=SLOW, headers=h)
        err = (await r.json())["error"]
        assert r.status == 429 and err["code"] == "rate_limit_exceeded", err
        assert int(r.headers["Retry-After"]) == math.ceil(int(r.headers["retry-after-ms"]) / 1000)
        assert sync_redis.hget(POOL.stats, "P1.admitted") == before  # nothing queued or charged


async def test_queue_full_is_503_with_retry_after(client, sync_redis):
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                          headers=auth("demo-p2"))
    assert r.status == 503
    err = (await r.json())["error"]
    assert err["code"] == "queue_full" and "full" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert int(sync_redis.hget(POOL.queued, "P2") or 0) == 0


async def test_rejections_by_the_system_leave_a_sample_for_the_controller(redis_server, sync_redis, aredis):
    """A request its class cannot start within its max wait (429 max_wait_exceeded) and a full
    queue are SLO misses the controller must count (outcome ``rejected``); a tenant over its
    own budget is not the system's miss and leaves none."""
    cfg = make_cfg(redis_server.url, classes=CLASSES, pool={"capacity_tokens_s": 10.0},  # P0 waits <= 400 ms
                   tenants=[*TENANTS, tenant("tiny-p1", "key-tiny-p1", "P1", rate=1, burst_s=1.0)])
    async with frontend(cfg) as client:  # no worker: what is queued stays queued
        first = asyncio.create_task(client.post("/v1/completions", json=SLOW, headers=auth("demo-p0")))
        await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P0") or 0) == 1, "one P0 request queued")
        r = await client.post("/v1/completions", json=SLOW, headers=auth("demo-p0"))
        err = (await r.json())["error"]  # 10 weighted tokens ahead at 10/s: 1 s, past 400 ms
        assert r.status == 429 and err["code"] == "max_wait_exceeded" and "max wait" in err["message"]
        assert r.headers["Retry-After"] == "1"
        assert 0 < int(r.headers["retry-after-ms"]) <= 1000
        assert "x-should-retry" not in r.headers  # the SDK's own rule: retry a 429
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                              headers=auth("demo-p2"))
        assert r.status == 503 and (await r.json())["error"]["code"] == "queue_full"
        # a drain estimate in whole seconds, not an exact wait: retry-after-ms says the same
        # (it read 1 ms, and the SDK resent to the full queue at once)
        assert int(r.headers["retry-after-ms"]) == 1000 * int(r.headers["Retry-After"]) >= 1000
        second = asyncio.create_task(client.post("/v1/completions", json=SLOW, headers=auth("key-tiny-p1")))
        await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 1, "one P1 request queued")
        r = await client.post("/v1/completions", json=SLOW, headers=auth("key-tiny-p1"))
        assert r.status == 429 and "tenant" in (await r.json())["error"]["message"]
        assert (await first).status == 503 and (await second).status == 503  # their max waits passed
        await wait_until(lambda: sync_redis.xlen(POOL.samples) >= 4, "four latency samples")
    samples = [msgpack.unpackb(f[b"d"], raw=False) for _, f in sync_redis.xrange(POOL.samples)]
    rejected = [(x["class"], x["tenant"], x["input_tokens"]) for x in samples if x["outcome"] == "rejected"]
    assert sorted(rejected) == [("P0", "demo-p0", 3), ("P2", "demo-p2", 2)], samples
    for x in samples:  # every sample, rejected ones included, is one the controller accepts
        decode_sample(x, ("P0", "P1", "P2"))


async def test_a_wait_its_client_shortened_is_not_counted_as_its_classes_miss(redis_server, sync_redis):
    """X-QoS-Max-Wait-Ms shortens a request's wait for the client's own reasons. A 429 for
    that shorter wait, and an expiry at it, were samples the controller counted as misses of
    the class (a violation of P0's SLO), although the class would have started the request
    within both its own max wait and its TTFT target: any tenant could steer the controller
    with a short header. Their samples now carry the wait as a bound on the first token,
    and the controller does not count them while it is within the TTFT target (a review)."""
    from limiter.controller.settings import ControllerSettings

    cfg = make_cfg(redis_server.url, classes=CLASSES, pool={"capacity_tokens_s": 100.0})
    p0 = ControllerSettings.slos(cfg)["P0"]
    assert p0.ttft_ms is not None
    async with frontend(cfg) as client:  # no worker: what is queued stays queued
        first = asyncio.create_task(client.post("/v1/completions", json=SLOW, headers=auth("demo-p0")))
        await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P0") or 0) == 1, "one P0 request queued")
        # 10 weighted tokens ahead at 100/s: ~100 ms, within P0's 400 ms but past the client's 20
        r = await client.post("/v1/completions", json=SLOW,
                              headers=auth("demo-p0", **{"X-QoS-Max-Wait-Ms": "20"}))
        assert r.status == 429 and (await r.json())["error"]["code"] == "max_wait_exceeded"
        assert (await first).status == 503  # the class's own 400 ms passed: a miss of the class
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 4},
                              headers=auth("demo-p0", **{"X-QoS-Max-Wait-Ms": "50"}))
        assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"
        await wait_until(lambda: sync_redis.xlen(POOL.samples) >= 3, "three latency samples")
    samples = [decode_sample(msgpack.unpackb(f[b"d"], raw=False), ("P0", "P1", "P2"))
               for _, f in sync_redis.xrange(POOL.samples)]
    verdicts = sorted((s.outcome, p0.judge(s) is False) for s in samples)
    assert verdicts == [("expired", False), ("expired", True), ("rejected", False)], samples
    own = [s for s in samples if s.ttft_at_least_ms is not None]
    assert len(own) == 2 and all(s.ttft_at_least_ms <= p0.ttft_ms for s in own), own


@pytest.mark.parametrize("stream", [False, True])
async def test_a_running_request_whose_record_redis_lost_is_answered_at_the_next_heartbeat(
        redis_server, sync_redis, aredis, stream):
    """Redis restarted empty (FLUSHALL here) while a worker ran the request: the worker's next
    push found no lease and dropped it, and nothing told the frontend, whose client waited the
    whole request_timeout_s (600 s) for an answer that could not come (a review). The
    heartbeat finds its own entry gone, looks the admitted requests' records up, and answers
    those gone with a 503 request_lost (mid-stream: an error event) that a retry mends."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg, heartbeat_s=0.2) as client, \
            FakeWorker(aredis, POOL, fixed_text="abcdefghijklmnop", delay_s=0.3, batch=2) as w:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 16, "stream": stream}
        try:
            async with asyncio.timeout(30):
                if stream:  # the stream opens with its first text: lose the record after it
                    r = await client.post("/v1/completions", json=body, headers=auth())
                    first = await r.content.readline()
                    sync_redis.flushall()  # as a Redis restart without persistence
                    text = first.decode() + await r.text()
                else:
                    task = asyncio.create_task(client.post("/v1/completions", json=body, headers=auth()))
                    await wait_until(lambda: bool(w.claimed), "a worker claimed the request")
                    sync_redis.flushall()
                    r = await task
                    text = await r.text()
        except TimeoutError:
            pytest.fail("no answer within 30 s of Redis losing the running request's record")
    if stream:
        assert r.status == 200 and '"request_lost"' in text and "[DONE]" not in text, text
    else:
        assert r.status == 503 and '"request_lost"' in text and r.headers["Retry-After"] == "1", text


@pytest.mark.parametrize("running", [False, True])
async def test_a_request_whose_record_alone_was_lost_is_answered_by_the_sweep(
        redis_server, sync_redis, aredis, monkeypatch, running):
    """A failover to a replica that lagged loses the last writes: a request's record, not this
    frontend's heartbeat entry (written long before), so the check at a lost entry never ran,
    and the client waited its max wait (queued: P2's 60 s) or request_timeout_s (running).
    The periodic sweep answers it (503 request_lost)."""
    from limiter.frontend import runtime

    monkeypatch.setattr(runtime, "LOST_SWEEP_S", 0.2)
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg, heartbeat_s=0.2) as client, contextlib.AsyncExitStack() as stack:
        w = await stack.enter_async_context(FakeWorker(aredis, POOL, fixed_text="abcdefgh", delay_s=60)) \
            if running else None
        task = asyncio.create_task(client.post("/v1/completions", headers=auth("demo-p2"),
                                               json={"model": "tiny", "prompt": "x", "max_tokens": 8}))
        if w is not None:
            await wait_until(lambda: bool(w.claimed), "a worker claimed the request")
        else:
            await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P2") or 0) == 1, "the request queued")
        (key,) = sync_redis.keys(POOL.request_prefix + "*")
        sync_redis.delete(key)  # its record alone, as a replica that never got it
        try:
            async with asyncio.timeout(30):
                r = await task
                text = await r.text()
        except TimeoutError:
            pytest.fail("no answer within 30 s of Redis losing the request's record")
    assert r.status == 503 and '"request_lost"' in text, text


async def test_the_sweep_leaves_a_pool_whose_replies_cannot_be_read(client, sync_redis) -> None:
    """While a pool's reply stream cannot be read, or its reader has not caught up with what
    piled up meanwhile (its last read was a full READ_COUNT), a finished request's final reply
    may wait there past its record's expiry (record_ttl_s): the sweep must not call it lost
    then (a review: `healthy` alone came back with the first of several reads)."""
    fe = fe_of(client)
    q = fe.router.register("gone")  # admitted, and no record in Redis
    fe.router.admitted("gone", POOL.pool)
    try:
        await wait_until(lambda: fe.router.caught_up[POOL.pool], "the pool's reader caught up")
        fe.router.caught_up[POOL.pool] = False  # (as after a read of READ_COUNT entries)
        await fe._sweep_lost_requests(POOL)
        assert q.empty()
        fe.router.caught_up[POOL.pool] = True
        await fe._sweep_lost_requests(POOL)
        assert q.get_nowait().code == "lost"
        await fe._sweep_lost_requests(POOL)  # answered once: not again at the next sweep
        assert q.empty()
    finally:
        fe.router.unregister("gone")


async def test_the_sweep_leaves_a_request_whose_final_reply_came(client) -> None:
    """A finished request's record expires record_ttl_s after its end, maybe while its handler
    still writes the answer to a slow client: once its final reply came, it is no request
    the sweep looks for (it counted it lost, and logged so)."""
    fe = fe_of(client)
    q = fe.router.register("done-slowly")  # admitted, finished, its record expired since
    fe.router.admitted("done-slowly", POOL.pool)
    try:
        fe.router.dispatch(POOL.pool, {b"k": b"done", b"id": b"done-slowly", b"fin": b"stop"})
        await fe._sweep_lost_requests(POOL)
        assert q.get_nowait().kind == "done" and q.empty()
    finally:
        fe.router.unregister("done-slowly")


async def test_the_sweep_leaves_a_request_whose_final_reply_came_before_its_admit_returned(client) -> None:
    """A fast worker's final reply may be read before the admit's answer (register comes
    first for that): the request it ended is then no request the sweep looks for either."""
    fe = fe_of(client)
    q = fe.router.register("done-early")
    try:
        fe.router.dispatch(POOL.pool, {b"k": b"done", b"id": b"done-early", b"fin": b"stop"})
        fe.router.admitted("done-early", POOL.pool)  # admit returns; its record expired since
        await wait_until(lambda: fe.router.caught_up[POOL.pool], "the pool's reader caught up")
        await fe._sweep_lost_requests(POOL)
        assert q.get_nowait().kind == "done" and q.empty()
    finally:
        fe.router.unregister("done-early")


async def test_a_request_answered_lost_is_answered_and_counted_once(client) -> None:
    """A request answered lost (the heartbeat found its entry gone, or a sweep) is no longer
    one to look for: its handler may not have read the answer yet (a check and a sweep in the
    same beat, a stream writing to a slow client), and the next look counted it lost again,
    logged it again and queued another answer, every 10 s until its handler ended."""
    fe = fe_of(client)
    q = fe.router.register("lost-once")  # admitted, and no record in Redis
    fe.router.admitted("lost-once", POOL.pool)
    lost = fe.metrics.lost_requests.labels(POOL.pool)
    before = lost._value.get()
    try:
        await wait_until(lambda: fe.router.caught_up[POOL.pool], "the pool's reader caught up")
        await fe._find_lost_requests(POOL)  # the heartbeat found its own entry gone
        await fe._sweep_lost_requests(POOL)  # then a sweep, before the handler read its answer
        await fe._sweep_lost_requests(POOL)
        assert q.get_nowait().code == "lost" and q.empty()
        assert lost._value.get() == before + 1
    finally:
        fe.router.unregister("lost-once")


def _only_record(sync_redis) -> dict[bytes, bytes]:
    """The record of the one request this test sent."""
    keys = sync_redis.keys(POOL.request_prefix + "*")
    assert len(keys) == 1, keys
    return sync_redis.hgetall(keys[0])


async def test_queue_timeout_is_503_and_refunds(client, sync_redis):
    """No worker: the request's own max wait (header, shorter than the class's) expires it."""
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5},
                          headers=auth("key-frugal", **{"X-QoS-Max-Wait-Ms": "150"}))
    elapsed = time.monotonic() - t0
    assert r.status == 503
    err = (await r.json())["error"]
    assert err["code"] == "queue_timeout" and "max queue wait" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    # Never before its own max wait; that it was the header's 150 ms and not P1's class wait
    # is read from the record, not from how soon the answer came on this machine.
    assert elapsed >= 0.14
    assert _only_record(sync_redis)[b"max_wait_ms"] == b"150"
    assert int(sync_redis.hget(POOL.queued, "P1") or 0) == 0
    assert sync_redis.hget(POOL.stats, "P1.expired") == b"1"
    assert bucket_tokens(sync_redis, POOL.tenant_bucket("frugal")) == pytest.approx(1000.0, abs=1.0)


async def test_max_wait_header_cannot_lengthen(client, sync_redis):
    """P0's max wait is 400 ms here; asking for a day still expires after ~400 ms."""
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                          headers=auth("demo-p0", **{"X-QoS-Max-Wait-Ms": "86400000"}))
    assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"
    assert time.monotonic() - t0 >= 0.35
    assert _only_record(sync_redis)[b"max_wait_ms"] == b"400"  # the class's, not the day asked for


async def test_tenant_concurrency_cap_is_429(client, sync_redis):
    first = asyncio.create_task(client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                                            headers=auth("key-single", **{"X-QoS-Max-Wait-Ms": "1000"})))
    await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 1, "one P1 request queued")
    second = {"model": "tiny", "prompt": "y"}
    r = await client.post("/v1/completions", json=second, headers=auth("key-single"))
    assert r.status == 429 and (await r.json())["error"]["code"] == "too_many_inflight"
    assert "Retry-After" in r.headers
    assert (await first).status == 503


@pytest.mark.parametrize("attempts", [2, 1])
async def test_a_request_whose_workers_all_died_on_it_is_not_resent_by_the_sdk(redis_server, sync_redis,
                                                                                aredis, attempts) -> None:
    """Every attempt's worker died holding it (its lease expired each time): with two or more
    attempts a 503 worker_failed with ``x-should-retry: false`` -- a prompt that kills
    workers, resent twice by the OpenAI SDK, would be admitted, charged and kill as many
    workers again; after one attempt alone (max_attempts 1) the SDK may still resend it."""
    from limiter.scripts import Scripts

    cfg = make_cfg(redis_server.url, pool={"lease_ms": 100, "max_attempts": attempts})
    scripts = Scripts(aredis)
    async with frontend(cfg, reap_s=0.1) as client:
        answer = asyncio.create_task(client.post("/v1/completions", headers=auth(),
                                                 json={"model": "tiny", "prompt": "x", "max_tokens": 2}))
        for attempt in range(1, attempts + 1):  # a worker claims it and dies: requeued, then failed
            await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 1,
                             f"the request queued for attempt {attempt}")
            claimed = (await scripts.claim(POOL, f"doomed-{attempt}", 1)).requests
            assert [c.attempt for c in claimed] == [attempt]
        r = await asyncio.wait_for(answer, 30)
        err = (await r.json())["error"]
    assert r.status == 503 and err["code"] == "worker_failed", err
    assert f"{attempts} attempts" in err["message"], err
    assert r.headers.get("x-should-retry") == ("false" if attempts >= 2 else None)


async def test_worker_failure_is_503(client, aredis):
    async with FakeWorker(aredis, POOL, fail=True):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
    assert r.status == 503
    assert (await r.json())["error"]["code"] == "worker_failed"
    # not told "do not retry": a model server's one-off 500 fails a request at its first attempt
    assert "x-should-retry" not in r.headers


async def test_a_request_refused_for_what_it_is_is_a_400_the_sdk_does_not_send_again(client, aredis):
    """A failure no retry mends (a model server's 400 for a prompt past its context, a prompt
    no worker can hold) was a 503 with Retry-After: the OpenAI SDK sent it twice more, each
    time admitted, charged and failed again (found by a review). It is a 400, as the model
    server's own answer, and the SDK gives up at once."""
    import openai

    base = str(client.server.make_url("/v1"))
    sdk = openai.AsyncOpenAI(base_url=base, api_key="demo-p1")  # the SDK's default retries (2)
    async with FakeWorker(aredis, POOL, fail=True, fail_outcome="refused") as fw:
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
        assert r.status == 400 and "Retry-After" not in r.headers
        err = (await r.json())["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "request_refused")
        assert "fake worker told to fail" in err["message"]
        with pytest.raises(openai.BadRequestError):
            await sdk.completions.create(model="tiny", prompt="y", max_tokens=3)
    await sdk.close()
    assert len(fw.claimed) == 2, f"claimed {fw.claimed}: the SDK sent the refused request again"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_failure_after_a_push_with_no_text_is_still_an_honest_503(client, aredis, path):
    """A first push may carry a token and no text (the first byte of a UTF-8 character is
    held back): nothing the client can see, so a failure after it is still an HTTP 503, not
    an error inside a 200 stream (the stream was opened by any first entry; found by a
    review)."""
    from limiter.scripts import Scripts

    scripts = Scripts(aredis)
    body = {"model": "tiny", "stream": True, "prompt": "hi"} if path == "/v1/completions" else \
        {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    post = asyncio.create_task(client.post(path, json=body, headers=auth()))
    claimed = []

    async def claim() -> bool:
        claimed.extend((await scripts.claim(POOL, "w1", 1)).requests)
        return bool(claimed)

    deadline = time.monotonic() + 15
    while not await claim():
        assert time.monotonic() < deadline, "the request to be claimed"
        await asyncio.sleep(0.01)
    (c,) = claimed
    await scripts.push_tokens(POOL, request_id=c.request_id, worker_id="w1", fence=c.fence, offset=0,
                              token_ids=[0xE6], text="", grouped=True)  # half of a character
    await scripts.complete(POOL, request_id=c.request_id, worker_id="w1", fence=c.fence, outcome="failed",
                           usage_in=3, finish_reason="error", message="engine broke")
    r = await post
    assert r.status == 503, await r.text()
    assert (await r.json())["error"]["code"] == "worker_failed"


async def test_disconnect_while_queued_cancels_and_refunds_in_full(client, sync_redis):
    task = asyncio.create_task(client.post("/v1/chat/completions", headers=auth("key-frugal"), json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}))
    await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 1, "one P1 request queued")
    assert bucket_tokens(sync_redis, POOL.tenant_bucket("frugal")) < 1000 - 50
    task.cancel()  # the client closes its connection
    await wait_until(lambda: sync_redis.hget(POOL.stats, "P1.cancelled") == b"1", "the P1 cancel counted")
    assert int(sync_redis.hget(POOL.queued, "P1") or 0) == 0 and sync_redis.zcard(POOL.deadlines) == 0
    assert sync_redis.hlen(POOL.tenant_inflight) == 0
    assert bucket_tokens(sync_redis, POOL.tenant_bucket("frugal")) == pytest.approx(1000.0, abs=1.0)


async def test_a_cancel_that_overtakes_its_admit_is_sent_again(client, sync_redis, monkeypatch):
    """A client that leaves while its admit is in flight: the frontend's cancel goes on
    another connection and can reach Redis first (an admit carrying a large prompt is still
    being read). It found nothing ('not_found') and the admit that landed after it queued a
    request nobody waits for: a worker ran it to its end. Now a cancel that finds nothing is
    sent again shortly after."""
    fe = fe_of(client)
    answers: list[str] = []
    cancel = fe.scripts.cancel

    async def recording_cancel(*args, **kwargs):
        answers.append(await cancel(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(fe.scripts, "cancel", recording_cancel)
    fe.cancel_soon(POOL, "overtaken", "frugal", "client_gone")
    await wait_until(lambda: answers, "the first cancel's answer")
    assert answers == ["not_found"]  # it overtook the admit
    await fe.scripts.admit(POOL, request_id="overtaken", tenant="frugal", cls="P1", input_tokens=5,
                           max_tokens=50, tenant_rate=1.0, tenant_burst=1000.0, tenant_max_inflight=0,
                           max_wait_ms=0, frontend_id=fe.frontend_id, payload=b"x")
    # The answer the frontend got, not Redis' counter: that counter is written before the
    # answer reaches the frontend, and on a loaded machine the test read the answers in
    # between (a late 'not_found' last, loaded pass 20).
    await wait_until(lambda: "cancelled" in answers, "the late cancel's answer")
    assert set(answers[:-1]) == {"not_found"} and answers[-1] == "cancelled", answers
    assert sync_redis.hget(POOL.stats, "P1.cancelled") == b"1"
    assert int(sync_redis.hget(POOL.queued, "P1") or 0) == 0 and sync_redis.hlen(POOL.tenant_inflight) == 0


async def test_a_cancel_an_outage_refused_is_sent_once_redis_answers() -> None:
    """A client that leaves while Redis is down: its cancel is refused. Only logged, it left
    the request queued once Redis was back, and a worker generated it for nobody (claim only
    cancels a frontend's requests once it stops beating, and this one beats on). Now it is
    kept and sent again at the heartbeat's first success. (A Redis of its own, on an
    append-only file written at each command: the queued request survives the restart.)"""
    server = RedisServer(extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    try:
        cfg = make_cfg(server.url, classes=CLASSES, tenants=TENANTS)
        with server.client() as sync:
            async with frontend(cfg, heartbeat_s=0.2) as c:
                fe = fe_of(c)
                task = asyncio.create_task(c.post("/v1/chat/completions", headers=auth("key-frugal"), json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}))
                await wait_until(lambda: int(sync.hget(POOL.queued, "P1") or 0) == 1, "one P1 request queued")
                server.kill()
                task.cancel()  # the client closes its connection
                await wait_until(lambda: fe.unsent_cancels, "the refused cancel kept to send again")
                assert fe.metrics.unsent_cancels._value.get() == 1
                server.start()
                await wait_until(lambda: sync.hget(POOL.stats, "P1.cancelled") == b"1",
                                 "the kept cancel to reach the restarted Redis")
                await wait_until(lambda: not fe.unsent_cancels, "the sent cancel no longer kept")
                assert fe.metrics.unsent_cancels._value.get() == 0
                assert int(sync.hget(POOL.queued, "P1") or 0) == 0 and sync.hlen(POOL.tenant_inflight) == 0
    finally:
        server.stop()


async def test_kept_cancels_are_bounded_in_number_and_in_time(client, sync_redis, monkeypatch) -> None:
    """At most UNSENT_CANCELS_MAX are kept (a long outage with many clients leaving must not
    grow the process without bound), and one kept past request_timeout_s is dropped unsent."""
    from limiter.frontend import runtime

    fe = fe_of(client)
    monkeypatch.setattr(runtime, "UNSENT_CANCELS_MAX", 2)
    for rid in ("a", "b", "c"):
        fe._keep_unsent_cancel(POOL, rid, "frugal", "client_gone", ConnectionError("down"))
    assert list(fe.unsent_cancels) == ["a", "b"]
    sent: list[str] = []

    async def recording_cancel(keys, request_id, *args):
        sent.append(request_id)
        return "not_found"

    monkeypatch.setattr(fe.scripts, "cancel", recording_cancel)
    keys, tenant_name, reason, _ = fe.unsent_cancels["a"]
    fe.unsent_cancels["a"] = (keys, tenant_name, reason, time.monotonic() - 1)  # past its time
    await fe._send_unsent_cancels(POOL)
    assert sent == ["b"] and not fe.unsent_cancels


async def test_a_kept_cancel_that_keeps_failing_leaves_the_beat_s_other_chores_done(
        client, sync_redis, monkeypatch) -> None:
    """A kept cancel whose every resend meets an outage (its shard flapping) made the beat
    skip that beat's lost-record sweep and reap: the chores now run each on its own, and the
    beat still reports the outage (the loop counts and logs it)."""
    from limiter.errors import RedisUnavailable

    fe = fe_of(client)
    q = fe.router.register("gone")  # admitted, and no record in Redis
    fe.router.admitted("gone", POOL.pool)
    await wait_until(lambda: fe.router.caught_up[POOL.pool], "the pool's reader caught up")
    fe._keep_unsent_cancel(POOL, "left", "frugal", "client_gone", ConnectionError("down"))
    reaped: list[str] = []

    async def failing_cancel(*args):
        raise RedisUnavailable("the shard is flapping")

    async def recording_reap(keys, max_calls):
        reaped.append(keys.pool)

    monkeypatch.setattr(fe.scripts, "cancel", failing_cancel)
    monkeypatch.setattr(fe.scripts, "reap_all", recording_reap)
    try:
        with pytest.raises(RedisUnavailable):
            await fe._beat(POOL, sweep=True, reap=True)
        assert reaped == [POOL.pool], "the reap was skipped"
        assert q.get_nowait().code == "lost", "the sweep was skipped"
        assert list(fe.unsent_cancels) == ["left"]  # kept for the next beat
    finally:
        fe.router.unregister("gone")


async def test_disconnect_mid_stream_stops_the_worker_and_reconciles(client, aredis, sync_redis):
    async with FakeWorker(aredis, POOL, fixed_text="y" * 200, batch=1, delay_s=0.02) as w:
        resp = await client.post("/v1/completions", headers=auth("key-frugal"), json={
            "model": "tiny", "prompt": "abc", "max_tokens": 200, "stream": True})
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        rid = resp.headers["X-QoS-Request-Id"]
        resp.close()  # drop the connection mid-stream
        await wait_until(lambda: any(s.request_id == rid for s in w.served),
                         "the worker to finish the dropped stream")
        served = await w.by_id(rid)
    assert served.outcome == "cancelled"
    assert 1 <= served.usage_out < 100  # the worker stopped long before 200 tokens
    state, refund = sync_redis.hmget(POOL.request(rid), ["state", "refund"])
    assert state == b"cancelled"
    # Charged 4 + 200; used 4 + what was generated; the rest came back.
    assert float(refund) == pytest.approx(200 - served.usage_out)
    assert sync_redis.scard(POOL.cancels) == 0 and sync_redis.zcard(POOL.leases) == 0
    assert sync_redis.hlen(POOL.tenant_inflight) == 0 and sync_redis.hlen(POOL.inflight) == 0
    level = bucket_tokens(sync_redis, POOL.tenant_bucket("frugal"))
    assert level == pytest.approx(1000 - 4 - served.usage_out, abs=2.0)


async def test_safety_timeout_cancels(redis_server, sync_redis, aredis, cfg):
    async with frontend(cfg, request_timeout_s=1.0) as client, \
            FakeWorker(aredis, POOL, fixed_text="slow", delay_s=3.0, batch=1):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
        # request_timeout (not a late answer from the 3 s worker) says the 1 s timeout fired.
        assert r.status == 503 and (await r.json())["error"]["code"] == "request_timeout"
        assert r.headers["x-should-retry"] == "false"  # a resend would run as long again
        assert time.monotonic() - t0 >= 1.0
        # the worker is told to stop
        await wait_until(lambda: sync_redis.scard(POOL.cancels) == 1, "the cancel for the timed-out request")


async def test_policy_missing_is_reinitialised(client, aredis, sync_redis):
    sync_redis.delete(POOL.policy)  # as after a Redis restart with no persistence
    async with FakeWorker(aredis, POOL):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "xy", "max_tokens": 2},
                              headers=auth())
    assert r.status == 200, await r.text()
    assert sync_redis.hget(POOL.policy, "classes") == b"P0,P1,P2"


async def test_redis_down_is_503_not_ready(sync_redis):
    from tests.support.redis_server import free_port

    cfg = make_cfg(f"redis://127.0.0.1:{free_port()}/0")
    async with frontend(cfg) as client:
        assert (await client.get("/healthz")).status == 200
        r = await client.get("/readyz")
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
        assert r.status == 503
        body = await r.json()
        assert body["error"]["code"] == "redis_unavailable" and r.headers["Retry-After"] == "1"
        # Bad input is still judged without Redis.
        r = await client.post("/v1/completions", json={"model": "tiny"}, headers=auth())
        assert r.status == 400


async def test_a_started_frontend_is_registered_with_a_measured_clock_offset(client, sync_redis):
    fe = fe_of(client)
    assert sync_redis.zscore(POOL.frontends, fe.frontend_id) is not None
    assert abs(fe.heartbeat.clock_offset_ms) < 5_000  # measured, finite (NaN fails this too)


def _refusing(sync_redis, state: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """How to put a Redis into a state where it refuses every write script, and back."""
    from tests.support.redis_server import free_port

    return {
        "maxmemory": (lambda: sync_redis.config_set("maxmemory", 1),
                      lambda: sync_redis.config_set("maxmemory", 0)),
        # a failover demoted it: a master that never answers
        "replica": (lambda: sync_redis.replicaof("127.0.0.1", free_port()),
                    lambda: sync_redis.replicaof("NO", "ONE")),
        # its replicas lagging or gone
        "min_replicas": (lambda: sync_redis.config_set("min-replicas-to-write", 1),
                         lambda: sync_redis.config_set("min-replicas-to-write", 0)),
    }[state]


@pytest.mark.parametrize("state", ["maxmemory", "replica", "min_replicas"])
async def test_redis_refusing_for_its_own_state_is_503_not_500(client, sync_redis, state):
    """Redis refuses admit.lua for its own state, not the request's: at its maxmemory
    (noeviction, as deployed; OOM), demoted by a failover (READONLY), short of its
    min-replicas-to-write (NOREPLICAS, a reply redis-py has no class for; found by a review).
    Each was a 500 internal_error, logged as a bug per request, while it is an outage that
    passes (complete/cancel may run under OOM)."""
    enter, leave = _refusing(sync_redis, state)
    enter()
    try:
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
        body = await r.json()
    finally:
        leave()
    assert r.status == 503, body
    assert body["error"]["code"] == "redis_unavailable" and r.headers["Retry-After"] == "1"
    assert int(sync_redis.hget(POOL.queued, "P1") or 0) == 0


async def test_a_disabled_class_is_429_naming_the_class(redis_server, sync_redis):
    """A class whose ceiling is 0 is closed: the answer named the bucket ("Class class is
    disabled") instead of the class."""
    cfg = make_cfg(redis_server.url, classes={"P2": {"share": 0.0, "ceil_share": 0.0, "floor": 0.0}},
                   tenants=[tenant("batch", "key-batch", "P2")])
    async with frontend(cfg) as c:
        r = await c.post("/v1/completions", json=SLOW, headers=auth("key-batch"))
        err = (await r.json())["error"]
        assert r.status == 429 and err["code"] == "rate_limit_exceeded", err
        assert err["message"].startswith("Class P2 is disabled right now"), err
        assert r.headers["Retry-After"] == "5"


async def test_a_class_the_pools_policy_lacks_is_a_503_while_configurations_differ(redis_server, scripts,
                                                                                   sync_redis):
    """A rolling deploy that adds a class: this frontend has it, the pool's policy (written by a
    role of the older configuration) does not, and admit refuses the class. That was a 400
    `invalid_value` carrying the Lua's text (the pool's class list): the client told to change
    a request that was fine. It is the server's disagreement: a 503 to retry, nothing queued;
    and the request passes once the policy has the class (any role of the new configuration
    starting writes it)."""
    import dataclasses

    from limiter.scripts import policy_document

    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as c:
        older = dataclasses.replace(cfg, classes=cfg.classes[:2])
        await scripts.init_pool(POOL, policy_document(older, older.pool("tiny")))
        r = await c.post("/v1/completions", json=SLOW, headers=auth("demo-p2"))
        err = (await r.json())["error"]
        assert r.status == 503 and err["code"] == "class_unavailable", err
        assert r.headers["Retry-After"] == "5" and "P0" not in err["message"]
        assert int(await scripts.client.hget(POOL.queued, "P2") or 0) == 0
        await scripts.init_pool(POOL, policy_document(cfg, cfg.pool("tiny")))
        waiting = asyncio.create_task(c.post("/v1/completions", json=SLOW, headers=auth("demo-p2")))
        try:  # no worker here: admitted, it waits in its queue
            await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P2") or 0) == 1,
                             "the request admitted once the policy has its class")
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


async def test_a_request_admitted_right_after_redis_lost_everything_is_not_cancelled_as_an_orphan(
        redis_server, sync_redis, aredis):
    """Redis restarted empty (FLUSHALL here): the first admit met NOPOLICY, wrote the policy
    again and was admitted, but this frontend's heartbeat entry had gone too, and until its
    next beat (heartbeat_s away) claim took it for dead: the worker cancelled the request as
    an orphan and the client of a live, ready frontend got a 503 request_cancelled (a review).
    The admit that finds the policy gone beats before it admits, as the start does."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg, heartbeat_s=2.0) as client, FakeWorker(aredis, POOL, fixed_text="abc"):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3}
        r = await client.post("/v1/completions", json=body, headers=auth())
        assert r.status == 200, await r.text()
        sync_redis.flushall()  # as a Redis restart without persistence
        r = await client.post("/v1/completions", json=body, headers=auth())
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == "abc"


async def test_a_request_admitted_after_another_role_wrote_the_lost_policy_is_not_cancelled_as_an_orphan(
        redis_server, sync_redis, aredis):
    """Redis restarted empty and another role (the controller, another frontend) wrote the
    policy again first: this frontend's admit never met NOPOLICY, so it did not beat before
    admitting, and its heartbeat entry stayed gone until its next beat (heartbeat_s away).
    claim found no entry and cancelled the request as an orphan (503 request_cancelled from a
    live, ready frontend). A request admitted within the frontend TTL counts its frontend
    alive while the frontend has no entry (lua/include/liveness.lua)."""
    cfg = make_cfg(redis_server.url, pool={"frontend_ttl_ms": 60_000})
    # (a beat 20 s away: the window stays open for the whole test)
    async with frontend(cfg, heartbeat_s=20.0) as client, FakeWorker(aredis, POOL, fixed_text="abc"):
        fe = fe_of(client)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3}
        r = await client.post("/v1/completions", json=body, headers=auth())
        assert r.status == 200, await r.text()
        sync_redis.flushall()  # as a Redis restart without persistence
        await Scripts(aredis).init_pool(POOL, policy_document(cfg, cfg.pools[0]))  # the other role
        r = await client.post("/v1/completions", json=body, headers=auth())
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == "abc"
        # the window this is about: no beat of this frontend since the flush
        assert sync_redis.zscore(POOL.frontends, fe.frontend_id) is None
