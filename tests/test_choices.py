"""Several answers to one request: ``n`` > 1, or a completion's several prompts (lm-eval's
``batch_size``, OpenAI's batched completions). Each answer is a request of its own in the queue
(counted by its tenant's quota and in-flight bound, scheduled, resumed and charged as any),
answered together in vLLM's order; the first failure fails the whole and cancels the rest."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import MAX_CHOICES, split_choices
from limiter.frontend.runtime import FRONTEND
from limiter.localstack.sse import sse_chunks
from tests.support.fake_upstream import breaks_once, sse_chunk, sse_response
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state, tenant
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
])
def test_too_many_answers_are_a_400(kind: str, body: dict[str, Any], param: str,
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


async def _read_stream(r: Any) -> list[Any]:
    """A stream's chunks, then None for its ``[DONE]`` (absent when it ended without one)."""
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream"), await r.text()
    return [c async for c in sse_chunks(r.content)]


def _by_index(chunks: list[Any], field: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            part = choice["delta"].get("content") if field == "content" else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (part or "")
    return texts


async def test_n_answers_streamed_come_as_chunks_of_their_index(redis_server, fake_upstream) -> None:
    """vLLM's stream of ``n`` answers: a role chunk for each choice first, then each answer's
    chunks as its ``index`` (interleaved: the fake writes each answer's first piece, then
    waits), one finish each, each chunk's running usage its own answer's, and the usage
    summed at the end with the prompt once; one id on every chunk."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    up.gate = asyncio.Semaphore(0)  # each answer's first piece, then nothing until released
    # (the request timeout bounds the test, were the stream never to show what it waits for)
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abcdef ghi"}], "n": 3,
            "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert r.status == 200, await r.text()
        first: list[Any] = []
        async for c in sse_chunks(r.content):  # every answer's first piece, before any second
            first.append(c)
            if len(_by_index(first, "content")) == 3 and all(_by_index(first, "content").values()):
                break
        for _ in range(100):
            up.gate.release()
        chunks = first + [c async for c in sse_chunks(r.content)]
        records = r.headers["X-QoS-Request-Id"].split(",")
        one = await (await client.post("/v1/chat/completions", headers=auth(), json={
            "model": "tiny", "messages": [{"role": "user", "content": "abcdef ghi"}],
            "max_tokens": 10})).json()
    assert chunks[-1] is None  # [DONE]
    chunks = chunks[:-1]
    assert len(set(records)) == 3
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:3]] == ["assistant"] * 3
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert _by_index(chunks[:-1], "content") == {i: "ihg fedcba" for i in range(3)}
    assert {c["id"] for c in chunks} == {"chatcmpl-" + r.headers["x-request-id"]}
    assert len({(c["created"], c["model"]) for c in chunks}) == 1
    finishes = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"] == "stop"]
    assert sorted(finishes) == [0, 1, 2]
    prompt, each = one["usage"]["prompt_tokens"], one["usage"]["completion_tokens"]
    for c in chunks[:-1]:  # each chunk's running usage is its own answer's (not the sum's)
        assert c["usage"]["completion_tokens"] <= each, c
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": 3 * each, "total_tokens": prompt + 3 * each}


async def test_several_prompts_streamed_each_echo_its_own_prompt_and_count_its_own_offsets(
        redis_server, fake_upstream) -> None:
    """A completion's two prompts, ``n`` 2 each, streamed with ``echo`` and logprobs: choices
    0-1 answer the first prompt, 2-3 the second; each text begins with its own prompt, and each
    choice's ``text_offset`` counts its own answer; the usage counts each prompt once."""
    cfg, up = make_cfg(redis_server.url, pool={"logprobs": True}), fake_upstream
    prompts = ["abc def", "ghi jkl mno"]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 10, "echo": True, "logprobs": 0,
            "stream": True, "stream_options": {"include_usage": True}})
        chunks = await _read_stream(r)
    assert chunks[-1] is None
    texts = _by_index(chunks[:-2], "text")
    assert texts == {0: "abc deffed cba", 1: "abc deffed cba", 2: "ghi jkl mnoonm lkj ihg",
                     3: "ghi jkl mnoonm lkj ihg"}
    for i in range(4):
        offsets = [o for c in chunks[:-2] for ch in c["choices"] if ch["index"] == i and ch["logprobs"]
                   for o in ch["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and offsets[0] == 0, (i, offsets)
        assert offsets[-1] < len(texts[i])
    usage = chunks[-2]["usage"]
    assert usage["prompt_tokens"] == 3 + 4  # the fake's words + BOS, each prompt once
    assert usage["completion_tokens"] == 2 * (3 + 4)  # (3-character tokens of "fed cba" / "onm lkj ihg")


def _writes_then_waits(up: Any) -> Any:
    """A server script that writes one chunk ("first"), then waits for its client (the worker)
    to leave, counted in ``up.disconnects``."""
    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(sse_chunk("first"))
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.01)  # (the fake's handlers are not cancelled when a client leaves)
        up.disconnects += 1
        return resp

    return script


async def test_a_refusal_before_the_stream_opens_is_an_http_status_that_leaves_nothing_taken(
        redis_server, fake_upstream, monkeypatch) -> None:
    """Of two answers, the first streams text (and then waits), and the second is admitted only
    after that text reached this frontend, to find its tenant's in-flight bound taken (by a
    request held at the model server, and the first): the stream is not opened until every
    answer is admitted, so the client reads an honest 429, not a 200 with an error inside;
    the first is cancelled, and its slot is free again."""
    capped = tenant("capped", "key-capped", "P1", max_inflight=2)
    cfg, up = make_cfg(redis_server.url, tenants=[capped]), fake_upstream
    release = asyncio.Event()

    async def held(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await release.wait()
        await resp.write(sse_chunk("x", finish="stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up.scripts["HOLD"], up.scripts["WAITS"] = held, _writes_then_waits(up)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        fe = client.server.app[FRONTEND]
        admit = fe.scripts.admit

        def first_tokens() -> float:  # first tokens this frontend took from the reply stream
            return sum(s.value for m in fe.metrics.ttft.collect() for s in m.samples
                       if s.name.endswith("_count"))

        async def admitted_after_the_first_answers_text(keys: Any, **kw: Any) -> Any:
            if b"LAST" in kw["payload"]:
                await wait_until(lambda: first_tokens() >= 1, "the first answer's text at the frontend")
            return await admit(keys, **kw)

        monkeypatch.setattr(fe.scripts, "admit", admitted_after_the_first_answers_text)
        holder = asyncio.create_task(client.post("/v1/completions", headers=auth("key-capped"),
                                                 json={"model": "tiny", "prompt": "HOLD", "max_tokens": 5}))
        await wait_until(lambda: any(b["prompt"] == "HOLD" for b in up.bodies),
                         "the held request at the model server")
        r = await client.post("/v1/completions", headers=auth("key-capped"), json={
            "model": "tiny", "prompt": ["WAITS", "LAST"], "max_tokens": 10, "stream": True})
        assert r.headers["Content-Type"].startswith("application/json"), await r.text()
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (429, "too_many_inflight"), error
        await wait_until(lambda: up.disconnects >= 1, "the first answer's stream broken off (cancelled)")
        release.set()
        assert (await holder).status == 200
        # both slots free again: the first answer was cancelled, not left holding one
        r = await client.post("/v1/completions", headers=auth("key-capped"), json={
            "model": "tiny", "prompt": ["abc", "def"], "max_tokens": 10, "stream": True})
        chunks = await _read_stream(r)
    assert chunks[-1] is None and _by_index(chunks[:-1], "text") == {0: "cba", 1: "fed"}


async def test_a_failure_after_the_stream_opened_is_reported_in_band_and_cancels_the_others(
        redis_server, fake_upstream) -> None:
    """Both answers stream their first text; once the client read it, one then fails at the
    model server (an error event mid-answer): the status is sent, so the error comes in-band
    as one answer's would (no ``[DONE]``), and the waiting answer is cancelled (its stream to
    the model server broken off)."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    read = asyncio.Event()

    async def fails_once_read(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(sse_chunk("late"))
        await read.wait()
        # (text and the failure in one write: they may reach the client's stream together)
        await resp.write(sse_chunk(" more") + b'data: {"error": {"message": "CUDA out of memory"}}\n\n')
        return resp

    up.scripts["WAITS"], up.scripts["LATE"] = _writes_then_waits(up), fails_once_read
    # (the request timeout bounds the test, were the stream never to show what it waits for)
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["WAITS", "LATE"], "max_tokens": 10, "stream": True})
        assert r.status == 200, await r.text()
        chunks = []
        async for c in sse_chunks(r.content):
            chunks.append(c)
            if len(_by_index([c for c in chunks if c and c.get("choices")], "text")) == 2:
                read.set()
        await wait_until(lambda: up.disconnects >= 1, "the waiting answer's stream broken off (cancelled)")
    assert _by_index(chunks[:-1], "text") == {0: "first", 1: "late more"}  # what came before it too
    assert None not in chunks  # no [DONE]
    assert chunks[-1]["error"]["code"] == "worker_failed", chunks[-1]
    assert "CUDA out of memory" in chunks[-1]["error"]["message"]


async def test_a_prompt_refused_after_another_answer_streamed_text_is_an_http_status(
        redis_server, fake_upstream) -> None:
    """One answer streams text (and then waits); the other is refused by the model server
    before its first token (vLLM's context-length 400), after that text reached this frontend:
    no worker had begun the second, so the stream is not open yet and the client reads the
    400 itself, as vLLM answers a batch with a prompt it refuses; the first is cancelled."""
    cfg, up = make_cfg(redis_server.url), fake_upstream

    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        fe = client.server.app[FRONTEND]

        def first_tokens() -> float:  # first tokens this frontend took from the reply stream
            return sum(s.value for m in fe.metrics.ttft.collect() for s in m.samples
                       if s.name.endswith("_count"))

        async def refused_once_streamed(request: Any, body: dict[str, Any], n: int) -> Any:
            await wait_until(lambda: first_tokens() >= 1, "the first answer's text at the frontend")
            return web.json_response({"error": {"message": "This model's maximum context length is 64 tokens",
                                                "type": "BadRequestError", "code": 400}}, status=400)

        up.scripts["WAITS"], up.scripts["LATE"] = _writes_then_waits(up), refused_once_streamed
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["WAITS", "LATE"], "max_tokens": 10, "stream": True})
        assert r.headers["Content-Type"].startswith("application/json"), await r.text()
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (400, "request_refused"), error
        assert "maximum context length" in error["message"]
        await wait_until(lambda: up.disconnects >= 1, "the waiting answer's stream broken off (cancelled)")


async def test_an_answer_that_waits_past_its_max_queue_wait_while_another_streams_is_an_honest_503(
        redis_server, fake_upstream) -> None:
    """Two answers, and a worker that runs one at a time: the first streams text (and then
    waits), the second waits in the queue past the client's max queue wait. A queue timeout
    is an HTTP 503 with a ``Retry-After`` (the SDK retries it), as one answer's is, not an
    error inside a 200 stream opened on the other's text; the first is cancelled."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    up.scripts["WAITS"] = _writes_then_waits(up)
    # (the request timeout bounds the test, were the second answer taken after all)
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url, max_inflight=1):
        r = await client.post("/v1/completions", headers=auth(**{"X-QoS-Max-Wait-Ms": "500"}), json={
            "model": "tiny", "prompt": "WAITS", "n": 2, "max_tokens": 10, "stream": True})
        assert r.headers["Content-Type"].startswith("application/json"), await r.text()
        error = (await r.json())["error"]
        assert (r.status, error["code"]) == (503, "queue_timeout"), error
        assert int(r.headers["Retry-After"]) >= 1
        await wait_until(lambda: up.disconnects >= 1, "the streaming answer's stream broken off (cancelled)")
        assert not client.server.app[FRONTEND].router._queues  # both answers' handlers ended
    assert len(up.bodies) == 1  # the second never reached the model server


async def test_answers_that_together_pass_what_a_request_may_hold_queued_are_a_400(
        redis_server, sync_redis, fake_upstream) -> None:
    """Each answer is queued with its prompt: 64 answers to a prompt of 200 KB would hold
    ~13 MB of Redis' memory while they wait. Refused before anything is admitted, naming the
    bound and what to do; as many answers as fit are served."""
    # (a capacity that starts 40 answers of 200,000 prompt tokens within the class's max wait)
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 1_000_000, "capacity_tokens_s": 1e8})
    prompt = "x" * 200_000
    async with frontend(cfg, max_body_bytes=16 << 20) as client, \
            worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        before = redis_state(sync_redis)
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": prompt, "n": 64, "max_tokens": 1})
        error = (await r.json())["error"]
        assert (r.status, error["code"], error["param"]) == (400, "request_too_large", "n"), error
        assert "64 answers" in error["message"] and "8 MiB" in error["message"]
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": [prompt] * 45, "max_tokens": 1})
        assert (r.status, (await r.json())["error"]["param"]) == (400, "prompt"), await r.text()
        assert redis_state(sync_redis) == before and fake_upstream.bodies == []
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": prompt, "n": 40, "max_tokens": 1})
        assert r.status == 200, await r.text()
        assert len((await r.json())["choices"]) == 40


async def test_a_client_leaving_a_stream_of_several_answers_cancels_every_one(redis_server, sync_redis,
                                                                                fake_upstream) -> None:
    """The client reads both answers' first text and goes: every answer is cancelled in Redis
    (its record ends cancelled, nothing left in flight), its stream to the model server
    broken off, and no reply queue is left in the frontend."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    up.scripts["WAITS"] = _writes_then_waits(up)
    # (the request timeout bounds the test, were the stream never to show what it waits for)
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url):
        fe = client.server.app[FRONTEND]
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": "WAITS", "n": 2, "max_tokens": 10, "stream": True})
        records = r.headers["X-QoS-Request-Id"].split(",")
        seen: list[Any] = []
        async for c in sse_chunks(r.content):
            seen.append(c)
            if len(_by_index([c for c in seen if c and c.get("choices")], "text")) == 2:
                break
        r.close()  # the client goes
        await wait_until(lambda: up.disconnects >= 2, "both answers' streams broken off")
        await wait_until(lambda: not fe.router._queues, "the handlers' reply queues gone")

        def states() -> list[bytes | None]:
            return [sync_redis.hget(POOL.request(rid), "state") for rid in records]

        await wait_until(lambda: states() == [b"cancelled"] * 2, f"both records cancelled ({states()})")


async def test_an_answer_resumed_mid_stream_reaches_the_client_once_beside_the_other(
        redis_server, fake_upstream) -> None:
    """One of two streamed answers breaks off at its model server after text the client read;
    the worker resumes it: the client reads each answer's text exactly once (no repeat of what
    it had), both finished, and the usage summed."""
    cfg, up = make_cfg(redis_server.url), fake_upstream
    read = asyncio.Event()
    up.scripts["RESUME"] = breaks_once([sse_chunk("One"), sse_chunk("Two")], read,
                                       [sse_chunk("Six"), sse_chunk(finish="stop", completion_tokens=1),
                                        b"data: [DONE]\n\n"])
    retry = {"upstream_retry_min_s": 0.1, "upstream_retry_max_s": 0.4}
    # (the request timeout bounds the test, were the stream never to show what it waits for)
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url, **retry):
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["abc def", "RESUME"], "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status == 200, await r.text()
        chunks: list[Any] = []
        async for c in sse_chunks(r.content):
            chunks.append(c)
            texts = _by_index([x for x in chunks if x and x["choices"]], "text")
            if c and c.get("choices") and texts.get(1) == "OneTwo":
                read.set()  # the client read them: now the server breaks
    assert up.calls["RESUME"] == 2 and chunks[-1] is None
    assert _by_index(chunks[:-2], "text") == {0: "fed cba", 1: "OneTwoSix"}
    finishes = sorted(ch["index"] for c in chunks[:-2] for ch in c["choices"] if ch["finish_reason"])
    assert finishes == [0, 1] and chunks[-2]["choices"] == []


async def test_answers_costing_more_than_the_tenants_quota_can_give_are_a_429_before_any_is_admitted(
        redis_server, sync_redis, fake_upstream) -> None:
    """Each answer is charged its own cost from its tenant's bucket: answers that together cost
    more than a full bucket plus what refills within the class's admission wait can never all be
    admitted. A 429 that says so (and not to resend it), with nothing admitted -- not some of
    them admitted, charged and handed to a worker, then cancelled, on every resend (as with
    ``max_inflight``)."""
    # a bucket of 100 weighted tokens, +50 within P1's admission wait (500 ms)
    small = tenant("small", "key-small", "P1", rate=100.0, burst_s=1.0)
    cfg = make_cfg(redis_server.url, tenants=[small])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth("key-small"), json={
            "model": "tiny", "prompt": "abc", "n": 3, "max_tokens": 60})  # 3 x (60 + the prompt) > 150
        body = await r.json()
        assert (r.status, body["error"]["code"]) == (429, "rate_limit_exceeded"), body
        assert "3 answers" in body["error"]["message"] and r.headers["x-should-retry"] == "false"
        assert sync_redis.keys(POOL.request_prefix + "*") == [] and fake_upstream.bodies == []
        # two of them fit (the second waits for the bucket within the admission wait): served
        r = await client.post("/v1/completions", headers=auth("key-small"), json={
            "model": "tiny", "prompt": "abc", "n": 2, "max_tokens": 60})
        assert r.status == 200, await r.text()
        assert len((await r.json())["choices"]) == 2


async def test_the_copies_of_a_prompt_are_checked_against_the_quota_once(redis_server, fake_upstream,
                                                                         monkeypatch) -> None:
    """``n`` copies of a prompt differ only in their seed: the quota's look at the tenant's
    bucket (a Redis call, after a recent refusal) is made once a prompt, not once an answer."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        fe = client.server.app[FRONTEND]
        looked: list[str] = []
        check = fe.quota.refuse_if_spent

        async def counted(draft: Any, *args: Any) -> None:
            looked.append(draft.prompt)
            await check(draft, *args)

        monkeypatch.setattr(fe.quota, "refuse_if_spent", counted)
        r = await client.post("/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": ["abc", "def"], "n": 3, "max_tokens": 5})
        assert r.status == 200 and len((await r.json())["choices"]) == 6
    assert looked == ["abc", "def"]
