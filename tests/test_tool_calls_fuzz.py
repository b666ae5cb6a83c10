"""Tool fields of every shape, near-valid and junk, in a pool that calls tools: each body is a
400 naming a field, or a request whose payload the worker reads back as it was checked (the
tools and earlier calls stored as sent), never an exception of another kind."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from limiter.config import demo_config, validate
from limiter.frontend.errors import ApiError
from limiter.frontend.openai_api import finish_request, parse_request, refuse_if_surely_too_long
from limiter.prompt import Payload, count_tokens
from tests.support.body_strategies import JSON, JUNK
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state

# Each field: mostly a valid value (so a good share of bodies pass and reach the payload),
# sometimes a near miss or junk of any JSON type.
GOOD_NAME = st.sampled_from(["get_weather", "f", "a-b_c"])
NAME = st.one_of(GOOD_NAME, GOOD_NAME, GOOD_NAME, st.text(max_size=70), JUNK)
FUNCTION = st.fixed_dictionaries(
    {"name": NAME},
    optional={"description": st.one_of(st.text(max_size=20), st.text(max_size=20), JUNK),
              "parameters": st.one_of(st.just({"type": "object", "properties": {}}), JSON),
              "strict": st.one_of(st.booleans(), st.booleans(), JUNK)})
# A schema is the model server's to judge, but it must be storable: integers past 64 bits
# (which msgpack cannot pack) must be a 400, not a 500
SCHEMA_VALUE = st.one_of(JSON, st.sampled_from([2**64, -(2**63) - 1, 2**63 - 1]))
GOOD_FUNCTION = st.fixed_dictionaries(
    {"name": GOOD_NAME},
    optional={"description": st.text(max_size=20), "strict": st.booleans(),
              "parameters": st.fixed_dictionaries({"type": st.just("object")},
                                                  optional={"properties": st.dictionaries(
                                                      st.text(max_size=5), SCHEMA_VALUE, max_size=3)})})
GOOD_TOOL = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": GOOD_FUNCTION}),
                      st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}))
TOOL = st.one_of(GOOD_TOOL, GOOD_TOOL, GOOD_TOOL,
                 st.fixed_dictionaries({"type": JUNK, "function": FUNCTION}, optional={"extra": JUNK}), JUNK)
GOOD_CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=10), "function": st.fixed_dictionaries({"name": NAME,
                                                                   "arguments": st.text(max_size=20)})},
    optional={"type": st.just("function")})
CALL = st.one_of(GOOD_CALL, GOOD_CALL, GOOD_CALL, st.fixed_dictionaries(
    {"id": st.one_of(st.text(min_size=257, max_size=260), JUNK),
     "function": st.one_of(st.fixed_dictionaries({"name": NAME, "arguments": JUNK}), JUNK)},
    optional={"type": JUNK}), JUNK)
USER = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=10)})
GOOD_FUNCTION_CALL = st.fixed_dictionaries({"name": GOOD_NAME, "arguments": st.text(max_size=20)})
GOOD_ASSISTANT = st.fixed_dictionaries(
    {"role": st.just("assistant"),
     "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=10), "type": st.just("function"),
                                                   "function": GOOD_FUNCTION_CALL}), min_size=1, max_size=3)},
    optional={"content": st.one_of(st.none(), st.text(max_size=10))})
ASSISTANT = st.fixed_dictionaries(
    {"role": st.just("assistant"), "tool_calls": st.one_of(st.lists(CALL, min_size=1, max_size=3),
                                                           st.none(), JUNK)},
    optional={"content": st.one_of(st.none(), st.text(max_size=10), JUNK)})
TOOL_RESULT = st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=10),
                                     "tool_call_id": st.text(max_size=8)})
MESSAGE = st.one_of(USER, USER, USER, GOOD_ASSISTANT, GOOD_ASSISTANT, TOOL_RESULT, ASSISTANT)
# (names drawn from three: lists of two or three named one twice most of the time)
DISTINCT_TOOLS = st.lists(GOOD_TOOL, min_size=1, max_size=3,
                          unique_by=lambda t: repr(t["function"].get("name")))
FIELDS = {
    "tools": st.integers(0, 4).flatmap(lambda i: (DISTINCT_TOOLS, DISTINCT_TOOLS, DISTINCT_TOOLS,
                                                  st.lists(TOOL, max_size=3), JUNK)[i]),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.sampled_from(["auto", "any"]),
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": NAME})}),
                             JUNK),
    "parallel_tool_calls": st.one_of(st.booleans(), st.booleans(), JUNK),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    # junk for the whole list one body in ten (hypothesis' one_of drew it for most)
    messages = draw(JUNK if draw(st.integers(0, 9)) == 0 else st.lists(MESSAGE, min_size=1, max_size=3))
    body = {"model": "tiny", "messages": messages, "max_tokens": 8}
    # each field drawn apart, so each shows up often (fixed_dictionaries' optional keys rarely
    # held the valid tools)
    for name, values in FIELDS.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


def _tool_cfg():
    cfg = demo_config()
    return validate(dataclasses.replace(cfg, pools=tuple(dataclasses.replace(p, tool_calls=True)
                                                         for p in cfg.pools)))


CFG = _tool_cfg()


@settings(max_examples=1000, deadline=None)
@given(body=bodies())
def test_a_tool_body_is_a_400_naming_a_field_or_stored_as_checked(body: dict[str, Any]) -> None:
    body = json.loads(json.dumps(body))  # as it comes off the wire (no tuples, str keys)
    try:
        d = parse_request("chat", body, CFG)
        refuse_if_surely_too_long(d)
        req = finish_request(d, count_tokens(d.prompt))
    except ApiError as exc:
        event(f"400 {exc.param.split('[')[0].split('.')[0]}")
        assert exc.status == 400 and exc.param and exc.message
        return
    event("accepted" + (" with tools" if req.upstream.get("tools") else ""))
    stored = Payload.unpack(Payload("chat", req.prompt, req.max_tokens, messages=req.messages,
                                    upstream=req.upstream).pack())
    assert stored.messages == req.messages and stored.upstream == req.upstream
    if req.upstream.get("tools"):
        assert req.upstream["tools"] == body["tools"]  # sent to the model server as the client sent them
    for sent, kept in zip(body["messages"], req.messages, strict=True):
        assert [dict(c) for c in kept.tool_calls] == [
            {**c, "type": "function"} for c in sent.get("tool_calls") or []]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(body=bodies())
async def test_a_tool_body_over_http_is_never_a_5xx_and_an_error_changes_nothing(sync_redis, tool_client,
                                                                                body) -> None:
    before = redis_state(sync_redis)
    r = await tool_client.post("/v1/chat/completions", json=body, headers=auth())
    text = await r.text()
    event(f"status {r.status}")
    assert r.status in (200, 400), text
    if r.status == 400:
        err = json.loads(text)["error"]
        # (a body with Infinity in it is no JSON: that 400 names no field)
        assert err["message"] and err["type"] == "invalid_request_error"
        assert err["param"] or err["code"] == "invalid_json"
        assert redis_state(sync_redis) == before


@pytest.fixture
async def tool_client(redis_server, sync_redis, aredis):
    """A frontend of a pool that calls tools, and a worker that reads each payload back."""
    cfg = make_cfg(redis_server.url, pool={"tool_calls": True})
    async with frontend(cfg) as c, FakeWorker(aredis, POOL, fixed_text="ok"):
        yield c
