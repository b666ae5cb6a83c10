"""Bad input: every class of malformed request is a 4xx OpenAI-style error naming the field,
and changes nothing in Redis (nothing admitted, nothing charged). Plus a hypothesis fuzz over
request bodies: "4xx JSON error or success, never 5xx, never a charge on error"."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.body_strategies import FIELDS
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state
from tests.support.redis_server import free_port

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
SMALL_CONTEXT = {"context_tokens": 4096}
COMP = "/v1/completions"

# (path, body (dict or raw bytes), extra headers, status, param, code)
CASES = [
    (CHAT, b"", {}, 400, None, "invalid_json"),
    (CHAT, b"{", {}, 400, None, "invalid_json"),
    (CHAT, b"[1, 2]", {}, 400, None, "invalid_json"),
    (CHAT, b'{"model": "tiny", "messages": [], "temperature": NaN}', {}, 400, None, "invalid_json"),
    (CHAT, b"\xff\xfe{}", {}, 400, None, "invalid_json"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, {}, 400, None, "invalid_json"),
    (CHAT, b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, None, "invalid_json"),
    (CHAT, b'{"model": "tiny", "max_tokens": ' + b"9" * 101 + b"}", {}, 400, None, "invalid_json"),
    (COMP, b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', {}, 400, None, "invalid_json"),
    # An integer past a float's range (math.isfinite raised OverflowError: a 500 and a traceback)
    *[(COMP, {"model": "tiny", "prompt": "x", name: 10**400}, {}, 400, None, "invalid_json")
      for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "min_p")],
    (COMP, {"model": "tiny", "prompt": "x", "temperature": 10**99}, {}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": MSG}, {}, 400, "model", "missing_required_parameter"),
    (CHAT, {"model": 5, "messages": MSG}, {}, 400, "model", "invalid_type"),
    (CHAT, {"model": "gpt-9", "messages": MSG}, {}, 404, "model", "model_not_found"),
    (COMP, {"model": "gpt-9", "prompt": "x"}, {}, 404, "model", "model_not_found"),
    (CHAT, {"model": "tiny"}, {}, 400, "messages", "missing_required_parameter"),
    (CHAT, {"model": "tiny", "messages": []}, {}, 400, "messages", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": "hi"}, {}, 400, "messages", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": ["hi"]}, {}, 400, "messages[0]", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": [{"role": "god", "content": "x"}]}, {}, 400, "messages[0].role",
     "invalid_value"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content",
     "invalid_type"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, {}, 400, "messages[0].content",
     "missing_required_parameter"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400,
     "messages[0].content[0]", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x", "mood": "sad"}]}, {}, 400,
     "messages[0].mood", "unknown_parameter"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}, {}, 400,
     "messages[0].content", "invalid_type"),
    (COMP, {"model": "tiny"}, {}, 400, "prompt", "missing_required_parameter"),
    (COMP, {"model": "tiny", "prompt": ["a", ["b"]]}, {}, 400, "prompt", "invalid_type"),
    # token ids: a pool that counts bytes has no model's ids (tests/test_token_id_prompts.py)
    (COMP, {"model": "tiny", "prompt": [1, 2, 3]}, {}, 400, "prompt", "unsupported_value"),
    (COMP, {"model": "tiny", "prompt": [1, "a"]}, {}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": [[1], [2]]}, {}, 400, "prompt", "unsupported_value"),
    # lists of texts, or of batches: none of vLLM's prompt shapes (not several prompts)
    (COMP, {"model": "tiny", "prompt": [["a"], ["b"]]}, {}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": ["a"] * 65}, {}, 400, "prompt", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": ["a", 1], "stream": True}, {}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": {"text": "x"}}, {}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x" * 5000}, {}, 400, "prompt", "context_length_exceeded"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, {}, 400, "messages",
     "context_length_exceeded"),
    (COMP, {"model": "tiny", "prompt": "x" * 4000, "max_tokens": 200}, {}, 400, "max_tokens",
     "context_length_exceeded"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": -1}, {}, 400, "max_tokens", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 10**30}, {}, 400, "max_tokens",
     "context_length_exceeded"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": "10"}, {}, 400, "max_tokens", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 2.5}, {}, 400, "max_tokens", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": True}, {}, 400, "max_tokens", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": 0}, {}, 400, "max_completion_tokens",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "temperature": 2.5}, {}, 400, "temperature", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "temperature": -0.1}, {}, 400, "temperature", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "temperature": "hot"}, {}, 400, "temperature", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "top_p": 0}, {}, 400, "top_p", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "top_p": 1.5}, {}, 400, "top_p", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": [str(i) for i in range(33)]}, {}, 400, "stop",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": 5}, {}, 400, "stop", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": ["a", 5]}, {}, 400, "stop[1]", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": [""]}, {}, 400, "stop[0]", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "seed": "42"}, {}, 400, "seed", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "seed": 2**70}, {}, 400, "seed", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "n": 65}, {}, 400, "n", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "n": "2"}, {}, 400, "n", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "n": 2.5, "stream": True}, {}, 400, "n", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, {}, 400, "n",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "stream": "yes"}, {}, 400, "stream", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"x": 1}}, {}, 400,
     "stream_options.x", "unknown_parameter"),
    (COMP, {"model": "tiny", "prompt": "x", "stream": True, "stream_options": []}, {}, 400,
     "stream_options", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "frobnicate": 1}, {}, 400, "frobnicate", "unknown_parameter"),
    # vLLM's extensions: wrong types, out of range, and values this service does not implement
    (COMP, {"model": "tiny", "prompt": "x", "ignore_eos": "yes"}, {}, 400, "ignore_eos", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "min_tokens": 1.5}, {}, 400, "min_tokens", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "min_tokens": -1}, {}, 400, "min_tokens", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, {}, 400, "min_tokens",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "min_tokens": 2, "stop": "z"}, {}, 400, "min_tokens",
     "unsupported_value"),
    (COMP, {"model": "tiny", "prompt": "x", "repetition_penalty": 1.2}, {}, 400, "repetition_penalty",
     "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "top_k": 40}, {}, 400, "top_k", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "min_p": 0.1}, {}, 400, "min_p", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "stream": True,
            "stream_options": {"continuous_usage_stats": 1}}, {}, 400,
     "stream_options.continuous_usage_stats", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "guided_json": {}}, {}, 400, "guided_json",
     "unknown_parameter"),
    (COMP, {"model": "tiny", "prompt": "x", "messages": MSG}, {}, 400, "messages", "unknown_parameter"),
    (CHAT, {"model": "tiny", "messages": MSG, "logprobs": True}, {}, 400, "logprobs", "unsupported_value"),
    # 0 asks for the sampled token's logprob: answered with null, a client read nothing
    (COMP, {"model": "tiny", "prompt": "x", "logprobs": 0}, {}, 400, "logprobs", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "user": 5}, {}, 400, "user", "invalid_type"),
    # stored with the request, never counted as prompt tokens: bounded (a review stored 32 MiB
    # of them in Redis for a tenant of 100 tokens/s)
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "n" * 257}]}, {}, 400,
     "messages[0].name", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": "i" * 257}]}, {},
     400, "messages[0].tool_call_id", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": ["s" * 1000] * 5}, {}, 400, "stop", "invalid_value"),
    # OpenAI's fields: ids and metadata of the wrong shape, values that ask for what is not offered
    (CHAT, {"model": "tiny", "messages": MSG, "safety_identifier": 5}, {}, 400, "safety_identifier",
     "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "prompt_cache_key": ["a"]}, {}, 400, "prompt_cache_key",
     "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "metadata": ["a"]}, {}, 400, "metadata", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "metadata": {"k": 1}}, {}, 400, "metadata.k", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "metadata": {str(i): "v" for i in range(17)}}, {}, 400,
     "metadata", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "metadata": {"k": "v" * 513}}, {}, 400, "metadata.k",
     "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "store": True}, {}, 400, "store", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "service_tier": "flex"}, {}, 400, "service_tier",
     "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "reasoning_effort": "low"}, {}, 400, "reasoning_effort",
     "unsupported_value"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": float("inf")}, {}, 400, None, "invalid_json"),
    (COMP, {"model": "tiny", "prompt": "x", "seed": 2.0**70}, {}, 400, "seed", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, {},
     400, "tools", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "tool_choice": "auto"}, {}, 400, "tool_choice",
     "unsupported_value"),
    # an assistant message as returned, sent back: only at the values this service returns
    (CHAT, {"model": "tiny", "messages": [{"role": "assistant", "content": "", "refusal": "no"}]}, {}, 400,
     "messages[0].refusal", "unsupported_value"),
    (CHAT, {"model": "tiny", "messages": [{"role": "assistant", "content": "x",
                                           "tool_calls": [{"id": "1"}]}]}, {}, 400,
     "messages[0].tool_calls", "unsupported_value"),
    # a wrong type is named as such, not as a disagreement with max_completion_tokens
    (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": "abc", "max_completion_tokens": 5}, {}, 400,
     "max_tokens", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x" * (2 << 20)}, {}, 400, None, "request_too_large"),
    (COMP, {"model": "tiny", "prompt": "x"}, {"X-QoS-Max-Wait-Ms": "soon"}, 400, "X-QoS-Max-Wait-Ms",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x"}, {"X-QoS-Max-Wait-Ms": "0"}, 400, "X-QoS-Max-Wait-Ms",
     "invalid_value"),
    # an HTTP integer is digits: Python's int() also took "1_000", "+1000" and non-ASCII digits
    (COMP, {"model": "tiny", "prompt": "x"}, {"X-QoS-Max-Wait-Ms": "1_000"}, 400, "X-QoS-Max-Wait-Ms",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x"}, {"X-QoS-Max-Wait-Ms": "+1000"}, 400, "X-QoS-Max-Wait-Ms",
     "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x"}, {"X-QoS-Class": "P9"}, 400, "X-QoS-Class", "invalid_class"),
]


@pytest.fixture
async def client(redis_server, sync_redis):
    async with frontend(make_cfg(redis_server.url, pool=SMALL_CONTEXT)) as c:
        yield c


def _ids() -> list[str]:
    out = []
    for i, (path, _body, _headers, _status, param, code) in enumerate(CASES):
        what = param or code
        out.append(f"{i}-{path.rsplit('/', 1)[1]}-{what}")
    return out


@pytest.mark.parametrize("path,body,headers,status,param,code", CASES, ids=_ids())
async def test_bad_input_is_4xx_naming_the_field_and_changes_nothing(client, sync_redis, path, body, headers,
                                                                       status, param, code):
    before = redis_state(sync_redis)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(path, data=data, headers={**auth(), "Content-Type": "application/json", **headers})
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code
    assert err["type"] == "invalid_request_error" and err["message"]
    assert redis_state(sync_redis) == before


async def test_a_bad_header_is_400_before_the_prompt_is_counted_by_the_model_server(redis_server, sync_redis):
    """With tokenizer = "upstream", counting the prompt asks the model server: a bad
    X-QoS-Max-Wait-Ms was judged only after that, so while the server was down the client got
    503 tokenizer_unavailable with Retry-After (and retried for ever) instead of this 400."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = make_cfg(redis_server.url, pool={"tokenizer": "upstream", "tokenizer_url": dead})
    async with frontend(cfg, tokenize_timeout_s=1.0) as c:
        r = await c.post(COMP, json={"model": "tiny", "prompt": "x"},
                         headers={**auth(), "X-QoS-Max-Wait-Ms": "soon"})
        err = (await r.json())["error"]
        assert (r.status, err["code"], err["param"]) == (400, "invalid_value", "X-QoS-Max-Wait-Ms"), err


def test_an_integer_past_a_floats_range_is_a_400_naming_its_field_wherever_the_body_came_from():
    """parse_request's own number check (math.isfinite raised OverflowError for such an int:
    a 500); parse_json refuses the digits already, this is for a body built otherwise."""
    from limiter.config import demo_config
    from limiter.frontend.errors import ApiError
    from limiter.frontend.openai_api import parse_request

    for name in ("temperature", "frequency_penalty"):
        with pytest.raises(ApiError) as e:
            parse_request("completion", {"model": "tiny", "prompt": "x", name: 10**400}, demo_config())
        assert e.value.status == 400 and e.value.param == name
        assert len(e.value.message) < 200  # not the 401 digits


def test_max_wait_header_takes_ascii_digits_only():
    from limiter.config import demo_config
    from limiter.frontend.app import _max_wait_ms
    from limiter.frontend.errors import ApiError

    cls = demo_config().classes[2]
    assert _max_wait_ms(" 0500 ", cls) == 500
    for bad in ("\u0661\u0660\u0660\u0660", "\uff11\uff10", "1_000", "+1000", "-5", "5.0", ""):
        with pytest.raises(ApiError):
            _max_wait_ms(bad, cls)


async def test_wrong_method_and_unknown_path_are_json_errors(client):
    r = await client.get(CHAT, headers=auth())
    assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    assert r.headers.get("Allow") == "POST"  # a 405 says what is allowed (RFC 9110 15.5.6)
    r = await client.post("/v1/embeddings", json={}, headers=auth())
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


# --- fuzz ---------------------------------------------------------------------------------------

@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """Mostly near-valid bodies (so a good share succeed), with junk mixed into any field."""
    path = draw(st.sampled_from([CHAT, COMP]))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(max_size=40))
    core = {"model": "tiny"}
    if path == CHAT:
        core["messages"] = draw(st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                "content": st.text(max_size=20)}),
                                         min_size=1, max_size=2))
    else:
        core["prompt"] = draw(st.text(max_size=30))
    body = {**core, **draw(st.fixed_dictionaries({}, optional=FIELDS))}
    return path, json.dumps(body).encode()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(req=requests())
async def test_fuzz_bodies_never_5xx_never_charge_on_error(sync_redis, fuzz_client, req):
    path, data = req
    before = redis_state(sync_redis)
    r = await fuzz_client.post(path, data=data, headers={**auth(), "Content-Type": "application/json"})
    text = await r.text()
    event(f"status {r.status}")
    assert r.status in (200, 400, 404), text
    if r.status == 200:
        return
    err = json.loads(text)["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert redis_state(sync_redis) == before


@pytest.fixture
async def fuzz_client(redis_server, sync_redis, aredis):
    cfg = make_cfg(redis_server.url, pool=SMALL_CONTEXT)
    async with frontend(cfg) as c, FakeWorker(aredis, POOL, fixed_text="ok"):
        yield c


async def test_requests_aiohttp_cannot_parse_leave_no_error_in_the_log(
        redis_server, sync_redis, caplog) -> None:
    """A request line or header aiohttp cannot parse gets its plain-text 400 before any of
    the frontend's code runs, and aiohttp logged some of them ("Error handling request", a
    bad header token) at ERROR with a traceback: any client, no key needed, could fill the
    log with tracebacks. They are logged at DEBUG, and change nothing in Redis."""
    import asyncio
    import logging

    caplog.set_level(logging.INFO)
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg) as c:
        before = redis_state(sync_redis)
        for raw in (b"GARBAGE\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: \x01\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n{}"):
            reader, writer = await asyncio.open_connection("127.0.0.1", c.port)
            try:
                writer.write(raw)
                await writer.drain()
                head = await asyncio.wait_for(reader.readline(), 10)
                assert b" 400 " in head, (raw, head)
            finally:
                writer.close()
        assert redis_state(sync_redis) == before
    loud = [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.WARNING]
    assert not loud, [(r.levelname, r.getMessage()) for r in loud]


async def _first_answer_line(port: int, head: bytes, body_after_continue: bytes | None = None) -> list[bytes]:
    """Sends a request head (``Expect: 100-continue``, no body) and returns the status lines
    the server answers with, the body sent only once a ``100 Continue`` came."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        lines = [await asyncio.wait_for(reader.readline(), 10)]  # deadline: the server's first answer
        if not lines[0].startswith(b"HTTP/1.1 100 "):
            # a refusal says the connection closes after it: the client's body, if it sends
            # one anyway, is never read as the start of a next request
            head = []
            while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
                head.append(line.strip().lower())
            assert b"connection: close" in head, head
            return lines
        if body_after_continue is not None:
            assert await asyncio.wait_for(reader.readline(), 10) == b"\r\n"
            writer.write(body_after_continue)
            await writer.drain()
            lines.append(await asyncio.wait_for(reader.readline(), 10))  # deadline: the final answer
        return lines
    finally:
        writer.close()


def _expect_head(headers: dict[str, str], length: int, expect: str = "100-continue") -> bytes:
    lines = [f"POST {CHAT} HTTP/1.1", "Host: x", "Content-Type: application/json",
             f"Content-Length: {length}", f"Expect: {expect}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_expect_100_continue_is_answered_only_when_the_headers_pass(redis_server, sync_redis) -> None:
    """``Expect: 100-continue`` asks whether to send the body: a bad key, a class above the
    key's ceiling, a bad max-wait header or a body over the limit get their final 4xx at once,
    with no ``100 Continue`` (aiohttp's default sent the 100 first: the client uploaded its
    whole body to be refused); good headers get the 100, and the body is then read (here a
    broken one: its 400 shows it was). Another expectation is a 417. Nothing changes in Redis."""
    cfg = make_cfg(redis_server.url)
    async with frontend(cfg, max_body_bytes=10_000) as c:
        before = redis_state(sync_redis)
        for headers, length, status in (
                (auth("wrong-key"), 100, 401),
                ({}, 100, 401),
                (auth(**{"X-QoS-Class": "P0"}), 100, 403),
                (auth(**{"X-QoS-Max-Wait-Ms": "0"}), 100, 400),
                (auth(), 10_001, 400)):
            lines = await _first_answer_line(c.port, _expect_head(headers, length))
            assert lines[0].startswith(f"HTTP/1.1 {status} ".encode()), (headers, length, lines)
        lines = await _first_answer_line(c.port, _expect_head(auth(), 5), b"{nope")
        assert lines[0].startswith(b"HTTP/1.1 100 ") and lines[1].startswith(b"HTTP/1.1 400 "), lines
        lines = await _first_answer_line(c.port, _expect_head(auth(), 5, expect="something-else"))
        assert lines[0].startswith(b"HTTP/1.1 417 "), lines
        assert redis_state(sync_redis) == before
