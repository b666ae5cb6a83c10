"""Real ``qos frontend`` processes on one private Redis: a tenant's quota is shared exactly
across processes, SIGTERM drains in-flight streams then cancels the rest, and the CLI
refuses to publish the demo keys."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import aiohttp
import pytest
import redis.asyncio as aioredis

from limiter import cli
from limiter.config import demo_config, hash_key, load
from limiter.errors import ConfigError
from limiter.frontend.settings import load_settings
from limiter.localstack import launcher
from limiter.localstack.toml_writer import toml_dumps
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL
from tests.support.helpers import three_classes
from tests.support.redis_server import RedisServer, free_port

# Its frontend processes (a module's fixture) keep their state on the session's redis-server.
pytestmark = pytest.mark.shared_redis

# Cost of this request: "ab" = 3 tokens (2 bytes + BOS) + 7 reserved = 10; the fixed-text
# worker uses all 7, so nothing is refunded and a 100-token burst admits exactly 10.
SLOW = {"model": "tiny", "prompt": "ab", "max_tokens": 7}


def _config(url: str, shared: str, solo: str, user: str) -> str:
    """Tenants "shared" and "solo" (0.5 tokens/s, a 200 s burst) and "user" (no limit)."""
    limited = {"rate_tokens_s": 0.5, "burst_s": 200.0}
    return toml_dumps({
        "redis": {"url": url},
        "classes": three_classes(P0={"admission_wait_ms": 0}, P1={"admission_wait_ms": 0}),
        "pools": [{"name": "tiny", "context_tokens": 4096}],
        "tenants": [{"name": "shared", "key_sha256": [hash_key(shared)], **limited},
                    {"name": "solo", "key_sha256": [hash_key(solo)], **limited},
                    {"name": "user", "key_sha256": [hash_key(user)]}],
        "frontend": {"shutdown_grace_s": 1.5, "heartbeat_s": 0.5},  # last: a test appends to it
    })


def _start(config: Path, port: int) -> Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    # SIGKILL when the test process dies, even if pytest is killed (Linux)
    argv = launcher.module_argv("frontend", config, "--port", str(port), "--log-level", "WARNING")
    return launcher.spawn(argv, env, death_signal=signal.SIGKILL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)


async def _ready(port: int, proc: Popen[bytes], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            if not await launcher.answers_ok(s, f"http://127.0.0.1:{port}/readyz", 5.0):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"frontend on {port} never became ready")


@pytest.fixture(scope="module")
def two_frontends(redis_server: RedisServer, tmp_path_factory) -> Iterator[list[tuple[int, Popen]]]:
    redis_server.client().flushall()
    path = tmp_path_factory.mktemp("fe") / "qos.toml"
    path.write_text(_config(redis_server.url, "key-shared", "key-solo", "key-user"))
    procs: list[tuple[int, Popen[bytes]]] = []

    async def all_ready() -> None:
        await asyncio.gather(*(_ready(p, proc) for p, proc in procs))

    try:
        for _ in range(2):
            port = free_port()
            procs.append((port, _start(path, port)))
        asyncio.run(all_ready())
        yield procs
    finally:  # also when startup fails: never leave a frontend running
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
async def redis_client(redis_server):  # no flush: the module's frontends keep their state
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def _burst(urls: list[str], key: str, n: int) -> list[int]:
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> int:
            async with s.post(urls[i % len(urls)] + "/v1/completions", json=SLOW,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                return r.status
        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_quota_is_shared_exactly_across_processes(two_frontends, redis_client):
    urls = [f"http://127.0.0.1:{port}" for port, _ in two_frontends]
    async with FakeWorker(redis_client, POOL, fixed_text="z" * 7):
        split = await _burst(urls, "key-shared", 20)  # alternating between the two processes
        single = await _burst(urls[:1], "key-solo", 20)  # the same burst on one process
    assert sorted(split) == [200] * 10 + [429] * 10
    assert sorted(single) == sorted(split)


async def test_sigterm_drains_then_cancels(two_frontends, redis_client):
    """Run last in this module: it stops both processes."""
    (port_a, proc_a), (port_b, proc_b) = two_frontends
    headers = {"Authorization": "Bearer key-user"}
    async with FakeWorker(redis_client, POOL, fixed_text="q" * 60, batch=1, delay_s=0.05) as w, \
            aiohttp.ClientSession() as s:
        short = await s.post(f"http://127.0.0.1:{port_a}/v1/completions", headers=headers,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True})
        long = await s.post(f"http://127.0.0.1:{port_b}/v1/completions", headers=headers,
                            json={"model": "tiny", "prompt": "x", "max_tokens": 60, "stream": True})
        assert short.status == 200 and long.status == 200
        await short.content.readline()
        await long.content.readline()
        t0 = time.monotonic()
        proc_a.send_signal(signal.SIGTERM)
        proc_b.send_signal(signal.SIGTERM)
        # A's stream (0.15 s of tokens: 10x inside the 1.5 s grace, also on a loaded machine)
        # finishes: complete, with [DONE].
        rest = (await short.content.read()).decode()
        assert rest.rstrip().endswith("data: [DONE]")
        # B's stream (3 s of tokens) is ended at the grace period with an in-band error
        # (a clean end of the HTTP response, no [DONE]) and cancelled in Redis.
        tail = (await long.content.read()).decode()
        assert "[DONE]" not in tail
        assert '"code":"shutting_down"' in tail.strip().splitlines()[-1]
        rid_b = long.headers["X-QoS-Request-Id"]
        end = time.monotonic() + 30  # bounds a hang: the loop waits for the worker's cancel
        while not any(x.request_id == rid_b for x in w.served) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        assert (await w.by_id(rid_b)).outcome == "cancelled"
        assert (await w.by_id(rid_b)).usage_out < 60
    for proc in (proc_a, proc_b):
        assert proc.wait(timeout=30) == 0
    print(f"\n[SIGTERM] both frontends gone {time.monotonic() - t0:.1f} s after it (grace 1.5 s)")
    assert await redis_client.zcard(POOL.frontends) == 0  # both left cleanly
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s:
            await s.get(f"http://127.0.0.1:{port_a}/healthz")


# --- startup checks -----------------------------------------------------------------------------

def test_demo_keys_refused_on_public_address(capsys):
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert cli.main(["frontend", "--host", host, "--port", "0"]) == 2
        assert "--allow-demo-keys-public" in capsys.readouterr().err
    # Loopback is fine, and so is an explicit opt-in (checked without starting a server).
    cfg = demo_config()
    assert load_settings(cfg, {"host": "127.0.0.1"}).host == "127.0.0.1"
    assert load_settings(cfg, {"host": "::1"}).host == "::1"
    assert load_settings(cfg, {"host": "0.0.0.0", "allow_demo_keys_public": True}).allow_demo_keys_public


def test_own_keys_may_listen_publicly_and_bad_settings_name_the_field(tmp_path):
    path = tmp_path / "qos.toml"
    own = _config("redis://127.0.0.1:1/0", "a", "b", "c")
    path.write_text(own)
    assert load_settings(load(path, {}), {"host": "0.0.0.0"}).host == "0.0.0.0"
    path.write_text(own + 'port = "eighty"\n')
    with pytest.raises(ConfigError, match=r"frontend\.port"):
        load_settings(load(path, {}))
    path.write_text(own.replace("heartbeat_s = 0.5", "heartbeat_s = 60.0"))
    with pytest.raises(ConfigError, match=r"frontend\.heartbeat_s"):
        load_settings(load(path, {}))


async def test_each_process_can_serve_its_own_metrics_apart_from_a_shared_api_port(redis_server, sync_redis):
    """Processes sharing the API port (--reuse-port, `qos up --frontends N`) answer its
    /metrics in turn: a counter read there jumped between processes, 3 8 8 3 3... (found by a
    review of what operators see). With metrics_port each serves its own, always the same."""
    from tests.support.frontend_helpers import auth, frontend, make_cfg

    cfg = make_cfg(redis_server.url)
    ports = [free_port(), free_port()]
    r = aioredis.from_url(redis_server.url)
    try:
        async with FakeWorker(r, POOL, fixed_text="hi"), frontend(cfg, metrics_port=ports[0]) as a, \
                frontend(cfg, metrics_port=ports[1]), aiohttp.ClientSession() as s:
            for _ in range(3):
                resp = await a.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                                    headers=auth())
                assert resp.status == 200
            counts = []
            for port in ports:
                async with s.get(f"http://127.0.0.1:{port}/metrics") as m:
                    text = await m.text()
                counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                  if line.startswith("qos_frontend_requests_total{")))
                async with s.get(f"http://127.0.0.1:{port}/healthz") as h:
                    assert (await h.json())["status"] == "ok"
            assert counts == [3, 0]
    finally:
        await r.aclose()


async def test_metrics_can_be_kept_off_a_client_facing_api_port(redis_server, sync_redis):
    """The frontend's series name tenants, and /metrics needs no key: on an API port that
    faces clients, any client read every tenant's name and traffic. With api_metrics false
    the API port has no /metrics (404, as any unknown path); metrics_port still serves it."""
    from tests.support.frontend_helpers import auth, frontend, make_cfg

    cfg = make_cfg(redis_server.url)
    port = free_port()
    r = aioredis.from_url(redis_server.url)
    try:
        async with FakeWorker(r, POOL, fixed_text="hi"), \
                frontend(cfg, metrics_port=port, api_metrics=False) as api, aiohttp.ClientSession() as s:
            resp = await api.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                                  headers=auth())
            assert resp.status == 200
            assert (await api.get("/metrics")).status == 404
            async with s.get(f"http://127.0.0.1:{port}/metrics") as m:
                assert m.status == 200 and 'tenant="' in await m.text()
    finally:
        await r.aclose()


def test_api_metrics_off_without_a_metrics_port_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"frontend\.api_metrics: false needs a metrics_port"):
        load_settings(demo_config(), {"api_metrics": False})
    assert not load_settings(demo_config(), {"api_metrics": False, "metrics_port": 9100}).api_metrics


def test_a_metrics_port_on_the_api_port_or_out_of_range_is_refused_by_name():
    cfg = demo_config()
    for bad in (-1, 65536, 8000):
        with pytest.raises(ConfigError, match=r"frontend\.metrics_port"):
            load_settings(cfg, {"port": 8000, "metrics_port": bad})
    assert load_settings(cfg, {"metrics_port": 9100}).metrics_port == 9100


def test_a_taken_metrics_port_fails_the_start_before_anything_is_written_to_redis():
    """The metrics port was bound after the frontend's start: the process had loaded its
    scripts, rewritten every pool's policy, written its heartbeat and logged "ready" before
    it exited 2 naming frontend.metrics_port, leaving its entry in the pool's frontends
    (`qos status` listed a frontend that never served). The port first, as the worker and
    the controller do."""
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    with RedisServer() as server, holder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        proc = subprocess.run([sys.executable, "-m", "limiter.cli", "frontend", "--port", "0", "--redis-url",
                               server.url, "--metrics-port", str(holder.getsockname()[1])],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2 and "frontend.metrics_port" in proc.stderr, proc.stderr[-1500:]
        assert " ready " not in proc.stderr, proc.stderr[-1500:]
        r = server.client()
        assert r.zrange("qos:{tiny}:frontends", 0, -1) == [] and r.keys("qos:*") == []


def test_a_bad_qos_frontend_port_stops_the_frontend_alone(monkeypatch, capsys):
    """QOS_FRONTEND_PORT was read as the parser was built, for every subcommand: a value that
    is not a number made `qos worker`, `qos status`, `qos config check` ... exit 2 with the
    frontend's error (one env file for every service, as compose's `env_file`). Only the
    frontend reads it, and it names it."""
    monkeypatch.setenv("QOS_FRONTEND_PORT", "80a")
    assert cli.main(["config", "example"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(["frontend", "--redis-url", "redis://127.0.0.1:1/0"])
    assert exc.value.code == 2 and "QOS_FRONTEND_PORT" in capsys.readouterr().err
