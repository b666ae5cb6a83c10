"""The worker end to end against a private redis-server: a tiny client admits with the real
admit script and reassembles the reply stream; the worker runs in-process (the real
runtime, loop and engines). Sim engine at a small time scale, and the torch tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import aiohttp
import pytest
import torch

from limiter.errors import RedisUnavailable
from limiter.prompt import count_tokens
from tests.support.controller_helpers import metric
from tests.support.helpers import ALIVE, wait_until
from tests.support.redis_server import free_port
from tests.support.torch_device import DEVICE
from tests.support.worker_helpers import (
    Client,
    admit_one_at_a_time,
    blocked_on_the_wake_list,
    count_claims,
    count_pushes,
    sim_text,
    start_worker,
    stop_worker,
    worker,
)
from worker.batch_policy import Limits
from worker.engines.base import SamplingParams
from worker.engines.sim import SimEngine
from worker.engines.torch_engine import TorchEngine
from worker.local_run import LocalRequest, run_local


@pytest.fixture
def env(worker_env):
    return worker_env


async def test_sim_usage_length_and_stop_strings(env) -> None:
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.01, flush_tokens=3) as rt:
        plain = await c.admit("hello there", max_tokens=40)
        # "output" spans six byte tokens and several pushes: held back, then cut before it
        stopped = await c.admit("abc", max_tokens=100, stop=("output", "zzz"))
        one = await c.admit("x", max_tokens=1)
        await c.wait(timeout=20)
        hb = await c.client.hgetall(rt.keys.worker(rt.worker_id))
        assert await c.client.zscore(rt.keys.workers, rt.worker_id)
    a = c.answers[plain]
    assert a.done["fin"] == "length" and a.tokens == 40 and a.text == sim_text("hello there", 0, 40)
    assert int(a.done["in"]) == count_tokens("hello there") and int(a.done["out"]) == 40
    rec = await c.record(plain)
    assert rec["usage_out"] == "40" and rec["usage_in"] == str(count_tokens("hello there"))
    assert len(await c.generated(plain)) == 40

    s = c.answers[stopped]
    full = sim_text("abc", 0, 100)
    assert s.done["fin"] == "stop" and s.text == full[: full.index("output")]
    assert "outp" not in s.text and len(s.offsets) > 1
    # every generated token is counted (the stop's own tokens included), none is lost
    assert int(s.done["out"]) == s.tokens == len(await c.generated(stopped)) >= len(s.text)
    assert c.answers[one].done["fin"] == "length" and c.answers[one].tokens == 1
    assert hb[b"engine"] == b"sim" and hb[b"simulated"] == b"1" and int(hb[b"kv_capacity"]) > 0
    assert await c.client.zscore(rt.keys.workers, rt.worker_id) is None  # a drained worker deregisters


async def test_the_heartbeat_capacity_is_computed_for_saturation_once_the_worker_knows_its_mix(env) -> None:
    """A fresh worker reports its full steps' rate; once it has fitted its step cost and
    seen a mix (worker/saturated_capacity.py) the heartbeat's figure is the computed one."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.2) as rt:  # steps of ms: a fit of real costs
        key = rt.keys.worker(rt.worker_id)
        ids = [await c.admit("word " * (20 + 37 * i), max_tokens=30) for i in range(12)]
        await c.wait(ids, timeout=30)
        deadline = time.monotonic() + 10
        while (hb := await c.client.hgetall(key)).get(b"capacity_basis") != b"saturated":
            assert time.monotonic() < deadline, f"no heartbeat with capacity_basis 'saturated' in 10 s: {hb}"
            await asyncio.sleep(0.05)
    assert float(hb[b"capacity_tokens_s"]) > 0 and b"full_steps_tokens_s" in hb


async def test_the_work_a_worker_reports_is_weighted_by_its_requests_classes(env) -> None:
    """``work_done`` (the heartbeat's weighted tokens of useful work, what capacity is
    measured in) counts each request's prompt at its class's weight and its output at the
    class's out_weight."""
    cfg, c = env
    cfg = dataclasses.replace(cfg, classes=tuple(
        dataclasses.replace(k, weight=2.0, out_weight=3.0) if k.name == "P1" else k for k in cfg.classes))
    p0 = cfg.class_config("P0")
    assert p0 is not None and (p0.weight, p0.out_weight) == (1.0, 1.0)
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.0)
    try:
        ids = [await c.admit("hello", cls="P1", max_tokens=10), await c.admit("hi", cls="P0", max_tokens=4)]
        await c.wait(ids, timeout=20)
        work = loop.stats()["work_done"]
    finally:
        assert await stop_worker(rt, task) is None
    prompt = {text: len(SimEngine(time_scale=0).encode(text)) for text in ("hello", "hi")}
    assert work == 2.0 * prompt["hello"] + 3.0 * 10 + prompt["hi"] + 4, (work, prompt)


async def test_the_heartbeat_reports_the_loops_time_between_busy_steps_and_zero_once_idle(env) -> None:
    """``step_gap_ms``: while steps follow each other with work left, the mean time from one
    step's end to the next one's start (claims, cancel checks) is > 0; an interval without
    such a pair reports 0, not the last busy figure."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.2) as rt:
        key = rt.keys.worker(rt.worker_id)
        ids = [await c.admit("word " * (20 + 37 * i), max_tokens=60) for i in range(8)]
        deadline = time.monotonic() + 20
        while float((hb := await c.client.hgetall(key)).get(b"step_gap_ms", b"0")) <= 0:
            assert time.monotonic() < deadline, f"no heartbeat with step_gap_ms > 0 while busy in 20 s: {hb}"
            await asyncio.sleep(0.05)
        busy_gap = float(hb[b"step_gap_ms"])
        await c.wait(ids, timeout=30)
        deadline = time.monotonic() + 10
        while float((hb := await c.client.hgetall(key)).get(b"step_gap_ms", b"-1")) != 0:
            assert time.monotonic() < deadline, f"no heartbeat with step_gap_ms 0 once idle in 10 s: {hb}"
            await asyncio.sleep(0.05)
    assert 0 < busy_gap < 1000  # ms: the loop's own time, not an idle wait


async def test_a_full_batch_keeps_stepping_while_its_look_ahead_claim_waits_on_redis(env) -> None:
    """A full worker's look-ahead claim runs beside its steps: while that claim's reply is held
    back, the running requests go on producing tokens (awaited before each step, a slow claim
    stopped the whole batch), and the request it brings runs once the reply lands."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.02, max_seqs=2, token_budget=64) as rt:
        first = [await c.admit("run " * 20, max_tokens=2000) for _ in range(2)]
        for rid in first:
            await c.wait_tokens(rid, 1)
        real, gate, held_back = rt.claim, asyncio.Event(), asyncio.Event()

        async def slow_claim(*args: Any, **kwargs: Any) -> Any:
            if len(rt.held) >= 2:  # the batch is full: this is the look-ahead claim
                held_back.set()
                await gate.wait()
            return await real(*args, **kwargs)

        rt.claim = slow_claim  # type: ignore[method-assign]
        late = await c.admit("late " * 5, max_tokens=4)
        deadline = time.monotonic() + 15
        while not held_back.is_set():
            assert time.monotonic() < deadline, "no look-ahead claim within 15 s of the third request"
            await asyncio.sleep(0.01)
        before = c.answers[first[0]].tokens
        await c.wait_tokens(first[0], before + 50, timeout=15)  # the batch steps on meanwhile
        gate.set()
        await c.wait([late], timeout=30)
        for rid in first:
            await c.client.sadd(rt.keys.cancels, rid)
        await c.wait(first, timeout=30)
    assert c.answers[late].done["fin"] == "length"


async def test_steps_go_on_while_a_push_s_reply_is_awaited_and_a_request_s_calls_never_overlap(
        env) -> None:
    """Each step waited for the last step's calls even with nothing of its own to send: with
    steps shorter than a round trip (a null engine) every step after a push waited for the
    push's reply. While a push's reply is held back the worker now goes on stepping; what
    that request sends next (here its completion) still waits for the reply, so one
    request's calls never overlap; and the client gets every token once, in order."""
    cfg, c = env
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.0)
    real_push, real_finish = rt.push_batches, rt.finish  # patched before the worker first runs
    gate, held_back = asyncio.Event(), asyncio.Event()
    in_flight: list[str] = []
    overlaps: list[str] = []
    finishing: list[str] = []

    async def calls_of(ids: list[str], call: Any) -> Any:
        overlaps.extend(r for r in ids if r in in_flight)
        in_flight.extend(ids)
        try:
            return await call
        finally:
            for r in ids:
                in_flight.remove(r)

    async def push_batches(todo: Any) -> Any:
        if not held_back.is_set():  # the first push: its reply is held back
            held_back.set()
            await gate.wait()
        return await real_push(todo)

    async def pushed(todo: Any) -> Any:
        return await calls_of([d.request_id for d, _ in todo], push_batches(todo))

    async def finish(d: Any, *args: Any, **kwargs: Any) -> Any:
        finishing.append(d.request_id)
        return await calls_of([d.request_id], real_finish(d, *args, **kwargs))

    rt.push_batches, rt.finish = pushed, finish  # type: ignore[method-assign]
    try:
        rid = await c.admit("hold", max_tokens=120)
        deadline = time.monotonic() + 15
        while not (held_back.is_set() and rid in rt.held and rid not in loop.sched):
            assert time.monotonic() < deadline, (
                f"the request did not run to its end while its first push's reply was held back "
                f"(held back: {held_back.is_set()}; pending tokens: "
                f"{rt.held[rid].pending_tokens if rid in rt.held else None})")
            await asyncio.sleep(0.01)
        assert finishing == [], "the completion went while the push's reply was still awaited"
        gate.set()
        await c.wait([rid], timeout=30)
    finally:
        gate.set()
        assert await stop_worker(rt, task) is None
    a = c.answers[rid]
    assert a.done["fin"] == "length" and a.tokens == 120 and a.text == sim_text("hold", 0, 120)
    assert overlaps == [] and finishing == [rid]


async def test_an_outage_a_step_s_calls_met_is_raised_before_the_next_step_sends(env) -> None:
    """The step loop leaves a step's calls running beside the next step; a finished one is
    still settled before the next step's calls are made: its outage backs the loop off once
    (counted by loop), and its pushes, in doubt, are settled by the next push's offset check.
    Replaced by the next step's task unsettled, the outage went unseen."""
    cfg, c = env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.0)
    real_push = rt.push_batches  # patched before the worker first runs
    failed: list[list[str]] = []

    async def push_batches(todo: Any) -> Any:
        if not failed:  # the first push meets an outage (at once: done before the next step)
            failed.append([d.request_id for d, _ in todo])
            raise RedisUnavailable("connection reset (the test)")
        return await real_push(todo)

    rt.push_batches = push_batches  # type: ignore[method-assign]
    try:
        rid = await c.admit("outage", max_tokens=20)
        await c.wait([rid], timeout=30)
    finally:
        assert await stop_worker(rt, task) is None
    assert failed == [[rid]]
    assert metric(rt, "qos_worker_redis_errors_total", loop="worker") == 1
    a = c.answers[rid]
    assert a.done["fin"] == "length" and a.tokens == 20 and a.text == sim_text("outage", 0, 20)


async def test_batched_pushes_are_fewer_than_tokens(env) -> None:
    cfg, c = env
    # Only the token count may trigger a push here: with the default flush_ms (50 ms), how
    # many tokens one push carries depends on how fast this machine runs the loop (beside two
    # busy loops a step took longer than flush_ms: 101 pushes for 800 tokens).
    async with worker(cfg, engine="sim", time_scale=0.01, flush_ms=10_000, flush_tokens=16):
        ids = [await c.admit(f"p{i}", max_tokens=200) for i in range(4)]
        await c.wait(ids, timeout=20)
    tokens = sum(c.answers[r].tokens for r in ids)
    pushes = sum(len(c.answers[r].offsets) for r in ids)
    # per request: the first token alone, then one push per 16, the rest riding on complete
    assert tokens == 800 and pushes <= 4 * (2 + 199 // 16), (pushes, tokens)


async def test_torch_tiny_end_to_end_matches_local_run(env) -> None:
    cfg, c = env
    torch.set_num_threads(1)
    # fp32 on either device: the worker and run_local batch differently, and only fp32's
    # rounding keeps the two runs token for token the same
    engine = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, dtype=torch.float32,
                                     kv_capacity_tokens=16384)
    prompts = [(f"Question {i}: what is {i} + {i}? ", 0.0 if i % 2 else 0.7) for i in range(8)]
    ref_engine = TorchEngine.from_preset("tiny", seed=0, device=DEVICE, dtype=torch.float32,
                                         kv_capacity_tokens=16384)
    reqs = [LocalRequest(f"t{i}", tuple(ref_engine.encode(p)), SamplingParams(t, seed=i, max_tokens=120))
            for i, (p, t) in enumerate(prompts)]
    ref = (await run_local(ref_engine, reqs, Limits(token_budget=512, max_seqs=8))).traces
    async with worker(cfg, engine_obj=engine, max_seqs=8, metrics_port=(port := free_port())) as rt:
        t0 = time.monotonic()
        ids = [await c.admit(p, max_tokens=120, temperature=t, seed=i, rid=f"t{i}")
               for i, (p, t) in enumerate(prompts)]
        capacity = 0.0
        while not all(c.answers[r].finished for r in ids):
            assert time.monotonic() - t0 < 120, "every request to finish"
            await c.read()
            hb = await c.client.hget(rt.keys.worker(rt.worker_id), "capacity_tokens_s")
            capacity = max(capacity, float(hb or 0))
        wall = time.monotonic() - t0
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                metrics = await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                health = await resp.json()
        hist = rt.metrics.step_seconds.collect()[0].samples
        steps = next(s.value for s in hist if s.name.endswith("_count"))
        step_s = next(s.value for s in hist if s.name.endswith("_sum")) / steps
    total = 0
    for rid in ids:
        a = c.answers[rid]
        assert a.text == ref[rid].text and await c.generated(rid) == ref[rid].tokens
        assert int(a.done["out"]) == len(ref[rid].tokens) == a.tokens
        assert a.done["fin"] == ref[rid].finish_reason
        total += a.tokens
    assert "qos_worker_generated_tokens_total" in metrics and 'engine="torch"' in metrics
    assert health["status"] == "ok" and health["redis_ok"] and health["simulated"] is False
    assert capacity > 0  # weighted tokens/s while busy, for the controller's capacity estimate
    print(f"\n[worker torch tiny, {DEVICE}, 1 thread] {total} tokens from 8 requests in {wall:.2f} s = "
          f"{total / wall:.0f} tokens/s end to end; {steps:.0f} steps, mean step {step_s * 1e3:.1f} ms;"
          f" heartbeat capacity up to {capacity:.0f} weighted tokens/s")


async def test_prompt_too_long_for_the_engine_fails_clearly(env) -> None:
    cfg, c = env
    async with worker(cfg, engine_obj=SimEngine(time_scale=0.0, max_seq_len=64)):
        big = await c.admit("y" * 100, max_tokens=1)
        small = await c.admit("ok", max_tokens=4)
        await c.wait(timeout=10)
    assert c.answers[small].done is not None
    err = c.answers[big].error
    # refused: a retry fails the same way (its frontend answers 400), and the class's targets
    # do not count it; its record says failed. Claim refuses it (told the worker's context,
    # the shortest of its KV and its model's max_seq_len, no worker of the pool holds it).
    assert err is not None and err["code"] == "too_large" and "does not fit any worker" in err["msg"], err
    assert (await c.record(big))["state"] == "failed"
    assert [s["outcome"] for s in await c.samples() if s["request_id"] == big] == ["refused"]


async def test_fields_for_a_model_server_are_refused_by_a_step_engine(env) -> None:
    """A payload carrying a pool's ``upstream_fields`` (vLLM's top_k here) on a sim worker:
    the engine does not do what they ask, so the request is refused (its client reads a 400
    naming them), not answered as if they had not been sent."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.0):
        odd = await c.admit("with top_k", max_tokens=4, upstream={"top_k": 20, "min_p": 0.05})
        plain = await c.admit("without", max_tokens=4)
        await c.wait(timeout=10)
    assert c.answers[plain].done is not None
    err = c.answers[odd].error
    assert err is not None and err["code"] == "refused" and "min_p, top_k" in err["msg"], err
    assert "sim engine" in err["msg"]
    assert [s["outcome"] for s in await c.samples() if s["request_id"] == odd] == ["refused"]


async def test_a_token_id_prompt_is_refused_by_a_step_engine(env) -> None:
    """A payload whose prompt is a model's token ids (which a frontend takes only in a pool
    counting in that model's tokenizer, which no step engine serves): refused, saying why."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.0):
        ids = await c.admit("", max_tokens=4, prompt_ids=(7, 4, 11))
        await c.wait(timeout=10)
    err = c.answers[ids].error
    assert err is not None and err["code"] == "refused" and "token-id prompt" in err["msg"], err


async def test_a_resume_too_long_for_the_engine_is_a_failure_a_retry_may_mend(env) -> None:
    """The prompt fits; with what an earlier attempt (on a bigger worker) generated it does
    not: that is the resume's, not the request's, so it fails as a worker failure (a 503 its
    client may retry), not refused (found by a review)."""
    cfg, c = env
    rid = await c.admit("y" * 40, max_tokens=60)
    first = (await c.scripts.claim(c.keys, "w-big", 1)).requests[0]  # a bigger worker's attempt
    await c.scripts.push_tokens(c.keys, request_id=rid, worker_id="w-big", fence=first.fence, offset=0,
                                token_ids=[65] * 30, text="A" * 30)
    assert await c.scripts.release(c.keys, request_id=rid, worker_id="w-big", fence=first.fence) == "requeued"
    async with worker(cfg, engine_obj=SimEngine(time_scale=0.0, max_seq_len=64)):
        await c.wait([rid], timeout=10)
    err = c.answers[rid].error
    assert err is not None and err["code"] == "failed" and "30 generated" in err["msg"], err
    assert [s["outcome"] for s in await c.samples() if s["request_id"] == rid] == ["failed"]


async def _script_calls(c: Client) -> int:
    stats = await c.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


async def _script_rate(c: Client, window_s: float = 1.0) -> float:
    """Script calls per second on the server over about ``window_s`` (divided by the window
    as it was: a loaded machine's longer sleep counts more calls, not a faster rate)."""
    t0, before = time.monotonic(), await _script_calls(c)
    await asyncio.sleep(window_s)
    return (await _script_calls(c) - before) / (time.monotonic() - t0)


async def test_idle_and_blocked_workers_do_not_poll(env) -> None:
    """Idle: BLPOP on the wake list, ~1 claim per idle_block_s. A queue head too big for this
    worker's KV (claim re-announces the backlog it cannot take) must not become a hot loop:
    its empty claims back off to one per 100 ms (MAX_BACKOFF_INTERVALS of claim_interval_ms),
    where a hot loop is one per claim_interval_ms (20 ms) or faster."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.0, kv_capacity_tokens=64, idle_block_s=0.5) as rt:
        await blocked_on_the_wake_list(c)  # up and idle
        idle = await _script_rate(c)
        claims = count_claims(rt)
        # a live worker of the pool that could hold it: the request is left for that one (with
        # none, claim.lua refuses it as too large, and nothing blocks)
        await c.client.zadd(c.keys.workers, {"w-big": ALIVE})
        await c.client.hset(c.keys.worker_kv, "w-big", 10_000)
        seen = len(claims)  # an idle claim may land before the admit: the one after it is awaited
        rid = await c.admit("z" * 100, max_tokens=1)  # needs 102 KV tokens: never claimable here
        await wait_until(lambda: len(claims) > seen, "the worker's claim after the admit woke it")
        blocked = await _script_rate(c)
        assert (await c.record(rid))["state"] == "queued"  # its head stayed blocked throughout
    print(f"\n[no polling] script calls per second: idle {idle:.1f}, head-of-line blocked {blocked:.1f}")
    # (10 claims a second at most while blocked, plus the heartbeat's and the janitor's calls)
    assert idle <= 4 and blocked <= 16


async def test_an_idle_worker_claims_only_when_work_is_announced(env) -> None:
    """One request at a time, each admitted once the worker waits on the wake list: a claim
    each. A worker that had just gone idle used to claim before it blocked, a whole claim
    script (~150 us of the shard's time) finding nothing after every request."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.0, idle_block_s=30.0) as rt:  # no wait times out
        claims = count_claims(rt)
        ids = await admit_one_at_a_time(c, 6)
    assert all(c.answers[r].done for r in ids)
    assert len(claims) <= len(ids) + 1, claims  # + the claim a worker makes at start


async def test_requests_that_finish_at_one_step_are_completed_in_one_call(env) -> None:
    """Four requests claimed together, of one prompt and one length, end at the same step:
    their completions are one complete call (the script batcher merges them), a quarter of
    the shard's fixed cost of four calls; and their first tokens are one push."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=0.0) as rt:
        await blocked_on_the_wake_list(c)  # idle: its next claim takes all four at once
        assert rt.scripts.batcher is not None
        claims, before = count_claims(rt), rt.scripts.batcher.merged
        pushes = count_pushes(rt)
        ids = await asyncio.gather(*(c.admit("same prompt", max_tokens=6) for _ in range(4)))
        await c.wait(ids, timeout=30)
        merged = rt.scripts.batcher.merged - before
    assert all(c.answers[r].done["fin"] == "length" for r in ids)
    assert len(claims) == 1, claims  # claimed together, so they ran as one batch
    assert merged == 3, merged  # three completions went inside the fourth's call
    # their first tokens came at one step too: one push (what qos bench redis-budget's
    # "push_tokens (first) x8" assumes of requests claimed together)
    assert pushes[0] == [(0, 1)] * 4, pushes


async def test_a_step_s_push_goes_out_during_the_next_step(env) -> None:
    """A step's only call (a push, or a completion) is awaited in the calls' own task, which
    first runs when the next step yields: the tokens go out during that step. gather made each
    call a task of its own, started a loop turn later: behind a null engine, whose step yields
    once, a push went out after the next step, two steps after its tokens were made."""
    cfg, c = env
    # a push every 4 tokens, never for time (flush_ms at its most: a step slowed past the 50 ms
    # default on a loaded machine pushed one token alone); no look at the wake list after the
    # first (its wait lets tasks run)
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.0, flush_tokens=4, flush_ms=10_000,
                                        wake_check_ms=10_000)
    real_push, real_step = rt.push_batches, loop.sched.step  # patched before the worker first runs
    stepped = 0
    pushes: list[tuple[int, int]] = []  # (engine steps done when the push was sent, tokens it covers)

    async def push_batches(todo: Any) -> Any:
        pushes.extend((stepped, b.offset + b.count) for _, b in todo)
        return await real_push(todo)

    async def step() -> Any:
        nonlocal stepped
        res = await real_step()
        stepped += 1
        # the last step's push landed before this step ends: no push is put off to a later step
        if loop._io is not None:
            await asyncio.wait({loop._io}, timeout=30)
        return res

    rt.push_batches, loop.sched.step = push_batches, step  # type: ignore[method-assign]
    try:
        await blocked_on_the_wake_list(c)
        rid = await c.admit("every four", max_tokens=40)
        await c.wait([rid], timeout=30)
    finally:
        assert await stop_worker(rt, task) is None
    assert [tokens for _, tokens in pushes] == list(range(1, 40, 4)), pushes
    assert all(steps == tokens for steps, tokens in pushes), pushes
    a = c.answers[rid]
    assert a.done["fin"] == "length" and a.tokens == 40 and a.text == sim_text("every four", 0, 40)
