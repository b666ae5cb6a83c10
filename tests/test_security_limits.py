"""Limits on everything a client controls, beyond the body fields (tests/test_frontend_bad_input.py
covers body size by Content-Length, prompt tokens against the context, ``max_tokens``):

* a body sent chunked (no Content-Length) past ``max_body_bytes``: 400, nothing read further;
* a body announced and never (fully) sent: 408 ``body_timeout`` after ``body_timeout_s``;
* connections that sit idle, or never finish their request line or headers: closed after
  ``idle_timeout_s`` (a real ``qos frontend`` process: the setting goes through the CLI; a
  half-sent body is answered 408 there too, then aiohttp lingers at most 10 s before closing);
* oversized request lines and headers: a 4xx from the HTTP parser, before any handler;
* concurrent requests (and so streams) per tenant: ``max_inflight``, then 429
  ``too_many_inflight`` with Retry-After, other tenants unaffected, and the slot comes back.

Every rejected request leaves Redis byte-for-byte unchanged (heartbeats aside).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from limiter.frontend.metrics import METRICS
from limiter.frontend.runtime import FRONTEND
from limiter.scripts import Scripts
from tests.support.fake_worker import FakeWorker
from tests.support.frontend_helpers import POOL, auth, frontend, make_cfg, redis_state, tenant
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer
from tests.support.reliability_stack import KEY_P1, LiveStack, base_config

COMP = "/v1/completions"


def raw_request(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(data)
    return s


def read_all(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; and when it closed. Fails
    if it is still open after ``timeout`` s (a deadline against a hang, not a speed)."""
    s.settimeout(timeout)
    t0 = time.monotonic()
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server had not closed the connection after {timeout} s") from None
    return out, time.monotonic() - t0


def read_response(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """One HTTP response (head and Content-Length body); and how long it took to come. Fails
    after ``timeout`` s without one."""
    s.settimeout(timeout)
    t0 = time.monotonic()
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body, time.monotonic() - t0


@pytest.fixture
async def client(redis_server: RedisServer, sync_redis: Any) -> AsyncIterator[Any]:
    async with frontend(make_cfg(redis_server.url), body_timeout_s=0.5) as c:
        yield c


async def test_chunked_body_over_the_limit_is_rejected(client: Any, sync_redis: Any) -> None:
    before = redis_state(sync_redis)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB in all, no Content-Length
        yield b'"}'

    r = await client.post(COMP, data=body(), headers=auth())
    assert r.status == 400 and (await r.json())["error"]["code"] == "request_too_large"
    assert redis_state(sync_redis) == before


async def test_a_body_that_never_arrives_is_408_and_changes_nothing(client: Any, sync_redis: Any) -> None:
    before = redis_state(sync_redis)
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer demo-p1\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    s = await asyncio.to_thread(raw_request, client.port, head + b'{"model": "ti')
    try:
        out, took = await asyncio.to_thread(read_response, s, 30.0)
    finally:
        s.close()
    status, _, rest = out.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", out[:200]
    err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    # body_timeout (not request_timeout, nor the client's patience) says which timer fired;
    # never before its 0.5 s, however fast the machine.
    assert err["code"] == "body_timeout" and err["message"]
    assert took >= 0.45
    assert redis_state(sync_redis) == before


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_that_does_not_decompress_is_400_and_changes_nothing(
    client: Any, sync_redis: Any, encoding: str
) -> None:
    """aiohttp raises a bare Exception for it (RequestPayloadError): it was a 500 and a logged
    traceback for every such request."""
    before = redis_state(sync_redis)
    raw = (f"POST {COMP} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer demo-p1\r\n"
           f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\nContent-Length: 10\r\n\r\n"
           "0123456789").encode()
    s = await asyncio.to_thread(raw_request, client.port, raw)
    try:
        out, _ = await asyncio.to_thread(read_response, s, 30.0)
    finally:
        s.close()
    status, _, rest = out.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 400"), out[:300]
    err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_body", err
    # what went wrong in words of ours, not the parser's exception text
    assert err["message"].endswith("its Content-Encoding does not decode"), err
    assert redis_state(sync_redis) == before


async def test_a_request_over_what_a_queued_request_may_hold_is_refused_naming_its_field(
    redis_server: RedisServer, sync_redis: Any
) -> None:
    """A chat request carries its text twice when queued (rendered, and as messages), so a body
    well inside max_body_bytes can exceed the 8 MiB admit takes: the answer named 'payload', a
    field the client never sent."""
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 10_000_000})
    async with frontend(cfg, max_body_bytes=16 << 20) as c:
        before = redis_state(sync_redis)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 4_500_000}], "max_tokens": 1}
        r = await c.post("/v1/chat/completions", data=json.dumps(body),
                         headers={**auth(), "Content-Type": "application/json"})
        err = (await r.json())["error"]
        assert r.status == 400 and (err["param"], err["code"]) == ("messages", "request_too_large"), err
        assert "8 MiB" in err["message"]
        assert redis_state(sync_redis) == before


@contextlib.asynccontextmanager
async def _client_that_stops_reading(port: int, request: dict[str, Any]
                                     ) -> AsyncIterator[asyncio.StreamReader]:
    """POST ``request`` on a socket with a small receive buffer, read the status line (200),
    then nothing more, the connection kept open: yields its reader, for what came after."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    try:
        body = json.dumps(request).encode()
        head = (f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer demo-p1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        yield reader
    finally:
        writer.close()


async def _bytes_left(reader: asyncio.StreamReader) -> int:
    """What still comes on a connection until it ends (at most 10 s of reading)."""
    got = 0
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        async with asyncio.timeout(10):
            while chunk := await reader.read(1 << 16):
                got += len(chunk)
    return got


async def test_a_stream_whose_client_stopped_reading_is_dropped_at_the_request_timeout(
    redis_server: RedisServer, sync_redis: Any, aredis: Any
) -> None:
    """The request timeout bounds writes too. A client that stops reading but keeps its socket
    open held the handler, its reply queue and the whole output in the frontend for as long
    as it liked: once the worker finished, its tenant's max_inflight no longer counted it."""
    n = 6_000_000  # far more than the loopback socket buffers hold
    # Long enough for the worker to finish first, even on a loaded machine (loaded pass 24 of
    # the eleventh stop: at 1 s the handler was dropped while the worker was still pushing).
    timeout_s = 8.0
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 10_000_000})
    async with frontend(cfg, request_timeout_s=timeout_s) as c, \
            FakeWorker(aredis, POOL, fixed_text="y" * n, batch=1_000_000) as w:
        async with _client_that_stops_reading(c.port, {"model": "tiny", "prompt": "x", "max_tokens": n,
                                                       "stream": True}) as reader:
            deadline = time.monotonic() + timeout_s + 2.0 + 10.0  # timeout + write grace + slack
            await wait_until(lambda: w.served, "the worker to finish the whole answer", timeout=timeout_s)
            assert w.served[0].outcome == "ok", w.served  # all of it now waits in the frontend
            router = c.server.app[FRONTEND].router
            while router._queues:
                assert time.monotonic() < deadline, "the stream's handler outlived request_timeout_s"
                await asyncio.sleep(0.1)
            # dropped, not closed: a close waits to flush what is buffered for a client that
            # reads nothing, and held the connection and that buffer as long as it kept still
            await wait_until(lambda: not c.server.runner.server.connections,
                             "the frontend to drop the connection of a client that reads nothing")
            # The connection was dropped with the answer unsent, not closed after all of it
            # (6 MB of text; the socket buffers hold a small part): a clean end after the
            # whole answer passed here once, a reset being one of the errors taken.
            got = await _bytes_left(reader)
            assert got < n, f"the whole answer ({got} bytes) was sent after the request timeout"


async def test_a_non_stream_answer_whose_client_stopped_reading_is_dropped_at_the_request_timeout(
    redis_server: RedisServer, sync_redis: Any, aredis: Any
) -> None:
    """The write bound holds for a non-stream answer too. aiohttp wrote the handler's returned
    JSON itself, with no bound: a client that asked for a large answer and read none of it
    held its connection, the handler and the whole answer in the frontend for as long as it
    kept the socket open (its request done in Redis, its tenant's max_inflight free again)."""
    n = 6_000_000  # far more than the loopback socket buffers hold
    timeout_s = 8.0  # long enough for the worker to finish first on a loaded machine
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 10_000_000})
    async with frontend(cfg, request_timeout_s=timeout_s) as c, \
            FakeWorker(aredis, POOL, fixed_text="y" * n, batch=1_000_000) as w:
        async with _client_that_stops_reading(c.port, {"model": "tiny", "prompt": "x",
                                                       "max_tokens": n}) as reader:
            await wait_until(lambda: w.served, "the worker to finish the whole answer", timeout=timeout_s)
            assert w.served[0].outcome == "ok", w.served
            # timeout + write grace + slack for a loaded machine
            await wait_until(lambda: not c.server.runner.server.connections,
                             "the frontend to drop the connection of a client that reads nothing",
                             timeout=timeout_s + 2.0 + 10.0)
            got = await _bytes_left(reader)
            assert got < n, f"the whole answer ({got} bytes) was sent after the request timeout"


async def test_a_stream_that_times_out_while_its_client_stopped_reading_is_dropped_not_held(
    redis_server: RedisServer, sync_redis: Any, aredis: Any
) -> None:
    """A stream that reaches ``request_timeout_s`` while waiting for its worker, its client
    reading nothing, must be dropped too. The in-band error went out as a plain write (small:
    no drain) and the handler returned; aiohttp's own ``write_eof`` then waited, unbounded,
    for a client that never read: the connection, the handler and what was buffered for it
    stayed for as long as the client kept its socket open."""
    timeout_s = 3.0
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 1_000_000})
    scripts = Scripts(aredis)
    async with frontend(cfg, request_timeout_s=timeout_s) as c:
        # Small kernel buffers on both ends (an accepted socket inherits the listener's): the
        # three 40 KB batches below fill them and the frontend's write buffer past its
        # high-water mark, the third without a drain (aiohttp drains past 64 KiB written).
        for site in c.server.runner.sites:
            for lsock in site._server.sockets:  # type: ignore[attr-defined]
                lsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", c.port))
        try:
            body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 500_000,
                               "stream": True}).encode()
            head = (f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer demo-p1\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
            sock.sendall(head.encode() + body)
            claimed: list[Any] = []

            async def claim() -> bool:
                claimed.extend((await scripts.claim(POOL, "w-stall", 1)).requests)
                return bool(claimed)

            end = time.monotonic() + 15
            while not await claim():
                assert time.monotonic() < end, "the request was never queued"
                await asyncio.sleep(0.02)
            (cl,) = claimed
            queues = c.server.app[FRONTEND].router._queues
            text = "y" * 40_000
            for i in range(3):  # ... and the worker goes quiet: the request times out waiting
                await scripts.push_tokens(POOL, request_id=cl.request_id, worker_id="w-stall", fence=cl.fence,
                                          offset=i * len(text), token_ids=[121] * len(text), text=text)
                await wait_until(lambda: cl.request_id in queues and queues[cl.request_id].empty(),
                                 f"the frontend to take batch {i}")
            await wait_until(lambda: cl.request_id not in queues, "the request to time out",
                             timeout=timeout_s + 10.0)
            # timeout + write grace + slack for a loaded machine
            await wait_until(lambda: not c.server.runner.server.connections,
                             "the frontend to drop the connection of a client that reads nothing",
                             timeout=2.0 + 10.0)
            # and its worker was told to stop
            await wait_until(lambda: sync_redis.sismember(POOL.cancels, cl.request_id),
                             "the running request to be cancelled")
        finally:
            sock.close()


PIPELINED = {
    "healthz": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    # a CORS preflight (no key needed either), answered by its own middleware: it wrote its 204
    # outside the bound until a review found it
    "cors-preflight": b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://a.example\r\n"
                      b"Access-Control-Request-Method: POST\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", list(PIPELINED.values()), ids=list(PIPELINED))
async def test_a_client_that_pipelines_requests_and_reads_no_answer_is_dropped(
    redis_server: RedisServer, sync_redis: Any, request_bytes: bytes
) -> None:
    """aiohttp writes an answer a handler returns with no bound: a client that pipelined
    requests on one connection (``GET /healthz``: no key needed) and read none of the
    answers held that connection and its handler for as long as it kept the socket open,
    past ``idle_timeout_s`` and every other timeout. Now an answer not read within
    ``idle_timeout_s`` drops the connection."""
    async with frontend(make_cfg(redis_server.url), idle_timeout_s=1.0, cors_origins=("*",)) as c:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", c.port))
        sock.setblocking(False)
        try:
            # far more answers than the socket buffers hold
            data = request_bytes * 20_000
            sent, end = 0, time.monotonic() + 15
            while sent < len(data) and time.monotonic() < end:
                try:
                    sent += sock.send(data[sent:])
                except BlockingIOError:
                    await asyncio.sleep(0.05)  # the frontend stopped reading: its answers wait
            await wait_until(lambda: c.server.runner.server.connections,
                             "the frontend to take the connection")
            await wait_until(lambda: not c.server.runner.server.connections,
                             "the frontend to drop a connection whose client reads no answer",
                             timeout=1.0 + 15.0)
        finally:
            sock.close()


async def test_oversized_request_line_and_headers_are_refused_by_the_parser(
    client: Any, sync_redis: Any
) -> None:
    before = redis_state(sync_redis)
    r = await client.post(COMP + "?" + "a" * 20_000, json={"model": "tiny", "prompt": "x"}, headers=auth())
    assert 400 <= r.status < 500
    r = await client.post(
        COMP, json={"model": "tiny", "prompt": "x"}, headers=auth(**{"X-Big": "b" * 20_000})
    )
    assert 400 <= r.status < 500
    many = {f"X-H{i}": "v" for i in range(300)}
    r = await client.post(COMP, json={"model": "tiny", "prompt": "x"}, headers=auth(**many))
    assert 400 <= r.status < 500
    assert redis_state(sync_redis) == before


async def test_idle_and_half_sent_connections_are_closed(tmp_path: Path) -> None:
    """A real frontend process with ``idle_timeout_s`` 1 and ``body_timeout_s`` 1."""
    server = RedisServer().start()
    r = aioredis.from_url(server.url)
    stack = LiveStack(
        tmp_path, base_config(server.url, frontend={"idle_timeout_s": 1.0, "body_timeout_s": 1.0})
    )
    socks: dict[str, socket.socket] = {}
    try:
        stack.frontend("fe0")
        await stack.wait_ready(r)
        port = stack.procs["fe0"].port
        for name, data in {
            "silent": b"",
            "half request line": b"POST /v1/compl",
            "half headers": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n",
            "idle keep-alive": b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n",
        }.items():
            socks[name] = raw_request(port, data)
        results = await asyncio.gather(*(asyncio.to_thread(read_all, s, 60.0) for s in socks.values()))
        closed = {name: round(took, 1) for name, (_, took) in zip(socks, results, strict=True)}
        print(f"\n[idle connections] closed after (s): {closed}")
        # read_all fails unless the server closed each one; not before its 1 s idle timeout.
        assert all(t >= 0.9 for t in closed.values()), closed
        # A half-sent body gets its 408 after body_timeout_s (as in-process above); aiohttp
        # then lingers up to 10 s reading what is left before it closes.
        s = raw_request(
            port,
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
            + KEY_P1.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"mo',
        )
        socks["half body"] = s
        out, took = await asyncio.to_thread(read_response, s, 30.0)
        assert out.startswith(b"HTTP/1.1 408") and b"body_timeout" in out and took >= 0.9, (out[:100], took)
    finally:
        for s in socks.values():
            s.close()
        stack.stop()
        await r.aclose()
        server.stop()


async def test_streams_per_tenant_are_capped(redis_server: RedisServer, sync_redis: Any, aredis: Any) -> None:
    cfg = make_cfg(redis_server.url, tenants=[tenant("capped", "capped-key", max_inflight=2)])
    body = {"model": "tiny", "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 20, "stream": True}
    async with frontend(cfg) as c, FakeWorker(aredis, POOL, delay_s=0.3, batch=2):
        first = [asyncio.create_task(c.post(COMP, json=body, headers=auth("capped-key"))) for _ in range(2)]
        while int(sync_redis.hget(POOL.tenant_inflight, "capped") or 0) < 2:
            await asyncio.sleep(0.01)
        admitted = sync_redis.hget(POOL.stats, "P1.admitted")
        bucket = sync_redis.hgetall(POOL.tenant_bucket("capped"))
        third = await c.post(COMP, json=body, headers=auth("capped-key"))
        assert third.status == 429 and third.headers["Retry-After"] == "1"
        assert (await third.json())["error"]["code"] == "too_many_inflight"
        # nothing admitted, nothing charged for the refused one
        assert sync_redis.hget(POOL.stats, "P1.admitted") == admitted
        assert sync_redis.hgetall(POOL.tenant_bucket("capped")) == bucket
        assert int(sync_redis.hget(POOL.tenant_inflight, "capped")) == 2
        other = await c.post(COMP, json={**body, "stream": False, "max_tokens": 2}, headers=auth("demo-p1"))
        assert other.status == 200  # another tenant is not affected
        for t in first:
            resp = await t
            assert resp.status == 200 and (await resp.read()).rstrip().endswith(b"data: [DONE]")
        assert sync_redis.hget(POOL.tenant_inflight, "capped") is None  # the slots came back
        again = await c.post(
            COMP, json={**body, "stream": False, "max_tokens": 2}, headers=auth("capped-key")
        )
        assert again.status == 200


async def test_concurrent_readiness_probes_share_one_check_of_redis(redis_server: RedisServer,
                                                                     sync_redis: Any) -> None:
    """``/readyz`` and ``/health`` need no key (guidellm probes ``/health`` on the client-facing
    port) and each check asks Redis one HMGET per worker of every pool, on the connections the
    requests and the heartbeat use: N probes at once cost N checks, so anyone could multiply
    the shared Redis's load by the fleet's size. Probes that arrive while a check is under way
    now share its answer."""
    workers = 200
    for i in range(workers):  # live openai workers of the pool, their upstream reachable
        sync_redis.zadd(POOL.workers, {f"w{i}": 4102444800000})
        sync_redis.hset(POOL.worker(f"w{i}"), mapping={"engine": "openai", "upstream_state": "closed"})

    def hmgets() -> int:
        return int(sync_redis.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))

    probes = 100
    async with frontend(make_cfg(redis_server.url)) as c:
        assert (await c.get("/readyz")).status == 200
        before = hmgets()
        answers = await asyncio.gather(*(c.get("/health" if i % 2 else "/readyz") for i in range(probes)))
        assert [a.status for a in answers] == [200] * probes
        checks = (hmgets() - before) / workers
        # one check per probe before; a few shared ones now (a bound, not a speed: more overlap
        # on a slower machine only lowers it)
        assert checks <= probes / 4, f"{probes} concurrent probes ran {checks:g} checks of every worker"
        # a probe after them asks Redis afresh: a worker whose upstream went down is seen at once
        for i in range(workers):
            sync_redis.hset(POOL.worker(f"w{i}"), "upstream_state", "open")
        r = await c.get("/readyz")
        assert r.status == 503 and (await r.json())["reason"].startswith("every worker of pool tiny")


async def test_a_stream_of_several_answers_whose_client_stopped_reading_is_dropped_at_the_request_timeout(
    redis_server: RedisServer, sync_redis: Any, aredis: Any
) -> None:
    """The same bound on a stream of several answers (limiter/frontend/choices.py writes them
    under the first answer's deadline): the handler, every answer's reply queue and what the
    worker sent go once the request timeout and the write grace passed."""
    n = 3_000_000  # each; far more than the loopback socket buffers hold
    timeout_s = 8.0
    # (a capacity that starts the second answer within its max wait, the first queued ahead)
    cfg = make_cfg(redis_server.url, pool={"context_tokens": 10_000_000, "capacity_tokens_s": 1e8})
    async with frontend(cfg, request_timeout_s=timeout_s) as c, \
            FakeWorker(aredis, POOL, fixed_text="y" * n, batch=1_000_000) as w:
        async with _client_that_stops_reading(c.port, {"model": "tiny", "prompt": "x", "max_tokens": n,
                                                       "n": 2, "stream": True}) as reader:
            deadline = time.monotonic() + timeout_s + 2.0 + 10.0  # timeout + write grace + slack
            await wait_until(lambda: len(w.served) == 2, "the worker to finish both answers",
                             timeout=timeout_s)
            metrics = c.server.app[METRICS]

            def finished() -> float:  # the handlers that returned (the answers' queues go before)
                return sum(s.value for m in metrics.requests.collect() for s in m.samples
                           if s.name.endswith("_total"))

            while not finished():
                assert time.monotonic() < deadline, "the stream's handler outlived request_timeout_s"
                await asyncio.sleep(0.1)
            assert not c.server.app[FRONTEND].router._queues
            await wait_until(lambda: not c.server.runner.server.connections,
                             "the frontend to drop the connection of a client that reads nothing")
            got = await _bytes_left(reader)
            assert got < 2 * n, f"both answers ({got} bytes) were sent after the request timeout"
