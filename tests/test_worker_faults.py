"""Worker faults found by review, each reproduced here first: a push whose reply was lost,
a cancel during a push, an outage while failing an unusable request, a model server that
breaks on one prompt, a backlog the worker cannot take, a late lease renewal, a model
server's error bodies. Each test's docstring says what went wrong before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import pytest

from limiter.errors import LeaseLost, RedisUnavailable
from limiter.scripts import Scripts
from tests.support.helpers import wait_until
from tests.support.worker_helpers import (
    drained_now,
    mark_hand_backs,
    record_calls,
    release_each_chunk_once_pushed,
    sim_text,
    start_worker,
    stop_worker,
    worker,
)


@pytest.fixture
def env(worker_env):
    return worker_env


def lose_reply_of_push(monkeypatch, rid_holder: dict, at_offset: int) -> dict:
    """The push_tokens call carrying request rid_holder['rid'] at ``at_offset`` lands in Redis,
    but its reply is lost (the connection drops after the command ran): the caller sees
    RedisUnavailable for the whole call."""
    real = Scripts.push_tokens_many
    state = {"fired": 0}

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        res = await real(self, keys, worker_id, batches, lease_ms, **kw)
        if not state["fired"] and any(b.request_id == rid_holder.get("rid") and b.offset == at_offset
                                      for b in batches):
            state["fired"] += 1
            raise RedisUnavailable("Connection reset by peer (reply lost)")
        return res

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    return state


async def test_complete_after_a_push_whose_reply_was_lost_does_not_duplicate_tokens(env, monkeypatch) -> None:
    """A push that landed but whose reply was lost keeps its tokens pending; when the very next
    call for the request is ``complete`` (the request finished on the next step), complete has no
    offset check and re-appends them: the client reads them twice (or complete fails BADARG)."""
    cfg, c = env
    holder: dict = {}
    state = lose_reply_of_push(monkeypatch, holder, at_offset=0)
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=100, flush_ms=10000):
        prompt = "abc"
        full = sim_text(prompt, 0, 40)
        # finishes by a stop string at the 3rd token: "sim" -> stop "m" cuts there
        stop = full[2]
        holder["rid"] = rid = await c.admit(prompt, max_tokens=40, stop=(stop,))
        await c.wait([rid], timeout=15)
    a = c.answers[rid]
    assert state["fired"] == 1
    expected = full[: full.index(stop)]
    assert a.done is not None, a.error
    assert a.text == expected, f"client text {a.text!r}, expected {expected!r}"
    rec = await c.record(rid)
    assert int(rec["usage_out"]) == a.tokens


async def test_a_push_after_a_lost_push_reply_takes_the_landed_tokens_as_delivered(env, monkeypatch) -> None:
    """The next *push* after a lost reply carries the landed token again: push_tokens answers
    'offset' with Redis's count, and the worker must take exactly the landed tokens as sent
    (taking the whole retried batch as sent put it one token ahead of Redis: every later push
    was refused and the request was dropped as lost)."""
    cfg, c = env
    holder: dict = {}
    state = lose_reply_of_push(monkeypatch, holder, at_offset=0)
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=1):
        holder["rid"] = rid = await c.admit("abc", max_tokens=12)
        await c.wait([rid], timeout=15)
    a = c.answers[rid]
    assert state["fired"] == 1
    assert a.done is not None and a.tokens == 12, (a, await c.record(rid))
    assert a.text == sim_text("abc", 0, 12)  # each token once, in order (Client.read checks offsets)
    rec = await c.record(rid)  # and by the one attempt: not dropped, then resumed after its lease
    assert rec["attempts"] == "1" and len(set(a.attempts)) == 1, (rec, a.attempts)


async def test_a_lost_push_reply_just_before_max_tokens_does_not_kill_the_worker(env, monkeypatch) -> None:
    """Same lost reply, but the request ends by max_tokens on the next step: complete re-sends
    the landed tokens, Redis refuses it (BADARG count > max_tokens), and InvalidArgument is not
    an outage rt.guard handles: it escapes StepLoop.run and the worker process dies, taking
    every request it held with it (they wait out their leases)."""
    cfg, c = env
    holder: dict = {}
    state = lose_reply_of_push(monkeypatch, holder, at_offset=0)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.01, flush_tokens=100, flush_ms=10000)
    try:
        holder["rid"] = rid = await c.admit("abc", max_tokens=2)
        deadline = time.monotonic() + 8
        while not c.answers[rid].finished and time.monotonic() < deadline and not task.done():
            await c.read()
        died = task.exception() if task.done() else None
        assert died is None, f"the worker died: {type(died).__name__}: {died}"
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 2, (a, await c.record(rid))
        assert state["fired"] == 1  # the reply was lost: the case this test is about happened
    finally:
        await stop_worker(rt, task)


class PoisonUpstream:
    """Wraps FakeUpstream: a prompt containing POISON makes the 'server' drop the connection
    before its first chunk (as a model server crashing on that input does); others are served."""

    @staticmethod
    async def make():
        from aiohttp import web

        from tests.support.fake_upstream import FakeUpstream

        up = FakeUpstream()
        up.poison_hits = 0
        real = up.handle

        async def handle(request):
            body = await request.json()
            prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
            if "POISON" not in prompt:
                return await real(request)
            up.poison_hits += 1
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(0.01)
            request.transport.abort()
            return resp

        up.handle = handle
        # the router captured the bound method at construction: re-register
        for route in up.runner.app.router.routes():
            if route.method == "POST" and route.resource.canonical.endswith("completions"):
                route._handler = handle
        await up.start()
        return up


async def test_a_request_that_always_breaks_the_upstream_is_not_retried_for_ever(env) -> None:
    """UpstreamDown hands the request back with release, which gives the attempt back and
    resets its queue deadline. A request whose stream always breaks the upstream (a crash on
    that input) is thus claimed, breaks the stream, trips the breaker, and is requeued at the
    head of its class -- for ever: max_attempts never bounds it and its client never hears."""
    cfg, c = env
    up = await PoisonUpstream.make()
    try:
        rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url,
                                             upstream_retry_min_s=0.05, upstream_retry_max_s=0.1)
        try:
            rid = await c.admit("POISON prompt", max_tokens=50)
            deadline = time.monotonic() + 8
            while not c.answers[rid].finished and time.monotonic() < deadline:
                await c.read()
            rec = await c.record(rid)
        finally:
            await stop_worker(rt, task)
    finally:
        await up.runner.cleanup()
    max_attempts = cfg.pool("tiny").max_attempts
    assert up.poison_hits <= max_attempts and c.answers[rid].finished, (
        f"upstream hit {up.poison_hits} times (max_attempts {max_attempts}); record state "
        f"{rec.get('state')!r}, attempts {rec.get('attempts')!r}; client finished: {c.answers[rid].finished}")


async def _queue_unusable(c) -> str:
    """Queue a request whose payload no worker can read (failed at claim); returns its id."""
    from tests.support.worker_helpers import FE

    bad = "rbad"
    await c.scripts.admit(c.keys, request_id=bad, tenant="t1", cls="P1", input_tokens=3, max_tokens=8,
                          tenant_rate=1e9, tenant_burst=1e9, tenant_max_inflight=0, max_wait_ms=0,
                          frontend_id=FE, payload=b"\xc1 not a payload")
    return bad


async def _unusable_whose_first_completion_meets_an_outage(c, monkeypatch) -> tuple[str, dict]:
    """Queue a request whose payload no worker can read; the first ``complete`` for it (the
    worker failing it at claim) meets a Redis outage. Returns its id and a counter."""
    bad = await _queue_unusable(c)
    real = Scripts.complete
    state = {"failed": 0}

    async def complete(self, keys, *, request_id, **kw):
        if request_id == bad and not state["failed"]:
            state["failed"] += 1
            raise RedisUnavailable("Connection reset by peer")
        return await real(self, keys, request_id=request_id, **kw)

    monkeypatch.setattr(Scripts, "complete", complete)
    return bad, state


async def test_an_outage_while_failing_an_unusable_request_leaves_the_rest_of_its_claim_running(
        env, monkeypatch) -> None:
    """WorkerRuntime.claim puts each claimed request in ``held`` as it goes; when an unusable
    payload's ``finish`` meets a Redis outage, claim raises, and the requests of the same claim
    already put in ``held`` are never returned to the loop: never started, not in the
    scheduler, no final -- held (their leases renewed) for ever while their clients wait."""
    cfg, c = env
    good = await c.admit("a good request", max_tokens=8)
    bad, state = await _unusable_whose_first_completion_meets_an_outage(c, monkeypatch)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.01)
    try:
        deadline = time.monotonic() + 8
        while not c.answers[good].finished and time.monotonic() < deadline and not task.done():
            await c.read()
        rec = await c.record(good)
        held = sorted(rt.held)
    finally:
        await stop_worker(rt, task)
    assert state["failed"] == 1
    assert (await c.record(bad))["state"] == "failed"
    assert c.answers[good].finished, (f"{good} never finished: record state {rec['state']!r}, "
                                      f"worker holds {held}")


async def test_openai_a_decided_answer_being_landed_is_not_interrupted_by_its_clients_cancel(
        env, monkeypatch, fake_upstream) -> None:
    """A decided answer held without a stream (an unusable payload failed at claim, its
    completion meeting an outage) is landed by a task of its own. The cancel watcher, seeing its
    client's cancel, interrupted that task: the next look made it again, and the interrupt's
    reason was never forgotten (left in ``why`` for good: a later attempt of the id could not
    be interrupted). The answer stands; the task is not interrupted and leaves nothing behind."""
    from worker.runtime import WorkerRuntime

    cfg, c = env
    up = fake_upstream
    bad = await _queue_unusable(c)
    real_complete, real_cancelled = Scripts.complete, WorkerRuntime.cancelled
    seen = {"cancel_seen": False, "refused": 0}

    async def cancelled(self, ids):
        out = await real_cancelled(self, ids)
        seen["cancel_seen"] = seen["cancel_seen"] or bad in out
        return out

    async def complete(self, keys, *, request_id, **kw):
        if request_id == bad and not seen["cancel_seen"]:  # refused until the watcher saw the cancel
            if not seen["refused"]:
                assert await c.scripts.cancel(c.keys, bad, "t1") == "cancelling"
            seen["refused"] += 1
            raise RedisUnavailable("Connection reset by peer")
        return await real_complete(self, keys, request_id=request_id, **kw)

    monkeypatch.setattr(WorkerRuntime, "cancelled", cancelled)
    monkeypatch.setattr(Scripts, "complete", complete)
    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url)
    real_settle, settles = loop._settle, []

    def settle(d):
        settles.append(d.request_id)
        return real_settle(d)

    loop._settle = settle
    try:
        await wait_until(lambda: seen["cancel_seen"] and bad not in rt.held and bad not in loop.tasks,
                         "the cancel seen by the watcher, then the answer landed")
        why = dict(loop.why)
    finally:
        await stop_worker(rt, task)
    assert (await c.record(bad))["state"] == "failed"
    assert settles == [bad], f"the answer's task was made {len(settles)} times: interrupted"
    assert bad not in why, f"an interrupt's reason left behind: {why}"


async def test_openai_a_decided_answer_being_landed_at_the_drain_deadline_is_handed_back_as_one(
        env, monkeypatch, fake_upstream) -> None:
    """At the drain's deadline the task landing a decided answer outside a stream (an unusable
    payload's failure meeting an outage) was cancelled like a stream, and the worker exited
    holding the answer: requeued at its lease's end and answered again. It ends as any
    hand-back of a decided answer does: retried, for a bounded time (hand_back_limit_s)."""

    cfg, c = env
    up = fake_upstream
    bad = await _queue_unusable(c)
    handing_back = mark_hand_backs(monkeypatch)
    real_complete = Scripts.complete
    tries: list[bool] = []  # whether each try was the hand-back's

    async def complete(self, keys, **kw):
        tries.append(handing_back.get())
        if tries.count(True) < 2:  # refused until the hand-back's second try
            raise RedisUnavailable("Connection reset by peer")
        return await real_complete(self, keys, **kw)

    monkeypatch.setattr(Scripts, "complete", complete)
    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, drain_timeout_s=60)
    try:
        await wait_until(lambda: bad in loop.tasks and tries, "the answer's task retrying it")
        await drained_now(rt, task)
    finally:
        await stop_worker(rt, task)
    assert tries.count(True) == 2, tries
    assert (await c.record(bad))["state"] == "failed"


async def test_openai_a_drain_deadline_falling_as_a_decided_answers_task_is_made_does_not_spin(
        env, monkeypatch, fake_upstream) -> None:
    """The drain loop made the task landing a decided answer, then read the deadline again to
    interrupt its tasks: a deadline falling between the two reads cancelled the new task before
    its first step, so its body (and its finally) never ran. It stayed in the loop's tasks,
    done, and the drain spun at 100 % CPU, the answer held (found by a review). Here the
    deadline falls just after the task is made."""

    cfg, c = env
    up = fake_upstream
    bad = await _queue_unusable(c)
    handing_back = mark_hand_backs(monkeypatch)
    real_complete = Scripts.complete

    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, drain_timeout_s=60)
    real_settle_decided = loop._settle_decided

    async def complete(self, keys, **kw):
        if not rt.draining.is_set():
            rt.begin_drain("test")  # failing the unusable request at claim: drained then
        if handing_back.get():
            return await real_complete(self, keys, **kw)
        raise RedisUnavailable("Connection reset by peer")  # until the hand-back's

    def settle_decided() -> None:
        real_settle_decided()
        if rt.draining.is_set() and bad in loop.tasks:
            rt.drain_deadline = time.monotonic()  # just after the task was made

    monkeypatch.setattr(Scripts, "complete", complete)
    loop._settle_decided = settle_decided
    try:
        assert await asyncio.wait_for(task, 30) == 0
    finally:
        await stop_worker(rt, task)
    assert (await c.record(bad))["state"] == "failed"


async def test_openai_a_decided_answer_redis_refuses_is_given_up_not_tried_for_ever(
        env, monkeypatch, fake_upstream) -> None:
    """The task landing a decided answer died on an error that is not an outage (Redis refusing
    an argument of the worker's own), the answer still held: the next look made it again, to
    fail again, each time an unread task exception (found by a review). It is logged and the
    request left to its lease (after one plain failure, refused too here)."""
    from limiter.errors import InvalidArgument

    cfg, c = env
    up = fake_upstream
    bad = await _queue_unusable(c)
    calls: list[str] = []
    real = Scripts.complete

    async def complete(self, keys, *, request_id, **kw):
        calls.append(request_id)
        if request_id != bad:
            return await real(self, keys, request_id=request_id, **kw)
        if len(calls) == 1:
            raise RedisUnavailable("Connection reset by peer")  # failing it at claim: held, decided
        raise InvalidArgument("outcome", "refused")

    monkeypatch.setattr(Scripts, "complete", complete)
    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url)
    try:
        await wait_until(lambda: len(calls) >= 2 and bad not in rt.held and bad not in loop.tasks,
                         "the refused answer given up")
        await c.admit("another request, served after it", max_tokens=4)
        await wait_until(lambda: len(rt.held) == 0 and len(calls) >= 3, "the next request served")
    finally:
        await stop_worker(rt, task)
    # the outage's try, the refused one, and once more as a plain failure (no sample, fixed
    # arguments: WorkerRuntime._fail_unfinishable), refused too here, then given up
    assert calls.count(bad) == 3, f"the refused answer's completion was tried {calls.count(bad)} times"


async def test_openai_worker_retries_a_completion_that_met_an_outage_outside_a_stream(
        env, monkeypatch, fake_upstream) -> None:
    """The openai loop retries completions only inside a stream's task (_finish). A request
    failed by WorkerRuntime.fail_unusable at claim time has no task: when its complete meets a
    Redis outage it stays in ``held`` with its final set and nothing retries it. With
    max_inflight 1 the worker then has no room and no task: ``asyncio.wait([])`` raises
    ValueError out of _pull and the worker process dies."""

    cfg, c = env
    up = fake_upstream
    bad, state = await _unusable_whose_first_completion_meets_an_outage(c, monkeypatch)
    rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, max_inflight=1)
    try:
        good = await c.admit("served after it", max_tokens=8)
        deadline = time.monotonic() + 6
        while not c.answers[good].finished and time.monotonic() < deadline and not task.done():
            await c.read()
        died = task.exception() if task.done() else None
        rec = await c.record(bad)
    finally:
        await stop_worker(rt, task)
    assert state["failed"] == 1
    assert died is None, f"the worker died: {type(died).__name__}: {died}"
    assert rec["state"] == "failed" and c.answers[good].finished, (rec["state"], c.answers[good])


async def test_openai_cancel_arriving_during_a_push_does_not_strand_the_request(
        env, monkeypatch, fake_upstream) -> None:
    """The cancel watcher cancels the stream's task wherever it is -- also inside
    ``rt.push``, after push_tokens ran in Redis but before its reply was read. _serve then
    completes with those tokens still pending: complete has no offset check, so it adds them
    again (usage over-counted) and, on the last token, Redis refuses (count > max_tokens):
    InvalidArgument escapes _serve's CancelledError handler, the task ends, and the request stays
    in ``held`` for ever (renewed, never finished, one max_inflight slot gone).

    Since the pushes of a turn share a call (worker/push_merge.py), a cancel does not stop
    the call, and the race moved: the cancelled task sent complete at once, offset-checked
    against the offset before the push; the push's reply was then applied (offset 5), and
    complete's offset error found Redis's 5 tokens "already sent": LeaseLost, the request
    dropped, its record leased until the lease ran out. Here the push's reply waits for
    complete to be sent (2 s at most: a worker that waits for the reply never sends it), and
    complete's call for that reply to be applied."""
    from worker.delivery import Delivery

    cfg, c = env
    up = fake_upstream
    holder: dict = {}
    real = Scripts.push_tokens_many
    landed, complete_sent, settled = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def push_tokens_many(self, keys, worker_id, batches, *args, **kw):
        res = await real(self, keys, worker_id, batches, *args, **kw)
        if any(b.request_id == holder.get("rid") and b.offset == 4 for b in batches):
            landed.set()  # a slow reply: the cancel watcher (every flush_ms) fires meanwhile
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(complete_sent.wait(), 2.0)
        return res

    real_settle = Delivery.settle

    def settle(self, b, reply):
        try:
            return real_settle(self, b, reply)
        finally:
            if b.request_id == holder.get("rid") and b.offset == 4:
                settled.set()

    real_complete = Scripts.complete
    refused: list[str] = []

    async def complete(self, keys, **kw):
        if kw.get("request_id") == holder.get("rid"):
            complete_sent.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settled.wait(), 2.0)
        try:
            return await real_complete(self, keys, **kw)
        except Exception as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
            raise

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    monkeypatch.setattr(Delivery, "settle", settle)
    monkeypatch.setattr(Scripts, "complete", complete)
    up.gate = asyncio.Semaphore(0)  # the chunks come apart: a push each, the fifth at offset 4
    try:
        rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, max_inflight=2)
        try:
            holder["rid"] = rid = await c.admit("abcdefghij" * 3, max_tokens=5)
            await release_each_chunk_once_pushed(c, up, rid, chunks=4)
            await asyncio.wait_for(landed.wait(), 10)
            assert await c.scripts.cancel(c.keys, rid, "t1") == "cancelling"
            deadline = time.monotonic() + 10
            while (await c.record(rid))["state"] == "leased" and rid in rt.held:  # or dropped, stranded
                assert time.monotonic() < deadline, "waiting for the cancelled request to end"
                await asyncio.sleep(0.05)
            rec = await c.record(rid)
            held = sorted(rt.held)
        finally:
            await stop_worker(rt, task)
    finally:
        up.gate.release()  # the finish chunk: the handler finds the stream the cancel closed
    assert rec["state"] == "cancelled" and not held, (
        f"record {rec['state']!r}, worker still holds {held}; complete refused: {refused}")
    assert int(rec["usage_out"]) == 5


async def _json_error_upstream(status: int, body: dict):
    """An upstream whose completions answer ``status`` with a JSON ``body`` (no 'error' key)."""
    from aiohttp import web

    from tests.support.redis_server import free_port

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def completions(request):
        await request.read()
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _error_read_from(env: Any, status: int, body: dict[str, Any]) -> str:
    """The error message a request's client reads when the model server answers ``status``
    with ``body``."""
    cfg, c = env
    runner, url = await _json_error_upstream(status, body)
    try:
        rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=url)
        try:
            rid = await c.admit("some prompt", max_tokens=8)
            await c.wait([rid], timeout=10)
        finally:
            await stop_worker(rt, task)
    finally:
        await runner.cleanup()
    return c.answers[rid].error["msg"]


@pytest.mark.parametrize("body", [
    # vLLM's ErrorResponse before it was wrapped in {"error": ...} (vLLM <= 0.9)
    {"object": "error", "message": "This model's maximum context length is 2048 tokens.",
     "type": "BadRequestError", "param": None, "code": 400},
    # FastAPI's own validation error (what vLLM answers for a field it rejects)
    {"detail": [{"loc": ["body", "top_p"], "msg": "Input should be less than or equal to 1"}]},
])
async def test_an_upstream_json_error_without_an_error_key_reaches_the_client_as_its_text(env, body) -> None:
    """_error_text takes json.loads(body).get('error'); when the JSON has no 'error' key it
    returns str(None): the client reads '... (HTTP 400): None' instead of the server's reason."""
    msg = await _error_read_from(env, 400, body)
    assert not msg.endswith(": None"), msg


async def test_a_long_upstream_json_error_reaches_the_client_as_its_message(env) -> None:
    """The error body was cut to its first 500 characters before it was parsed: a longer JSON
    error (a validation error listing its fields, say) failed to parse and the client read the
    reason phrase, "Bad Request" (found by a review of the openai worker)."""
    message = "Input validation failed: " + "field x out of range; " * 40  # ~900 characters
    msg = await _error_read_from(env, 400, {"error": {"message": message, "code": 400}})
    assert msg.startswith("the model server refused the request (HTTP 400): Input validation failed: "), msg


@pytest.mark.parametrize("engine", ["sim", "openai"])  # sim: the step loop, as a control (passes)
async def test_openai_worker_does_not_spin_on_a_backlog_it_cannot_take(
        redis_server, sync_redis, tmp_path, monkeypatch, engine, fake_upstream) -> None:
    """A class held by its ceiling stays queued; claim then announces it again on the wake list
    (backlog = 1). The step loop backs off for that (claim_interval_ms, doubling); the openai
    loop does not: _pull claims, finds nothing, BLPOPs the marker claim itself just pushed,
    and claims again at once -- a hot loop of Lua claims against Redis for as long as the
    ceiling binds, from every openai worker."""
    import redis.asyncio as aioredis

    from limiter.config import load as load_config
    from limiter.localstack.toml_writer import write_toml
    from tests.support.helpers import three_classes
    from tests.support.worker_helpers import Client

    path = write_toml({
        "redis": {"url": redis_server.url},
        "classes": three_classes(P2={"ceil_share": 0.1, "floor": 0.0, "max_wait_ms": 600_000}),
        "pools": [{"name": "tiny", "lease_ms": 10000, "max_attempts": 5, "capacity_tokens_s": 1000}],
        "worker": {},
    }, tmp_path / "qos.toml")
    cfg = load_config(path, env={})
    r = aioredis.from_url(redis_server.url)
    c = Client(r, cfg)
    await c.setup()
    up = fake_upstream
    real = Scripts.claim
    calls = {"n": 0}

    async def claim(self, *a, **kw):
        calls["n"] += 1
        return await real(self, *a, **kw)

    monkeypatch.setattr(Scripts, "claim", claim)
    try:
        for i in range(30):  # ~50 tokens each against a 100 tokens/s ceiling (burst 50)
            await c.admit(f"w{i} " + "x" * 20, cls="P2", max_tokens=10)
        extra = {"upstream_url": up.url, "max_inflight": 8} if engine == "openai" else {"time_scale": 0.01}
        rt, _loop, task = await start_worker(cfg, engine=engine, **extra)
        try:
            await asyncio.sleep(1.0)
            t0, n0 = time.monotonic(), calls["n"]
            await asyncio.sleep(2.0)
            rate = (calls["n"] - n0) / (time.monotonic() - t0)
        finally:
            await stop_worker(rt, task)
    finally:
        await r.aclose()
    # the step loop's back-off allows at most one claim per claim_interval_ms (20 ms): 50/s
    assert rate <= 100, f"{rate:.0f} claims/s while the ceiling holds the backlog"


async def test_a_late_renew_reply_about_an_old_attempt_does_not_drop_the_new_one(env, monkeypatch) -> None:
    """The worker's lease on R lapses (as after a Redis outage longer than a lease) and R is
    requeued; the worker claims R back (a new fence). A renew_leases call that asked about the
    old fence answers 'lost' only after that: WorkerRuntime.renew passes bare ids to on_lost,
    StepLoop._apply_signals then removes the *new* attempt from the scheduler and drops it from
    ``held`` (its lease in Redis is kept by nobody) -- R stalls a whole lease and burns an
    attempt. (_send checks the Delivery's identity for this; renew does not.)"""
    cfg, c = env
    rt_box: dict = {}
    real = Scripts.renew_leases
    state = {"stale_replies": 0}

    async def renew_leases(self, keys, worker_id, held, lease_ms=0):
        rt = rt_box.get("rt")
        rid = rt_box.get("rid")
        mine = dict(held)
        if rt is None or rid not in mine or state["stale_replies"]:
            return await real(self, keys, worker_id, held, lease_ms)
        old = mine[rid]
        # the lease lapses and a reaper requeues R just as this renew is sent
        await real(self, keys, worker_id, [], lease_ms)
        assert await self.release(keys, request_id=rid, worker_id=worker_id, fence=old) == "requeued"
        res = await real(self, keys, worker_id, held, lease_ms)
        assert rid in res.lost
        deadline = time.monotonic() + 5
        while not (rid in rt.held and rt.held[rid].fence != old) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # the reply is slow: meanwhile the loop claims R back
        state["stale_replies"] += 1
        state["new_fence"] = rt.held[rid].fence if rid in rt.held else None
        return res

    monkeypatch.setattr(Scripts, "renew_leases", renew_leases)
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.01, lease_ms=1500)
    signals_applied: list[None] = []  # one entry per _apply_signals call ended
    apply_signals = loop._apply_signals

    async def counted_apply_signals() -> None:
        await apply_signals()
        signals_applied.append(None)

    monkeypatch.setattr(loop, "_apply_signals", counted_apply_signals)
    try:
        rid = await c.admit("a long stream", max_tokens=100000)
        await c.wait_tokens(rid, 1)
        rt_box.update(rt=rt, rid=rid)
        deadline = time.monotonic() + 5
        while not state["stale_replies"] and time.monotonic() < deadline:
            await c.read()
        assert state["stale_replies"] == 1 and state["new_fence"] is not None, state
        # the renew passed on its news as it returned (no await after it): two whole loop
        # iterations from now have applied it (each begins with _apply_signals)
        applied = len(signals_applied)
        await wait_until(lambda: len(signals_applied) >= applied + 2,
                         "two loop iterations to apply the renew's news")
        held = rid in rt.held and rt.held[rid].fence == state["new_fence"]
        running = rid in loop.sched
    finally:
        await stop_worker(rt, task)
    assert held and running, (f"the new attempt (fence {state['new_fence']}) was dropped: held {held}, "
                              f"running {running}")


class _LandingScripts:
    """push_tokens/complete as Redis checks them (offsets in model tokens), keeping the text
    that landed; the first push lands but its reply is lost."""

    def __init__(self) -> None:
        self.client = self
        self.tokens, self.text, self.lost_once = 0, "", True

    async def push_tokens(self, keys, *, offset, text, count, **_kw):
        from limiter.errors import InvalidArgument, RedisUnavailable

        if offset != self.tokens:
            raise InvalidArgument("offset", f"offset: {offset} but {self.tokens} tokens were delivered")
        self.tokens, self.text = self.tokens + count, self.text + text
        if self.lost_once:
            self.lost_once = False
            raise RedisUnavailable("Connection reset by peer (reply lost)")
        return False

    async def complete(self, keys, *, offset, text, count, **_kw):
        from limiter.errors import InvalidArgument

        if offset != self.tokens:
            raise InvalidArgument("offset", f"offset: {offset} but {self.tokens} tokens were delivered")
        self.tokens, self.text = self.tokens + count, self.text + text
        return 0.0

    async def hget(self, _key, _field):
        return str(self.tokens).encode()


async def test_reconcile_does_not_drop_text_that_never_landed_when_two_pushes_carry_one_token_count() -> None:
    """Delivery._uncertain is keyed by the pushed token count. On the openai path text may come
    with no new token (upstream usage not advanced: ``new = running - counted`` = 0), so a
    second push can carry the same count as the one whose reply was lost: it overwrites that
    entry with its own (longer) ids/text, and the reconcile marks all of it delivered --
    "cd" below never reaches Redis or the client, and complete sends nothing for it."""
    from limiter.errors import RedisUnavailable
    from limiter.keys import PoolKeys
    from limiter.prompt import Payload
    from limiter.scripts import Claimed
    from worker.delivery import Delivery

    c = Claimed("r1", "P1", "t1", 1, b"", 0, 5, 100, "fe1", 0, [], 0, 0)
    d = Delivery(c, Payload("completion", "hi", 100), 1000, 0.0, 3, 1)
    fake, keys = _LandingScripts(), PoolKeys("tiny")
    d.add(list(b"ab"), "ab", 0.0, tokens=1)
    with pytest.raises(RedisUnavailable):
        await d.push(fake, keys, "w")  # landed; reply lost ("ab", 1 token)
    d.add(list(b"cd"), "cd", 0.0, tokens=0)  # a chunk whose running usage did not move
    assert d.due(0.0, 50, 16)  # the attempt's first push has not succeeded yet: due at once
    await d.push(fake, keys, "w")
    await d.complete(fake, keys, "w", outcome="ok", finish_reason="stop")  # type: ignore[arg-type]
    assert fake.text == "abcd", f"Redis (and the client) got {fake.text!r}"


async def test_openai_a_stale_attempts_lease_lost_does_not_drop_the_new_attempt(
        env, monkeypatch, fake_upstream) -> None:
    """The case efda348 fixed for renew (an old attempt's news dropping the new attempt of
    the same request, claimed back by this worker after its lease lapsed) on the openai path:
    the old stream's next push gets LeaseLost, and _serve's handler calls rt.drop(rid) -- by
    id, so it drops the *new* attempt from ``held`` (its lease then renewed by nobody) and its
    finally pops the new task from ``tasks`` (no cancel, no drain wait reaches it)."""

    cfg, c = env
    up = fake_upstream
    box: dict = {}
    real = Scripts.push_tokens_many

    async def push_tokens_many(self, keys, worker_id, batches, *args, **kw):
        rt = box.get("rt")
        for b in batches:
            if rt is not None and b.request_id == box.get("rid") and b.offset >= 3 and "old_fence" not in box:
                # the lease lapsed (a Redis outage longer than lease_ms): a reaper requeues it ...
                box["old_fence"] = b.fence
                box["old_task"] = box["loop"].tasks.get(b.request_id)  # the old attempt's stream
                released = await self.release(keys, request_id=b.request_id, worker_id=worker_id,
                                              fence=b.fence)
                assert released == "requeued"
                deadline = time.monotonic() + 5
                while not (b.request_id in rt.held and rt.held[b.request_id].fence != b.fence) \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)  # ... and this worker claims it back meanwhile
                try:
                    return await real(self, keys, worker_id, batches, *args, **kw)
                finally:
                    box["old_push_ended"] = True
        return await real(self, keys, worker_id, batches, *args, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, max_inflight=2,
                                         flush_tokens=1)
    box.update(rt=rt, loop=_loop)
    try:
        box["rid"] = rid = await c.admit("SLOW " + "abcdefghij" * 12, max_tokens=30)
        deadline = time.monotonic() + 8
        while not ("old_fence" in box and rid in rt.held and rt.held[rid].fence != box["old_fence"]):
            assert time.monotonic() < deadline, f"no new attempt of {rid} held in 8 s: {box}"
            await c.read()
        box["new_fence"] = rt.held[rid].fence
        # the old stream's push has had its LeaseLost, and the old attempt's task has ended
        await wait_until(lambda: box.get("old_push_ended"), "the old attempt's push to end")
        old_task = box["old_task"]
        assert old_task is not None and old_task is not _loop.tasks.get(rid)
        await wait_until(old_task.done, "the old attempt's stream task to end")
        held = rid in rt.held and rt.held[rid].fence == box["new_fence"]
        tracked = rid in _loop.tasks
        # The run above ends the old stream through the re-claim's cancel, before its push
        # meets LeaseLost (a review: with the LeaseLost handler dropping by id, it passed).
        # That handler itself: an old attempt whose stream ends in LeaseLost drops only itself.
        new = rt.held.get(rid)
        if new is not None:
            stale = dataclasses.replace(new, claimed=dataclasses.replace(new.claimed,
                                                                         fence=box["old_fence"]))

            async def lost(d: object) -> tuple[str, str, str]:
                raise LeaseLost(f"{rid}: the lease went to fence {box['new_fence']}")

            monkeypatch.setattr(_loop, "_stream", lost)
            await _loop._serve(stale)
            held = held and rt.held.get(rid) is new
    finally:
        await stop_worker(rt, task)
    assert held and tracked, (f"the new attempt (fence {box['new_fence']}) was dropped by the old one's "
                              f"LeaseLost: held {held}, task tracked {tracked}")


async def test_openai_an_old_attempts_completion_does_not_spin_while_a_new_attempt_runs(
        env, monkeypatch, fake_upstream) -> None:
    """UpstreamLoop._finish retries ``while d.request_id in self.rt.held``: by id. When the old
    attempt's complete meets LeaseLost while this worker holds a *new* attempt of the same
    request (claimed back after its lease lapsed), rt.finish returns quietly (it drops only
    its own Delivery) and the loop calls complete again at once, and again, for as long as the
    new attempt runs: a hot loop of Lua calls (the same id test efda348's renew fix is about).

    The re-claim also cancels the old attempt's task, which ends its completion before any
    retry: alone, that hid a _finish that loops by id (this test passed with it). The old
    call here swallows that cancellation, as redis-py can in a read (tests/test_tasks.py), so
    _finish's own check is what must stop the retries."""

    cfg, c = env
    up = fake_upstream
    box: dict = {"old_calls": 0}
    real = Scripts.complete

    async def complete(self, keys, *, request_id, worker_id, fence, **kw):
        rt = box.get("rt")
        if rt is not None and request_id == box.get("rid"):
            if "old" not in box:
                box["old"], box["t0"] = fence, time.monotonic()
                # its lease lapsed meanwhile (an outage): requeued, and this worker claims it back
                released = await self.release(keys, request_id=request_id, worker_id=worker_id, fence=fence)
                assert released == "requeued"
                deadline = time.monotonic() + 15
                while not (request_id in rt.held and rt.held[request_id].fence != fence) \
                        and time.monotonic() < deadline:
                    try:
                        await asyncio.sleep(0.005)
                    except asyncio.CancelledError:  # the re-claim's cancel, lost in the read
                        box["cancel_swallowed"] = True
                box["new_held"] = request_id in rt.held and rt.held[request_id].fence != fence
            if fence == box["old"]:
                box["old_calls"] += 1
        return await real(self, keys, request_id=request_id, worker_id=worker_id, fence=fence, **kw)

    monkeypatch.setattr(Scripts, "complete", complete)
    rt, _loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, max_inflight=2,
                                         flush_tokens=1000, flush_ms=10000)
    box["rt"] = rt
    try:
        # the old attempt ends by "stop" short of max_tokens; the new one resumes (prompt + the
        # text delivered before: a longer answer from the fake upstream) and runs ~1-2 s
        box["rid"] = await c.admit("SLOW " + "abcdefghij" * 6, max_tokens=200)
        deadline = time.monotonic() + 30
        while "new_held" not in box:  # the old attempt's complete met the new attempt held
            assert time.monotonic() < deadline, f"the old attempt's completion did not come: {box}"
            await c.read()
        assert box["new_held"], f"no new attempt held while the old one's complete ran: {box}"
        await asyncio.sleep(0.5)
        calls, spent = box["old_calls"], time.monotonic() - box["t0"]
    finally:
        await stop_worker(rt, task)
    assert calls <= 3, f"{calls} complete calls for the old attempt in {spent:.2f} s"


async def test_openai_cancel_arriving_while_a_broken_stream_is_handed_back_does_not_strand_it(
        env, monkeypatch, fake_upstream) -> None:
    """The upstream breaks off mid-stream: _serve's UpstreamDown handler hands the request back
    (push + release). A cancel the watcher delivered meanwhile raised CancelledError inside that
    handler, out of _serve, before rt.drop: the request stayed in ``held`` with no task, its
    lease renewed for ever (renew's 'stop' found no task to tell), never finished, one
    max_inflight slot gone. The watcher no longer interrupts a hand-back (its release applies
    the cancel: test_worker_openai.py); what still may (the loop ending, a hopeless drain)
    is played here by cancelling the task."""

    cfg, c = env
    up = fake_upstream
    real = Scripts.release
    entered, gate = asyncio.Event(), asyncio.Event()

    async def release(self, keys, **kw):
        entered.set()
        await gate.wait()  # a slow hand-back (a busy Redis, a connection to wait for)
        return await real(self, keys, **kw)

    monkeypatch.setattr(Scripts, "release", release)
    rt, loop, task = await start_worker(cfg, engine="openai", upstream_url=up.url, flush_tokens=1,
                                        lease_ms=1000, upstream_retry_min_s=30, upstream_retry_max_s=30)
    try:
        rid = await c.admit("SLOW " + "abcdefghij" * 30, max_tokens=500)
        await c.wait_tokens(rid, 3)
        await up.kill()
        await asyncio.wait_for(entered.wait(), 10)
        assert await c.scripts.cancel(c.keys, rid, "t1") == "cancelling"
        loop.tasks[rid].cancel()  # an interrupt during the hand-back
        deadline = time.monotonic() + 10
        while rid in loop.tasks:
            assert time.monotonic() < deadline, "the interrupted task to end"
            await asyncio.sleep(0.02)
        gate.set()
        while (rec := await c.record(rid))["state"] != "cancelled":
            assert time.monotonic() < deadline, (
                f"record {rec['state']!r}; worker holds {sorted(rt.held)}, tasks {sorted(loop.tasks)}")
            await c.scripts.reap(c.keys)  # once the lease lapses, the janitor ends it
            await asyncio.sleep(0.05)
        assert rid not in rt.held
    finally:
        gate.set()
        await stop_worker(rt, task)


async def test_a_failed_completion_is_retried_while_other_requests_keep_the_batch_stepping(
        env, monkeypatch) -> None:
    """StepLoop._retry_finals ran only when no step's calls were in flight at the top of an
    iteration; but every step leaves its calls in flight (a fresh task that has not run yet),
    so while any request keeps the batch stepping a completion that met an outage outside a
    step's own calls (an unusable payload failed at claim) was never retried: its client
    waited until the batch emptied -- for ever under steady load."""
    cfg, c = env
    good = await c.admit("a long stream", max_tokens=100000)
    bad, state = await _unusable_whose_first_completion_meets_an_outage(c, monkeypatch)
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.05)
    try:
        deadline = time.monotonic() + 10
        while state["failed"] == 0 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.01)
        assert state["failed"] == 1, "the worker never claimed the unusable request"
        deadline = time.monotonic() + 10
        while (await c.record(bad)).get("state") != "failed" and time.monotonic() < deadline \
                and not task.done():
            await asyncio.sleep(0.05)
        bad_state = (await c.record(bad)).get("state")
        good_running = good in loop.sched
    finally:
        await stop_worker(rt, task)
    assert good_running, "the long request stopped running: the test proves nothing"
    assert bad_state == "failed", (f"{bad}'s completion was never retried while {good} ran: "
                                   f"record state {bad_state!r}")


@pytest.mark.parametrize("where", ["push", "complete"])
async def test_tokens_redis_refuses_for_one_request_fail_that_request_not_the_worker(
        env, monkeypatch, where) -> None:
    """A batch past the max_tokens Redis holds for one request (the worker believed more: here
    the record is lowered just after the claim) was a BADARG for the whole ``push_tokens``
    call -- nothing delivered for any request of the step -- and its InvalidArgument, no outage
    rt.guard handles, escaped StepLoop.run: the worker process died and every request it held
    waited out its lease. A completion whose last tokens Redis refused did the same."""
    cfg, c = env
    other = await c.admit("the other request", max_tokens=60)
    bad = await c.admit("one past its max_tokens", max_tokens=60)
    real = Scripts.claim

    async def claim(self, keys, *args, **kw):
        res = await real(self, keys, *args, **kw)
        if any(r.request_id == bad for r in res.requests):  # the worker believes 60
            await self.client.hset(keys.request(bad), "max_tokens", 10)
        return res

    monkeypatch.setattr(Scripts, "claim", claim)
    # push: every token is pushed at once (the push at offset 10 is refused); complete: the
    # first token is pushed, the rest rides on complete (60 tokens, refused)
    flush = {"flush_tokens": 1} if where == "push" else {"flush_tokens": 100000, "flush_ms": 10000}
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.05, max_seqs=4, **flush)
    try:
        deadline = time.monotonic() + 30
        while not (c.answers[bad].finished and c.answers[other].finished) and not task.done():
            assert time.monotonic() < deadline, (c.answers, await c.record(bad))
            await c.read()
        died = task.exception() if task.done() else None
        assert died is None, f"the worker died: {type(died).__name__}: {died}"
        rec = await c.record(bad)
        assert rec["state"] == "failed" and "max_tokens" in rec["reason"], rec
        assert c.answers[bad].error is not None and "max_tokens" in c.answers[bad].error["msg"]
        # what was delivered stays delivered: up to the refused batch (a push of one token at
        # a time on an idle machine, 10; on a busy one a push carries what several steps made,
        # and the refused one may start below 10 -- a loaded pass saw 9), or the first token
        delivered = int(rec["out_tokens"])
        assert c.answers[bad].tokens == delivered
        assert (1 <= delivered <= 10) if where == "push" else delivered == 1, delivered
        a = c.answers[other]
        assert a.done is not None and a.tokens == 60 and a.text == sim_text("the other request", 0, 60)
        # the worker goes on serving
        again = await c.admit("served after", max_tokens=8)
        await c.wait([again], timeout=30)
        assert c.answers[again].done is not None and c.answers[again].tokens == 8
    finally:
        stopped = await stop_worker(rt, task)
    assert stopped is None, f"the worker ended with {stopped!r}"


async def test_a_hopeless_drain_leaves_none_of_the_last_steps_calls_behind(env, monkeypatch, caplog) -> None:
    """Draining with Redis out of reach for a whole lease (rt.drain_hopeless), StepLoop.run
    returned at once, leaving the last step's calls (the task the step just before had
    created) unawaited: stuck on the unreachable Redis, it was still pending after the worker
    had closed ("Task was destroyed but it is pending" at exit); failing (a refused
    connection), its exception was never retrieved. Here Redis answers no heartbeat, and a
    push made once the drain is hopeless hangs as a call to a host that does not answer.
    The step task cancelled before it first ran also left the push coroutine it was handed
    never awaited (pyproject's filterwarnings makes that warning a failure)."""
    from worker.runtime import WorkerRuntime

    cfg, c = env
    state: dict = {"gone": False}
    real_beat, real_push = WorkerRuntime.heartbeat, Scripts.push_tokens_many

    async def heartbeat(self):
        if state["gone"]:
            raise RedisUnavailable("Redis out of reach (test)")
        return await real_beat(self)

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        if state["gone"] and state["rt"].drain_hopeless:
            await asyncio.sleep(5)  # until redis-py's socket timeout
            raise RedisUnavailable("Redis out of reach (test)")
        return await real_push(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(WorkerRuntime, "heartbeat", heartbeat)
    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    ios: list[asyncio.Task] = []  # every step's calls
    real_create = asyncio.create_task

    def create_task(coro, **kw):
        t = real_create(coro, **kw)
        if t.get_name() == "step-io":
            ios.append(t)
        return t

    monkeypatch.setattr(asyncio, "create_task", create_task)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, flush_tokens=1, heartbeat_s=0.1,
                                         lease_ms=1000, drain_timeout_s=120)
    state["rt"] = rt
    try:
        rid = await c.admit("a long answer", max_tokens=100000)
        await c.wait_tokens(rid, 3)
        state["gone"] = True
        rt.begin_drain("SIGTERM (Redis gone)")
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done, "the hopeless drain did not end"
        assert task.result() == 0
        assert "Redis out of reach for a whole lease" in caplog.text  # the hopeless path, not the deadline
        left = [t for t in ios if not t.done()]
        assert not left, f"the worker exited with its last step's calls still pending: {left}"
    finally:
        if not task.done():
            rt.drain_deadline = time.monotonic()
            await asyncio.wait({task}, timeout=30)
        for t in ios:
            t.cancel()


async def test_a_request_the_worker_cannot_start_fails_without_the_exception_text(env, monkeypatch) -> None:
    """A claimed request whose start raised was failed with ``could not start: <type>: <text>``,
    and that text reached the client in its error (exception text can name hosts and paths);
    the client reads a plain message, the log keeps the rest, and the other request runs."""
    from worker.claim_step_loop import StepLoop

    cfg, c = env
    real = StepLoop._start

    async def _start(self, d) -> None:
        if d.payload.prompt == "bad":
            raise RuntimeError("no route to 10.0.0.7:6379 (/srv/qos/secret.toml)")
        await real(self, d)

    monkeypatch.setattr(StepLoop, "_start", _start)
    async with worker(cfg, engine="sim", time_scale=0.01):
        bad = await c.admit("bad", max_tokens=4)
        good = await c.admit("good", max_tokens=4)
        await c.wait([bad, good], timeout=15)
    assert c.answers[good].done is not None, c.answers[good].error
    err = c.answers[bad].error
    assert err is not None and err["code"] == "failed"
    assert "10.0.0.7" not in err["msg"] and "RuntimeError" not in err["msg"] and "secret" not in err["msg"]
    assert "could not start" in err["msg"]


@pytest.mark.parametrize("outage", [False, True])
async def test_an_engine_error_fails_what_the_engine_held_and_hands_back_what_it_never_held(
        env, outage) -> None:
    """An engine error failed every request the worker held (StepLoop._fail_all), also the
    ones the engine did not hold: a look-ahead request waiting in the scheduler for a slot,
    never started, and a sequence paused with its KV freed (its engine sequence gone). Those
    are handed back now (released and requeued, as a drain hands back what never started);
    they resume -- here, on the same worker -- from what was delivered. Only the one the
    engine held fails (found by a review). ``outage``: the first release meets one, and is
    tried again (not left held, neither running nor finishing, for ever)."""
    from worker.engines.sim import SimEngine

    class Flaky(SimEngine):
        boom = False

        async def step(self, plan):
            if self.boom:
                self.boom = False
                raise RuntimeError("CUDA error (simulated)")
            return await super().step(plan)

    cfg, c = env
    eng = Flaky(time_scale=0.5, kv_capacity_tokens=1000)
    # One slot: a P2 with a 401-token prompt runs; a P0 look-ahead (701 tokens) takes its slot,
    # and the KV (1000) holds both only if the P2's is freed; then a P1 look-ahead waits.
    async with worker(cfg, eng, engine="sim", max_seqs=1, claim_ahead=2, flush_tokens=1) as rt:
        await wait_until(lambda: hasattr(rt, "scripts"), "the worker's scripts")
        released = record_calls(rt.scripts, "release", lambda keys, **kw: kw["request_id"])
        failures = [RedisUnavailable("Connection reset by peer")] if outage else []
        if outage:
            recorded = rt.scripts.release

            async def release(keys, **kw):
                if failures:
                    raise failures.pop()
                return await recorded(keys, **kw)

            rt.scripts.release = release
        loop = rt.stats.__self__
        p2 = await c.admit("x" * 400, cls="P2", max_tokens=300)
        await c.wait_tokens(p2, 3, timeout=15)
        p0 = await c.admit("y" * 700, cls="P0", max_tokens=400)

        def paused_kv_freed() -> bool:
            s0, s2 = loop.sched.seq(p0), loop.sched.seq(p2)
            return s0 is not None and s0.running and s2 is not None and not s2.running \
                and not s2.resident and len(s2.generated) > 0

        await wait_until(paused_kv_freed, "the P0 running, the P2 paused with its KV freed")
        p1 = await c.admit("z" * 20, cls="P1", max_tokens=4)

        def p1_waiting() -> bool:
            s1 = loop.sched.seq(p1)
            return s1 is not None and not s1.running and not s1.resident and paused_kv_freed()

        await wait_until(p1_waiting, "the P1 look-ahead waiting in the scheduler beside the running P0")
        assert p1 not in eng._table.seqs and p2 not in eng._table.seqs and p0 in eng._table.seqs
        eng.boom = True
        await c.wait([p0, p1, p2], timeout=30)
        assert not failures, "no release met the outage: the test proves nothing"
    assert c.answers[p0].error is not None and c.answers[p0].error["code"] == "failed", c.answers[p0]
    assert "engine error" in c.answers[p0].error["msg"]
    for rid, n in ((p1, 4), (p2, 300)):
        a = c.answers[rid]
        assert a.error is None, f"{rid}, which the engine did not hold, was failed: {a.error}"
        assert a.done is not None and a.tokens == n, a  # resumed where it stopped (offsets checked)
    assert sorted(released) == sorted([p1, p2]), released  # each landed once (the outage's try did not)
    assert len(set(c.answers[p2].attempts)) == 2, c.answers[p2].attempts  # resumed by a new attempt


async def test_a_clients_cancel_does_not_turn_an_answer_whose_completion_met_an_outage_into_a_cancel(
        env, monkeypatch) -> None:
    """A request finished (its answer decided: d.final ok, its last tokens pending) and its
    ``complete`` met a Redis outage; its client cancelled meanwhile. The lease renewal said
    "stop", and StepLoop._apply_signals, which runs before _retry_finals, overwrote the decided
    answer with ``cancelled`` and completed it so: the client lost an answer the worker had
    made whole, and the sample said cancelled. The answer decided first wins."""
    cfg, c = env
    rid = await c.admit("an answer decided before the cancel", max_tokens=6)
    real = Scripts.complete
    seen: dict[str, Any] = {"outcomes": [], "stop_told": False}

    async def complete(self, keys, *, request_id, outcome, **kw):
        if request_id == rid:
            seen["outcomes"].append(outcome)
            if not seen["stop_told"]:  # an outage until the renewal has told the worker "stop"
                if len(seen["outcomes"]) == 1:
                    assert await c.scripts.cancel(c.keys, rid, "t1") == "cancelling"
                raise RedisUnavailable("Connection reset by peer")
        return await real(self, keys, request_id=request_id, outcome=outcome, **kw)

    monkeypatch.setattr(Scripts, "complete", complete)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.01, lease_ms=1500)
    loop_on_stop = rt.on_stop

    def on_stop(ids: list[str]) -> None:
        loop_on_stop(ids)
        seen["stop_told"] = seen["stop_told"] or rid in ids

    rt.on_stop = on_stop
    try:
        await wait_until(lambda: seen["stop_told"], "the renewal telling the worker to stop it")
        deadline = time.monotonic() + 15
        while not c.answers[rid].finished:
            assert time.monotonic() < deadline and not task.done(), ("the request's end", seen)
            await c.read()
        rec = await c.record(rid)
    finally:
        stopped = await stop_worker(rt, task)
    assert stopped is None, f"the worker ended with {stopped!r}"
    a = c.answers[rid]
    assert a.error is None and a.done is not None, f"the decided answer was lost: {a.error}"
    assert a.tokens == 6 and a.text == sim_text("an answer decided before the cancel", 0, 6), a
    assert rec["state"] == "done", rec
    assert len(seen["outcomes"]) >= 2 and set(seen["outcomes"]) == {"ok"}, seen["outcomes"]


async def test_a_completion_redis_refuses_for_a_worker_bug_fails_that_request_not_the_worker(
        env, monkeypatch, caplog) -> None:
    """A ``complete`` refused for an argument that is not the request's tokens (a bug of the
    worker's own: here a latency sample past the script's 64 KiB) raised InvalidArgument out
    of WorkerRuntime.finish; StepLoop._retry_finals raised it again, rt.guard lets anything
    but an outage through, and the step worker exited with every request it held (under a
    supervisor: a crash loop). The one request fails, its client told; the error is logged;
    the other request and the worker go on."""
    import worker.runtime as runtime

    cfg, c = env
    other = await c.admit("the other request", max_tokens=30)
    bad = await c.admit("one whose sample the worker gets wrong", max_tokens=6)
    real_pack = runtime.pack_sample

    def pack_sample(sample: dict[str, Any]) -> bytes:
        if sample["request_id"] == bad:
            return b"\x00" * 70000  # past complete's 64 KiB: a BADARG 'sample'
        return real_pack(sample)

    monkeypatch.setattr(runtime, "pack_sample", pack_sample)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.05, max_seqs=4)
    try:
        deadline = time.monotonic() + 30
        while not (c.answers[bad].finished and c.answers[other].finished):
            assert not task.done(), f"the worker ended: {task.exception()!r}"
            assert time.monotonic() < deadline, ("both requests' ends", c.answers)
            await c.read()
        rec = await c.record(bad)
        # the worker goes on serving
        again = await c.admit("served after", max_tokens=8)
        await c.wait([again], timeout=30)
    finally:
        stopped = await stop_worker(rt, task)
    assert stopped is None, f"the worker ended with {stopped!r}"
    err = c.answers[bad].error
    assert err is not None and err["code"] == "failed" and "internal error" in err["msg"], c.answers[bad]
    assert rec["state"] == "failed", rec
    assert any(r.levelname == "ERROR" and bad in r.getMessage() and "sample" in r.getMessage()
               for r in caplog.records), caplog.text
    a = c.answers[other]
    assert a.done is not None and a.tokens == 30 and a.text == sim_text("the other request", 0, 30), a
    assert c.answers[again].done is not None and c.answers[again].tokens == 8


@pytest.mark.parametrize("failed_at", ["claim", "start"])
async def test_a_lease_lost_notice_of_an_old_attempt_does_not_touch_the_new_one_a_claim_holds(
        env, monkeypatch, failed_at) -> None:
    """R's lease is lost (requeued under the worker, as after an outage past its lease) and a
    look-ahead claim beside a step of R's old sequence takes R back (a new attempt) together
    with a request it must fail (``failed_at`` claim: an unusable payload, in
    WorkerRuntime.claim; start: a token-id prompt this engine refuses, in
    StepLoop._start_all, claimed before R), and waits on that failure; a push of the old
    sequence says its lease is lost. R's new attempt was in ``held`` meanwhile:
    the old sequence's next token went out as the new attempt's (a token past the one Redis
    expected, at its offset: the answer skipped one), and the notice, naming only R, dropped
    the new attempt (nobody served R for a whole lease; an attempt spent). The notice is
    applied to the attempt it is about, and a new attempt is held only once its claim has
    nothing left to await. The loop sent the unusable one's failure again meanwhile (its
    retry of completions) and waited on it: it is sent once.

    Ordered by states, not times: the pair is claimed in one claim (so it ends in one step),
    its answers land only once the loop has put a look-ahead beside the next step, and that
    look-ahead loses R's lease and queues the other request once the pair is gone. Left to
    timing, a loaded host landed the answers first: the loop made the claim itself, stepped
    nothing while it waited, and never applied the notice before the claim returned."""
    cfg, c = env
    prompt = "a stream whose lease is lost under it"
    rid = await c.admit(prompt, max_tokens=60)
    real_complete, real_claim = Scripts.complete, Scripts.claim
    state: dict[str, Any] = {"pair": (), "bad": None, "claims": [], "in_claim": 0, "bad_completes": 0}
    claims_open = asyncio.Event()
    claims_open.set()
    # Set by a look-ahead claim the loop put beside a step once both of the pair were decided.
    beside = asyncio.Event()
    failing, gate = asyncio.Event(), asyncio.Event()
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=3.0, max_seqs=3, flush_tokens=1)

    def pair_decided() -> bool:
        return bool(state["pair"]) and all((d := rt.held.get(x)) is not None and d.final is not None
                                           for x in state["pair"])

    async def claim(self, keys, *args, **kw):
        await claims_open.wait()
        state["in_claim"] += 1
        try:
            res = await real_claim(self, keys, *args, **kw)
        finally:
            state["in_claim"] -= 1
        state["claims"].append(sorted(r.request_id for r in res.requests))
        return res

    async def complete(self, keys, *, request_id, **kw):
        if request_id in state["pair"] and pair_decided():
            # The pair's answers land only once the loop, its batch still full, has put a
            # look-ahead claim beside the next step: landed before the loop looked, its batch
            # had room and the loop itself made the claim (waiting on it, stepping nothing).
            await asyncio.wait_for(beside.wait(), 20)
        elif request_id == state["bad"]:  # the claim fails it, and waits on that
            state["bad_completes"] += 1
            if not failing.is_set():
                failing.set()
                await asyncio.wait_for(gate.wait(), 20)
        return await real_complete(self, keys, request_id=request_id, **kw)

    real_pull_late, real_pull = loop._pull_late, loop._pull

    async def pull_late() -> None:
        if pair_decided():
            beside.set()
        await real_pull_late()

    async def pull() -> None:
        if beside.is_set() and state["bad"] is None and asyncio.current_task() is loop._claiming:
            # That look-ahead, beside a step of R: once the pair is gone it has room for two.
            # R's lease is lost now (requeued under the worker), and a request it must fail
            # queued behind it; its claim takes both.
            await wait_until(lambda: not any(x in rt.held for x in state["pair"]), "the pair's answers")
            d = rt.held[rid]
            assert await c.scripts.release(c.keys, request_id=rid, worker_id=rt.worker_id,
                                           fence=d.claimed.fence) == "requeued"
            if failed_at == "claim":
                state["bad"] = await _queue_unusable(c)
            else:  # P0: claimed, and so started, before R
                state["bad"] = await c.admit("ids", cls="P0", max_tokens=4, prompt_ids=(1, 2, 3))
        await real_pull()

    monkeypatch.setattr(Scripts, "complete", complete)
    monkeypatch.setattr(Scripts, "claim", claim)
    loop._pull_late, loop._pull = pull_late, pull
    try:
        await c.wait_tokens(rid, 2)
        # the pair in one claim, so that they finish in the same step
        claims_open.clear()
        await wait_until(lambda: state["in_claim"] == 0, "no claim in flight")
        state["pair"] = (await c.admit("short one", max_tokens=4), await c.admit("short two", max_tokens=4))
        claims_open.set()
        await wait_until(failing.is_set, "the look-ahead claim taking R back, failing the unusable one")
        assert sorted(state["pair"]) in state["claims"], state["claims"]
        assert sorted([rid, state["bad"]]) in state["claims"], state["claims"]  # one claim took both
        # the notice applied meanwhile: R's old sequence stopped (the loop then waits on the claim)
        await wait_until(lambda: rid not in loop.sched, "the old attempt's sequence out of the scheduler")
        gate.set()
        deadline = time.monotonic() + 30
        while not c.answers[rid].finished:
            assert not task.done(), f"the worker ended: {task.exception()!r}"
            assert time.monotonic() < deadline, ("R's end", c.answers[rid], await c.record(rid))
            await c.read()
        rec = await c.record(rid)
    finally:
        beside.set()
        gate.set()
        claims_open.set()
        stopped = await stop_worker(rt, task)
    assert stopped is None, f"the worker ended with {stopped!r}"
    a = c.answers[rid]
    assert a.done is not None and a.tokens == 60, a
    assert a.text == sim_text(prompt, 0, 60), f"R's answer is not its tokens in order: {a.text!r}"
    # the test's release gave its attempt back; a dropped attempt would spend one at its lease's end
    assert rec["state"] == "done" and int(rec["attempts"]) == 1, rec
    assert len(set(a.attempts)) == 2, a.attempts  # the old attempt's tokens, then the new one's
    # the failure the claim sent, once: the loop did not send it again while it was in flight
    assert state["bad_completes"] == 1, state["bad_completes"]


async def test_a_hand_back_redis_refuses_for_a_worker_bug_drops_that_request_not_the_worker(
        env, caplog) -> None:
    """A ``release`` refused for an argument that is not the request's tokens (a bug of the
    worker's own) raised InvalidArgument out of WorkerRuntime.release and stopped the draining
    worker with the requests it still held. That one is dropped (its lease lapses and the
    janitor requeues it: a worker resumes it); the others are handed back; the worker exits 0."""
    from limiter.errors import InvalidArgument

    cfg, c = env
    first = await c.admit("one whose hand-back is refused", max_tokens=400)
    second = await c.admit("one handed back", max_tokens=400)
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=1.0, max_seqs=4, lease_ms=1500)
    await wait_until(lambda: hasattr(rt, "scripts"), "the worker's scripts")
    recorded = rt.scripts.release

    async def release(keys, **kw):
        if kw["request_id"] == first:
            raise InvalidArgument("fence", "must be an integer >= 1 (a worker bug, simulated)")
        return await recorded(keys, **kw)

    rt.scripts.release = release
    await c.wait_tokens(first, 2, timeout=15)
    await c.wait_tokens(second, 2, timeout=15)
    await drained_now(rt, task)  # (asserts the worker exited 0 within 30 s)
    assert any(r.levelname == "ERROR" and first in r.getMessage() and "hand-back" in r.getMessage()
               for r in caplog.records), caplog.text
    assert (await c.record(second))["state"] == "queued"  # handed back at once
    # the refused one waits out its lease; the janitor of the next worker requeues it
    async with worker(cfg, engine="sim", time_scale=0.05):
        await c.wait([first, second], timeout=60)
    for rid in (first, second):
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 400, a


async def test_a_look_ahead_cancelled_before_it_started_is_charged_nothing(env) -> None:
    """A request the worker claimed ahead of a free slot, never started, whose client went
    away: completed as cancelled with ``usage_in`` the prompt tokens its engine processed --
    none -- so charged nothing, as a hand-back of it is (it was charged its whole prompt, for
    a prefill that never ran, where the same cancel while it was queued refunded it all). One
    that had started is charged its prompt and what it delivered, as before."""
    from tests.support.helpers import charge_of

    cfg, c = env
    running = await c.admit("the one running", max_tokens=400)
    async with worker(cfg, engine="sim", time_scale=1.0, max_seqs=1, claim_ahead=1) as rt:
        await c.wait_tokens(running, 2, timeout=15)
        ahead = await c.admit("x" * 300 + " waiting ahead of a free slot", max_tokens=50)
        await wait_until(lambda: ahead in rt.held, "the look-ahead claimed and held")
        loop = rt.stats.__self__
        seq = loop.sched.seq(ahead)
        assert seq is None or seq.kv_high == 0, "the look-ahead started: the test proves nothing"
        assert await c.scripts.cancel(c.keys, ahead, "t1") == "cancelling"
        await c.wait([ahead], timeout=15)
        assert await c.scripts.cancel(c.keys, running, "t1") == "cancelling"
        await c.wait([running], timeout=15)
    ended, started = await c.record(ahead), await c.record(running)
    assert ended["state"] == "cancelled" and ended["usage_in"] == "0", ended
    assert charge_of(ended) == 0 and float(ended["refund"]) == float(ended["cost"]), ended
    assert int(started["usage_in"]) > 0 and charge_of(started) > 0, started
