"""The aiohttp application: routes, the request path, and the one error middleware.

Request path of a generation request (``POST /v1/chat/completions``, ``/v1/completions``):

1. identify the key (401), resolve the class (403 above the key's ceiling), read and
   validate the body (400/404) — nothing in Redis is touched until here;
2. register a reply queue, then admit (one script call). An empty bucket is waited out
   when the wait fits the class's ``admission_wait_ms``, else 429 with an exact
   ``Retry-After``; a full queue is 503 with a ``Retry-After`` from the measured drain rate;
3. wait for reply entries, forwarding tokens in order (deduplicated by offset). If the
   queue deadline passes before the first token, ``cancel(expired)`` decides: still queued
   -> 503, already running -> keep waiting. A safety timeout bounds every request;
4. a client that goes away (a failed write, or aiohttp cancelling the handler) cancels
   the request everywhere; so does shutdown after its grace period.

All HTTP errors are produced by :func:`error_middleware` from :class:`ApiError` and the
:mod:`limiter.errors` hierarchy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter import status as status_mod
from limiter import token_count
from limiter.config import ClassConfig, PoolConfig, QosConfig, TenantConfig
from limiter.errors import (
    InvalidArgument,
    Overloaded,
    PolicyMissing,
    QosError,
    QueueFull,
    RedisUnavailable,
    ScriptError,
    TenantBusy,
    Throttled,
)
from limiter.frontend import openai_api as oa
from limiter.frontend.auth import CLASS_HEADER, KeyRing, require_admin, resolve_class
from limiter.frontend.metrics import FrontendMetrics
from limiter.frontend.replies import Heartbeat, Reply, ReplyRouter, dedup, drain_estimate_s
from limiter.frontend.settings import FrontendSettings
from limiter.keys import SAMPLES_MAXLEN, PoolKeys
from limiter.redis_conn import open_redis
from limiter.samples import build_sample, pack_sample
from limiter.scripts import SCRIPT_NAMES, Admitted, Scripts, policy_document, script_source

log = logging.getLogger("qos.frontend")

MAX_WAIT_HEADER = "X-QoS-Max-Wait-Ms"
REQUEST_ID_HEADER = "X-QoS-Request-Id"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# After cancel(expired) finds the request already finished, its final entry is on the way.
FINAL_GRACE_S = 2.0
# Slack added to Redis' deadline: Redis' own expiry (claim) and ours then agree on the outcome.
DEADLINE_SLACK_S = 0.02


@dataclass
class RequestLabels:
    """What the error middleware needs to count a request, filled in as it is learnt."""

    pool: str = ""
    cls: str = ""
    tenant: str = ""
    outcome: str = "ok"


LABELS = web.RequestKey("qos_labels", RequestLabels)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Frontend:
    """Per-process runtime: the Redis client, scripts, reply router and heartbeat."""

    def __init__(self, settings: FrontendSettings, cfg: QosConfig, metrics: FrontendMetrics,
                 frontend_id: str | None = None) -> None:
        self.settings = settings
        self.cfg = cfg
        self.metrics = metrics
        self.frontend_id = frontend_id or f"fe-{uuid.uuid4().hex[:16]}"
        self.keyring = KeyRing(cfg)
        self.pool_keys = {p.name: PoolKeys(p.name) for p in cfg.pools}
        self.classes = {c.name: c for c in cfg.classes}
        # Each pool's prompts are counted in its own tokens (limiter/token_count.py).
        self.counters = {p.name: token_count.counter_for(p.tokenizer, p.tokenizer_url, cfg.worker,
                                                         p.model_name, timeout_s=settings.tokenize_timeout_s)
                         for p in cfg.pools}
        self.client: Any = None
        self.scripts: Scripts | None = None
        self.router: ReplyRouter | None = None
        self.heartbeat: Heartbeat | None = None
        self.bootstrapped = False
        self.shutting_down = False
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._end_streams: asyncio.Task[None] | None = None
        # Liveness must stay well inside the shortest TTL after which claim gives up on us.
        self._fresh_s = min(p.frontend_ttl_ms for p in cfg.pools) / 1000 / 2

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.client = open_redis(self.cfg.redis, max_connections=self.settings.redis_max_connections,
                                 pool_wait_s=5.0)
        self.scripts = Scripts(self.client)
        keys = list(self.pool_keys.values())
        self.router = ReplyRouter(self.client, keys, self.frontend_id, self.metrics)
        router = self.router
        self.heartbeat = Heartbeat(self.client, keys, self.frontend_id, list(self.classes),
                                   self.settings.heartbeat_s, trim_upto=lambda pool: router.last_ids[pool],
                                   outage_grace_ms={p.name: 2 * p.frontend_ttl_ms for p in self.cfg.pools},
                                   prune_after_ms={p.name: 4 * p.frontend_ttl_ms for p in self.cfg.pools})
        for k in keys:
            self._tasks.append(asyncio.create_task(self.router.run(k), name=f"replies-{k.pool}"))
        # One attempt now, so a healthy deployment is ready the moment it listens; if Redis
        # is not there yet, the heartbeat loop keeps trying and /readyz says 503 meanwhile.
        # Anything else (a policy Redis rejects, a script that does not load) is a real fault:
        # it propagates and the process does not start.
        with contextlib.suppress(RedisUnavailable, RedisConnectionError, RedisTimeoutError, OSError):
            await self._bootstrap()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))

    async def _bootstrap(self) -> None:
        assert self.scripts and self.heartbeat
        await self.scripts.load_all()
        for pool in self.cfg.pools:
            await self.init_pool(pool)
        await self.heartbeat.beat()  # before anything is admitted: claim must see us alive
        self.bootstrapped = True
        log.info("frontend %s ready (pools: %s)", self.frontend_id, ", ".join(self.pool_keys))

    async def init_pool(self, pool: PoolConfig) -> None:
        """Write the pool's static policy; keep_rates leaves the controller's rates alone."""
        assert self.scripts
        await self.scripts.init_pool(self.pool_keys[pool.name], policy_document(self.cfg, pool))

    async def _heartbeat_loop(self) -> None:
        assert self.heartbeat and self.scripts
        loop = asyncio.get_running_loop()
        next_reap = loop.time() + self.settings.reap_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await self._stop.wait()
                return
            try:
                if self.bootstrapped:
                    await self.heartbeat.beat()
                    if self.settings.reap_s and loop.time() >= next_reap:
                        # Frontends sweep too, so requests are finished in time even while no
                        # worker or controller of a pool runs (each call is bounded).
                        next_reap = loop.time() + self.settings.reap_s
                        for keys in self.pool_keys.values():
                            await self.scripts.reap_all(keys, max_calls=4)
                else:
                    await self._bootstrap()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep beating through outages; readiness reports it
                self.metrics.redis_errors.labels("heartbeat").inc()
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        # Cancels started by handlers (client gone, shutdown) must reach Redis first.
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
        if self._end_streams:
            self._end_streams.cancel()
        # Flags, not Task.cancel(): redis-py can swallow a cancellation that lands in a
        # blocking read. The reply loops return within one XREAD block.
        self._stop.set()
        if self.router:
            await self.router.stop()
        if self._tasks:
            block_s = self.router.block_ms / 1000 if self.router else 0.0
            _, pending = await asyncio.wait(self._tasks, timeout=block_s + 1.0)
            for t in pending:
                t.cancel()
        if self.heartbeat and self.bootstrapped:
            await self.heartbeat.leave()
        for counter in self.counters.values():
            await counter.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests; in-flight ones get the grace period to finish.

        Just before aiohttp would cancel the stragglers, tell them to end cleanly instead:
        a stream gets an in-band error event and a proper end, a waiting non-stream request
        a 503, and each is cancelled in Redis with reason 'shutdown' (its worker stops)."""
        if self.shutting_down:
            return
        self.shutting_down = True

        async def end_streams() -> None:
            loop = asyncio.get_running_loop()
            end = loop.time() + max(self.settings.shutdown_grace_s - 0.25, 0.0)
            lost_since = None
            while (now := loop.time()) < end:
                # Redis out of reach for a second (e.g. `qos up` died and took it along): no
                # stream can finish, so end them now rather than at the end of the grace.
                if self.router and not any(self.router.healthy.values()):
                    lost_since = now if lost_since is None else lost_since
                    if now - lost_since >= 1.0:
                        break
                else:
                    lost_since = None
                await asyncio.sleep(min(0.1, max(end - now, 0.0)))
            if self.router:
                self.router.broadcast(Reply("shutdown"))

        self._end_streams = asyncio.create_task(end_streams())

    # --- helpers used by the request path ----------------------------------------------------
    async def count_prompt(self, draft: oa.Draft) -> int:
        """The prompt's tokens in its pool's tokenizer; 503 when the model server must count
        them and cannot (nothing is admitted or charged)."""
        try:
            return await self.counters[draft.pool.name].count(draft.prompt, draft.messages)
        except token_count.TokenizerUnavailable as exc:
            log.warning("pool %s: the upstream tokenizer could not count a prompt: %s", draft.pool.name, exc)
            raise oa.ApiError(503, "Service temporarily unavailable: the model server could not count the "
                              "prompt's tokens; retry shortly", code="tokenizer_unavailable", retry_after_s=1,
                              outcome="unavailable") from exc

    def ready(self) -> bool:
        return self.bootstrapped and self.heartbeat is not None and self.heartbeat.fresh(self._fresh_s)

    def cancel_soon(self, keys: PoolKeys, request_id: str, tenant: str, reason: str) -> None:
        """Cancel in a task of its own: the handler calling this is itself being cancelled."""
        task = asyncio.create_task(self._cancel(keys, request_id, tenant, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, keys: PoolKeys, request_id: str, tenant: str, reason: str) -> None:
        assert self.scripts
        try:
            await self.scripts.cancel(keys, request_id, tenant, reason)
        except Exception as exc:  # claim/reap will catch up once our heartbeat stops
            log.warning("cancel %s (%s) failed: %s", request_id, reason, exc)

    def record_rejection(self, keys: PoolKeys, cls: str, tenant: str, request_id: str, input_tokens: int,
                         waited_ms: float) -> None:
        """A request its class could not start in time (429) or a full queue (503) turned away
        is an SLO miss the controller must see: it gets no latency sample otherwise, and a class could miss
        its attainment on rejections while its window reads ~100 %. One sample, outcome
        ``rejected``, written in a task of its own so the client's answer does not wait."""
        assert self.heartbeat
        sample = build_sample(pool=keys.pool, cls=cls, tenant=tenant, outcome="rejected",
                              request_id=request_id, worker="", input_tokens=input_tokens, output_tokens=0,
                              queue_wait_ms=0, e2e_ms=round(waited_ms),
                              ts_ms=int(self.heartbeat.redis_now_ms()))
        task = asyncio.create_task(self._add_sample(keys, pack_sample(sample)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _add_sample(self, keys: PoolKeys, data: bytes) -> None:
        try:
            await self.client.xadd(keys.samples, {"d": data}, maxlen=SAMPLES_MAXLEN, approximate=True)
        except Exception as exc:  # a lost sample only blurs the controller's view a little
            log.warning("rejection sample for %s not written: %s", keys.pool, exc)

    def drain_estimate_s(self, pool: str, cls: str, depth: int) -> int:
        rate = self.heartbeat.service_rate(pool, cls) if self.heartbeat else None
        return drain_estimate_s(depth, rate, self.classes[cls].max_wait_ms / 1000)


SETTINGS = web.AppKey("settings", FrontendSettings)
CONFIG = web.AppKey("config", QosConfig)
METRICS = web.AppKey("metrics", FrontendMetrics)
FRONTEND = web.AppKey("frontend", Frontend)


# --- one request ----------------------------------------------------------------------------

class Generation:
    """The life of one admitted generation request inside this process."""

    def __init__(self, fe: Frontend, request: web.Request, tenant: TenantConfig, cls: str,
                 req: oa.GenerationRequest, max_wait_ms: int, received: float) -> None:
        assert fe.router and fe.scripts and fe.heartbeat
        self.fe, self.request, self.tenant, self.cls, self.req = fe, request, tenant, cls, req
        self.max_wait_ms = max_wait_ms
        self.received = received
        self.keys = fe.pool_keys[req.pool.name]
        self.class_cfg: ClassConfig = fe.classes[cls]
        self.request_id = "r" + uuid.uuid4().hex
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Reply] | None = None
        self.maybe_admitted = False  # admit may have queued it: cancel on any abnormal exit
        self.terminal = False  # the request reached a final state; nothing left to cancel
        self.forwarded = 0  # tokens forwarded to the client (dedup by offset)
        self.first_token_at: float | None = None
        self.admitted_at = 0.0
        self.local_deadline = math.inf
        self.deadline_active = True
        self.final_grace_used = False
        self.safety_deadline = received + fe.settings.request_timeout_s
        self.labels = (req.pool.name, cls)

    async def run(self) -> web.StreamResponse:
        fe = self.fe
        assert fe.router
        self.queue = fe.router.register(self.request_id)
        fe.metrics.inflight.labels(self.req.pool.name).inc()
        try:
            await self.admit()
            return await (self.stream() if self.req.stream else self.collect())
        except asyncio.CancelledError:
            self.request[LABELS].outcome = "cancelled"
            raise
        finally:
            fe.router.unregister(self.request_id)
            fe.metrics.inflight.labels(self.req.pool.name).dec()
            if self.maybe_admitted and not self.terminal:
                # Abandoned (client gone, timeout, shutdown): stop it everywhere, refund the rest.
                reason = "shutdown" if fe.shutting_down else "client_gone"
                fe.cancel_soon(self.keys, self.request_id, self.tenant.name, reason)

    # --- admission --------------------------------------------------------------------------
    async def admit(self) -> Admitted:
        fe = self.fe
        started = self.loop.time()
        payload = self.req.payload().pack()
        policy_retry = True
        while True:
            if fe.shutting_down:
                raise oa.ApiError(503, "This frontend is shutting down; retry (another one will serve you)",
                                  code="shutting_down", retry_after_s=1, outcome="unavailable")
            if not fe.ready():
                raise RedisUnavailable("the frontend has no live Redis connection (not ready)")
            try:
                adm = await self._admit_once(payload)
            except PolicyMissing:
                # Redis restarted empty (or was flushed): write the policy again, retry once.
                if not policy_retry:
                    raise
                policy_retry = False
                await fe.init_pool(self.req.pool)
                continue
            except Throttled as exc:
                waited_ms = (self.loop.time() - started) * 1000
                budget_ms = self.class_cfg.admission_wait_ms
                if 0 <= exc.retry_after_ms and waited_ms + exc.retry_after_ms <= budget_ms:
                    fe.metrics.admission_retries.labels(*self.labels).inc()
                    # Sleep exactly until the bucket holds enough (+1 ms for rounding): no polling.
                    await asyncio.sleep((exc.retry_after_ms + 1) / 1000)
                    continue
                if exc.bucket == "class":  # a tenant over its own quota is not the system's miss
                    fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                        self.req.prompt_tokens, waited_ms)
                raise
            except Overloaded:
                # The class cannot start it within its max wait: an SLO miss the controller must see.
                fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                    self.req.prompt_tokens, (self.loop.time() - started) * 1000)
                raise
            except QueueFull as exc:
                exc.retry_after_ms = 1000 * fe.drain_estimate_s(self.req.pool.name, self.cls, exc.depth)
                fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                    self.req.prompt_tokens, (self.loop.time() - started) * 1000)
                raise
            break
        now = self.loop.time()
        self.admitted_at = now
        fe.metrics.admission.labels(*self.labels).observe(now - started)
        assert fe.heartbeat
        if adm.deadline_ms:
            remaining_s = (adm.deadline_ms - fe.heartbeat.redis_now_ms()) / 1000
        else:  # a retried call found it admitted already: its deadline is about max wait away
            remaining_s = self.max_wait_ms / 1000
        self.local_deadline = now + max(remaining_s, 0.0) + DEADLINE_SLACK_S
        return adm

    async def _admit_once(self, payload: bytes) -> Admitted:
        fe, t = self.fe, self.tenant
        assert fe.scripts
        # Until the script answers, it may have run (a lost reply, a cancelled handler).
        self.maybe_admitted = True
        try:
            adm = await fe.scripts.admit(
                self.keys, request_id=self.request_id, tenant=t.name, cls=self.cls,
                input_tokens=self.req.prompt_tokens, max_tokens=self.req.max_tokens,
                tenant_rate=t.rate_tokens_s, tenant_burst=t.rate_tokens_s * t.burst_s,
                tenant_max_inflight=t.max_inflight, max_wait_ms=self.max_wait_ms,
                frontend_id=fe.frontend_id, payload=payload, tenant_weight=t.weight)
        except RedisUnavailable:
            raise  # ambiguous: the finally clause of run() cancels, in case it did run
        except QosError:
            self.maybe_admitted = False  # the script said no: nothing was queued or charged
            raise
        if adm.duplicate_state is not None:
            # redis-py retried after a lost reply and the first call had admitted it.
            if adm.duplicate_state not in ("queued", "leased"):
                raise ScriptError(f"request {self.request_id} is already {adm.duplicate_state}")
        return adm

    # --- waiting for replies ----------------------------------------------------------------
    async def next_reply(self) -> Reply:
        """The next reply entry, enforcing the queue deadline and the safety timeout."""
        assert self.queue is not None
        while True:
            now = self.loop.time()
            limit = min(self.safety_deadline, self.local_deadline) if self.deadline_active \
                else self.safety_deadline
            if now >= limit:
                if now >= self.safety_deadline:
                    raise oa.ApiError(503, f"No answer within the {self.fe.settings.request_timeout_s:g} s "
                                      "request timeout", code="request_timeout", retry_after_s=1,
                                      outcome="timeout")
                await self.on_deadline()
                continue
            try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                async with asyncio.timeout(limit - now):
                    return await self.queue.get()
            except TimeoutError:
                continue

    async def on_deadline(self) -> None:
        """The max queue wait passed with no token yet: ask Redis whether it is still queued."""
        fe = self.fe
        assert fe.scripts
        state = await fe.scripts.cancel(self.keys, self.request_id, self.tenant.name, "expired")
        if state == "expired":
            self.terminal = True
            raise await self.expired_error()
        if state == "running":
            self.deadline_active = False  # a worker has it: only the safety timeout applies now
            return
        # Finished (or gone) already: its final entry is in the reply stream or never comes
        # (e.g. claim cancelled it while our heartbeat was late). Give it a short grace.
        if state.startswith("final:") and not self.final_grace_used:
            self.final_grace_used = True
            self.local_deadline = self.loop.time() + FINAL_GRACE_S
            return
        self.terminal = True
        raise oa.ApiError(503, f"The request ended without an answer ({state})", code="request_lost",
                          retry_after_s=1, outcome="failed")

    async def expired_error(self) -> oa.ApiError:
        fe = self.fe
        try:
            depth = int(await fe.client.hget(self.keys.queued, self.cls) or 0)
        except Exception:
            depth = 0
        wait_s = fe.drain_estimate_s(self.req.pool.name, self.cls, depth)
        return oa.ApiError(503, f"The request waited past its max queue wait ({self.max_wait_ms} ms) "
                           f"without a worker taking it; {depth} requests are queued in class {self.cls}",
                           code="queue_timeout", retry_after_s=wait_s, outcome="expired")

    def reply_error(self, r: Reply) -> oa.ApiError:
        if r.kind == "shutdown":  # not terminal: run() cancels it in Redis
            return oa.ApiError(503, "This frontend is shutting down; the request was cancelled, retry it",
                               code="shutting_down", retry_after_s=1, outcome="unavailable")
        self.terminal = True
        if r.code == "expired":
            wait_s = self.fe.drain_estimate_s(self.req.pool.name, self.cls, 0)
            return oa.ApiError(503, f"The request waited past its max queue wait: {r.message}",
                               code="queue_timeout", retry_after_s=wait_s, outcome="expired")
        if r.code == "cancelled":  # e.g. this frontend's heartbeat was late and it was taken for dead
            return oa.ApiError(503, f"The request was cancelled: {r.message}", code="request_cancelled",
                               retry_after_s=1, outcome="cancelled")
        return oa.ApiError(503, f"The worker failed the request: {r.message}", code="worker_failed",
                           retry_after_s=1, outcome="failed")

    def accept(self, r: Reply) -> str:
        """The text of ``r`` not yet forwarded ('' for a replay from a resumed stream)."""
        if r.offset > self.forwarded:  # push_tokens checks offsets, so this is a bug upstream
            log.warning("%s: gap in reply stream (offset %d, forwarded %d)", self.request_id, r.offset,
                        self.forwarded)
        self.deadline_active = False  # a worker has it: the queue deadline no longer applies
        text, forwarded = dedup(r, self.forwarded)
        if r.count and forwarded == self.forwarded:
            self.fe.metrics.reply_entries.labels(self.req.pool.name, "dup").inc()
        self.forwarded = forwarded
        if self.first_token_at is None and (r.count or r.kind == "done"):
            self.first_token_at = self.loop.time()
            self.fe.metrics.queue_wait.labels(*self.labels).observe(self.first_token_at - self.admitted_at)
            self.fe.metrics.ttft.labels(*self.labels).observe(self.first_token_at - self.received)
        return text

    def observe_done(self, r: Reply) -> None:
        self.terminal = True
        if self.first_token_at is not None and r.usage_out > 1:
            self.fe.metrics.tpot.labels(*self.labels).observe(
                (self.loop.time() - self.first_token_at) / (r.usage_out - 1))

    # --- answers ------------------------------------------------------------------------------
    async def collect(self) -> web.Response:
        parts: list[str] = []
        while True:
            r = await self.next_reply()
            if r.kind in ("err", "shutdown"):
                raise self.reply_error(r)
            parts.append(self.accept(r))
            if r.kind == "done":
                self.observe_done(r)
                body = oa.full_response(self.req, self.request_id, self.created, "".join(parts), r.finish,
                                        r.usage_in, r.usage_out)
                return web.json_response(body, headers={REQUEST_ID_HEADER: self.request_id},
                                         dumps=_dumps)

    async def stream(self) -> web.StreamResponse:
        resp: web.StreamResponse | None = None
        req, rid, created = self.req, self.request_id, self.created

        async def open_stream() -> web.StreamResponse:
            # Headers go out with the first token, not before: until then a queue timeout
            # can still be an honest 503 rather than an error inside a 200 stream.
            s = web.StreamResponse(headers={
                "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no", REQUEST_ID_HEADER: rid})
            await s.prepare(self.request)
            if req.kind == "chat":
                opener = oa.chunk(req, rid, created, role=True, usage_so_far=(req.prompt_tokens, 0))
                await s.write(oa.sse(opener))
            return s

        try:
            while True:
                try:
                    r = await self.next_reply()
                    if r.kind in ("err", "shutdown"):
                        raise self.reply_error(r)
                except oa.ApiError as exc:
                    if resp is None:
                        raise
                    # Mid-stream: the status is sent; report in-band as OpenAI does.
                    self.request[LABELS].outcome = exc.outcome
                    await resp.write(oa.sse(exc.body()))
                    return resp
                text = self.accept(r)
                if resp is None:
                    resp = await open_stream()
                if text:
                    await resp.write(oa.sse(oa.chunk(req, rid, created, text=text,
                                                     usage_so_far=(req.prompt_tokens, self.forwarded))))
                if r.kind == "done":
                    self.observe_done(r)
                    await resp.write(oa.sse(oa.chunk(req, rid, created, reason=r.finish,
                                                     usage_so_far=(r.usage_in, r.usage_out))))
                    if req.include_usage:
                        await resp.write(oa.sse(oa.usage_chunk(req, rid, created, r.usage_in, r.usage_out)))
                    await resp.write(oa.sse("[DONE]"))
                    await resp.write_eof()
                    return resp
        except ConnectionError:
            # The client closed the connection mid-stream (aiohttp's reset errors are
            # ConnectionErrors): the finally clause in run() cancels the request.
            self.request[LABELS].outcome = "cancelled"
            return resp or web.Response(status=499)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# --- handlers -------------------------------------------------------------------------------

def _frontend(request: web.Request) -> Frontend:
    return request.app[FRONTEND]


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise oa.ApiError(400, f"Request body is {request.content_length} bytes, over the {limit}-byte limit",
                          code="request_too_large")
    try:
        # A client that announces a body and sends it slowly (or never) must not hold a
        # handler and its buffer for ever: aiohttp itself has no timeout on a body read.
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError as exc:
        raise oa.ApiError(408, f"The request body did not arrive within {timeout_s:g} s", code="body_timeout",
                          err_type="invalid_request_error") from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise oa.ApiError(400, f"Request body is over the {limit}-byte limit",
                          code="request_too_large") from exc
    except (ConnectionError, aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError) as exc:
        # A truncated or broken upload: the client's fault (and it is probably gone).
        raise oa.ApiError(400, f"Could not read the request body: {exc}", code="invalid_body") from exc


def _max_wait_ms(header: str | None, cls: ClassConfig) -> int:
    """The client may shorten, never lengthen, its class's max queue wait."""
    if header is None:
        return cls.max_wait_ms
    try:
        v = int(header.strip())
    except ValueError:
        v = 0
    if not 1 <= v <= 86_400_000:
        raise oa.ApiError(400, f"{MAX_WAIT_HEADER} must be an integer number of milliseconds in "
                          "[1, 86400000]", code="invalid_value", param=MAX_WAIT_HEADER)
    return min(v, cls.max_wait_ms)


def _generation_handler(kind: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        received = asyncio.get_running_loop().time()
        fe = _frontend(request)
        labels = request[LABELS]
        tenant = fe.keyring.identify(request.headers.get("Authorization"))
        labels.tenant = tenant.name
        cls = resolve_class(fe.cfg, tenant, request.headers.get(CLASS_HEADER))
        labels.cls = cls
        raw = await _read_body(request, fe.settings.max_body_bytes, fe.settings.body_timeout_s)
        body = oa.parse_json(raw)
        pool = oa.resolve_pool(fe.cfg, body)
        labels.pool = pool.name
        draft = oa.parse_request(kind, body, fe.cfg)
        req = oa.finish_request(draft, await fe.count_prompt(draft))
        max_wait = _max_wait_ms(request.headers.get(MAX_WAIT_HEADER), fe.classes[cls])
        return await Generation(fe, request, tenant, cls, req, max_wait, received).run()

    return handler


def _model_object(pool: PoolConfig) -> dict[str, Any]:
    return {"id": pool.model_name, "object": "model", "created": 0, "owned_by": "qos",
            "max_model_len": pool.context_tokens}


async def models(request: web.Request) -> web.Response:
    fe = _frontend(request)
    fe.keyring.identify(request.headers.get("Authorization"))
    return web.json_response({"object": "list", "data": [_model_object(p) for p in fe.cfg.pools]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``); ids may contain '/'."""
    fe = _frontend(request)
    fe.keyring.identify(request.headers.get("Authorization"))
    return web.json_response(_model_object(oa.resolve_pool(fe.cfg, {"model": request.match_info["id"]})))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "frontend": _frontend(request).frontend_id})


@functools.cache
def _script_shas() -> list[str]:
    """The SHA1s Redis knows the scripts by (as redis-py computes them for EVALSHA)."""
    return [hashlib.sha1(script_source(n).encode()).hexdigest() for n in SCRIPT_NAMES]


async def readyz(request: web.Request) -> web.Response:
    """``/readyz``, and ``/health`` (vLLM's name for it, which guidellm and vLLM's tooling
    probe before they send anything): 200 only when this frontend can admit requests."""
    fe = _frontend(request)
    problem = ""
    try:
        if fe.shutting_down:
            problem = "shutting down"
        elif not fe.bootstrapped:
            problem = "not connected to Redis yet"
        else:
            async with asyncio.timeout(2.0):
                await fe.client.ping()
                loaded = await fe.client.script_exists(*_script_shas())
                if not all(loaded):  # Redis restarted and lost its script cache: load again
                    assert fe.scripts
                    await fe.scripts.load_all()
            if not fe.ready():
                problem = "heartbeat is stale"
            elif down := await _pools_with_upstream_down(fe):
                problem = f"every worker of pool {', '.join(down)} reports its upstream unreachable"
    except (TimeoutError, QosError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
        log.warning("readiness: Redis unavailable: %s", exc)
        problem = "Redis unavailable"  # /readyz is unauthenticated: no address, no driver text
    if problem:
        return web.json_response({"status": "unavailable", "reason": problem}, status=503,
                                 headers={"Retry-After": "1"})
    return web.json_response({"status": "ready", "frontend": fe.frontend_id})


async def _pools_with_upstream_down(fe: Frontend) -> list[str]:
    """Pools none of whose live workers can serve: each one's heartbeat says its upstream
    is unreachable (openai engine, breaker open). A pool with no worker heartbeat at all is
    left alone: workers may simply not have started yet, and admitted work waits for them."""
    down = []
    for name, keys in fe.pool_keys.items():
        ids = await fe.client.zrange(keys.workers, 0, -1)
        if not ids:
            continue
        pipe = fe.client.pipeline(transaction=False)
        for w in ids:
            wid = w.decode() if isinstance(w, bytes) else str(w)
            pipe.hmget(keys.worker(wid), ["engine", "upstream_state"])
        rows = [r for r in await pipe.execute() if r[0] is not None]  # no hash: its heartbeat expired
        if rows and all(r[1] in (b"open", "open") for r in rows):
            down.append(name)
    return down


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def qos_status(request: web.Request) -> web.Response:
    fe = _frontend(request)
    require_admin(fe.keyring.identify(request.headers.get("Authorization")))
    snap = await status_mod.snapshot(fe.client, fe.cfg)
    snap["frontend"] = fe.frontend_id
    return web.json_response(snap, dumps=_dumps)


# --- errors -----------------------------------------------------------------------------------

def _to_api_error(exc: BaseException) -> oa.ApiError:
    """Map the limiter.errors hierarchy (and HTTP/Redis exceptions) to one HTTP answer."""
    if isinstance(exc, oa.ApiError):
        return exc
    if isinstance(exc, Overloaded):
        retry_s = 5 if exc.retry_after_ms < 0 else max(1, math.ceil(exc.retry_after_ms / 1000))
        return oa.ApiError(429, f"Overloaded: {exc}; retry in {retry_s} s", code="max_wait_exceeded",
                           retry_after_s=retry_s, outcome="throttled")
    if isinstance(exc, Throttled):
        if exc.retry_after_ms < 0:
            return oa.ApiError(429, f"Class {exc.bucket} is disabled right now (its ceiling is 0)",
                               code="rate_limit_exceeded", retry_after_s=5, outcome="throttled")
        return oa.ApiError(429, f"Rate limit reached: the {exc.bucket} token bucket is empty; retry in "
                           f"{exc.retry_after_ms} ms", code="rate_limit_exceeded",
                           retry_after_s=max(1, math.ceil(exc.retry_after_ms / 1000)), outcome="throttled")
    if isinstance(exc, TenantBusy):
        return oa.ApiError(429, f"Too many concurrent requests: {exc}", code="too_many_inflight",
                           retry_after_s=1, outcome="throttled")
    if isinstance(exc, QueueFull):
        return oa.ApiError(503, f"Overloaded: the {exc.cls} queue is full ({exc.depth} waiting); retry later",
                           code="queue_full", retry_after_s=max(1, math.ceil(exc.retry_after_ms / 1000)),
                           outcome="shed")
    if isinstance(exc, InvalidArgument):
        return oa.ApiError(400, str(exc), code="invalid_value", param=exc.field)
    if isinstance(exc, RedisUnavailable | PolicyMissing | RedisConnectionError | RedisTimeoutError):
        # The client learns what happened, not the store's address or the driver's text (the
        # heartbeat loop logs the outage once per beat; per request it would flood the log).
        log.debug("Redis unavailable: %s", exc)
        return oa.ApiError(503, "Service temporarily unavailable: the request queue cannot be reached; retry "
                           "shortly", code="redis_unavailable", retry_after_s=1, outcome="unavailable")
    if isinstance(exc, web.HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        outcome = "not_found" if exc.status == 404 else "bad_request"
        return oa.ApiError(exc.status, exc.reason, code=code, outcome=outcome)
    return oa.ApiError(500, "Internal server error", code="internal_error", outcome="error")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        err = _to_api_error(exc)
        if err.status >= 500 and err.code == "internal_error":
            log.exception("unhandled error on %s %s", request.method, request.path)
        if err.status in (429, 503) and counted:
            request.app[METRICS].rejections.labels(labels.pool, labels.cls, str(err.status),
                                                   err.code or "").inc()
        labels.outcome = err.outcome
        if counted:
            _count(request, err.outcome)
        return web.json_response(err.body(), status=err.status, headers=err.headers())
    if counted:
        _count(request, labels.outcome)
    return resp


def _count(request: web.Request, outcome: str) -> None:
    labels = request[LABELS]
    request.app[METRICS].requests.labels(labels.pool, labels.cls, labels.tenant, outcome).inc()


# --- the application --------------------------------------------------------------------------

async def _on_shutdown(app: web.Application) -> None:
    # Runs once the listening sockets are closed, before aiohttp waits out the grace period.
    if FRONTEND in app:
        app[FRONTEND].begin_shutdown()


def create_app(settings: FrontendSettings, cfg: QosConfig, *,
               frontend_id: str | None = None) -> web.Application:
    """The frontend as an aiohttp app; Redis is opened and closed with the app's lifetime."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware])
    app[SETTINGS] = settings
    app[CONFIG] = cfg
    app[METRICS] = FrontendMetrics()

    async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
        fe = Frontend(settings, cfg, app[METRICS], frontend_id)
        app[FRONTEND] = fe
        await fe.start()
        yield
        fe.begin_shutdown()
        await fe.stop()

    app.cleanup_ctx.append(redis_ctx)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", _generation_handler("chat"))
    app.router.add_post("/v1/completions", _generation_handler("completion"))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)
    app.router.add_get("/v1/qos/status", qos_status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/health", readyz)
    app.router.add_get("/metrics", metrics)
    return app
