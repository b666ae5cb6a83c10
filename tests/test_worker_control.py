"""Cancellation within one step, SIGTERM drain (real processes), hand-back on drain timeout."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.support.helpers import redis_ms, wait_until
from tests.support.redis_server import RedisServer
from tests.support.worker_helpers import (
    Client,
    config,
    drained_now,
    mark_hand_backs,
    record_calls,
    sim_text,
    spawn_worker,
    start_worker,
    stop_process,
    worker,
    write_config,
)
from worker.main import build_worker
from worker.settings import load_settings


@pytest.fixture
def env(worker_env):
    return worker_env


async def wait_state(c: Client, rid: str, states: tuple[str, ...], timeout: float = 10) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (rec := await c.record(rid)).get("state") not in states:
        assert time.monotonic() < deadline, rec
        await asyncio.sleep(0.01)
    return rec


async def test_cancellation_stops_generation_within_flush_ms_and_a_step_or_two(env) -> None:
    """The worker asks the cancels set for all it holds every flush_ms (a push does not say
    it: lua/push_tokens.lua), so a cancelled request makes at most flush_ms of tokens more,
    and a step or two (the check's round trip, the step it lands in)."""
    cfg, c = env
    flush_ms = 20
    # ~11 ms sim steps; every token is pushed at once so Redis knows exactly what was generated
    async with worker(cfg, engine="sim", time_scale=1.0, flush_tokens=1, flush_ms=flush_ms):
        rid = await c.admit("cancel me", max_tokens=1000)
        other = await c.admit("keep me", max_tokens=60)
        await c.wait_tokens(rid, 10)
        assert await c.scripts.cancel(c.keys, rid, "t1") == "cancelling"
        cancel_ms = await redis_ms(c.client)
        at_cancel = int((await c.record(rid))["out_tokens"])
        rec = await wait_state(c, rid, ("cancelled",))
        await c.wait([other])
    after = int(rec["usage_out"]) - at_cancel
    took = int(rec["finished_ms"]) - cancel_ms
    # This run's own step, from its tokens before the cancel (one reply entry each, Redis's
    # clock): ~11 ms, longer on a loaded machine, where 60 ms is not 'a few steps' any more.
    times = [t for t in c.answers[rid].times_ms if t <= cancel_ms][1:]  # (the first: prefill)
    step_ms = (times[-1] - times[0]) / (len(times) - 1)
    print(f"\n[cancel] {after} token(s) generated after the cancel; stopped {took} ms later "
          f"(step {step_ms:.1f} ms)")
    assert after <= math.ceil(flush_ms / step_ms) + 2 and took <= max(60, flush_ms + 5 * step_ms)
    assert c.answers[rid].done is None and c.answers[other].done["fin"] == "length"
    assert [s["outcome"] for s in await c.samples() if s["request_id"] == rid] == ["cancelled"]


async def test_drain_hands_back_unstarted_work_at_once_and_finishes_running_work(env) -> None:
    cfg, c = env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.5, max_seqs=1, token_budget=64,
                                         claim_ahead=1)
    running = await c.admit("first", max_tokens=80)
    await c.wait_tokens(running, 3)
    queued = await c.admit("second", max_tokens=80)
    await wait_state(c, queued, ("leased",))  # claimed ahead, waiting for the only slot
    rt.begin_drain("test")
    rec = await wait_state(c, queued, ("queued",), timeout=2)
    assert rec["attempts"] == "0" and rec["worker"] == ""  # handed back, attempt not used up
    await asyncio.wait_for(task, 10)
    await c.wait([running], timeout=5)
    assert c.answers[running].done["fin"] == "length" and c.answers[running].tokens == 80
    assert (await c.record(queued))["state"] == "queued"


async def test_sigterm_drains_and_exits_0_and_a_timed_out_drain_hands_back(
        redis_server: RedisServer, env, tmp_path: Path) -> None:
    cfg, c = env
    path = write_config(tmp_path / "w.toml", redis_server.url,
                        worker={"idle_block_s": 0.2, "heartbeat_s": 0.2})
    args = ["--engine", "sim", "--time-scale", "0.3", "--pool", "tiny"]
    # 1. SIGTERM with a request running: it finishes, the process exits 0
    p = spawn_worker(path, *args, "--worker-id", "drainer", log=tmp_path / "drainer.log")
    try:
        rid = await c.admit("drain me", max_tokens=150)
        await c.wait_tokens(rid, 5, timeout=30)
        p.send_signal(signal.SIGTERM)
        # The signal is handled when the worker's loop gets to it: admitted before that (a
        # loaded machine), "too late" was not too late. Its heartbeat says when it drains.
        beat = c.keys.worker("drainer")
        deadline = time.monotonic() + 30
        while p.poll() is None and await c.client.hget(beat, "state") != b"draining":
            assert time.monotonic() < deadline, "the worker to begin draining after SIGTERM"
            await asyncio.sleep(0.02)
        late = await c.admit("too late", max_tokens=5)
        assert await asyncio.to_thread(p.wait, 20) == 0
        await c.wait([rid], timeout=5)
        assert c.answers[rid].done["fin"] == "length" and c.answers[rid].text == sim_text("drain me", 0, 150)
        assert (await c.record(late))["state"] == "queued"  # a draining worker pulls nothing new
        # 2. drain timeout: a long request is handed back with its tokens, and resumed elsewhere
        p = spawn_worker(path, *args, "--drain-timeout", "0.3", "--worker-id", "quitter",
                         log=tmp_path / "quitter.log")
        long = await c.admit("a very long answer", max_tokens=3000)
        await c.wait([late], timeout=30)
        await c.wait_tokens(long, 20)
        t0 = time.monotonic()
        assert stop_process(p, signal.SIGTERM, timeout=30) == 0
        print(f"\n[drain timeout 0.3 s] the worker exited {time.monotonic() - t0:.1f} s after SIGTERM")
        # handed back unfinished (queued, its tokens kept): the drain timeout ended it, not the work
        rec = await c.record(long)
        assert rec["state"] == "queued" and int(rec["out_tokens"]) >= 20 and rec["attempts"] == "0"
        async with worker(cfg, engine="sim", time_scale=0.0):
            await c.wait([long], timeout=20)
        a = c.answers[long]
        assert a.tokens == 3000 and a.text == sim_text("a very long answer", 0, 3000)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


async def test_a_redis_restart_is_survived_and_the_pool_recreated(tmp_path: Path) -> None:
    """Redis restarts empty: the worker backs off while it is down, re-initialises the pool
    policy (PolicyMissing) and serves new requests; the process never stops."""
    srv = RedisServer().start()
    cfg = config(tmp_path / "qos.toml", srv.url)
    r = aioredis.from_url(srv.url)
    try:
        c = Client(r, cfg)
        await c.setup()
        async with worker(cfg, engine="sim", time_scale=0.01):
            first = await c.admit("before", max_tokens=5)
            await c.wait([first])
            await asyncio.to_thread(srv.restart)  # --save "": it comes back empty
            deadline = time.monotonic() + 30
            while True:  # until the worker has put the policy back
                assert time.monotonic() < deadline, "the worker to put the pool's policy back"
                with contextlib.suppress(RedisConnectionError):  # our own stale connection
                    if await r.exists(c.keys.policy):
                        break
                await asyncio.sleep(0.05)
            await r.zadd(c.keys.frontends, {"fe1": 4102444800000})
            c._last = "0-0"
            second = await c.admit("after", max_tokens=5)
            await c.wait([second], timeout=10)
        assert c.answers[second].done["fin"] == "length"
    finally:
        await r.aclose()
        srv.stop()


async def test_a_request_reclaimed_by_the_same_worker_after_its_lease_expired_resumes(env) -> None:
    """Redis out of reach for longer than the lease: the lease expires, ``claim`` requeues the
    request and may hand it straight back to the same worker at the next attempt. The worker
    drops its stale sequence and resumes from what Redis recorded (it used to crash on
    'already scheduled')."""
    cfg, c = env
    # pushes only every 5 s after the first token: the request is mid-stream when its lease expires
    async with worker(cfg, engine="sim", time_scale=1.0, flush_ms=5000, flush_tokens=100000) as rt:
        rid = await c.admit("lease expires under me", max_tokens=400)
        await c.wait_tokens(rid, 1)
        deadline = time.monotonic() + 30  # bounds a hang; the loop waits for attempt 2
        while (rec := await c.record(rid))["attempts"] != "2":
            assert time.monotonic() < deadline and rec["state"] in ("leased", "queued"), rec
            if rec["state"] == "leased":
                # what a long outage leaves behind: the lease expired and the reaper requeued
                # the request (again, should a lease renewal have come first)
                await c.client.zadd(c.keys.leases, {rid: 1})
                await c.scripts.reap(c.keys)
            await asyncio.sleep(0.02)
        await c.wait([rid], timeout=20)
        assert not rt.draining.is_set()  # still serving: the loop did not die
    a = c.answers[rid]
    assert a.done is not None and a.done["fin"] == "length" and a.tokens == 400, a
    assert a.text == sim_text("lease expires under me", 0, 400) and set(a.attempts) == {1, 2}
    assert [s["outcome"] for s in await c.samples() if s["request_id"] == rid] == ["ok"]


async def test_a_full_worker_claims_a_new_p0_past_its_lower_class_look_ahead(env) -> None:
    """One slot running P1, the look-ahead slot holding P2: a P0 queued now is claimed anyway
    (above_class) and preempts the P1, instead of waiting for both to finish."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=1.0, max_seqs=1, claim_ahead=1, flush_tokens=1):
        p1 = await c.admit("long P1", cls="P1", max_tokens=300)
        await c.wait_tokens(p1, 3)
        p2 = await c.admit("batch P2", cls="P2", max_tokens=300)
        await wait_state(c, p2, ("leased",))  # claimed ahead, waiting for the only slot
        t0 = time.monotonic()
        p0 = await c.admit("urgent P0", cls="P0", max_tokens=5)
        await c.wait([p0], timeout=10)
        p0_took = time.monotonic() - t0
        assert not c.answers[p1].finished and not c.answers[p2].finished
        await c.wait([p1, p2], timeout=30)
    assert c.answers[p0].done["fin"] == "length" and c.answers[p0].tokens == 5
    assert c.answers[p1].tokens == 300 and c.answers[p1].text == sim_text("long P1", 0, 300)
    # That P0 finished while P1 and P2 had not (asserted above) is the claim; the time is a figure.
    print(f"\n[look-ahead] P0 answered {p0_took * 1000:.0f} ms after it was queued (P1 needs ~3 s)")


async def test_a_drain_hands_back_held_work_that_is_not_running_instead_of_waiting(env) -> None:
    """A request the worker holds (lease renewed) but never started -- what a failed start
    used to leave behind for the rest of a claimed batch -- must not keep a drain waiting
    for drain_timeout_s (issue 14: a worker 'draining' for 30 s with all its work done)."""
    cfg, c = env
    s = load_settings(cfg, {"pool": "tiny", "engine": "sim", "idle_block_s": 0.2, "drain_timeout_s": 60})
    rt, loop = build_worker(s, cfg)
    await rt.open()
    try:
        rid = await c.admit("held, never started", max_tokens=20)
        (stranded,) = await rt.claim(1, 0)  # held by this worker, unknown to its loop
        assert stranded.request_id == rid and rid in rt.held
    except BaseException:
        await rt.close()
        raise
    task = asyncio.create_task(loop.run())
    t0 = time.monotonic()
    rt.begin_drain("test")
    try:
        done, _ = await asyncio.wait({task}, timeout=10)
        took = time.monotonic() - t0
        if not done:  # end it the old way (the drain deadline) before failing
            rt.drain_deadline = time.monotonic()
            await task
        assert done, "the drain waited for held work that was not running"
        await task
    finally:
        await rt.close()
    assert took < 10
    rec = await c.record(rid)
    assert rec["state"] == "queued" and rec["worker"] == "", rec  # handed back for another worker


async def test_the_step_loop_yields_while_it_holds_work_it_cannot_step(env) -> None:
    """A held request the loop has nothing to step for (a parked or stranded one) must not
    turn the loop into a spin: heartbeats and lease renewals go on (issue 14)."""
    cfg, c = env
    s = load_settings(cfg, {"pool": "tiny", "engine": "sim", "idle_block_s": 0.2, "heartbeat_s": 0.1,
                            "heartbeat_ttl_s": 1})
    rt, loop = build_worker(s, cfg)
    await rt.open()
    task = None
    try:
        rid = await c.admit("parked", max_tokens=20)
        (held,) = await rt.claim(1, 0)
        assert held.request_id == rid
        task = asyncio.create_task(loop.run())
        first = await c.client.zscore(rt.keys.workers, rt.worker_id)
        deadline = time.monotonic() + 10
        beats = set()
        cpu0, wall0 = time.process_time(), time.monotonic()
        while len(beats) < 3:  # three fresh heartbeats while the loop runs with the request held
            assert time.monotonic() < deadline, "no heartbeat: the step loop does not yield"
            score = await c.client.zscore(rt.keys.workers, rt.worker_id)
            if score is not None and score > first:
                beats.add(score)
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - wall0)))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        # Idle apart from a look every 50 ms: a spinning loop burns a whole core (cpu ~ wall).
        assert cpu < 0.25 * wall, f"the step loop spins: {cpu:.2f} s CPU in {wall:.2f} s"
    finally:
        if task is not None:
            rt.begin_drain("test over")
            rt.drain_deadline = time.monotonic()
            await asyncio.wait_for(task, 30)
        await rt.close()


async def test_a_push_failing_just_before_the_drain_deadline_does_not_keep_the_work_from_being_handed_back(
        env, monkeypatch) -> None:
    """At the drain deadline the loop hands back what it holds with _release, which first awaits
    the last step's calls; when one of those had met a passing outage (a push that failed just
    then), that stale failure aborted _release before any hand-back, and the worker exited
    holding the work: with Redis answering again, its requests waited out a whole lease and
    burnt an attempt instead of being requeued at once."""
    from limiter.errors import RedisUnavailable
    from limiter.scripts import Scripts

    cfg, c = env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, flush_tokens=1,
                                         drain_timeout_s=60)
    real = Scripts.push_tokens_many
    state = {"failed": 0}

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        if rt.drain_expired and not state["failed"]:  # one push, the first after the deadline
            state["failed"] += 1
            raise RedisUnavailable("Connection reset by peer")
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)  # before the worker first runs
    try:
        rid = await c.admit("hand me back", max_tokens=100000)
        await c.wait_tokens(rid, 3)
        rt.begin_drain("test")  # 60 s: the running request goes on
        await c.wait_tokens(rid, c.answers[rid].tokens + 2)
        rt.drain_deadline = time.monotonic()
        await asyncio.wait_for(task, 20)
    finally:
        if not task.done():
            task.cancel()
    assert state["failed"] == 1
    rec = await c.record(rid)
    assert rec["state"] == "queued", f"the drained worker exited still holding {rid}: {rec.get('state')!r}"
    assert rec["attempts"] == "0"


async def test_a_missing_policy_met_by_the_last_steps_push_does_not_keep_the_work_from_being_handed_back(
        env, monkeypatch) -> None:
    """The step's calls still in flight at the drain deadline are awaited before the hand-back;
    one that met NOPOLICY (Redis restarted empty just then) raised out of the hand-back, and the
    worker exited with a traceback holding its work (found by a review of the shared
    hand-back): each request waited out its lease. The hand-back goes on (it writes the pool
    again on its own calls' NOPOLICY)."""
    from limiter.errors import PolicyMissing
    from limiter.scripts import Scripts

    cfg, c = env
    rt, loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, flush_tokens=1,
                                         drain_timeout_s=60)
    real, real_hand_back_all = Scripts.push_tokens_many, loop._hand_back_all
    state = {"failed": 0}
    handing_back = asyncio.Event()

    async def hand_back_all() -> None:
        handing_back.set()
        await real_hand_back_all()

    async def push_tokens_many(self, keys, worker_id, batches, lease_ms=0, **kw):
        # a step's push after the drain began, nobody awaiting it yet (not one the drain's
        # first look settles, nor the hand-back's own)
        if rt.draining.is_set() and loop._io is asyncio.current_task() and not state["failed"]:
            state["failed"] += 1
            rt.drain_deadline = time.monotonic()
            # still in flight when the loop next looks: the hand-back, not a step, awaits it
            await wait_until(handing_back.is_set, "the hand-back to begin")
            raise PolicyMissing(keys.pool)
        return await real(self, keys, worker_id, batches, lease_ms, **kw)

    loop._hand_back_all = hand_back_all

    monkeypatch.setattr(Scripts, "push_tokens_many", push_tokens_many)  # before the worker first runs
    try:
        rid = await c.admit("hand me back", max_tokens=100000)
        await c.wait_tokens(rid, 3)
        rt.begin_drain("test")  # 60 s: the running request goes on, pushing every token
        assert await asyncio.wait_for(task, 20) == 0
    finally:
        if not task.done():
            task.cancel()
    assert state["failed"] == 1
    rec = await c.record(rid)
    assert (rec["state"], rec["attempts"]) == ("queued", "0"), rec


async def _every_release_refused_at_the_deadline(env, monkeypatch, error: Exception
                                                 ) -> tuple[str, list[float]]:
    """A step worker running one request, drained at once, every release raising ``error``:
    the request's id and the times of the tries, once the worker has exited (0)."""
    from limiter.scripts import Scripts

    cfg, c = env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, drain_timeout_s=60)
    tries: list[float] = []

    async def release(self, keys, **kw):
        tries.append(time.monotonic())
        raise error

    monkeypatch.setattr(Scripts, "release", release)
    try:
        rid = await c.admit("never handed back", max_tokens=100000)
        await c.wait_tokens(rid, 1)
        await drained_now(rt, task)
    finally:
        if not task.done():
            task.cancel()
    return rid, tries


async def test_a_hand_back_that_keeps_failing_at_the_drain_deadline_is_given_up(env, monkeypatch) -> None:
    """The retry of a failed hand-back is bounded (HAND_BACK_RETRY_S): with every release
    refused by an outage the worker still exits, leaving the request to requeue when its lease
    expires, as when Redis is down."""
    from limiter.errors import RedisUnavailable

    rid, tries = await _every_release_refused_at_the_deadline(
        env, monkeypatch, RedisUnavailable("Connection reset by peer"))
    assert len(tries) >= 2, f"tried {len(tries)} time(s): no retry"
    assert (await env[1].record(rid))["state"] == "leased"  # its lease lapses: claim requeues it


async def test_a_hand_back_that_meets_a_missing_policy_at_the_deadline_does_not_spin(
        env, monkeypatch) -> None:
    """guard backs off after an outage but not after NOPOLICY (it writes the policy again
    at once): the hand-back's retry made ~1,500 tries in its 5 s (found by a review). The
    shared hand-back (WorkerRuntime.hand_back) backs off 0.2 s doubling to 1 s after either."""
    from limiter.errors import PolicyMissing
    from worker.runtime import HAND_BACK_RETRY_S

    _rid, tries = await _every_release_refused_at_the_deadline(env, monkeypatch, PolicyMissing("tiny"))
    assert 2 <= len(tries) <= HAND_BACK_RETRY_S / 0.2 + 2, f"{len(tries)} tries"


@pytest.mark.parametrize("failing", ["release", "push_tokens_many"])
async def test_a_hand_back_meeting_a_passing_outage_at_the_drain_deadline_is_tried_again(
        env, monkeypatch, failing: str) -> None:
    """At the drain deadline the worker hands back what it holds, pushing its last tokens
    first. A passing outage just then (one call of the hand-back failed: its push or the
    release itself) left the worker to exit holding the request, which then waited out a
    whole lease and spent an attempt; it is tried again after a back-off (HAND_BACK_RETRY_S).
    Found by the suite with both cores busy: the test above failed when the first push after
    the deadline was the hand-back's own rather than a step's."""
    from limiter.errors import RedisUnavailable
    from limiter.scripts import Scripts
    from worker.runtime import WorkerRuntime

    cfg, c = env
    # No push of the steps' own after the first token: the hand-back has tokens to push.
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, flush_ms=10_000,
                                         flush_tokens=100_000, drain_timeout_s=60)
    handing_back: contextvars.ContextVar[bool] = contextvars.ContextVar("handing_back", default=False)
    real_release, real = WorkerRuntime.release, getattr(Scripts, failing)
    state = {"failed": 0}

    async def release(self, d, spent=False):
        handing_back.set(True)  # this task's context (and of those it starts) only
        return await real_release(self, d, spent)

    async def once_failing(self, *args, **kw):
        if handing_back.get() and rt.drain_expired and not state["failed"]:
            state["failed"] += 1
            raise RedisUnavailable("Connection reset by peer")
        return await real(self, *args, **kw)

    monkeypatch.setattr(WorkerRuntime, "release", release)
    monkeypatch.setattr(Scripts, failing, once_failing)  # before the worker first runs
    try:
        rid = await c.admit("hand me back", max_tokens=100000)
        await c.wait_tokens(rid, 1)  # running (its first token is pushed at once)
        rt.begin_drain("test")  # 60 s: the running request goes on
        await wait_until(lambda: rid in rt.held and rt.held[rid].pending_tokens >= 3,
                         "three tokens generated and not pushed")
        rt.drain_deadline = time.monotonic()
        await asyncio.wait_for(task, 20)
    finally:
        if not task.done():
            task.cancel()
    assert state["failed"] == 1, f"no {failing} call after the deadline: the test did not test"
    rec = await c.record(rid)
    assert rec["state"] == "queued", f"the drained worker exited still holding {rid}: {rec.get('state')!r}"
    assert rec["attempts"] == "0"


async def test_an_answer_decided_before_the_drain_deadline_is_finished_past_the_hand_back_bound(
        env, monkeypatch) -> None:
    """A request whose answer is decided (its completion met an outage) when the drain's
    deadline comes is finished with it, retried as any completion: given up after the
    hand-back's bound for a release (HAND_BACK_RETRY_S), it stayed held, and requeued at its
    lease's end to be answered again. The openai worker already kept trying. The bound for an
    answer is as long as a drain waits for Redis (hand_back_limit_s: a lease here, 10 s)."""
    from limiter.errors import RedisUnavailable
    from limiter.scripts import Scripts
    from worker.runtime import hand_back_limit_s

    monkeypatch.setattr("worker.runtime.HAND_BACK_RETRY_S", 0.3)
    cfg, c = env
    rt, _loop, task = await start_worker(cfg, engine="sim", time_scale=0.2, drain_timeout_s=60)
    assert hand_back_limit_s(rt.settings, rt.cfg) >= 5  # the outage below ends well before
    handing_back = mark_hand_backs(monkeypatch)
    real = Scripts.complete
    tries: list[float] = []  # the hand-back's

    async def complete(self, keys, **kw):
        if handing_back.get():
            tries.append(time.monotonic())
            if tries[-1] < tries[0] + 1.0:  # more than the 0.3 s a release is given
                raise RedisUnavailable("Connection reset by peer")
            return await real(self, keys, **kw)
        raise RedisUnavailable("Connection reset by peer")  # the step's own, and its retries

    monkeypatch.setattr(Scripts, "complete", complete)  # before the worker first runs
    try:
        rid = await c.admit("decided, then drained", max_tokens=4)
        await wait_until(lambda: rid in rt.held and rt.held[rid].final is not None,
                         "the request's completion met the outage")
        await drained_now(rt, task)
    finally:
        if not task.done():
            task.cancel()
    assert len(tries) >= 2 and tries[-1] >= tries[0] + 1.0, f"the hand-back's tries: {tries}"
    rec = await c.record(rid)
    assert rec["state"] == "done", f"a decided answer was left held at the drain: {rec.get('state')!r}"
    assert (rec["finish_reason"], rec["attempts"]) == ("length", "1"), rec


async def test_a_look_ahead_request_refused_at_start_is_completed_once(env) -> None:
    """A request the look-ahead claim (a task beside the step) refuses in StepLoop._start (bad
    sampling parameters here; a prompt past the context, a resume already at its end) has
    ``d.final`` set while its completion is in flight in that task; the main loop's
    _retry_finals, which left out only the step's own completions, sent the same ``complete``
    again, and one of the two replies could read as a lost lease (logged so, counted
    ``finished{outcome=lost}``) for a request that was answered (found by a review). Completes
    are slowed here so that the window spans a loop iteration."""
    cfg, c = env
    async with worker(cfg, engine="sim", time_scale=1.0, max_seqs=2, flush_tokens=1) as rt:
        await wait_until(lambda: hasattr(rt, "scripts"), "the worker's scripts")
        claims = record_calls(rt, "claim", lambda *a, **kw: asyncio.current_task().get_name())
        completes = record_calls(rt.scripts, "complete", lambda keys, **kw: kw["request_id"])
        real, landing = rt.scripts.complete, [0]

        async def slow(*a, **kw):
            landing[0] += 1
            try:
                await asyncio.sleep(0.05)
                return await real(*a, **kw)
            finally:
                landing[0] -= 1

        rt.scripts.complete = slow
        long = [await c.admit("x" * 20, cls="P2", max_tokens=400) for _ in range(2)]
        for rid in long:
            await c.wait_tokens(rid, 3, timeout=10)
        bad = await c.admit("bad seed", cls="P0", max_tokens=4, seed=-1)
        await c.wait([bad], timeout=10)
        # Once it is no longer held nothing can complete it again: wait for that and for every
        # complete in flight to land.
        await wait_until(lambda: bad not in rt.held and not landing[0],
                         "the refused request's completes landed")
        lost = rt.metrics.finished.labels("P0", "lost")._value.get()
    assert "look-ahead-claim" in claims, "no look-ahead claim beside a step: the test proves nothing"
    assert c.answers[bad].error is not None and c.answers[bad].error["code"] == "refused"
    assert completes.count(bad) == 1, f"{completes.count(bad)} completes for {bad}"
    assert lost == 0
