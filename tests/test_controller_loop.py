"""The controller's closed loop against a private redis-server: samples in, rates out.

The first test runs the real process object (all loops, metrics server) with short ticks;
the others drive one pool's loop step by step so each fault path is deterministic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import pytest
import redis.exceptions

from limiter.controller.leader import holder_id
from limiter.controller.loop import PoolController
from limiter.controller.metrics import ControllerMetrics
from limiter.controller.service import Controller
from limiter.errors import PolicyMissing
from limiter.keys import SAMPLES_GROUP
from limiter.scripts import Scripts
from limiter.status import snapshot
from tests.support.controller_helpers import (
    fast_settings,
    metric,
    pool_controller,
    push,
    sample,
    wait_for,
)
from tests.support.helpers import admit, redis_ms, wait_until
from tests.support.redis_server import free_port


async def _traffic(client, keys, stop: asyncio.Event) -> None:
    """P0 misses its 500 ms TTFT target; P1 and P2 run fine and are claimed steadily."""
    while not stop.is_set():
        now = await redis_ms(client)
        batch = [sample("P0", now, ttft_ms=2000.0) for _ in range(5)]
        batch += [sample("P1", now, input_tokens=200, output_tokens=100)]
        batch += [sample("P2", now, input_tokens=500, output_tokens=100)]
        await push(client, keys, batch)
        await client.hincrby(keys.stats, "P1.claimed", 1)  # 10/s x 300 = 3000 tokens/s: 15 % of C
        await client.hincrby(keys.stats, "P2.claimed", 1)  # 10/s x 600 = 6000 tokens/s: 30 % of C
        await asyncio.sleep(0.1)


async def test_violating_samples_tighten_the_lower_classes(aredis, pool, cfg):
    port = free_port()
    ctl = Controller(fast_settings(cfg, metrics_port=port, metrics_host="127.0.0.1"), cfg, client=aredis)
    await ctl.start()
    stop = asyncio.Event()
    traffic = None
    try:
        pc = ctl.pools["tiny"]
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None))
        traffic = asyncio.create_task(_traffic(aredis, pool, stop))
        await wait_for(lambda: aredis.xlen(pool.decisions), timeout=10)
        stop.set()
        await traffic
        (_id, fields), *_ = await aredis.xrange(pool.decisions)
        assert fields[b"controller"] == pc.lease.owner.encode() and int(fields[b"fence"]) == pc.term.fence
        record = json.loads(fields[b"d"])
        p0, p2 = record["classes"]["P0"], record["classes"]["P2"]
        assert p0["compliance"] < 0.95 and p0["samples"] >= 20  # the input that caused it
        assert p2["reason"] == "tighten_lower_for_P0"
        assert p2["new"]["ceil"] < p2["old"]["ceil"] == pytest.approx(20000.0)
        assert p2["used"] > 0 and record["capacity"]["new"] == pytest.approx(20000.0)
        assert record["classes"]["P0"]["new"]["ceil"] == pytest.approx(20000.0)  # P0 keeps its ceiling
        policy = await aredis.hgetall(pool.policy)
        assert float(policy[b"P2.ceil"]) < 20000.0 * 0.95
        compliance = await aredis.hgetall(pool.compliance)
        assert float(compliance[b"P0"]) < 0.95 and float(compliance[b"P1"]) == 1.0
        assert b"P2" not in compliance  # no SLO: no score, rather than a perfect one
        assert float(compliance[b".capacity"]) == pytest.approx(20000.0)
        assert await aredis.pttl(pool.compliance) > 0
        assert metric(ctl.metrics, "qos_controller_rate_writes_total", pool="tiny") >= 1
        assert metric(ctl.metrics, "qos_controller_decisions_total", pool="tiny", **{"class": "P2"},
                      reason="tighten_lower_for_P0") >= 1
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            assert 'qos_controller_leader{pool="tiny"} 1.0' in text
            assert 'qos_controller_samples_total{class="P0",pool="tiny"}' in text
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                health = await resp.json()
            assert health["pools"]["tiny"]["leader"] is True
        pending = await aredis.xpending(pool.samples, SAMPLES_GROUP)
        assert pending["pending"] <= 7  # at most the batch in flight
    finally:
        stop.set()
        if traffic is not None:
            await asyncio.gather(traffic, return_exceptions=True)
        await ctl.stop()
    assert await aredis.get(pool.leader) is None  # a clean stop releases the lease


async def _violate_and_tick(pc, client, keys):
    """Lead, get 30 violating P0 samples into the window while P2 served a lot of work two
    seconds ago (a closed interval: the interference), and tick: the law wants to cut P2."""
    await pc.renew_once()
    term = pc.term
    assert term is not None
    now = await redis_ms(client)
    p2 = [sample("P2", now - 2000, input_tokens=4000, output_tokens=100) for _ in range(10)]
    await push(client, keys, p2 + [sample("P0", now, ttft_ms=3000.0) for _ in range(30)])
    await pc.consume_once(term)
    assert term.consumed == 40
    return term


async def test_a_stale_leaders_write_is_refused_and_it_steps_down(aredis, pool, cfg):
    pc = pool_controller(cfg, aredis)
    term = await _violate_and_tick(pc, aredis, pool)
    version = await aredis.hget(pool.policy, "version")
    # Meanwhile the lease went to "b" (e.g. this process was paused past its lease).
    await aredis.set(pool.leader, f"b.0123abcd:{term.fence + 1}", px=10_000)
    assert await pc.tick(term) is None
    assert pc.term is None and pc.lease.fence == 0 and not pc.lease.leading
    assert metric(pc, "qos_controller_stale_writes_total", pool="tiny") == 1
    assert metric(pc, "qos_controller_leader", pool="tiny") == 0
    assert await aredis.hget(pool.policy, "version") == version  # nothing written
    assert await aredis.xlen(pool.decisions) == 0
    await pc.renew_once()  # and it stays a standby while b holds the lease
    assert pc.term is None and pc.lease.holder == f"b.0123abcd:{term.fence + 1}"


async def _taken_again(pc, pool) -> None:
    """The lease lapsed (Redis stalled past it) and the lease loop took it again: a new term."""
    await pc.client.delete(pool.leader)
    pc.lease._valid_until = 0.0
    await pc.renew_once()


async def test_a_tick_whose_term_ended_while_it_read_writes_nothing_and_leaves_the_new_term_be(
        aredis, pool, cfg, monkeypatch):
    """A tick checked its term once, at its start: the lease lapsing and taken again while it
    read (a new term, a new fence) left it to write the old term's decision with the old
    fence, refused, and the refusal stepped down -- ending the new, valid term, its lease held
    in Redis and led by nobody (found by a review)."""
    import limiter.controller.loop as loop_mod

    pc = pool_controller(cfg, aredis)
    term = await _violate_and_tick(pc, aredis, pool)
    await aredis.hincrby(pool.stats, "P2.claimed", 10)  # the law wants to cut P2 now
    version = await aredis.hget(pool.policy, "version")
    real, calls = loop_mod.redis_now_ms, []

    async def redis_now_ms(client, keys):
        calls.append(1)
        if len(calls) == 1:  # the tick's first read
            await _taken_again(pc, pool)
        return await real(client, keys)

    monkeypatch.setattr(loop_mod, "redis_now_ms", redis_now_ms)
    assert await pc.tick(term) is None
    assert pc.term is not None and pc.term is not term and pc.lease.leading
    assert pc.lease.fence == pc.term.fence == term.fence + 1
    assert await aredis.hget(pool.policy, "version") == version  # nothing written
    assert metric(pc, "qos_controller_stale_writes_total", pool="tiny") == 0


async def test_a_write_refused_for_a_term_that_ended_meanwhile_leaves_the_new_term_be(aredis, pool, cfg):
    """The same, the lease taken again while the write was on its way: the refusal is the old
    term's, not a reason to end the new one."""
    pc = pool_controller(cfg, aredis)
    term = await _violate_and_tick(pc, aredis, pool)
    await aredis.hincrby(pool.stats, "P2.claimed", 10)
    real = pc.scripts.set_rates

    async def set_rates(*args, **kw):
        await _taken_again(pc, pool)
        return await real(*args, **kw)

    pc.scripts.set_rates = set_rates
    assert await pc.tick(term) is None
    assert metric(pc, "qos_controller_stale_writes_total", pool="tiny") == 1  # it was refused
    assert pc.term is not None and pc.term is not term and pc.lease.leading
    assert pc.lease.fence == pc.term.fence == term.fence + 1


async def test_a_new_leader_continues_from_the_policy_not_from_scratch(aredis, pool, cfg):
    a = pool_controller(cfg, aredis)
    term = await _violate_and_tick(a, aredis, pool)
    decision = await a.tick(term)
    assert decision is not None and decision.changed  # P0 violates: P2's borrowing is cut
    assert {c.name: c.reason for c in decision.classes}["P2"] == "tighten_lower_for_P0"
    await a.lease.release()
    b = pool_controller(cfg, aredis, controller_id="b")
    await b.renew_once()
    assert b.term is not None and b.term.fence == term.fence + 1
    old = {c.name: c.allowance for c in term.state.classes}
    new = {c.name: c.allowance for c in b.term.state.classes}
    ceiling = {c.name: c.ceil_share for c in cfg.classes}["P2"]
    assert new == pytest.approx(old) and old["P2"] < ceiling  # the cut survives the failover
    # ... and so does the cooldown: the change time written is Redis' own (set_rates), the
    # decision's is the controller's estimate of it, one round trip apart on a busy machine
    assert b.term.state.last_change_ms == pytest.approx(decision.now_ms, abs=100)


async def test_a_missing_policy_is_recreated_from_the_config(aredis, cfg, sync_redis):
    pc = pool_controller(cfg, aredis)
    assert not await aredis.exists(pc.keys.policy)  # never initialised
    await pc.renew_once()
    assert pc.term is not None and await aredis.hget(pc.keys.policy, "capacity") == b"20000"
    term = await _violate_and_tick(pc, aredis, pc.keys)
    await aredis.delete(pc.keys.policy)  # e.g. Redis restarted without persistence
    with pytest.raises(PolicyMissing):
        await pc.tick(term)
    await aredis.hincrby(pc.keys.stats, "P2.claimed", 10)  # P2 still claims: the law still cuts it
    await pc._guard(pc.tick(term), "tick")  # what the tick loop does: re-create, go on
    assert await aredis.hget(pc.keys.policy, "capacity") is not None
    assert pc.term is term  # still leading


async def test_a_leader_whose_tick_loop_stalled_gives_up_its_lease(aredis, pool, cfg):
    """A leader that renews but no longer decides would block the standby forever."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert pc.term is not None
    pc._ticked -= pc.stall_s + 1  # the tick loop has not turned for longer than allowed
    await pc.renew_once()
    assert pc.term is None and pc.lease.fence == 0
    assert await aredis.get(pool.leader) is None  # released: a standby takes it at its next poll


async def test_ticks_that_keep_failing_are_a_stall_and_end_the_leadership(aredis, pool, cfg, monkeypatch):
    """A term whose state went bad (one absurd sample made every later tick raise) renewed
    its lease for ever without deciding: a tick that fails with an error of its own is not a
    turn of the loop for the watchdog; a Redis outage is."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    term = pc.term
    assert term is not None

    failed: list[None] = []

    async def broken(_term):
        failed.append(None)
        raise ValueError("a term's state gone bad")

    monkeypatch.setattr(pc, "tick", broken)
    before = pc._ticked = pc._ticked - 1.0
    loop = asyncio.create_task(pc.tick_loop())
    try:
        # several turns, every one failing (the third has begun: the second has ended)
        await wait_until(lambda: len(failed) >= 3, "three failing ticks of the loop")
        assert pc._ticked == before
        pc._ticked -= pc.stall_s  # ... for longer than the watchdog allows
        await pc.renew_once()
        assert pc.term is None and await aredis.get(pool.leader) is None  # a standby may take it
    finally:
        loop.cancel()


async def test_a_lease_no_term_can_begin_on_is_given_up(aredis, pool, cfg, monkeypatch):
    """A term that cannot begin (an error of its own each time: an ACL refusing XGROUP CREATE,
    say) left the lease held and renewed for ever with no term: no decision, and every standby
    kept out. The watchdog gives such a lease up as it does a stalled tick loop."""
    pc = pool_controller(cfg, aredis)

    async def refused():
        raise redis.exceptions.NoPermissionError("NOPERM this user has no permissions to run 'xgroup'")

    monkeypatch.setattr(pc.consumer, "ensure_group", refused)
    await pc.renew_once()
    assert pc.term is None and pc.lease.leading  # the lease is ours, no term began
    await pc.renew_once()
    assert pc.lease.leading and pc._termless_since is not None
    pc._termless_since -= pc.stall_s + 1  # ... for longer than the watchdog allows
    await pc.renew_once()
    assert pc.lease.fence == 0 and await aredis.get(pool.leader) is None  # a standby may take it


async def test_absurd_figures_are_not_taken_from_samples_or_heartbeats(aredis, pool, cfg):
    """Token counts of 1e308 (finite, whole) passed decode_sample and made the usage meter inf,
    then NaN; a heartbeat of 2e15 tokens/s made every rate one set_rates refuses. Both wedged
    the leader (every tick raised). A sample out of bounds is a bad sample; a heartbeat out of
    bounds is not a report."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    term = pc.term
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P1", now, input_tokens=1e308, output_tokens=1e308, e2e_ms=1000.0),
                              *[sample("P1", now) for _ in range(5)]])
    await pc.consume_once(term)
    assert (term.consumed, term.bad) == (5, 1)
    await aredis.zadd(pool.workers, {"w1": now})
    await aredis.hset(pool.worker("w1"), mapping={"capacity_tokens_s": 2e15})
    for _ in range(3):
        await aredis.hincrby(pool.stats, "P1.claimed", 5)
        assert await pc.tick(term) is not None
        await asyncio.sleep(0.05)
    assert 0 < float(await aredis.hget(pool.policy, "capacity")) <= 1e12
    assert pc.term is term


async def test_a_leader_whose_lease_lapsed_leaves_the_samples_it_read_to_its_successor(aredis, pool, cfg):
    """A leader paused past its lease (GC, a VM, SIGSTOP) whose blocked read was answered
    meanwhile resumed in its sample loop first: it fed the batch to its dead term and
    acknowledged it, and the new leader never saw those samples."""
    a = pool_controller(cfg, aredis)
    b = pool_controller(cfg, aredis, controller_id="b")
    await a.renew_once()
    term = a.term
    await a.consume_once(term)  # caught up
    await push(aredis, pool, [sample("P0", await redis_ms(aredis)) for _ in range(5)])
    batch = await a.consumer.read_new(50)  # delivered to a ... which is then paused past its lease
    a.lease._valid_until = 0.0
    await aredis.delete(pool.leader)  # (the lease's PX expiry)
    await b.renew_once()
    assert b.term is not None and not a.lease.leading
    await a.take(term, batch)  # a resumes in its sample loop
    assert term.consumed == 0
    # still pending: b claims them once idle for claim_idle_s (tests/test_controller_consumer.py)
    assert (await aredis.xpending(pool.samples, SAMPLES_GROUP))["pending"] == 5


async def test_a_leader_suspended_past_its_lease_knows_it_on_resume(aredis, pool, cfg, monkeypatch):
    """A VM suspended past the lease: Redis' PX ran on, time.monotonic stopped. Timed on the
    monotonic clock, the resumed leader read its lease as valid until its next renewal, reading
    and acknowledging samples its successor should have had. The lease's clock counts the
    suspend (CLOCK_BOOTTIME): simulated here by that clock alone jumping past the lease."""
    import time

    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert pc.lease.leading
    suspended_s = 10 * pc.lease.lease_ms / 1000
    real = time.clock_gettime

    def suspended(clock: int) -> float:
        return real(clock) + (suspended_s if clock == getattr(time, "CLOCK_BOOTTIME", None) else 0.0)

    monkeypatch.setattr(time, "clock_gettime", suspended)
    assert not pc.lease.leading


async def test_two_processes_started_with_one_id_do_not_both_lead(aredis, pool, cfg):
    """A controller_id in the shared [controller] table gives every process the same id: the
    lease, named by the id alone, was renewed by both, and both led with one fence."""
    a = pool_controller(cfg, aredis, controller_id="ctl")
    b = pool_controller(cfg, aredis, controller_id="ctl")
    await a.renew_once()
    await b.renew_once()
    assert a.term is not None and b.term is None and not b.lease.leading
    assert holder_id(b.lease.holder) == "ctl" and b.lease.holder != f"{b.lease.owner}:{a.term.fence}"
    await a.lease.release()
    a.end_term("test over")
    await b.renew_once()
    assert b.term is not None  # ... and it takes over once the first one lets go


async def test_a_redis_clock_stepped_back_starts_a_new_term_afresh(aredis, pool, cfg):
    """last_change_ms is Redis time, read back by every new term: with the clock stepped back
    an hour, the law held for the hour (now - last < cooldown) and the windows, marked after
    the last change, took no sample as fresh for as long. Marking them at the new time instead
    took the samples stamped on the old clock -- under the old rates -- as fresh. The term ends;
    the next one starts afresh: no cooldown, empty windows, nothing of the old clock."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    term = pc.term
    now = await redis_ms(aredis)
    ahead = now + 3_600_000  # the clock before it stepped back an hour
    await push(aredis, pool, [sample("P0", ahead - 10_000, ttft_ms=3000.0) for _ in range(40)])
    await pc.consume_once(term)
    term.state = dataclasses.replace(term.state, last_change_ms=ahead - 5_000)
    term.monitor.mark(ahead - 5_000 + pc.settings.settle_s * 1000)
    await aredis.hset(pool.policy, "updated_ms", ahead - 5_000)  # as set_rates wrote it
    assert await pc.tick(term) is None and pc.term is None
    await pc.renew_once()  # same lease, a new term
    fresh = pc.term
    assert fresh is not None and fresh is not term and fresh.state.last_change_ms is None
    assert fresh.monitor.stats()["P0"].count == 0  # nothing stamped on the old clock
    await push(aredis, pool, [sample("P0", await redis_ms(aredis), ttft_ms=3000.0) for _ in range(40)])
    await pc.consume_once(fresh)
    assert fresh.monitor.stats()["P0"].fresh_count == 40  # what comes now counts
    await aredis.hincrby(pool.stats, "P2.claimed", 50)
    assert await pc.tick(fresh) is not None and pc.term is fresh


async def test_worker_heartbeats_move_the_capacity_and_every_rate_follows(aredis, pool, cfg):
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    now = await redis_ms(aredis)
    for w, cap in (("w1", 15000.0), ("w2", 15000.0)):
        await aredis.zadd(pool.workers, {w: now})
        await aredis.hset(pool.worker(w), mapping={"capacity_tokens_s": cap, "tokens_s": 80.0})
    await aredis.zadd(pool.workers, {"old": now - 60_000})  # silent past worker_ttl_s: not counted
    await aredis.hset(pool.worker("old"), "capacity_tokens_s", 99999.0)
    decision = await pc.tick(pc.term)
    assert decision.changed and decision.capacity == pytest.approx(30000.0)
    assert {c.reason for c in decision.classes} == {"capacity_change"}
    policy = await aredis.hgetall(pool.policy)
    assert float(policy[b"capacity"]) == pytest.approx(30000.0)
    assert float(policy[b"P1.rate"]) == pytest.approx(0.35 * 30000.0)
    assert float((await aredis.hgetall(pool.compliance))[b".capacity"]) == pytest.approx(30000.0)
    await aredis.zrem(pool.workers, "w2")  # a clean shutdown: its share leaves at once
    decision = await pc.tick(pc.term)  # a capacity change rescales at once, cooldown or not
    assert pc.term.estimator.estimate().live_workers == 1
    assert decision.changed and decision.capacity == pytest.approx(15000.0)
    assert float(await aredis.hget(pool.policy, "P1.rate")) == pytest.approx(0.35 * 15000.0)


async def test_rejections_count_against_a_class_only_inside_its_guarantee(aredis, pool, cfg):
    """A class turned away while it used less than its guaranteed rate was failed by the system
    (counted: the law protects it); one turned away over its guarantee is overload ending as
    designed (not counted, or the law would cut it for its own excess) -- unless it is the top
    class, which the law serves by cutting the others. Neither is work."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    term = pc.term
    assert term is not None
    await pc.tick(term)  # no traffic yet: every class used less than its guarantee
    assert term.within_guarantee == {"P0": True, "P1": True, "P2": True}
    now = await redis_ms(aredis)
    rejected = {"outcome": "rejected", "output_tokens": 0, "queue_wait_ms": 0, "e2e_ms": 900}
    for k in ("ttft_ms", "tpot_mean_ms", "tpot_max_ms"):
        rejected[k] = None
    await push(aredis, pool, [sample("P0", now) for _ in range(10)])
    await push(aredis, pool, [sample("P0", now) | rejected for _ in range(10)])
    await pc.consume_once(term)
    w = term.monitor.stats(now)["P0"]
    assert (w.count, w.met) == (20, 10)
    assert term.usage.mean_work("P0") == pytest.approx(200 + 100)  # the rejections did no work
    await push(aredis, pool, [sample("P1", now) for _ in range(5)])  # P1's mean work per request
    await pc.consume_once(term)
    await aredis.hincrby(pool.stats, "P0.claimed", 1000)  # P0 far over its guarantee now
    await aredis.hincrby(pool.stats, "P1.claimed", 1000)  # ...and P1 too
    await pc.tick(term)
    assert term.within_guarantee == {"P0": True, "P1": False, "P2": True}  # P0: the top class
    await push(aredis, pool, [sample("P1", now) | rejected for _ in range(5)])
    await pc.consume_once(term)
    assert term.monitor.stats(now)["P1"].count == 5 and term.consumed == 30  # the 5 ok ones only


class _TickThatEndsAsItIsCancelled(PoolController):
    """The real pool loop; its tick tells the test it ran, and finishes in the same turn of the
    event loop in which the test cancels the loop task: the race a stop meets, made certain."""

    ticked: asyncio.Event

    async def tick(self, term):
        self.ticked.set()
        return None


async def test_a_refusal_for_redis_own_state_is_an_outage_of_the_loop_not_its_error(aredis, pool, cfg):
    """A plain command (an XACK, a read of the stats) refused for the store's state --
    NOREPLICAS with min-replicas-to-write unmet -- was logged as the loop's own error and
    counted as a failed step (the stall watchdog's business); it is an outage, retried."""
    from redis.exceptions import ResponseError

    pc = pool_controller(cfg, aredis)

    async def refused() -> None:
        raise ResponseError("NOREPLICAS Not enough good replicas to write.")

    async def bug() -> None:
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    assert await pc._guard(refused(), "samples") is True and pc.redis_ok is False
    assert await pc._guard(bug(), "samples") is False


async def test_a_loop_stops_when_cancelled_as_its_step_finishes(aredis, pool, cfg):
    """Python 3.11's asyncio.wait_for returns the step's result instead of raising when the
    cancellation arrives after the step finished: the loop went on for ever and the test
    that stopped the controller hung until pytest's 300 s timeout (issue 14)."""
    s = fast_settings(cfg)
    pc = _TickThatEndsAsItIsCancelled(cfg=cfg, pool=cfg.pool("tiny"), settings=s, client=aredis,
                                      scripts=Scripts(aredis), metrics=ControllerMetrics(s.controller_id))
    pc.ticked = asyncio.Event()
    await pc.renew_once()
    assert pc.term is not None
    for _ in range(3):
        pc.ticked.clear()
        task = asyncio.create_task(pc.tick_loop())
        async with asyncio.timeout(10):  # (no task in between: we resume right after the tick)
            await pc.ticked.wait()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the tick loop swallowed its cancellation and kept running"
        assert task.cancelled()


async def test_a_redis_emptied_within_a_lease_starts_a_new_term_though_the_fence_repeats(aredis, pool, cfg):
    """Redis restarted without persistence (or was flushed) faster than a lease: the fence
    counter went with it, so the leader took the lease again with the fence it had (1, the
    first leadership's), the term went on, and its state kept the cuts it had written while
    the policy, re-created from the config by a frontend, held the configured rates: the two
    disagreed until the law next decided a change. A lease taken anew is a new leadership."""
    from limiter.scripts import policy_document

    pc = pool_controller(cfg, aredis)
    term = await _violate_and_tick(pc, aredis, pool)
    await aredis.hincrby(pool.stats, "P2.claimed", 10)
    decision = await pc.tick(term)
    assert decision is not None and decision.changed and term.fence == 1  # P2 cut, written
    cut = term.state.rates()["P2"].ceil
    await aredis.flushall()  # the data is gone (the connection, and the local lease, are not)
    await Scripts(aredis).init_pool(pool, policy_document(cfg, cfg.pool("tiny")))  # a frontend's admit
    configured = float(await aredis.hget(pool.policy, "P2.ceil"))
    assert configured > cut
    await pc.renew_once()  # the key is gone: taken again, and the counter restarts at 1
    assert pc.lease.fence == 1 and pc.term is not None
    assert pc.term is not term  # a new leadership: its state is what Redis holds now
    assert pc.term.state.rates()["P2"].ceil == pytest.approx(configured)


async def test_a_busy_sample_loop_stops_when_cancelled(aredis, pool, cfg):
    """redis-py sends every command through asyncio.wait_for (the client has a socket timeout),
    and on Python 3.11 that swallows a cancellation landing as the send finishes. With samples
    arriving faster than it reads, the sample loop never blocks, so a stop's cancellations
    often all landed in a send: the loop read and acknowledged on for the 6 s stop_tasks
    waits, then was left behind, and the standby took over seconds late. (The step here is a
    bare wait_for, the part of a redis-py call that loses the cancellation, every time.)"""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert pc.term is not None
    steps = 0

    async def sent() -> None:  # a send that finishes at once (the socket takes it)
        return None

    async def busy(_term) -> None:
        nonlocal steps
        steps += 1
        await asyncio.wait_for(sent(), 5.0)

    pc.consume_once = busy
    loop = asyncio.create_task(pc.sample_loop())
    await wait_for(lambda: asyncio.sleep(0, steps > 10))
    from limiter.tasks import stop_tasks

    stopped = await stop_tasks([loop], "sample loop", wait_s=1.0, rounds=2)
    if not stopped:  # (do not leave it spinning into the next test)
        pc.consume_once = lambda _term: asyncio.sleep(1.0)
        await stop_tasks([loop], "sample loop", wait_s=2.0)
    assert stopped


async def test_a_controller_that_stops_leading_stops_reporting_the_pools_figures(aredis, pool, cfg):
    """A deposed leader (or a stopped one) kept exporting the rates, ceilings, used, capacity
    and compliance of its last tick for as long as it ran: a standby's scrape showed a P0
    compliance that was no longer measured (an alert on it never cleared) and rates that
    were no longer in force, beside the new leader's."""
    pc = pool_controller(cfg, aredis)
    term = await _violate_and_tick(pc, aredis, pool)
    assert await pc.tick(term) is not None
    reg = pc.metrics.registry
    per_class = ("qos_controller_rate", "qos_controller_ceil", "qos_controller_used",
                 "qos_controller_compliance", "qos_controller_fresh_compliance", "qos_controller_queued",
                 "qos_controller_queued_tokens", "qos_controller_leased")
    assert reg.get_sample_value("qos_controller_compliance", {"pool": "tiny", "class": "P0"}) < 0.95
    assert reg.get_sample_value("qos_controller_capacity", {"pool": "tiny"}) is not None
    await aredis.set(pool.leader, f"b.0123abcd:{term.fence + 1}", px=10_000)
    await pc.renew_once()  # the lease is another's: the term ends
    assert pc.term is None and metric(pc, "qos_controller_leader", pool="tiny") == 0
    for name in per_class:
        for c in cfg.class_names():
            value = reg.get_sample_value(name, {"pool": "tiny", "class": c})
            assert value is None, f"{name}{{class={c}}} still {value} after the term ended"
    for name in ("qos_controller_capacity", "qos_controller_live_workers", "qos_controller_live_frontends"):
        value = reg.get_sample_value(name, {"pool": "tiny"})
        assert value is None, f"{name} still {value} after the term ended"


async def test_the_pools_queues_and_fleet_are_exported_as_redis_holds_them(aredis, pool, cfg):
    """What an autoscaler of the GPU fleet reads (no per-process metric can tell it): every
    tick the leader sets, per class, the requests queued, their reserved cost and the requests
    workers hold, and the workers and frontends that beat in time, from the same Redis state
    ``qos status`` reads."""
    scripts = Scripts(aredis)
    for tenant in ("t1", "t2", "t1"):
        await admit(scripts, pool, cls="P1", tenant=tenant, input_tokens=100, max_tokens=10)
    await admit(scripts, pool, cls="P2", input_tokens=40, max_tokens=5)
    got = await scripts.claim(pool, "w1", 1)  # one P1 to a worker
    assert [c.cls for c in got.requests] == ["P1"]
    now = await redis_ms(aredis)
    await aredis.zadd(pool.workers, {"w1": now, "w2": now, "gone": now - 3_600_000})
    await aredis.zadd(pool.frontends, {"fe2": now - 3_600_000})  # fe1: set up alive
    status = (await snapshot(aredis, cfg))["pools"]["tiny"]["classes"]
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    assert await pc.tick(pc.term) is not None

    def gauge(name: str, **labels: str) -> float | None:
        return pc.metrics.registry.get_sample_value(name, {"pool": "tiny", **labels})

    for c in cfg.class_names():
        assert gauge("qos_controller_queued", **{"class": c}) == status[c]["queued"], c
        cost = status[c]["queued_cost"]
        assert gauge("qos_controller_queued_tokens", **{"class": c}) == pytest.approx(cost), c
        assert gauge("qos_controller_leased", **{"class": c}) == status[c]["inflight"], c
    assert gauge("qos_controller_queued", **{"class": "P1"}) == 2
    assert gauge("qos_controller_queued", **{"class": "P2"}) == 1
    assert gauge("qos_controller_queued_tokens", **{"class": "P1"}) > 0
    assert gauge("qos_controller_leased", **{"class": "P1"}) == 1
    assert gauge("qos_controller_live_workers") == 2
    assert gauge("qos_controller_live_frontends") == 1
    await scripts.claim(pool, "w2", 8)  # the rest goes to a worker: the next tick reads it
    assert await pc.tick(pc.term) is not None
    assert gauge("qos_controller_queued", **{"class": "P1"}) == 0 == gauge("qos_controller_queued_tokens",
                                                                          **{"class": "P1"})
    assert gauge("qos_controller_leased", **{"class": "P1"}) == 3
    assert gauge("qos_controller_leased", **{"class": "P2"}) == 1
