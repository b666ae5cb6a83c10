"""The latency sample a worker appends (via ``complete``) for every request it finishes.

The controller's SLO monitor (:mod:`limiter.controller.slo_window`) consumes these from ``qos:{pool}:samples``
(field ``d``, msgpack map). Fields, all times in ms:

==================  ===========================================================================
``v``               1 (schema version)
``pool``            pool name
``class``           priority class (P0, P1, ...)
``tenant``          tenant name
``outcome``         ``ok`` | ``cancelled`` | ``failed``
``request_id``      request id
``worker``          worker id
``engine``          ``torch`` | ``sim`` | ``openai``; ``simulated`` true for the sim engine
``queue_wait_ms``   ``claimed_ms - enq_ms``: first claim minus admission, both Redis clock
``ttft_ms``         admission -> first token. If an earlier attempt already delivered one, it
                    is ``first_ms - enq_ms`` (Redis clock); otherwise ``(claim time of this
                    attempt - enq_ms)`` + local time from that claim to the engine emitting the
                    first token. Absent when no token was produced.
``tpot_mean_ms``    mean time per output token after the first, this attempt's tokens:
                    ``(last - first) / (n - 1)``; absent when fewer than 2 tokens
``tpot_max_ms``     the largest inter-token gap of this attempt (the seed's stall shows here)
``e2e_ms``          admission -> completion
``input_tokens``    prompt tokens (pool tokenizer units: UTF-8 bytes + BOS; openai: the upstream's)
``output_tokens``   tokens delivered in total, all attempts
``attempt``         this attempt's number (1 unless resumed after a worker died)
``ts_ms``           completion time (Redis clock, estimated from the claim reply)
``upstream_*``      openai engine only: the upstream's own ``prompt_tokens`` and
                    ``completion_tokens`` from its final usage chunk (its tokenizer's units)
==================  ===========================================================================

Token times are when the engine produced the token (end of its step), not when the batched
push reached Redis: the sample measures the GPU schedule, which is what the controller
steers; the push batching adds at most ``flush_ms`` on top and is the same for every class.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from worker.delivery import Delivery

SAMPLE_VERSION = 1


def build_sample(d: Delivery, *, pool: str, worker_id: str, engine: str, simulated: bool, outcome: str,
                 now: float | None = None, output_tokens: int | None = None) -> dict[str, Any]:
    """The sample for ``d`` finishing now (monotonic ``now``) with ``outcome``."""
    c = d.claimed
    now = time.monotonic() if now is None else now
    end_ms = d.redis_ms(now)
    s: dict[str, Any] = {
        "v": SAMPLE_VERSION, "pool": pool, "class": c.cls, "tenant": c.tenant, "outcome": outcome,
        "request_id": c.request_id, "worker": worker_id, "engine": engine, "simulated": simulated,
        "attempt": c.attempt, "queue_wait_ms": float(c.claimed_ms - c.enq_ms),
        "e2e_ms": round(end_ms - c.enq_ms, 3), "input_tokens": d.usage_in,
        "output_tokens": d.total_tokens if output_tokens is None else output_tokens,
        "ts_ms": int(end_ms),
    }
    if c.first_ms > 0:
        s["ttft_ms"] = float(c.first_ms - c.enq_ms)
    elif d.first_t is not None:
        s["ttft_ms"] = round(d.redis_ms(d.first_t) - c.enq_ms, 3)
    if d.first_t is not None and d.last_t is not None and d.produced >= 2:
        s["tpot_mean_ms"] = round((d.last_t - d.first_t) * 1e3 / (d.produced - 1), 3)
        s["tpot_max_ms"] = round(d.max_gap_s * 1e3, 3)
    s.update({k: v for k, v in d.sample_extra.items() if v is not None})
    return s


def pack_sample(sample: dict[str, Any]) -> bytes:
    return msgpack.packb(sample, use_bin_type=True)
