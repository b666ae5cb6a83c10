"""Prometheus metrics of one worker process, served on ``--metrics-port`` (0 = off).

A per-process registry (not the global one), so tests can run several workers in one
process. The server is a tiny aiohttp app: ``GET /metrics`` (Prometheus text) and
``GET /healthz`` (JSON; 200 while the process runs, with ``redis_ok`` and ``draining``
inside - a Redis outage must not get a liveness probe to kill a worker holding work).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class WorkerMetrics:
    def __init__(self, *, pool: str, worker: str, engine: str, simulated: bool, device: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.info = Gauge("qos_worker_info", "Always 1; labels say what this worker runs",
                          ["pool", "worker", "engine", "simulated", "device"], registry=r)
        self.info.labels(pool, worker, engine, str(simulated).lower(), device).set(1)
        self.batch_size = Gauge("qos_worker_batch_size", "Sequences in the last engine step (running)",
                                registry=r)
        self.waiting = Gauge("qos_worker_waiting", "Claimed requests not running now (not yet admitted, "
                             "or paused by preemption)", registry=r)
        self.step_seconds = Histogram("qos_worker_step_seconds", "Wall time of one engine step",
                                      buckets=_STEP_SECONDS, registry=r)
        self.generated_tokens = Counter("qos_worker_generated_tokens", "Tokens generated; rate() gives "
                                        "tokens/s", registry=r)
        self.prefill_tokens = Counter("qos_worker_prefill_tokens", "Prompt tokens prefilled (re-prefills "
                                      "after preemption or resume included)", registry=r)
        self.kv_used = Gauge("qos_worker_kv_used_tokens", "KV cache tokens in use", registry=r)
        self.kv_capacity = Gauge("qos_worker_kv_capacity_tokens", "KV cache capacity in tokens", registry=r)
        self.preemptions = Counter("qos_worker_preemptions", "Sequences paused for a higher class or "
                                   "for KV room", registry=r)
        self.claims = Counter("qos_worker_claims", "Requests claimed, by class", ["class"], registry=r)
        self.cancellations = Counter("qos_worker_cancellations", "Requests stopped because their client "
                                     "went away", registry=r)
        self.finished = Counter("qos_worker_requests", "Requests this worker finished, by outcome "
                                "(ok, cancelled, failed, refused, lost, released, given_up; dropped: "
                                "a call Redis refused for a worker bug, left to its lease)",
                                ["class", "outcome"], registry=r)
        self.pushes = Counter("qos_worker_pushes", "token batches pushed, one per request and push "
                              "(a push_tokens call carries a step's due requests)", registry=r)
        self.redis_errors = Counter("qos_worker_redis_errors", "Redis failures, by loop", ["loop"],
                                    registry=r)
        # openai engine: the upstream circuit breaker (worker/upstream.py)
        self.upstream_open = Gauge("qos_worker_upstream_open", "1 while the upstream is taken for "
                                   "unreachable (not claiming, probing)", registry=r)
        self.upstream_failures = Counter("qos_worker_upstream_failures", "Requests handed back because "
                                         "the upstream could not be reached or broke off", registry=r)
        self.upstream_probes = Counter("qos_worker_upstream_probes", "Probes of an unreachable upstream, "
                                       "by result (up, down)", ["result"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

