"""Tool calling in front of a model server that calls tools (``[[pools]] tool_calls``): the
request's tools reach the server, its tool calls reach the client as OpenAI's shape (streamed
deltas, a whole message, ``finish_reason: tool_calls``), and a call broken off is failed, not
resumed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import openai
import pytest

from limiter.config import demo_config, validate
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import merge_tool_calls, parse_request
from limiter.localstack.sse import sse_chunks
from limiter.prompt import ChatMessage, Payload
from limiter.reply_text import ReplyText, pack, unpack, unpack_in_order
from tests.support.fake_upstream import breaks_once, chat_chunk, sse_response, tool_chunk
from tests.support.frontend_helpers import auth, frontend, make_cfg
from tests.support.worker_helpers import worker

RETRY = {"upstream_retry_min_s": 0.1, "upstream_retry_max_s": 0.4}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
# vLLM's stream of one call (hermes parser): the id, type and name first, the arguments in pieces
CALL_DELTAS = [[{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                 "function": {"name": "get_weather", "arguments": ""}}],
               [{"index": 0, "function": {"arguments": "{\"city\": "}}],
               [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]]
CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def _tool_cfg(**pool: Any):
    cfg = demo_config()
    pools = tuple(dataclasses.replace(p, tool_calls=True, **pool) for p in cfg.pools)
    return validate(dataclasses.replace(cfg, pools=pools))


# --- the text a push carries ---------------------------------------------------------------

def test_tool_calls_ride_in_the_pushed_text_and_unpack_in_order() -> None:
    nul = [{"index": 0, "function": {"arguments": "\x00\"}"}}]  # a NUL in the JSON: escaped
    pieces = [pack("", tool_calls=CALL_DELTAS[0]), pack("", "hm", tool_calls=CALL_DELTAS[1]),
              pack("a\x00b", tool_calls=nul), pack("c")]
    got = unpack("".join(pieces))
    assert got == ReplyText("a\x00bc", "hm", "reasoning", (CALL_DELTAS[0], CALL_DELTAS[1], nul))
    assert unpack(pack("plain")) == ReplyText("plain")  # no tool calls: the text as it is


def test_a_whole_answers_tool_calls_are_merged_by_index() -> None:
    second = [[{"index": 1, "id": "t2", "type": "function", "function": {"name": "f", "arguments": "{"}}],
              [{"index": 1, "function": {"arguments": "}"}}]]
    merged = merge_tool_calls([CALL_DELTAS[0], second[0], *CALL_DELTAS[1:], second[1]])
    assert merged == [CALL, {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert merge_tool_calls([]) == []
    # a delta with no index (a server's own shape) is a call of its own, not merged into index 0
    unindexed = {"id": "u", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    assert merge_tool_calls([[unindexed], CALL_DELTAS[0], *CALL_DELTAS[1:]]) == [unindexed, CALL]


# --- the request -----------------------------------------------------------------------------

def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], **body}


def test_a_tool_pools_request_carries_its_tools_choice_and_earlier_calls_to_the_model_server() -> None:
    cfg = _tool_cfg()
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C"}]
    d = parse_request("chat", {"model": "tiny", "messages": messages, "tools": [WEATHER],
                               "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                               "parallel_tool_calls": False}, cfg)
    up = d.fields["upstream"]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert up == {"tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False}
    assert d.messages[1] == ChatMessage("assistant", "", tool_calls=(CALL,))
    assert d.messages[1].to_dict() == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    # counted by the frontend's own counters: the tools' and the calls' JSON are in the prompt
    assert "get_weather" in d.prompt and "Weather of a city" in d.prompt and "Paris\\\"}" in d.prompt
    bare = parse_request("chat", {"model": "tiny", "messages": messages[:1]}, cfg)
    assert len(d.prompt) > len(bare.prompt) + len(json.dumps(WEATHER))
    # stored and read back by the worker as sent
    p = Payload("chat", d.prompt, 8, messages=d.messages, upstream=up)
    assert Payload.unpack(p.pack()).messages == d.messages
    assert Payload.unpack(p.pack()).upstream == up
    # no tools: none of the three goes (the server answers as without them)
    assert parse_request("chat", _chat(tools=[], tool_choice="none", parallel_tool_calls=True),
                         cfg).fields["upstream"] == {}


def test_a_payload_with_tools_or_earlier_calls_is_one_a_worker_before_tool_calling_refuses() -> None:
    """Version 3: a worker of the release before, which reads versions 1 and 2, sent the tools
    upstream and dropped the server's tool calls (an empty answer ending "stop"), and sent an
    assistant turn without its calls. It refuses version 3 (the request fails) instead."""
    import msgpack

    cfg = _tool_cfg()
    with_tools = parse_request("chat", _chat(tools=[WEATHER]), cfg)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C"}]
    with_calls = parse_request("chat", {"model": "tiny", "messages": history}, cfg)
    for d in (with_tools, with_calls):
        p = Payload("chat", d.prompt, 8, messages=d.messages, upstream=d.fields["upstream"])
        assert msgpack.unpackb(p.pack())["v"] == 3
        assert Payload.unpack(p.pack()) == p
    # neither: as before, an older worker reads it
    plain = parse_request("chat", _chat(tools=[], tool_choice="none"), cfg)
    assert msgpack.unpackb(Payload("chat", plain.prompt, 8, messages=plain.messages).pack())["v"] == 1


@pytest.mark.parametrize(("body", "param"), [
    (_chat(tools={"a": 1}), "tools"),
    (_chat(tools=[WEATHER] * 2), "tools[1].function.name"),
    (_chat(tools=[{**WEATHER, "type": "code_interpreter"}]), "tools[0].type"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": "f" * 257}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]), "tools[0].function.extra"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict"),
    (_chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools"),
    (_chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice.function.name"),
    (_chat(tool_choice="auto"), "tool_choice"),
    (_chat(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (_chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), "messages[0].tool_calls"),
    (_chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": None}]}]),
     "messages[0].tool_calls[0].id"),
    (_chat(messages=[{"role": "assistant",
                      "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (_chat(messages=[{"role": "assistant", "tool_calls": [{**CALL, "type": "web"}]}]),
     "messages[0].tool_calls[0].type"),
    (_chat(messages=[{"role": "assistant", "tool_calls": "x"}]), "messages[0].tool_calls"),
    # junk that is falsy was taken for no calls and dropped (a pool without tool_calls: a 400)
    *[(_chat(messages=[{"role": "assistant", "content": "x", "tool_calls": v}]), "messages[0].tool_calls")
      for v in (0, "", False, {})],
    (_chat(messages=[{"role": "assistant", "content": None}]), "messages[0].content"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}]),
     "tools[0].function.description"),
])
def test_a_malformed_tool_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request("chat", body, _tool_cfg())
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_a_pool_that_calls_no_tools_refuses_them_and_says_which_setting_serves_them() -> None:
    cfg = demo_config()
    for body, param in [(_chat(tools=[WEATHER]), "tools"), (_chat(tool_choice="auto"), "tool_choice"),
                        (_chat(messages=[{"role": "assistant", "content": "", "tool_calls": [CALL]}]),
                         "messages[0].tool_calls")]:
        with pytest.raises(ApiError) as e:
            parse_request("chat", body, cfg)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(ApiError) as e:
        parse_request("chat", _chat(tools=[WEATHER]), cfg)
    assert "tool_calls = true" in e.value.message
    # what a client that always sends the fields sends with no tools is still accepted
    assert parse_request("chat", _chat(tools=[], tool_choice="none"), cfg).fields["upstream"] == {}


# --- end to end: frontend, openai worker, a model server that calls tools ----------------------

def _calls_weather(finish: str = "tool_calls") -> Any:
    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        for i, deltas in enumerate(CALL_DELTAS, 1):
            await resp.write(tool_chunk(deltas, completion_tokens=i))
        await resp.write(tool_chunk([], finish=finish, completion_tokens=len(CALL_DELTAS)))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return script


async def test_a_tool_call_reaches_the_client_whole_streamed_and_through_the_sdk(env_tools) -> None:
    cfg, up = env_tools
    up.scripts["Weather"] = _calls_weather()
    body = _chat(tools=[WEATHER], tool_choice="auto", max_tokens=40)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(), json=body)
        assert r.status == 200, await r.text()
        answer = await r.json()
        r = await client.post("/v1/chat/completions", headers=auth(), json={**body, "stream": True})
        assert r.status == 200, await r.text()
        chunks = [ch async for ch in sse_chunks(r.content) if ch and ch["choices"]]
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            sent = await sdk.chat.completions.create(model="tiny", messages=body["messages"], tools=[WEATHER])
            stream = await sdk.chat.completions.create(model="tiny", messages=body["messages"],
                                                       tools=[WEATHER], stream=True)
            streamed = [c async for c in stream]
        finally:
            await sdk.close()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert answer["usage"]["completion_tokens"] == len(CALL_DELTAS)
    deltas = [ch["choices"][0]["delta"]["tool_calls"] for ch in chunks
              if "tool_calls" in ch["choices"][0]["delta"]]
    assert deltas == CALL_DELTAS  # as the model server sent them, a chunk each
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(ch["choices"][0]["delta"].get("content") in (None, "") for ch in chunks)
    # the SDK's own types read both
    assert sent.choices[0].finish_reason == "tool_calls"
    (call,) = sent.choices[0].message.tool_calls or []
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "chatcmpl-tool-1", "get_weather", {"city": "Paris"})
    args = "".join(tc.function.arguments or "" for c in streamed if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []) if tc.function)
    assert json.loads(args) == {"city": "Paris"}
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # the model server got the tools, as the client sent them
    assert all(b["tools"] == [WEATHER] for b in up.bodies)
    assert up.bodies[0]["tool_choice"] == "auto" and "tool_choice" not in up.bodies[2]


@pytest.mark.parametrize("bad", [{"index": [0], "function": {"name": "get_weather"}},
                                 {"index": 0, "function": "get_weather"},
                                 {"index": 0, "function": {"name": 5, "arguments": {"city": "Paris"}}},
                                 {"index": True, "id": ["x"]}])
async def test_a_malformed_tool_call_delta_fails_the_request_as_a_malformed_response(env_tools, bad) -> None:
    """A delta not of OpenAI's shape (an index that is no integer: unhashable, it was a 500
    from the frontend's merge; a function, name or arguments that is no string: the client's
    SDK fails on it) is a malformed response, as any other."""
    cfg, up = env_tools

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(tool_chunk([bad], completion_tokens=1))
        await resp.write(tool_chunk([], finish="tool_calls", completion_tokens=1) + b"data: [DONE]\n\n")
        return resp

    up.scripts["Weather"] = script
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(tools=[WEATHER], max_tokens=40))
        body = await r.json()
    assert r.status != 500 and "malformed response" in body["error"]["message"], body
    assert merge_tool_calls([[bad]])[0]["type"] == "function"  # the frontend's merge takes any


async def test_a_tool_result_goes_back_to_the_model_server_with_the_call_it_answers(env_tools) -> None:
    cfg, up = env_tools
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C and sunny"}]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": messages, "tools": [WEATHER],
                                    "max_tokens": 40})
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"] == "18 C and sunny"[::-1]  # the fake's answer
    (body,) = up.bodies
    assert body["messages"] == messages
    assert body["tools"] == [WEATHER]


async def test_a_call_to_a_name_the_tools_do_not_have_can_be_sent_back(env_tools) -> None:
    """A model server's parser does not hold the model to the tools' names (vLLM's hermes
    reads whatever name the model wrote): the answer, sent back as the next request's history
    with the tool's error, is accepted (it was a 400 on the name: the agent loop ended)."""
    cfg, up = env_tools
    odd = {"index": 0, "id": "chatcmpl-tool-9", "type": "function",
           "function": {"name": "weather.get now", "arguments": "{}"}}

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(tool_chunk([odd], finish="tool_calls", completion_tokens=3) + b"data: [DONE]\n\n")
        return resp

    up.scripts["Weather"] = script
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(tools=[WEATHER], max_tokens=40))
        assert r.status == 200, await r.text()
        message = (await r.json())["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "weather.get now"
        history = [*_chat()["messages"], message,
                   {"role": "tool", "tool_call_id": "chatcmpl-tool-9", "content": "no such tool"}]
        up.scripts.pop("Weather")
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json={"model": "tiny", "messages": history, "tools": [WEATHER],
                                    "max_tokens": 40})
        assert r.status == 200, await r.text()
    assert up.bodies[-1]["messages"][1]["tool_calls"] == [{k: v for k, v in odd.items() if k != "index"}]
    with pytest.raises(ApiError) as e:  # still bounded: stored with the request
        parse_request("chat", {"model": "tiny", "messages": [
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f" * 257, "arguments": ""}}]},
        ]}, _tool_cfg())
    assert e.value.param == "messages[0].tool_calls[0].function.name"


async def test_a_tool_call_broken_off_is_failed_not_resumed(env_tools) -> None:
    """A stream broken off after the first pieces of a call: the client read them, and a
    second answer would call again or write text after them. The request fails with a message
    saying so; the model server is asked once."""
    cfg, up = env_tools
    read = asyncio.Event()
    up.scripts["Weather"] = breaks_once([tool_chunk(CALL_DELTAS[0], completion_tokens=1)], read,
                                        [tool_chunk(CALL_DELTAS[1], finish="tool_calls",
                                                    completion_tokens=1)])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(tools=[WEATHER], max_tokens=40, stream=True))
        assert r.status == 200, await r.text()
        events: list[Any] = []
        async for ch in sse_chunks(r.content):
            events.append(ch)
            if ch and ch.get("choices") and "tool_calls" in ch["choices"][0]["delta"]:
                read.set()  # the call's first piece reached the client: now the server breaks
    assert up.calls["Weather"] == 1
    error = next(e for e in events if e and "error" in e)
    assert "tool call" in error["error"]["message"] and "cannot be resumed" in error["error"]["message"]


async def test_an_answer_broken_off_before_its_tool_call_is_resumed_and_calls(env_tools) -> None:
    """Broken off after text alone, the answer is resumed as any other, and the tool call that
    comes in the continuation reaches the client."""
    cfg, up = env_tools
    read = asyncio.Event()
    up.scripts["Weather"] = breaks_once([chat_chunk("Let me look.", completion_tokens=1)], read,
                                        [tool_chunk([CALL_DELTAS[0][0] | {"function": {**CALL["function"]}}],
                                                    completion_tokens=1),
                                         tool_chunk([], finish="tool_calls", completion_tokens=1)])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url, **RETRY):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(tools=[WEATHER], max_tokens=40, stream=True))
        assert r.status == 200, await r.text()
        chunks = []
        async for ch in sse_chunks(r.content):
            chunks.append(ch)
            if ch and ch.get("choices") and ch["choices"][0]["delta"].get("content"):
                read.set()
    assert up.calls["Weather"] == 2
    choices = [c["choices"][0] for c in chunks if c and c.get("choices")]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Let me look."
    calls = [c["delta"]["tool_calls"] for c in choices if "tool_calls" in c["delta"]]
    assert calls == [[{**CALL, "index": 0}]]
    assert choices[-1]["finish_reason"] == "tool_calls"


async def test_tools_are_counted_as_prompt_tokens_by_the_model_servers_tokenize(env_tools) -> None:
    """With ``tokenizer = "upstream"`` the count asks /tokenize with the tools, as vLLM's
    template renders them; the prompt's usage is the count."""
    cfg, up = env_tools
    pools = tuple(dataclasses.replace(p, tokenizer="upstream", tokenizer_url=up.url) for p in cfg.pools)
    cfg = dataclasses.replace(cfg, pools=pools)
    body = _chat(tools=[WEATHER], max_tokens=4)
    async with frontend(cfg) as client:
        r = await client.post("/v1/chat/completions", headers=auth(), json={**body, "max_tokens": 100_000})
        assert r.status == 400  # the count came first: the context check refuses it, nothing admitted
    (asked,) = up.tokenized
    assert asked["tools"] == [WEATHER] and asked["messages"] == body["messages"]


@pytest.fixture
def env_tools(redis_server, fake_upstream):
    return make_cfg(redis_server.url, pool={"tool_calls": True}), fake_upstream


def test_text_between_tool_calls_unpacks_where_it_came() -> None:
    """Chunks pushed together (one read of the stream): text before a call, a parser's newline
    between two calls, thinking after text. In order, as runs of thinking, calls, then text;
    merged, as a whole answer."""
    c0 = [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}}]
    c1 = [{"index": 1, "id": "b"}]
    joined = "".join([pack("Let me."), pack("", tool_calls=c0), pack("\n"), pack("", tool_calls=c1),
                      pack("x"), pack("then", "thought")])
    assert unpack_in_order(joined) == [ReplyText("Let me."), ReplyText("\n", tool_calls=(c0,)),
                                       ReplyText("x", tool_calls=(c1,)),
                                       ReplyText("then", "thought", "reasoning")]
    assert unpack(joined) == ReplyText("Let me.\nxthen", "thought", "reasoning", (c0, c1))
    assert unpack_in_order(pack("plain")) == [ReplyText("plain")]


async def test_a_stream_keeps_the_model_servers_order_of_text_and_calls(env_tools) -> None:
    """Text, a call, a newline, a second call, sent in one write (pushed together): the client
    reads them in that order, not the text first and the calls after it."""
    cfg, up = env_tools
    second = [{"index": 1, "id": "chatcmpl-tool-2", "type": "function",
               "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chat_chunk("Checking.", completion_tokens=1)
                         + tool_chunk(CALL_DELTAS[0], completion_tokens=2)
                         + chat_chunk("\n", completion_tokens=3) + tool_chunk(second, completion_tokens=4)
                         + tool_chunk([], finish="tool_calls", completion_tokens=4) + b"data: [DONE]\n\n")
        return resp

    up.scripts["Weather"] = script
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(tools=[WEATHER], max_tokens=40, stream=True))
        assert r.status == 200, await r.text()
        deltas = [ch["choices"][0]["delta"] async for ch in sse_chunks(r.content) if ch and ch["choices"]]
    seen = [("calls", d["tool_calls"][0]["index"]) if "tool_calls" in d else ("text", d["content"])
            for d in deltas if d.get("content") or "tool_calls" in d]
    assert seen == [("text", "Checking."), ("calls", 0), ("text", "\n"), ("calls", 1)]


def test_a_tools_name_is_any_text_as_the_model_server_takes_it() -> None:
    """vLLM takes any function name (OpenAI's own API holds them to 64 of [A-Za-z0-9_-]): an
    MCP client's dotted "server.tool", a pydantic generic's "Resp[int]" (the SDK's
    pydantic_function_tool) were a 400 here."""
    names = ["github.create_issue", "Resp[int]", "mcp__files__read file"]
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    choice = {"type": "function", "function": {"name": names[1]}}
    d = parse_request("chat", _chat(tools=tools, tool_choice=choice), _tool_cfg())
    assert [t["function"]["name"] for t in d.fields["upstream"]["tools"]] == names
    assert d.fields["upstream"]["tool_choice"]["function"]["name"] == "Resp[int]"
