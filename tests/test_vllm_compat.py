"""The vLLM-compatible surface: ``/health``, ``GET /v1/models/{id}``, vLLM's request
extensions (``ignore_eos``, ``min_tokens``, ``stream_options.continuous_usage_stats``, the
neutral sampling knobs ``vllm bench serve`` sends), and the exact requests guidellm 0.8.1,
aiperf 0.13.0 and ``vllm bench serve`` send by default, replayed byte for byte with their
headers against the real frontend, a private redis-server and the in-test worker.

The replayed bodies were read from the tools' own source (guidellm
``backends/openai/request_handlers.py`` ``format`` after its ``deep_filter`` of None values,
aiperf ``endpoints/openai_chat.py`` / ``openai_completions.py`` and
``transports/base_transports.py``, vLLM ``benchmarks/lib/endpoint_request_func.py``).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from limiter.errors import InvalidArgument
from limiter.prompt import ChatMessage, Payload, count_tokens, render_chat
from tests.support.frontend_helpers import auth, fe_of, frontend, make_cfg

# Fixtures, asked for by name ("client", "fake_worker"): the "as" re-exports them.
from tests.support.frontend_helpers import client_fixture as client_fixture
from tests.support.frontend_helpers import fake_worker_fixture as fake_worker_fixture
from tests.support.worker_helpers import worker
from worker.batch_policy import Limits
from worker.engines.base import SamplingParams
from worker.engines.torch_engine import TorchEngine
from worker.local_run import LocalRequest, run_local
from worker.tokenizer import EOS_ID

KEY = "demo-p1"
TEXT = "The quick brown fox jumps over the lazy dog, again and again and again."


def events(raw: str) -> list[Any]:
    assert raw.endswith("\n\n"), raw[-200:]
    out: list[Any] = []
    for e in raw[:-2].split("\n\n"):
        assert e.startswith("data: "), e
        out.append(e[6:] if e == "data: [DONE]" else json.loads(e[6:]))
    return out


# --- /health and /v1/models/{id} --------------------------------------------------------------

async def test_health_is_readiness(client):
    r = await client.get("/health", headers={"Authorization": f"Bearer {KEY}"})  # guidellm sends the key
    assert r.status == 200 and (await r.json())["status"] == "ready"
    assert (await client.get("/health")).status == 200  # and needs none


async def test_health_is_503_while_not_ready(sync_redis):
    from tests.support.redis_server import free_port

    async with frontend(make_cfg(f"redis://127.0.0.1:{free_port()}/0")) as c:  # nothing listens there
        r = await c.get("/health")
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await c.get("/healthz")).status == 200  # liveness is not readiness


async def test_models_retrieve(client):
    r = await client.get("/v1/models/tiny", headers=auth())
    assert r.status == 200
    assert await r.json() == {"id": "tiny", "object": "model", "created": 0, "owned_by": "qos",
                              "max_model_len": fe_of(client).cfg.pools[0].context_tokens}
    listed = (await (await client.get("/v1/models", headers=auth())).json())["data"]
    assert listed == [await r.json()]
    assert (await client.get("/v1/models/tiny")).status == 401
    r = await client.get("/v1/models/meta-llama/Llama-3-8B", headers=auth())  # ids may hold '/'
    assert r.status == 404
    err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error"
    assert "'meta-llama/Llama-3-8B' does not exist" in err["message"] and "tiny" in err["message"]

    sdk = openai.AsyncOpenAI(base_url=str(client.server.make_url("/v1")), api_key=KEY, max_retries=0)
    m = await sdk.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as nf:
        await sdk.models.retrieve("gpt-9")
    assert "gpt-9" in str(nf.value)
    await sdk.close()


# --- vLLM's extensions ---------------------------------------------------------------------------

async def test_extensions_reach_the_worker_payload(client, fake_worker):
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 12, "ignore_eos": True, "min_tokens": 5,
            "repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": None, "stop": None}
    r = await client.post("/v1/completions", json=body, headers=auth())
    assert r.status == 200, await r.text()
    p = fake_worker.payloads[r.headers["X-QoS-Request-Id"]]
    assert p.ignore_eos is True and p.min_tokens == 5 and p.max_tokens == 12 and p.messages == ()
    assert p.stream is False  # what the worker's push cadence follows
    assert p.grouped_tokens is True  # this frontend reads a push's grouped reply entries
    assert p.aside_logprobs is True  # and a chunk's logprobs marked apart (reply_text.py NUL L)

    r = await client.post("/v1/completions", json={**body, "stream": True}, headers=auth())
    assert r.status == 200, await r.text()
    await r.read()
    assert fake_worker.payloads[r.headers["X-QoS-Request-Id"]].stream is True

    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}],
                                           "name": "ann"}], "max_completion_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 200, await r.text()
    p = fake_worker.payloads[r.headers["X-QoS-Request-Id"]]
    assert p.ignore_eos is False and p.min_tokens == 0
    assert p.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hi", name="ann"))
    assert p.prompt == render_chat([("system", "be brief"), ("user", "hi")])

    # text parts are joined with a newline, as vLLM joins them (not run into one word)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    body["messages"] = [{"role": "user", "content": parts}]
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 200, await r.text()
    p = fake_worker.payloads[r.headers["X-QoS-Request-Id"]]
    assert p.messages == (ChatMessage("user", "Hello\nworld"),)


def _check_continuous_usage(chunks: list[dict[str, Any]], prompt_tokens: int, text: str) -> dict[str, int]:
    """Every chunk carries the running usage; the content chunks' completion_tokens is the
    tokens streamed so far (the in-test worker: one token per character); it ends with a
    usage-only chunk that agrees with the last running figure."""
    assert all(isinstance(c.get("usage"), dict) for c in chunks), chunks
    streamed, last = "", 0
    for c in chunks[:-1]:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens
        assert u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        assert u["completion_tokens"] >= last
        last = u["completion_tokens"]
        ch = c["choices"][0]
        piece = ch.get("text") if "text" in ch else (ch["delta"].get("content") or "")
        streamed += piece
        if piece:
            assert u["completion_tokens"] == len(streamed)
    assert streamed == text
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"] == chunks[-2]["usage"]
    return final["usage"]


async def test_continuous_usage_stats_per_chunk(client, fake_worker):
    fake_worker.batch = 3  # several reply entries, so several content chunks
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = await client.post("/v1/completions", json=body, headers=auth())
    ev = events(await r.text())
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 3
    u = _check_continuous_usage(chunks, count_tokens(TEXT), TEXT[::-1][:20])
    assert u == {"prompt_tokens": count_tokens(TEXT), "completion_tokens": 20,
                 "total_tokens": count_tokens(TEXT) + 20}

    # continuous_usage_stats without include_usage changes nothing (as vLLM): no usage at all
    body["stream_options"] = {"continuous_usage_stats": True}
    ev = events(await (await client.post("/v1/completions", json=body, headers=auth())).text())
    assert all("usage" not in c for c in ev[:-1])


# --- what the tools send, replayed ---------------------------------------------------------------

def _user_text(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


HTTPX = {"Accept": "*/*", "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive",
         "User-Agent": "python-httpx/0.28.1", "Content-Type": "application/json"}
AIPERF = {"User-Agent": "aiperf/0.13.0", "X-Request-ID": "4f1c0f5e-8d6e-4a43-9d4e-0c2b8f6b7a11",
          "X-Correlation-ID": "0b6f2d1e-7a3c-4c55-8f0e-5d9a6c1e2b33", "Content-Type": "application/json"}
VLLM = {"Content-Type": "application/json", "x-request-id": "bench-6f1e2d3c-0"}

# (tool, path, extra headers, body as the tool serialises it: key order kept)
REPLAYS: list[tuple[str, str, dict[str, str], dict[str, Any]]] = [
    ("guidellm-chat", "/v1/chat/completions", HTTPX, {
        "model": "tiny", "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": _user_text(TEXT)}]}),
    ("guidellm-completions", "/v1/completions", HTTPX, {
        "model": "tiny", "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 16, "ignore_eos": True, "prompt": TEXT}),
    ("aiperf-chat-per-chunk-usage", "/v1/chat/completions", {**AIPERF, "Accept": "text/event-stream"}, {
        "messages": [{"role": "user", "content": TEXT}], "model": "tiny", "stream": True,
        "max_completion_tokens": 16,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("aiperf-completions-non-stream", "/v1/completions", {**AIPERF, "Accept": "application/json"}, {
        "prompt": TEXT, "model": "tiny", "stream": False, "max_tokens": 16}),
    ("vllm-bench-completions", "/v1/completions", VLLM, {
        "model": "tiny", "prompt": TEXT, "repetition_penalty": 1.0, "max_tokens": 16, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}),
    ("vllm-bench-chat", "/v1/chat/completions", VLLM, {
        "model": "tiny", "messages": [{"role": "user", "content": _user_text(TEXT)}],
        "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "temperature": 0.0}),
]


@pytest.mark.parametrize("tool,path,headers,body", REPLAYS, ids=[r[0] for r in REPLAYS])
async def test_tool_requests_replayed(client, fake_worker, tool, path, headers, body):
    fake_worker.batch = 5
    raw = json.dumps(body).encode()
    r = await client.post(path, data=raw, headers={**headers, "Authorization": f"Bearer {KEY}"})
    assert r.status == 200, (tool, await r.text())
    rid = r.headers["X-QoS-Request-Id"]
    p = fake_worker.payloads[rid]
    chat = path.endswith("chat/completions")
    # the tool's own X-Request-Id comes back as the answer's id and x-request-id, as vLLM answers
    own = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)
    assert r.headers["x-request-id"] == (own or rid)
    answer_id = ("chatcmpl-" if chat else "cmpl-") + (own or rid)
    prompt = render_chat([("user", TEXT)]) if chat else TEXT
    assert p.prompt == prompt and p.max_tokens == 16
    assert p.ignore_eos is bool(body.get("ignore_eos"))
    assert p.temperature == body.get("temperature", 1.0)
    want = prompt[::-1][:16]
    if not body["stream"]:
        out = await r.json()
        assert out["choices"][0]["text"] == want and out["usage"]["completion_tokens"] == 16
        assert out["id"] == answer_id
        return
    ev = events(await r.text())
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert {c["id"] for c in chunks} == {answer_id}
    if body["stream_options"].get("continuous_usage_stats"):
        u = _check_continuous_usage(chunks, count_tokens(prompt), want)
    else:
        assert all(c["usage"] is None for c in chunks[:-1])
        u = chunks[-1]["usage"]
        text = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "")
                       for c in chunks if c["choices"])
        assert text == want
    assert u["completion_tokens"] == 16 and u["prompt_tokens"] == count_tokens(prompt)
    fins = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert fins[-1] == "length" and all(f is None for f in fins[:-1])


async def test_guidellm_probes_then_runs(client, fake_worker):
    """guidellm's start-up: GET /health with the key, then GET /v1/models (its requests:
    test_tool_requests_replayed)."""
    h = {**HTTPX, "Authorization": f"Bearer {KEY}"}
    h.pop("Content-Type")
    assert (await client.get("/health", headers=h)).status == 200
    models = await (await client.get("/v1/models", headers=h)).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


# --- the payload ------------------------------------------------------------------------------

def test_payload_carries_extensions_and_messages():
    msgs = (ChatMessage("system", "s"), ChatMessage("user", "u\n<|system|>\nx", name="n"),
            ChatMessage("tool", "42", tool_call_id="call_1"))
    p = Payload("chat", "rendered", 9, ignore_eos=True, min_tokens=3, messages=msgs)
    assert Payload.unpack(p.pack()) == p
    # a payload written without the new fields (an older frontend) decodes to the defaults
    old = Payload("completion", "x", 2).pack()
    assert Payload.unpack(old) == Payload("completion", "x", 2)
    import msgpack
    assert "stream" not in msgpack.unpackb(old)  # a streamed request's payload is as before
    unstreamed = Payload("completion", "x", 2, stream=False)
    assert Payload.unpack(unstreamed.pack()) == unstreamed and not Payload.unpack(unstreamed.pack()).stream
    with pytest.raises(ValueError, match="'stream' is not a boolean"):
        Payload.unpack(msgpack.packb({"v": 1, "kind": "chat", "prompt": "x", "max_tokens": 1, "stream": 0}))
    # this release's frontends read grouped reply entries and say so; an older one's payload does not
    grouped = Payload("completion", "x", 2, grouped_tokens=True)
    assert Payload.unpack(grouped.pack()).grouped_tokens and not Payload.unpack(old).grouped_tokens
    assert "grouped_tokens" not in msgpack.unpackb(old)
    with pytest.raises(ValueError, match="'grouped_tokens' is not a boolean"):
        Payload.unpack(msgpack.packb({"v": 1, "kind": "chat", "prompt": "x", "max_tokens": 1,
                                      "grouped_tokens": 1}))
    with pytest.raises(ValueError):
        import msgpack
        Payload.unpack(msgpack.packb({"v": 1, "kind": "chat", "prompt": "x", "max_tokens": 1,
                                      "messages": [{"role": "root", "content": "x"}]}))


# --- the step engines honour ignore_eos and min_tokens -----------------------------------------

def eos_loving_engine() -> TorchEngine:
    """The tiny model with a bias that makes EOS the likeliest next token everywhere: real
    forward passes, a model that wants to stop at once."""
    eng = TorchEngine.from_preset("tiny", seed=0, kv_capacity_tokens=4096)
    old = eng.model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS_ID] = 1e4
    eng.model.lm_head = head
    return eng


def test_eos_rule():
    assert SamplingParams.eos_rule(10, False, 0) == 0
    assert SamplingParams.eos_rule(10, True, 5) == -1
    assert SamplingParams.eos_rule(10, False, 5) == 15
    p = SamplingParams(eos_min_len=15)
    assert not p.eos_allowed(14) and p.eos_allowed(15)
    assert not SamplingParams(eos_min_len=-1).eos_allowed(10**6)
    with pytest.raises(InvalidArgument):
        SamplingParams(eos_min_len=-2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_torch_engine_honours_ignore_eos_and_min_tokens(temperature):
    torch.set_num_threads(1)
    eng = eos_loving_engine()
    prompt = tuple(eng.encode("hello"))
    n = len(prompt)

    def req(rid: str, eos_min_len: int) -> LocalRequest:
        params = SamplingParams(temperature, seed=1, max_tokens=12, eos_min_len=eos_min_len)
        return LocalRequest(rid, prompt, params)

    run = await run_local(eng, [req("plain", 0), req("ignore", SamplingParams.eos_rule(n, True, 0)),
                                req("min5", SamplingParams.eos_rule(n, False, 5))], Limits(512, 8))
    t = run.traces
    assert t["plain"].tokens == [EOS_ID] and t["plain"].finish_reason == "stop"
    assert len(t["ignore"].tokens) == 12 and EOS_ID not in t["ignore"].tokens
    assert t["ignore"].finish_reason == "length"
    assert len(t["min5"].tokens) == 6 and EOS_ID not in t["min5"].tokens[:5] and t["min5"].tokens[5] == EOS_ID
    assert t["min5"].finish_reason == "stop"


async def test_worker_passes_ignore_eos_and_min_tokens_to_the_torch_engine(worker_env):
    """Through Redis and the real step loop: the payload's fields decide when EOS may come."""
    cfg, c = worker_env
    torch.set_num_threads(1)
    async with worker(cfg, engine_obj=eos_loving_engine()):
        plain = await c.admit("hello", max_tokens=10)
        ignore = await c.admit("hello", max_tokens=10, ignore_eos=True)
        least = await c.admit("hello", max_tokens=10, min_tokens=4)
        await c.wait(timeout=60)
    assert c.answers[plain].done["fin"] == "stop" and int(c.answers[plain].done["out"]) == 1
    assert c.answers[ignore].done["fin"] == "length" and int(c.answers[ignore].done["out"]) == 10
    assert EOS_ID not in await c.generated(ignore)
    assert c.answers[least].done["fin"] == "stop" and int(c.answers[least].done["out"]) == 5
    assert (await c.generated(least))[-1] == EOS_ID


async def test_redis_outage_errors_name_no_address():
    """When Redis goes away under a running frontend, the 503 a client gets and the public
    /readyz reason say what is wrong without the store's address or the driver's text."""
    from tests.support.redis_server import RedisServer

    with RedisServer() as server:
        async with frontend(make_cfg(server.url)) as c:
            assert (await c.get("/health")).status == 200
            server.kill()
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth())
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "redis_unavailable" and "cannot be reached" in err["message"]
            r = await c.get("/readyz")
            body = await r.text()
            assert r.status == 503
            for text in (err["message"], body):
                assert str(server.port) not in text and "127.0.0.1" not in text and "Error" not in text


async def test_openai_sdk_with_vllm_extras(client, fake_worker):
    """The official SDK passing vLLM's fields the documented way (extra_body, stream_options)."""
    fake_worker.batch = 2
    sdk = openai.AsyncOpenAI(base_url=str(client.server.make_url("/v1")), api_key=KEY, max_retries=0)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "min_tokens": 2})
    usages = [ch.usage.completion_tokens async for ch in stream]
    assert usages == sorted(usages) and usages[-1] == 8 and len(usages) >= 4
    assert all(u is not None for u in usages)
    (p,) = fake_worker.payloads.values()
    assert p.ignore_eos and p.min_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.completions.create(model="tiny", prompt="x", extra_body={"min_tokens": 5}, max_tokens=2)
    assert e.value.body["param"] == "min_tokens"
    await sdk.close()


def test_fields_openai_and_vllm_clients_send_at_their_do_nothing_values_are_accepted():
    """What OpenAI's and vLLM's servers take and clients send (the Agents SDK's ``store`` and
    ``metadata``, LangChain's ``service_tier``, the SDK's ``safety_identifier``; numbers
    written as floats; more than OpenAI's 4 stop strings, as vLLM takes; both max-token
    fields, where vLLM uses ``max_completion_tokens``): each was a 400 "Unrecognized request
    argument" or a type error (found by review)."""
    from limiter.config import demo_config
    from limiter.frontend.openai_api import finish_request, parse_request

    cfg = demo_config()

    def request(kind: str = "chat", **fields: Any):
        base = {"model": "tiny", **({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat"
                                    else {"prompt": "x"})}
        return finish_request(parse_request(kind, {**base, **fields}, cfg), 2)

    for fields in ({"store": False}, {"metadata": {"run": "7", "team": "a"}}, {"service_tier": "auto"},
                   {"service_tier": "default"}, {"safety_identifier": "u-1"}, {"prompt_cache_key": "k"},
                   {"modalities": ["text"]}, {"n": 1.0}):
        assert request(**fields).max_tokens > 0, fields
    assert request("completion", store=False, metadata={}, safety_identifier="u").max_tokens > 0
    r = request(max_tokens=5.0, seed=1.0, min_tokens=2.0)
    assert (r.max_tokens, r.seed, r.payload().min_tokens) == (5, 1, 2)
    assert all(type(v) is int for v in (r.max_tokens, r.seed, r.payload().min_tokens))
    assert request(stop=[str(i) for i in range(32)]).stop == tuple(str(i) for i in range(32))
    assert request(max_tokens=100, max_completion_tokens=7).max_tokens == 7


@pytest.mark.parametrize("sent", ["a b", "x" * 129, "ü"])
async def test_a_request_id_the_answer_cannot_carry_is_ignored_not_refused(client, fake_worker, sent) -> None:
    """A client's X-Request-Id that is not 1 to 128 visible ASCII characters (a long tracing
    id): the request is served with the service's own id (it was ignored before; a 400 would
    refuse every request of such a client)."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": sent.encode().decode("latin-1")}
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2},
                          headers=headers)
    assert r.status == 200, await r.text()
    rid = r.headers["X-QoS-Request-Id"]
    assert r.headers["x-request-id"] == rid and (await r.json())["id"] == "cmpl-" + rid


def test_a_pools_upstream_fields_are_carried_to_the_worker_as_sent():
    """``[[pools]] upstream_fields``: those fields of a request go into the payload as the
    client sent them (any JSON value; null: not sent), for the openai engine to pass on; a
    pool that lists none refuses them as before, and a pool's list is its own."""
    import dataclasses

    from limiter.config import PoolConfig, demo_config, validate
    from limiter.frontend.errors import ApiError
    from limiter.frontend.openai_api import finish_request, parse_request

    base = demo_config()
    vllm = PoolConfig(name="vllm", context_tokens=4096,
                      upstream_fields=("top_k", "min_p", "chat_template_kwargs", "guided_json"))
    cfg = validate(dataclasses.replace(base, pools=(*base.pools, vllm)))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    knobs = {"top_k": 20, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False},
             "guided_json": {"type": "object", "properties": {"a": {"type": "string"}}}}
    req = finish_request(parse_request("chat", {"model": "vllm", **chat, **knobs, "min_p": None}, cfg), 3)
    payload = req.payload()
    assert payload.upstream == {k: v for k, v in knobs.items() if k != "min_p"}
    assert Payload.unpack(payload.pack()) == payload
    assert finish_request(parse_request("chat", {"model": "vllm", **chat}, cfg), 3).payload().upstream == {}
    assert "upstream" not in __import__("msgpack").unpackb(
        finish_request(parse_request("chat", {"model": "vllm", **chat}, cfg), 3).payload().pack())
    with pytest.raises(ApiError) as e:  # the demo pool lists none: top_k only at its neutral value
        parse_request("chat", {"model": "tiny", **chat, "top_k": 20}, cfg)
    assert e.value.body()["error"]["param"] == "top_k"
    with pytest.raises(ApiError) as e:
        parse_request("chat", {"model": "tiny", **chat, "chat_template_kwargs": {}}, cfg)
    assert e.value.body()["error"]["code"] == "unknown_parameter"
    with pytest.raises(ValueError, match="upstream"):  # a stored payload of the wrong shape
        Payload.unpack(__import__("msgpack").packb({"v": 1, "kind": "chat", "prompt": "x", "max_tokens": 1,
                                                    "upstream": [1, 2]}))


def _passing_cfg():
    import dataclasses

    from limiter.config import PoolConfig, demo_config, validate

    base = demo_config()
    vllm = PoolConfig(name="vllm", context_tokens=4096,
                      upstream_fields=("top_k", "chat_template_kwargs", "extra"))
    return validate(dataclasses.replace(base, pools=(*base.pools, vllm)))


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("field,value,param", [
    ("top_k", 2**64, "top_k"),  # msgpack holds 64 bits: was a 500 and a traceback
    ("top_k", -(2**63) - 1, "top_k"),
    ("extra", {"a": [1, {"b": 10**30}]}, "extra.a[1].b"),
    ("extra", "\ud800", "extra"),  # a lone surrogate: no UTF-8
    ("extra", {"\ud800": 1}, "extra"),
    ("extra", _nested(40), None),
    # chat_template_kwargs may not set what the worker sets, nor carry a template or uncounted text
    ("chat_template_kwargs", {"enable_thinking": False, "chat_template": "{{ 1 }}"},
     "chat_template_kwargs.chat_template"),
    ("chat_template_kwargs", {"continue_final_message": True}, "chat_template_kwargs.continue_final_message"),
    ("chat_template_kwargs", {"documents": [{"text": "x" * 1000}]}, "chat_template_kwargs.documents"),
    # vLLM's is an object: anything else was a 500 out of the /tokenize count
    *[("chat_template_kwargs", v, "chat_template_kwargs") for v in ("x", True, 5, [["a", "b"]])],
])
def test_a_passed_field_that_cannot_go_as_sent_is_a_400_naming_it(field, value, param) -> None:
    from limiter.frontend.errors import ApiError
    from limiter.frontend.openai_api import parse_request

    body = {"model": "vllm", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ApiError) as e:
        parse_request("chat", body, _passing_cfg())
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param, e.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(st.characters(exclude_categories=())),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(st.characters(exclude_categories=()), max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values)
def test_a_passed_value_is_refused_or_stored_as_sent(value) -> None:
    """Whatever JSON a client puts in a passed-through field: a 400, or a payload that packs
    and reads back with the value as sent (never an error out of the packing: a 500)."""
    from limiter.frontend.errors import ApiError
    from limiter.frontend.openai_api import finish_request, parse_request

    body = {"model": "vllm", "prompt": "x", "extra": value}
    try:
        req = finish_request(parse_request("completion", body, _passing_cfg()), 2)
    except ApiError as exc:
        assert exc.status == 400
        return
    payload = req.payload()
    got = Payload.unpack(payload.pack())
    assert got.upstream == ({} if value is None else {"extra": value})


def test_a_payload_with_passed_fields_is_one_an_older_worker_refuses():
    """Version 2 when it carries ``upstream``: a worker of an older release, which reads
    version 1 only, refuses it (the request fails) instead of answering without the fields."""
    import msgpack

    with_fields = Payload("chat", "x", 3, upstream={"top_k": 5})
    assert msgpack.unpackb(with_fields.pack())["v"] == 2
    assert msgpack.unpackb(Payload("chat", "x", 3).pack())["v"] == 1  # as before: old workers read it
    assert Payload.unpack(with_fields.pack()) == with_fields


def test_sampling_fields_the_client_left_out_are_left_to_the_model_server():
    """A request without temperature / top_p: the step engines use the service's defaults, the
    openai engine sends nothing for them (vLLM applies the model's generation_config, as for
    the client directly; found by a review of the openai worker). An older frontend's payload
    has no `defaulted`: everything counts as given, as before."""
    import msgpack

    from limiter.config import demo_config
    from limiter.frontend.openai_api import finish_request, parse_request

    cfg = demo_config()

    def payload(**fields: Any) -> Payload:
        return finish_request(parse_request("completion", {"model": "tiny", "prompt": "x", **fields}, cfg),
                              2).payload()

    left_out = payload()
    assert left_out.defaulted == ("temperature", "top_p") and left_out.temperature == 1.0
    assert payload(temperature=0.2).defaulted == ("top_p",)
    assert payload(temperature=0.2, top_p=0.9).defaulted == ()
    assert Payload.unpack(left_out.pack()) == left_out
    assert "defaulted" not in msgpack.unpackb(Payload("completion", "x", 2).pack())
    odd = msgpack.packb({"v": 1, "kind": "completion", "prompt": "x", "max_tokens": 1,
                         "defaulted": ["seed", "temperature"]})
    assert Payload.unpack(odd).defaulted == ("temperature",)  # only what may be left out
