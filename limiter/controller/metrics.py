"""Prometheus metrics of one controller process, served on ``--metrics-port`` (0 = off).

A per-process registry (not the global one), so tests can run two controllers in one
process. ``GET /metrics`` is Prometheus text; ``GET /healthz`` is JSON and answers 200 while
the process runs -- a standby or a controller waiting out a Redis outage is healthy, a
liveness probe must not kill it (``leader`` and ``redis_ok`` are inside the body).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class ControllerMetrics:
    def __init__(self, controller_id: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        Gauge("qos_controller_info", "Always 1; labels say which controller this is", ["controller"],
              registry=r).labels(controller_id).set(1)
        self.leader = Gauge("qos_controller_leader", "1 while this process is the pool's active controller",
                            ["pool"], registry=r)
        self.compliance = Gauge("qos_controller_compliance", "SLO compliance over the window (0..1; NaN = "
                                "no target or no samples)", ["pool", "class"], registry=r)
        self.fresh_compliance = Gauge("qos_controller_fresh_compliance", "Compliance over samples since the "
                                      "last change (what the law judges)", ["pool", "class"], registry=r)
        self.rate = Gauge("qos_controller_rate", "Guaranteed rate per class, weighted tokens/s",
                          ["pool", "class"], registry=r)
        self.ceil = Gauge("qos_controller_ceil", "Ceiling (rate with borrowing) per class, weighted tokens/s",
                          ["pool", "class"], registry=r)
        self.used = Gauge("qos_controller_used", "Admitted work per class, weighted tokens/s (the law's "
                          "'used')", ["pool", "class"], registry=r)
        self.capacity = Gauge("qos_controller_capacity", "Capacity estimate, weighted tokens/s", ["pool"],
                              registry=r)
        self.decisions = Counter("qos_controller_decisions", "Per-class verdicts of the law, by reason, one "
                                 "per tick (hold, relax, tighten_lower_for_P0, cooldown, ...)",
                                 ["pool", "class", "reason"], registry=r)
        self.writes = Counter("qos_controller_rate_writes", "Rate changes written with set_rates", ["pool"],
                              registry=r)
        self.stale = Counter("qos_controller_stale_writes", "set_rates refused: this controller was no "
                             "longer the leader (it stepped down)", ["pool"], registry=r)
        self.samples = Counter("qos_controller_samples", "Latency samples read and acknowledged (a "
                               "class's admission rejections over its guarantee are read, not judged)",
                               ["pool", "class"], registry=r)
        self.bad_samples = Counter("qos_controller_bad_samples", "Samples that could not be used (logged and "
                                   "acknowledged), by offending field", ["pool", "field"], registry=r)
        self.claimed = Counter("qos_controller_claimed_samples", "Entries taken over from another consumer's "
                               "pending list (XAUTOCLAIM) or replayed from our own", ["pool", "how"],
                               registry=r)
        self.redis_errors = Counter("qos_controller_redis_errors", "Redis failures, by loop", ["loop"],
                                    registry=r)
        # The pool's queues and fleet as Redis holds them, read every tick: what an autoscaler
        # of the GPU fleet (or an alert) reads, which no per-process metric can tell
        self.queued = Gauge("qos_controller_queued", "Requests queued now (admitted, no worker holds "
                            "them)", ["pool", "class"], registry=r)
        self.queued_tokens = Gauge("qos_controller_queued_tokens", "Reserved cost of the queued requests, "
                                   "weighted tokens", ["pool", "class"], registry=r)
        self.leased = Gauge("qos_controller_leased", "Requests a worker holds now (claimed, unfinished)",
                            ["pool", "class"], registry=r)
        self.live_workers = Gauge("qos_controller_live_workers", "Workers that beat within the capacity "
                                  "estimator's worker_ttl_s", ["pool"], registry=r)
        self.live_frontends = Gauge("qos_controller_live_frontends", "Frontends that beat within the "
                                    "pool's frontend_ttl_ms", ["pool"], registry=r)

    def forget_term(self, pool: str, classes: list[str]) -> None:
        """Drop the figures of a term that ended: a standby exporting its last tick's rates and
        compliance for ever looked like a second, stale leader."""
        for g in (self.capacity, self.live_workers, self.live_frontends):
            g.remove(pool)
        for g in (self.compliance, self.fresh_compliance, self.rate, self.ceil, self.used, self.queued,
                  self.queued_tokens, self.leased):
            for c in classes:
                g.remove(pool, c)

    def render(self) -> bytes:
        return generate_latest(self.registry)

