"""init_pool.lua over a running pool: a deploy that rewrites the policy while requests are
queued. A class's `fair` flag says what its backlog's scores mean (virtual token counters in
a fair class, the seq of each tenant's oldest request in an arrival-order one)."""

from __future__ import annotations

from limiter.config import QosConfig
from limiter.keys import PoolKeys
from limiter.scripts import Scripts, policy_document
from tests.support.helpers import admit, class_cfg, init_pool

LONG = {"max_wait_ms": 600_000}


async def _switch(scripts: Scripts, keys: PoolKeys, cfg: QosConfig) -> None:
    """A role on another configuration starts: init_pool, keeping the controller's rates."""
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))


async def _scores(scripts: Scripts, keys: PoolKeys, cls: str) -> dict[str, float]:
    return {t.decode(): s for t, s in await scripts.client.zrange(keys.backlog(cls), 0, -1, withscores=True)}


async def _oldest_seq(scripts: Scripts, keys: PoolKeys, cls: str, tenant: str) -> float:
    return (await scripts.client.zrange(keys.queue(cls, tenant), 0, 0, withscores=True))[0][1]


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
