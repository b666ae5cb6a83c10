"""Several answers to one request: ``n`` > 1, or a completion's several prompts (lm-eval's
``batch_size``, OpenAI's batched completions). Each answer is a request of its own in the queue
(counted by its tenant's quota and in-flight bound, scheduled, resumed and charged as any),
answered together in vLLM's order; the first failure fails the whole and cancels the rest."""

from __future__ import annotations

from typing import Any

import pytest

from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import MAX_CHOICES, split_choices
from limiter.frontend.runtime import FRONTEND
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, tenant
from tests.support.helpers import wait_until
from tests.support.worker_helpers import worker


def test_n_copies_a_body_with_its_seed_apart_and_prompts_go_one_a_body() -> None:
    bodies, n = split_choices("chat", {"model": "tiny", "messages": [], "n": 3, "seed": 5})
    assert n == 3 and [b["seed"] for b in bodies] == [5, 4, 7] and all(b["n"] == 1 for b in bodies)
    bodies, n = split_choices("completion", {"model": "tiny", "prompt": ["a", "b"], "n": 2})
    assert n == 2 and [b["prompt"] for b in bodies] == ["a", "a", "b", "b"]
    bodies, n = split_choices("completion", {"model": "tiny", "prompt": [[1, 2], [3]]})
    assert n == 1 and [b["prompt"] for b in bodies] == [[1, 2], [3]]
    # one answer: the body as it came (one prompt in a list, token ids, a batch of one)
    for prompt in ("a", ["a"], [1, 2], [[1, 2]]):
        assert split_choices("completion", {"prompt": prompt}) == ([{"prompt": prompt}], 1)
    assert split_choices("chat", {"messages": [], "n": 1}) == ([{"messages": [], "n": 1}], 1)
    # a list of lists holding texts or lists is no batch of token-id prompts (parse_request's 400)
    for prompt in ([["a"], ["b"]], [[[1]], [[2]]], [[1, 2], ["a"]]):
        assert split_choices("completion", {"prompt": prompt}) == ([{"prompt": prompt}], 1)


@pytest.mark.parametrize(("kind", "body", "param", "code"), [
    ("chat", {"n": MAX_CHOICES + 1}, "n", "invalid_value"),
    ("chat", {"n": 0}, "n", "invalid_value"),
    ("chat", {"n": True}, "n", "invalid_type"),
    ("completion", {"prompt": ["a"] * 33, "n": 2}, "prompt", "invalid_value"),
    ("chat", {"n": 2, "stream": True}, "n", "unsupported_value"),
    ("completion", {"prompt": ["a", "b"], "stream": True}, "prompt", "unsupported_value"),
])
def test_too_many_answers_or_several_streamed_are_a_400(kind: str, body: dict[str, Any], param: str,
                                                         code: str) -> None:
    with pytest.raises(ApiError) as e:
        split_choices(kind, body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message


async def test_n_answers_come_as_choices_with_the_prompt_counted_once(redis_server, fake_upstream) -> None:
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abcdef"}], "n": 3, "max_tokens": 10,
            "seed": 7})
        assert r.status == 200, await r.text()
        out = await r.json()
        one = await (await client.post("/v1/chat/completions", headers=auth(), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abcdef"}], "max_tokens": 10})).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "fedcba" for c in out["choices"])  # (the fake answers alike)
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert sorted(b["seed"] for b in fake_upstream.bodies[:3]) == [5, 6, 7]  # 7, 7^1, 7^2


async def test_several_prompts_come_as_a_choice_each_in_order(redis_server, fake_upstream) -> None:
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["abc", "defghi", "jk"], "max_tokens": 10})
        assert r.status == 200, await r.text()
        out = await r.json()
        records = r.headers["X-QoS-Request-Id"].split(",")  # each answer's record, to trace it
        assert len(set(records)) == 3
        fe = client.server.app[FRONTEND]
        states = [await fe.client.hget(fe.pool_keys["tiny"].request(rid), "state") for rid in records]
    assert [c["text"] for c in out["choices"]] == ["cba", "ihgfed", "kj"]
    assert states == [b"done"] * 3, states
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    # the fake counts a prompt's words + BOS: 2 each
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 1 + 2 + 1, "total_tokens": 10}


async def test_one_answer_failing_fails_the_whole_and_cancels_the_others(redis_server, fake_upstream) -> None:
    """One prompt the model server refuses (FAIL: a 400), one it answers slowly: the client
    reads the refusal, and the slow one is cancelled (its stream to the server is broken
    off), not left to run for nobody."""
    cfg = make_cfg(redis_server.url)
    up = fake_upstream
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["SLOW " * 30, "FAIL"], "max_tokens": 60})
        body = await r.json()
        assert r.status == 400 and "maximum context length" in body["error"]["message"], body
        await wait_until(lambda: up.disconnects >= 1, "the slow answer's stream broken off (cancelled)")


async def test_more_answers_than_the_tenants_max_inflight_is_a_429_before_any_is_admitted(
        redis_server, sync_redis, fake_upstream) -> None:
    """A tenant whose ``max_inflight`` is below the answers asked for can never have them all
    in flight: a 429 that says so (and not to resend it), with nothing admitted -- not some
    of them admitted, charged and handed to a worker, then cancelled, on every resend."""
    capped = tenant("capped", "key-capped", "P1", max_inflight=2)
    cfg = make_cfg(redis_server.url, tenants=[capped])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/chat/completions", headers=auth("key-capped"), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abc"}], "n": 3, "max_tokens": 10})
        body = await r.json()
        assert (r.status, body["error"]["code"]) == (429, "too_many_inflight"), body
        assert "max_inflight" in body["error"]["message"] and r.headers["x-should-retry"] == "false"
        assert sync_redis.keys(POOL.request_prefix + "*") == [] and fake_upstream.bodies == []
        # as many as its bound: served
        r = await client.post("/v1/chat/completions", headers=auth("key-capped"), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abc"}], "n": 2, "max_tokens": 10})
        assert r.status == 200, await r.text()
        assert len((await r.json())["choices"]) == 2
