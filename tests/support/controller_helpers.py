"""Helpers for the controller tests: fast settings, synthetic samples as workers write them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from limiter.config import QosConfig
from limiter.controller.capacity import CapacityConfig
from limiter.controller.loop import PoolController
from limiter.controller.metrics import ControllerMetrics
from limiter.controller.settings import ControllerSettings
from limiter.keys import PoolKeys
from limiter.samples import build_sample, pack_sample
from limiter.scripts import Scripts

# Short everything: decisions every 0.1 s, a change at most every 0.3 s, 20 samples a verdict.
FAST = ControllerSettings(
    controller_id="a", tick_s=0.1, lease_s=1.0, renew_s=0.1, block_s=0.05, claim_idle_s=0.2,
    cooldown_s=0.3, settle_s=0.1, window=200, min_samples=20, used_window_s=0.5,
    capacity=CapacityConfig(interval_s=0.5, min_reports=1),
)


def fast_settings(cfg: QosConfig, **kw: Any) -> ControllerSettings:
    s = replace(FAST, **kw)
    s.validate(cfg)
    return s


def pool_controller(cfg: QosConfig, client: Any, **kw: Any) -> PoolController:
    s = fast_settings(cfg, **kw)
    return PoolController(cfg=cfg, pool=cfg.pool("tiny"), settings=s, client=client, scripts=Scripts(client),
                          metrics=ControllerMetrics(s.controller_id))


def sample(cls: str, ts_ms: float, *, ttft_ms: float = 100.0, tpot_ms: float = 20.0, input_tokens: int = 200,
           output_tokens: int = 100, queue_wait_ms: float = 10.0, outcome: str = "ok", **extra: Any
           ) -> dict[str, Any]:
    """A sample shaped like a worker's (worker/samples.py); ``extra`` fields go in as given."""
    s = build_sample(
        pool="tiny", cls=cls, tenant="t1", outcome=outcome, request_id="r", worker="w1",
        input_tokens=input_tokens, output_tokens=output_tokens, queue_wait_ms=queue_wait_ms,
        e2e_ms=ttft_ms + tpot_ms * output_tokens, ts_ms=int(ts_ms), engine="sim", simulated=True, attempt=1,
        ttft_ms=ttft_ms, tpot_mean_ms=tpot_ms, tpot_max_ms=2 * tpot_ms,
    )
    return s | extra


async def push(client: Any, keys: PoolKeys, samples: list[dict[str, Any]]) -> list[bytes]:
    async with client.pipeline(transaction=False) as pipe:
        for s in samples:
            pipe.xadd(keys.samples, {"d": pack_sample(s)})
        return await pipe.execute()


async def wait_for(cond: Callable[[], Awaitable[Any]], timeout: float = 10.0, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:  # a wedged Redis call must fail the test, not hang it
            value = await asyncio.wait_for(cond(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise AssertionError(f"condition still pending after {timeout} s") from None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(every)


def metric(pc_or_metrics: Any, name: str, **labels: str) -> float:
    metrics = getattr(pc_or_metrics, "metrics", pc_or_metrics)
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
