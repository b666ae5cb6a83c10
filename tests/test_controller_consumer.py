"""The samples consumer group: a dead consumer's pending entries are claimed, our own are
replayed, nothing is counted twice, and bad samples are counted, logged and acknowledged."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest

from limiter.keys import SAMPLES_GROUP
from limiter.tasks import stop_tasks
from tests.support.controller_helpers import metric, pool_controller, push, sample
from tests.support.helpers import redis_ms


async def _group(client, keys) -> None:
    await client.xgroup_create(keys.samples, SAMPLES_GROUP, id="$", mkstream=True)


async def _deliver_without_ack(client, keys, consumer: str, count: int) -> None:
    """What a controller that died mid-batch leaves behind: entries delivered, never acked."""
    reply = await client.xreadgroup(SAMPLES_GROUP, consumer, {keys.samples: ">"}, count=count)
    assert len(reply[0][1]) == count


async def _pending(client, keys) -> int:
    return (await client.xpending(keys.samples, SAMPLES_GROUP))["pending"]


async def test_a_dead_consumers_pending_samples_are_claimed_once(aredis, pool, cfg):
    await _group(aredis, pool)
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P0", now + i) for i in range(30)])
    await _deliver_without_ack(aredis, pool, "dead-leader", 20)  # it read 20 and died
    await push(aredis, pool, [sample("P1", now + 100 + i) for i in range(15)])
    await asyncio.sleep(0.25)  # older than claim_idle_s (0.2 s)

    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    term = pc.term
    for _ in range(3):  # catch up (claim 20), then the 25 never delivered, then nothing new
        await pc.consume_once(term)
    assert term.consumed == 45
    stats = term.monitor.stats()
    assert stats["P0"].count == 30 and stats["P1"].count == 15  # each exactly once
    assert metric(pc, "qos_controller_claimed_samples_total", pool="tiny", how="autoclaimed") == 20
    assert metric(pc, "qos_controller_samples_total", pool="tiny", **{"class": "P0"}) == 30
    assert await _pending(aredis, pool) == 0
    term.next_claim = 0  # force the periodic XAUTOCLAIM: it finds nothing left to count
    await pc.consume_once(term)
    assert term.consumed == 45


async def test_our_own_pending_samples_are_replayed_first(aredis, pool, cfg):
    await _group(aredis, pool)
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P0", now + i) for i in range(12)])
    await _deliver_without_ack(aredis, pool, "a", 10)  # an earlier incarnation of --id a
    # claim_idle_s is long: only the replay (XREADGROUP ... 0) can find them now
    pc = pool_controller(cfg, aredis, claim_idle_s=60.0)
    await pc.renew_once()
    await pc.consume_once(pc.term)
    await pc.consume_once(pc.term)
    assert pc.term.consumed == 12
    assert metric(pc, "qos_controller_claimed_samples_total", pool="tiny", how="replayed") == 10
    assert await _pending(aredis, pool) == 0


async def test_a_standby_does_not_read_and_a_deposed_leader_leaves_entries_pending(aredis, pool, cfg):
    a = pool_controller(cfg, aredis)
    b = pool_controller(cfg, aredis, controller_id="b")
    await a.renew_once()
    await b.renew_once()
    assert a.term is not None and b.term is None
    await push(aredis, pool, [sample("P0", await redis_ms(aredis)) for _ in range(5)])
    term = a.term
    batch = await a.consumer.read_new(50)
    a.step_down("test: deposed while the batch was in flight")
    await a.take(term, batch)  # too late: not fed, not acked
    assert term.consumed == 0 and await _pending(aredis, pool) == 5
    await aredis.delete(pool.leader)
    await asyncio.sleep(0.25)
    await b.renew_once()
    await b.consume_once(b.term)  # b claims what a left pending
    assert b.term.consumed == 5 and await _pending(aredis, pool) == 0


async def test_bad_samples_are_counted_logged_acked_and_skipped(aredis, pool, cfg, caplog):
    caplog.set_level(logging.WARNING, "qos.controller")
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    now = await redis_ms(aredis)
    good = [sample("P0", now + i, ttft_ms=100.0) for i in range(5)]
    no_ts = sample("P0", now)
    del no_ts["ts_ms"]
    async with aredis.pipeline(transaction=False) as pipe:
        pipe.xadd(pool.samples, {"d": b"\xc1\x00garbage"})  # 0xc1 is never valid msgpack
        pipe.xadd(pool.samples, {"d": msgpack.packb([1, 2, 3])})  # not a map
        pipe.xadd(pool.samples, {"d": msgpack.packb(no_ts)})  # a required field missing
        pipe.xadd(pool.samples, {"d": msgpack.packb(sample("P0", now, ttft_ms=-5.0))})  # negative time
        pipe.xadd(pool.samples, {"d": msgpack.packb(sample("P0", now, queue_wait_ms=-1.0))})
        pipe.xadd(pool.samples, {"d": msgpack.packb(sample("P9", now))})  # unknown class
        pipe.xadd(pool.samples, {"x": b"1"})  # no d field at all
        await pipe.execute()
    await push(aredis, pool, good)
    for _ in range(2):
        await pc.consume_once(pc.term)
    term = pc.term
    assert term.consumed == 5 and term.bad == 7
    stats = term.monitor.stats()["P0"]
    assert stats.count == 5 and stats.compliance == 1.0  # the window only holds the good ones
    assert await _pending(aredis, pool) == 0  # bad ones acked too: they never come back
    for field, n in [("d", 2), ("sample", 1), ("sample.ts_ms", 1), ("sample.ttft_ms", 1),
                     ("sample.queue_wait_ms", 1), ("sample.class", 1)]:
        assert metric(pc, "qos_controller_bad_samples_total", pool="tiny", field=field) == n, field
    assert any("bad sample" in r.message for r in caplog.records)
    decision = await pc.tick(term)  # and the controller goes on
    assert decision is not None


@pytest.mark.parametrize("payload", [b"", b"\x93\x01", msgpack.packb({"class": b"\xff\xfe"})])
async def test_odd_payloads_never_raise(aredis, pool, cfg, payload):
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    await aredis.xadd(pool.samples, {"d": payload})
    await pc.consume_once(pc.term)
    assert pc.term.bad == 1 and await _pending(aredis, pool) == 0


async def test_a_group_redis_refuses_to_recreate_is_retried_with_backoff_not_in_a_tight_loop(aredis, pool,
                                                                                           cfg):
    """The stream (and its group) gone and XGROUP CREATE refused (here: Redis out of memory
    under noeviction): the sample loop went straight from NOGROUP to the refused create and
    back, thousands of round trips and logged tracebacks a second, with no back-off."""
    pc = pool_controller(cfg, aredis)
    await pc.renew_once()
    await pc.consume_once(pc.term)
    await aredis.delete(pool.samples)
    creates = 0
    real = pc.consumer.ensure_group

    async def counted() -> None:
        nonlocal creates
        creates += 1
        await real()

    pc.consumer.ensure_group = counted
    await aredis.config_set("maxmemory", 1)
    loop = asyncio.create_task(pc.sample_loop())
    try:
        await asyncio.sleep(1.0)
        in_a_second = creates
    finally:
        # (memory back first: a loop spinning through redis-py calls loses the cancellations
        # that land in a send -- Python 3.11's wait_for -- and a stop would wait for ever)
        await aredis.config_set("maxmemory", 0)
        assert await stop_tasks([loop], "sample loop", wait_s=1.0)
    assert 1 <= in_a_second <= 8  # back-off from 0.1 s, doubling: about 4 attempts in a second


async def test_pending_entries_trimmed_away_are_acked_without_counting_as_bad_samples(aredis, pool, cfg):
    """An entry delivered but trimmed from the stream before anyone acked it comes back from
    XREADGROUP ... 0 with no data; redis-py hands it over as ``{}``, not None, so the check
    for trimmed entries never matched and each was counted and logged as a bad sample (no
    'd' field): a writer bug that does not exist."""
    await _group(aredis, pool)
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P0", now + i) for i in range(5)])
    await _deliver_without_ack(aredis, pool, "a", 5)  # an earlier incarnation of --id a
    await aredis.xtrim(pool.samples, maxlen=0)  # the writers' MAXLEN caught up with them
    await push(aredis, pool, [sample("P0", now + 10)])
    pc = pool_controller(cfg, aredis, claim_idle_s=60.0)
    await pc.renew_once()
    await pc.consume_once(pc.term)
    assert (pc.term.consumed, pc.term.bad) == (1, 0)
    assert metric(pc, "qos_controller_bad_samples_total", pool="tiny", field="d") == 0
    assert await _pending(aredis, pool) == 0  # acknowledged all the same: they never come back


async def _consumers(client, keys) -> dict[str, int]:
    return {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: c["pending"]
            for c in await client.xinfo_consumers(keys.samples, SAMPLES_GROUP)}


async def test_idle_consumers_with_nothing_pending_are_removed_when_a_term_catches_up(aredis, pool, cfg):
    """Every controller process reads under an id of its own (<host>-<pid>), so each restart
    left one more consumer in the group for good. A term's catch-up removes those idle past
    claim_idle_ms with nothing pending (once autoclaim took a dead leader's entries, it too),
    a bounded number per call; a consumer still holding entries stays."""
    await _group(aredis, pool)
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P0", now + i) for i in range(6)])
    for old in ("restarted-1", "restarted-2"):  # read and acked, long ago
        reply = await aredis.xreadgroup(SAMPLES_GROUP, old, {pool.samples: ">"}, count=1)
        await aredis.xack(pool.samples, SAMPLES_GROUP, reply[0][1][0][0])
    await _deliver_without_ack(aredis, pool, "dead-leader", 2)
    await asyncio.sleep(0.25)  # all three idle past claim_idle_s (0.2 s): a lower bound
    pc = pool_controller(cfg, aredis)
    assert await pc.consumer.prune_consumers(limit=1) == 1  # bounded
    assert await pc.consumer.prune_consumers() == 1
    assert set(await _consumers(aredis, pool)) == {"dead-leader"}  # it holds 2 entries
    await pc.renew_once()
    await pc.consume_once(pc.term)  # catch up: replay, autoclaim (dead-leader's 2), prune
    assert set(await _consumers(aredis, pool)) == {pc.consumer.consumer}
    assert await _pending(aredis, pool) == 0


async def test_an_acl_without_the_pruning_commands_does_not_stop_the_samples(aredis, pool, cfg, monkeypatch):
    """A qos user set up with an ACL line from before the pruning lacks XINFO CONSUMERS: the
    catch-up must go on reading samples (pruning is housekeeping), not fail every time."""
    import redis.exceptions

    await _group(aredis, pool)
    now = await redis_ms(aredis)
    await push(aredis, pool, [sample("P0", now + i) for i in range(5)])
    pc = pool_controller(cfg, aredis)

    async def refused(*_args, **_kwargs):
        raise redis.exceptions.NoPermissionError("NOPERM no permissions to run 'xinfo|consumers'")

    monkeypatch.setattr(pc.client, "xinfo_consumers", refused)
    await pc.renew_once()
    term = pc.term
    await pc.consume_once(term)
    await pc.consume_once(term)
    assert term.caught_up and term.consumed == 5
