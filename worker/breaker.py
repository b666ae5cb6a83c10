"""The openai worker's circuit breaker over its model server (worker/upstream.py): while
the server cannot serve (unreachable, dying, hung), the worker stops claiming, and probes
it after a back-off. Pure but for the clock it reads and the metrics it moves."""

from __future__ import annotations

import logging
import time

from worker.metrics import WorkerMetrics

log = logging.getLogger("qos.worker")


class Breaker:
    """Circuit breaker over the upstream: ``closed`` (claim) or ``open`` (do not claim; probe
    when ``retry_at`` comes). The back-off doubles on every failed probe and on a failure
    soon after a successful probe, and goes back to ``min_s`` once a request succeeds."""

    def __init__(self, min_s: float, max_s: float, metrics: WorkerMetrics | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.metrics = metrics
        self.state = "closed"
        self.backoff_s = min_s
        self.retry_at = 0.0
        self.failures = 0  # upstream failures since the last success
        self.probes = 0  # probes sent, ever
        self._proven = True  # a request succeeded since the breaker last closed

    def trip(self, why: str, *, request: bool = True) -> None:
        """Open (or keep open). ``request``: a request met the failure (it is counted in
        ``upstream_failures``); False for a health check of an idle worker's."""
        if request:
            self.failures += 1
        if self.metrics is not None:
            if request:
                self.metrics.upstream_failures.inc()
            self.metrics.upstream_open.set(1)
        if self.state == "open":
            return  # several streams failing at once is one outage
        if not self._proven:  # it failed again right after a probe said it was back
            self.backoff_s = min(self.max_s, self.backoff_s * 2)
        self.state = "open"
        self.retry_at = time.monotonic() + self.backoff_s
        log.warning("upstream unavailable (%s): not claiming; probing in %.1f s", why, self.backoff_s)

    def probe_failed(self, why: str) -> None:
        if self.metrics is not None:
            self.metrics.upstream_probes.labels("down").inc()
        self.backoff_s = min(self.max_s, self.backoff_s * 2)
        self.retry_at = time.monotonic() + self.backoff_s
        log.warning("upstream probe failed (%s); next in %.1f s", why, self.backoff_s)

    def probe_ok(self) -> None:
        if self.metrics is not None:
            self.metrics.upstream_probes.labels("up").inc()
            self.metrics.upstream_open.set(0)
        self.state = "closed"
        self._proven = False
        log.info("upstream answers again: claiming")

    def success(self) -> None:
        self.failures = 0
        self._proven = True
        self.backoff_s = self.min_s
