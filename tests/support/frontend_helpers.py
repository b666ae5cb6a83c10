"""Shared pieces of the frontend tests: configs, an in-process frontend, Redis snapshots."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from limiter.config import QosConfig, RedisConfig, TenantConfig, demo_config, hash_key, validate
from limiter.frontend.app import create_app
from limiter.frontend.runtime import FRONTEND, Frontend
from limiter.frontend.settings import FrontendSettings
from limiter.keys import PoolKeys
from limiter.localstack.sse import sse_chunks
from tests.support.fake_worker import FakeWorker

POOL = PoolKeys("tiny")


def auth(key: str = "demo-p1", **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


async def post_captured(http: TestClient, path: str, raw: bytes, headers: dict[str, str], what: str,
                        streamed: bool, key: str = "demo-p1") -> tuple[list[Any], dict[str, Any] | None]:
    """A client's captured request sent as it was, with its tenant's key: (its SSE chunks,
    None) when ``streamed``, ([], its JSON) when not; a 200 (and, streamed, an event stream)
    asserted, ``what`` (the client) named when not."""
    r = await http.post(path, data=raw, headers={**headers, "Authorization": f"Bearer {key}"})
    assert r.status == 200, (what, await r.text())
    if not streamed:
        return [], await r.json()
    assert r.headers["Content-Type"].startswith("text/event-stream"), what
    return [c async for c in sse_chunks(r.content)], None


def make_cfg(redis_url: str, *, classes: dict[str, dict[str, Any]] | None = None,
             tenants: list[TenantConfig] | None = None, pool: dict[str, Any] | None = None) -> QosConfig:
    """The demo config on a private Redis, with class/pool overrides and extra tenants."""
    cfg = demo_config()
    cls = tuple(dataclasses.replace(c, **(classes or {}).get(c.name, {})) for c in cfg.classes)
    pools = tuple(dataclasses.replace(p, **(pool or {})) for p in cfg.pools)
    return validate(dataclasses.replace(cfg, redis=RedisConfig(url=redis_url), classes=cls, pools=pools,
                                        tenants=cfg.tenants + tuple(tenants or ())))


def tenant(name: str, key: str, cls: str = "P1", *, max_class: str | None = None, rate: float = 1e9,
           burst_s: float = 1.0, max_inflight: int = 0) -> TenantConfig:
    return TenantConfig(name=name, key_sha256=(hash_key(key),), default_class=cls, max_class=max_class or cls,
                        rate_tokens_s=rate, burst_s=burst_s, max_inflight=max_inflight)


@contextlib.asynccontextmanager
async def frontend(cfg: QosConfig, **settings: Any) -> AsyncIterator[TestClient]:
    """The app on a real loopback socket (TestServer), with handler cancellation on."""
    app = create_app(FrontendSettings(**settings), cfg)
    # A short shutdown grace: a failed test must not leave teardown waiting on open handlers.
    async with TestClient(TestServer(app, shutdown_timeout=1.0)) as client:
        yield client


# Fixtures of the in-process frontend tests (a test module imports the *_fixture functions;
# tests ask for them by the name= given here, which no import then shadows).
@pytest.fixture(name="client")
async def client_fixture(redis_server: Any, sync_redis: Any) -> AsyncIterator[TestClient]:
    """The demo config's frontend on the test's private Redis (flushed first by sync_redis)."""
    async with frontend(make_cfg(redis_server.url)) as c:
        yield c


@pytest.fixture(name="fake_worker")
async def fake_worker_fixture(aredis: Any) -> AsyncIterator[FakeWorker]:
    """The in-test worker (tests/support/fake_worker.py) serving the demo pool."""
    async with FakeWorker(aredis, POOL) as w:
        yield w


def fe_of(client: TestClient) -> Frontend:
    return client.server.app[FRONTEND]


# Keys that change on their own (heartbeats, idle worker loops, trimmed reply streams) are
# left out: everything else must be byte-identical after a rejected request.
_VOLATILE = (POOL.frontends, POOL.workers, POOL.served, POOL.wake)


def redis_state(sync_client: Any) -> dict[bytes, tuple[bytes, bool]]:
    out = {}
    for key in sorted(sync_client.keys("*")):
        k = key.decode()
        if k in _VOLATILE or k.startswith(POOL.reply_prefix):
            continue
        out[key] = (sync_client.dump(key), sync_client.pttl(key) > 0)
    return out


def bucket_tokens(sync_client: Any, key: str) -> float | None:
    v = sync_client.hget(key, "tokens")
    return None if v is None else float(v)

