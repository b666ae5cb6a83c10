"""A completion's prompt as token ids (vLLM's ``prompt: [int]``; lm-eval's ``local-completions``
sends them by default, ``tokenized_requests=True``), in a pool that counts in its model's
tokenizer: counted exactly as many tokens as ids (no count asked of anyone), sent to the model
server as they are, echoed as the server echoes them, refused by a step engine and by a pool
that counts bytes (a step engine serves only those: one refuses a token-id payload all the
same, tests/test_worker_e2e.py), and failed rather than resumed once its answer began."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest

from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import MAX_TOKEN_ID, parse_request
from limiter.localstack.sse import sse_chunks
from limiter.prompt import Payload
from tests.support.fake_upstream import breaks_once, fake_decode, fake_prompt_logprob, sse_chunk
from tests.support.frontend_helpers import auth, fe_of, frontend, make_cfg, redis_state
from tests.support.worker_helpers import worker
from tests.test_token_count import word_tokenizer

IDS = list(b"hello")  # the fake's "hello"
RETRY = {"upstream_retry_min_s": 0.1, "upstream_retry_max_s": 0.4}


def _cfg(url: str = "redis://127.0.0.1:1", upstream: str = "http://127.0.0.1:1", **pool: Any):
    return make_cfg(url, pool={"tokenizer": "upstream", "tokenizer_url": upstream, **pool})


@pytest.fixture
def env_ids(redis_server, fake_upstream):
    return _cfg(redis_server.url, fake_upstream.url, logprobs=True), fake_upstream


def _body(prompt: Any, **more: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, **more}


# --- the request -----------------------------------------------------------------------------

def test_a_token_id_prompt_is_its_ids_with_no_text() -> None:
    cfg = _cfg()
    for prompt in (IDS, [IDS]):  # (a batch of one, as lm-eval sends it)
        d = parse_request("completion", _body(prompt), cfg)
        assert (d.prompt, d.prompt_ids) == ("", tuple(IDS))
    # echo: the frontend has no text to put first; the model server's echo is forwarded
    d = parse_request("completion", _body(IDS, echo=True), cfg)
    assert (d.fields["echo"], d.fields["upstream"]) == (False, {"echo": True})
    text = parse_request("completion", _body("hello"), cfg)
    assert (text.prompt, text.prompt_ids) == ("hello", ())


@pytest.mark.parametrize(("prompt", "code"), [
    ([1, -1], "invalid_value"), ([MAX_TOKEN_ID + 1], "invalid_value"),
    ([1, 2.0], "invalid_type"), ([True, 1], "invalid_type"), ([], "invalid_type"),
    ([[1], [2]], "invalid_type"), ([[]], "invalid_type"), ([1, "a"], "invalid_type"),
])
def test_a_malformed_token_id_prompt_is_a_400_naming_it(prompt: Any, code: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request("completion", _body(prompt), _cfg())
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", code), e.value.message


@pytest.mark.parametrize(("prompt", "shown", "at"), [
    ([[None, *IDS]], "null", 0), ([[*IDS, None]], "null", 5), ([1, "a"], '"a"', 1), ([True, 1], "true", 0),
    ([[1, 2.5]], "2.5", 1),
])
def test_a_token_id_prompt_with_something_else_in_it_is_a_400_naming_it(prompt: Any, shown: str,
                                                                        at: int) -> None:
    """Not "batched prompts are not supported": what is there and where (lm-eval sends null as
    a rolling window's first token when its tokenizer has neither BOS nor EOS)."""
    with pytest.raises(ApiError) as e:
        parse_request("completion", _body(prompt), _cfg())
    assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "invalid_type")
    assert f"holds {shown} at {at}" in e.value.message and "batched" not in e.value.message, e.value.message
    if shown == "null":
        assert "custom_prefix_token_id" in e.value.message


def test_a_pool_that_counts_bytes_refuses_token_ids_saying_why() -> None:
    with pytest.raises(ApiError) as e:
        parse_request("completion", _body(IDS), make_cfg("redis://127.0.0.1:1"))
    assert e.value.code == "unsupported_value" and "tokenizer" in e.value.message


def test_a_token_id_payload_is_one_a_worker_before_them_refuses() -> None:
    p = Payload("completion", "", 8, prompt_ids=tuple(IDS))
    assert msgpack.unpackb(p.pack())["v"] == 5
    assert Payload.unpack(p.pack()) == p
    with pytest.raises(ValueError, match="prompt_ids"):
        Payload.unpack(msgpack.packb({**msgpack.unpackb(p.pack()), "prompt_ids": ["a"]}))


# --- end to end ------------------------------------------------------------------------------

async def test_token_ids_are_counted_as_themselves_and_reach_the_model_server_as_sent(env_ids) -> None:
    cfg, up = env_ids
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json=_body(IDS, max_tokens=40))
        assert r.status == 200, await r.text()
        answer = await r.json()
        r = await client.post("/v1/completions", headers=auth(),
                              json=_body([IDS], max_tokens=40, stream=True))
        streamed = "".join([ch["choices"][0]["text"] async for ch in sse_chunks(r.content)
                            if ch and ch["choices"]])
    assert answer["choices"][0]["text"] == streamed == "olleh"  # the fake's answer to "hello"
    assert answer["usage"]["prompt_tokens"] == len(IDS)
    assert up.tokenized == []  # counted as the ids: nobody was asked
    assert [b["prompt"] for b in up.bodies] == [IDS, IDS]


async def test_a_token_id_prompts_echo_with_logprobs_is_the_model_servers(env_ids) -> None:
    """lm-eval's default loglikelihood request: token ids, echo, logprobs 1, max_tokens 1.
    The text is the server's (the prompt's text, then the answer's), and the logprobs begin
    with the prompt's tokens'."""
    cfg, up = env_ids
    body = _body([IDS], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        choice = (await r.json())["choices"][0]
        r = await client.post("/v1/completions", headers=auth(), json=_body(IDS, echo=True, max_tokens=1))
        echoed = (await r.json())["choices"][0]
    assert choice["text"] == echoed["text"] == fake_decode(IDS) + "oll"
    lp = choice["logprobs"]
    assert lp["tokens"] == [*fake_decode(IDS), "oll"]
    assert lp["token_logprobs"][:len(IDS)] == [fake_prompt_logprob(k) for k in range(len(IDS))]
    assert all(b["echo"] is True and b["prompt"] == IDS for b in up.bodies)


async def test_an_answer_to_token_ids_broken_off_is_failed_not_resumed(env_ids) -> None:
    cfg, up = env_ids
    read = asyncio.Event()
    up.scripts[fake_decode(IDS)] = breaks_once([sse_chunk("one", completion_tokens=1)], read,
                                               [sse_chunk("two", finish="stop", completion_tokens=1)])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/completions", headers=auth(),
                              json=_body(IDS, max_tokens=40, stream=True))
        assert r.status == 200, await r.text()
        events: list[Any] = []
        async for ch in sse_chunks(r.content):
            events.append(ch)
            if ch and ch.get("choices") and ch["choices"][0]["text"]:
                read.set()
    assert up.calls[fake_decode(IDS)] == 1
    error = next(e for e in events if e and "error" in e)
    assert "token-id prompt" in error["error"]["message"], error


async def test_an_id_past_the_vocabulary_the_pool_counts_in_is_a_400_before_admission(
        tmp_path, redis_server, sync_redis) -> None:
    """A pool counting in a tokenizer.json knows its model's vocabulary: an id past it (another
    model's ids) is no token of the model, refused now, nothing charged or queued (it was
    admitted, charged its prompt and queued for the model server to refuse)."""
    tok = word_tokenizer(tmp_path / "tokenizer.json")  # ids 0..11
    cfg = make_cfg(redis_server.url, pool={"tokenizer": str(tok)})
    async with frontend(cfg) as client:
        before = redis_state(sync_redis)
        r = await client.post("/v1/completions", headers=auth(), json=_body([1, 2, 11, 12, 3], max_tokens=4))
        body = await r.json()
        assert r.status == 400, body
        assert (body["error"]["param"], body["error"]["code"]) == ("prompt", "invalid_value")
        assert "token id 12 at 3" in body["error"]["message"] and "ends at 11" in body["error"]["message"]
        assert redis_state(sync_redis) == before  # nothing charged or queued
        # the vocabulary's own ids, its last too, are counted as themselves
        assert await fe_of(client).count_prompt(parse_request("completion", _body([1, 2, 11]), cfg)) == 3
