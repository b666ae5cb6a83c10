"""HTTP errors: :class:`ApiError` (an error in OpenAI's shape), the mapping of the
:mod:`limiter.errors` hierarchy onto it, and the one middleware that renders and counts them.

Handlers and the request path raise; nothing else builds an error response. The mapping
sits beside the error type it produces (as httpx's ``_exceptions`` + ``map_exceptions``):
adding an exception to the hierarchy means adding one branch to :func:`to_api_error`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter.errors import (
    InvalidArgument,
    Overloaded,
    PolicyMissing,
    QueueFull,
    RedisUnavailable,
    TenantBusy,
    Throttled,
)
from limiter.frontend.metrics import METRICS

log = logging.getLogger("qos.frontend")

# The requests counted in the requests and rejections metrics.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# 401 is OpenAI's own: type invalid_request_error, code invalid_api_key (authentication_error
# is another vendor's word; the OpenAI SDKs key on the status, some proxies on the type).
_DEFAULT_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 503: "service_unavailable",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; the app's error middleware renders it.

    ``outcome`` is the label it is counted under in the requests metric."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 err_type: str | None = None, retry_after_s: int | None = None,
                 retry_after_ms: int | None = None, should_retry: bool | None = None,
                 outcome: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type or _DEFAULT_TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s
        # Retry-After holds whole seconds (RFC 9110): a 40 ms bucket wait read as 1 s. The
        # OpenAI SDKs read ``retry-after-ms`` first, so the exact wait goes there too.
        self.retry_after_ms = retry_after_ms
        # ``x-should-retry`` (read by the OpenAI SDKs before the status): false where a
        # resend is admitted, charged and most likely fails again (the pool already retried it).
        self.should_retry = should_retry
        self.outcome = outcome

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.code, self.param)

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.retry_after_s is not None:
            exact = self.retry_after_ms is not None and self.retry_after_ms > 0
            ms = self.retry_after_ms if exact else self.retry_after_s * 1000
            h |= {"Retry-After": str(self.retry_after_s), "retry-after-ms": str(ms)}
        if self.should_retry is not None:
            h["x-should-retry"] = "true" if self.should_retry else "false"
        return h


def error_body(message: str, err_type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass
class RequestLabels:
    """What the error middleware needs to count a request, filled in as it is learnt."""

    pool: str = ""
    cls: str = ""
    tenant: str = ""
    outcome: str = "ok"


LABELS = web.RequestKey("qos_labels", RequestLabels)


def _retry_s(retry_after_ms: int) -> int:
    return max(1, math.ceil(retry_after_ms / 1000))


def to_api_error(exc: BaseException) -> ApiError:
    """Map the limiter.errors hierarchy (and HTTP/Redis exceptions) to one HTTP answer."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        known = exc.retry_after_ms >= 0  # -1: the class gets no capacity, no drain to estimate
        retry_s = _retry_s(exc.retry_after_ms) if known else 5
        return ApiError(429, f"Overloaded: {exc}; retry in {retry_s} s", code="max_wait_exceeded",
                        retry_after_s=retry_s, retry_after_ms=exc.retry_after_ms if known else None,
                        outcome="throttled")
    if isinstance(exc, Throttled):
        if exc.retry_after_ms < 0:
            cls = exc.cls or "of this request"
            return ApiError(429, f"Class {cls} is disabled right now (its ceiling is 0)",
                            code="rate_limit_exceeded", retry_after_s=5, outcome="throttled")
        return ApiError(429, f"Rate limit reached: the {exc.bucket} token bucket is empty; retry in "
                        f"{exc.retry_after_ms} ms", code="rate_limit_exceeded",
                        retry_after_s=_retry_s(exc.retry_after_ms), retry_after_ms=exc.retry_after_ms,
                        outcome="throttled")
    if isinstance(exc, TenantBusy):
        return ApiError(429, f"Too many concurrent requests: {exc}", code="too_many_inflight",
                        retry_after_s=1, outcome="throttled")
    if isinstance(exc, QueueFull):
        return ApiError(503, f"Overloaded: the {exc.cls} queue is full ({exc.depth} waiting); retry later",
                        code="queue_full", retry_after_s=_retry_s(exc.retry_after_ms), outcome="shed")
    if isinstance(exc, InvalidArgument):
        # Only a script raises it here: the frontend checked the client's input before the call,
        # so a script refusing an argument is the server's own disagreement, not the client's
        # (a 400 told the client to change a request that was fine, with the Lua's text).
        if exc.field == "class":
            # the pool's policy lacks a class this frontend's configuration has: its roles run
            # different configurations (a rolling deploy that adds one) until the next init_pool
            log.warning("the pool's policy has no such class (its roles' configurations differ?): %s", exc)
            return ApiError(503, "Service temporarily unavailable: this class is not in the pool's policy "
                            "yet; retry shortly", code="class_unavailable", retry_after_s=5,
                            outcome="unavailable")
        return ApiError(500, "Internal server error", code="internal_error", outcome="error")
    if isinstance(exc, RedisUnavailable | PolicyMissing | RedisConnectionError | RedisTimeoutError):
        # The client learns what happened, not the store's address or the driver's text (the
        # heartbeat loop logs the outage once when it starts; per request it would flood the log).
        log.debug("Redis unavailable: %s", exc)
        return ApiError(503, "Service temporarily unavailable: the request queue cannot be reached; retry "
                        "shortly", code="redis_unavailable", retry_after_s=1, outcome="unavailable")
    if isinstance(exc, web.HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        outcome = "not_found" if exc.status == 404 else "bad_request"
        return ApiError(exc.status, exc.reason, code=code, outcome=outcome)
    return ApiError(500, "Internal server error", code="internal_error", outcome="error")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error answer of the app, and the count of every generation request."""
    labels = RequestLabels()
    request[LABELS] = labels
    counted = request.path in GENERATION_PATHS
    try:
        resp = await handler(request)
    except asyncio.CancelledError:
        if counted:
            _count(request, "cancelled" if labels.outcome == "ok" else labels.outcome)
        raise
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise  # redirects and the like are not errors
        err = to_api_error(exc)
        if err.status >= 500 and err.code == "internal_error":
            log.exception("unhandled error on %s %s", request.method, request.raw_path)  # as sent: no newline
        if err.status in (429, 503) and counted:
            request.app[METRICS].rejections.labels(labels.pool, labels.cls, str(err.status),
                                                   err.code or "").inc()
        labels.outcome = err.outcome
        if counted:
            _count(request, err.outcome)
        headers = err.headers()
        if isinstance(exc, web.HTTPException) and "Allow" in exc.headers:
            headers["Allow"] = exc.headers["Allow"]  # a 405 must say what is allowed (RFC 9110)
        return web.json_response(err.body(), status=err.status, headers=headers)
    if counted:
        _count(request, labels.outcome)
    return resp


def _count(request: web.Request, outcome: str) -> None:
    labels = request[LABELS]
    request.app[METRICS].requests.labels(labels.pool, labels.cls, labels.tenant, outcome).inc()


class _ClientParseErrors(logging.Filter):
    """aiohttp answers a request it cannot parse (a bad request line or header: the client's
    fault) with its own 400 and logs "Error handling request" with a traceback, at ERROR for
    some of them: any client, no key needed, could fill the log with tracebacks. Such a record
    goes at DEBUG (shown only when aiohttp.server logs at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_client_parse_errors() -> None:
    """Install :class:`_ClientParseErrors` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientParseErrors) for f in logger.filters):
        logger.addFilter(_ClientParseErrors())
