"""Token log probabilities in front of a model server that returns them (``[[pools]]
logprobs``): a chat's ``logprobs``/``top_logprobs`` and a completion's ``logprobs`` reach the
server, its logprobs reach the client in OpenAI's shape (streamed a chunk each with its text,
or whole), exactly once per token across a resume, and a shape no client reads fails the
request as a malformed response."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import msgpack
import openai
import pytest

from limiter.config import demo_config
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import parse_request
from limiter.localstack.sse import sse_chunks
from limiter.prompt import Payload
from limiter.reply_text import ReplyText, pack, unpack, unpack_in_order
from tests.support.fake_upstream import (
    breaks_once,
    echo_logprobs,
    fake_logprob,
    fake_prompt_logprob,
    sse_chunk,
    sse_response,
)
from tests.support.frontend_helpers import auth, frontend, make_cfg
from tests.support.worker_helpers import worker
from worker.delivery import PUSH_TEXT_CHARS
from worker.logprobs import LOGPROB_FLOOR, choice_logprobs
from worker.sse_events import MalformedStream

RETRY = {"upstream_retry_min_s": 0.1, "upstream_retry_max_s": 0.4}
HI = ["Hi", 2 * -0.5, [72, 105], [["Hi", -1.0, [72, 105]], ["Yo", -2.0, None]]]


@pytest.fixture
def env_logprobs(redis_server, fake_upstream):
    return make_cfg(redis_server.url, pool={"logprobs": True}), fake_upstream


def _cfg(**pool: Any):
    import dataclasses

    from limiter.config import validate
    cfg = demo_config()
    return validate(dataclasses.replace(cfg, pools=tuple(dataclasses.replace(p, logprobs=True, **pool)
                                                         for p in cfg.pools)))


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "abcdefghijklmno"}], **body}


def _completion(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "abcdefghijklmno", **body}


# --- the text a push carries ---------------------------------------------------------------

def test_logprobs_ride_in_the_pushed_text_with_their_run() -> None:
    nul = ["a\x00", -0.25, [97, 0], []]  # a NUL in a token: JSON escapes it
    pieces = [pack("Hi", logprobs=[HI]), pack("a\x00", logprobs=[nul]), pack("", "think", logprobs=[HI]),
              pack("x")]
    assert unpack("".join(pieces)) == ReplyText("Hia\x00x", "think", "reasoning", (), (HI, nul, HI),
                                                (HI, nul))
    # each chunk's logprobs stay with the run of its text (thinking after text is a new run);
    # the text's own apart (a chunk of thinking alone has tokens of its own)
    assert unpack_in_order("".join(pieces)) == [
        ReplyText("Hia\x00", logprobs=(HI, nul), text_logprobs=(HI, nul)),
        ReplyText("x", "think", "reasoning", logprobs=(HI,))]
    assert unpack(pack("plain")) == ReplyText("plain")


def test_the_texts_own_logprobs_are_those_of_chunks_with_text_or_with_nothing_else() -> None:
    """A chunk of thinking or calls alone: not the text's. A chunk of thinking and text (the
    chunk where a reasoning parser's thinking ends), of text whose first character is a NUL,
    or of nothing but logprobs (vLLM's stop token): the text's."""
    lp = [[f"t{k}", -0.5, None, None] for k in range(6)]
    call = [{"index": 0, "function": {"arguments": "{}"}}]
    packed = (pack("", "hm", logprobs=[lp[0]]) + pack("", tool_calls=call, logprobs=[lp[1]])
              + pack("a", "hm", logprobs=[lp[2]]) + pack("\x00b", logprobs=[lp[3]])
              + pack("", logprobs=[lp[4]]) + pack("", "hm", logprobs=[lp[5]]))
    got = unpack(packed)
    assert got.logprobs == tuple(lp) and got.text_logprobs == (lp[2], lp[3], lp[4])


def test_an_older_frontends_request_gets_no_logprobs_mark_that_frontend_does_not_read() -> None:
    """A rolling deploy: a frontend of an older release kept ``NUL L`` (a mark it does not
    know) as text, and its client read the logprobs' JSON in the thinking. Only a payload of
    a frontend that reads it (``aside_logprobs``, this release's) gets it; an older one's
    chunk of thinking alone marks its logprobs ``NUL l``, as that release wrote them."""
    from limiter.scripts import Claimed
    from worker.delivery import Delivery

    lp = ["hm", -0.5, None, []]
    claimed = Claimed("r1", "P1", "t1", 1, b"", 0, 5, 100_000, "fe1", 0, [], 0, 0)
    texts = {}
    for aside in (False, True):
        payload = Payload("chat", "x", 100, aside_logprobs=aside)
        assert Payload.unpack(payload.pack()).aside_logprobs is aside
        d = Delivery(claimed, payload, claim_now_ms=0, claim_t=0.0, usage_in=5, class_rank=1)
        d.add([1], "", 0.0, reasoning="hm", logprobs=[lp])
        texts[aside] = d.pending_text
    assert "\x00L" not in texts[False]
    assert unpack(texts[False]) == ReplyText("", "hm", "reasoning", (), (lp,), (lp,))
    assert unpack(texts[True]) == ReplyText("", "hm", "reasoning", (), (lp,))
    # (this release's frontend says it reads the mark: test_vllm_compat.py
    # test_extensions_reach_the_worker_payload)


# --- the request -----------------------------------------------------------------------------

def test_a_logprobs_pools_request_carries_its_logprobs_fields_to_the_model_server() -> None:
    cfg = _cfg()
    d = parse_request("chat", _chat(logprobs=True, top_logprobs=3), cfg)
    assert d.fields["upstream"] == {"logprobs": True, "top_logprobs": 3}
    assert parse_request("chat", _chat(logprobs=True), cfg).fields["upstream"] == {"logprobs": True}
    # not asked for: nothing goes (what a client that always sends the fields sends)
    assert parse_request("chat", _chat(logprobs=False, top_logprobs=0), cfg).fields["upstream"] == {}
    assert parse_request("completion", _completion(logprobs=2), cfg).fields["upstream"] == {"logprobs": 2}
    assert parse_request("completion", _completion(logprobs=0), cfg).fields["upstream"] == {"logprobs": 0}
    assert parse_request("completion", _completion(logprobs=None), cfg).fields["upstream"] == {}


def test_a_payload_with_logprobs_is_one_a_worker_before_logprobs_refuses() -> None:
    """Version 4: a worker of the release before reads versions 1 to 3, would send logprobs
    upstream and drop the server's (the client read ``logprobs: null``)."""
    d = parse_request("completion", _completion(logprobs=1), _cfg())
    p = Payload("completion", d.prompt, 8, upstream=d.fields["upstream"])
    assert msgpack.unpackb(p.pack())["v"] == 4
    assert Payload.unpack(p.pack()) == p
    plain = Payload("completion", d.prompt, 8)
    assert msgpack.unpackb(plain.pack())["v"] == 1


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", _chat(logprobs="yes"), "logprobs"),
    ("chat", _chat(logprobs=1), "logprobs"),
    ("chat", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("chat", _chat(logprobs=True, top_logprobs=2.5), "top_logprobs"),
    ("chat", _chat(logprobs=True, top_logprobs="3"), "top_logprobs"),
    ("chat", _chat(top_logprobs=3), "top_logprobs"),  # needs logprobs true (OpenAI, vLLM)
    ("chat", _chat(logprobs=False, top_logprobs=3), "top_logprobs"),
    ("completion", _completion(logprobs=True), "logprobs"),
    ("completion", _completion(logprobs=21), "logprobs"),
    ("completion", _completion(logprobs=-1), "logprobs"),
    ("completion", _completion(logprobs=[1]), "logprobs"),
    ("completion", _completion(logprobs=1, echo="yes"), "echo"),
    ("completion", _completion(echo=1), "echo"),
])
def test_a_malformed_logprobs_field_is_a_400_naming_it(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(kind, body, _cfg())
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_a_pools_max_logprobs_bounds_the_alternatives_asked_for() -> None:
    cfg = _cfg(max_logprobs=5)
    top = parse_request("chat", _chat(logprobs=True, top_logprobs=5), cfg).fields["upstream"]["top_logprobs"]
    assert top == 5
    for kind, body, param in [("chat", _chat(logprobs=True, top_logprobs=6), "top_logprobs"),
                              ("completion", _completion(logprobs=6), "logprobs")]:
        with pytest.raises(ApiError) as e:
            parse_request(kind, body, cfg)
        assert (e.value.param, "[0, 5]" in e.value.message) == (param, True), e.value.message


def test_a_pool_without_logprobs_refuses_them_and_says_which_setting_serves_them() -> None:
    cfg = demo_config()
    for kind, body in [("chat", _chat(logprobs=True)), ("chat", _chat(top_logprobs=2)),
                       ("completion", _completion(logprobs=0))]:
        with pytest.raises(ApiError) as e:
            parse_request(kind, body, cfg)
        assert e.value.status == 400 and "logprobs = true" in e.value.message, e.value.message
    assert parse_request("chat", _chat(logprobs=False, top_logprobs=0), cfg).fields["upstream"] == {}


# --- the model server's logprobs, read by the worker ------------------------------------------

def test_a_chunks_logprobs_become_compact_entries_in_either_endpoints_shape() -> None:
    top = [{"token": "Hi", "logprob": -1.0, "bytes": [72, 105]},
           {"token": "Yo", "logprob": -math.inf, "bytes": None}]
    entry = {"token": "Hi", "logprob": -1.0, "bytes": [72, 105], "top_logprobs": top}
    chat = {"logprobs": {"content": [entry]}}
    assert choice_logprobs(chat, True, "") == [["Hi", -1.0, [72, 105], [["Hi", -1.0, [72, 105]],
                                                                         ["Yo", LOGPROB_FLOOR, None]]]]
    completion = {"logprobs": {"tokens": ["Hi", "!"], "token_logprobs": [None, -0.5],
                               "top_logprobs": [None, {"!": -0.5, "?": math.nan}], "text_offset": [7, 9]}}
    alts = [["!", -0.5, None], ["?", None, None]]
    assert choice_logprobs(completion, False, "") == [["Hi", None, None, None], ["!", -0.5, None, alts]]
    assert choice_logprobs({"logprobs": None}, True, "") == []
    assert choice_logprobs({"logprobs": {"content": None}}, True, "") == []


@pytest.mark.parametrize(("chat", "lp"), [
    (True, []),
    (True, {"content": {"token": "x"}}),
    (True, {"content": [{"token": 5, "logprob": -1.0}]}),
    (True, {"content": [{"token": "x", "logprob": "-1"}]}),
    (True, {"content": [{"token": "x", "logprob": True}]}),
    (True, {"content": [{"token": "x", "logprob": -1.0, "bytes": [256]}]}),
    (True, {"content": [{"token": "x", "logprob": -1.0, "top_logprobs": {"x": -1.0}}]}),
    (True, {"content": [{"token": "x", "logprob": -1.0, "top_logprobs": [{"token": None}]}]}),
    (False, {"tokens": ["a", "b"], "token_logprobs": [-1.0]}),
    (False, {"tokens": "ab", "token_logprobs": [-1.0, -1.0]}),
    (False, {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [["a", -1.0]]}),
    (False, {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": "x"}]}),
    (False, {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": []}),
])
def test_a_logprobs_shape_no_client_reads_is_a_malformed_stream(chat: bool, lp: Any) -> None:
    with pytest.raises(MalformedStream):
        choice_logprobs({"logprobs": lp}, chat, json.dumps(lp))


def test_pending_text_past_a_quarter_of_a_pushes_bound_is_pushed_whatever_the_period() -> None:
    """An unstreamed answer is pushed once a second; with 20 alternatives a token, that
    second's text could pass push_tokens' 16 MiB (the request failed)."""
    from limiter.scripts import Claimed
    from worker.delivery import Delivery

    claimed = Claimed("r1", "P1", "t1", 1, b"", 0, 5, 100_000, "fe1", 0, [], 0, 0)
    d = Delivery(claimed, Payload("chat", "x", 100_000), claim_now_ms=0, claim_t=0.0, usage_in=5,
                 class_rank=1)
    d.add([1], "x", 0.0)
    d.pushes = 1  # (the first push goes at once anyway)
    assert not d.due(0.0, 1000.0, None)
    d.add([1], "", 0.0, logprobs=[["y" * PUSH_TEXT_CHARS, -1.0, None, []]])
    assert d.due(0.0, 1000.0, None)
    assert PUSH_TEXT_CHARS * 4 <= 4 * 1024 * 1024  # a quarter of the bound: a character is at most 4 bytes


# --- end to end: frontend, openai worker, the fake model server ------------------------------

def _fake_tokens(text: str) -> list[str]:
    """The fake's answer to ``text``, in its 3-character tokens."""
    answer = text[::-1]
    return [answer[i:i + 3] for i in range(0, len(answer), 3)]


async def test_chat_logprobs_reach_the_client_whole_streamed_and_through_the_sdk(env_logprobs) -> None:
    cfg, up = env_logprobs
    body = _chat(logprobs=True, top_logprobs=2, max_tokens=40)
    tokens = _fake_tokens("abcdefghijklmno")
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        answer = await r.json()
        r = await client.post("/v1/chat/completions", headers=auth(), json={**body, "stream": True})
        assert r.status == 200, await r.text()
        chunks = [ch async for ch in sse_chunks(r.content) if ch and ch["choices"]]
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            sent = await sdk.chat.completions.create(model="tiny", messages=body["messages"], logprobs=True,
                                                     top_logprobs=2, max_tokens=40)
        finally:
            await sdk.close()
    content = answer["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == tokens
    assert [e["logprob"] for e in content] == [fake_logprob(k) for k in range(len(tokens))]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert [[a["token"] for a in e["top_logprobs"]] for e in content] == [[t, "alt1"] for t in tokens]
    # streamed: each chunk's logprobs are its own text's tokens, every token once
    with_text = [ch["choices"][0] for ch in chunks if ch["choices"][0]["delta"].get("content")]
    assert all("".join(e["token"] for e in c["logprobs"]["content"]) == c["delta"]["content"]
               for c in with_text)
    assert [e for c in with_text for e in c["logprobs"]["content"]] == content
    assert [e.token for e in sent.choices[0].logprobs.content] == tokens  # the SDK's own types
    assert up.bodies[0]["logprobs"] is True and up.bodies[0]["top_logprobs"] == 2


async def test_completion_logprobs_reach_the_client_with_offsets_over_the_whole_answer(env_logprobs) -> None:
    cfg, up = env_logprobs
    body = _completion(logprobs=3, max_tokens=40)
    tokens = _fake_tokens("abcdefghijklmno")
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        whole = (await r.json())["choices"][0]
        # the server's chunks come apart (each waits until the client read the one before): a
        # chunk's offsets count the characters streamed before it
        up.gate = asyncio.Semaphore(0)
        r = await client.post("/v1/completions", headers=auth(), json={**body, "stream": True})
        chunks = []
        async for ch in sse_chunks(r.content):
            if ch and ch["choices"]:
                chunks.append(ch["choices"][0])
                up.gate.release()
        up.gate = None
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            sent = await sdk.completions.create(model="tiny", prompt=body["prompt"], logprobs=3,
                                                max_tokens=40)
        finally:
            await sdk.close()
    lp = whole["logprobs"]
    assert lp["tokens"] == tokens and "".join(tokens) == whole["text"]
    assert lp["token_logprobs"] == [fake_logprob(k) for k in range(len(tokens))]
    assert lp["text_offset"] == [3 * k for k in range(len(tokens))]
    assert [list(t) for t in lp["top_logprobs"]] == [[t, "alt1", "alt2"] for t in tokens]
    streamed = [c for c in chunks if c["text"]]
    assert len(streamed) == len(tokens)
    assert all("".join(c["logprobs"]["tokens"]) == c["text"] for c in streamed)
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == lp["text_offset"]
    assert sent.choices[0].logprobs is not None and sent.choices[0].logprobs.tokens == tokens


async def test_a_request_without_logprobs_in_a_logprobs_pool_answers_null(env_logprobs) -> None:
    cfg, up = env_logprobs
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json=_chat(max_tokens=40))
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["logprobs"] is None
    assert "logprobs" not in up.bodies[0]


def _lp_chunk(tokens: list[str], first: int, finish: str | None = None, field: str = "content") -> bytes:
    """A chat chunk as vLLM streams it with logprobs: ``tokens`` in ``field`` (``reasoning``:
    a reasoning parser's thinking), the answer's ``first``-th token on."""
    entries = [{"token": t, "logprob": fake_logprob(first + i), "bytes": list(t.encode()),
                "top_logprobs": []} for i, t in enumerate(tokens)]
    c = {"id": "x", "object": "chat.completion.chunk", "model": "tiny",
         "choices": [{"index": 0, "delta": {field: "".join(tokens)} if tokens else {},
                      "logprobs": {"content": entries} if tokens else None, "finish_reason": finish}],
         "usage": {"prompt_tokens": 5, "completion_tokens": first + len(tokens), "total_tokens": 5}}
    return ("data: " + json.dumps(c) + "\n\n").encode()


async def _read_resumed(cfg: Any, up: Any, first: list[bytes], then: list[bytes]
                        ) -> tuple[str, list[dict[str, Any]]]:
    """A streamed chat with logprobs (prompt RESUME) whose server writes ``first``, breaks once
    the client read "OneTwoSix " and writes ``then`` to the resume: (the text, the logprobs
    entries) the client read."""
    read = asyncio.Event()
    up.scripts["RESUME"] = breaks_once(first, read, then)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": [{"role": "user", "content": "RESUME"}],
                                    "logprobs": True, "max_tokens": 40, "stream": True})
        assert r.status == 200, await r.text()
        texts: list[str] = []
        entries: list[dict[str, Any]] = []
        async for ch in sse_chunks(r.content):
            if not ch or not ch.get("choices"):
                continue
            c = ch["choices"][0]
            texts.append(c["delta"].get("content") or "")
            entries += (c["logprobs"] or {}).get("content") or []
            if "".join(texts) == "OneTwoSix ":
                read.set()  # the chunks reached the client: now the server breaks
    return "".join(texts), entries


async def test_a_resumed_answers_logprobs_reach_the_client_once_per_token(env_logprobs) -> None:
    """The stream breaks after chunks the client read, the last a space; the next attempt
    continues the answer, whose first token repeats that space (the resume sent the text
    without it: worker/upstream.py _past_seam), and the client reads every token's logprob
    once, in order: the repeated space's too would be one token too many."""
    cfg, up = env_logprobs
    first = [_lp_chunk(["One", "Two"], 0), _lp_chunk(["Six"], 2), _lp_chunk([" "], 3)]
    then = [_lp_chunk([" "], 0), _lp_chunk(["Ten"], 1), _lp_chunk([], 2, finish="stop")]
    text, entries = await _read_resumed(cfg, up, first, then)
    assert up.calls["RESUME"] == 2
    assert text == "OneTwoSix Ten"
    assert [e["token"] for e in entries] == ["One", "Two", "Six", " ", "Ten"]
    assert up.bodies[-1]["messages"][-1] == {"role": "assistant", "content": "OneTwoSix"}


async def test_malformed_logprobs_fail_the_request_as_a_malformed_response(env_logprobs) -> None:
    cfg, up = env_logprobs

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        bad = {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hi"},
                                       "logprobs": {"content": [{"token": 5}]}, "finish_reason": "stop"}]}
        await resp.write(f"data: {json.dumps(bad)}\n\ndata: [DONE]\n\n".encode())
        return resp

    up.scripts["BADLP"] = script
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": [{"role": "user", "content": "BADLP"}],
                                    "logprobs": True, "max_tokens": 40})
        body = await r.json()
    assert r.status != 500 and "malformed response" in body["error"]["message"], body


# --- echo: the prompt before the answer, and with logprobs the prompt's tokens' first ----------

def test_echo_is_the_frontends_own_unless_the_prompts_logprobs_are_asked_for() -> None:
    """``echo`` alone: the frontend puts the prompt before the answer, any engine serves it
    (nothing goes upstream). With logprobs: the model server is asked to echo, for the
    prompt's tokens' logprobs (lm-eval's loglikelihood tasks)."""
    alone = parse_request("completion", _completion(echo=True), demo_config())
    assert (alone.fields["echo"], alone.fields["upstream"]) == (True, {})
    both = parse_request("completion", _completion(echo=True, logprobs=1), _cfg())
    assert (both.fields["echo"], both.fields["upstream"]) == (True, {"logprobs": 1, "echo": True})
    assert parse_request("completion", _completion(echo=False), _cfg()).fields["echo"] is False
    with pytest.raises(ApiError) as e:  # a chat has none (as OpenAI)
        parse_request("chat", _chat(echo=True), _cfg())
    assert e.value.param == "echo"


async def test_an_echoed_completion_begins_with_its_prompt_streamed_or_not(env_logprobs) -> None:
    cfg, up = env_logprobs
    prompt = "ab\x00cd"  # (a NUL in the prompt is text, not a mark of the pushed text: NUL c is one)
    answer = prompt[::-1]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(),
                              json={"model": "tiny", "prompt": prompt, "echo": True, "max_tokens": 40})
        assert r.status == 200, await r.text()
        whole = (await r.json())["choices"][0]
        r = await client.post("/v1/completions", headers=auth(),
                              json={"model": "tiny", "prompt": prompt, "echo": True, "max_tokens": 40,
                                    "stream": True})
        streamed = "".join([ch["choices"][0]["text"] async for ch in sse_chunks(r.content)
                            if ch and ch["choices"]])
    assert whole["text"] == streamed == prompt + answer
    assert whole["logprobs"] is None
    assert all("echo" not in b for b in up.bodies)  # the frontend's own


async def test_an_echoed_completions_logprobs_begin_with_the_prompts_tokens(env_logprobs) -> None:
    """As lm-eval's loglikelihood tasks ask (echo, logprobs 1, max_tokens 1, unstreamed): the
    prompt's tokens' logprobs, the first null, then the answer's; the text is the prompt and
    the answer once each (the worker takes the server's echo apart, the frontend adds it)."""
    cfg, up = env_logprobs
    prompt = "abcdefghi"
    body = {"model": "tiny", "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0.0, "seed": 1234}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        whole = (await r.json())["choices"][0]
        up.gate = asyncio.Semaphore(0)
        r = await client.post("/v1/completions", headers=auth(),
                              json={**body, "max_tokens": 3, "stream": True})
        chunks = []
        async for ch in sse_chunks(r.content):
            if ch and ch["choices"]:
                chunks.append(ch["choices"][0])
                up.gate.release()
        up.gate = None
    lp = whole["logprobs"]
    assert whole["text"] == prompt + "ihg"
    assert lp["tokens"] == [*prompt, "ihg"]
    assert lp["token_logprobs"] == [*(fake_prompt_logprob(k) for k in range(len(prompt))), fake_logprob(0)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [*range(len(prompt)), len(prompt)]
    streamed = [c for c in chunks if c["text"]]
    assert "".join(c["text"] for c in streamed) == prompt + "ihgfedcba"
    assert [t for c in streamed for t in c["logprobs"]["tokens"]] == [*prompt, "ihg", "fed", "cba"]
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == [*range(9), 9, 12, 15]
    assert all(b["echo"] is True and b["prompt"] == prompt for b in up.bodies)


async def test_an_echoed_answer_resumed_sends_no_second_echo(env_logprobs) -> None:
    """Broken off after the echo and the first text: the next attempt continues the prompt and
    the text delivered, without ``echo`` (the client has the prompt's logprobs); the client
    reads the prompt and each token's logprob once."""
    cfg, up = env_logprobs
    read = asyncio.Event()
    prompt = "RESUME:"

    def lp(tokens: list[str], first: int, echo: bool = False) -> dict[str, Any]:
        out = {"tokens": tokens, "token_logprobs": [fake_logprob(first + i) for i in range(len(tokens))],
               "top_logprobs": [None] * len(tokens), "text_offset": [0] * len(tokens)}
        if echo:
            out = {k: [*([None] * len(prompt) if k != "tokens" else prompt), *v] for k, v in out.items()}
        return out

    def chunk(text: str, lps: dict[str, Any], finish: str | None = None) -> bytes:
        c = {"id": "x", "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}]}
        return ("data: " + json.dumps(c) + "\n\n").encode()

    # (the echo alone first: a chunk of no answer text, whose logprobs are the prompt's)
    first = [chunk(prompt, lp([], 0, echo=True)), chunk("One", lp(["One"], 0)), chunk("Two", lp(["Two"], 1))]
    up.scripts["RESUME"] = breaks_once(first, read, [chunk("Six", lp(["Six"], 0)), sse_chunk(finish="stop")])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/completions", headers=auth(),
                              json={"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 0,
                                    "max_tokens": 40, "stream": True})
        assert r.status == 200, await r.text()
        texts: list[str] = []
        tokens: list[str] = []
        async for ch in sse_chunks(r.content):
            if ch and ch.get("choices"):
                texts.append(ch["choices"][0]["text"])
                tokens += (ch["choices"][0]["logprobs"] or {}).get("tokens") or []
                if "".join(texts) == prompt + "OneTwo":
                    read.set()
    assert "".join(texts) == prompt + "OneTwoSix"
    assert tokens == [*prompt, "One", "Two", "Six"]
    assert up.bodies[0]["echo"] is True and "echo" not in up.bodies[1]
    assert up.bodies[1]["prompt"] == prompt + "OneTwo"


async def test_an_echo_that_is_not_the_prompt_fails_the_request_as_a_malformed_response(env_logprobs) -> None:
    cfg, up = env_logprobs

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(sse_chunk("something else", finish="stop") + b"data: [DONE]\n\n")
        return resp

    up.scripts["ECHO"] = script
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/completions", headers=auth(),
                              json={"model": "tiny", "prompt": "ECHO", "echo": True, "logprobs": 0,
                                    "max_tokens": 40})
        body = await r.json()
    assert r.status != 500 and "malformed response" in body["error"]["message"], body
def _lp_entries_chunk(entries: list[tuple[str, float]], text: str, completion_tokens: int,
                      finish: str | None = None) -> bytes:
    """A chat chunk whose text is ``text`` and whose logprobs are ``entries`` as vLLM streams
    them (a chunk of several tokens, or one whose token has no text: an EOS)."""
    content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
               for t, lp in entries]
    c = {"id": "x", "object": "chat.completion.chunk", "model": "tiny",
         "choices": [{"index": 0, "delta": {"content": text}, "logprobs": {"content": content},
                      "finish_reason": finish}],
         "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens, "total_tokens": 5}}
    return ("data: " + json.dumps(c) + "\n\n").encode()


async def test_a_resumes_repeated_seam_in_a_chunk_of_several_tokens_is_answered_once(env_logprobs) -> None:
    """The resumed server's first chunk holds two tokens, the space the client already read
    and the next word (vLLM sends several tokens a chunk under load, or with speculative
    decoding): the text loses the repeated space (_past_seam), and so must its logprobs, or
    the client reads the space's token twice."""
    cfg, up = env_logprobs
    first = [_lp_chunk(["One", "Two"], 0), _lp_chunk(["Six"], 2), _lp_chunk([" "], 3)]
    then = [_lp_entries_chunk([(" ", -0.5), ("Ten", -0.25)], " Ten", 2), _lp_chunk([], 2, finish="stop")]
    text, entries = await _read_resumed(cfg, up, first, then)
    assert up.calls["RESUME"] == 2
    assert text == "OneTwoSix Ten"
    assert [e["token"] for e in entries] == ["One", "Two", "Six", " ", "Ten"]
    assert entries[-1]["logprob"] == -0.25


@pytest.mark.parametrize("stream", [False, True])
async def test_the_logprob_of_a_token_without_text_reaches_the_client(env_logprobs, stream: bool) -> None:
    """vLLM keeps the stop token among a choice's tokens and logprobs (its text is left out:
    v1/engine/detokenizer.py), so its last chunk has no text and the EOS token's logprob
    (serving_chat.py: logprobs on every chunk, the finish chunk's too), and its whole answer
    has as many logprobs as completion_tokens. Dropped as a chunk without text, the client
    lost it."""
    cfg, up = env_logprobs

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        for c in (_lp_entries_chunk([("Hi", -0.5)], "Hi", 1),
                  _lp_entries_chunk([("<|eot_id|>", -0.125)], "", 2, finish="stop")):
            await resp.write(c)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up.scripts["EOS"] = script
    body = {"model": "tiny", "messages": [{"role": "user", "content": "EOS"}], "logprobs": True,
            "max_tokens": 40, "stream": stream}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        if stream:
            entries: list[dict[str, Any]] = []
            text = ""
            async for ch in sse_chunks(r.content):
                if ch and ch.get("choices"):
                    c = ch["choices"][0]
                    text += c["delta"].get("content") or ""
                    entries += (c["logprobs"] or {}).get("content") or []
        else:
            answer = (await r.json())["choices"][0]
            text, entries = answer["message"]["content"], answer["logprobs"]["content"]
    assert text == "Hi"
    assert [(e["token"], e["logprob"]) for e in entries] == [("Hi", -0.5), ("<|eot_id|>", -0.125)]


async def test_a_second_thought_after_a_resume_forwards_no_logprobs(env_logprobs) -> None:
    """Broken off mid-thought, the next attempt thinks again from the start; that thought is
    not forwarded (the client read the first), and neither are its tokens' logprobs."""
    cfg, up = env_logprobs
    read = asyncio.Event()
    first = [_lp_chunk(["Hmm"], 0, field="reasoning")]
    then = [_lp_chunk(["Hmm"], 0, field="reasoning"), _lp_chunk(["Yes"], 1), _lp_chunk([], 2, finish="stop")]
    up.scripts["THINK"] = breaks_once(first, read, then)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": [{"role": "user", "content": "THINK"}],
                                    "logprobs": True, "max_tokens": 40, "stream": True})
        assert r.status == 200, await r.text()
        tokens: list[str] = []
        async for ch in sse_chunks(r.content):
            if ch and ch.get("choices"):
                tokens += [e["token"] for e in ((ch["choices"][0]["logprobs"] or {}).get("content") or [])]
                if ch["choices"][0]["delta"].get("reasoning"):
                    read.set()
    assert up.calls["THINK"] == 2
    assert tokens == ["Hmm", "Yes"]


async def test_a_pool_with_tool_calls_and_logprobs_answers_both_in_the_servers_order(
        redis_server, fake_upstream) -> None:
    """Text, then a tool call in two chunks, each chunk with its tokens' logprobs: the calls
    reach the client as with no logprobs, and every token's logprob once, in order (streamed,
    a run's on its last chunk)."""
    cfg, up = make_cfg(redis_server.url, pool={"logprobs": True, "tool_calls": True}), fake_upstream
    call = [[{"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": ""}}],
            [{"index": 0, "function": {"arguments": "{}"}}]]

    def chunk(delta: dict[str, Any], tokens: list[str], first: int, finish: str | None = None) -> bytes:
        entries = [{"token": t, "logprob": fake_logprob(first + i), "bytes": list(t.encode()),
                    "top_logprobs": []} for i, t in enumerate(tokens)]
        c = {"id": "x", "choices": [{"index": 0, "delta": delta, "logprobs": {"content": entries},
                                     "finish_reason": finish}],
             "usage": {"prompt_tokens": 5, "completion_tokens": first + len(tokens), "total_tokens": 5}}
        return ("data: " + json.dumps(c) + "\n\n").encode()

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chunk({"content": "Ok."}, ["Ok", "."], 0))
        await resp.write(chunk({"tool_calls": call[0]}, ["<tool>", "f"], 2))
        await resp.write(chunk({"tool_calls": call[1]}, ["{}", "</tool>"], 4, finish="tool_calls"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up.scripts["TOOLS"] = script
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "TOOLS"}], "tools": [tool],
            "logprobs": True, "max_tokens": 40}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        whole = (await r.json())["choices"][0]
        r = await client.post("/v1/chat/completions", headers=auth(), json={**body, "stream": True})
        chunks = [ch["choices"][0] async for ch in sse_chunks(r.content) if ch and ch["choices"]]
    tokens = ["Ok", ".", "<tool>", "f", "{}", "</tool>"]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["tool_calls"] == [{"id": "t1", "type": "function",
                                               "function": {"name": "f", "arguments": "{}"}}]
    assert [e["token"] for e in whole["logprobs"]["content"]] == tokens
    assert [c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]] == call
    assert [e["token"] for c in chunks for e in ((c["logprobs"] or {}).get("content") or [])] == tokens
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Ok."


async def test_a_long_prompts_echo_with_its_logprobs_is_one_line_past_a_mebibyte(redis_server,
                                                                                 fake_upstream) -> None:
    """vLLM sends the echoed prompt's logprobs in the stream's first chunk, one line; with a
    long prompt that line is past MAX_SSE_LINE (a chunk without echo is well under a
    kilobyte), and the request failed as a malformed response: lm-eval's loglikelihood with
    a long ``max_length`` (here 40,000 tokens of the fake, ~1.3 MB in one line)."""
    from worker.sse_events import MAX_SSE_LINE
    cfg = make_cfg(redis_server.url, pool={"logprobs": True, "context_tokens": 65536})
    prompt = ("the quick brown fox " * 2000)[:40_000]
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        answer = await r.json()
    assert r.status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    assert lp["tokens"][:len(prompt)] == list(prompt) and len(lp["tokens"]) == len(prompt) + 1
    ctxlen = len(prompt) - 5  # lm-eval's parse: the continuation's tokens, the generated one left out
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
        sum(fake_prompt_logprob(k) for k in range(ctxlen, len(prompt))))
    assert len(json.dumps(lp)) > MAX_SSE_LINE  # (the line the server sent was longer still)


async def test_an_echo_whose_prompts_logprobs_pass_4_mib_is_answered(redis_server, fake_upstream) -> None:
    """The echo's chunk carries the prompt's logprobs in one push: with 5 alternatives a
    token, 60,000 prompt tokens are ~8 MB of them, past the 4 MiB a push's text was bounded
    by (the request failed, "the worker's tokens for this request were refused")."""
    cfg = make_cfg(redis_server.url, pool={"logprobs": True, "context_tokens": 65536})
    prompt = ("the quick brown fox " * 3000)[:60_000]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "logprobs": 5, "echo": True}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        raw = await r.read()
    assert r.status == 200, raw[:300]
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and len(json.dumps(lp)) > 4 * 1024 * 1024


async def test_an_echoed_prompts_logprobs_past_what_a_batch_carries_are_refused_saying_so(
        redis_server, fake_upstream) -> None:
    """Past the 16 MiB a batch's text may be, an echo's prompt's logprobs (one chunk) cannot be
    answered: a refusal that says why (not a 503 "tokens refused", which the SDKs retry to
    the same end, each prefilled again). (After a review's test.)"""
    cfg = make_cfg(redis_server.url, pool={"logprobs": True, "context_tokens": 65536})
    prompt = "abcdefghij" * 6000
    body = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 1}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "request_refused", err
    assert "logprobs" in err["message"] and "shorter prompt" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echoed_prompts_logprobs_past_a_chunks_line_bound_reach_the_client(
        redis_server, fake_upstream, stream: bool) -> None:
    """20 alternatives a token make an echo's first chunk ~300 bytes a prompt token: a prompt
    of a few thousand tokens passes the 1 MiB a line of a stream without echo may hold.
    Streamed and whole, the client reads every prompt token's logprob. (A review's test.)"""
    from worker.sse_events import MAX_SSE_LINE

    cfg = make_cfg(redis_server.url, pool={"logprobs": True, "context_tokens": 8192})
    prompt = "abcdefghij" * 400
    body = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 1,
            "stream": stream}
    none: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    assert len(json.dumps(echo_logprobs(body, none))) > MAX_SSE_LINE  # (the server's first chunk)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        if stream:  # (read whole: aiohttp's line reader takes 512 KiB a line)
            events = [e.removeprefix(b"data: ") for e in (await r.read()).split(b"\n\n") if e]
            chunks = [json.loads(e)["choices"][0] for e in events if e != b"[DONE]"]
        else:
            chunks = [(await r.json())["choices"][0]]
    assert "".join(c["text"] for c in chunks).startswith(prompt)
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens[:len(prompt)] == list(prompt) and len(tokens) == len(prompt) + 1
