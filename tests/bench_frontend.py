"""Frontend overhead, measured: ``python tests/bench_frontend.py [requests]``.

Starts a private redis-server, a ``qos frontend`` process (demo config), a process running
the test suite's fake worker (the real scripts: claim -> complete, one token), and times
one-token requests from this process: sequential (latency) and 2000 concurrent (throughput).
Not collected by pytest (no ``test_`` prefix); docs/frontend.md quotes its output.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from limiter.localstack.launcher import answers_ok, spawn, stop_process  # noqa: E402
from tests.support.redis_server import RedisServer, free_port  # noqa: E402

WORKER = """
import asyncio, sys
sys.path.insert(0, sys.argv[2])
import redis.asyncio as aioredis
from limiter.keys import PoolKeys
from tests.support.fake_worker import FakeWorker

async def main():
    async with FakeWorker(aioredis.from_url(sys.argv[1]), PoolKeys("tiny"), fixed_text="k"):
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def bench(n: int) -> None:
    server = RedisServer().start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
    env["QOS_REDIS_URL"] = server.url
    procs = [
        spawn([sys.executable, "-m", "limiter.cli", "frontend", "--port", str(port), "--log-level", "ERROR"],
              env, cwd=ROOT),
        spawn([sys.executable, "-c", WORKER, server.url, str(ROOT)], env, cwd=ROOT),
    ]
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer demo-p0"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(400):
                if not await answers_ok(s, url + "/readyz"):
                    break
                await asyncio.sleep(0.05)

            async def one(stream: bool = False) -> float:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/completions", json={**body, "stream": stream},
                                  headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                return time.perf_counter() - t0

            for _ in range(50):  # warm-up
                await one()
            for stream in (False, True):
                lat = sorted([await one(stream) for _ in range(n)])
                q = {p: lat[min(int(p * n), n - 1)] * 1000 for p in (0.5, 0.9, 0.99)}
                print(f"sequential, stream={stream!s:5}: p50 {q[0.5]:.2f} ms  p90 {q[0.9]:.2f} ms  "
                      f"p99 {q[0.99]:.2f} ms  ({n} requests)")
            many = 2000
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(many)))
            print(f"concurrent: {many / (time.perf_counter() - t0):.0f} requests/s ({many} at once)")
    finally:
        for p in procs:
            stop_process(p)
        server.stop()


if __name__ == "__main__":
    asyncio.run(bench(int(sys.argv[1]) if len(sys.argv) > 1 else 500))
