"""What the tick reads besides the samples, and what it reports after deciding.

Kept apart from the loop so the tick reads as "measure, decide, write": Redis time, worker
heartbeats in; the ``compliance`` hash and the Prometheus gauges out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from limiter.config import MAX_CAPACITY_TOKENS_S
from limiter.controller.capacity import CapacityConfig, CapacityEstimate
from limiter.controller.control_law import Decision, Inputs
from limiter.controller.metrics import ControllerMetrics
from limiter.controller.settings import ControllerSettings
from limiter.controller.slo_window import WindowStats
from limiter.controller.term import Term, parse_float
from limiter.errors import InvalidName
from limiter.keys import PoolKeys
from limiter.scripts import Scripts


def live_workers(term: Term, workers: list[tuple[bytes, float]], now_ms: float,
                 ttl_ms: float) -> dict[str, float]:
    """The workers of the ``workers`` ZSET that beat within ``ttl_ms``: id -> when it last did.

    A worker stamps its beat with its own estimate of Redis's clock (its wall clock plus an
    offset from its last claim): one whose clock stepped ahead beats in the future, and killed
    then it stayed live until Redis's clock caught up with its last stamp (an hour for an
    hour's step), its capacity in every rate. A beat is taken as no later than when this term
    first saw its stamp, so a silent worker leaves ``ttl_ms`` after its last beat."""
    beats: dict[str, tuple[float, float]] = {}
    for m, s in workers:
        w, stamp = (m.decode() if isinstance(m, bytes) else str(m)), float(s)
        known = term.beats.get(w)
        beats[w] = known if known is not None and known[0] == stamp else (stamp, now_ms)
    term.beats = beats  # (the ZSET's members only: bounded)
    return {w: min(stamp, seen) for w, (stamp, seen) in beats.items() if now_ms - min(stamp, seen) <= ttl_ms}


async def read_heartbeats(client: Any, keys: PoolKeys, term: Term, live: dict[str, float],
                          now_ms: float, cap: CapacityConfig) -> None:
    """Feed the reported capacity (``cap.worker_field``) of the ``live`` workers
    (:func:`live_workers`) to the term's estimator.

    Only a heartbeat newer than the one last used is read (the EWMA must not count one report
    twice); a worker that left the ZSET (clean shutdown) or went silent leaves the sum now."""
    for gone in [w for w in term.workers if w not in live]:
        del term.workers[gone]  # the estimator forgets it in set_alive below
    todo, alive = [], {}
    for w, seen in live.items():
        try:
            if term.workers.get(w) != seen:
                todo.append((w, seen, keys.worker(w)))
        except InvalidName:  # not a worker this system wrote
            continue
        alive[w] = seen
    term.estimator.set_alive(alive)  # unmeasured live workers count at the measured mean
    if not todo:
        return
    async with client.pipeline(transaction=False) as pipe:
        for _, _, key in todo:
            pipe.hget(key, cap.worker_field)
        values = await pipe.execute()
    for (w, seen, _), raw in zip(todo, values, strict=True):
        value = parse_float(raw)
        if value is not None and 0 < value <= MAX_CAPACITY_TOKENS_S:  # else garbage: not a report
            term.estimator.observe_worker(w, value, now_ms)
            term.workers[w] = seen


async def publish(scripts: Scripts, keys: PoolKeys, settings: ControllerSettings, now_ms: float,
                  window: Mapping[str, WindowStats], estimate: CapacityEstimate) -> None:
    """``qos:{pool}:compliance`` for status/top: compliance per class (absent = no target or
    no samples) and the capacity estimate in dotted fields (keys.PoolKeys.compliance); it
    expires unless the next tick rewrites it. One script call: the hash and its expiry
    together (a plain pipeline's HSET could land without the PEXPIRE after it, and a dead
    controller's figures then read as current for good)."""
    ttl_ms = int(max(10.0, 10 * settings.tick_s) * 1000)  # a dead fleet's numbers fade out
    fields: dict[str, str | float | int] = {
        c: w.compliance for c, w in window.items() if w.compliance is not None}
    if math.isfinite(estimate.value) and 0 <= estimate.value <= MAX_CAPACITY_TOKENS_S:
        fields[".capacity"] = float(estimate.value)  # (else no figure: the script takes none)
    await scripts.publish_compliance(keys, ttl_ms, fields | {
        ".capacity_source": estimate.source, ".capacity_confidence": round(estimate.confidence, 3),
        ".capacity_workers": estimate.live_workers, ".updated_ms": int(now_ms),
        ".controller": settings.controller_id})


@dataclass(frozen=True)
class PoolState:
    """What the pool's queues and fleet hold now, as the tick read them (for the gauges)."""
    queued: dict[str, int]  # class -> requests queued
    queued_tokens: dict[str, float]  # class -> their reserved weighted cost
    leased: dict[str, int]  # class -> requests a worker holds
    live_workers: int
    live_frontends: int

    @classmethod
    def read(cls, classes: list[str], queued: list[Any], leased: list[Any], live_workers: int,
             live_frontends: int) -> PoolState:
        """``queued``: HMGET of the queued hash, every class's count then every class's
        ``.cost``; ``leased``: HMGET of the inflight hash by class. A field missing (nothing
        ever queued) or unreadable reads 0."""
        n = len(classes)

        def num(raw: Any) -> float:
            v = parse_float(raw)
            return 0.0 if v is None else max(0.0, v)

        return cls(queued={c: int(num(queued[i])) for i, c in enumerate(classes)},
                   queued_tokens={c: num(queued[n + i]) for i, c in enumerate(classes)},
                   leased={c: int(num(leased[i])) for i, c in enumerate(classes)},
                   live_workers=live_workers, live_frontends=int(live_frontends))

    def record(self, m: ControllerMetrics, pool: str) -> None:
        for c, n in self.queued.items():
            m.queued.labels(pool, c).set(n)
            m.queued_tokens.labels(pool, c).set(self.queued_tokens[c])
            m.leased.labels(pool, c).set(self.leased[c])
        m.live_workers.labels(pool).set(self.live_workers)
        m.live_frontends.labels(pool).set(self.live_frontends)


def record_metrics(m: ControllerMetrics, pool: str, d: Decision, window: Mapping[str, WindowStats],
                   capacity: float, inputs: Inputs) -> None:
    m.capacity.labels(pool).set(capacity)
    rates = d.state.rates()
    for c in d.classes:
        w = window[c.name]
        m.compliance.labels(pool, c.name).set(_nan(w.compliance))
        m.fresh_compliance.labels(pool, c.name).set(_nan(w.fresh_compliance))
        m.rate.labels(pool, c.name).set(rates[c.name].rate)
        m.ceil.labels(pool, c.name).set(rates[c.name].ceil)
        m.used.labels(pool, c.name).set(inputs.classes[c.name].used)
        m.decisions.labels(pool, c.name, c.reason).inc()


def _nan(v: float | None) -> float:
    return math.nan if v is None else v
