"""The original problem through the full worker (Redis, claim, batching, streaming, samples),
with the sim engine at full scale: a 32K-token P2 prompt (~2 s of prefill on the modelled
GPU) arrives while a short P0 request is decoding (~11 ms per token).

Without chunked prefill (``--no-chunked-prefill``, the original "before") the P0 request's
next token waits for the whole prefill: its worst inter-token gap is ~2 s. With chunked
prefill (512-token budget per step) the prompt runs in 64 slices interleaved with P0's
decode steps, and P0's worst gap is one loaded step (~45 ms).
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

from tests.support.redis_server import RedisServer
from tests.support.worker_helpers import Client, config, worker

LONG = 32768  # prompt tokens (UTF-8 bytes + BOS)


async def scenario(cfg, c: Client, chunked: bool) -> tuple[dict, dict, float]:
    async with worker(cfg, engine="sim", time_scale=1.0, token_budget=512, chunked_prefill=chunked):
        short = await c.admit("Hi! Quick question?", cls="P0", max_tokens=100)
        await c.wait_tokens(short, 5)
        long = await c.admit("x" * (LONG - 1), cls="P2", max_tokens=2)
        await c.wait([short, long], timeout=30)
    samples = {s["request_id"]: s for s in await c.samples()}
    a = c.answers[short]
    stream_gap = max(b - x for x, b in zip(a.times_ms, a.times_ms[1:], strict=False))
    return samples[short], samples[long], stream_gap


async def test_chunked_prefill_bounds_the_p0_gap_through_the_worker(
        redis_server: RedisServer, sync_redis, tmp_path: Path) -> None:
    cfg = config(tmp_path / "qos.toml", redis_server.url)
    r = aioredis.from_url(redis_server.url)
    try:
        c = Client(r, cfg)
        await c.setup()
        short_on, long_on, gap_on = await scenario(cfg, c, chunked=True)
        short_off, long_off, gap_off = await scenario(cfg, c, chunked=False)
    finally:
        await r.aclose()
    lines = [f"  {name}: P0 max gap {s['tpot_max_ms']:.0f} ms (mean {s['tpot_mean_ms']:.0f} ms), reply-stream"
             f" max gap {gap} ms; P2 TTFT {lg['ttft_ms']:.0f} ms"
             for name, s, lg, gap in (("chunked  ", short_on, long_on, gap_on),
                                      ("unchunked", short_off, long_off, gap_off))]
    print("\n[long-prefill stall via the worker, sim engine, time_scale 1] 32K-token P2 prompt"
          " vs a decoding P0:\n" + "\n".join(lines))
    assert short_on["tpot_max_ms"] < 150  # one loaded step (~45 ms), with room for a busy box
    assert short_off["tpot_max_ms"] > 1500  # the whole ~2 s prefill
    assert gap_on < 250 and gap_off > 1500  # what the client sees (pushes batch up to ~50 ms)
    assert long_on["output_tokens"] == long_off["output_tokens"] == 2
