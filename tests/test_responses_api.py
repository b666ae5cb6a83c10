"""OpenAI's Responses API (``POST /v1/responses``), stateless, served as the chat it asks for:
the body checked field by field (a 400 names the field as the client sent it) and turned into
the chat it describes; the answer a ``response`` object or its stream of typed events, each
validated against the OpenAI SDK's own types; text, a reasoning model's thinking and function
calls as their output items; a failure before the stream opens an HTTP status, after it an
``error`` event and ``response.failed``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from limiter.config import demo_config
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import finish_request
from limiter.frontend.responses_api import ResponseEvents, output_of
from limiter.frontend.responses_request import parse_request
from tests.support.fake_upstream import chat_chunk, end_stream, sse_response, tool_chunk
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state
from tests.support.helpers import wait_until
from tests.support.worker_helpers import worker

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL_DELTAS = [[{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                 "function": {"name": "get_weather", "arguments": ""}}],
               [{"index": 0, "function": {"arguments": "{\"city\": "}}],
               [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]]


def _tool_cfg(**pool: Any) -> Any:
    return make_cfg("redis://127.0.0.1:1", pool={"tool_calls": True, **pool})


def _chat_of(body: dict[str, Any], cfg: Any = None) -> dict[str, Any]:
    cfg = cfg or demo_config()
    shape, draft = parse_request({"model": "tiny", **body}, cfg, cfg.pools[0])
    return {"messages": [(m.role, m.content, m.tool_call_id, m.tool_calls) for m in draft.messages],
            "reasoning": [m.reasoning for m in draft.messages],
            "max_tokens": draft.max_tokens, "upstream": draft.fields["upstream"], "shape": shape,
            "stream": draft.fields["stream"]}


async def _events(r: Any) -> list[dict[str, Any]]:
    """A streamed response's events, each checked against the SDK's union of event types and
    its SSE ``event:`` line against its ``type``."""
    return _events_of(await r.read())


def _events_of(raw: bytes) -> list[dict[str, Any]]:
    """The events of a streamed response's body, checked as :func:`_events` says."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        ev = json.loads(lines["data"])
        assert lines["event"] == ev["type"], block
        EVENT.validate_python(ev)
        out.append(ev)
    return out


def _check_order(events: list[dict[str, Any]]) -> None:
    """OpenAI's order: created, in_progress, items each added, its deltas, done; the last event
    the response's end; sequence numbers 0, 1, 2, ...; every delta's item open."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    open_items: dict[str, int] = {}
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["item"]["id"] not in open_items
            open_items[e["item"]["id"]] = e["output_index"]
        elif e["type"] == "response.output_item.done":
            assert open_items.pop(e["item"]["id"]) == e["output_index"]
        else:
            assert open_items.get(e["item_id"]) == e["output_index"], e
    assert not open_items
    assert events[-1]["type"] in ("response.completed", "response.failed")


Read = tuple[dict[str, Any], list[dict[str, Any]], Any]


async def _read_three_ways(client: Any, body: dict[str, Any]) -> Read:
    """One request's answer whole, as its checked event stream, and as the OpenAI SDK's
    ``responses.stream()`` helper reads it (its final response)."""
    whole = await (await client.post("/v1/responses", headers=auth(), json=body)).json()
    events = await _events(await client.post("/v1/responses", headers=auth(), json={**body, "stream": True}))
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
    try:
        async with sdk.responses.stream(**body) as stream:
            final = await stream.get_final_response()
    finally:
        await sdk.close()
    return whole, events, final


# --- the request, as the chat it asks for ----------------------------------------------------

def test_input_and_instructions_become_the_chats_messages() -> None:
    assert _chat_of({"input": "hi"})["messages"] == [("user", "hi", None, ())]
    got = _chat_of({"instructions": "Be brief.", "max_output_tokens": 7, "input": [
        {"role": "developer", "content": "Use French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        # an earlier answer sent back as the SDK has it (its id, status, annotations)
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "d"}]})
    assert got["messages"] == [("system", "Be brief.", None, ()), ("system", "Use French.", None, ()),
                               ("user", "a\nb", None, ()), ("assistant", "c", None, ()),
                               ("user", "d", None, ())]
    assert got["max_tokens"] == 7 and got["shape"].instructions == "Be brief."


def test_function_calls_and_their_outputs_become_an_assistants_calls_and_tool_messages() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
            "arguments": "{\"city\": \"Paris\"}", "status": "completed"}
    got = _chat_of({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "x"}]},
        call, {**call, "call_id": "call_2", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}]},
        _tool_cfg())
    calls = tuple({"id": c, "type": "function", "function": {"name": "get_weather", "arguments": a}}
                  for c, a in (("call_1", "{\"city\": \"Paris\"}"), ("call_2", "{\"city\": \"Rome\"}")))
    assert got["messages"] == [("user", "Weather in Paris and Rome?", None, ()),
                               ("assistant", "", None, calls), ("tool", "sunny", "call_1", ()),
                               ("tool", "rain", "call_2", ())]
    assert got["reasoning"][1] == ("reasoning", "x")  # the thinking, with the turn's calls
    assert got["upstream"]["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert got["upstream"]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert got["shape"].tools[0]["name"] == "get_weather"


def test_a_json_schema_format_is_the_chats_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = _chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                                      "strict": True}}},
                   make_cfg("redis://127.0.0.1:1", pool={"structured_outputs": True}))
    assert got["upstream"]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "A", "schema": schema, "strict": True}}
    assert got["shape"].text_format == {"type": "json_schema", "name": "A", "schema": schema, "strict": True}


def test_what_a_client_sends_at_its_neutral_value_is_accepted() -> None:
    """store (either way: answered false), truncation disabled, the encrypted reasoning Codex
    asks for with store false, a reasoning summary, the OpenAI SDK's ids."""
    got = _chat_of({"input": "x", "store": True, "truncation": "disabled", "service_tier": "auto",
                    "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
                    "text": {"format": {"type": "text"}, "verbosity": "medium"}, "top_logprobs": 0,
                    "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "prompt_cache_key": "p",
                    "parallel_tool_calls": False, "stream": True,
                    "stream_options": {"include_obfuscation": False},
                    "background": False, "previous_response_id": None, "temperature": 0.5})
    assert got["messages"] == [("user", "x", None, ())] and got["stream"]
    assert got["shape"].metadata == {"k": "v"} and got["shape"].parallel_tool_calls is False
    # truncation auto: nothing is cut (a conversation past the context is the 400 either way)
    assert _chat_of({"input": "x", "truncation": "auto"})["shape"].truncation == "auto"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({}, "input", "invalid_type"),
    ({"input": []}, "input", "invalid_type"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": [{"role": "system", "content": "x"}]}, "input", "invalid_value"),
    ({"input": ["x"]}, "input[0]", "invalid_type"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour", "unknown_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text",
     "missing_required_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "invalid_type"),
    ({"input": [{"role": "user", "content": "\ud800"}]}, "input[0].content", "invalid_type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_value"),
    *[({"input": [{"role": "user", "content": "x"},
                  {"type": "reasoning", "summary": [], "encrypted_content": sealed}]},
       "input[1].encrypted_content", "unsupported_value") for sealed in ("gAAA", 0)],
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0].type", "unsupported_value"),
    ({"input": "x", "instructions": 5}, "instructions", "invalid_type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens", "invalid_type"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_value"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_value"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_value"),
    ({"input": "x", "background": True}, "background", "unsupported_value"),
    ({"input": "x", "store": "yes"}, "store", "invalid_type"),
    ({"input": "x", "truncation": "middle"}, "truncation", "unsupported_value"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include[0]", "unsupported_value"),
    ({"input": "x", "include": "x"}, "include", "invalid_type"),
    ({"input": "x", "max_tool_calls": 3}, "max_tool_calls", "unsupported_value"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"input": "x", "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ({"input": "x", "top_logprobs": False}, "top_logprobs", "invalid_type"),
    ({"input": "x", "top_logprobs": 2**70}, "top_logprobs", "invalid_value"),
    ({"input": "x", "top_logprobs": [2**64]}, "top_logprobs", "invalid_type"),
    ({"input": [{"role": "user", "content": "x", "status": "done"}]}, "input[0].status", "invalid_value"),
    ({"input": [{"role": "user", "content": "x", "status": 1}]}, "input[0].status", "invalid_value"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
    ({"input": "x", "stream": True, "stream_options": {"include_usage": True}},
     "stream_options.include_usage", "unknown_parameter"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
    ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity", "unsupported_value"),
    ({"input": "x", "text": {"format": {"type": "text", "schema": {}}}}, "text.format.schema",
     "unknown_parameter"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format", "unsupported_value"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_value"),
    ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary", "invalid_value"),
    ({"input": "x", "tools": [WEATHER]}, "tools", "unsupported_value"),
    ({"input": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"input": "x", "messages": []}, "messages", "unknown_parameter"),
    ({"input": "x", "n": 2}, "n", "unknown_parameter"),
])
def test_a_bad_body_is_a_400_naming_the_field_as_sent(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as e:
        _chat_of(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message
    assert f"'{param}'" in e.value.message or e.value.code == "unknown_parameter"
    if param == "reasoning.effort":  # (the setting that serves it named)
        assert "upstream_fields" in e.value.message


@pytest.mark.parametrize("value", [2**70, [2**64], "[" * 400 + "]" * 400])
@pytest.mark.parametrize(("item", "name"), [
    ({"role": "assistant", "content": "x"}, "phase"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, "namespace"),
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "caller")])
def test_a_sent_back_field_at_no_value_served_here_is_a_400_whatever_it_holds(
        item: dict[str, Any], name: str, value: Any) -> None:
    """Its value is shown in the 400 safely: an integer past 64 bits was a 500."""
    item = {**item, name: json.loads(value) if isinstance(value, str) else value}
    with pytest.raises(ApiError) as e:
        _chat_of({"input": [{"role": "user", "content": "q"}, item]}, _tool_cfg())
    assert (e.value.status, e.value.param, e.value.code) == (400, f"input[1].{name}", "unsupported_value")


async def test_a_min_tokens_past_the_max_names_max_output_tokens(redis_server) -> None:
    """Checked with the body (a max given) and once counted (the max's default): the bound
    is named as the Responses body calls it, not the chat's max_tokens."""
    with pytest.raises(ApiError) as e:
        _chat_of({"input": "x", "max_output_tokens": 5, "min_tokens": 9})
    assert e.value.param == "min_tokens" and "max_output_tokens (5)" in e.value.message, e.value.message
    cfg = make_cfg(redis_server.url, pool={"default_max_tokens": 4})
    async with frontend(cfg) as client:
        r = await client.post("/v1/responses", headers=auth(), json={"model": "tiny", "input": "x",
                                                                       "min_tokens": 9})
        error = (await r.json())["error"]
    assert (r.status, error["param"]) == (400, "min_tokens") and "max_output_tokens (4)" in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    # (a hosted tool is not offered, as vLLM: the chat's checks still name the tool as sent)
    ({"tools": [{"type": "web_search"}, WEATHER, WEATHER]}, "tools[2].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [WEATHER, WEATHER]}]}, "tools[0].tools[1].name"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "extra": 1}]}, "tools[0].extra"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "name": ""}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "description": 5}]}, "tools[0].description"),
    ({"tools": [{**WEATHER, "parameters": [1]}]}, "tools[0].parameters"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [{**WEATHER, "parameters": {"maximum": 2**70}}]}, "tools[0].parameters.maximum"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": ""}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_bad_tools_and_calls_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        _chat_of({"input": "x", **body}, _tool_cfg())
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert "function." not in e.value.message  # (the chat's names, never sent)


# --- end to end: frontend, worker ------------------------------------------------------------

async def test_an_answer_is_a_response_object_of_the_sdks_type_as_the_chat_answers_it(redis_server) -> None:
    cfg = make_cfg(redis_server.url)
    body = {"model": "tiny", "max_output_tokens": 6, "temperature": 0, "seed": 3}
    async with frontend(cfg) as client, worker(cfg):
        r = await client.post("/v1/responses", headers=auth(),
                              json={**body, "input": "hello", "metadata": {"a": "b"}})
        assert r.status == 200, await r.text()
        out = await r.json()
        chat = await (await client.post("/v1/chat/completions", headers=auth(), json={
            "model": "tiny", "max_tokens": 6, "temperature": 0, "seed": 3,
            "messages": [{"role": "user", "content": "hello"}]})).json()
        mine = await client.post("/v1/responses", headers={**auth(), "X-Request-Id": "trace-7"},
                                 json={**body, "input": "hello"})
        assert (await mine.json())["id"] == "resp_trace-7" and mine.headers["x-request-id"] == "trace-7"
    Response.model_validate(out)
    assert out["id"].startswith("resp_") and out["object"] == "response" and out["metadata"] == {"a": "b"}
    (item,) = out["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["text"] == chat["choices"][0]["message"]["content"]  # the same chat, seeded
    done = chat["choices"][0]["finish_reason"] == "stop"
    assert out["status"] == ("completed" if done else "incomplete")
    assert out["incomplete_details"] == (None if done else {"reason": "max_output_tokens"})
    assert (out["usage"]["input_tokens"], out["usage"]["output_tokens"]) == (
        chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
    assert out["usage"]["total_tokens"] == chat["usage"]["total_tokens"]


async def test_a_streamed_answer_is_openais_events_in_order_ending_with_the_whole_response(
        redis_server) -> None:
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client, worker(cfg):
        r = await client.post("/v1/responses", headers=auth(), json={
            "model": "tiny", "input": "hello", "max_output_tokens": 12, "stream": True, "seed": 1})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = await _events(r)
    _check_order(events)
    types = [e["type"] for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    # (completed whatever the status, as vLLM: the SDK's stream helper reads no other end)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (text_done,) = [e for e in events if e["type"] == "response.output_text.done"]
    final = events[-1]["response"]
    Response.model_validate(final)
    assert deltas == text_done["text"] == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] >= 1 and final["status"] in ("completed", "incomplete")
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


async def test_the_sdks_create_and_stream_helper_read_it(redis_server, fake_upstream) -> None:
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            made = await sdk.responses.create(model="tiny", input="hello", instructions="Be brief.",
                                              max_output_tokens=5)
            async with sdk.responses.stream(model="tiny", input=[{"role": "user", "content": "hi"}],
                                            max_output_tokens=9) as stream:
                deltas = [ev.delta async for ev in stream if ev.type == "response.output_text.delta"]
                final = await stream.get_final_response()
        finally:
            await sdk.close()
    assert made.output_text == "olleh" and made.usage is not None and made.status == "completed"
    assert final.output_text == "".join(deltas) == "ih" and final.usage is not None
    # the instructions went as the chat's system message
    assert fake_upstream.bodies[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "hello"}]


async def test_an_answer_cut_at_max_output_tokens_is_incomplete_and_the_sdk_reads_it_whole(
        redis_server, fake_upstream) -> None:
    """The chat's finish ``length``: status incomplete with OpenAI's reason, the message item
    incomplete; streamed, the last event is still ``response.completed`` (as vLLM sends it:
    the SDK's stream helper reads a final response from no other)."""
    cfg = make_cfg(redis_server.url)
    body = {"model": "tiny", "input": "abcdefghijkl", "max_output_tokens": 2}  # (4 tokens of the fake's)
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        whole, events, final = await _read_three_ways(client, body)
    for r in (whole, events[-1]["response"]):
        assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
        assert r["output"][0]["status"] == "incomplete" and r["output"][0]["content"][0]["text"] == "lkjihg"
        assert r["usage"]["output_tokens"] == 2
    assert events[-1]["type"] == "response.completed"
    assert final.status == "incomplete" and final.output_text == "lkjihg"


def _calls_weather(text: str = "") -> Any:
    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chat_chunk(reasoning="The user wants weather.", completion_tokens=1))
        if text:
            await resp.write(chat_chunk(text, completion_tokens=2))
        for i, deltas in enumerate(CALL_DELTAS, 3):
            await resp.write(tool_chunk(deltas, completion_tokens=i))
        return await end_stream(resp, tool_chunk([], finish="tool_calls", completion_tokens=5))

    return script


async def test_thinking_and_a_function_call_are_their_own_output_items(redis_server, fake_upstream) -> None:
    cfg, up = make_cfg(redis_server.url, pool={"tool_calls": True}), fake_upstream
    up.scripts["Weather"] = _calls_weather("Let me look.")
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 40}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        whole, events, final = await _read_three_ways(client, body)
    Response.model_validate(whole)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert whole["output"][1]["content"][0]["text"] == "Let me look."
    call = whole["output"][2]
    assert (call["call_id"], call["name"], json.loads(call["arguments"]), call["status"]) == (
        "chatcmpl-tool-1", "get_weather", {"city": "Paris"}, "completed")
    assert whole["status"] == "completed" and whole["tools"][0]["name"] == "get_weather"
    # the model server was sent the chat's tools
    assert up.bodies[0]["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    _check_order(events)
    final_out = events[-1]["response"]["output"]
    assert [i["type"] for i in final_out] == ["reasoning", "message", "function_call"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        final_out[2]["arguments"] == call["arguments"]
    (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done["name"] == "get_weather" and args_done["arguments"] == call["arguments"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        "The user wants weather."
    (fc,) = [i for i in final.output if i.type == "function_call"]
    assert (fc.call_id, fc.name, fc.arguments) == ("chatcmpl-tool-1", "get_weather", call["arguments"])


async def test_a_tool_result_goes_back_to_the_model_server_with_the_call_it_answers(
        redis_server, fake_upstream) -> None:
    cfg, up = make_cfg(redis_server.url, pool={"tool_calls": True}), fake_upstream
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/responses", headers=auth(), json={
            "model": "tiny", "tools": [WEATHER], "max_output_tokens": 20, "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "call_9", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]})
        assert r.status == 200, await r.text()
        out = await r.json()
    assert up.bodies[-1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_9"}]
    assert out["output"][0]["content"][0]["text"] == "ynnus"  # (the fake answers the last message reversed)


async def test_a_refusal_before_the_stream_opens_is_an_http_status(redis_server) -> None:
    """No worker takes it within its max wait: the 503 with Retry-After, not a stream."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client:
        r = await client.post("/v1/responses", headers={**auth(), "X-QoS-Max-Wait-Ms": "100"}, json={
            "model": "tiny", "input": "x", "stream": True})
        assert (r.status, (await r.json())["error"]["code"]) == (503, "queue_timeout")
        assert "Retry-After" in r.headers
        r = await client.post("/v1/responses", headers=auth(), json={"model": "nope", "input": "x"})
        assert r.status == 404 and (await r.json())["error"]["param"] == "model"


async def test_a_failure_after_the_stream_opened_is_an_error_event_and_response_failed(
        redis_server, fake_upstream) -> None:
    cfg, up = make_cfg(redis_server.url), fake_upstream

    async def fails(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chat_chunk("Partly", completion_tokens=1))
        await asyncio.sleep(0.05)
        await resp.write(b'data: {"error": {"message": "CUDA out of memory"}}\n\n')
        return resp

    up.scripts["BREAKS"] = fails
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/responses", headers=auth(), json={
            "model": "tiny", "input": "BREAKS", "max_output_tokens": 10, "stream": True})
        assert r.status == 200
        events = await _events(r)
        metrics = await (await client.get("/metrics")).text()  # counted as a chat's failure is
    counted = 'qos_frontend_requests_total{class="P1",outcome="failed",pool="tiny",tenant="demo-p1"} 1.0'
    assert counted in metrics
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "worker_failed" and "CUDA out of memory" in events[-2]["message"]
    failed = events[-1]["response"]
    Response.model_validate(failed)
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "CUDA out of memory" in failed["error"]["message"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Partly"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_client_leaving_a_stream_cancels_its_request(redis_server, sync_redis, fake_upstream) -> None:
    cfg, up = make_cfg(redis_server.url), fake_upstream

    async def writes_then_waits(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chat_chunk("first", completion_tokens=1))
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.01)  # (the fake's handlers are not cancelled when a client leaves)
        up.disconnects += 1
        return resp

    up.scripts["WAITS"] = writes_then_waits
    async with frontend(cfg, request_timeout_s=30) as client, \
            worker(cfg, engine="openai", upstream_url=up.url):
        r = await client.post("/v1/responses", headers=auth(), json={
            "model": "tiny", "input": "WAITS", "stream": True})
        assert r.status == 200
        record = r.headers["X-QoS-Request-Id"]
        await r.content.readuntil(b"response.output_text.delta")
        r.close()  # the client goes
        await wait_until(lambda: up.disconnects >= 1, "the model server's stream broken off")
        await wait_until(lambda: sync_redis.hget(POOL.request(record), "state") == b"cancelled",
                         "the record cancelled")


async def test_a_stored_response_asked_for_is_a_404_naming_it(redis_server) -> None:
    """Nothing is stored (every response says store false): the SDK's retrieve, delete, cancel
    and input_items read a 404 naming the id, as from vLLM with its store off."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as client:
        for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                             ("POST", "/v1/responses/resp_1/cancel"),
                             ("GET", "/v1/responses/resp_1/input_items")):
            r = await client.request(method, path, headers=auth())
            err = (await r.json())["error"]
            assert (r.status, err["param"]) == (404, "response_id") and "'resp_1'" in err["message"], path
        r = await client.get("/v1/responses/resp_1")
        assert r.status == 401  # (a key first, as every API path)
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.retrieve("resp_1")
        finally:
            await sdk.close()


# --- review: bodies that were a 500, fields named as sent, the stream's state machine ----------

@pytest.mark.parametrize("name", ["truncation", "service_tier", "prompt_cache_retention"])
@pytest.mark.parametrize("value", [2**70, [2**64], "[" * 400 + "]" * 400])
def test_a_field_taken_only_at_its_neutral_value_is_a_400_whatever_it_holds(name: str, value: Any) -> None:
    """Its value is shown in the 400: an integer past 64 bits, or one nested deep, is no 500."""
    body = {"input": "x", name: json.loads(value) if isinstance(value, str) else value}
    with pytest.raises(ApiError) as e:
        _chat_of(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, name, "unsupported_value")
    assert len(e.value.message) < 300


async def test_refusals_after_the_parse_name_input_not_the_chats_messages(
        redis_server, sync_redis, fake_upstream) -> None:
    """The request too large to queue (a chat is queued with its text twice), and a prompt the
    model server refused to count: 'input', the field the client sent."""
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 10_000_000})
    async with frontend(cfg, max_body_bytes=16 << 20) as client:
        before = redis_state(sync_redis)
        r = await client.post("/v1/responses", headers=auth(), json={
            "model": "tiny", "input": "x" * 4_500_000, "max_output_tokens": 1})
        err = (await r.json())["error"]
        assert (r.status, err["code"], err["param"]) == (400, "request_too_large", "input"), err
        assert "'input'" in err["message"] and "messages" not in err["message"]
        assert redis_state(sync_redis) == before
    fake_upstream.status = 422
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": fake_upstream.url})
    async with frontend(cfg) as client:
        r = await client.post("/v1/responses", headers=auth(), json={"model": "tiny", "input": "hi"})
        err = (await r.json())["error"]
        assert (r.status, err["code"], err["param"]) == (400, "tokenizer_refused", "input"), err
        assert "messages" not in err["message"]


def _streamed(steps: list[tuple[Any, ...]], finish: str = "stop") -> list[dict[str, Any]]:
    """The events of a stream fed ``steps`` (ResponseEvents' text / reasoning / tool_calls and
    their arguments), each of the SDK's types, and read by the SDK's own ``responses.stream()``
    accumulator."""
    cfg = demo_config()
    shape, draft = parse_request({"model": "tiny", "input": "x"}, cfg, cfg.pools[0])
    ev = ResponseEvents(shape, finish_request(draft, 3), "resp_1", 0)
    raw = ev.opening()
    for kind, *args in steps:
        raw += getattr(ev, kind)(*args)
    raw += ev.end(finish, 3, 4)
    events = [json.loads(b.split(b"\ndata: ", 1)[1]) for b in raw]
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for e in events:
        EVENT.validate_python(e)
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    _check_order(events)
    return events


def test_a_streamed_call_without_an_id_gets_one_and_its_name_when_it_comes() -> None:
    """A model server's call deltas without ids (two calls with the same empty call_id broke
    the SDK's stream helper: 'conflicting output identities'), the name in a later delta."""
    events = _streamed([("tool_calls", [{"index": 0, "function": {"arguments": "{"}}]),
                        ("tool_calls", [{"index": 0, "function": {"name": "f", "arguments": "}"}}]),
                        ("tool_calls", [{"index": 1, "function": {"name": "g", "arguments": "[]"}}])],
                       "tool_calls")
    calls = events[-1]["response"]["output"]
    assert [(c["type"], c["name"], c["arguments"]) for c in calls] == [
        ("function_call", "f", "{}"), ("function_call", "g", "[]")]
    assert all(c["call_id"].startswith("call_") for c in calls) and calls[0]["call_id"] != calls[1]["call_id"]
    done = {e["item"]["id"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert [done[c["id"]] for c in calls] == calls
    assert [e["name"] for e in events if e["type"] == "response.function_call_arguments.done"] == ["f", "g"]
    # the same whole
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    (call,) = output_of(chat)[0]
    assert call["call_id"].startswith("call_")


CALL = ("tool_calls", [{"index": 0, "id": "c0", "function": {"name": "f", "arguments": "{}"}}])


@pytest.mark.parametrize(("steps", "types"), [
    ([], ["message"]),
    ([("reasoning", "r")], ["reasoning", "message"]),
    ([("text", " "), ("text", "\n")], ["message"]),
    ([("reasoning", "r"), ("text", "\n")], ["reasoning", "message"]),
    ([("text", "\n"), CALL], ["function_call"]),
    ([("reasoning", "r"), CALL, ("text", "\n")], ["reasoning", "function_call"]),
    ([("text", "a"), CALL], ["message", "function_call"]),
])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_streamed_answer_has_the_output_items_of_the_whole_one(steps: list[tuple[str, Any]],
                                                                types: list[str], finish: str) -> None:
    """An empty answer (or thinking alone) is one empty message, streamed or not, as vLLM
    answers without a tool parser; whitespace beside calls is no message; cut at max tokens,
    the message is incomplete only where it is the last item, streamed or not."""
    final = _streamed(steps, finish)[-1]["response"]["output"]
    text = "".join(v for k, v in steps if k == "text")
    thought = "".join(v for k, v in steps if k == "reasoning")
    calls = [{"id": "c0", "function": {"name": "f", "arguments": "{}"}}] if CALL in steps else []
    whole, _ = output_of({"choices": [{"finish_reason": finish, "message": {
        "content": text, "reasoning": thought, "tool_calls": calls}}]})
    assert [i["type"] for i in final] == [i["type"] for i in whole] == types
    assert [i["content"] for i in final if i["type"] == "message"] == \
        [i["content"] for i in whole if i["type"] == "message"]
    assert [i["status"] for i in final] == [i["status"] for i in whole]


def test_a_namespace_call_sent_back_is_the_flat_name_its_tool_was_offered_by() -> None:
    ns = {"type": "namespace", "name": "agents", "description": "d", "tools": [WEATHER]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "namespace": "agents",
            "arguments": "{}"}
    chat = _chat_of({"input": [{"role": "user", "content": "x"}, call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "tools": [ns, {"type": "web_search"}], "client_metadata": {"k": "v"}}, _tool_cfg())
    assert [t["function"]["name"] for t in chat["upstream"]["tools"]] == ["agents__get_weather"]
    assert chat["messages"][1][3][0]["function"]["name"] == "agents__get_weather"


def test_a_namespace_tools_function_called_is_answered_by_its_own_name_and_namespace() -> None:
    """The model calls the flat name it was offered (``agents__get_weather``): the client reads
    the function by its own name with its ``namespace``, streamed (a name in the first delta
    or a later one) or whole, as vLLM answers; a plain function, or a flat-looking name no
    namespace tool offered, as the model wrote it."""
    cfg = _tool_cfg()
    ns = {"type": "namespace", "name": "agents", "description": "d", "tools": [WEATHER]}
    shape, draft = parse_request({"model": "tiny", "input": "x", "tools": [ns, {**WEATHER, "name": "plain"}]},
                                 cfg, cfg.pools[0])
    ev = ResponseEvents(shape, finish_request(draft, 3), "resp_1", 0)
    raw = ev.opening()
    raw += ev.tool_calls([{"index": 0, "id": "c0", "function": {"name": "agents__get_weather",
                                                               "arguments": "{}"}}])
    raw += ev.tool_calls([{"index": 1, "id": "c1", "function": {"arguments": "{"}}])
    raw += ev.tool_calls([{"index": 1, "function": {"name": "agents__get_weather", "arguments": "}"}}])
    raw += ev.tool_calls([{"index": 2, "id": "c2", "function": {"name": "plain", "arguments": "{}"}}])
    raw += ev.tool_calls([{"index": 3, "id": "c3", "function": {"name": "other__x", "arguments": "{}"}}])
    raw += ev.end("tool_calls", 3, 4)
    events = [json.loads(b.split(b"\ndata: ", 1)[1]) for b in raw]
    for e in events:
        EVENT.validate_python(e)
    streamed = [(i["name"], i.get("namespace")) for i in events[-1]["response"]["output"]]
    want = [("get_weather", "agents"), ("get_weather", "agents"), ("plain", None), ("other__x", None)]
    assert streamed == want
    assert [e["item"].get("namespace") for e in events if e["type"] == "response.output_item.done"] == \
        ["agents", "agents", None, None]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
             for i, n in enumerate(("agents__get_weather", "agents__get_weather", "plain", "other__x"))]
    whole, _ = output_of({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": calls}}]}, shape)
    assert [(i["name"], i.get("namespace")) for i in whole] == want


async def test_a_namespace_call_reaches_the_client_by_its_own_name_whole_and_streamed(
        redis_server, fake_upstream) -> None:
    cfg, up = make_cfg(redis_server.url, pool={"tool_calls": True}), fake_upstream

    async def calls_flat(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(tool_chunk([{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "agents__get_weather", "arguments": "{}"}}],
                                    completion_tokens=1))
        return await end_stream(resp, tool_chunk([], finish="tool_calls", completion_tokens=1))

    up.scripts["Weather"] = calls_flat
    body = {"model": "tiny", "input": "Weather in Paris?", "max_output_tokens": 20,
            "tools": [{"type": "namespace", "name": "agents", "description": "d", "tools": [WEATHER]}]}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        whole, events, final = await _read_three_ways(client, body)
    assert final.output[0].namespace == "agents"  # (the SDK reads it too)
    assert up.bodies[0]["tools"][0]["function"]["name"] == "agents__get_weather"  # offered flat
    for out in (whole["output"], events[-1]["response"]["output"]):
        (call,) = out
        assert (call["name"], call["namespace"], call["call_id"]) == ("get_weather", "agents", "call_1")


# --- logprobs: include message.output_text.logprobs, top_logprobs --------------------------

def _logprobs_cfg(url: str = "redis://127.0.0.1:1") -> Any:
    return make_cfg(url, pool={"logprobs": True})


def test_output_logprobs_asked_for_become_the_chats_and_top_logprobs_alone_asks_for_none() -> None:
    cfg = _logprobs_cfg()
    asked = _chat_of({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 3}, cfg)
    assert (asked["upstream"]["logprobs"], asked["upstream"]["top_logprobs"]) == (True, 3)
    assert asked["shape"].top_logprobs == 3
    alone = _chat_of({"input": "x", "include": ["message.output_text.logprobs"]}, cfg)
    assert alone["upstream"]["logprobs"] is True and "top_logprobs" not in alone["upstream"]
    # as vLLM: top_logprobs without the include asks the model server for nothing
    unasked = _chat_of({"input": "x", "top_logprobs": 3}, cfg)
    assert "logprobs" not in unasked["upstream"] and unasked["shape"].top_logprobs == 3
    with pytest.raises(ApiError) as e:  # (the pool's max_logprobs bounds it, as a chat's)
        _chat_of({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, cfg)
    assert e.value.param == "top_logprobs"
    # a pool whose model server returns none: the include is refused by its place, saying why
    with pytest.raises(ApiError) as e:
        _chat_of({"input": "x", "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]})
    assert e.value.param == "include[1]" and "logprobs = true" in e.value.message


async def test_the_answers_logprobs_reach_the_client_whole_streamed_and_through_the_sdk(
        redis_server, fake_upstream) -> None:
    """Each token's logprob and alternatives in the output_text (with bytes), in each text
    delta (its own tokens, every token once) and in output_text.done; top_logprobs echoed."""
    from tests.support.fake_upstream import fake_logprob

    cfg = _logprobs_cfg(redis_server.url)
    body = {"model": "tiny", "input": "abcdefghijklmno", "max_output_tokens": 40,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    answer = "abcdefghijklmno"[::-1]
    tokens = [answer[i:i + 3] for i in range(0, len(answer), 3)]  # the fake's 3-character tokens
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        whole, events, final = await _read_three_ways(client, body)
    Response.model_validate(whole)
    _check_order(events)
    for r in (whole, events[-1]["response"]):
        assert r["top_logprobs"] == 2
        probs = r["output"][0]["content"][0]["logprobs"]
        assert [p["token"] for p in probs] == tokens
        assert [p["logprob"] for p in probs] == [fake_logprob(k) for k in range(len(tokens))]
        assert all(p["bytes"] == list(p["token"].encode()) for p in probs)
        assert [[a["token"] for a in p["top_logprobs"]] for p in probs] == [[t, "alt1"] for t in tokens]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all("".join(p["token"] for p in e["logprobs"]) == e["delta"] for e in deltas)
    streamed = [p for e in deltas for p in e["logprobs"]]
    assert [p["token"] for p in streamed] == tokens and all("bytes" not in p for p in streamed)
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == streamed
    assert [p.token for p in final.output[0].content[0].logprobs] == tokens  # the SDK's own types
    assert fake_upstream.bodies[0]["logprobs"] is True and fake_upstream.bodies[0]["top_logprobs"] == 2


def _token_chunk(delta: dict[str, Any], token: str, lp: float, completion_tokens: int,
                 finish: str | None = None) -> bytes:
    """A chat chunk of one token, its logprob beside its delta, as vLLM streams it."""
    c = {"id": "x", "object": "chat.completion.chunk", "model": "tiny", "choices": [{
        "index": 0, "delta": delta, "finish_reason": finish,
        "logprobs": {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()),
                                  "top_logprobs": []}]}}],
         "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens,
                   "total_tokens": 5 + completion_tokens}}
    return ("data: " + json.dumps(c) + "\n\n").encode()


def _thinks_then_answers(request: Any, body: dict[str, Any], n: int) -> Any:
    """Thinking, then the answer, each chunk with its own token's logprob (as vLLM streams a
    reasoning model's: the thinking tokens have logprobs too)."""
    async def script() -> Any:
        resp = await sse_response(request)
        await resp.write(_token_chunk({"reasoning": "Hmm."}, "Hmm.", -0.5, 1))
        await resp.write(_token_chunk({"content": " "}, " ", -0.25, 2))  # whitespace before the text
        await resp.write(_token_chunk({"content": "Yes"}, "Yes", -0.125, 3))
        return await end_stream(resp, chat_chunk(finish="stop", completion_tokens=3))

    return script()


async def test_thinking_tokens_logprobs_are_no_part_of_the_output_texts(redis_server, fake_upstream) -> None:
    """The output_text holds its own tokens' logprobs: the thinking's (a reasoning item has
    none) are left out, the whitespace before the text kept with it."""
    cfg, up = _logprobs_cfg(redis_server.url), fake_upstream
    up.scripts["Think"] = _thinks_then_answers
    body = {"model": "tiny", "input": "Think", "max_output_tokens": 40,
            "include": ["message.output_text.logprobs"]}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        whole, events, final = await _read_three_ways(client, body)
    for r in (whole, events[-1]["response"]):
        assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
        text = r["output"][1]["content"][0]
        assert text["text"] == " Yes"
        assert [(p["token"], p["logprob"]) for p in text["logprobs"]] == [(" ", -0.25), ("Yes", -0.125)]
    (delta,) = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [p["token"] for p in delta["logprobs"]] == [" ", "Yes"]
    assert final.output_text == " Yes"


@pytest.mark.parametrize("then", ["text", "nothing"])
def test_whitespace_held_before_a_message_opens_keeps_its_tokens_logprobs(then: str) -> None:
    """Whitespace with no message open is held until text follows (or the answer ends): its
    tokens' logprobs are held with it, in the delta and the done text that carry it."""
    space, yes = [" ", -0.25, [32], []], ["Yes", -0.125, [89, 101, 115], []]
    steps: list[tuple[Any, ...]] = [("reasoning", "Hmm."), ("text", " ", [space])]
    if then == "text":
        steps.append(("text", "Yes", [yes]))
    events = _streamed(steps)
    want = [" ", "Yes"] if then == "text" else [" "]
    (delta,) = [e for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [p["token"] for p in delta["logprobs"]] == [p["token"] for p in done["logprobs"]] == want
    text = events[-1]["response"]["output"][1]["content"][0]
    assert [p["token"] for p in text["logprobs"]] == want and text["logprobs"][0]["bytes"] == [32]


@pytest.mark.parametrize("text", ["Hi", ""])
async def test_the_logprob_of_a_token_without_text_reaches_the_streamed_response(
        redis_server, fake_upstream, text: str) -> None:
    """vLLM's last chunk has no text and the stop token's logprob (its text left out). The
    whole answer's output_text holds it, as the chat's: streamed, it is in a delta of its own
    (a push of no text), the done text and the final response, also when it is the whole
    answer after thinking. Dropped as a push without text, the streamed response lost it."""
    cfg, up = _logprobs_cfg(redis_server.url), fake_upstream
    read = asyncio.Event()

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        first = {"content": text} if text else {"reasoning": "Hmm."}
        await resp.write(_token_chunk(first, text or "Hmm.", -0.5, 1))
        if n == 2:  # the streamed request: the stop token comes once the first push was read
            await read.wait()
        return await end_stream(resp, _token_chunk({"content": ""}, "<|eot_id|>", -0.125, 2, "stop"))

    up.scripts["EOS"] = script
    body = {"model": "tiny", "input": "EOS", "max_output_tokens": 40,
            "include": ["message.output_text.logprobs"]}
    want = [*([text] if text else []), "<|eot_id|>"]
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        whole = await (await client.post("/v1/responses", headers=auth(), json=body)).json()
        r = await client.post("/v1/responses", headers=auth(), json={**body, "stream": True})
        assert r.status == 200, await r.text()
        raw = b""
        while b"response.output_text.delta" not in raw and b"reasoning_text.delta" not in raw:
            raw += await r.content.readany()
        read.set()
        events = _events_of(raw + await r.content.read())
    _check_order(events)
    message = [i for i in whole["output"] if i["type"] == "message"][-1]
    assert [p["token"] for p in message["content"][0]["logprobs"]] == want
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    streamed = [p["token"] for e in deltas for p in e["logprobs"]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    final = [i for i in events[-1]["response"]["output"] if i["type"] == "message"][-1]
    assert streamed == [p["token"] for p in done["logprobs"]] == want
    assert final["content"][0]["logprobs"] == message["content"][0]["logprobs"]


async def test_a_stop_tokens_logprob_after_a_tool_call_is_no_part_of_the_text_before_it(
        redis_server, fake_upstream) -> None:
    """Text, then a tool call, then the stop token without text: streamed, the message closed
    when the call opened, so the stop token has no text to join; the whole answer leaves it
    out of its message too (a run of calls and no text holds tokens of its own), so both read
    the same logprobs -- the text's."""
    cfg = make_cfg(redis_server.url, pool={"logprobs": True, "tool_calls": True})
    up = fake_upstream
    read = asyncio.Event()

    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(_token_chunk({"content": "Let me look."}, "Let me look.", -0.5, 1))
        call = {"tool_calls": CALL_DELTAS[0][:1] and [{**CALL_DELTAS[0][0], "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
        await resp.write(_token_chunk(call, "<call>", -0.25, 2))
        if n == 2:  # the streamed request: the stop token in a push of its own
            await read.wait()
        return await end_stream(resp, _token_chunk({"content": ""}, "<|eot_id|>", -0.125, 3, "tool_calls"))

    up.scripts["Look"] = script
    body = {"model": "tiny", "input": "Look", "tools": [WEATHER], "max_output_tokens": 40,
            "include": ["message.output_text.logprobs"]}
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        whole = await (await client.post("/v1/responses", headers=auth(), json=body)).json()
        r = await client.post("/v1/responses", headers=auth(), json={**body, "stream": True})
        assert r.status == 200, await r.text()
        raw = b""
        while b"response.function_call_arguments" not in raw:
            raw += await r.content.readany()
        read.set()
        events = _events_of(raw + await r.content.read())
    _check_order(events)
    assert [i["type"] for i in whole["output"]] == ["message", "function_call"]
    assert [p["token"] for p in whole["output"][0]["content"][0]["logprobs"]] == ["Let me look."]
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call"]
    assert final[0]["content"][0]["logprobs"] == whole["output"][0]["content"][0]["logprobs"]
