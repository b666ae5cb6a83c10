"""The frontend's OpenAI API end to end: test client and the official openai SDK over real
sockets, against a private redis-server and the in-test fake worker (real scripts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import openai
import pytest

from limiter.config import validate
from limiter.frontend.replies import Reply, dedup
from limiter.frontend.runtime import FRONTEND
from limiter.keys import PoolKeys
from limiter.prompt import Payload, count_tokens, render_chat
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, fe_of, frontend, make_cfg

# Fixtures, asked for by name ("client", "fake_worker"): the "as" re-exports them.
from tests.support.frontend_helpers import client_fixture as client_fixture
from tests.support.frontend_helpers import fake_worker_fixture as fake_worker_fixture

ONE_TOKEN = {"model": "tiny", "prompt": "x", "max_tokens": 1}


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    out = []
    for e in events:
        assert e.startswith("data: "), e
        assert "\n" not in e
        out.append(e[len("data: "):])
    return out


# --- the shared prompt module -------------------------------------------------------------------

def test_count_tokens_is_utf8_bytes_plus_bos():
    assert count_tokens("") == 1
    assert count_tokens("hello") == 6
    assert count_tokens("héllo") == 7  # é is two bytes
    assert count_tokens("日本") == 7


def test_render_chat_template():
    assert render_chat([("system", "be brief"), ("user", "hi")]) == \
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_payload_roundtrip():
    p = Payload(kind="chat", prompt="x", max_tokens=3, temperature=0.5, top_p=0.9, stop=("a",), seed=7,
                model="tiny")
    assert Payload.unpack(p.pack()) == p
    with pytest.raises(ValueError):
        Payload.unpack(b"\x93\x01")
    # a number no int holds is a malformed payload (ValueError, which a worker fails the request
    # for), not an OverflowError out of the worker's claim
    import msgpack

    for field, value in (("max_tokens", float("inf")), ("min_tokens", float("-inf"))):
        blob = msgpack.packb({"v": 1, "kind": "completion", "prompt": "x", "max_tokens": 3, field: value})
        with pytest.raises(ValueError, match="malformed"):
            Payload.unpack(blob)


# --- non-stream and stream through the test client -------------------------------------------

async def test_chat_non_stream(client, fake_worker):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "sys"},
                                          {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "max_tokens": 8, "temperature": 0.2, "seed": 3, "stop": ["zz"]}
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 200, await r.text()
    out = await r.json()
    prompt = render_chat([("system", "sys"), ("user", "hello")])
    served = await fake_worker.by_id(r.headers["X-QoS-Request-Id"])
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": prompt[::-1][:8]}
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": served.usage_in, "completion_tokens": served.usage_out,
                            "total_tokens": served.usage_in + served.usage_out}
    assert served.usage_in == count_tokens(prompt) and served.usage_out == 8


async def test_a_multi_turn_client_may_send_back_its_answer_and_a_developer_message(client, fake_worker,
                                                                                     sync_redis):
    """Clients that append the assistant message they received (as OpenAI and vLLM return it:
    refusal, tool_calls, function_call, audio at null) and send the tool fields empty were
    refused field by field; "developer" is OpenAI's newer name for the system message."""
    first = await client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}, headers=auth())
    answer = (await first.json())["choices"][0]["message"]
    # as OpenAI returns it (openai-python's model_dump) and as vLLM does (reasoning_content)
    echoed = {**answer, "refusal": None, "tool_calls": [], "function_call": None, "audio": None,
              "annotations": None, "reasoning_content": "thinking it over"}
    body = {"model": "tiny", "max_tokens": 4, "tools": None, "tool_choice": "none", "functions": [],
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                         echoed, {"role": "user", "content": "again"}]}
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 200, await r.text()
    served = await fake_worker.by_id(r.headers["X-QoS-Request-Id"])
    prompt = render_chat([("system", "be brief"), ("user", "hi"), ("assistant", answer["content"]),
                          ("user", "again")])
    # the thinking sent back is kept, under the client's name for it, for the model server
    # (interleaved-thinking models' templates render it); it was dropped. Not counted locally:
    # most templates drop it, and counted it refused chats that fit (the context check)
    assert served.usage_in == count_tokens(prompt)  # what the (fake) engine saw
    admitted = sync_redis.hget(POOL.request(r.headers["X-QoS-Request-Id"]), "input_tokens")
    assert int(admitted) == count_tokens(prompt)
    assert (await r.json())["choices"][0]["message"]["content"] == prompt[::-1][:4]
    kept = fake_worker.payloads[r.headers["X-QoS-Request-Id"]].messages[2]
    assert kept.reasoning == ("reasoning_content", "thinking it over")
    assert kept.to_dict()["reasoning_content"] == "thinking it over"
    echoed["reasoning_content"] = 5
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 400 and (await r.json())["error"]["param"] == "messages[2].reasoning_content"
    echoed.update(reasoning="a thought", reasoning_content=5)  # the second one is checked too
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    assert r.status == 400 and (await r.json())["error"]["param"] == "messages[2].reasoning_content"


async def test_completion_stream_sse_framing_and_usage(client, fake_worker):
    body = {"model": "tiny", "prompt": "hello stream", "stream": True,
            "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body, headers=auth())
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "hello stream"[::-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == []
    served = await fake_worker.by_id(r.headers["X-QoS-Request-Id"])
    assert chunks[-1]["usage"] == {"prompt_tokens": served.usage_in, "completion_tokens": served.usage_out,
                                   "total_tokens": served.usage_in + served.usage_out}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_a_stream_costs_one_socket_write_per_reply_entry(client, fake_worker, monkeypatch):
    """Headers go out with the first token, and the last entry's text, finish, usage and
    [DONE] with the chunked terminator: 3 reply entries, 3 sends (there were 8, and a send on
    loopback was a third of the frontend's CPU)."""
    from asyncio import selector_events

    sent: list[bytes] = []
    transport = selector_events._SelectorSocketTransport
    write, writelines = transport.write, transport.writelines

    def counted(data: bytes) -> None:
        if bytes(data).startswith(b"HTTP/1.1 200") or b"data: " in bytes(data):  # the server's side
            sent.append(bytes(data))

    monkeypatch.setattr(transport, "write", lambda self, data: (counted(data), write(self, data))[1])
    monkeypatch.setattr(transport, "writelines",
                        lambda self, parts: (counted(b"".join(parts)), writelines(self, parts))[1])
    fake_worker.batch = 4
    body = {"model": "tiny", "prompt": "hello stream", "stream": True,
            "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body, headers=auth())
    events = sse_events(await r.text())
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "hello stream"[::-1]
    assert len(sent) == 3, sent
    assert sent[0].startswith(b"HTTP/1.1 200") and b"data: " in sent[0]
    assert sent[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_chat_stream_without_usage(client, fake_worker):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "stream": True,
            "max_tokens": 5}
    r = await client.post("/v1/chat/completions", json=body, headers=auth())
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == render_chat([("user", "abc")])[::-1][:5]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_dedup_by_offset_drops_replayed_entries():
    """A resumed stream may replay entries: anything at or below what was forwarded is dropped."""
    forwarded, out = 0, []
    for o, n, t in [(0, 2, "ab"), (0, 2, "ab"), (2, 1, "c"), (1, 2, "bc"), (3, 1, "d"), (4, 0, "")]:
        text, forwarded = dedup(Reply("tok", offset=o, count=n, text=t), forwarded)
        out.append(text)
    assert "".join(out) == "abcd" and forwarded == 4


# --- identity, classes, admin ---------------------------------------------------------------------

async def test_missing_and_unknown_keys_are_401(client):
    body = {"model": "tiny", "prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic demo-p1"},
                    {"Authorization": "Bearer"}):
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status == 401
        err = (await r.json())["error"]
        assert err["type"] == "invalid_request_error"
        assert err["code"] in ("missing_api_key", "invalid_api_key")


async def test_class_ceiling(client, fake_worker, sync_redis):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = await client.post("/v1/completions", json=body, headers=auth("demo-p2", **{"X-QoS-Class": "P0"}))
    assert r.status == 403
    assert (await r.json())["error"]["code"] == "class_not_allowed"
    r = await client.post("/v1/completions", json=body, headers=auth("demo-p0", **{"X-QoS-Class": "P2"}))
    assert r.status == 200
    assert (await fake_worker.by_id(r.headers["X-QoS-Request-Id"])).cls == "P2"
    assert sync_redis.hget(POOL.stats, "P2.admitted") == b"1"
    r = await client.post("/v1/completions", json=body, headers=auth("demo-p0", **{"X-QoS-Class": "P7"}))
    assert r.status == 400 and (await r.json())["error"]["param"] == "X-QoS-Class"


async def test_models_health_ready_metrics(client, fake_worker):
    r = await client.get("/v1/models", headers=auth())
    assert (await r.json())["data"][0]["id"] == "tiny"
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/healthz")).status == 200
    r = await client.get("/readyz")
    assert r.status == 200 and (await r.json())["status"] == "ready"
    await client.post("/v1/completions", json={**ONE_TOKEN, "prompt": "xyz", "max_tokens": 3}, headers=auth())
    await client.post("/v1/completions", json=ONE_TOKEN, headers=auth("bad"))
    text = await (await client.get("/metrics")).text()
    assert 'qos_frontend_requests_total{class="P1",outcome="ok",pool="tiny",tenant="demo-p1"} 1.0' in text
    assert 'outcome="unauthorized"' in text
    for name in ("qos_frontend_admission_seconds_bucket", "qos_frontend_queue_wait_seconds_bucket",
                 "qos_frontend_ttft_seconds_bucket", "qos_frontend_tpot_seconds_bucket",
                 'qos_frontend_inflight{pool="tiny"} 0.0'):
        assert name in text


async def test_the_ttft_target_counter_judges_each_prompt_by_its_own_target(redis_server, sync_redis,
                                                                           aredis) -> None:
    """``qos_frontend_ttft_target``: each first token is judged against its own request's
    target, the class's prompt allowance included (the histogram's bucket sits at the base
    target alone). P1 here: 50 ms, plus 60 s per 1,000 prompt tokens past the first 100; the
    worker waits 0.2 s before answering, so a short prompt misses and a 600-token one meets."""
    slo = {"slo_ttft_ms": 50.0, "slo_ttft_ms_per_1k_prompt_tokens": 60_000.0,
           "slo_ttft_base_prompt_tokens": 100}
    async with frontend(make_cfg(redis_server.url, classes={"P1": slo})) as client, \
            FakeWorker(aredis, POOL, delay_s=0.2):
        for prompt in ("x", "y" * 600):  # 2 tokens: target 50 ms; 601: 50 + 30,060 ms
            r = await client.post("/v1/completions", json={**ONE_TOKEN, "prompt": prompt}, headers=auth())
            assert r.status == 200, await r.text()
        text = await (await client.get("/metrics")).text()
    assert 'qos_frontend_ttft_target_total{class="P1",met="no",pool="tiny"} 1.0' in text
    assert 'qos_frontend_ttft_target_total{class="P1",met="yes",pool="tiny"} 1.0' in text


async def test_one_pool_whose_upstream_is_down_leaves_the_frontend_ready_for_the_others(
        redis_server, sync_redis) -> None:
    """Every live worker of one pool reports its upstream unreachable: the frontend stays
    ready (its other pool serves; it was 503 for all, and a readiness probe took every
    frontend out of the balancer for one broken model server), lists the pool as degraded,
    and ``?pool=`` answers per pool. With every pool down it is not ready."""
    cfg = make_cfg(redis_server.url)
    tiny = cfg.pools[0]
    cfg = validate(dataclasses.replace(cfg, pools=(tiny, dataclasses.replace(tiny, name="big", model="big"))))

    def upstream(pool: str, state: str) -> None:
        keys = PoolKeys(pool)
        sync_redis.zadd(keys.workers, {f"w-{pool}": 4102444800000})
        sync_redis.hset(keys.worker(f"w-{pool}"), mapping={"engine": "openai", "upstream_state": state})

    async with frontend(cfg) as client:
        # both pools set up: the start may leave one to its heartbeat loop (a loaded machine
        # whose second set-up ended START_OTHERS_S after the first)
        from tests.support.helpers import wait_until

        await wait_until(lambda: fe_of(client).set_up == {"tiny", "big"}, "both pools set up")
        assert (await client.get("/readyz")).status == 200
        upstream("tiny", "open")
        upstream("big", "closed")
        r = await client.get("/readyz")
        assert r.status == 200 and (await r.json())["degraded"] == {
            "tiny": "every worker reports its upstream unreachable"}
        r = await client.get("/readyz?pool=tiny")
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["reason"] == "every worker of pool tiny reports its upstream unreachable"
        r = await client.get("/health?pool=big")
        assert r.status == 200 and "degraded" not in await r.json()
        r = await client.get("/readyz?pool=nope")
        assert r.status == 404 and (await r.json())["status"] == "unknown"
        upstream("big", "open")
        r = await client.get("/readyz")
        assert r.status == 503
        assert (await r.json())["reason"] == "every worker of pool tiny, big reports its upstream unreachable"


async def test_admin_status(client, fake_worker, sync_redis):
    await client.post("/v1/completions", json=ONE_TOKEN, headers=auth())
    sync_redis.hset(POOL.compliance, mapping={"P0": "0.995"})
    assert (await client.get("/v1/qos/status")).status == 401
    assert (await client.get("/v1/qos/status", headers=auth("demo-p0"))).status == 403
    r = await client.get("/v1/qos/status", headers=auth("demo-admin"))
    assert r.status == 200
    snap = await r.json()
    tiny = snap["pools"]["tiny"]
    assert tiny["initialised"] is True
    p0, p1 = tiny["classes"]["P0"], tiny["classes"]["P1"]
    assert p0["rate"] == 12000.0 and p0["burst"] == 6000.0 and p0["compliance"] == 0.995
    assert p1["compliance"] is None and p1["queued"] == 0 and p1["inflight"] == 0
    assert p1["counters"]["admitted"] == 1 and 0 < p1["tokens"] <= p1["burst"]
    assert "fake-w1" in tiny["workers"] and tiny["workers"]["fake-w1"]["last_seen_s"] < 5
    assert fe_of(client).frontend_id in tiny["frontends"]


async def test_reply_stream_is_one_per_process(client, fake_worker, sync_redis):
    """Many concurrent requests share one reply stream and a bounded connection pool."""
    fe = client.server.app[FRONTEND]
    bodies = [{"model": "tiny", "prompt": f"request {i}", "stream": i % 2 == 0} for i in range(40)]
    rs = await asyncio.gather(*(client.post("/v1/completions", json=b, headers=auth()) for b in bodies))
    for b, r in zip(bodies, rs, strict=True):
        text = await r.text()
        assert r.status == 200
        if b["stream"]:
            got = "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(text)[:-1])
        else:
            got = json.loads(text)["choices"][0]["text"]
        assert got == b["prompt"][::-1]
    streams = [k for k in sync_redis.keys(POOL.reply_prefix + "*")]
    assert streams == [POOL.reply(fe.frontend_id).encode()]
    pool = fe.client.connection_pool
    opened = len(pool._available_connections) + len(pool._in_use_connections)
    # (one may do: the admits of one event-loop turn go as one call)
    assert 1 <= opened <= fe.settings.redis_max_connections


# --- the official SDK over real sockets ---------------------------------------------------------

async def test_openai_sdk_async_and_sync(client, fake_worker):
    base = str(client.server.make_url("/v1"))
    sdk = openai.AsyncOpenAI(base_url=base, api_key="demo-p1", max_retries=0)
    out = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                            max_tokens=6)
    assert out.choices[0].message.content == render_chat([("user", "hi there")])[::-1][:6]
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == count_tokens(render_chat([("user", "hi there")]))
    # the SDK's own request id (OpenAI's x-request-id header) is the record's, as X-QoS-Request-Id
    raw = await sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "id?"}], max_tokens=2)
    assert raw.headers["x-request-id"] == raw.headers["X-QoS-Request-Id"] != ""
    assert raw.parse()._request_id == raw.headers["X-QoS-Request-Id"]

    stream = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}],
                                               stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    async for ch in stream:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == render_chat([("user", "yo")])[::-1]
    assert usage.completion_tokens == len("".join(parts))
    assert stream.response.headers["x-request-id"] == stream.response.headers["X-QoS-Request-Id"] != ""

    comp = await sdk.completions.create(model="tiny", prompt="abc", max_tokens=2)
    assert comp.choices[0].text == "cb" and comp.usage.prompt_tokens == 4

    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="no-such-model", prompt="abc")
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.completions.create(model="tiny", prompt="abc", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await sdk.close()

    def sync_call() -> str:
        with openai.OpenAI(base_url=base, api_key="demo-p2", max_retries=0) as s:
            return s.completions.create(model="tiny", prompt="sync", max_tokens=4).choices[0].text

    assert await asyncio.to_thread(sync_call) == "cnys"


@pytest.mark.parametrize("ttft_ms,tpot_ms", [(2_000, 150), (300, 40)])
def test_latency_histograms_have_a_bucket_at_every_class_slo(ttft_ms, tpot_ms):
    """An SLO that is not a bucket boundary cannot be read off the histogram (the share of
    requests within it is only bounded by the buckets either side): the demo's P1 TTFT
    target of 2 s fell between the 1 s and 2.5 s buckets."""
    from limiter.frontend.app import create_app
    from limiter.frontend.metrics import METRICS
    from limiter.frontend.settings import FrontendSettings
    from tests.support.frontend_helpers import make_cfg

    cfg = make_cfg("redis://127.0.0.1:1/0", classes={"P1": {"slo_ttft_ms": ttft_ms, "slo_tpot_ms": tpot_ms}})
    m = create_app(FrontendSettings(), cfg)[METRICS]
    m.ttft.labels("tiny", "P1").observe(0.1)
    m.tpot.labels("tiny", "P1").observe(0.01)
    for c in cfg.classes:
        for name, slo_ms in (("ttft", c.slo_ttft_ms), ("tpot", c.slo_tpot_ms)):
            if slo_ms is None:
                continue
            le = repr(float(slo_ms / 1000))
            got = m.registry.get_sample_value(f"qos_frontend_{name}_seconds_bucket",
                                              {"pool": "tiny", "class": "P1", "le": le})
            assert got is not None, f"no {name} bucket at class {c.name}'s SLO of {slo_ms} ms (le={le})"
