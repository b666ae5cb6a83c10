"""The controller runs unchanged on a 3-master Redis Cluster: every key of a pool shares its
hash tag, so the lease, the samples group, the tick's reads and set_rates each hit one slot."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from limiter.config import PoolConfig, RedisConfig, demo_config
from limiter.controller.leader import holder_id
from limiter.controller.service import Controller
from limiter.keys import PoolKeys
from tests.support.controller_helpers import fast_settings, metric, push, sample, wait_for
from tests.support.redis_server import move_slot


async def test_the_controller_leads_consumes_and_decides_on_a_cluster(redis_cluster) -> None:
    base = demo_config()
    # a pool name of its own: the cluster is shared by the whole session and never flushed
    cfg = dataclasses.replace(base, redis=RedisConfig(url=redis_cluster.url, cluster=True),
                              pools=(PoolConfig(name="ctl-cluster"),))
    keys = PoolKeys("ctl-cluster")
    ctl = Controller(fast_settings(cfg), cfg)
    claims: asyncio.Task[None] | None = None
    try:
        await ctl.start()
        pc = ctl.pools["ctl-cluster"]
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None))
        sec, _ = await ctl.client.time()
        now = int(sec) * 1000
        p2 = [sample("P2", now - 2000, input_tokens=4000, output_tokens=100) for _ in range(10)]
        await push(ctl.client, keys, p2 + [sample("P0", now, ttft_ms=3000.0) for _ in range(30)])
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None and pc.term.consumed == 40))
        # P2 keeps claiming, as workers would: the law cuts a class only for what it uses now
        # (claimed/s from the stats counters), so without claims P2 would not be interfering.
        claims = asyncio.create_task(keep_claiming(ctl.client, keys, "P2"))
        await wait_for(lambda: ctl.client.xlen(keys.decisions))  # P0 violates: P2 is cut, written
        await wait_for(lambda: ctl.client.hget(keys.compliance, "P0"))
        assert await ctl.client.get(keys.leader) == f"{pc.lease.owner}:{pc.term.fence}".encode()
        assert holder_id(pc.lease.owner) == "a"
    finally:
        # Bounded, so that a stuck teardown fails here with its own traceback instead of at
        # pytest-timeout's 300 s (one loaded run hung in this test, where is not known).
        if claims is not None:
            claims.cancel()
            done, _ = await asyncio.wait({claims}, timeout=10)
            assert done, "keep_claiming still running 10 s after its cancellation"
        await asyncio.wait_for(ctl.stop(), 30)  # stop_tasks gives up after 6 s; release after 2


async def keep_claiming(client, keys: PoolKeys, cls: str) -> None:
    while True:
        await client.hincrby(keys.stats, f"{cls}.claimed", 1)
        await asyncio.sleep(0.02)


async def test_a_reshard_of_the_pools_slot_is_an_outage_of_the_sample_loop_not_its_error(
        redis_cluster, caplog) -> None:
    """``redis-cli --cluster reshard`` of the pool's slot (docs/scaling.md) MIGRATEs the
    samples stream: Redis deletes it on the old owner and answers the leader's blocked
    XREADGROUP "UNBLOCKED the stream key no longer exists" (a manual CLUSTER FAILOVER answers it
    "UNBLOCKED force unblock ..."): Redis' state, as for a worker's BLPOP (redis_conn.
    store_refused). The sample loop logged it as its own ERROR ("sample read failed") and did
    not count it; it is an outage, and the samples go on being read on the new owner."""
    pool = "ctl-reshard"
    cfg = dataclasses.replace(demo_config(), redis=RedisConfig(url=redis_cluster.url, cluster=True),
                              pools=(PoolConfig(name=pool),))
    keys = PoolKeys(pool)
    ctl = Controller(fast_settings(cfg, block_s=5.0), cfg)  # the reader sits blocked in XREADGROUP
    try:
        await ctl.start()
        pc = ctl.pools[pool]
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None))
        sec, _ = await ctl.client.time()
        now = int(sec) * 1000
        await push(ctl.client, keys, [sample("P1", now) for _ in range(5)])
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None and pc.term.consumed == 5))
        owner = redis_cluster.owner(keys.samples)

        def blocked_reader() -> bool:
            with owner.client() as c:
                return any(e["cmd"] == "xreadgroup" and "b" in e["flags"] for e in c.client_list())

        await wait_for(lambda: asyncio.to_thread(blocked_reader))
        caplog.set_level(logging.WARNING, logger="qos.controller")
        await asyncio.to_thread(move_slot, redis_cluster, keys.samples)
        errors = lambda: metric(pc, "qos_controller_redis_errors_total", loop="samples")  # noqa: E731
        await wait_for(lambda: asyncio.sleep(0, errors()), timeout=10)
        await push(ctl.client, keys, [sample("P1", now) for _ in range(5)])
        await wait_for(lambda: asyncio.sleep(0, pc.term is not None and pc.term.consumed == 10), timeout=20)
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not logged, [r.getMessage() for r in logged]
    finally:
        await asyncio.wait_for(ctl.stop(), 30)
