"""CORS (``[frontend] cors_origins``): a browser's preflight is answered before any key check,
and every answer to an allowed origin -- streamed, JSON, error -- carries the origin, so a
page can read it; nothing changes for a frontend that lists none."""

from __future__ import annotations

import dataclasses

import pytest

from limiter.config import demo_config
from limiter.errors import ConfigError
from limiter.frontend.settings import FrontendSettings, validate
from tests.support.frontend_helpers import auth, frontend, make_cfg

# Fixtures, asked for by name ("fake_worker"): the "as" re-exports it.
from tests.support.frontend_helpers import fake_worker_fixture as fake_worker_fixture

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
BODY = {"model": "tiny", "prompt": "abc", "max_tokens": 2}


async def test_a_listed_origin_gets_its_preflight_and_every_answer_marked(redis_server, sync_redis,
                                                                          fake_worker) -> None:
    async with frontend(make_cfg(redis_server.url), cors_origins=(PAGE,)) as client:
        r = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # no key: a browser sends none
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == PAGE and r.headers["Vary"] == "Origin"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == PREFLIGHT["Access-Control-Request-Headers"]
        assert "Access-Control-Allow-Credentials" not in r.headers  # a bearer key, not a cookie
        # the answers: streamed (headers sent before the handler returns), JSON, and an error
        r = await client.post("/v1/completions", json={**BODY, "stream": True},
                              headers={**auth(), "Origin": PAGE})
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == PAGE
        assert "X-QoS-Request-Id" in r.headers["Access-Control-Expose-Headers"]
        assert (await r.text()).endswith("data: [DONE]\n\n")
        r = await client.post("/v1/completions", json=BODY, headers={**auth(), "Origin": PAGE})
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == PAGE
        r = await client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})  # no key
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == PAGE
        assert "retry-after-ms" in r.headers["Access-Control-Expose-Headers"]
        # another origin: nothing it could read by, and its preflight is the route's 405
        other = {**PREFLIGHT, "Origin": "http://evil.example"}
        r = await client.options("/v1/chat/completions", headers=other)
        assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.post("/v1/completions", json=BODY, headers={**auth(), "Origin": other["Origin"]})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        # ...but told it depends on the Origin: a shared cache must not serve it to a listed page
        assert r.headers["Vary"] == "Origin"
        assert (await client.get("/v1/models", headers=auth())).headers["Vary"] == "Origin"
        # a header list that is not one is not echoed
        r = await client.options("/v1/completions",
                                 headers={**PREFLIGHT, "Access-Control-Request-Headers": "x-a, (y)"})
        assert r.status == 204 and "Access-Control-Allow-Headers" not in r.headers


async def test_any_origin_and_none(redis_server, sync_redis) -> None:
    async with frontend(make_cfg(redis_server.url), cors_origins=("*",)) as client:
        r = await client.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in r.headers
        r = await client.get("/v1/models", headers={**auth(), "Origin": "https://any.example"})
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
    async with frontend(make_cfg(redis_server.url)) as client:  # the default: no CORS at all
        r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.get("/v1/models", headers={**auth(), "Origin": PAGE})
        assert "Access-Control-Allow-Origin" not in r.headers


@pytest.mark.parametrize("origin", ["localhost:3000", "http://x.example/app", "ftp://x.example",
                                    "http://user@x.example", " http://x.example", "http://"])
def test_an_entry_that_is_no_origin_is_refused_naming_it(origin: str) -> None:
    settings = FrontendSettings(cors_origins=("https://ok.example", origin))
    with pytest.raises(ConfigError) as exc:
        validate(settings, demo_config())
    assert exc.value.path == "frontend.cors_origins[1]", str(exc.value)


def test_listed_origins_load() -> None:
    s = validate(FrontendSettings(cors_origins=("*", "https://chat.example:8443")), demo_config())
    assert s.cors_origins == ("*", "https://chat.example:8443")
    assert dataclasses.replace(s, cors_origins=()).cors_origins == ()
