"""init_pool.lua over a running pool: a deploy that rewrites the policy while requests are
queued. Switching a class's `fair` flag changes what its backlog's scores mean (virtual
token counters in a fair class, the seq of each tenant's oldest request in an arrival-order
one): the backlog is rescored by the same call (docs/scheduling.md)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from limiter.config import QosConfig
from limiter.keys import PoolKeys
from limiter.scripts import Scripts, policy_document
from tests.support.helpers import admit, class_cfg, init_pool, script_commands
from tests.support.redis_server import RedisServer

LONG = {"max_wait_ms": 600_000}


async def _switch(scripts: Scripts, keys: PoolKeys, cfg: QosConfig) -> None:
    """A role on another configuration starts: init_pool, keeping the controller's rates."""
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))


async def _scores(scripts: Scripts, keys: PoolKeys, cls: str) -> dict[str, float]:
    return {t.decode(): s for t, s in await scripts.client.zrange(keys.backlog(cls), 0, -1, withscores=True)}


async def _oldest_seq(scripts: Scripts, keys: PoolKeys, cls: str, tenant: str) -> float:
    return (await scripts.client.zrange(keys.queue(cls, tenant), 0, 0, withscores=True))[0][1]


async def _serve(scripts: Scripts, keys: PoolKeys, tenant: str, n: int, cost_tokens: int) -> None:
    """``n`` requests of ``tenant`` in P1, each claimed and finished: its counter grows."""
    for i in range(n):
        await admit(scripts, keys, cls="P1", tenant=tenant, request_id=f"{tenant}-served-{i}",
                    input_tokens=cost_tokens - 10, max_tokens=10)
        (c,) = (await scripts.claim(keys, "w1", 1)).requests
        await scripts.complete(keys, request_id=c.request_id, worker_id="w1", fence=c.fence, outcome="ok",
                               usage_in=cost_tokens - 10, token_ids=[1] * 10)


async def test_requests_queued_when_a_class_turns_to_arrival_order_keep_their_place(scripts, sync_redis):
    """Fair -> arrival order: a tenant backlogged at the switch kept its virtual counter
    (10,000 here) as its score, while a later tenant's was the seq of its request (a few
    dozen): the older request went after every later one, and, while the class stayed
    busy, until it expired."""
    keys = await init_pool(scripts, class_cfg(P1=LONG))
    await _serve(scripts, keys, "old", 10, 1000)
    await admit(scripts, keys, cls="P1", tenant="old", request_id="old-q", input_tokens=90, max_tokens=10)
    assert (await _scores(scripts, keys, "P1"))["old"] >= 10_000
    await _switch(scripts, keys, class_cfg(P1={**LONG, "fair": False}))
    for i in range(3):
        await admit(scripts, keys, cls="P1", tenant="new", request_id=f"new-{i}", input_tokens=90,
                    max_tokens=10)
    assert await _scores(scripts, keys, "P1") == {"old": await _oldest_seq(scripts, keys, "P1", "old"),
                                                  "new": await _oldest_seq(scripts, keys, "P1", "new")}
    assert await scripts.client.exists(keys.vtime("P1")) == 0  # no counters kept in arrival order
    got = await scripts.claim(keys, "w1", 4)
    assert [c.request_id for c in got.requests] == ["old-q", "new-0", "new-1", "new-2"]


async def test_tenants_queued_when_a_class_turns_fair_share_it_from_the_switch(scripts, sync_redis):
    """Arrival order -> fair: the backlogged tenants kept the seqs of their oldest requests as
    counters, so a tenant whose oldest request was 40 admissions older took 40 weighted
    tokens of the class before the other got anything; and a tenant whose counter was kept
    from an earlier fair period (10,000) came back that far behind the others: it waited
    until they had been served 10,000 tokens more. From the switch on they share equally."""
    keys = await init_pool(scripts, class_cfg(P1=LONG))
    await _serve(scripts, keys, "rich", 10, 1000)  # its counter (10,000) is kept while it is idle
    await _switch(scripts, keys, class_cfg(P1={**LONG, "fair": False}))
    # 40 admissions in between: the seqs of early's and late's oldest requests are 40 apart
    for cls, tenant, n in (("P1", "early", 10), ("P2", "filler", 40), ("P1", "late", 10)):
        for i in range(n):
            await admit(scripts, keys, cls=cls, tenant=tenant, request_id=f"{tenant}-{i}", input_tokens=1,
                        max_tokens=1)
    await _switch(scripts, keys, class_cfg(P1=LONG))
    scores = await _scores(scripts, keys, "P1")
    assert scores["early"] == scores["late"]
    await admit(scripts, keys, cls="P1", tenant="rich", request_id="rich-0", input_tokens=1, max_tokens=1)
    scores = await _scores(scripts, keys, "P1")
    assert max(scores.values()) - min(scores.values()) <= 2  # within one request's cost
    got = await scripts.claim(keys, "w1", 6, above_class="P2")  # P1 only (P0 is empty)
    # equal counters (ties by name), each claim adds the request's cost (2)
    assert [c.tenant for c in got.requests] == ["early", "late", "rich", "early", "late", "early"]


async def test_a_refund_after_a_class_turns_to_arrival_order_leaves_its_order_alone(scripts, sync_redis):
    """A request claimed while the class was fair (its counter charged) and finished after
    the switch got its unused reservation back on its tenant's score -- by then the seq of
    the tenant's oldest request: the tenant went ahead of older requests of others."""
    keys = await init_pool(scripts, class_cfg(P1=LONG))
    await admit(scripts, keys, cls="P1", tenant="x", request_id="x-1", input_tokens=900, max_tokens=100)
    (x1,) = (await scripts.claim(keys, "w1", 1)).requests
    await _switch(scripts, keys, class_cfg(P1={**LONG, "fair": False}))
    await admit(scripts, keys, cls="P1", tenant="y", request_id="y-1", input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="x", request_id="x-2", input_tokens=1, max_tokens=1)
    await scripts.complete(keys, request_id="x-1", worker_id="w1", fence=x1.fence, outcome="ok", usage_in=1,
                           token_ids=[1])  # 998 of its 1,000 unused
    assert (await _scores(scripts, keys, "P1"))["x"] == await _oldest_seq(scripts, keys, "P1", "x")
    rec = await scripts.client.hgetall(keys.request("x-1"))
    assert float(rec[b"c_vtc"]) == 1000 and float(rec[b"r_vtc"]) == 0  # nothing given to a counter
    got = await scripts.claim(keys, "w1", 2)
    assert [c.request_id for c in got.requests] == ["y-1", "x-2"]


async def test_a_class_removed_and_restored_keeps_its_arrival_order(scripts, sync_redis):
    """While a deploy has removed an arrival-order class, its queued requests still expire
    (or are cancelled): their tenant's score must move on to its next request, as it does
    while the class is in the policy, so that the class restored serves in arrival order."""
    cfg = class_cfg(P2={"fair": False, "max_wait_ms": 600_000})
    keys = await init_pool(scripts, cfg)
    await admit(scripts, keys, cls="P2", tenant="a", request_id="a-1", input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P2", tenant="b", request_id="b-1", input_tokens=1, max_tokens=1)
    await admit(scripts, keys, cls="P2", tenant="a", request_id="a-2", input_tokens=1, max_tokens=1)
    doc = policy_document(cfg, cfg.pool("tiny"))
    doc["classes"] = doc["classes"][:2]
    await scripts.init_pool(keys, doc)
    assert await scripts.cancel(keys, "a-1", "a") == "cancelled"
    await _switch(scripts, keys, cfg)
    assert await _scores(scripts, keys, "P2") == {"a": await _oldest_seq(scripts, keys, "P2", "a"),
                                                  "b": await _oldest_seq(scripts, keys, "P2", "b")}
    assert await scripts.client.exists(keys.vtime("P2")) == 0
    got = await scripts.claim(keys, "w1", 2)
    assert [c.request_id for c in got.requests] == ["b-1", "a-2"]


@pytest.mark.parametrize("to_fair", [False, True])
async def test_a_switch_rescores_a_bounded_number_of_tenants_one_by_one(redis_server, scripts, sync_redis,
                                                                         to_fair):
    """init_pool does bounded work: at most 256 tenants are rescored one by one (to the seq
    of their oldest request); all of them are first set to one score by a single command
    (ZUNIONSTORE ... WEIGHTS 0): in a class turned fair that is the whole rescoring (every
    counter equal); in one turned to arrival order the tenants past the 256 keep it, and go
    first (their requests are older than any admitted after the switch)."""
    keys = await init_pool(scripts, class_cfg(P1={**LONG, "fair": to_fair is False}))
    n = 260
    for i in range(n):
        await admit(scripts, keys, cls="P1", tenant=f"t{i:03}", request_id=f"r{i}", input_tokens=1,
                    max_tokens=1)
    await admit(scripts, keys, cls="P1", tenant="t000", request_id="r-again", input_tokens=1, max_tokens=1)
    cfg = class_cfg(P1={**LONG, "fair": to_fair})

    async def switch() -> None:
        await _switch(scripts, keys, cfg)

    seen = await script_commands(redis_server, switch)
    reads = [c for c in seen if c.startswith(f"ZRANGE {keys.queue_prefix}")]
    assert len(reads) == (0 if to_fair else 256)
    scores = await _scores(scripts, keys, "P1")
    assert len(scores) == n
    if to_fair:
        assert set(scores.values()) == {0.0}
        return
    exact = {t for t, s in scores.items() if s == await _oldest_seq(scripts, keys, "P1", t)}
    assert len(exact) == 256 and {s for t, s in scores.items() if t not in exact} == {0.0}
    await admit(scripts, keys, cls="P1", tenant="newcomer", request_id="last", input_tokens=1, max_tokens=1)
    got = await scripts.claim(keys, "w1", 1024)
    # the 4 left at 0 first (by name), then every tenant by its oldest request
    assert [c.request_id for c in got.requests] == [
        *(f"r{i}" for i in range(256, n)), *(f"r{i}" for i in range(256)), "r-again", "last"]


async def test_a_switch_runs_under_the_documented_acl_user():
    """The rescoring's commands are in the ACL line of docs/reliability.md (a fresh pool's
    first init_pool rescores nothing, so the whole-stack ACL test never runs them)."""
    from tests.test_security_redis import PASSWORD, create_acl_user

    server = RedisServer().start()
    client = None
    try:
        create_acl_user(server.client())
        client = aioredis.from_url(f"redis://qos:{PASSWORD}@127.0.0.1:{server.port}/0")
        scripts = Scripts(client)
        keys = await init_pool(scripts, class_cfg(P1=LONG))
        for tenant in ("a", "b"):
            await admit(scripts, keys, cls="P1", tenant=tenant, input_tokens=1, max_tokens=1)
        await _switch(scripts, keys, class_cfg(P1={**LONG, "fair": False}))
        assert set((await _scores(scripts, keys, "P1")).values()) == {1.0, 2.0}
        await _switch(scripts, keys, class_cfg(P1=LONG))
        assert set((await _scores(scripts, keys, "P1")).values()) == {0.0}
    finally:
        if client is not None:
            await client.aclose()
        server.stop()
