from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from limiter.config import demo_config
from limiter.keys import PoolKeys
from limiter.scripts import Scripts, policy_document
from tests.support.hang_report import before_timeout
from tests.support.redis_server import RedisClusterServers, RedisServer

if shutil.which("redis-server") is None:  # pragma: no cover - CI installs it
    raise RuntimeError("redis-server is required for the test suite")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test that hangs says what it waited on (tests/support/hang_report.py)."""
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    with before_timeout(item.nodeid, timeout):
        return (yield)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers().start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def _empty_redis_for_each_test(request: pytest.FixtureRequest) -> None:
    """A test on the session's private redis-server starts from an empty one, whether or not
    it asks for ``sync_redis`` (which flushes too): a request another test left queued (its
    frontend gone before the cancel landed, or admitted for the worker tests' frontend, whose
    heartbeat never lapses) was claimed by the next test's worker on the same pool and sent to
    that test's model server (test_tool_calls read another test's request as its first body).
    Not for a module whose tests share processes on it (``shared_redis``)."""
    if "redis_server" in request.fixturenames and request.node.get_closest_marker("shared_redis") is None:
        client = request.getfixturevalue("redis_server").client()
        try:
            client.flushall()
        finally:
            client.close()


@pytest.fixture
def sync_redis(redis_server: RedisServer):
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
async def aredis(redis_server: RedisServer, sync_redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def scripts(aredis) -> Scripts:
    return Scripts(aredis)


@pytest.fixture
def cfg():
    return demo_config()


@pytest.fixture
async def pool(scripts: Scripts, cfg) -> PoolKeys:
    """The demo pool 'tiny', initialised, with a live frontend 'fe1'."""
    keys = PoolKeys("tiny")
    await scripts.init_pool(keys, policy_document(cfg, cfg.pool("tiny")))
    await scripts.client.zadd(keys.frontends, {"fe1": 4102444800000})  # alive until 2100
    return keys


@pytest.fixture
async def fake_upstream():
    """A started fake OpenAI-compatible model server (tests/support/fake_upstream.py)."""
    from tests.support.fake_upstream import FakeUpstream

    up = FakeUpstream()
    await up.start()
    yield up
    await up.runner.cleanup()


@pytest.fixture
async def worker_env(redis_server: RedisServer, sync_redis, tmp_path):
    """A config file for the worker tests and a client that admits and reads replies."""
    from tests.support.worker_helpers import Client, config

    cfg = config(tmp_path / "qos.toml", redis_server.url)
    r = aioredis.from_url(redis_server.url)
    client = Client(r, cfg)
    await client.setup()
    yield cfg, client
    await r.aclose()
