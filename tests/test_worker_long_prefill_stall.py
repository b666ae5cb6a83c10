"""The original problem through the full worker (Redis, claim, batching, streaming, samples),
with the sim engine at full scale: a 32K-token P2 prompt (~2 s of prefill on the modelled
GPU) arrives while a short P0 request is decoding (~11 ms per token).

Without chunked prefill (``--no-chunked-prefill``, the original "before") the P0 request's
next token waits for the whole prefill: its worst inter-token gap is ~2 s. With chunked
prefill (512-token budget per step) the prompt runs in 64 slices interleaved with P0's
decode steps, and P0's worst gap is one loaded step (~45 ms).

What is asserted does not depend on how fast this machine is: how many P0 tokens the reply
stream carries between the P2 request's admission and its first token (one per slice when
chunked, the prefill's single step when not), and the gaps relative to each other (a busy
box stretches every gap; a 173 ms chunked gap under load failed the absolute 150 ms bound).
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

from limiter.frontend.replies import replies_of
from tests.support.redis_server import RedisServer
from tests.support.worker_helpers import FE, Client, config, worker

LONG = 32768  # prompt tokens (UTF-8 bytes + BOS)


async def p0_tokens_during_prefill(c: Client, short: str, long: str, after: bytes) -> int:
    """P0 tokens the reply stream carried after entry ``after`` (its last entry once the P2
    request was admitted) and before the P2 request's first token: stream order, not time."""
    count = 0
    for _eid, f in await c.client.xrange(c.keys.reply(FE), f"({after.decode()}", "+"):
        for rid, r in replies_of(f):
            if rid == long and r.count:
                return count
            if rid == short:
                count += r.count
    raise AssertionError(f"{long}: no first token on the reply stream")


async def scenario(cfg, c: Client, chunked: bool) -> tuple[dict, dict, float, int]:
    async with worker(cfg, engine="sim", time_scale=1.0, token_budget=512, chunked_prefill=chunked):
        short = await c.admit("Hi! Quick question?", cls="P0", max_tokens=100)
        await c.wait_tokens(short, 5)
        long = await c.admit("x" * (LONG - 1), cls="P2", max_tokens=2)
        # the stream's last entry now: P0 tokens after it came while the P2 prompt was queued or
        # prefilling (those appended between the admit and this read are not counted: fewer)
        last = await c.client.xrevrange(c.keys.reply(FE), count=1)
        await c.wait([short, long], timeout=30)
    during = await p0_tokens_during_prefill(c, short, long, last[0][0] if last else b"0-0")
    samples = {s["request_id"]: s for s in await c.samples()}
    a = c.answers[short]
    stream_gap = max(b - x for x, b in zip(a.times_ms, a.times_ms[1:], strict=False))
    return samples[short], samples[long], stream_gap, during


async def test_chunked_prefill_bounds_the_p0_gap_through_the_worker(
        redis_server: RedisServer, sync_redis, tmp_path: Path) -> None:
    cfg = config(tmp_path / "qos.toml", redis_server.url)
    r = aioredis.from_url(redis_server.url)
    try:
        c = Client(r, cfg)
        await c.setup()
        short_on, long_on, gap_on, during_on = await scenario(cfg, c, chunked=True)
        short_off, long_off, gap_off, during_off = await scenario(cfg, c, chunked=False)
    finally:
        await r.aclose()
    lines = [f"  {name}: P0 max gap {s['tpot_max_ms']:.0f} ms (mean {s['tpot_mean_ms']:.0f} ms), reply-stream"
             f" max gap {gap} ms; P2 TTFT {lg['ttft_ms']:.0f} ms; P0 tokens during the prefill {n}"
             for name, s, lg, gap, n in (("chunked  ", short_on, long_on, gap_on, during_on),
                                         ("unchunked", short_off, long_off, gap_off, during_off))]
    print("\n[long-prefill stall via the worker, sim engine, time_scale 1] 32K-token P2 prompt"
          " vs a decoding P0:\n" + "\n".join(lines))
    # Chunked: P0 decodes beside each of the prompt's 64 slices (more slices if the adaptive
    # budget, measuring a slow box, cuts them smaller). Unchunked: the prefill is one step, so
    # P0 gets its token of that step plus those of the steps before the claim.
    assert during_on >= 32, during_on
    assert short_off["tpot_max_ms"] > 1500  # the whole ~2 s prefill (a busy box only adds)
    assert gap_off > 1500  # what the client sees
    # the worst gap is one step, not the prefill: a busy box lengthens both, not this ratio
    assert short_on["tpot_max_ms"] * 4 < short_off["tpot_max_ms"]
    assert gap_on * 4 < gap_off
    assert long_on["output_tokens"] == long_off["output_tokens"] == 2
