"""The quota check before the model server counts a prompt (limiter/frontend/quota_check.py):
a tenant refused for its quota lately, in a pool counted upstream, whose bucket cannot hold a
request's least cost gets its 429 with no /tokenize."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from limiter.config import ClassConfig
from limiter.errors import Throttled
from limiter.frontend.openai_api import Draft, parse_request
from limiter.frontend.quota_check import least_cost
from limiter.keys import PoolKeys
from tests.support.frontend_helpers import auth, fe_of, frontend, make_cfg, tenant
from tests.support.helpers import wait_until

POOL = PoolKeys("tiny")


@pytest.fixture
def upstream(fake_upstream):
    return fake_upstream


async def test_a_throttled_tenant_is_refused_before_the_model_server_counts_its_prompt(
        redis_server, sync_redis, upstream) -> None:
    """With tokenizer = "upstream" the prompt is counted before the quota is checked: a
    throttled tenant cost the model server a /tokenize per request, however many it sent.
    Once admission refused a tenant for its quota, its bucket is read first: a request whose
    output alone cannot fit is a 429 with no count; one that might fit is counted as usual,
    and an admission clears the check."""
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": upstream.url},
                   tenants=[tenant("poor", "key-poor", "P1", rate=1.0, burst_s=100.0)])  # 100, ~no refill

    def ask(max_tokens: int) -> dict:
        return {"model": "tiny", "prompt": "one two", "max_tokens": max_tokens}

    async with frontend(cfg) as client:
        queued = [asyncio.create_task(client.post("/v1/completions", headers=auth("key-poor"), json=ask(60)))]
        try:
            await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 1,
                             "the first request queued")
            assert len(upstream.tokenized) == 1
            # 60 + the prompt are charged: 50 more cannot fit; refused by admission, after a count
            r = await client.post("/v1/completions", headers=auth("key-poor"), json=ask(50))
            assert r.status == 429 and len(upstream.tokenized) == 2, await r.text()
            # the next such request is refused before its count, with a Retry-After
            r = await client.post("/v1/completions", headers=auth("key-poor"), json=ask(50))
            body = await r.json()
            assert r.status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
            assert len(upstream.tokenized) == 2, "the model server counted a prompt that cannot be admitted"
            assert int(r.headers["Retry-After"]) >= 1
            # unless the class would wait for the bucket that long: then counted as usual
            fe = fe_of(client)
            poor = next(t for t in cfg.tenants if t.name == "poor")
            draft = parse_request("completion", ask(50), cfg)
            with pytest.raises(Throttled):
                await fe.quota.refuse_if_spent(draft, poor, fe.classes["P1"])
            await fe.quota.refuse_if_spent(draft, poor, dataclasses.replace(fe.classes["P1"],
                                                                           admission_wait_ms=3_600_000))
            # one whose output might fit is counted, and admitted
            queued.append(asyncio.create_task(
                client.post("/v1/completions", headers=auth("key-poor"), json=ask(1))))
            await wait_until(lambda: int(sync_redis.hget(POOL.queued, "P1") or 0) == 2,
                             "the small request admitted")
            assert len(upstream.tokenized) == 3 and not fe.quota.until  # admitted: no check now
        finally:
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0), (0.1, 5.0), (0.0, 2.0)])
@pytest.mark.parametrize("max_tokens", [None, 1, 10])
def test_the_least_cost_before_counting_is_the_least_of_every_prompt_length(weights, max_tokens) -> None:
    """The quota check before counting refuses only a request that no prompt length could let
    in: its bound is the least cost over every prompt length, by brute force here (a bound
    at one end only refused, for a pricey output, requests a long prompt leaves little of)."""
    cfg = make_cfg("redis://127.0.0.1:1/0", pool={"context_tokens": 64, "default_max_tokens": 16})
    cls = ClassConfig(name="P1", share=0.5, weight=weights[0], out_weight=weights[1])
    draft = Draft(kind="completion", pool=cfg.pools[0], prompt="x", prompt_param="prompt", messages=(),
                  max_tokens=max_tokens, max_param="max_tokens", min_tokens=0, fields={})
    costs = [p * weights[0] + (max_tokens if max_tokens is not None else min(16, 64 - p)) * weights[1]
             for p in range(0, 64)]
    assert least_cost(draft, cls) == pytest.approx(min(costs))
