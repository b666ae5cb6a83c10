"""The same scripts, unchanged, on a local 3-master Redis Cluster; two pools on different shards."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.scripts import Scripts, lifecycle_keys, policy_document
from tests.support.helpers import admit
from tests.support.redis_server import pools_on_different_shards


@pytest.fixture
async def cluster_client(redis_cluster):
    client = RedisCluster.from_url(redis_cluster.url)
    await client.initialize()
    yield client
    await client.aclose()


async def test_lifecycle_on_cluster_with_pools_on_different_shards(cluster_client):
    scripts = Scripts(cluster_client)
    cfg = demo_config()
    names = pools_on_different_shards(cluster_client)
    for name in names:
        keys = PoolKeys(name)
        assert len({key_slot(k.encode()) for k in lifecycle_keys(keys)}) == 1
        await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
        await cluster_client.zadd(keys.frontends, {"fe1": 4102444800000})
        await admit(scripts, keys, cls="P0", request_id=f"{name}-a", input_tokens=5, max_tokens=5)
        await admit(scripts, keys, cls="P2", request_id=f"{name}-b", input_tokens=5, max_tokens=5)
        got = await scripts.claim(keys, "w1", 1)
        c = got.requests[0]
        assert c.request_id == f"{name}-a"
        await scripts.push_tokens(keys, request_id=c.request_id, worker_id="w1", fence=c.fence, offset=0,
                                  token_ids=[65], text="A")
        await scripts.renew_leases(keys, "w1", [(c.request_id, 1)])
        await scripts.complete(keys, request_id=c.request_id, worker_id="w1", fence=c.fence, outcome="ok",
                               usage_in=5, token_ids=[66], text="B")
        assert await scripts.cancel(keys, f"{name}-b", "t1") == "cancelled"
        assert (await scripts.reap(keys)).expired == 0
        fence, _ = await scripts.acquire_leader(keys, "ctl", 1000)
        assert await scripts.set_rates(keys, "ctl", fence, {}, {"P0.rate": 10}) == 1
        entries = await cluster_client.xrange(keys.reply("fe1"))
        assert "".join(e[b"t"].decode() for _, e in entries) == "AB"


async def test_status_reads_each_pools_time_from_its_own_shard(cluster_client, monkeypatch):
    """A pool's buckets and heartbeats are stamped with its shard's clock; `qos status` aged
    and refilled every pool by one node's (TIME went to redis-py's default node): a host's
    clock skew moved every other pool's figures by it (found by a review of the operator
    paths)."""
    import dataclasses

    from limiter.status import snapshot

    names = pools_on_different_shards(cluster_client)
    base = demo_config()
    pools = tuple(dataclasses.replace(base.pool("tiny"), name=n) for n in names)
    cfg = dataclasses.replace(base, pools=pools)
    asked: list[str] = []
    real = cluster_client.execute_command

    async def spy(*args, **kwargs):
        if args and args[0] == "TIME":
            nodes = kwargs.get("target_nodes")
            asked.append(getattr(nodes, "name", "default"))
        return await real(*args, **kwargs)

    monkeypatch.setattr(cluster_client, "execute_command", spy)
    snap = await snapshot(cluster_client, cfg)
    assert set(snap["pools"]) == set(names)
    assert asked == [cluster_client.get_node_from_key(PoolKeys(n).policy).name for n in names]


async def test_status_names_the_shard_that_may_evict_keys_and_only_its_pools(cluster_client):
    """`redis_eviction` is read from each pool's own shard (INFO memory of that node): one
    shard under an evicting policy is named for its pools, not for the others."""
    import dataclasses

    from limiter.status import snapshot

    names = pools_on_different_shards(cluster_client)
    base = demo_config()
    pools = tuple(dataclasses.replace(base.pool("tiny"), name=n) for n in names)
    cfg = dataclasses.replace(base, pools=pools)
    risky = cluster_client.get_node_from_key(PoolKeys(names[0]).policy)
    before = await cluster_client.execute_command("CONFIG GET", "maxmemory*", target_nodes=risky)
    await cluster_client.execute_command("CONFIG SET", "maxmemory", "1gb", "maxmemory-policy", "allkeys-lru",
                                         target_nodes=risky)
    try:
        snap = await snapshot(cluster_client, cfg)
    finally:
        await cluster_client.execute_command(
            "CONFIG SET", "maxmemory", before["maxmemory"], "maxmemory-policy", before["maxmemory-policy"],
            target_nodes=risky)
    assert "allkeys-lru" in snap["pools"][names[0]]["redis_eviction"]
    assert [snap["pools"][n]["redis_eviction"] for n in names[1:]] == [None] * (len(names) - 1)
