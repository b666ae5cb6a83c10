"""The latency sample a worker appends (via ``complete``) for every request it finishes.

The schema (fields, version, packing) is limiter/samples.py's, shared with the frontend and
the controller; this module only fills it from a worker's :class:`Delivery` (outcomes ``ok``,
``cancelled``, ``failed``, ``refused``).

Token times are when the engine produced the token (end of its step), not when the batched
push reached Redis: the sample measures the GPU schedule, which is what the controller
steers; the push batching adds at most ``flush_ms`` on top for a streamed request (its
class's ``stream_flush_ms``; an unstreamed one's client reads nothing before the end).
"""

from __future__ import annotations

import time
from typing import Any

from limiter import samples as schema
from worker.delivery import Delivery


def build_sample(d: Delivery, *, pool: str, worker_id: str, engine: str, simulated: bool, outcome: str,
                 now: float | None = None, output_tokens: int | None = None) -> dict[str, Any]:
    """The sample for ``d`` finishing now (monotonic ``now``) with ``outcome``."""
    c = d.claimed
    now = time.monotonic() if now is None else now
    end_ms = d.redis_ms(now)
    if c.first_ms > 0:  # an earlier attempt delivered the first token: Redis has its time
        ttft_ms: float | None = float(c.first_ms - c.enq_ms)
    elif d.first_t is not None:
        ttft_ms = round(d.redis_ms(d.first_t) - c.enq_ms, 3)
    else:
        ttft_ms = None
    tpot: dict[str, float] = {}
    if d.first_t is not None and d.last_t is not None and d.produced >= 2:
        tpot["tpot_mean_ms"] = round((d.last_t - d.first_t) * 1e3 / (d.produced - 1), 3)
        tpot["tpot_max_ms"] = round(d.max_gap_s * 1e3, 3)
    return schema.build_sample(
        pool=pool, cls=c.cls, tenant=c.tenant, outcome=outcome, request_id=c.request_id, worker=worker_id,
        input_tokens=d.usage_in, output_tokens=d.total_tokens if output_tokens is None else output_tokens,
        queue_wait_ms=float(c.claimed_ms - c.enq_ms), e2e_ms=round(end_ms - c.enq_ms, 3), ts_ms=int(end_ms),
        engine=engine, simulated=simulated, attempt=c.attempt, ttft_ms=ttft_ms, prompt_tokens=c.input_tokens,
        **tpot, **d.sample_extra,
    )
