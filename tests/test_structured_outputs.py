"""JSON answers in front of a model server that holds an answer to a schema (``[[pools]]
structured_outputs``; vLLM's structured outputs): a chat's ``response_format`` is checked and
sent on, the OpenAI SDK's ``parse()`` reads its answer into its type, that answer sent back with
its ``parsed`` object is accepted (and ``parsed`` not sent on), and a pool without the setting
says which one serves it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pydantic
import pytest

from limiter.config import demo_config, validate
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import parse_request
from limiter.localstack.sse import sse_chunks
from tests.support.fake_upstream import breaks_once, chat_chunk, sse_response
from tests.support.frontend_helpers import auth, frontend, make_cfg
from tests.support.worker_helpers import worker

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
          "required": ["city", "celsius"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": SCHEMA, "strict": True}}


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def _cfg(**pool: Any):
    import dataclasses
    cfg = demo_config()
    return validate(dataclasses.replace(cfg, pools=tuple(
        dataclasses.replace(p, structured_outputs=True, **pool) for p in cfg.pools)))


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], **body}


def test_a_response_format_goes_to_the_model_server_as_sent() -> None:
    cfg = _cfg()
    assert parse_request("chat", _chat(response_format=JSON_SCHEMA), cfg).fields["upstream"] == {
        "response_format": JSON_SCHEMA}
    obj = parse_request("chat", _chat(response_format={"type": "json_object"}), cfg)
    assert obj.fields["upstream"] == {"response_format": {"type": "json_object"}}
    # text is what the server answers anyway: nothing is sent
    assert parse_request("chat", _chat(response_format={"type": "text"}), cfg).fields["upstream"] == {}
    # a pool that lists it among its upstream_fields passes it as the client sent it, unchecked
    listed = _cfg(upstream_fields=("response_format",))
    odd = {"type": "regex", "regex": "[0-9]+"}
    assert parse_request("chat", _chat(response_format=odd), listed).fields["upstream"] == {
        "response_format": odd}


@pytest.mark.parametrize(("rf", "param"), [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": 7}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "W" * 257}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "W", "schema": "{}"}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "W", "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "W", "extra": 1}}, "response_format.json_schema.extra"),
    ({"type": "json_object", "json_schema": {"name": "W"}}, "response_format.json_schema"),
    ({"type": "text", "extra": 1}, "response_format.extra"),
])
def test_a_malformed_response_format_is_a_400_naming_it(rf: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request("chat", _chat(response_format=rf), _cfg())
    assert (e.value.status, e.value.param) == (400, param), e.value.message


@pytest.mark.parametrize("name", ["Resp[int]", "Weather report", "Météo", "W" * 256])
def test_a_schema_name_outside_openais_pattern_goes_on_as_vllm_takes_it(name: str) -> None:
    """Was a 400 "must be 1 to 64 letters, digits, underscores or dashes": the SDK's parse()
    and LangChain's with_structured_output name the schema after a generic pydantic model
    (``Resp[int]``) or a JSON schema's title (``"Weather report"``); vLLM takes any string as
    the name (a label: the schema is what holds the answer)."""
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMA}}
    got = parse_request("chat", _chat(response_format=rf), _cfg())
    assert got.fields["upstream"] == {"response_format": rf}


def test_a_pool_without_structured_outputs_refuses_a_json_answer_and_says_which_serves_it() -> None:
    with pytest.raises(ApiError) as e:
        parse_request("chat", _chat(response_format=JSON_SCHEMA), demo_config())
    assert e.value.param == "response_format" and "structured_outputs = true" in e.value.message
    text = parse_request("chat", _chat(response_format={"type": "text"}), demo_config())
    assert text.fields["upstream"] == {}


def _answers(content: str) -> Any:
    async def script(request: Any, body: dict[str, Any], n: int) -> Any:
        resp = await sse_response(request)
        await resp.write(chat_chunk(content, completion_tokens=5))
        await resp.write(chat_chunk(finish="stop", completion_tokens=5) + b"data: [DONE]\n\n")
        return resp

    return script


# (the SDK warns when it serializes its own ParsedChatCompletionMessage, appended as history)
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
async def test_the_sdks_parse_reads_the_answer_into_its_type_and_may_send_it_back(
        redis_server, fake_upstream) -> None:
    """``client.chat.completions.parse(response_format=Weather)``: the SDK sends a strict
    json_schema; the answer's content is read into a Weather; appended to the next request
    (as an agent does), its ``parsed`` object comes back and is not sent on."""
    cfg = make_cfg(redis_server.url, pool={"structured_outputs": True})
    up = fake_upstream
    up.scripts["Weather"] = _answers(json.dumps({"city": "Paris", "celsius": 18}))
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url):
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="demo-p1", max_retries=0)
        try:
            messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
            got = await sdk.chat.completions.parse(model="tiny", messages=messages, response_format=Weather,
                                                   max_tokens=40)
            message = got.choices[0].message
            assert message.parsed == Weather(city="Paris", celsius=18)
            again = await sdk.chat.completions.parse(
                model="tiny", messages=[*messages, message, {"role": "user", "content": "Weather again?"}],
                response_format=Weather, max_tokens=40)
        finally:
            await sdk.close()
    assert again.choices[0].message.parsed == Weather(city="Paris", celsius=18)
    sent = up.bodies[0]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "Weather"
    assert sent["json_schema"]["strict"] is True
    assert sent["json_schema"]["schema"]["required"] == ["city", "celsius"]
    assert "parsed" not in up.bodies[1]["messages"][1]
    assert up.bodies[1]["messages"][1]["content"] == json.dumps({"city": "Paris", "celsius": 18})


@pytest.mark.parametrize("held", ["response_format", "guided_json"])
async def test_a_json_answer_broken_off_is_failed_not_resumed(redis_server, fake_upstream, held: str) -> None:
    """A model server holds the answer to the schema from its first token: a resume's
    continuation (the delivered text as the assistant message to continue) is held to it anew,
    a whole object of its own, and the client read ``{"city": "Par{"city": ...}``. Broken off
    after its text began, a JSON answer fails saying so; the model server is asked once. So
    does one held to vLLM's own guided_json, which a pool passes on (upstream_fields)."""
    cfg = make_cfg(redis_server.url, pool={"structured_outputs": True, "upstream_fields": ("guided_json",)})
    fmt = {"response_format": JSON_SCHEMA} if held == "response_format" else {"guided_json": SCHEMA}
    up = fake_upstream
    read = asyncio.Event()
    up.scripts["Weather"] = breaks_once([chat_chunk('{"city": "Par', completion_tokens=3)], read,
                                        [chat_chunk('{"city": "Paris", "celsius": 18}', finish="stop",
                                                    completion_tokens=9)])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url,
                                               upstream_retry_min_s=0.1, upstream_retry_max_s=0.4):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(**fmt, max_tokens=40, stream=True))
        assert r.status == 200, await r.text()
        events: list[Any] = []
        async for ch in sse_chunks(r.content):
            events.append(ch)
            if ch and ch.get("choices") and ch["choices"][0]["delta"].get("content"):
                read.set()  # the object's first piece reached the client: now the server breaks
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e and e.get("choices"))
    assert up.calls["Weather"] == 1, text
    error = next(e for e in events if e and "error" in e)
    assert "cannot be resumed" in error["error"]["message"], error


async def test_a_json_answer_broken_off_before_its_text_began_is_tried_again(redis_server,
                                                                             fake_upstream) -> None:
    """Nothing of the object delivered (the stream broke before its first text): another try
    asks for it whole, as any request."""
    cfg = make_cfg(redis_server.url, pool={"structured_outputs": True})
    up = fake_upstream
    read = asyncio.Event()
    read.set()
    answer = json.dumps({"city": "Paris", "celsius": 18})
    up.scripts["Weather"] = breaks_once([], read, [chat_chunk(answer, finish="stop", completion_tokens=9)])
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=up.url,
                                               upstream_retry_min_s=0.1, upstream_retry_max_s=0.4):
        r = await client.post("/v1/chat/completions", headers=auth(),
                              json=_chat(response_format=JSON_SCHEMA, max_tokens=40))
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"] == answer
    assert up.calls["Weather"] == 2
    assert all(b["response_format"] == JSON_SCHEMA for b in up.bodies)
