"""Tool calling as the agent tools people use send it: the exact requests of LangChain
(``langchain-openai`` 1.8.1, ``langchain-core`` 1.8.3: ``ChatOpenAI(...).bind_tools`` and
``with_structured_output(method="function_calling")``), LiteLLM 1.110.2 (``litellm.acompletion
(model="openai/...", tools=...)``) and the OpenAI SDK 3.63.0's ``chat.completions.parse`` /
``.stream`` helpers, each over the SDK's httpx transport: one agent round, the model's call and
then the tool's result sent back (the answer's message appended as the client hands it over).

The bodies were captured from those clients, run against a recording server (Python 3.11.7),
and are replayed byte for byte with their headers through the real frontend (a tool_calls
pool), a private redis-server and the openai worker to the fake model server: each is
accepted, reaches the model server as a model server that calls tools reads it, and is
answered in the shape those clients were seen to parse (run live, the same clients read
these answers: ids, names and arguments, LangChain's ``tool_call_chunks`` merged by
``index``, LiteLLM's ``stream_chunk_builder``, ``finish_reason``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from limiter.config import demo_config
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import parse_request
from limiter.prompt import ChatMessage
from tests.support.fake_upstream import chat_chunk, sse_response, tool_chunk

# Fixtures, asked for by name ("client", "fake_worker"): the "as" re-exports them.
from tests.support.frontend_helpers import client_fixture as client_fixture
from tests.support.frontend_helpers import fake_worker_fixture as fake_worker_fixture
from tests.support.frontend_helpers import frontend, make_cfg, post_captured
from tests.support.sdk_headers import OPENAI_SDK
from tests.support.worker_helpers import worker

KEY = "demo-p1"
# The OpenAI SDK's headers (LangChain and LiteLLM send through it)
SDK = {**OPENAI_SDK, "x-stainless-retry-count": "0"}
LANGCHAIN = {**SDK, "x-stainless-raw-response": "true"}  # unstreamed (streamed: SDK's alone)
LITELLM = {**LANGCHAIN, "Accept-Encoding": "gzip, deflate, zstd", "x-stainless-read-timeout": "600.0"}
SDK_PLAIN = {**SDK, "x-stainless-read-timeout": "600"}
SDK_PARSE = {**SDK_PLAIN, "x-stainless-helper-method": "chat.completions.parse"}
SDK_STREAM = {**SDK_PLAIN, "x-stainless-helper-method": "chat.completions.stream"}

# bind_tools([GetWeather]): a pydantic model with a docstring and a described field
LC_PARAMS = {"properties": {"city": {"description": "The city", "type": "string"}}, "required": ["city"],
             "type": "object"}
LC_TOOL = {"type": "function", "function": {"name": "GetWeather", "description": "Weather of a city",
                                            "parameters": LC_PARAMS}}
# bind_tools([GetWeather], strict=True)
LC_STRICT = {"type": "function", "function": {"name": "GetWeather", "description": "Weather of a city",
                                              "parameters": {**LC_PARAMS, "additionalProperties": False},
                                              "strict": True}}
# bind_tools([get_weather]): a python function with a Google-style docstring
LC_FN = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": LC_PARAMS}}
# LiteLLM: the tools as its user wrote them
LL_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# openai.pydantic_function_tool(GetWeather): strict, the schema's titles kept
SDK_TOOL = {"type": "function", "function": {
    "name": "GetWeather", "strict": True,
    "parameters": {"description": "Weather of a city",
                   "properties": {"city": {"description": "The city", "title": "City", "type": "string"}},
                   "required": ["city"], "title": "GetWeather", "type": "object",
                   "additionalProperties": False},
    "description": "Weather of a city"}}

ASK = "Weather in Paris?"
ASK2 = "Weather in Paris and Rome?"  # the model server calls the tool twice
ASK_T = "Think, then Weather in Paris?"  # it writes a line, then calls
ARGS = "{\"city\": \"Paris\"}"
ARGS2 = "{\"city\": \"Rome\"}"


def lc_user(text: str = ASK) -> dict[str, Any]:
    return {"content": text, "role": "user"}  # LangChain's key order


def lc_call(name: str = "GetWeather", args: str = ARGS, n: int = 1) -> dict[str, Any]:
    return {"type": "function", "id": f"chatcmpl-tool-{n}", "function": {"name": name, "arguments": args}}


def lc_result(text: str = "18 C and sunny", n: int = 1) -> dict[str, Any]:
    return {"content": text, "role": "tool", "tool_call_id": f"chatcmpl-tool-{n}"}


def lc(stream: bool, *messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A LangChain body: model, stream, messages, then its fields in the order it writes them."""
    order = ("parallel_tool_calls", "stream_options", "tool_choice", "tools")
    return {"model": "tiny", "stream": stream, "messages": list(messages) or [lc_user()],
            **{k: fields[k] for k in order if k in fields}}


LC_ROUND2 = [lc_user(), {"content": None, "role": "assistant", "tool_calls": [lc_call()]}, lc_result()]
LC_TWO_ROUND2 = [lc_user(ASK2), {"content": None, "role": "assistant",
                                 "tool_calls": [lc_call(), lc_call(args=ARGS2, n=2)]},
                 lc_result("0 C"), lc_result("1 C", n=2)]
LC_TEXT_ROUND2 = [lc_user(ASK_T), {"content": "Let me look.", "role": "assistant", "tool_calls": [lc_call()]},
                  lc_result()]
LL_USER = {"role": "user", "content": ASK}
SDK_RESULT = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C and sunny"}
# LiteLLM's own Message appended as it came: no content at all beside the calls
LL_CALL = {"function": {"arguments": ARGS, "name": "get_weather"}, "id": "chatcmpl-tool-1",
           "type": "function"}
LL_ROUND2 = [LL_USER, {"role": "assistant", "tool_calls": [LL_CALL]}, SDK_RESULT]
SDK_CALL = {"id": "chatcmpl-tool-1", "function": {"arguments": ARGS, "name": "GetWeather"},
            "type": "function"}
# .parse()'s answer appended: ParsedChatCompletionMessage (parsed, parsed_arguments)
SDK_PARSED = {"content": None, "role": "assistant",
              "tool_calls": [{"id": "chatcmpl-tool-1", "function": {"arguments": ARGS, "name": "GetWeather",
                                                                    "parsed_arguments": {"city": "Paris"}},
                              "type": "function"}], "parsed": None}
# .stream()'s get_final_completion() appended: every field set, the call's stream index kept
SDK_STREAMED = {"content": None, "refusal": None, "role": "assistant", "annotations": None, "audio": None,
                "function_call": None,
                "tool_calls": [{"id": "chatcmpl-tool-1", "function": {"arguments": ARGS, "name": "GetWeather",
                                                                      "parsed_arguments": {"city": "Paris"}},
                                "type": "function", "index": 0}], "parsed": None}


def ll(*messages: dict[str, Any], stream: bool = False, **fields: Any) -> dict[str, Any]:
    """A LiteLLM body (openai/ provider): its own key order, stream last."""
    body: dict[str, Any] = {"model": "tiny", "messages": list(messages) or [LL_USER], **fields}
    if stream:
        body["stream"] = True
    return body


def sdk(stream: bool | None, *messages: dict[str, Any]) -> dict[str, Any]:
    """The SDK's body with openai.pydantic_function_tool(GetWeather) (stream: as the helper
    sets it; None: create(), which leaves it out)."""
    body: dict[str, Any] = {"model": "tiny"}
    if stream is not None:
        body["stream"] = stream
    return {**body, "messages": list(messages) or [{"role": "user", "content": ASK}], "tools": [SDK_TOOL]}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


CALLED, TWO, TEXT_CALLED, ANSWERED = "called", "two calls", "text and call", "answered"
LC, LL, OA = "langchain-openai-1.8.1", "litellm-1.110.2", "openai-3.63.0"
OA_USER = {"role": "user", "content": ASK}
# (client and what it did, headers, body as the client serialises it (key order kept), answer)
REPLAYS: list[tuple[str, dict[str, str], dict[str, Any], str]] = [
    (f"{LC}-bind_tools-auto", LANGCHAIN, lc(False, tool_choice="auto", tools=[LC_TOOL]), CALLED),
    (f"{LC}-bind_tools-any-streamed", SDK, lc(True, tool_choice="required", tools=[LC_TOOL]), CALLED),
    (f"{LC}-bind_tools-named", LANGCHAIN, lc(False, tool_choice=named("GetWeather"), tools=[LC_TOOL]),
     CALLED),
    (f"{LC}-bind_tools-streamed", SDK, lc(True, tools=[LC_TOOL]), CALLED),
    (f"{LC}-bind_tools-parallel_tool_calls-false-streamed", SDK,
     lc(True, parallel_tool_calls=False, tools=[LC_TOOL]), CALLED),
    (f"{LC}-bind_tools-strict", LANGCHAIN, lc(False, tools=[LC_STRICT]), CALLED),
    (f"{LC}-bind_tools-stream_usage", SDK, lc(True, stream_options={"include_usage": True}, tools=[LC_TOOL]),
     CALLED),
    (f"{LC}-bind_tools-function-named", LANGCHAIN, lc(False, tool_choice=named("get_weather"), tools=[LC_FN]),
     CALLED),
    (f"{LC}-with_structured_output-function_calling", LANGCHAIN,
     lc(False, parallel_tool_calls=False, tool_choice=named("GetWeather"), tools=[LC_TOOL]), CALLED),
    (f"{LC}-two-calls-streamed", SDK, lc(True, lc_user(ASK2), tools=[LC_TOOL]), TWO),
    (f"{LC}-text-then-call", LANGCHAIN, lc(False, lc_user(ASK_T), tools=[LC_TOOL]), TEXT_CALLED),
    (f"{LC}-text-then-call-streamed", SDK, lc(True, lc_user(ASK_T), tools=[LC_TOOL]), TEXT_CALLED),
    (f"{LC}-ToolMessage-auto", LANGCHAIN, lc(False, *LC_ROUND2, tool_choice="auto", tools=[LC_TOOL]),
     ANSWERED),
    (f"{LC}-ToolMessage-streamed", SDK, lc(True, *LC_ROUND2, tools=[LC_TOOL]), ANSWERED),
    (f"{LC}-two-ToolMessages", LANGCHAIN, lc(False, *LC_TWO_ROUND2, tools=[LC_TOOL]), ANSWERED),
    (f"{LC}-text-then-call-ToolMessage", LANGCHAIN, lc(False, *LC_TEXT_ROUND2, tools=[LC_TOOL]), ANSWERED),
    (f"{LL}-auto", LITELLM, ll(max_tokens=40, tools=[LL_TOOL], tool_choice="auto"), CALLED),
    (f"{LL}-required-streamed", LITELLM,
     ll(max_tokens=40, tools=[LL_TOOL], tool_choice="required", stream=True), CALLED),
    (f"{LL}-named-streamed", LITELLM,
     ll(max_tokens=40, tools=[LL_TOOL], tool_choice=named("get_weather"), stream=True), CALLED),
    (f"{LL}-parallel_tool_calls-false", LITELLM,
     ll(max_tokens=40, tools=[LL_TOOL], parallel_tool_calls=False), CALLED),
    (f"{LL}-two-calls", LITELLM, ll({"role": "user", "content": ASK2}, tools=[LL_TOOL]), TWO),
    (f"{LL}-two-calls-streamed-usage", LITELLM,
     {**ll({"role": "user", "content": ASK2}, tools=[LL_TOOL], stream=True),
      "stream_options": {"include_usage": True}}, TWO),
    (f"{LL}-tool-result", LITELLM, ll(*LL_ROUND2, max_tokens=40, tools=[LL_TOOL]), ANSWERED),
    (f"{LL}-tool-result-streamed", LITELLM, ll(*LL_ROUND2, max_tokens=40, tools=[LL_TOOL], stream=True),
     ANSWERED),
    (f"{OA}-parse", SDK_PARSE, sdk(False), CALLED),
    (f"{OA}-stream-helper", SDK_STREAM, sdk(True), CALLED),
    (f"{OA}-create-tool-result", SDK_PLAIN,
     sdk(None, OA_USER, {"content": None, "role": "assistant", "tool_calls": [SDK_CALL]}, SDK_RESULT),
     ANSWERED),
    (f"{OA}-parse-answer-appended", SDK_PLAIN, sdk(None, OA_USER, SDK_PARSED, SDK_RESULT), ANSWERED),
    (f"{OA}-stream-helper-answer-appended", SDK_PLAIN, sdk(None, OA_USER, SDK_STREAMED, SDK_RESULT),
     ANSWERED),
]


def _name(body: dict[str, Any]) -> str:
    return body["tools"][0]["function"]["name"]


def _calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls the model server below makes for ``body``, whole."""
    asked = body["messages"][0]["content"]
    calls = [{"id": "chatcmpl-tool-1", "type": "function",
              "function": {"name": _name(body), "arguments": ARGS}}]
    if "Rome" in asked:
        calls.append({"id": "chatcmpl-tool-2", "type": "function",
                      "function": {"name": _name(body), "arguments": ARGS2}})
    return calls


async def _model_server(request: Any, body: dict[str, Any], n: int) -> Any:
    """vLLM with a tool parser: a tool's result is answered with text; else the call (id,
    type and name first, the arguments in two pieces), a second call for Rome, a line of text
    first when asked to think; finish_reason tool_calls."""
    resp = await sse_response(request)
    if any(m["role"] == "tool" for m in body["messages"]):
        await resp.write(chat_chunk("It is sunny.", completion_tokens=1))
        await resp.write(chat_chunk(None, finish="stop", completion_tokens=1))
    else:
        done = 0
        if "Think" in body["messages"][0]["content"]:
            done += 1
            await resp.write(chat_chunk("Let me look.", completion_tokens=done))
        for i, call in enumerate(_calls(body)):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            args = call["function"]["arguments"]
            for d in (head, {"index": i, "function": {"arguments": args[:9]}},
                      {"index": i, "function": {"arguments": args[9:]}}):
                done += 1
                await resp.write(tool_chunk([d], completion_tokens=done))
        await resp.write(tool_chunk([], finish="tool_calls", completion_tokens=done))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _upstream_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the model server gets it: role, content (null beside calls alone), the
    calls' id, type, name and arguments, the tool_call_id; what the SDK keeps on its answer
    objects (parsed, parsed_arguments, a stream index, null refusal/audio/...) left out."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {k: c["function"][k] for k in ("name", "arguments")}}
                             for c in m["tool_calls"]]
    if "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    return out


@pytest.mark.parametrize("client,headers,body,answer", REPLAYS, ids=[r[0] for r in REPLAYS])
async def test_agent_clients_tool_requests_replayed(redis_server, sync_redis, fake_upstream, client, headers,
                                                    body, answer):
    cfg = make_cfg(redis_server.url, pool={"tool_calls": True})
    fake_upstream.scripts["Weather"] = _model_server
    raw = json.dumps(body, separators=(",", ":")).encode()  # as the SDK's httpx writes it
    async with frontend(cfg) as http, worker(cfg, engine="openai", upstream_url=fake_upstream.url):
        chunks, whole = await post_captured(http, "/v1/chat/completions", raw, headers, client,
                                            bool(body.get("stream")), KEY)
    # what reached the model server: the tools as sent, the choice and parallel flag as sent,
    # the messages with the earlier calls and their results
    (up,) = fake_upstream.bodies
    assert up["tools"] == body["tools"]
    for k in ("tool_choice", "parallel_tool_calls"):
        assert up.get(k) == body.get(k), k
    assert up["messages"] == [_upstream_message(m) for m in body["messages"]]
    if "max_tokens" in body:
        assert up["max_tokens"] == body["max_tokens"]

    calls = _calls(body) if answer != ANSWERED else []
    text = {ANSWERED: "It is sunny.", TEXT_CALLED: "Let me look."}.get(answer)
    finish = "stop" if answer == ANSWERED else "tool_calls"
    if not body.get("stream"):
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == finish
        want: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            want["tool_calls"] = calls  # the calls whole, merged per index (content null beside them alone)
        assert choice["message"] == want
        assert whole["usage"]["completion_tokens"] > 0
        return
    # streamed: what LangChain's tool_call_chunks, LiteLLM's stream_chunk_builder and the SDK's
    # stream helper read: every tool-call delta carries its index; the first of a call its id,
    # type "function" and name; the arguments' pieces joined per index are the call's JSON
    assert chunks[-1] is None  # [DONE]
    with_choices = [c for c in chunks[:-1] if c["choices"]]
    assert {c["object"] for c in with_choices} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks[:-1]}) == 1
    deltas = [c["choices"][0]["delta"] for c in with_choices]
    assert deltas[0]["role"] == "assistant"
    got: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            assert isinstance(tc["index"], int)
            if tc["index"] not in got:
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                got[tc["index"]] = {"id": tc["id"], "type": "function",
                                    "function": {"name": tc["function"]["name"], "arguments": ""}}
            else:
                assert "id" not in tc and "name" not in tc["function"]  # a later piece: arguments alone
            got[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments") or ""
    assert [got[i] for i in sorted(got)] == calls
    assert all(json.loads(c["function"]["arguments"]) for c in calls)
    assert "".join(d.get("content") or "" for d in deltas) == (text or "")
    fins = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert fins[-1] == finish and all(f is None for f in fins[:-1])
    if (body.get("stream_options") or {}).get("include_usage"):
        last = chunks[-2]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
        assert all(c["usage"] is None for c in with_choices)
    else:
        assert all("usage" not in c for c in chunks[:-1])


# --- the OpenAI SDK's parse() / stream() answers, appended to the next request ----------------

# The helpers' answer without tools, appended as it came (captured as above): parse() sets
# tool_calls and parsed (null), stream()'s final completion every field of the message.
PARSED_TEXT = {"content": "It is sunny.", "role": "assistant", "tool_calls": None, "parsed": None}
STREAMED_TEXT = {"content": "It is sunny.", "refusal": None, "role": "assistant", "annotations": None,
                 "audio": None, "function_call": None, "tool_calls": None, "parsed": None}
MORE = {"role": "user", "content": "more"}


@pytest.mark.parametrize("answer", [PARSED_TEXT, STREAMED_TEXT], ids=["parse", "stream"])
async def test_the_sdk_helpers_answer_appended_in_a_pool_without_tools(client, fake_worker, answer):
    """Was a 400 "unrecognized field 'messages[1].parsed'" in every pool: a chat continued
    with the helpers' answer (the SDK's documented loop) failed at its second turn."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, answer, MORE]}
    raw = json.dumps(body, separators=(",", ":")).encode()
    r = await client.post("/v1/chat/completions", data=raw,
                          headers={**SDK_PLAIN, "Authorization": f"Bearer {KEY}"})
    assert r.status == 200, await r.text()
    p = fake_worker.payloads[r.headers["X-QoS-Request-Id"]]
    assert p.messages[1] == ChatMessage("assistant", "It is sunny.")


def test_what_the_sdk_keeps_on_an_answered_call_is_accepted_and_not_sent_on() -> None:
    cfg = make_cfg("redis://127.0.0.1:1/0", pool={"tool_calls": True})
    for answer in (SDK_PARSED, SDK_STREAMED):
        d = parse_request("chat", sdk(None, OA_USER, answer, SDK_RESULT), cfg)
        sent = {"id": "chatcmpl-tool-1", "type": "function",
                "function": {"name": "GetWeather", "arguments": ARGS}}
        assert d.messages[1] == ChatMessage("assistant", "", tool_calls=(sent,))
    call = SDK_STREAMED["tool_calls"][0]
    for bad_call, param in [({**call, "index": -1}, "index"), ({**call, "index": "0"}, "index"),
                            ({**call, "function": {**call["function"], "parsed_arguments": "x"}},
                             "function.parsed_arguments")]:
        body = sdk(None, OA_USER, {**SDK_STREAMED, "tool_calls": [bad_call]}, SDK_RESULT)
        with pytest.raises(ApiError) as e:
            parse_request("chat", body, cfg)
        assert (e.value.status, e.value.param) == (400, f"messages[1].tool_calls[0].{param}")
    # a parsed object (a response_format's, served by a structured_outputs pool only) is refused
    for c in (cfg, demo_config()):
        with pytest.raises(ApiError) as e:
            parse_request("chat", {"model": "tiny", "messages": [
                OA_USER, {**PARSED_TEXT, "parsed": {"city": "Paris"}}, MORE]}, c)
        assert (e.value.status, e.value.param) == (400, "messages[1].parsed")
        assert e.value.code == "unsupported_value"
