"""limiter/script_batcher.py against a real redis-server: the script calls of one event-loop
turn share one pipeline, and each call still gets its own reply, its own error, and the
connection's failure."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

from limiter.config import RedisConfig, demo_config
from limiter.errors import InvalidArgument, RedisUnavailable
from limiter.keys import PoolKeys
from limiter.redis_conn import open_redis
from limiter.script_batcher import BATCH_LIMIT, LONE_CALL_BYTES, ScriptBatcher
from limiter.scripts import ADMIT_MERGE, MERGE_LIMITS, Scripts, lua_dir, policy_document
from tests.support.helpers import admit, dump_all, init_pool, wait_until
from tests.support.redis_server import free_port, pools_on_different_shards
from tests.support.stalling_proxy import StallingProxy


async def within(calls: list[Any], what: str) -> list[Any]:
    """The results of ``calls`` gathered (exceptions returned), or a failure naming ``what``
    after 30 s: a call whose reply never comes must fail the test, not hang it."""
    try:
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
    except TimeoutError:
        raise AssertionError(f"{what}: no reply within 30 s") from None


@pytest.fixture
async def scripts(scripts: Scripts) -> Scripts:
    """The scripts loaded, as every role does at start: a first call is not a NOSCRIPT."""
    await scripts.load_all()
    return scripts


@pytest.fixture
async def pools(scripts: Scripts, pool: PoolKeys) -> list[PoolKeys]:
    """Three initialised pools with a live frontend 'fe1': calls to different pools are
    different script calls (their admits are not merged into one)."""
    cfg = demo_config()
    out = [pool]
    for name in ("tiny-b", "tiny-c"):
        keys = PoolKeys(name)
        await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
        await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})
        out.append(keys)
    return out


async def test_calls_of_one_turn_share_one_round_trip_and_each_gets_its_own_reply(scripts, pools, sync_redis):
    assert scripts.batcher is not None
    trips, sent, merged = scripts.batcher.round_trips, scripts.batcher.calls, scripts.batcher.merged
    # different input sizes: a reply handed to the wrong call shows as the wrong cost
    sizes = [10 * (i + 1) for i in range(12)]
    results = await within([admit(scripts, pools[i % 3], request_id=f"r{i}", input_tokens=n, max_tokens=5)
                            for i, n in enumerate(sizes)], "12 admits to 3 pools")
    assert scripts.batcher.round_trips == trips + 1
    # one EVALSHA per pool, each with its 4 admits
    assert (scripts.batcher.calls, scripts.batcher.merged) == (sent + 3, merged + 9)
    solo = await admit(scripts, pools[0], request_id="solo", input_tokens=10, max_tokens=5)
    unit = solo.cost - 10  # the cost's part that is not the prompt (same max_tokens, class, weight)
    assert [r.cost - unit for r in results] == sizes
    assert scripts.batcher.round_trips == trips + 2  # a call alone goes alone, at once
    for i, n in enumerate(sizes):
        assert int(sync_redis.hget(pools[i % 3].request(f"r{i}"), "input_tokens")) == n
        assert int(sync_redis.hget(pools[i % 3].request(f"r{i}"), "seq")) == i // 3 + 1


async def test_more_calls_than_the_limit_go_in_several_pipelines(aredis, sync_redis):
    sha = await aredis.script_load("return redis.call('INCR', KEYS[1]) .. ARGV[1]")
    batcher = ScriptBatcher(aredis)
    n = 2 * BATCH_LIMIT + 3
    results = await within([batcher.evalsha(sha, ["n"], [f"-{i}"]) for i in range(n)], f"{n} calls")
    assert sorted(int(r.split(b"-")[1]) for r in results) == list(range(n))
    assert batcher.round_trips == 3 and batcher.calls == n and batcher.merged == 0  # each sent once
    assert int(sync_redis.get("n")) == n


async def test_admits_of_one_pool_in_one_turn_go_in_one_call_up_to_its_limit(scripts, pool, sync_redis):
    trips, sent, merged = scripts.batcher.round_trips, scripts.batcher.calls, scripts.batcher.merged
    n = 2 * ADMIT_MERGE + 3
    results = await within([admit(scripts, pool, request_id=f"r{i}", input_tokens=i) for i in range(n)],
                           f"{n} admits")
    assert [r.depth for r in results] == list(range(1, n + 1))  # in order, each seeing those before it
    # calls of 16, 16 and 3; a pipeline holds at most BATCH_LIMIT admits, merged or not
    assert scripts.batcher.round_trips == trips + 2
    assert (scripts.batcher.calls, scripts.batcher.merged) == (sent + 3, merged + n - 3)
    assert [int(sync_redis.hget(pool.request(f"r{i}"), "input_tokens")) for i in range(n)] == list(range(n))
    assert sync_redis.zcard(pool.deadlines) == n


async def test_one_calls_error_fails_that_call_only(scripts, pools, sync_redis):
    trips = scripts.batcher.round_trips
    good, bad = await within([admit(scripts, pools[0], request_id="good"),
                              admit(scripts, pools[1], request_id="bad", max_tokens=-1)], "two admits")
    assert scripts.batcher.round_trips == trips + 1
    assert not isinstance(good, BaseException) and good.duplicate_state is None
    assert isinstance(bad, InvalidArgument) and bad.field == "max_tokens"
    assert sync_redis.exists(pools[0].request("good")) and not sync_redis.exists(pools[1].request("bad"))


async def test_a_bad_argument_in_merged_admits_fails_its_own_admit_only(scripts, pool, sync_redis):
    """The merged call is refused whole (admit.lua checks every request before it writes);
    each admit then goes again on its own and gets its own answer."""
    trips = scripts.batcher.round_trips
    calls = [admit(scripts, pool, request_id="a"), admit(scripts, pool, request_id="bad", max_tokens=-1),
             admit(scripts, pool, request_id="b")]
    results = await within(calls, "three admits, one bad")
    assert scripts.batcher.round_trips == trips + 2  # the merged call, then each alone in one pipeline
    assert isinstance(results[1], InvalidArgument) and results[1].field == "max_tokens"
    assert [r.depth for r in (results[0], results[2])] == [1, 2]
    assert sync_redis.exists(pool.request("a"), pool.request("b")) == 2
    assert not sync_redis.exists(pool.request("bad"))


async def test_a_steps_completions_go_in_one_call_and_a_refused_one_fails_alone(scripts, pool, sync_redis):
    """A step worker completes its finished requests concurrently: one complete call. One
    whose offset Redis refuses (a push whose reply was lost had landed) refuses the merged
    call whole; each goes again alone, and the others finish with their own refunds."""
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        await admit(scripts, pool, request_id=rid, max_tokens=10 + i)
    held = {c.request_id: c for c in (await scripts.claim(pool, "w1", 8)).requests}
    sent, merged = scripts.batcher.calls, scripts.batcher.merged

    def complete(rid: str, **extra: Any) -> Any:
        return scripts.complete(pool, request_id=rid, worker_id="w1", fence=held[rid].fence, outcome="ok",
                                usage_in=10, token_ids=[1, 2], text="hi", **extra)
    refunds = await within([complete(rid) for rid in ids[:2]], "two completions")
    assert (scripts.batcher.calls, scripts.batcher.merged) == (sent + 1, merged + 1)
    assert refunds[1] - refunds[0] == 1  # one more token reserved, none more used: each its own reply
    merged = scripts.batcher.merged
    results = await within([complete("r2", offset=0), complete("r3", offset=5)], "two, one refused")
    assert scripts.batcher.merged == merged + 1  # sent merged, refused whole, then each alone
    assert isinstance(results[1], InvalidArgument) and results[1].field == "offset"
    assert not isinstance(results[0], BaseException)
    states = [sync_redis.hget(pool.request(rid), "state") for rid in ids]
    assert states == [b"done", b"done", b"done", b"leased"]


@pytest.mark.parametrize("merge", [True, False])
async def test_a_pipelines_replies_cut_as_a_cluster_returns_them_are_an_outage_of_every_call(
        aredis, pool, monkeypatch, merge):
    """redis-py's cluster pipeline does not raise when its connection breaks while the
    replies are read: each command's reply is the ConnectionError (``execute(raise_on_error=
    False)``). A merged call's must be an outage of each of its calls too (a step worker
    retries its completions through one), as a call of its own is: it was read as "not a list
    of replies", a ScriptError, which stopped the worker. Emulated on one server: the
    pipeline runs, then its replies are swapped for that failure. (A review found it.)"""
    scripts = Scripts(aredis, merge=merge)
    await scripts.load_all()
    for i in range(3):
        await admit(scripts, pool, request_id=f"r{i}")
    held = {c.request_id: c for c in (await scripts.claim(pool, "w1", 8)).requests}
    real = ScriptBatcher._pipeline

    async def cut(self: ScriptBatcher, units: Any) -> list[Any]:
        await real(self, units)  # Redis ran every script; the read of the replies broke
        return [RedisConnectionError("Connection closed by server.") for _ in units]
    monkeypatch.setattr(ScriptBatcher, "_pipeline", cut)

    def complete(rid: str) -> Any:
        return scripts.complete(pool, request_id=rid, worker_id="w1", fence=held[rid].fence, outcome="ok",
                                usage_in=10, token_ids=[1, 2], text="hi", offset=0)
    push = scripts.push_tokens(pool, request_id="r2", worker_id="w1", fence=held["r2"].fence, offset=0,
                               token_ids=[1], text="x")
    results = await within([complete("r0"), complete("r1"), push], "a step's two completions and a push")
    assert all(isinstance(r, RedisUnavailable) for r in results), results
    assert len({id(r) for r in results}) == 3  # each its own exception: one raised in many tasks


async def test_merged_admits_stay_under_the_size_of_a_lone_call(scripts, pool, sync_redis):
    """Admits whose payloads together pass LONE_CALL_BYTES are not merged into one call: a
    pipeline's replies all wait for the whole of it."""
    sent, merged = scripts.batcher.calls, scripts.batcher.merged
    payload = b"x" * (LONE_CALL_BYTES // 2 - 1024)

    def big(rid: str) -> Any:
        return scripts.admit(pool, request_id=rid, tenant="t1", cls="P1", input_tokens=10, max_tokens=5,
                             tenant_rate=1e9, tenant_burst=1e9, tenant_max_inflight=0, max_wait_ms=0,
                             frontend_id="fe1", payload=payload)
    results = await within([big(f"b{i}") for i in range(3)], "3 admits of half a lone call each")
    assert [r.depth for r in results] == [1, 2, 3]
    assert (scripts.batcher.calls, scripts.batcher.merged) == (sent + 2, merged + 1)  # two, then one


async def test_an_error_at_connect_fails_each_call_once_and_is_not_sent_again_and_again(redis_server, pools):
    """A refusal while the connection is set up (here SELECT of a database that does not
    exist; NOPERM under an ACL) is a ResponseError too. A merged call sent again as single
    calls met it again, and again, until Python's recursion limit (reviewed)."""
    for batch in (True, False):
        client = aioredis.from_url(redis_server.url.rsplit("/", 1)[0] + "/99")
        try:
            scripts = Scripts(client, batch=batch)
            calls = [admit(scripts, pools[i % 2], request_id=f"r{i}") for i in range(4)]
            results = await within(calls, f"4 admits, batch={batch}")
        finally:
            await client.aclose()
        kinds = {type(r).__name__ for r in results}
        assert kinds == {"ScriptError"}, (batch, results)
        if batch:
            assert scripts.batcher.round_trips <= 2, scripts.batcher.round_trips


async def test_a_lost_script_cache_is_loaded_again_for_every_call_of_the_pipeline(scripts, pools, sync_redis):
    sync_redis.script_flush()
    trips = scripts.batcher.round_trips
    results = await within([admit(scripts, pools[i % 3], request_id=f"r{i}", input_tokens=10 * (i + 1))
                            for i in range(6)], "6 admits to 3 pools after SCRIPT FLUSH")
    recorded = [float(sync_redis.hget(pools[i % 3].request(f"r{i}"), "cost")) for i in range(6)]
    assert [r.cost for r in results] == recorded
    # the NOSCRIPTs of the 3 merged calls came back in one pipeline, then each admit's own in one
    assert scripts.batcher.round_trips == trips + 2
    assert sum(sync_redis.zcard(keys.deadlines) for keys in pools) == 6


async def _cancelled_admit_sends_nothing(scripts: Scripts, pool: PoolKeys, sync_redis: Any,
                                        after_flush: bool) -> None:
    before, trips = dump_all(sync_redis), scripts.batcher.round_trips
    task = asyncio.create_task(admit(scripts, pool, request_id="gone"))
    await asyncio.sleep(0)  # the task queues its call; the flush comes after this turn
    if after_flush:  # after the flush has made the send's task, before that task's first step
        asyncio.get_running_loop().call_soon(task.cancel)
    else:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    assert scripts.batcher.round_trips == trips
    assert dump_all(sync_redis) == before


async def test_a_caller_cancelled_before_its_turn_ends_sends_nothing(scripts, pool, sync_redis):
    await _cancelled_admit_sends_nothing(scripts, pool, sync_redis, after_flush=False)


async def test_a_caller_cancelled_between_the_flush_and_the_send_sends_nothing(scripts, pool, sync_redis):
    await _cancelled_admit_sends_nothing(scripts, pool, sync_redis, after_flush=True)


async def test_a_call_with_large_arguments_goes_alone(scripts, pool, sync_redis):
    trips = scripts.batcher.round_trips
    big = scripts.admit(pool, request_id="big", tenant="t1", cls="P1", input_tokens=10, max_tokens=5,
                        tenant_rate=1e9, tenant_burst=1e9, tenant_max_inflight=0, max_wait_ms=0,
                        frontend_id="fe1", payload=b"x" * (LONE_CALL_BYTES + 1))
    results = await within([big, *(admit(scripts, pool, request_id=f"r{i}") for i in range(3))], "4 admits")
    assert not any(isinstance(r, BaseException) for r in results), results
    assert scripts.batcher.round_trips == trips + 2  # the three small ones together, the big one alone
    assert len(sync_redis.hget(pool.request("big"), "payload")) == LONE_CALL_BYTES + 1


async def test_calls_sent_together_to_a_server_without_shebang_support_all_switch_over():
    """The embedded fakeredis of `qos up` refuses `#!lua`: every call of the first pipeline
    meets the refusal, and each must be sent again without the line, not only the first."""
    client = fakeredis.FakeAsyncRedis()
    scripts = Scripts(client)  # no load_all: the controller calls scripts without one
    keys = PoolKeys("tiny")
    cfg = demo_config()
    doc = policy_document(cfg, cfg.pool("tiny"))
    results = await within([scripts.init_pool(keys, doc) for _ in range(3)], "3 init_pool calls")
    assert results == [0, 0, 0] and scripts.shebang is False


async def test_a_caller_cancelled_after_the_send_leaves_the_others_their_replies(scripts, pool, sync_redis):
    trips = scripts.batcher.round_trips
    gone = asyncio.create_task(admit(scripts, pool, request_id="gone"))
    stay = asyncio.create_task(admit(scripts, pool, request_id="stay"))
    # every=0: cancel as soon as the pipeline is written, before its replies can come
    await wait_until(lambda: scripts.batcher.round_trips > trips, "the pipeline of both calls sent", every=0)
    gone.cancel()
    assert (await stay).duplicate_state is None
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert sync_redis.exists(pool.request("stay"))  # and "gone" ran or not: Redis had it either way


async def test_a_connection_failure_fails_every_call_of_the_pipeline_as_an_outage():
    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=2)
    try:
        scripts = Scripts(client)
        calls = [admit(scripts, PoolKeys("tiny"), request_id=f"r{i}") for i in range(4)]
        results = await within(calls, "4 admits to a closed port")
        assert scripts.batcher.round_trips == 1
        assert all(isinstance(r, RedisUnavailable) for r in results), results
        assert len({id(r.__cause__) for r in results}) == 4  # each call raises its own exception
    finally:
        await client.aclose()


async def test_batch_false_sends_each_call_alone(aredis):
    assert Scripts(aredis, batch=False).batcher is None
    with pytest.raises(ValueError, match="limit"):
        ScriptBatcher(aredis, limit=0)


@pytest.fixture
async def cluster_scripts(redis_cluster) -> AsyncIterator[tuple[Scripts, list[PoolKeys]]]:
    """Scripts on a 3-master cluster, loaded, and two initialised pools on different shards,
    through a client made as the roles make theirs (no retries of its own, pool waits)."""
    client = open_redis(RedisConfig(url=redis_cluster.url, cluster=True), pool_wait_s=5)
    try:
        await client.initialize()
        scripts = Scripts(client)
        await scripts.load_all()
        pools = [PoolKeys(name) for name in pools_on_different_shards(client, prefix=f"batch{next(_runs)}-")]
        cfg = demo_config()
        for keys in pools:
            await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
        yield scripts, pools
    finally:
        await client.aclose()


_runs = itertools.count()


async def test_on_a_cluster_the_calls_of_one_turn_go_to_each_shard_in_one_pipeline(
        cluster_scripts, redis_cluster):
    scripts, pools = cluster_scripts
    trips = scripts.batcher.round_trips
    sizes = [10 * (i + 1) for i in range(8)]  # a reply handed to the wrong call shows as the wrong cost
    calls = [admit(scripts, pools[i % 2], request_id=f"r{i}", input_tokens=n) for i, n in enumerate(sizes)]
    results = await within(calls, "8 admits over two shards")
    assert scripts.batcher.round_trips == trips + 2  # a pipeline per hash slot
    for i, (r, n) in enumerate(zip(results, sizes, strict=True)):
        keys = pools[i % 2]
        shard = redis_cluster.owner(keys.request(f"r{i}")).client()
        assert float(shard.hget(keys.request(f"r{i}"), "cost")) == r.cost
        assert int(shard.hget(keys.request(f"r{i}"), "input_tokens")) == n


async def test_on_a_cluster_a_call_sent_to_a_node_that_no_longer_holds_its_slot_follows_the_move(
        cluster_scripts, redis_cluster):
    """A resharding: the client's slot map names the wrong node, which answers MOVED; the
    call goes again alone and lands where the slot is."""
    scripts, pools = cluster_scripts
    client = scripts.client
    keys, other = pools
    slot = key_slot(keys.policy.encode())
    nodes = client.nodes_manager.slots_cache
    nodes[slot] = [client.get_node_from_key(other.policy)]  # a stale map: the other pool's shard
    results = await within([admit(scripts, keys, request_id=f"m{i}") for i in range(3)], "admits, MOVED")
    assert all(not isinstance(r, BaseException) and r.duplicate_state is None for r in results), results
    shard = redis_cluster.owner(keys.policy).client()
    assert all(shard.exists(keys.request(f"m{i}")) for i in range(3))
    assert client.get_node_from_key(keys.policy).name != client.get_node_from_key(other.policy).name


async def test_on_a_cluster_a_pipeline_to_a_gone_node_fails_as_an_outage_and_the_next_reads_the_layout(
        cluster_scripts, redis_cluster):
    """A failover moved a shard: the client's map still names a node that is gone. Every call
    to it fails as an outage, a call of the same turn to another shard does not; later calls
    find the shard again (the client reads the cluster's layout), as a call sent alone would
    have made it do. Each turn's admits are one more than merge into one call: two calls in
    one pipeline, which reads no layout of its own before redis-py 8.2 (the batcher asks for
    it). redis-py 8.2 asks itself and reads the layout at most once per
    ``topology_refresh_min_interval`` (1 s by default): calls in between may still go to the
    gone node, and must fail as outages too, until the layout is read."""
    scripts, pools = cluster_scripts
    client = scripts.client
    keys = pools[0]
    kwargs = dict(client.get_node_from_key(keys.policy).connection_kwargs)
    del kwargs["host"], kwargs["port"]
    gone = ClusterNode("127.0.0.1", free_port(), "primary", **kwargs)
    client.nodes_manager.slots_cache[key_slot(keys.policy.encode())] = [gone]
    healthy = pools[1]
    piped = ADMIT_MERGE + 1
    calls = [admit(scripts, keys, request_id=f"g{i}") for i in range(piped)]
    calls.append(admit(scripts, healthy, request_id="h0"))  # the same turn, the other shard
    *failed, other = await within(calls, "admits, node gone")
    assert all(isinstance(r, RedisUnavailable) for r in failed), failed
    # the healthy shard's call ran, and its caller is told so (a pipeline over both nodes
    # failed it too, after it ran: the frontend then cancelled a queued request)
    assert not isinstance(other, BaseException) and other.duplicate_state is None, other
    deadline = time.monotonic() + 15  # bounds a hang: the layout is read within seconds
    for n in itertools.count():
        again = await within([admit(scripts, keys, request_id=f"a{n}-{i}") for i in range(piped)],
                             "admits after it")
        assert all(isinstance(r, RedisUnavailable) or (not isinstance(r, BaseException)
                   and r.duplicate_state is None) for r in again), again
        if not any(isinstance(r, BaseException) for r in again):
            break
        assert time.monotonic() < deadline, f"admits still failing after 15 s: {again}"
        await asyncio.sleep(0.05)
    assert redis_cluster.owner(keys.policy).client().exists(keys.request(f"a{n}-0"))


def test_a_loop_that_stopped_before_its_flush_does_not_strand_later_calls(redis_server, sync_redis):
    """A process whose first event loop ends between a call and the end of that turn (its
    flush never runs) goes on with a new loop: the batcher must not wait for that flush."""
    client = aioredis.from_url(redis_server.url)
    scripts = Scripts(client)
    first = asyncio.new_event_loop()  # it opens no connection: redis-py's are bound to their loop
    try:
        stranded = first.create_task(admit(scripts, PoolKeys("tiny"), request_id="stranded"))
        first.call_soon(first.stop)  # runs in the same turn as the task's first step: no flush
        first.run_forever()
        assert not stranded.done()  # queued, never sent: its loop stops for good below
    finally:
        first.close()

    async def on_a_new_loop() -> list[Any]:
        try:
            await scripts.load_all()
            await within([init_pool(scripts, demo_config())], "init_pool on a new loop")
            later = admit(scripts, PoolKeys("tiny"), request_id="later")
            return await within([later], "an admit on a new loop")
        finally:
            await client.aclose()

    (result,) = asyncio.run(on_a_new_loop())
    assert not isinstance(result, BaseException), result
    assert sync_redis.exists(PoolKeys("tiny").request("later"))
    assert not sync_redis.exists(PoolKeys("tiny").request("stranded"))


@pytest.mark.parametrize("keep", [1, 120], ids=["in the first reply", "after the first reply"])
async def test_a_connection_cut_while_the_replies_are_read_fails_every_call_as_an_outage(
        scripts, pools, redis_server, sync_redis, keep):
    """Redis ran every script of the pipeline (one per pool, two admits each; a reply of two
    is about 100 bytes); the client's read broke in its replies. Each call fails as an outage
    (whether it ran is not known to it), none is handed a reply that is not its own, and the
    next calls go on a new connection."""
    with StallingProxy(redis_server.port) as proxy:
        client = aioredis.from_url(proxy.url)
        try:
            relayed = Scripts(client)  # the same scripts, loaded on that server by the fixture
            proxy.cut_replies_after(b"EVALSHA", keep)
            def six() -> list[Any]:
                return [admit(relayed, pools[i % 3], request_id=f"r{i}", input_tokens=10 * (i + 1))
                        for i in range(6)]
            results = await within(six(), "6 admits whose replies are cut")
            assert relayed.batcher.round_trips == 1
            assert all(isinstance(r, RedisUnavailable) for r in results), results
            # They ran: sent again, each is its own duplicate, and a new request gets its own cost.
            again = await within([*six(), admit(relayed, pools[0], request_id="new", input_tokens=70)],
                                 "the same admits again and a new one")
        finally:
            await client.aclose()
    assert [a.duplicate_state for a in again[:6]] == ["queued"] * 6, again
    assert again[6].duplicate_state is None
    assert again[6].cost == float(sync_redis.hget(pools[0].request("new"), "cost"))
    assert sum(sync_redis.zcard(keys.deadlines) for keys in pools) == 7


@pytest.mark.parametrize("refusal", ["maxmemory", "replica"])
async def test_a_store_that_refuses_writes_fails_each_call_of_the_pipeline_as_an_outage(
        scripts, pools, sync_redis, refusal):
    """At maxmemory (noeviction) and on a server a failover made a replica, every admit of the
    pipeline is refused, each as an outage (the lone call's 503, not a 500), and nothing is
    written."""
    before, trips = dump_all(sync_redis), scripts.batcher.round_trips
    if refusal == "maxmemory":
        sync_redis.config_set("maxmemory", 1)
    else:
        sync_redis.replicaof("127.0.0.1", free_port())  # a master that never answers
    try:
        calls = [admit(scripts, pools[i], request_id=f"r{i}") for i in range(3)]
        results = await within(calls, "3 refused admits")
    finally:
        if refusal == "maxmemory":
            sync_redis.config_set("maxmemory", 0)
        else:
            sync_redis.replicaof("NO", "ONE")
    assert scripts.batcher.round_trips == trips + 1
    assert all(isinstance(r, RedisUnavailable) for r in results), results
    assert dump_all(sync_redis) == before


async def test_an_argument_redis_py_cannot_encode_fails_its_own_call_only(aredis, sync_redis):
    """redis-py refuses a None while it packs the pipeline, before anything is sent: the
    other calls are sent (alone) and answered, and each script ran once."""
    sha = await aredis.script_load("return redis.call('INCR', KEYS[1]) .. ARGV[1]")
    batcher = ScriptBatcher(aredis)
    results = await within([batcher.evalsha(sha, ["n"], ["a"]), batcher.evalsha(sha, ["n"], [None]),
                            batcher.evalsha(sha, ["n"], ["c"])], "3 calls, one with a None")
    assert isinstance(results[1], DataError), results
    assert sorted([results[0], results[2]]) in ([b"1a", b"2c"], [b"1c", b"2a"]), results
    assert int(sync_redis.get("n")) == 2  # the pipeline was never sent: 2 runs, not 2 + 2


@pytest.mark.parametrize("name", ["admit", "complete"])
def test_scripts_of_another_version_that_take_one_request_are_not_merged(tmp_path, aredis, name):
    """``Scripts(lua=...)`` with an admit.lua from before 2026-12-03 or a complete.lua from
    before 2026-12-04 (a benchmark's baseline): merged, its first request would be served
    and every other caller told no."""
    shutil.copytree(lua_dir(), tmp_path / "lua")
    script = tmp_path / "lua" / f"{name}.lua"
    assert Scripts(aredis, lua=tmp_path / "lua").merge_limits == MERGE_LIMITS
    assert set(MERGE_LIMITS) == {"admit", "complete"}
    script.write_text(script.read_text().replace("MAX_ITEMS", "MOST_ITEMS"))
    assert Scripts(aredis, lua=tmp_path / "lua").merge_limits == {
        other: limit for other, limit in MERGE_LIMITS.items() if other != name}
    assert Scripts(aredis, merge=False).merge_limits == {}
