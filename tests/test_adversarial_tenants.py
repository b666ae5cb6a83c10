"""An adversarial tenant against the shares: what one tenant can take from the others through
the documented API alone (docs/scheduling.md).

* A request that reserves a whole context (``max_tokens`` up to the room left) and stops
  after a token (a stop string, an end-of-sequence, or its client cancelling) was counted in
  the served ledger at its reservation: claim charges the reservation and nothing settled it.
  The ledger decides the starvation floors (and the served rates admission subtracts from the
  spare capacity), so a few such requests a half-life lifted their class above its floor
  while its other tenants were served nothing. The ledger is now settled to what each request
  used when it ends (lua/include/served.lua ``served_settle``; the floor it protects:
  tests/test_claim.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from limiter.config import hash_key
from limiter.keys import PoolKeys
from tests.support.helpers import charge_of
from tests.support.redis_server import RedisServer
from tests.support.reliability_stack import KEY_P0, LiveStack, base_config

LONG = {"max_wait_ms": 600_000}


async def _wait_for(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0) -> Any:
    """Await ``check`` until it answers something true; fail naming ``what`` after ``timeout``
    s (a bound on a hang, not a speed)."""
    end = time.monotonic() + timeout
    while not (value := await check()):
        assert time.monotonic() < end, f"still waiting after {timeout} s for: {what}"
        await asyncio.sleep(0.01)
    return value


async def _served(client: Any, keys: PoolKeys) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in (await client.hgetall(keys.served)).items()}


# --- the same through a real stack ---------------------------------------------------------------


async def _first_token_then_leave(base: str, key: str, body: dict[str, Any]) -> str:
    """Stream ``body``, read up to the first token's chunk, then drop the connection (a
    client that reserved a context and wanted one token). Returns the request's record id."""
    async with aiohttp.ClientSession() as s, s.post(
        f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        assert r.status == 200, await r.text()
        rid = r.headers["X-QoS-Request-Id"]
        async with asyncio.timeout(60):
            async for line in r.content:
                if line.startswith(b"data: {"):
                    break  # the first token's chunk
    return rid


async def test_through_a_stack_a_client_that_leaves_after_a_token_is_served_what_it_used(
    tmp_path: Path,
) -> None:
    """A real frontend and sim worker: a P1 client streams a request of 4,000 reserved tokens
    and goes away at its first token; its worker stops it. The class's served ledger is then
    what it used (its prompt and the tokens made before the cancel reached the worker), not
    the 4,000 it reserved. (Fails without served_settle: the ledger holds the reservation.)"""
    server = RedisServer().start()
    client = aioredis.from_url(server.url)
    config = base_config(server.url, classes={c: LONG for c in ("P0", "P1", "P2")})
    config["tenants"].append({"name": "greedy", "key_sha256": [hash_key("greedy-key")], "default_class": "P1",
                              "max_class": "P1", "rate_tokens_s": 1e9, "burst_s": 1.0})
    stack = LiveStack(tmp_path, config)
    keys = PoolKeys("tiny")
    try:
        stack.frontend("fe0")
        stack.worker("w0", time_scale=1.0)
        await stack.wait_ready(client)
        body = {"model": "tiny", "prompt": "one token, please", "max_tokens": 4000, "stream": True}
        rid = await _first_token_then_leave(stack.base("fe0"), "greedy-key", body)

        async def ended() -> dict[str, str] | None:
            raw = await client.hgetall(keys.request_prefix + rid)
            rec = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
            return rec if rec.get("state") in ("cancelled", "done") else None

        rec = await _wait_for(ended, "the abandoned request to end (its worker stopped it)", timeout=60)
        used = charge_of(rec)
        assert int(rec["out_tokens"]) < 4000 and used < float(rec["cost"]) / 4, rec
        # its reservation is settled to what it used (the refund its buckets and counter get
        # back, each at most what it was charged), and its in-flight slot is back
        assert float(rec["cost"]) - float(rec["refund"]) == pytest.approx(used), rec
        assert await client.hget(keys.tenant_inflight, "greedy") is None
        served = await _served(client, keys)
        # one claim wrote the ledger (at the claim's time: no decay since); a P0 probe below
        # is not needed, the figure is read as stored
        assert served["P1"] == pytest.approx(used, rel=1e-6), (served, rec)
        # and the pool still answers a P0 request (nothing else was disturbed)
        async with aiohttp.ClientSession() as s, s.post(
            f"{stack.base('fe0')}/v1/completions", headers={"Authorization": f"Bearer {KEY_P0}"},
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        ) as r:
            assert r.status == 200
    finally:
        stack.stop()
        with contextlib.suppress(Exception):
            await client.aclose()
        server.stop()
