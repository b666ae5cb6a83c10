"""The aiohttp application: its routes, their handlers, and :func:`create_app`.

A generation request (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) is identified
(401), given its class (403 above the key's ceiling), and its body read and validated
(400/404) here -- nothing in Redis is touched until then; :class:`Generation`
(limiter/frontend/generation.py) admits it and answers. The process runtime (Redis, the
reply routers, the heartbeat) is :class:`Frontend` (limiter/frontend/runtime.py), made
and closed with the app by its cleanup context.

All HTTP errors are produced by :func:`~limiter.frontend.errors.error_middleware` from
:class:`ApiError` and the :mod:`limiter.errors` hierarchy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp.http_exceptions
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from limiter import status as status_mod
from limiter.config import ClassConfig, PoolConfig, QosConfig, TenantConfig
from limiter.errors import ConfigError
from limiter.frontend import choices, cors, responses_request, tokenizer_api
from limiter.frontend import openai_api as oa
from limiter.frontend.auth import CLASS_HEADER, one_header, require_admin, resolve_class
from limiter.frontend.errors import (
    LABELS,
    ApiError,
    Handler,
    RequestLabels,
    error_middleware,
    quiet_client_parse_errors,
    to_api_error,
)
from limiter.frontend.generation import Generation, queued_payload
from limiter.frontend.metrics import METRICS, FrontendMetrics
from limiter.frontend.readiness import readiness
from limiter.frontend.responses_api import ResponseGeneration
from limiter.frontend.runtime import FRONTEND, Frontend
from limiter.frontend.settings import FrontendSettings
from limiter.metrics_server import start_metrics_server

log = logging.getLogger("qos.frontend")

MAX_WAIT_HEADER = "X-QoS-Max-Wait-Ms"
# Set when an `Expect: 100-continue` was not answered with 100: the client may or may not
# send its body after the final answer, so the connection is closed after it (as nginx and
# Go do) rather than the body's bytes read as the next request's start.
BODY_NOT_ASKED = web.RequestKey("qos_body_not_asked", bool)


# --- handlers -------------------------------------------------------------------------------

def _frontend(request: web.Request) -> Frontend:
    """The process's runtime, made by the app's cleanup context."""
    return request.app[FRONTEND]


def _check_headers(fe: Frontend, request: web.Request,
                   labels: RequestLabels) -> tuple[TenantConfig, str, int]:
    """What a generation request's headers decide, checked before its body is read: the
    tenant (401), its class (400/403), its max wait (400), and the announced body size (400).
    Returns (tenant, class, max wait in ms)."""
    tenant = fe.keyring.identify(one_header(request.headers, "Authorization"))
    labels.tenant = tenant.name
    cls = resolve_class(fe.cfg, tenant, one_header(request.headers, CLASS_HEADER))
    labels.cls = cls
    max_wait = _max_wait_ms(one_header(request.headers, MAX_WAIT_HEADER), fe.classes[cls])
    _check_length(fe, request)
    return tenant, cls, max_wait


def _check_length(fe: Frontend, request: web.Request) -> None:
    """A 400 for a body announced over ``max_body_bytes``, before any of it is read."""
    limit = fe.settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(400, f"Request body is {request.content_length} bytes, over the {limit}-byte limit",
                          code="request_too_large")


def _check_tokenizer_headers(fe: Frontend, request: web.Request, labels: RequestLabels) -> TenantConfig:
    """What a tokenizer call's headers decide before its body is read: the tenant (401), and
    the announced body size (400)."""
    tenant = fe.keyring.identify(one_header(request.headers, "Authorization"))
    _check_length(fe, request)
    return tenant


HeaderCheck = Callable[[Frontend, web.Request, RequestLabels], object]


def _continue_if(check: HeaderCheck) -> Callable[[web.Request], Awaitable[web.Response | None]]:
    """An expect handler (:func:`_continue_if_acceptable`) for the routes whose headers
    ``check`` judges before their body is read."""
    async def expect_handler(request: web.Request) -> web.Response | None:
        return await _continue_if_acceptable(request, check)

    return expect_handler


async def _continue_if_acceptable(request: web.Request, check: HeaderCheck) -> web.Response | None:
    """A route's answer to ``Expect: 100-continue``: the ``100 Continue`` goes out only when
    the headers pass ``check`` (a generation's :func:`_check_headers`, a tokenizer call's
    :func:`_check_tokenizer_headers`); else nothing is sent here, and the handler answers the
    same error before it reads the body (aiohttp's default sent the 100 at once: a client
    with a bad key, or a body over the limit, uploaded all of it to be told 401 or 400), with
    ``Connection: close`` (BODY_NOT_ASKED). Any other expectation is a 417, as aiohttp's
    default made it."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() != "100-continue":
        refused = web.Response(status=417, text="Unknown Expect header: only 100-continue is supported")
        refused.force_close()
        return refused
    try:
        check(_frontend(request), request, RequestLabels())
    except ApiError:
        request[BODY_NOT_ASKED] = True
        return None
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # (aiohttp's own handler does so: the answer's size starts here)
    return None


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    try:
        # A client that announces a body and sends it slowly (or never) must not hold a
        # handler and its buffer for ever: aiohttp itself has no timeout on a body read.
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError as exc:
        raise ApiError(408, f"The request body did not arrive within {timeout_s:g} s", code="body_timeout",
                          err_type="invalid_request_error") from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(400, f"Request body is over the {limit}-byte limit",
                          code="request_too_large") from exc
    except (ConnectionError, aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError,
            RequestPayloadError) as exc:
        # A truncated or broken upload, or a compressed body that does not decompress
        # (RequestPayloadError, a bare Exception: it was a 500): the client's fault. The
        # message names the problem, not the parser's exception text.
        log.info("unreadable request body: %s", exc)
        raise ApiError(400, "Could not read the request body: it was cut off, its framing is broken, or "
                            "its Content-Encoding does not decode", code="invalid_body") from exc


def _max_wait_ms(header: str | None, cls: ClassConfig) -> int:
    """The client may shorten, never lengthen, its class's max queue wait."""
    if header is None:
        return cls.max_wait_ms
    text = header.strip()
    # Digits only, as HTTP numbers are: int() also takes '1_000', '+5' and non-ASCII digits.
    v = int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else 0
    if not 1 <= v <= 86_400_000:
        raise ApiError(400, f"{MAX_WAIT_HEADER} must be an integer number of milliseconds in "
                          "[1, 86400000]", code="invalid_value", param=MAX_WAIT_HEADER)
    return min(v, cls.max_wait_ms)


CLIENT_REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII: it goes in the answer's id


def _client_request_id(request: web.Request) -> str | None:
    """The client's own request id (``X-Request-Id``, as vLLM takes it), or None -- also for
    one that is not 1 to 128 visible ASCII characters: a tracing id set by the client's
    infrastructure, ignored before, must not turn its every request into a 400 (the answer
    then carries the service's id, so the client sees its own was not taken)."""
    value = one_header(request.headers, CLIENT_REQUEST_ID_HEADER)
    return value if value is not None and _CLIENT_REQUEST_ID.fullmatch(value) else None


def _generation_handler(kind: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        received = time.monotonic()  # (Generation's clock: not uvloop's whole milliseconds)
        fe = _frontend(request)
        labels = request[LABELS]
        # Every check of what the client sent comes before counting the prompt, which may ask
        # the model server: a bad header was a 503 (retried for ever) while it was down.
        tenant, cls, max_wait = _check_headers(fe, request, labels)
        client_id = _client_request_id(request)
        raw = await _read_body(request, fe.settings.max_body_bytes, fe.settings.body_timeout_s)
        body = oa.parse_json(raw)
        pool = oa.resolve_pool(fe.cfg, body)
        labels.pool = pool.name
        shape = None
        if kind == "response":  # a chat, answered in the Responses API's shape
            shape, draft = responses_request.parse_request(body, fe.cfg, pool)
            drafts, n = [draft], 1
        else:
            bodies, n = oa.split_choices(kind, body)
            drafts = [oa.parse_request(kind, one, fe.cfg, pool) for one in bodies]
        choices.refuse_more_than_in_flight(len(drafts), tenant)
        reqs = []
        for i, draft in enumerate(drafts):
            if i % n:  # a copy of the prompt before it (only its seed differs): checked and counted once
                reqs.append(oa.finish_request(draft, reqs[-1].prompt_tokens))
                continue
            await fe.quota.refuse_if_spent(draft, tenant, fe.classes[cls])
            oa.refuse_if_surely_too_long(draft)
            reqs.append(oa.finish_request(draft, await fe.count_prompt(draft, tenant)))
        choices.refuse_over_the_quota(reqs, tenant, fe.classes[cls])
        payloads = [queued_payload(req, draft.prompt_param) for req, draft in zip(reqs, drafts, strict=True)]
        choices.refuse_more_than_they_may_hold(payloads, n)
        # (made once every answer's request is checked: each registers for its replies; a
        # Responses request's one answer is written in that API's shape)
        answered_as = Generation if shape is None else functools.partial(ResponseGeneration, shape)
        gens = [answered_as(fe, request, tenant, cls, req, payload, max_wait, received, client_id)
                for req, payload in zip(reqs, payloads, strict=True)]
        if len(gens) == 1:
            return await gens[0].run()
        answer = choices.stream_choices if gens[0].req.stream else choices.run_choices
        return await answer(gens, n)

    return handler


async def stored_response(request: web.Request) -> web.Response:
    """``GET``/``DELETE /v1/responses/{id}``, its ``/cancel`` and ``/input_items``: this
    service keeps no responses (every one is answered ``store: false``), so every id is
    unknown -- a 404 naming it, as vLLM answers with its store off, not a bare route miss."""
    fe = _frontend(request)
    fe.keyring.identify(one_header(request.headers, "Authorization"))
    rid = request.match_info["id"][:200]
    raise ApiError(404, f"Response with id '{rid}' not found: this service keeps no responses (they are "
                   "answered with store false)", code="not_found", param="response_id", outcome="not_found")


def _model_object(pool: PoolConfig) -> dict[str, Any]:
    return {"id": pool.model_name, "object": "model", "created": 0, "owned_by": "qos",
            "max_model_len": pool.context_tokens}


async def models(request: web.Request) -> web.Response:
    fe = _frontend(request)
    fe.keyring.identify(one_header(request.headers, "Authorization"))
    return web.json_response({"object": "list", "data": [_model_object(p) for p in fe.cfg.pools]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``); ids may contain '/'."""
    fe = _frontend(request)
    fe.keyring.identify(one_header(request.headers, "Authorization"))
    return web.json_response(_model_object(oa.resolve_pool(fe.cfg, {"model": request.match_info["id"]})))


def _counted(endpoint: str, handler: Handler) -> Handler:
    """``handler``, each call counted by the status it answers (the error middleware answers
    an exception; it counts only the generation paths)."""
    async def counted(request: web.Request) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as exc:
            status = to_api_error(exc).status
            raise
        finally:
            request.app[METRICS].tokenizer_calls.labels(endpoint, str(status)).inc()

    return counted


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` (limiter/frontend/tokenizer_api.py)."""
    return await _tokenizer_call(request, tokenizer_api.tokenize)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /detokenize``."""
    return await _tokenizer_call(request, tokenizer_api.detokenize)


async def _tokenizer_call(request: web.Request, call: Any) -> web.Response:
    fe = _frontend(request)
    tenant = _check_tokenizer_headers(fe, request, request[LABELS])
    body = oa.parse_json(await _read_body(request, fe.settings.max_body_bytes, fe.settings.body_timeout_s))
    pool = tokenizer_api.pool_of(fe.cfg, body.get("model"))
    with fe.count_turn(tenant):
        return web.json_response(await call(pool, fe.counters[pool.name], body), dumps=tokenizer_api.dumps)


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's ``GET /tokenizer_info`` (``?model=``: which, where the frontend serves several)."""
    fe = _frontend(request)
    tenant = fe.keyring.identify(one_header(request.headers, "Authorization"))
    pool = tokenizer_api.pool_of(fe.cfg, request.query.get("model"))
    with fe.count_turn(tenant):
        return web.json_response(await tokenizer_api.tokenizer_info(pool, fe.counters[pool.name]),
                                 dumps=tokenizer_api.dumps)


def _health(fe: Frontend) -> dict[str, str]:
    """``/healthz``: the process runs (on the API port, and on ``metrics_port`` when set)."""
    return {"status": "ok", "frontend": fe.frontend_id}


async def healthz(request: web.Request) -> web.Response:
    return web.json_response(_health(_frontend(request)))


async def readyz(request: web.Request) -> web.Response:
    """``/readyz``, and ``/health`` (vLLM's name for it, which guidellm and vLLM's tooling
    probe before they send anything): 200 only when this frontend can admit requests.

    A pool out of service (its Redis shard not answering, its heartbeat stale, its reply
    stream unread, every live worker's upstream unreachable: limiter/frontend/readiness.py)
    makes it 503 only when that is every pool this frontend serves: behind a readiness
    probe, one broken model server or one Redis Cluster shard took every frontend out of its
    load balancer, and every other pool's clients with it. Such pools are listed as
    ``degraded``, each with why; ``?pool=NAME`` asks about one pool (a probe per model),
    503 while it is down, 404 for a pool this frontend does not serve.

    The path needs no key and a check asks Redis once per worker of each pool: probes that
    arrive while a check of the same scope is under way share its answer (N probes at once
    were N checks, on the connections the requests and the heartbeat use)."""
    fe = _frontend(request)
    asked = request.query.get("pool")
    if asked is not None and asked not in fe.pool_keys:
        return web.json_response({"status": "unknown", "reason": "no such pool"}, status=404)
    if fe.shutting_down:
        problem, degraded = "shutting down", {}
    else:
        check = fe.ready_checks.get(asked)
        if check is None or check.done():
            check = fe.ready_checks[asked] = asyncio.ensure_future(readiness(fe, asked))
        # shielded: a probe whose client left (handler cancellation) must not cancel the others'
        problem, degraded = await asyncio.shield(check)
    if problem:
        return web.json_response({"status": "unavailable", "reason": problem}, status=503,
                                 headers={"Retry-After": "1"})
    body: dict[str, Any] = {"status": "ready", "frontend": fe.frontend_id}
    if degraded and asked is None:
        body["degraded"] = degraded
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def qos_status(request: web.Request) -> web.Response:
    fe = _frontend(request)
    require_admin(fe.keyring.identify(one_header(request.headers, "Authorization")))
    snap = await status_mod.snapshot(fe.client, fe.cfg)
    snap["frontend"] = fe.frontend_id
    return web.json_response(snap, dumps=oa.compact_json)


# --- the application --------------------------------------------------------------------------

def _bounded_writes(timeout_s: float) -> Any:
    """Write each answer a handler returned unsent within ``timeout_s`` (``idle_timeout_s``),
    else drop the connection. aiohttp writes a returned response itself, with no bound: a
    client that pipelined requests (``GET /healthz``, no key needed) and read none of the
    answers held its connection and handler for as long as it kept the socket open, past
    every timeout the frontend has. (Streams and non-stream answers write themselves, under
    the request's own bound: limiter/frontend/generation.py.)"""

    @web.middleware
    async def bounded_writes(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await handler(request)
        if resp.prepared:
            return resp
        if request.get(BODY_NOT_ASKED):
            resp.force_close()
        try:
            async with asyncio.timeout(timeout_s):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            # raw_path: the path as sent, still %-encoded (a decoded %0A forged a log line)
            log.info("%s %s: the client read no answer within %g s; connection dropped", request.method,
                     request.raw_path, timeout_s)
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass  # the client left
        return resp

    return bounded_writes


async def _on_shutdown(app: web.Application) -> None:
    # Runs once the listening sockets are closed, before aiohttp waits out the grace period.
    if FRONTEND in app:
        app[FRONTEND].begin_shutdown()


def create_app(settings: FrontendSettings, cfg: QosConfig, *,
               frontend_id: str | None = None) -> web.Application:
    """The frontend as an aiohttp app; Redis is opened and closed with the app's lifetime."""
    quiet_client_parse_errors()
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[_bounded_writes(settings.idle_timeout_s), error_middleware])
    cors.install(app, settings.cors_origins)
    app[METRICS] = FrontendMetrics(ttft_slos_ms=[c.slo_ttft_ms for c in cfg.classes],
                                   tpot_slos_ms=[c.slo_tpot_ms for c in cfg.classes])

    async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
        fe = Frontend(settings, cfg, app[METRICS], frontend_id)
        app[FRONTEND] = fe
        await fe.start()
        yield
        fe.begin_shutdown()
        await fe.stop()

    async def metrics_ctx(app: web.Application) -> AsyncIterator[None]:
        # This process's own /metrics (and /healthz), apart from the API port that processes
        # may share: a scrape there reaches whichever the kernel picks.
        host = settings.metrics_host or settings.host
        try:
            # bound before the frontend starts (a scrape in between finds the process alive)
            runner = await start_metrics_server(
                app[METRICS].registry,
                lambda: _health(app[FRONTEND]) if FRONTEND in app else {"status": "ok"}, host,
                settings.metrics_port)
        except OSError as exc:
            raise ConfigError("frontend.metrics_port",
                              f"cannot listen on {host}:{settings.metrics_port}: {exc}") from exc
        yield
        await runner.cleanup()

    # The metrics port first: a taken one is refused before anything is written to Redis (it
    # was bound after the start: the scripts, the policy and a heartbeat of a frontend that
    # never served were in Redis, and "ready" in its log, when it exited naming the port).
    if settings.metrics_port:
        app.cleanup_ctx.append(metrics_ctx)
    app.cleanup_ctx.append(redis_ctx)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", _generation_handler("chat"),
                         expect_handler=_continue_if(_check_headers))
    app.router.add_post("/v1/completions", _generation_handler("completion"),
                         expect_handler=_continue_if(_check_headers))
    app.router.add_post("/v1/responses", _generation_handler("response"),
                         expect_handler=_continue_if(_check_headers))
    app.router.add_get("/v1/responses/{id}", stored_response)
    app.router.add_delete("/v1/responses/{id}", stored_response)
    app.router.add_post("/v1/responses/{id}/cancel", stored_response)
    app.router.add_get("/v1/responses/{id}/input_items", stored_response)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)
    app.router.add_get("/v1/qos/status", qos_status)
    # (a client with no key, or a body over the limit, is not asked for its body: as above)
    app.router.add_post("/tokenize", _counted("tokenize", tokenize),
                         expect_handler=_continue_if(_check_tokenizer_headers))
    app.router.add_post("/detokenize", _counted("detokenize", detokenize),
                         expect_handler=_continue_if(_check_tokenizer_headers))
    app.router.add_get("/tokenizer_info", _counted("tokenizer_info", tokenizer_info))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/health", readyz)
    if settings.api_metrics:
        app.router.add_get("/metrics", metrics)
    return app
