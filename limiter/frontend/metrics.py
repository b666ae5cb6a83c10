"""Prometheus metrics of one frontend app, in its own registry (several apps may share a
process in tests; the global registry would mix them). Served at ``GET /metrics``."""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from sub-millisecond frontend overhead up to long queue waits.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0)


def _with_slos(buckets: tuple[float, ...], slos_ms: Iterable[float | None]) -> tuple[float, ...]:
    """``buckets`` plus a boundary at every SLO (ms -> s): the share of requests within a
    target can only be read off a histogram that has a bucket there."""
    return tuple(sorted(set(buckets) | {ms / 1000 for ms in slos_ms if ms}))


class FrontendMetrics:
    def __init__(self, ttft_slos_ms: Iterable[float | None] = (),
                 tpot_slos_ms: Iterable[float | None] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "qos_frontend_requests", "Finished generation requests by outcome "
            "(ok, throttled, shed, expired, failed, refused, cancelled, timeout, bad_request, unauthorized, "
            "forbidden, not_found, unavailable, error)",
            ["pool", "class", "tenant", "outcome"], registry=r)
        self.rejections = Counter(
            "qos_frontend_rejections", "429 and 503 answers, by status and reason",
            ["pool", "class", "status", "reason"], registry=r)
        self.admission = Histogram(
            "qos_frontend_admission_seconds", "Time from the first admit call to admitted, "
            "including waits for bucket tokens (admission_wait_ms)", ["pool", "class"], buckets=_SECONDS,
            registry=r)
        self.admission_retries = Counter(
            "qos_frontend_admission_retries", "Admit calls retried after a bucket wait", ["pool", "class"],
            registry=r)
        self.queue_wait = Histogram(
            "qos_frontend_queue_wait_seconds", "Time from admitted to the first reply from a worker "
            "(queue wait plus prefill)", ["pool", "class"], buckets=_SECONDS, registry=r)
        self.ttft = Histogram(
            "qos_frontend_ttft_seconds", "Time from request received to first token", ["pool", "class"],
            buckets=_with_slos(_SECONDS, ttft_slos_ms), registry=r)
        # A class's TTFT target may grow with the prompt (slo_ttft_ms_per_1k_prompt_tokens): the
        # histogram's bucket at the base target is then not the class's attainment; this is.
        self.ttft_target = Counter(
            "qos_frontend_ttft_target", "First tokens judged against their class's TTFT target, "
            "prompt allowance included (met: yes or no)", ["pool", "class", "met"], registry=r)
        self.tpot = Histogram(
            "qos_frontend_tpot_seconds", "Mean time per output token after the first, per request",
            ["pool", "class"], buckets=_with_slos(_TPOT, tpot_slos_ms), registry=r)
        self.inflight = Gauge(
            "qos_frontend_inflight", "Generation requests being handled now", ["pool"], registry=r)
        self.reply_entries = Counter(
            "qos_frontend_reply_entries",
            "Replies read from the reply stream, by kind (tok, done, err, orphan, malformed)",
            ["pool", "kind"], registry=r)
        # A subset of the `tok` replies, so a counter of its own: as a kind of the one above it
        # was counted twice (as `tok` when read, as `dup` when dropped) and a sum over kinds
        # overstated the replies read.
        self.replayed_replies = Counter(
            "qos_frontend_replayed_replies",
            "Token replies dropped as replays of text the client already has (a resumed request)",
            ["pool"], registry=r)
        self.redis_errors = Counter(
            "qos_frontend_redis_errors", "Redis failures seen by background loops", ["loop"], registry=r)
        self.tokenizer_calls = Counter(
            "qos_frontend_tokenizer_calls", "Calls of the tokenizer endpoints (/tokenize, /detokenize, "
            "/tokenizer_info), by the HTTP status answered (499: the client left)", ["endpoint", "status"],
            registry=r)
        self.lost_requests = Counter(
            "qos_frontend_lost_requests",
            "Admitted requests whose record Redis no longer held (it lost data), answered 503", ["pool"],
            registry=r)
        # A reader that fell past the reply stream's cap (MAXLEN ~100,000 entries) read on after
        # entries that were trimmed unread: their requests' answers would have been incomplete.
        self.replies_lost = Counter(
            "qos_frontend_replies_lost",
            "Requests answered 503 replies_lost: reply entries of theirs were trimmed from the reply "
            "stream before this frontend read them", ["pool"], registry=r)

        self.unsent_cancels = Gauge(
            "qos_frontend_unsent_cancels",
            "Cancels of requests whose client left that Redis refused (an outage), kept to send again",
            registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", FrontendMetrics)
