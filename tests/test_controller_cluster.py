"""The controller runs unchanged on a 3-master Redis Cluster: every key of a pool shares its
hash tag, so the lease, the samples group, the tick's reads and set_rates each hit one slot."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

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


async def test_the_leader_publishes_through_a_reshard_of_its_pools_slot(redis_cluster, caplog) -> None:
    """While ``redis-cli --cluster reshard`` moves the pool's slot, a key already moved is
    reached with ASK, and after the move every command on the old map meets MOVED. The tick's
    compliance hash (``publish``) went in a MULTI/EXEC, which redis-py's cluster client does
    not redirect: each tick once the hash had moved failed with AskError (an ERROR traceback a
    tick, the tick not counted: a move longer than the stall limit made the leader give up its
    term), the AskError pointed the client's slot map at the importing node (the tick's reads
    then failed as an outage too), and the first tick after a move met MovedError. Now the
    hash is published through the move."""
    pool = "ctl-publish"
    cfg = dataclasses.replace(demo_config(), redis=RedisConfig(url=redis_cluster.url, cluster=True),
                              pools=(PoolConfig(name=pool),))
    keys = PoolKeys(pool)
    ctl = Controller(fast_settings(cfg), cfg)
    try:
        await ctl.start()
        pc = ctl.pools[pool]
        await wait_for(lambda: ctl.client.hget(keys.compliance, ".updated_ms"))
        caplog.set_level(logging.WARNING, logger="qos.controller")
        seen: list[int] = []

        def midway() -> None:  # the hash is on the new owner, the rest still on the old one
            seen.append(_published_ms(redis_cluster, keys))
            deadline = time.monotonic() + 5  # fifty ticks
            while seen[-1] <= seen[0] and time.monotonic() < deadline:
                time.sleep(0.02)
                seen.append(_published_ms(redis_cluster, keys))

        # to a primary that never ran the scripts (its cache flushed): the tick's EVALSHA
        # redirected there met NOSCRIPT, and loading the script on the slot map's owner (the
        # source) did not help the retry, redirected there again (every tick of the move)
        await asyncio.to_thread(move_slot, redis_cluster, keys.compliance, first=[keys.compliance],
                                midway=midway, fresh_target=True)
        assert seen[-1] > seen[0], f"no tick published the hash while the slot moved ({seen[0]} throughout)"
        sec, _ = await ctl.client.time()
        await wait_for(lambda: _published_since(ctl.client, keys, int(sec) * 1000 + 300))
        logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not logged, [r.getMessage() for r in logged]
        assert pc.term is not None and pc.term.fence == 1  # the same term throughout
    finally:
        await asyncio.wait_for(ctl.stop(), 30)


def _published_ms(cluster, keys: PoolKeys) -> int:
    """The hash's ``.updated_ms`` from whichever node serves it now (with ASKING: the importing
    node during a move), read beside the controller's client, whose slot map it leaves alone."""
    for node in cluster.nodes:
        with node.client() as c:
            pipe = c.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.hget(keys.compliance, ".updated_ms")
            _, value = pipe.execute(raise_on_error=False)
        if value is not None and not isinstance(value, Exception):
            return int(value)
    return 0


async def _published_since(client, keys: PoolKeys, ms: int) -> bool:
    return int(await client.hget(keys.compliance, ".updated_ms") or 0) > ms
