"""push_tokens with several requests in one call: each request's reply on its own, a refused
call writes nothing, the call's size is bounded, the step worker really sends one call for
the requests due at a step, and an outage between a step's calls loses and repeats nothing
(the last two scenarios came from a review of the change)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from limiter.errors import InvalidArgument, RedisUnavailable
from limiter.frontend.replies import replies_of
from limiter.scripts import PUSH_KEYS, PUSH_LIMIT, Pushed, Scripts, TokenBatch, lifecycle_keys, push_keys
from tests.support.helpers import admit, dump_all
from tests.support.worker_helpers import sim_text, worker


async def _claim(scripts, pool, n):
    got = await scripts.claim(pool, "w1", n)
    assert len(got.requests) == n
    return {c.request_id: c for c in got.requests}


async def test_each_request_of_a_batch_gets_its_own_reply_and_only_the_good_ones_are_written(
        scripts, pool) -> None:
    for rid in ("a", "b", "c"):
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 3)
    lease_before = await scripts.client.zscore(pool.leases, "b")
    await scripts.client.hset(pool.request("c"), "cancel", 1)  # its client cancelled: still delivered
    replies = await scripts.push_tokens_many(pool, "w1", [
        TokenBatch("a", held["a"].fence, 0, [7, 8], "hi", 2),
        TokenBatch("b", held["b"].fence + 1, 0, [9], "x", 1),  # a fence not issued: lost
        TokenBatch("c", held["c"].fence, 0, [5], "c", 1),
    ])
    # ...and answered "ok": a push does not say a cancel (the worker asks the cancels set)
    assert replies == [Pushed("ok"), Pushed("lost"), Pushed("ok")]
    # a retry of a's batch (its reply was lost): Redis has 2 tokens, the batch says 0
    again = await scripts.push_tokens_many(pool, "w1", [TokenBatch("a", held["a"].fence, 0, [7, 8], "hi", 2),
                                                        TokenBatch("c", held["c"].fence, 1, [6], "d", 1)])
    assert again == [Pushed("offset", delivered=2), Pushed("ok")]
    recs = {rid: await scripts.client.hgetall(pool.request(rid)) for rid in "abc"}
    assert recs["a"][b"out_tokens"] == b"2" and recs["c"][b"out_tokens"] == b"2"
    assert b"out_tokens" not in recs["b"] and b"first_ms" not in recs["b"]
    assert await scripts.client.zscore(pool.leases, "b") == lease_before  # b's lease not extended
    assert await scripts.client.get(pool.tokens("b")) is None
    # the token strings a push creates live as long as their records can (a week's grace)
    for rid in "ac":
        assert await scripts.client.pttl(pool.tokens(rid)) > 7 * 86400 * 1000, rid
    entries = [e for _, e in await scripts.client.xrange(pool.reply("fe1"))]
    assert [(e[b"id"], e[b"o"], e[b"t"]) for e in entries] == [(b"a", b"0", b"hi"), (b"c", b"0", b"c"),
                                                                (b"c", b"1", b"d")]
    assert 0 < await scripts.client.ttl(pool.reply("fe1")) <= 600


async def test_a_push_moves_no_lease_and_a_renewal_moves_them_all(scripts, pool) -> None:
    """Leases move with renew_leases only (the worker renews every held request every
    lease_ms / 3): a push writes neither the lease index nor the record's lease end."""
    for rid in ("a", "b"):
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 2)
    # leases ending 5 s earlier than the claim set them: any write of now + lease_ms shows
    earlier = {}
    for rid in "ab":
        end = int(await scripts.client.zscore(pool.leases, rid)) - 5000
        await scripts.client.zadd(pool.leases, {rid: end})
        await scripts.client.hset(pool.request(rid), "lease_ms", end)
        earlier[rid] = end

    async def lease_ends() -> dict[str, tuple[int, int]]:
        return {rid: (int(await scripts.client.zscore(pool.leases, rid)),
                      int(await scripts.client.hget(pool.request(rid), "lease_ms"))) for rid in "ab"}

    for offset in (0, 1):  # an attempt's first push (first_ms written) and a later one
        replies = await scripts.push_tokens_many(pool, "w1", [
            TokenBatch(rid, held[rid].fence, offset, [7], "x", 1) for rid in "ab"])
        assert replies == [Pushed("ok"), Pushed("ok")]
        assert await lease_ends() == {rid: (end, end) for rid, end in earlier.items()}
    renewed = await scripts.renew_leases(pool, "w1", [(rid, held[rid].fence) for rid in "ab"])
    assert renewed.lost == [] and renewed.stop == []
    after = await lease_ends()
    for rid, end in earlier.items():
        assert after[rid][0] == after[rid][1] >= end + 5000, (rid, after[rid], end)


async def test_the_first_push_stamps_the_first_token_and_no_later_push_moves_it(scripts, pool) -> None:
    """first_ms (the TTFT) is written by an attempt's first push only: a push tells that from
    out_tokens (not reading first_ms), and a later push of this attempt or of a resumed one
    leaves the stamp, however much later it comes."""
    await admit(scripts, pool, cls="P1", request_id="a", input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 1)
    assert await scripts.client.hget(pool.request("a"), "first_ms") is None
    assert await scripts.push_tokens_many(pool, "w1", [TokenBatch("a", held["a"].fence, 0, [7], "x", 1)]) \
        == [Pushed("ok")]
    stamped = int(await scripts.client.hget(pool.request("a"), "first_ms"))
    earlier = stamped - 5000  # as if the first token came 5 s ago: a rewrite of now would show
    await scripts.client.hset(pool.request("a"), "first_ms", earlier)
    assert await scripts.push_tokens_many(pool, "w1", [TokenBatch("a", held["a"].fence, 1, [8], "y", 1)]) \
        == [Pushed("ok")]
    assert int(await scripts.client.hget(pool.request("a"), "first_ms")) == earlier
    # handed back and claimed again: the new attempt's first push is not the request's first
    assert await scripts.release(pool, request_id="a", worker_id="w1", fence=held["a"].fence) == "requeued"
    again = await _claim(scripts, pool, 1)
    assert await scripts.push_tokens_many(pool, "w1", [TokenBatch("a", again["a"].fence, 2, [9], "z", 1)]) \
        == [Pushed("ok")]
    rec = await scripts.client.hgetall(pool.request("a"))
    assert int(rec[b"first_ms"]) == earlier and rec[b"out_tokens"] == b"3"


async def test_a_refused_batch_writes_nothing_for_any_request(scripts, pool, sync_redis) -> None:
    for rid in ("a", "b"):
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=4)
    held = await _claim(scripts, pool, 2)
    before = dump_all(sync_redis)
    with pytest.raises(InvalidArgument, match="twice"):
        await scripts.push_tokens_many(pool, "w1", [TokenBatch("a", held["a"].fence, 0, [1], "x", 1),
                                                    TokenBatch("b", held["b"].fence, 0, [1], "y", 1),
                                                    TokenBatch("a", held["a"].fence, 1, [2], "y", 1)])
    assert dump_all(sync_redis) == before


async def test_a_batch_past_its_max_tokens_is_refused_alone_and_the_others_are_delivered(
        scripts, pool, sync_redis) -> None:
    """One request's batch past its max_tokens is that request's state (the worker counted more
    than its record allows), like a lost lease: it was a BADARG for the whole call, and one
    such request kept every other request of the worker's step from being delivered."""
    for rid in ("a", "b"):
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=4)
    held = await _claim(scripts, pool, 2)
    of_b = [pool.request("b").encode(), pool.tokens("b").encode()]
    before = {k: v for k, v in dump_all(sync_redis).items() if k in of_b}
    assert of_b[0] in before
    lease_before = await scripts.client.zscore(pool.leases, "b")
    fits = TokenBatch("a", held["a"].fence, 0, [1], "x", 1)
    past = TokenBatch("b", held["b"].fence, 0, [1] * 5, "5 tok", 5)  # 5 tokens, max_tokens 4
    replies = await scripts.push_tokens_many(pool, "w1", [fits, past])
    assert replies == [Pushed("ok"), Pushed("max_tokens", max_tokens=4)]
    assert {k: v for k, v in dump_all(sync_redis).items() if k in of_b} == before  # nothing written for b
    assert await scripts.client.zscore(pool.leases, "b") == lease_before
    assert (await scripts.client.hgetall(pool.request("a")))[b"out_tokens"] == b"1"
    entries = [e for _, e in await scripts.client.xrange(pool.reply("fe1"))]
    assert [(e[b"id"], e[b"t"]) for e in entries] == [(b"a", b"x")]
    # one request alone: the wrapper for one request raises, as the refusal did before
    with pytest.raises(InvalidArgument, match="5 tokens exceed max_tokens 4") as refused:
        await scripts.push_tokens(pool, request_id="b", worker_id="w1", fence=held["b"].fence, offset=0,
                                  token_ids=[1] * 5, text="5 tok")
    assert refused.value.field == "count"


async def test_a_call_carries_at_most_push_limit_requests(scripts, pool, sync_redis) -> None:
    batches = [TokenBatch(f"r{i}", 1, 0, [1], "x", 1) for i in range(PUSH_LIMIT + 1)]
    with pytest.raises(InvalidArgument, match=f"at most {PUSH_LIMIT}"):
        await scripts.push_tokens_many(pool, "w1", batches)
    # the script refuses it too (bounded work whoever calls it), and says how many it takes
    args: list = ["w1", 0, PUSH_LIMIT + 1, 1]
    for b in batches:
        args += [b.request_id, 1, 0, 1, b"\x01\x00\x00\x00", "x", ""]
    before = dump_all(sync_redis)
    with pytest.raises(Exception, match=r"BADARG n: .* is outside \[1, 64\]"):
        await scripts.client.evalsha(scripts._scripts["push_tokens"].sha or
                                     await scripts.client.script_load(scripts._scripts["push_tokens"].script),
                                     len(lifecycle_keys(pool)), *lifecycle_keys(pool), *args)
    assert dump_all(sync_redis) == before


async def test_a_push_takes_the_head_of_the_key_list_or_all_of_it_and_refuses_less(
        scripts, pool, sync_redis) -> None:
    """push_tokens is passed the first PUSH_KEYS keys of the lifecycle list (the ones it uses:
    a key a call carries costs Redis ~1k instructions); the whole list works the same, and
    fewer keys are refused before anything is written."""
    assert push_keys(pool) == lifecycle_keys(pool)[:PUSH_KEYS] == (
        pool.policy, pool.request_prefix, pool.tokens_prefix, pool.reply_prefix)
    for rid in ("a", "b"):
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 2)
    sha = await scripts.client.script_load(scripts._scripts["push_tokens"].script)

    def args(rid: str) -> list:
        return ["w1", 0, 1, 0, rid, held[rid].fence, 0, 1, b"\x07\x00\x00\x00", "t", ""]

    assert await scripts.client.evalsha(sha, PUSH_KEYS, *push_keys(pool), *args("a")) == [b"ok"]
    whole = lifecycle_keys(pool)
    assert await scripts.client.evalsha(sha, len(whole), *whole, *args("b")) == [b"ok"]
    for rid in "ab":
        assert (await scripts.client.hgetall(pool.request(rid)))[b"out_tokens"] == b"1"
        assert await scripts.client.get(pool.tokens(rid)) == b"\x07\x00\x00\x00"
    entries = [e for _, e in await scripts.client.xrange(pool.reply("fe1"))]
    assert [(e[b"id"], e[b"t"]) for e in entries] == [(b"a", b"t"), (b"b", b"t")]
    before = dump_all(sync_redis)
    next_batch = args("a")
    next_batch[6] = 1  # a's offset now
    with pytest.raises(Exception, match="BADARG KEYS: expected at least the 4"):
        await scripts.client.evalsha(sha, PUSH_KEYS - 1, *push_keys(pool)[:-1], *next_batch)
    assert dump_all(sync_redis) == before


async def test_the_step_worker_pushes_the_requests_due_at_a_step_in_one_call(worker_env, monkeypatch) -> None:
    """Eight requests decoding together: their token batches travel together, and every
    client still reads its whole text in order."""
    cfg, c = worker_env
    calls: list[int] = []
    real = Scripts.push_tokens_many

    async def counting(self, keys, worker_id, batches, lease_ms=0, **kw):
        calls.append(len(batches))
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", counting)
    prompts = [f"prompt {i}" for i in range(8)]
    rids = [await c.admit(p, max_tokens=24) for p in prompts]  # queued before the worker starts
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=4):
        await c.wait(rids, timeout=30)
    for rid, p in zip(rids, prompts, strict=True):
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 24 and a.text == sim_text(p, 0, 24), (rid, a)
    assert max(calls) > 1, f"push_tokens calls carried {calls} requests each: no call carried two"


def _count_pushes(monkeypatch) -> dict[str, int]:
    """Request id -> the push_tokens batches it had, counted as the worker sends them."""
    batches: dict[str, int] = {}
    real = Scripts.push_tokens_many

    async def counting(self, keys, worker_id, bs, lease_ms=0, **kw):
        for b in bs:
            batches[b.request_id] = batches.get(b.request_id, 0) + 1
        return await real(self, keys, worker_id, bs, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", counting)
    return batches


async def test_requests_started_out_of_step_are_soon_pushed_in_the_same_calls(
        worker_env, monkeypatch) -> None:
    """B starts while A is somewhere in its push period: from B's second push on, both keep
    the step loop's push clock (worker/push_clock.py), so a call carries both and the two make
    one call a period instead of two, and every token still arrives, in order."""
    cfg, c = worker_env
    calls: list[set[str]] = []
    real = Scripts.push_tokens_many

    async def recording(self, keys, worker_id, batches, lease_ms=0, **kw):
        calls.append({b.request_id for b in batches})
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", recording)
    async with worker(cfg, engine="sim", time_scale=0.2, flush_ms=60, flush_tokens=100_000):
        a = await c.admit("first one", max_tokens=300)
        await c.wait_tokens(a, 1)
        b = await c.admit("second one", max_tokens=300)
        await c.wait([a, b], timeout=60)
    for rid, prompt in ((a, "first one"), (b, "second one")):
        assert c.answers[rid].tokens == 300 and c.answers[rid].text == sim_text(prompt, 0, 300)
    with_a = [i for i, ids in enumerate(calls) if a in ids]
    with_b = [i for i, ids in enumerate(calls) if b in ids]
    # from each one's third push on (a period or two to fall into step) until either's last
    start, end = max(with_a[2], with_b[2]), min(with_a[-1], with_b[-1])
    window = [calls[i] for i in range(start, end) if calls[i] & {a, b}]
    assert len(window) >= 3, (with_a, with_b)  # the two ran side by side for some periods
    assert all({a, b} <= ids for ids in window), (with_a, with_b)


async def test_a_class_with_a_longer_stream_flush_is_pushed_less_often(worker_env, monkeypatch) -> None:
    """``stream_flush_ms`` of a class overrides the worker's flush_ms for its requests: a P2
    request at 10 s is pushed once (its first token: time to first token is not batched)
    and completes with the rest, while P1 beside it is pushed at the worker's 1 ms."""
    cfg, c = worker_env
    classes = tuple(dataclasses.replace(k, stream_flush_ms=10_000.0) if k.name == "P2" else k
                    for k in cfg.classes)
    batches = _count_pushes(monkeypatch)
    p1 = await c.admit("steady one", cls="P1", max_tokens=24)
    p2 = await c.admit("batch job", cls="P2", max_tokens=24)
    async with worker(dataclasses.replace(cfg, classes=classes), engine="sim", time_scale=0.01, flush_ms=1,
                      flush_tokens=100):
        await c.wait([p1, p2], timeout=30)
    for rid, prompt in ((p1, "steady one"), (p2, "batch job")):
        a = c.answers[rid]
        assert a.done is not None and a.text == sim_text(prompt, 0, 24), (rid, a)
    assert batches.get(p2) == 1, batches
    assert batches.get(p1, 0) >= 4, batches


async def test_an_unstreamed_request_is_pushed_once_and_completes_with_the_rest(worker_env,
                                                                                   monkeypatch) -> None:
    """A client that does not stream reads the whole answer at the end: its request's first
    token is pushed at once (it tells the frontend the request runs) and the rest rides on
    complete well inside unstreamed_flush_ms, while a streamed request of the same class
    beside it is pushed at the worker's flush_ms / flush_tokens. Both answers are whole."""
    cfg, c = worker_env
    batches = _count_pushes(monkeypatch)
    streamed = await c.admit("read as it comes", max_tokens=24)
    unstreamed = await c.admit("read at the end", max_tokens=24, stream=False)
    async with worker(cfg, engine="sim", time_scale=0.01, flush_ms=1, flush_tokens=2,
                      unstreamed_flush_ms=60_000):
        await c.wait([streamed, unstreamed], timeout=30)
    for rid, prompt in ((streamed, "read as it comes"), (unstreamed, "read at the end")):
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 24 and a.text == sim_text(prompt, 0, 24), (rid, a)
    assert batches.get(unstreamed) == 1, batches
    assert batches.get(streamed, 0) >= 4, batches


def _fail_one_call(monkeypatch, *, land: bool, which: int) -> dict:
    """The ``which``-th push_tokens call that carries more than one request (1-based) meets
    an outage: after landing (reply lost) or before."""
    real = Scripts.push_tokens_many
    state = {"calls": [], "fired": 0}

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        state["calls"].append(len(batches))
        multi = sum(1 for n in state["calls"] if n > 1)
        if len(batches) > 1 and multi == which and not state["fired"]:
            state["fired"] = 1
            if land:
                await real(self, keys, worker_id, batches, lease_ms, **kw)
            raise RedisUnavailable("Connection reset by peer")
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    return state


@pytest.mark.parametrize("land", [True, False])
async def test_outage_in_a_later_chunk_keeps_delivery_exactly_once(worker_env, monkeypatch, land) -> None:
    """70 requests due at once take two calls (64 + 6); one multi-request call meets an
    outage after it ran (its reply lost) or before: every client still reads its whole text,
    each token once, by its first attempt."""
    cfg, c = worker_env
    n = PUSH_LIMIT + 6
    state = _fail_one_call(monkeypatch, land=land, which=4)
    prompts = [f"prompt {i}" for i in range(n)]
    rids = [await c.admit(p, max_tokens=12) for p in prompts]
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=1, max_seqs=128, token_budget=4096):
        await c.wait(rids, timeout=60)
    assert state["fired"] == 1, state
    assert max(state["calls"]) == PUSH_LIMIT, state["calls"]
    for rid, p in zip(rids, prompts, strict=True):
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 12 and a.text == sim_text(p, 0, 12), (rid, a)
        rec = await c.record(rid)
        assert rec["attempts"] == "1", (rid, rec)


async def test_a_cancel_made_while_a_step_s_pushes_meet_an_outage_still_stops_the_request(worker_env,
                                                                                         monkeypatch) -> None:
    """A client cancels while its request's push (chunk 1 of a step's pushes) is in flight, and
    chunk 2 meets an outage: the whole push_batches raises. The request must still stop: the
    cancel comes from the worker's SMISMEMBER (or renew's stop list), not from a push."""
    cfg, c = worker_env
    n = PUSH_LIMIT + 6
    real = Scripts.push_tokens_many
    state = {"phase": 0, "victim": None}

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        if state["phase"] == 0 and len(batches) == PUSH_LIMIT and all(b.offset > 0 for b in batches):
            state["victim"] = batches[0].request_id
            await self.cancel(keys, state["victim"], "t1")
            state["phase"] = 1
            return await real(self, keys, worker_id, batches, lease_ms, **kw)
        if state["phase"] == 1:
            state["phase"] = 2
            raise RedisUnavailable("Connection reset by peer")
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)
    for i in range(n):
        await c.admit(f"prompt {i}", max_tokens=300)
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=1, max_seqs=128, token_budget=4096):
        deadline = asyncio.get_running_loop().time() + 60
        while state["phase"] < 2 or not c.answers[state["victim"]].finished:
            assert asyncio.get_running_loop().time() < deadline, f"the cancelled request to end: {state}"
            await c.read()
    a = c.answers[state["victim"]]
    assert a.error is not None and a.error.get("code") == "cancelled", a
    assert a.tokens < 300, a.tokens


async def test_a_cancel_check_that_meets_an_outage_is_asked_again(worker_env, monkeypatch) -> None:
    """The worker's SMISMEMBER of the cancels set meets an outage once, just after a client
    cancelled: the request must still stop, from a later check (the news is not lost with the
    call). The renewals' stop list is hidden here: the cancel check is the only way left for
    the worker to learn it (a push does not say it)."""
    from worker.runtime import WorkerRuntime

    cfg, c = worker_env
    real_cancelled, real_renew = WorkerRuntime.cancelled, Scripts.renew_leases
    state = {"victim": "", "outages": 0, "asked_after": 0, "stops_hidden": 0}

    async def cancelled(self, ids):
        if state["victim"] in ids:
            if not state["outages"]:
                state["outages"] += 1
                raise RedisUnavailable("Connection reset by peer")
            state["asked_after"] += 1
        return await real_cancelled(self, ids)

    async def renew_leases(self, keys, worker_id, held, lease_ms=0):
        res = await real_renew(self, keys, worker_id, held, lease_ms)
        state["stops_hidden"] += len(res.stop)
        return dataclasses.replace(res, stop=[])

    monkeypatch.setattr(WorkerRuntime, "cancelled", cancelled)
    monkeypatch.setattr(Scripts, "renew_leases", renew_leases)
    async with worker(cfg, engine="sim", time_scale=1.0):  # ~11 ms steps: 1,000 tokens take ~11 s
        rid = await c.admit("cancel me", max_tokens=1000)
        await c.wait_tokens(rid, 2)
        state["victim"] = rid
        assert await c.scripts.cancel(c.keys, rid, "t1") == "cancelling"
        deadline = asyncio.get_running_loop().time() + 30
        while not c.answers[rid].finished:
            assert asyncio.get_running_loop().time() < deadline, f"the cancelled request to end: {state}"
            await c.read()
    a = c.answers[rid]
    assert a.error is not None and a.error.get("code") == "cancelled", a
    assert state["outages"] == 1 and state["asked_after"] >= 1, state
    assert a.tokens < 1000, a.tokens


async def test_a_batch_the_script_cannot_take_is_found_and_refused_alone(scripts, pool, cfg) -> None:
    """A batch the script refuses as an argument (here a text over its 16 MiB) refuses the
    whole call, nothing written: the worker sends that call's batches one at a time to find
    it, the others land, and only that request is failed (its InvalidArgument escaped and
    took the worker down, every request it held with it)."""
    from limiter.prompt import Payload
    from worker.delivery import Delivery
    from worker.runtime import WorkerRuntime
    from worker.settings import load_settings

    for rid in "abc":
        await admit(scripts, pool, cls="P1", request_id=rid, input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 3)
    settings = load_settings(cfg, {"pool": "tiny", "worker_id": "w1"})
    rt = WorkerRuntime(settings, cfg, engine="sim", simulated=True)
    rt.scripts = scripts
    ds = {rid: Delivery(c, Payload("completion", "p", 10), 0, 0.0, 3, 1) for rid, c in held.items()}
    rt.held.update(ds)
    for rid, d in ds.items():
        d.add([1], "x" * (16 * 1024 * 1024 + 1) if rid == "b" else rid, 0.0)
    news = {d.request_id: r for d, r in await rt.push_batches(rt.batches(list(ds.values())))}
    assert news["a"] is None and news["c"] is None
    refused = news["b"]
    assert isinstance(refused, InvalidArgument) and refused.field == "text"
    for rid in "ac":
        assert (await scripts.client.hgetall(pool.request(rid)))[b"out_tokens"] == b"1"
    assert b"out_tokens" not in await scripts.client.hgetall(pool.request("b"))
    assert rt.metrics.registry.get_sample_value("qos_worker_pushes_total") == 2
    await rt.fail_refused(ds["b"], refused)
    rec = await scripts.client.hgetall(pool.request("b"))
    assert rec[b"state"] == b"failed" and b"refused" in rec[b"reason"] and b"out_tokens" not in rec, rec
    assert "b" not in rt.held
    # a drain's hand-back pushes what is pending first: refused, the request fails (it raised
    # out of the drain, and the worker died holding the rest)
    await scripts.client.hset(pool.request("c"), "max_tokens", 1)
    ds["c"].add([2], "more", 0.0)
    await rt.release(ds["c"])
    rec = await scripts.client.hgetall(pool.request("c"))
    assert rec[b"state"] == b"failed" and b"max_tokens" in rec[b"reason"] and rec[b"out_tokens"] == b"1", rec
    assert "c" not in rt.held


@pytest.mark.parametrize("grouped", [0, 1])
async def test_numbers_written_otherwise_are_the_same_numbers(scripts, pool, grouped) -> None:
    """push_tokens and renew_leases compare the fence and the offset with the record's as
    strings first (no conversion when the digits are the same); a checked argument written
    otherwise ('007', '1e0', ' 3') is the same number, and the reply entry (one of its own or
    a grouped one) carries the record's canonical digits, never the argument's spelling."""
    await admit(scripts, pool, cls="P1", request_id="a", input_tokens=3, max_tokens=10)
    await admit(scripts, pool, cls="P1", request_id="b", input_tokens=3, max_tokens=10)
    held = await _claim(scripts, pool, 2)
    sha = await scripts.client.script_load(scripts._scripts["push_tokens"].script)
    pushed_b = 0

    async def push(fence: str, offset: str, count: str, text: str) -> list:
        """a's batch, written as given, and (grouped: a call of one request is an entry of its
        own) one token of b's, written plainly, in the same call."""
        nonlocal pushed_b
        a_batch = ["a", fence, offset, count, b"\x01\x00\x00\x00" * int(float(count)), text, ""]
        b_batch = ["b", held["b"].fence, pushed_b, 1, b"\x01\x00\x00\x00", "b", ""] if grouped else []
        pushed_b += grouped
        keys = lifecycle_keys(pool)
        args = ["w1", 0, 1 + grouped, grouped, *a_batch, *b_batch]
        replies = await scripts.client.evalsha(sha, len(keys), *keys, *args)
        assert not grouped or replies.pop() == b"ok"
        return replies

    fence_a = held["a"].fence
    assert await push(f"00{fence_a}", "0", "1", "x") == [b"ok"]
    assert await push(f"{fence_a}e0", "1e0", "2e0", "yz") == [b"ok"]
    assert await push(str(fence_a), " 3", "1", "w") == [b"ok"]
    assert await push(str(fence_a), "003", "1", "v") == [[b"offset", 4]]  # 4 were delivered
    assert await push(f"0{fence_a + 1}", "4", "1", "v") == [[b"lost", b"request is not leased to this "
                                                               b"worker with this fence"]]
    entries = [e for _, e in await scripts.client.xrange(pool.reply("fe1"))]
    fence = str(fence_a).encode()
    if grouped:  # one entry a call, a's batch under its id "a" (none when refused)
        assert [e.get(b"a") for e in entries] == [fence + b" 0 1 x", fence + b" 1 2 yz", fence + b" 3 1 w",
                                                  None, None]
        assert [e[b"k"] for e in entries] == [b"toks"] * 5
    else:
        assert [(e[b"a"], e[b"o"], e[b"n"], e[b"t"]) for e in entries] == [
            (fence, b"0", b"1", b"x"), (fence, b"1", b"2", b"yz"), (fence, b"3", b"1", b"w")]
    assert (await scripts.client.hgetall(pool.request("a")))[b"out_tokens"] == b"4"
    renew = await scripts.client.script_load(scripts._scripts["renew_leases"].script)
    keys = lifecycle_keys(pool)
    for entry, lost in ((f"a:00{fence_a}", []), (f"a:{fence_a + 1}", [b"a"])):
        assert await scripts.client.evalsha(renew, len(keys), *keys, "w1", 0, entry) == [lost, []], entry


async def test_a_grouped_entry_tells_each_frontend_what_entries_of_their_own_would(scripts, pool) -> None:
    """The same pushes, once with one entry per request and once grouped (two sets of
    requests, the same shapes): per frontend one entry a call instead of one a request, the
    refused batches in neither, and what the frontend's reader makes of them (replies_of) the
    same replies, in the same order per request -- text with spaces, several tokens, none."""
    fronts = {"a": "fe1", "b": "fe1", "c": "fe2", "d": "fe1"}
    await scripts.client.zadd(pool.frontends, dict.fromkeys(("fe1", "fe2"), 4102444800000))  # alive
    for mode in ("e", "g"):
        for rid, fe in fronts.items():
            await admit(scripts, pool, cls="P1", request_id=mode + rid, input_tokens=3, max_tokens=10,
                        frontend=fe)
    held = await _claim(scripts, pool, 8)

    def calls(mode: str) -> list[list[TokenBatch]]:
        def f(rid: str, fence_add: int = 0) -> int:
            return held[mode + rid].fence + fence_add
        return [
            [TokenBatch(mode + "a", f("a"), 0, [1], "x", 1),
             TokenBatch(mode + "b", f("b"), 0, [2, 3], " two words ", 2),
             TokenBatch(mode + "c", f("c"), 0, [4], "Grüße", 1),
             TokenBatch(mode + "d", f("d", 1), 0, [5], "no", 1)],  # a fence not issued: lost
            [TokenBatch(mode + "b", f("b"), 2, [6], "", 1),
             TokenBatch(mode + "a", f("a"), 0, [1], "again", 1),  # its reply was lost: offset
             TokenBatch(mode + "c", f("c"), 1, [7, 8, 9], "a b c", 3)],
        ]

    replies = {}
    for mode, grouped in (("g", True), ("e", False)):
        replies[mode] = [await scripts.push_tokens_many(pool, "w1", batches, grouped=grouped)
                         for batches in calls(mode)]
        if grouped:  # streams the grouped entries made (before the others set a TTL of their own)
            for fe in ("fe1", "fe2"):
                assert 0 < await scripts.client.ttl(pool.reply(fe)) <= 600, fe
    assert replies["e"] == replies["g"] == [[Pushed("ok"), Pushed("ok"), Pushed("ok"), Pushed("lost")],
                                            [Pushed("ok"), Pushed("offset", delivered=1), Pushed("ok")]]
    for fe in ("fe1", "fe2"):
        entries = [f for _, f in await scripts.client.xrange(pool.reply(fe))]
        seen: dict[str, list] = {"e": [], "g": []}
        for f in entries:
            for rid, reply in replies_of(f):  # attempt: the fence, another in each set
                assert reply.attempt == held[rid].fence
                seen[rid[0]].append((rid[1:], dataclasses.replace(reply, attempt=0)))
        assert seen["g"] == seen["e"] and seen["e"], fe
        grouped_entries = [f for f in entries if f[b"k"] == b"toks"]
        assert len(grouped_entries) == 2  # one a call: fe1 had requests in both calls, fe2 too
        assert len(entries) - len(grouped_entries) == len(seen["e"])  # the others: one a request
    assert [(rid, r.offset, r.count, r.text) for rid, r in seen["g"]] == [
        ("c", 0, 1, "Grüße"), ("c", 1, 3, "a b c")]  # fe2's, the last one checked


async def test_a_worker_sends_older_frontends_requests_in_calls_of_their_own(worker_env, monkeypatch) -> None:
    """A rolling deploy: requests of a frontend of this release (payload grouped_tokens) and of
    an older one (without it) held together go in separate calls, the older frontend's with
    one entry per request -- the only kind it reads -- and every client gets its whole text."""
    cfg, c = worker_env
    modes: list[tuple[bool, frozenset[str]]] = []
    real = Scripts.push_tokens_many

    async def recording(self, keys, worker_id, batches, lease_ms=0, *, grouped=False):
        modes.append((grouped, frozenset(b.request_id for b in batches)))
        return await real(self, keys, worker_id, batches, lease_ms, grouped=grouped)

    monkeypatch.setattr(Scripts, "push_tokens_many", recording)
    new = [await c.admit(f"new {i}", max_tokens=16) for i in range(3)]
    old = [await c.admit(f"old {i}", max_tokens=16, grouped_tokens=False) for i in range(3)]
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=4):
        await c.wait(new + old, timeout=30)
    for rid, prompt in zip(new + old, [f"new {i}" for i in range(3)] + [f"old {i}" for i in range(3)],
                           strict=True):
        a = c.answers[rid]
        assert a.done is not None and a.tokens == 16 and a.text == sim_text(prompt, 0, 16), (rid, a)
    assert modes and all(ids <= set(new) if grouped else ids <= set(old) for grouped, ids in modes)
    assert any(len(ids) > 1 for grouped, ids in modes if grouped)  # the new ones were grouped together
    entries = [f for _, f in await c.client.xrange(c.keys.reply("fe1"))]
    assert all(f[b"k"] != b"toks" or not set(f) & {o.encode() for o in old} for f in entries)
