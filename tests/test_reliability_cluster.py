"""The whole stack on a local 3-master Redis Cluster, through the HTTP API.

Two pools whose hash tags live on different shards are served by the same frontend
processes (each request goes to its pool's shard; every script touches one slot), one sim
worker per pool and a controller for both, all real processes started with
``redis.cluster = true``. Then the ledger: every request answered completely and coherently,
each admitted request ended exactly once on its own shard, charges reconciled, and no
per-request key left once the record TTL passed. (tests/test_cluster.py and
test_controller_cluster.py cover the scripts and the controller alone.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster

from limiter.keys import PoolKeys
from tests.support.redis_server import RedisClusterServers, pools_on_different_shards
from tests.support.reliability_stack import (
    LiveStack,
    Load,
    Recorder,
    base_config,
    check_charges,
    check_outcomes,
    drive,
    server_ledger,
    wait_buckets_full,
    wait_clean,
)

SIZES = [pytest.param(80, id="short"), pytest.param(600, id="full", marks=pytest.mark.slow)]


@pytest.fixture
async def cluster(redis_cluster: RedisClusterServers) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.url)
    await client.initialize()
    yield client
    await client.aclose()


@pytest.mark.parametrize("requests", SIZES)
async def test_two_pools_on_two_shards_end_to_end(
    redis_cluster: RedisClusterServers, cluster: RedisCluster, tmp_path: Path, requests: int
) -> None:
    pools = pools_on_different_shards(cluster)
    for p in pools:  # a previous run of this test in the same session
        async for k in cluster.scan_iter(match=PoolKeys(p).pattern()):
            await cluster.delete(k)
    cfg = base_config(redis_cluster.url, pools=pools, cluster=True)
    for p in cfg["pools"]:
        p["model"] = f"model-{p['name']}"
    stack = LiveStack(tmp_path, cfg)
    try:
        stack.frontend("fe0")
        stack.frontend("fe1")
        for p in pools:
            stack.worker(f"w-{p}", pool=p)
        stack.controller("ctl0")
        await stack.wait_ready(cluster)
        shards = {p: cluster.get_node_from_key(PoolKeys(p).policy).name for p in pools}
        assert len(set(shards.values())) == 2
        models = tuple(f"model-{p}" for p in pools)
        load = Load(n=requests, concurrency=16, max_tokens=(10, 60), models=models)
        async with Recorder(cluster, pools) as rec:
            outcomes = await drive(stack, ["fe0", "fe1"], load)
            rep = check_outcomes(outcomes, allowed_codes=("max_wait_exceeded",), rec=rec)
            await rec.scan()
            clean_s = await wait_clean(cluster, pools, timeout=30)
            rep.admitted, rep.samples, per_pool = await server_ledger(cluster, pools)
        states = check_charges(rec.records)
        assert sum(states.values()) == rep.admitted
        stack.procs["ctl0"].stop()  # rates stop moving: the buckets can be checked
        for p in pools:
            await wait_buckets_full(cluster, p)
        served = {p: sum(per_pool[p].values()) for p in pools}
        print(
            f"\n[cluster] pools {shards} on different shards; {rep.line()}; per pool {served}; "
            f"clean {clean_s:.1f} s after the load"
        )
        assert all(n > 0 for n in served.values())
        assert rep.kinds["ok"] > 0
    finally:
        stack.stop()
