"""Identity and isolation: nobody gets in where they don't belong.

* A key cannot raise its class above its ceiling by any path a client controls: the
  ``X-QoS-Class`` header (any spelling, repeated), body fields, query strings, other headers,
  several ``Authorization`` headers. What counts is the class written in Redis, read back
  from the request's record.
* A tenant cannot read another tenant's results or status: there is no endpoint that
  returns a result by id; under concurrency every client gets exactly its own answer; the
  admin status needs an admin key and holds no request ids or prompt text; a tenant cannot
  cancel another tenant's request (the script checks the owner).
* Request ids are unguessable: 122 random bits (uuid4), no sequence, never reused.
* Names cannot inject Redis keys or hash tags: pools, tenants, classes, workers,
  controllers are validated at config load, on the command line and in every script.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from limiter.config import ConfigError, demo_config, hash_key, parse
from limiter.errors import InvalidArgument, InvalidName
from limiter.keys import PoolKeys
from limiter.scripts import Scripts
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state, tenant
from tests.support.helpers import admit
from tests.support.reliability_stack import ROOT, toml_dumps

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
LOW = "low-key"  # tenant 'low': default class P2, ceiling P1


@pytest.fixture
async def client(redis_server: Any, sync_redis: Any, aredis: Any) -> AsyncIterator[Any]:
    cfg = make_cfg(redis_server.url, tenants=[tenant("low", LOW, "P2", max_class="P1")])
    async with frontend(cfg) as c, FakeWorker(aredis, POOL):  # answers the prompt reversed
        yield c


def record(sync: Any, request_id: str) -> dict[str, str]:
    raw = sync.hgetall(POOL.request(request_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"payload"}


# --- class ceilings ---------------------------------------------------------------------------

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
# (headers, body extras, query): every way a client might try to ask for P0
ATTEMPTS: list[tuple[list[tuple[str, str]], dict[str, Any], str]] = [
    ([("X-QoS-Class", "P0")], {}, ""),
    ([("X-QoS-Class", " P0 ")], {}, ""),
    ([("X-QoS-Class", "p0")], {}, ""),
    ([("X-QoS-Class", "P0,P1")], {}, ""),
    ([("X-QoS-Class", "P0"), ("X-QoS-Class", "P2")], {}, ""),
    ([("X-QoS-Class", "P2"), ("X-QoS-Class", "P0")], {}, ""),
    ([("x-qos-class", "P0")], {}, ""),
    ([], {"priority": 0}, ""),
    ([], {"qos_class": "P0"}, ""),
    ([], {"class": "P0"}, ""),
    ([], {"metadata": {"class": "P0"}}, ""),
    ([], {"service_tier": "priority"}, ""),
    ([], {"user": "P0"}, ""),
    ([], {"user": "demo-p0"}, ""),
    ([], {}, "?class=P0&priority=0&tenant=demo-p0"),
    (
        [
            ("X-QoS-Tenant", "demo-p0"),
            ("X-QoS-Priority", "0"),
            ("X-Forwarded-User", "demo-p0"),
            ("OpenAI-Organization", "demo-p0"),
        ],
        {},
        "",
    ),
]


@pytest.mark.parametrize(
    "headers,extra,query",
    ATTEMPTS,
    ids=[
        f"{i}-{(h[0][0] + '=' + h[0][1]) if h else next(iter(e), q)}" for i, (h, e, q) in enumerate(ATTEMPTS)
    ],
)
async def test_a_key_cannot_go_above_its_ceiling(
    client: Any, sync_redis: Any, headers: list[tuple[str, str]], extra: dict[str, Any], query: str
) -> None:
    before = redis_state(sync_redis)
    r = await client.post(
        COMP + query, json={**BODY, **extra}, headers=[("Authorization", f"Bearer {LOW}"), *headers]
    )
    if r.status == 200:
        rec = record(sync_redis, r.headers["X-QoS-Request-Id"])
        assert rec["tenant"] == "low" and rec["class"] in ("P1", "P2"), rec
    else:
        assert r.status in (400, 403), r.status
        err = (await r.json())["error"]
        assert err["code"] in ("class_not_allowed", "invalid_class", "unknown_parameter",
                               "unsupported_value", "duplicate_header"), err
        assert redis_state(sync_redis) == before


async def test_two_authorization_headers_are_refused_and_garbled_ones_fail(
    client: Any, sync_redis: Any
) -> None:
    """The first of two Authorization headers decided: a gateway that adds its own key rather
    than replacing the client's ran the request as the client's choice of key (a review)."""
    before = redis_state(sync_redis)
    for pair in ((LOW, "demo-p0"), ("demo-p0", LOW), (LOW, LOW)):
        r = await client.post(COMP, json=BODY, headers=[("Authorization", f"Bearer {k}") for k in pair])
        err = (await r.json())["error"]
        assert r.status == 400 and (err["code"], err["param"]) == ("duplicate_header", "Authorization"), err
        assert "demo-p0" not in err["message"] and LOW not in err["message"]
    twice = [("Authorization", f"Bearer {LOW}"), ("X-QoS-Max-Wait-Ms", "5"), ("X-QoS-Max-Wait-Ms", "9000")]
    r = await client.post(COMP, json=BODY, headers=twice)
    assert r.status == 400 and (await r.json())["error"]["code"] == "duplicate_header"
    assert redis_state(sync_redis) == before
    for value in (
        f"Bearer {LOW} demo-p0",
        f"Bearer {LOW},demo-p0",
        f"Bearer  {LOW}x",
        f"Basic {LOW}",
        "Bearer " + "demo-p0".upper(),
    ):
        r = await client.post(COMP, json=BODY, headers={"Authorization": value})
        assert r.status == 401, value


async def test_admin_status_needs_an_admin_key(client: Any) -> None:
    for key in ("demo-p0", "demo-p1", LOW):
        r = await client.get("/v1/qos/status", headers=auth(key))
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_required"
    assert (await client.get("/v1/qos/status")).status == 401


# --- isolation --------------------------------------------------------------------------------


async def test_each_client_gets_exactly_its_own_answer(client: Any) -> None:
    """100 concurrent requests of three tenants, streamed and not, share one frontend and its
    one reply stream: each answer is its own prompt reversed (the fake worker's output)."""
    keys = itertools.cycle(["demo-p0", "demo-p1", "demo-p2", LOW])

    async def one(i: int) -> tuple[str, str]:
        prompt = f"secret-{i}-{uuid.uuid4().hex[:8]}"
        key = next(keys)
        if i % 2:
            r = await client.post(
                COMP, json={"model": "tiny", "prompt": prompt, "max_tokens": 200}, headers=auth(key)
            )
            return prompt, (await r.json())["choices"][0]["text"]
        r = await client.post(
            COMP,
            json={"model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True},
            headers=auth(key),
        )
        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text += ch.get("text") or ""
        return prompt, text

    results = await asyncio.gather(*(one(i) for i in range(100)))
    for prompt, text in results:
        # completions: the worker sees the prompt as sent (plus the BOS it counts), reversed
        assert text == prompt[::-1], (prompt, text)


async def test_no_endpoint_returns_a_result_by_id(client: Any, sync_redis: Any) -> None:
    r = await client.post(
        COMP, json={"model": "tiny", "prompt": "private words", "max_tokens": 20}, headers=auth("demo-p1")
    )
    rid = r.headers["X-QoS-Request-Id"]
    resp_id = (await r.json())["id"]
    for key in ("demo-p2", "demo-p1", "demo-admin"):  # not even the owner: results are not stored for reading
        for method, path in (
            ("GET", f"{COMP}/{rid}"),
            ("GET", f"{COMP}/{resp_id}"),
            ("GET", f"/v1/requests/{rid}"),
            ("GET", f"/v1/qos/requests/{rid}"),
            ("DELETE", f"{COMP}/{rid}"),
            ("GET", f"/v1/responses/{resp_id}"),
            ("POST", f"{CHAT}/{rid}"),
        ):
            r = await client.request(method, path, headers=auth(key))
            assert r.status in (404, 405), (method, path, r.status)
    status = await client.get(f"/v1/qos/status?request_id={rid}", headers=auth("demo-admin"))
    text = await status.text()
    assert status.status == 200
    assert rid not in text and "private words" not in text and "sdrow etavirp" not in text
    assert not re.search(r"\br[0-9a-f]{32}\b", text)  # no request ids at all


async def test_a_tenant_cannot_cancel_another_tenants_request(scripts: Scripts, pool: PoolKeys) -> None:
    await admit(scripts, pool, tenant="alice", request_id="alice-1")
    assert await scripts.cancel(pool, "alice-1", "mallory") == "not_found"
    assert await scripts.client.hget(pool.request("alice-1"), "state") == b"queued"
    assert await scripts.cancel(pool, "alice-1", "alice") == "cancelled"


async def test_request_ids_are_unguessable(client: Any) -> None:
    ids = []
    for i in range(200):
        r = await client.post(
            COMP, json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 1}, headers=auth("demo-p1")
        )
        ids.append(r.headers["X-QoS-Request-Id"])
        assert (await r.json())["id"] == "cmpl-" + ids[-1]
    assert len(set(ids)) == len(ids)
    for rid in ids:
        assert re.fullmatch(r"r[0-9a-f]{32}", rid), rid
        assert uuid.UUID(rid[1:]).version == 4  # 122 bits from os.urandom
    # no shared prefix between consecutive ids beyond chance (a counter or clock would share one)
    shared = [len(_common_prefix(a, b)) - 1 for a, b in itertools.pairwise(ids)]
    assert max(shared) <= 4 and sum(shared) / len(shared) < 0.5, shared
    # every hex digit position varies (bar uuid4's version nibble)
    varying = [len({rid[1 + p] for rid in ids}) for p in range(32)]
    assert sum(v == 1 for v in varying) == 1, varying


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# --- names --------------------------------------------------------------------------------------

EVIL = ["a{b}", "{a}", "a}", "a:b", "a*", "a?", "a[b]", "a b", "a\nb", "", "a" * 65, "ä", "a/b", "a\x00"]


@pytest.mark.parametrize("evil", EVIL, ids=[repr(e)[:12] for e in EVIL])
def test_names_are_validated_in_config_keys_and_scripts(evil: str) -> None:
    base = demo_config()
    doc = {
        "classes": [{"name": c.name, "share": c.share} for c in base.classes],
        "pools": [{"name": "tiny"}],
        "tenants": [{"name": "t", "key_sha256": [hash_key("k")], "default_class": "P1", "max_class": "P1"}],
    }
    for where, mutate in (
        ("pools[0].name", lambda d: d["pools"][0].update(name=evil)),
        ("tenants[0].name", lambda d: d["tenants"][0].update(name=evil)),
        ("classes[0].name", lambda d: d["classes"][0].update(name=evil)),
    ):
        d = json.loads(json.dumps(doc))
        mutate(d)
        with pytest.raises(ConfigError) as exc:
            parse(d)
        assert where in str(exc.value) or "classes" in str(exc.value), (where, exc.value)
    with pytest.raises(InvalidName):
        PoolKeys(evil)
    methods = ("request", "tokens", "backlog", "vtime", "class_bucket", "tenant_bucket", "reply", "worker")
    for method in methods:
        with pytest.raises(InvalidName):
            getattr(PoolKeys("tiny"), method)(evil)
    for cls, tenant_name in ((evil, "t"), ("P1", evil)):
        with pytest.raises(InvalidName):
            PoolKeys("tiny").queue(cls, tenant_name)


@pytest.mark.parametrize("field", ["request_id", "tenant", "cls", "frontend_id"])
async def test_scripts_refuse_injected_names_and_change_nothing(
    scripts: Scripts, pool: PoolKeys, sync_redis: Any, field: str
) -> None:
    before = redis_state(sync_redis)
    for evil in ("x}:{other", "{other}", "x:y", "x*"):
        kw = {"request_id": "r1", "tenant": "t1", "cls": "P1", "frontend_id": "fe1", field: evil}
        with pytest.raises((InvalidArgument, InvalidName)):
            await scripts.admit(
                pool,
                input_tokens=1,
                max_tokens=1,
                tenant_rate=1e9,
                tenant_burst=1e9,
                tenant_max_inflight=0,
                max_wait_ms=0,
                payload=b"",
                **kw,
            )
    assert redis_state(sync_redis) == before


@pytest.mark.parametrize(
    "role,flag", [("worker", "--worker-id"), ("controller", "--id"), ("worker", "--pool")]
)
def test_role_ids_from_the_command_line_are_validated(tmp_path: Path, role: str, flag: str) -> None:
    cfg = tmp_path / "qos.toml"
    base = demo_config()
    cfg.write_text(
        toml_dumps(
            {
                "redis": {"url": "redis://127.0.0.1:1/0"},
                "classes": [{"name": c.name, "share": c.share} for c in base.classes],
                "pools": [{"name": "tiny"}],
            }
        )
    )
    extra = ["--engine", "sim"] if role == "worker" else []
    p = subprocess.run(
        [sys.executable, "-m", "limiter.cli", role, "--config", str(cfg), *extra, flag, "w{evil}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert "config error" in p.stderr
