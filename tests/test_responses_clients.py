"""``POST /v1/responses`` as the OpenAI Python SDK 3.63.0 sends it when its caller appends the
answer it got to the next request's ``input`` (the SDK's documented function-calling and
multi-turn loop), replayed byte for byte (its headers; Host and Content-Length left to the
test client) through the frontend, Redis, the openai worker and the fake model server, and
read back as the SDK reads it (``Response.output_text``).

Captured live from the SDK against this stack: each body is the *second* request of a loop
whose first answer's output items were turned back into dicts by the SDK's own serializers
(``to_dict()``: ``exclude_unset``, by alias; ``model_dump(mode="json", by_alias=True)``) or by
pydantic's ``model_dump()``. The items carry fields of the SDK's output types: the API's own
(``phase`` of a message, ``async``/``caller``/``namespace`` of a function call, at null) and
the SDK's local parse results (``parsed_arguments`` of a function call from the ``stream()``
helper or ``parse()`` with strict tools; ``parsed`` of an ``output_text`` part from
``parse(text_format=...)``). OpenAI's API and vLLM (``extra="allow"``) accept them; this
service answered a 400 ``unrecognized field``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai._models import construct_type
from openai.types.responses import Response

from tests.support.frontend_helpers import frontend, make_cfg
from tests.support.sdk_headers import OPENAI_SDK_SYNC
from tests.support.worker_helpers import answered_through_openai_worker, worker

SDK = {**OPENAI_SDK_SYNC, "Authorization": "Bearer demo-p1", "x-stainless-retry-count": "0",
       "x-stainless-read-timeout": "600"}
USER = b'{"role":"user","content":"What\'s the weather in Paris?"}'
REASONING = (b'{"id":"rs_0f72809dc3174ff384d1a4f709a94a71","summary":[],"type":"reasoning","content":'
             b'[{"text":"Need the weather.","type":"reasoning_text"}],"status":"completed"}')
TOOLS = (b'"tools":[{"type":"function","name":"get_weather","description":"w","parameters":{"type":"object",'
         b'"properties":{"city":{"type":"string"}},"required":["city"],"additionalProperties":false},'
         b'"strict":true}]')
OUTPUT = b'{"type":"function_call_output","call_id":"call_abc123","output":"sunny"}'


def _call(extra: bytes) -> bytes:
    return (b'{"arguments":"{\\"city\\": \\"Paris\\"}","call_id":"call_abc123","name":"get_weather",'
            b'"type":"function_call","id":"fc_0489cbcd8cd34423b38a33c02cfaf7b1"' + extra + b'}')


def _tool_loop(call: bytes) -> bytes:
    return (b'{"model":"tiny","input":[' + USER + b',' + REASONING + b',' + call + b',' + OUTPUT + b'],'
            + TOOLS + b'}')


@pytest.mark.parametrize(("raw", "text"), [
    # with sdk.responses.stream(..., tools=[strict tool]) as s: r = s.get_final_response();
    # input += [o.to_dict() for o in r.output]  (the stream helper's ParsedResponseFunctionToolCall)
    (_tool_loop(_call(b',"status":"completed","parsed_arguments":{"city":"Paris"}')), "ynnus"),
    # r = sdk.responses.create(..., tools=[...]); input += [o.model_dump(mode="json", by_alias=True) ...]
    (_tool_loop(_call(b',"async":null,"caller":null,"namespace":null,"status":"completed"')), "ynnus"),
    # r = sdk.responses.create(input=[hello]); input += [o.model_dump() for o in r.output] + [again]
    (b'{"model":"tiny","input":[{"role":"user","content":"hello"},{"id":"msg_386c8cfdb5c04afe9d762ae1c06c96a5",'
     b'"content":[{"annotations":[],"text":"olleh","type":"output_text","logprobs":[]}],"role":"assistant",'
     b'"status":"completed","type":"message","phase":null},{"role":"user","content":"again"}]}', "niaga"),
    # r = sdk.responses.parse(input=[give JSON], text_format=W); input += [o.to_dict() ...] + [again]
    (b'{"model":"tiny","input":[{"role":"user","content":"give JSON"},'
     b'{"id":"msg_3d58039148c44a789bb7a82d697e1d87",'
     b'"content":[{"annotations":[],"text":"{\\"city\\": \\"Paris\\", \\"temp\\": 21}","type":"output_text",'
     b'"logprobs":[],"parsed":{"city":"Paris","temp":21}}],"role":"assistant","status":"completed",'
     b'"type":"message"},{"role":"user","content":"again"}]}', "niaga"),
], ids=["stream-helper-to_dict-parsed_arguments", "create-model_dump-by_alias-async-caller-namespace",
        "create-model_dump-message-phase", "parse-to_dict-output_text-parsed"])
async def test_the_sdks_own_output_items_sent_back_in_input_are_answered(
        redis_server, sync_redis, fake_upstream, raw: bytes, text: str) -> None:
    """The next turn answered (the fake answers the last message reversed), as the SDK reads it;
    the earlier turn reaches the model server as the chat's assistant turn, unchanged."""
    cfg = make_cfg(redis_server.url, pool={"tool_calls": True, "structured_outputs": True})
    out = await answered_through_openai_worker(cfg, fake_upstream.url, "/v1/responses", raw, dict(SDK))
    got: Any = construct_type(type_=Response, value=out)
    assert got.output_text == text and got.status == "completed"
    assistant = [m for m in fake_upstream.bodies[-1]["messages"] if m["role"] == "assistant"]
    assert len(assistant) == 1
    if text == "ynnus":
        assert assistant[0]["tool_calls"] == [{"id": "call_abc123", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]


# --- Codex ------------------------------------------------------------------------------------

# Codex CLI 0.169.0 (`codex exec`, a custom provider with wire_api = "responses"), captured
# live against this stack: its second request of a turn in which the model called
# exec_command -- the whole conversation in `input` (developer messages of several text parts,
# the call and its output), its tools (functions, a `namespace` of functions, the hosted
# `web_search` it sends with every request), `client_metadata`, `include`, `reasoning.summary`
# and store false. Its long texts (instructions, descriptions) are cut; every field is as sent.
# OpenAI's API and vLLM (which ignores hosted tools and unknown fields and offers a namespace's
# functions as `<namespace>__<name>`) answer it; this service answered a 400 naming
# client_metadata (then tools[4].type, tools[8].type): Codex stopped at its first request.
CODEX_BODY = (Path(__file__).parent / "data" / "codex_0_169_0_tool_loop.json").read_text()
CODEX = {"Accept": "text/event-stream", "Content-Type": "application/json", "Authorization": "Bearer demo-p1",
         "originator": "codex_exec", "x-codex-beta-features": "remote_compaction_v2",
         "User-Agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)"}


def _codex_first_turn() -> bytes:
    body = json.loads(CODEX_BODY)
    body["input"] = body["input"][:4]  # (its first request: the user's message last)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("raw", "text"), [
    (_codex_first_turn(), "ih ohce nur esaelp"),
    (json.dumps(json.loads(CODEX_BODY)).encode(), "\nih\n:tuptuO"),
], ids=["first-request", "function_call_output-sent-back"])
async def test_codexs_requests_are_answered_with_its_function_tools_offered(
        redis_server, fake_upstream, raw: bytes, text: str) -> None:
    """Codex's request streamed through to response.completed (the fake answers the last
    message reversed); the model server is offered its functions, a namespace's by their flat
    names, and not web_search (none is run here)."""
    cfg = make_cfg(redis_server.url, pool={"tool_calls": True})
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await client.post("/v1/responses", data=raw, headers=dict(CODEX))
        assert r.status == 200, await r.text()
        events = [json.loads(b.split("data: ", 1)[1]) for b in (await r.text()).split("\n\n") if b.strip()]
    assert events[-1]["type"] == "response.completed"
    got: Any = construct_type(type_=Response, value=events[-1]["response"])
    assert got.status == "completed" and got.output_text.startswith(text)
    chat = fake_upstream.bodies[-1]
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names[:4] == ["exec_command", "write_stdin", "request_user_input", "view_image"]
    assert "multi_agent_v1__spawn_agent" in names and len(names) == 12
    assert [m["role"] for m in chat["messages"]][:4] == ["system", "system", "user", "user"]
    if "Output" in text:
        assert chat["messages"][-2]["tool_calls"][0]["function"] == {"name": "exec_command",
                                                                      "arguments": "{\"cmd\": \"echo hi\"}"}
        assert chat["messages"][-1]["role"] == "tool"
