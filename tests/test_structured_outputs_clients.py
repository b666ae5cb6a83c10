"""JSON answers as the clients people use ask for them: the exact requests of the OpenAI SDK
3.63.0 (``chat.completions.parse(response_format=<pydantic model>)``, the ``.stream()``
helper, ``create(response_format={"type": "json_object"})``, and each answer appended to the
next request as the SDK hands it over, ``parsed`` object and all), LangChain
(``langchain-openai`` 1.8.1, ``langchain-core`` 1.8.3: ``ChatOpenAI(...).with_structured_output``
with its default json_schema method, of a pydantic model, a TypedDict and a JSON schema,
``method="json_mode"``, ``include_raw=True``, streamed, with ``stream_usage``, and bound to
tools as well) and LiteLLM 1.110.2 (``acompletion(model="openai/...")`` and
``"hosted_vllm/..."`` with a pydantic model or a ``json_schema`` dict), all on pydantic 2.14.4.

The bodies were captured from those clients, run against a recording server (Python 3.11.7),
and are replayed byte for byte with their headers through the real frontend (a
structured_outputs pool), a private redis-server and the openai worker to the fake model
server, which answers the JSON the schema asks for: each is accepted, reaches the model
server with its response_format as sent (``{"type": "text"}``: none) and the appended
answers without the SDK's ``parsed``, and is answered in the shape those clients were seen to
parse (run live, each client read these answers into its type: ``message.parsed``,
LangChain's parsed object, LiteLLM's content and ``stream_chunk_builder``).

Seen live and not replayed: LangChain refuses a JSON schema without a ``title`` itself
("Unsupported function"), before any request; a ``json_schema`` without ``name`` (LiteLLM
passes the user's dict as it came) is a 400, as vLLM's (and OpenAI's) ``name`` is required."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.fake_upstream import chat_chunk, sse_response
from tests.support.frontend_helpers import frontend, make_cfg, post_captured
from tests.support.sdk_headers import OPENAI_SDK
from tests.support.worker_helpers import worker

KEY = "demo-p1"
# The OpenAI SDK's headers (LangChain and LiteLLM's openai/ provider send through it)
SDK = OPENAI_SDK
SDK_PLAIN = {**SDK, "x-stainless-retry-count": "0", "x-stainless-read-timeout": "600"}
SDK_PARSE = {**SDK, "x-stainless-helper-method": "chat.completions.parse", "x-stainless-retry-count": "0",
             "x-stainless-read-timeout": "600"}
SDK_STREAM = {**SDK, "x-stainless-helper-method": "chat.completions.stream", "x-stainless-retry-count": "0",
              "x-stainless-read-timeout": "600"}
# LangChain: unstreamed through parse() (raw response), streamed through stream()
LC_PARSE = {**SDK, "x-stainless-helper-method": "chat.completions.parse", "x-stainless-raw-response": "true",
            "x-stainless-retry-count": "0"}
LC_PLAIN = {**SDK, "x-stainless-raw-response": "true", "x-stainless-retry-count": "0"}
LC_STREAM = {**SDK, "x-stainless-helper-method": "chat.completions.stream", "x-stainless-retry-count": "0"}
LC_SYNC_STREAM = {**LC_STREAM, "User-Agent": "OpenAI/Python 3.63.0", "x-stainless-async": "false"}
LITELLM = {**SDK, "Accept-Encoding": "gzip, deflate, zstd", "x-stainless-raw-response": "true",
           "x-stainless-retry-count": "0", "x-stainless-read-timeout": "600.0"}
LITELLM_SYNC = {**LITELLM, "User-Agent": "OpenAI/Python 3.63.0", "x-stainless-async": "false"}
# LiteLLM's hosted_vllm/ provider: its own httpx client, json.dumps' default separators
LITELLM_VLLM = {"Accept": "*/*", "Accept-Encoding": "gzip, deflate, zstd", "Connection": "keep-alive",
                "User-Agent": "litellm/1.110.2", "Content-Type": "application/json"}


def _props(city: dict[str, Any], celsius: dict[str, Any]) -> dict[str, Any]:
    return {"city": {**city, "type": "string"}, "celsius": {**celsius, "type": "integer"}}


REQUIRED = ["city", "celsius"]
# openai's to_strict_json_schema(Weather) (docstring "Weather of a city", celsius described)
SDK_SCHEMA = {"description": "Weather of a city",
              "properties": _props({"title": "City"}, {"description": "Degrees", "title": "Celsius"}),
              "required": REQUIRED, "title": "Weather", "type": "object", "additionalProperties": False}
# LangChain's Weather: the city described
LC_SCHEMA = {"description": "Weather of a city",
             "properties": _props({"description": "The city", "title": "City"}, {"title": "Celsius"}),
             "required": REQUIRED, "title": "Weather", "type": "object", "additionalProperties": False}
# LiteLLM's Weather: no docstring
LL_SCHEMA = {"properties": _props({"title": "City"}, {"title": "Celsius"}), "required": REQUIRED,
             "title": "Weather", "type": "object", "additionalProperties": False}
# A forecast of cities: a $defs entry, an array, an Optional (anyOf with null)
CITY = {"properties": {"name": {"title": "Name", "type": "string"},
                       "temps": {"items": {"type": "integer"}, "title": "Temps", "type": "array"},
                       "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Note"}},
        "required": ["name", "temps", "note"], "title": "City", "type": "object",
        "additionalProperties": False}
FORECAST = {"$defs": {"City": CITY}, "description": "A forecast",
            "properties": {"cities": {"items": {"$ref": "#/$defs/City"}, "title": "Cities", "type": "array"}},
            "required": ["cities"], "title": "Forecast", "type": "object", "additionalProperties": False}
# Resp[int], a generic pydantic model: its name is not OpenAI's pattern
RESP_INT = {"properties": {"value": {"title": "Value", "type": "integer"}}, "required": ["value"],
            "title": "Resp[int]", "type": "object", "additionalProperties": False}


def strict(schema: dict[str, Any], name: str = "Weather") -> dict[str, Any]:
    """type_to_response_format_param(<pydantic model>): the SDK's, LangChain's and LiteLLM's."""
    return {"type": "json_schema", "json_schema": {"schema": schema, "name": name, "strict": True}}


def lc_dict(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """LangChain's response_format of a TypedDict or a JSON schema (strict unset: false)."""
    return {"type": "json_schema",
            "json_schema": {"name": name, "description": description, "strict": False, "schema": schema}}


JSON_OBJECT = {"type": "json_object"}
ANSWER = json.dumps({"city": "Paris", "celsius": 18})
ASK, AGAIN = "Weather in Paris?", "Weather again?"
USER, USER2 = {"role": "user", "content": ASK}, {"role": "user", "content": AGAIN}
LC_USER = {"content": ASK, "role": "user"}  # LangChain's key order
# parse()'s answer appended as it came, and stream()'s final completion's (every field set)
PARSED = {"content": ANSWER, "role": "assistant", "tool_calls": None,
          "parsed": {"city": "Paris", "celsius": 18}}
STREAMED = {"content": ANSWER, "refusal": None, "role": "assistant", "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None, "parsed": {"city": "Paris", "celsius": 18}}
# create()'s answer (a ChatCompletionMessage: the SDK leaves its null fields out), LangChain's
# AIMessage (its additional_kwargs' parsed not sent), LiteLLM's Message
ANSWERED = {"content": ANSWER, "role": "assistant"}
LC_TOOL = {"type": "function", "function": {
    "name": "Weather", "description": "",
    "parameters": {"properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
                   "required": REQUIRED, "type": "object", "additionalProperties": False}, "strict": True}}


def sdk(stream: bool | None, rf: dict[str, Any] | None, *messages: dict[str, Any]) -> dict[str, Any]:
    """The SDK's body (stream: as the helpers set it; None: create(), which leaves it out)."""
    body: dict[str, Any] = {"model": "tiny"}
    if stream is not None:
        body["stream"] = stream
    body["messages"] = list(messages) or [USER]
    if rf is not None:
        body["response_format"] = rf
    return body


def lc(stream: bool, rf: dict[str, Any] | None, *messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "stream": stream, "messages": list(messages) or [LC_USER]}
    if rf is not None:
        body["response_format"] = rf
    return {**body, **fields}


def ll(rf: dict[str, Any], *messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A LiteLLM body (openai/ provider): model, messages, response_format, then stream."""
    return {"model": "tiny", "messages": list(messages) or [USER], "response_format": rf, **fields}


OA, LC, LL = "openai-3.63.0", "langchain-openai-1.8.1", "litellm-1.110.2"
COMPACT, SPACED = (",", ":"), (", ", ": ")
# (client and what it did, headers, body as the client serialises it (key order kept), separators)
REPLAYS: list[tuple[str, dict[str, str], dict[str, Any], tuple[str, str]]] = [
    (f"{OA}-parse", SDK_PARSE, sdk(False, strict(SDK_SCHEMA)), COMPACT),
    (f"{OA}-parse-answer-appended", SDK_PARSE, sdk(False, strict(SDK_SCHEMA), USER, PARSED, USER2), COMPACT),
    (f"{OA}-create-after-parse-answer-appended", SDK_PLAIN, sdk(None, None, USER, PARSED, USER2), COMPACT),
    (f"{OA}-stream-helper", SDK_STREAM, sdk(True, strict(SDK_SCHEMA)), COMPACT),
    (f"{OA}-parse-stream-answer-appended", SDK_PARSE, sdk(False, strict(SDK_SCHEMA), USER, STREAMED, USER2),
     COMPACT),
    (f"{OA}-stream-helper-answer-appended", SDK_STREAM,
     sdk(True, strict(SDK_SCHEMA), USER, STREAMED, USER2), COMPACT),
    (f"{OA}-create-json_object", SDK_PLAIN, sdk(None, JSON_OBJECT), COMPACT),
    (f"{OA}-create-json_object-answer-appended", SDK_PLAIN, sdk(None, JSON_OBJECT, USER, ANSWERED, USER2),
     COMPACT),
    (f"{OA}-create-json_object-streamed", SDK_PLAIN, sdk(True, JSON_OBJECT), COMPACT),
    (f"{OA}-parse-text", SDK_PARSE, sdk(False, {"type": "text"}), COMPACT),
    (f"{OA}-create-json_schema-dict", SDK_PLAIN,
     sdk(None, {"type": "json_schema", "json_schema": {"name": "Weather", "schema": {
         k: v for k, v in SDK_SCHEMA.items() if k != "additionalProperties"}}}), COMPACT),
    (f"{OA}-parse-nested", SDK_PARSE, sdk(False, strict(FORECAST, "Forecast")), COMPACT),
    (f"{OA}-parse-generic-model", SDK_PARSE, sdk(False, strict(RESP_INT, "Resp[int]")), COMPACT),
    (f"{LC}-json_schema", LC_PARSE, lc(False, strict(LC_SCHEMA)), COMPACT),
    (f"{LC}-json_schema-typeddict", LC_PARSE, lc(False, lc_dict("WeatherTD", "Weather of a city", {
        "type": "object", "properties": {"city": {"description": "The city", "type": "string"},
                                         "celsius": {"type": "integer"}}, "required": REQUIRED})), COMPACT),
    (f"{LC}-json_schema-dict", LC_PARSE, lc(False, lc_dict("Weather", "Weather of a city", {
        "properties": _props({"description": "The city", "title": "City"}, {"title": "Celsius"}),
        "required": REQUIRED, "type": "object"})), COMPACT),
    (f"{LC}-json_schema-dict-titled-with-a-space", LC_PARSE, lc(False, lc_dict("Weather report", "A report", {
        "type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
        "required": REQUIRED})), COMPACT),
    (f"{LC}-json_schema-nested", LC_PARSE, lc(False, strict(FORECAST, "Forecast")), COMPACT),
    (f"{LC}-json_schema-generic-model", LC_PARSE, lc(False, strict(RESP_INT, "Resp[int]")), COMPACT),
    (f"{LC}-json_mode", LC_PARSE,
     lc(False, JSON_OBJECT, {"content": ASK + " Answer in JSON.", "role": "user"}), COMPACT),
    (f"{LC}-include_raw-answer-appended", LC_PLAIN, lc(False, None, LC_USER, ANSWERED,
                                                        {"content": AGAIN, "role": "user"}), COMPACT),
    (f"{LC}-include_raw-answer-appended-structured", LC_PARSE,
     lc(False, strict(LC_SCHEMA), LC_USER, ANSWERED, {"content": AGAIN, "role": "user"}), COMPACT),
    (f"{LC}-astream", LC_STREAM, lc(True, strict(LC_SCHEMA)), COMPACT),
    (f"{LC}-astream-dict", LC_STREAM, lc(True, lc_dict("Weather", "Weather of a city", {
        "properties": _props({"description": "The city", "title": "City"}, {"title": "Celsius"}),
        "required": REQUIRED, "type": "object"})), COMPACT),
    (f"{LC}-astream-json_mode", LC_STREAM, lc(True, JSON_OBJECT, {"content": ASK + " JSON", "role": "user"}),
     COMPACT),
    (f"{LC}-stream_usage", LC_STREAM, lc(True, strict(LC_SCHEMA), stream_options={"include_usage": True}),
     COMPACT),
    (f"{LC}-sync-stream", LC_SYNC_STREAM, lc(True, strict(LC_SCHEMA)), COMPACT),
    (f"{LC}-bind_tools-response_format", LC_PARSE, lc(False, strict(LL_SCHEMA), tools=[LC_TOOL]), COMPACT),
    (f"{LL}-model", LITELLM, ll(strict(LL_SCHEMA)), COMPACT),
    (f"{LL}-model-answer-appended", LITELLM, ll(strict(LL_SCHEMA), USER, ANSWERED, USER2), COMPACT),
    (f"{LL}-model-streamed", LITELLM, ll(strict(LL_SCHEMA), stream=True), COMPACT),
    (f"{LL}-json_schema-dict", LITELLM, ll({"type": "json_schema", "json_schema": {
        "name": "Weather", "schema": {
            "type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
            "required": REQUIRED, "additionalProperties": False}, "strict": True}}), COMPACT),
    (f"{LL}-json_object", LITELLM, ll(JSON_OBJECT), COMPACT),
    (f"{LL}-json_object-streamed-usage", LITELLM,
     ll(JSON_OBJECT, stream=True, stream_options={"include_usage": True}), COMPACT),
    (f"{LL}-nested", LITELLM, ll(strict(FORECAST, "Forecast")), COMPACT),
    (f"{LL}-sync", LITELLM_SYNC, ll(strict(LL_SCHEMA)), COMPACT),
    (f"{LL}-hosted_vllm-model", LITELLM_VLLM, ll(strict(LL_SCHEMA)), SPACED),
    (f"{LL}-hosted_vllm-json_object-streamed", LITELLM_VLLM,
     {"model": "tiny", "messages": [USER], "stream": True, "response_format": JSON_OBJECT}, SPACED),
]


def value(schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """What the fake model server writes for ``schema``: a value of each property's type."""
    if "$ref" in schema:
        return value(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return value(schema["anyOf"][0], defs)
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {k: value(v, defs) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [value(schema.get("items", {}), defs)]
    return {"integer": 18, "number": 18.5, "boolean": True}.get(kind, "Paris")  # type: ignore[arg-type]


def answer_for(body: dict[str, Any]) -> str:
    """The JSON the fake model server answers ``body`` with (json_object, or none: a Weather)."""
    rf = body.get("response_format") or {}
    if rf.get("type") != "json_schema":
        return ANSWER
    schema = rf["json_schema"].get("schema") or {}
    return json.dumps(value(schema, schema.get("$defs", {})))


async def _model_server(request: Any, body: dict[str, Any], n: int) -> Any:
    """vLLM's structured outputs: the JSON the schema asks for, in two pieces, then stop."""
    text = answer_for(body)
    resp = await sse_response(request)
    await resp.write(chat_chunk(text[:len(text) // 2], completion_tokens=1))
    await resp.write(chat_chunk(text[len(text) // 2:], completion_tokens=2))
    await resp.write(chat_chunk(finish="stop", completion_tokens=2) + b"data: [DONE]\n\n")
    return resp


def test_the_replays_are_the_bytes_the_clients_sent() -> None:
    """Spot checks against the captured bytes (the rest are built the same way)."""
    raw = {r[0]: json.dumps(r[2], separators=r[3]).encode() for r in REPLAYS}
    assert raw[f"{OA}-parse-answer-appended"] == (
        b'{"model":"tiny","stream":false,"messages":[{"role":"user","content":"Weather in Paris?"},'
        b'{"content":"{\\"city\\": \\"Paris\\", \\"celsius\\": 18}","role":"assistant","tool_calls":null,'
        b'"parsed":{"city":"Paris","celsius":18}},{"role":"user","content":"Weather again?"}],'
        b'"response_format":{"type":"json_schema","json_schema":{"schema":{"description":"Weather of a city",'
        b'"properties":{"city":{"title":"City","type":"string"},"celsius":{"description":"Degrees",'
        b'"title":"Celsius","type":"integer"}},"required":["city","celsius"],"title":"Weather",'
        b'"type":"object","additionalProperties":false},"name":"Weather","strict":true}}}')
    assert raw[f"{LL}-hosted_vllm-json_object-streamed"] == (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": true, '
        b'"response_format": {"type": "json_object"}}')


@pytest.mark.parametrize("client,headers,body,separators", REPLAYS, ids=[r[0] for r in REPLAYS])
async def test_structured_output_clients_requests_replayed(redis_server, fake_upstream, client, headers, body,
                                                          separators):
    cfg = make_cfg(redis_server.url, pool={"structured_outputs": True, "tool_calls": "tools" in body})
    fake_upstream.scripts["Weather"] = _model_server
    raw = json.dumps(body, separators=separators).encode()  # as the client wrote it
    async with frontend(cfg) as http, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        chunks, whole = await post_captured(http, "/v1/chat/completions", raw, headers, client,
                                            bool(body.get("stream")), KEY)
    # what reached the model server: the response_format as sent (text: none), the tools as
    # sent, the appended answers' content without the SDK's parsed object and null fields
    (up,) = fake_upstream.bodies
    rf = body.get("response_format")
    assert up.get("response_format") == (None if rf == {"type": "text"} else rf)
    assert up.get("tools") == body.get("tools")
    assert up["messages"] == [{"role": m["role"], "content": m["content"]} for m in body["messages"]]

    text = answer_for(body)
    json.loads(text)
    if not body.get("stream"):
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "stop"
        assert choice["message"] == {"role": "assistant", "content": text}
        assert whole["usage"]["completion_tokens"] > 0
        return
    # streamed: what the SDK's stream helper (content.delta / content.done, then parsed),
    # LangChain's astream and LiteLLM's stream_chunk_builder read
    assert chunks[-1] is None  # [DONE]
    with_choices = [c for c in chunks[:-1] if c["choices"]]
    assert {c["object"] for c in with_choices} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in with_choices]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == text
    fins = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert fins[-1] == "stop" and all(f is None for f in fins[:-1])
    if (body.get("stream_options") or {}).get("include_usage"):
        assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] > 0


async def test_a_json_schema_without_its_name_is_a_400_as_vllms(redis_server, fake_upstream) -> None:
    """LiteLLM passes a user's ``json_schema`` dict as it came; without ``name`` vLLM's
    JsonSchemaResponseFormat refuses it (``name: str``, required; OpenAI's too): a 400 here,
    naming it, and nothing reaches the model server."""
    cfg = make_cfg(redis_server.url, pool={"structured_outputs": True})
    body = ll({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
        "required": REQUIRED, "additionalProperties": False}}})
    async with frontend(cfg) as http, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        r = await http.post("/v1/chat/completions", data=json.dumps(body, separators=COMPACT).encode(),
                            headers={**LITELLM, "Authorization": f"Bearer {KEY}"})
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == "response_format.json_schema.name"
    assert fake_upstream.bodies == []
