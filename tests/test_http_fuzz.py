"""Fuzzing the whole HTTP API: methods, paths, query strings, headers and bodies.

Hypothesis drives the frontend app in-process on a real loopback socket (aiohttp's
TestServer) with the suite's fake worker behind it (real scripts: claim -> push_tokens ->
complete), against a private ``redis-server``. Each case is one HTTP request built from:

* a method and a path (the API's own, unknown ones, query strings);
* ``Authorization`` (every configured key, the admin key, garbage, other schemes),
  ``X-QoS-Class``, ``X-QoS-Max-Wait-Ms``, ``Content-Type`` and arbitrary extra headers;
* a body: near-valid OpenAI requests with junk in any field (a ``/v1/responses`` body with
  junk in its items, parts, tools and settings too), arbitrary JSON documents, oversized
  prompts and bodies, raw bytes.

Properties, for every case: no 5xx; every non-2xx answer is an OpenAI-style JSON error with
a message; a 2xx generation is a complete answer; and a request that was not a successful
generation changed nothing in Redis -- no charge, no queue entry, no request record, no
counter (byte-for-byte DUMP of every key but the heartbeats). The default run makes a few
hundred cases; the slow one ``QOS_FUZZ_CASES`` (default 10,000). Headers are printable
ASCII (what an HTTP client can send); ``X-QoS-Max-Wait-Ms`` values that could legitimately
time out (under 10 s) are left to tests/test_frontend_bad_input.py.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limiter.config import DEMO_ADMIN_KEY, DEMO_KEYS
from tests.support.body_strategies import FIELDS, JSON, RESPONSES_FIELDS
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, frontend, make_cfg, tenant

GEN = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TOKENIZER = ("/tokenize", "/detokenize")  # (POSTs; the fuzz pool counts bytes: refused, by name)
PATHS = (*GEN * 5, *TOKENIZER, "/tokenizer_info", "/v1/models", "/v1/qos/status", "/healthz", "/readyz",
         "/metrics")
KEYS = (*DEMO_KEYS, DEMO_ADMIN_KEY, "fuzz-capped")
KEY_RE = re.compile(r"qos:\{tiny\}:[a-z_]+(:[A-Za-z0-9_.-]{1,64}){0,2}")
VOLATILE = (POOL.frontends, POOL.workers, POOL.served, POOL.wake)

# --- strategies ---------------------------------------------------------------------------------

ASCII = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
TOKEN = st.from_regex(r"\A[A-Za-z][A-Za-z0-9-]{0,24}\Z")
@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes | None:
    kind = draw(st.integers(0, 99))
    if kind < 5:
        return draw(st.binary(max_size=64))
    if kind < 12:
        return json.dumps(draw(JSON)).encode()
    if kind < 15:  # far over the context, or over the body limit
        size = draw(st.sampled_from([5000, 20_000, (1 << 20) + 10]))
        return json.dumps({"model": "tiny", "prompt": "x" * size}).encode()
    if kind < 16:
        return None
    if path == "/v1/responses":
        return responses_body(draw)
    core: dict[str, Any] = {"model": "tiny"}
    if path.endswith("chat/completions"):
        core["messages"] = draw(
            st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                min_size=1,
                max_size=2,
            )
        )
    else:
        core["prompt"] = draw(st.text(max_size=30))
    extra: dict[str, Any] = {"max_tokens": draw(st.integers(1, 8))} if often(draw, 70) else {}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        extra[name] = draw(FIELDS[name])  # junk in up to three fields
    body = {**core, **extra}
    try:
        return json.dumps(body).encode()
    except ValueError:  # a circular or odd float: send it as text anyway
        return repr(body).encode()


def responses_body(draw: st.DrawFn) -> bytes:
    """A /v1/responses body: its input a text or items, and junk in up to three fields."""
    if often(draw, 60):
        body: dict[str, Any] = {"model": "tiny", "input": draw(st.text(max_size=30))}
    else:
        body = {"model": "tiny", "input": draw(RESPONSES_FIELDS["input"])}
    if often(draw, 70):
        body["max_output_tokens"] = draw(st.integers(1, 8))
    if often(draw, 30):
        body["stream"] = True
    for name in draw(st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=3, unique=True)):
        body[name] = draw(RESPONSES_FIELDS[name])
    try:
        return json.dumps(body).encode()
    except ValueError:
        return repr(body).encode()


def often(draw: st.DrawFn, percent: int) -> bool:
    """A biased coin: most cases must be close to valid, or few would reach Redis at all."""
    return draw(st.integers(0, 99)) < percent


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    if often(draw, 88):
        path = draw(st.sampled_from(PATHS))
    else:
        path = "/" + draw(st.from_regex(r"\A[A-Za-z0-9._~%-][A-Za-z0-9._~%/-]{0,29}\Z|\A\Z"))
    if often(draw, 8):
        path += "?" + draw(st.from_regex(r"\A[A-Za-z0-9=&_.-]{0,20}\Z"))
    usual = "POST" if path.split("?")[0] in (*GEN, *TOKENIZER) else "GET"
    method = (
        usual
        if often(draw, 88)
        else draw(st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]))
    )
    headers: dict[str, str] = {}
    if often(draw, 80):
        headers["Authorization"] = f"Bearer {draw(st.sampled_from(KEYS))}"
    else:
        auth = draw(
            st.one_of(
                st.none(),
                ASCII.map("Bearer {}".format),
                ASCII,
                st.sampled_from(
                    [
                        "Bearer",
                        "Bearer  ",
                        "bearer demo-p1",
                        "Basic ZGVtbzpkZW1v",
                        "Bearer demo-p1 demo-p0",
                        "Bearer demo-p0\t",
                        "Token demo-p0",
                    ]
                ),
            )
        )
        if auth is not None:
            headers["Authorization"] = auth
    if often(draw, 20):
        headers["X-QoS-Class"] = draw(
            st.one_of(
                st.sampled_from(["P0", "P1", "P2", " P2 ", "p1", "", "P3", "{P0}", "P0,P1", "P1\t"]), ASCII
            )
        )
    if often(draw, 20):
        wait = draw(
            st.one_of(
                st.sampled_from(["0", "-1", "1e9", "abc", "", " 20000 ", "86400001", "99999999999999999999"]),
                st.integers(10_000, 86_400_000).map(str),
                ASCII,
            )
        )
        if not (wait.strip().isdigit() and 0 < int(wait.strip()) < 10_000):
            headers["X-QoS-Max-Wait-Ms"] = wait
    if often(draw, 25):
        headers["Content-Type"] = draw(
            st.sampled_from(
                [
                    "application/json",
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data",
                    "application/json; charset=latin-1",
                    "application/octet-stream",
                ]
            )
        )
    if often(draw, 25):
        names = st.one_of(
            TOKEN,
            st.sampled_from(
                [
                    "X-QoS-Tenant",
                    "X-QoS-Priority",
                    "X-Forwarded-For",
                    "X-Real-IP",
                    "Accept",
                    "OpenAI-Organization",
                    "X-Request-Id",
                    "Cookie",
                    "Accept-Encoding",
                ]
            ),
        )
        for name, value in draw(st.dictionaries(names, ASCII, min_size=1, max_size=3)).items():
            if name.lower() not in {
                "content-length",
                "transfer-encoding",
                "host",
                "connection",
                "expect",
                "authorization",
                "content-type",
                "x-qos-class",
                "x-qos-max-wait-ms",
            }:
                headers[name] = value
    body = draw(bodies(path.split("?")[0]))
    return {"method": method, "path": path, "headers": headers, "body": body}


# --- the check ------------------------------------------------------------------------------------


def fingerprint(sync: Any) -> tuple[dict[bytes, Any], set[bytes]]:
    """Every key's DUMP but the heartbeats and reply streams; request keys by name (their
    records expire on their own, so only a *new* one is a change)."""
    state: dict[bytes, Any] = {}
    requests: set[bytes] = set()
    keys = list(sync.scan_iter(count=1000))
    pipe = sync.pipeline(transaction=False)
    todo = []
    for key in keys:
        k = key.decode()
        if k in VOLATILE or k.startswith(POOL.reply_prefix):
            continue
        if k.startswith((POOL.request_prefix, POOL.tokens_prefix)):
            requests.add(key)
            continue
        todo.append(key)
        pipe.dump(key)
    for key, value in zip(todo, pipe.execute(), strict=True):
        state[key] = value
    return state, requests


async def check_case(client: TestClient, sync: Any, case: dict[str, Any], stats: Counter[str]) -> None:
    before, reqs_before = fingerprint(sync)
    r = await client.request(case["method"], case["path"], data=case["body"], headers=case["headers"])
    raw = await r.read()
    path = case["path"].split("?")[0]
    generation = path in GEN and case["method"] == "POST"
    stats[f"{r.status}"] += 1
    stats["cases"] += 1
    assert r.status < 500, (case, r.status, raw[:300])
    ok = 200 <= r.status < 300
    if case["method"] != "HEAD" and not ok:
        err = json.loads(raw)["error"]
        assert err["message"] and err["type"] and err["code"], (case, err)
        stats[f"code:{err['code']}"] += 1
        if r.status in (429, 503):
            assert int(r.headers["Retry-After"]) >= 1
    if ok and generation:
        stats["generated"] += 1
        streamed = r.headers["Content-Type"].startswith("text/event-stream")
        if path == "/v1/responses":
            # the typed events, the last the whole response (no [DONE]); or the response
            last = json.loads(raw.rstrip().rsplit(b"\ndata: ", 1)[1]) if streamed else None
            final = last["response"] if last is not None else json.loads(raw)
            assert last is None or last["type"] == "response.completed", (case, raw[-300:])
            assert final["object"] == "response" and final["usage"]["output_tokens"] >= 0, (case, final)
        elif streamed:
            assert raw.rstrip().endswith(b"data: [DONE]"), (case, raw[-200:])
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] >= 0
        return
    after, reqs_after = fingerprint(sync)
    assert not (reqs_after - reqs_before), (case, r.status, reqs_after - reqs_before)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, (case, r.status, raw[:200], changed)


@pytest.fixture
async def fuzz_client(redis_server: Any, sync_redis: Any, aredis: Any) -> AsyncIterator[TestClient]:
    # A tenant that may only use P2 and has a small in-flight cap: the fuzz also probes
    # class ceilings and the cap; a tiny context makes long prompts a 400.
    capped = tenant("fuzz-capped", "fuzz-capped", "P2", max_inflight=2)
    cfg = make_cfg(redis_server.url, tenants=[capped], pool={"context_tokens": 4096, "record_ttl_s": 5})
    async with frontend(cfg) as c, FakeWorker(aredis, POOL, fixed_text="fuzz ok"):
        yield c


@pytest.fixture
def fuzz_stats(request: pytest.FixtureRequest, sync_redis: Any) -> Iterator[Counter[str]]:
    """Counts the cases of one fuzz test; after the last one, reports them and checks that
    hypothesis really ran as many as asked (and that some generations went through), and
    that whatever the clients sent, every key in Redis is a well-formed key of the pool (no
    name from a request made its way into a key)."""
    stats: Counter[str] = Counter()
    yield stats
    bad = [k for k in sync_redis.scan_iter(count=1000) if not KEY_RE.fullmatch(k.decode())]
    assert not bad, bad
    n = request.function.fuzz_cases
    print(
        f"\n[http fuzz] {stats['cases']} cases, 0 x 5xx, 0 changes to Redis from rejected requests; "
        f"{stats['generated']} generations answered; by status "
        f"{dict(sorted((k, v) for k, v in stats.items() if k.isdigit()))}; errors by code "
        f"{dict(sorted((k[5:], v) for k, v in stats.items() if k.startswith('code:')))}"
    )
    assert stats["cases"] >= n and stats["generated"] > 0, stats


def fuzz_test(n: int) -> Callable[..., Coroutine[Any, Any, None]]:
    """The property test with ``n`` cases (hypothesis settings are fixed per function)."""

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )
    @given(case=cases())
    async def test(
        fuzz_client: TestClient, sync_redis: Any, fuzz_stats: Counter[str], case: dict[str, Any]
    ) -> None:
        await check_case(fuzz_client, sync_redis, case, fuzz_stats)

    test.fuzz_cases = n  # type: ignore[attr-defined]
    return test


test_http_fuzz = fuzz_test(300)
test_http_fuzz_full = pytest.mark.slow(fuzz_test(int(os.environ.get("QOS_FUZZ_CASES", "10000"))))
