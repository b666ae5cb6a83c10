"""One generation request inside this process: admission, waiting for the reply stream,
and the answer (one JSON body, or an SSE stream).

The state machine of :class:`Generation`:

1. register a reply queue, then admit (one script call). An empty bucket is waited out
   when the wait fits the class's ``admission_wait_ms``, else 429 with an exact
   ``Retry-After``; a full queue is 503 with a ``Retry-After`` from the measured drain rate;
2. wait for reply entries, forwarding tokens in order (deduplicated by offset). If the
   queue deadline passes before the first token, ``cancel(expired)`` decides: still queued
   -> 503, already running -> keep waiting. A safety timeout bounds every request;
3. a client that goes away (a failed write, or aiohttp cancelling the handler) cancels
   the request everywhere; so does shutdown after its grace period.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from limiter.config import ClassConfig, TenantConfig
from limiter.errors import (
    Overloaded,
    PolicyMissing,
    QosError,
    QueueFull,
    RedisUnavailable,
    ScriptError,
    Throttled,
)
from limiter.frontend import openai_api as oa
from limiter.frontend.errors import LABELS, ApiError
from limiter.frontend.replies import REPLIES_LOST, Reply, dedup
from limiter.frontend.runtime import Frontend
from limiter.redis_conn import map_redis_errors
from limiter.reply_text import pack, unpack, unpack_in_order
from limiter.scripts import MAX_PAYLOAD_BYTES, Admitted

log = logging.getLogger("qos.frontend")
_T = TypeVar("_T")

REQUEST_ID_HEADER = "X-QoS-Request-Id"
# The same id under OpenAI's own header, which its SDKs read (``response._request_id``) and
# their users quote in logs and bug reports.
OPENAI_REQUEST_ID_HEADER = "x-request-id"
# After cancel(expired) finds the request already finished, its final entry is on the way.
FINAL_GRACE_S = 2.0
# Slack added to Redis' deadline: Redis' own expiry (claim) and ours then agree on the outcome.
DEADLINE_SLACK_S = 0.02
# A write to a streaming client may last until request_timeout_s plus this: the grace lets the
# in-band error that says why a stream ended still go out.
WRITE_GRACE_S = 2.0


class ClientStalled(Exception):
    """The client stopped reading and its socket stayed full past the request's time."""


class _SseResponse(web.StreamResponse):
    """A stream whose headers wait for its first body write and go out with it (one send
    instead of two; aiohttp >= 3.11 honours the flag, older versions send them at once)."""

    _send_headers_immediately = False


def queued_payload(req: oa.GenerationRequest, param: str | None = None) -> bytes:
    """The payload a request is queued with; a 400 naming its field past what one may hold
    (``MAX_PAYLOAD_BYTES``). admit.lua would refuse it as 'payload', a field the client never
    sent; a chat request carries its text twice (rendered and as messages), so this comes
    before max_body_bytes can. ``param``: the prompt's field as the client sent it (the
    draft's ``prompt_param``; by default the request kind's)."""
    payload = req.payload().pack()
    if len(payload) > MAX_PAYLOAD_BYTES:
        param = param or ("messages" if req.kind == "chat" else "prompt")
        raise ApiError(400, f"The request is too large to queue: its '{param}' take {len(payload)} bytes "
                       f"as queued, over the {MAX_PAYLOAD_BYTES >> 20} MiB a request may hold",
                       code="request_too_large", param=param)
    return payload


class Generation:
    """The life of one admitted generation request inside this process."""

    def __init__(self, fe: Frontend, request: web.Request, tenant: TenantConfig, cls: str,
                 req: oa.GenerationRequest, payload: bytes, max_wait_ms: int, received: float,
                 client_request_id: str | None = None) -> None:
        self.fe, self.request, self.tenant, self.cls, self.req = fe, request, tenant, cls, req
        self.payload = payload  # what is queued: queued_payload(req)
        self.max_wait_ms = max_wait_ms
        self.received = received
        self.keys = fe.pool_keys[req.pool.name]
        self.class_cfg: ClassConfig = fe.classes[cls]
        self.request_id = "r" + uuid.uuid4().hex
        # The id the client reads (the answer's id, x-request-id): its own X-Request-Id when
        # it sent one, as vLLM answers; Redis and X-QoS-Request-Id keep the service's own.
        self.public_id = client_request_id or self.request_id
        self.created = int(time.time())
        # Times are time.monotonic(), not the loop's clock: uvloop's counts whole milliseconds
        # and stands still within a turn, and the admission and TTFT histograms have
        # sub-millisecond buckets (every figure was a whole ms). ``received`` is one too.
        # Registered before admitting: a fast worker's first tokens may arrive before admit
        # returns. run() or run_to_answer(), awaited (or made a task) right after
        # construction, unregisters it in any case.
        self.queue = fe.router.register(self.request_id, req.pool.name)
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
        self.streamed_chars = 0  # a stream's answer characters sent so far (a completion's offsets)
        self.echo_pending = req.echo  # a streamed completion's `echo`, still to send

    async def run(self) -> web.StreamResponse:
        return await self.run_admitted(lambda: self.stream() if self.req.stream else self.collect())

    async def run_to_answer(self) -> dict[str, Any]:
        """Admit and wait for the whole answer, written by the caller (one of several
        choices: limiter/frontend/choices.py)."""
        return await self.run_admitted(self.answer)

    async def run_admitted(self, then: Callable[[], Awaitable[_T]]) -> _T:
        fe = self.fe
        fe.metrics.inflight.labels(self.req.pool.name).inc()
        try:
            await self.admit()
            return await then()
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
        started = time.monotonic()
        payload = self.payload
        policy_retry = True
        while True:
            if fe.shutting_down:
                raise ApiError(503, "This frontend is shutting down; retry (another one will serve you)",
                                  code="shutting_down", retry_after_s=1, outcome="unavailable")
            if why := fe.not_ready_because(self.req.pool.name):
                raise RedisUnavailable(f"this frontend is not ready: {why}")
            try:
                adm = await self._admit_once(payload)
            except PolicyMissing:
                # Redis restarted empty (or was flushed): write the policy again, retry once.
                if not policy_retry:
                    raise
                policy_retry = False
                asked_at = time.monotonic()
                await fe.init_pool(self.req.pool)
                # Our heartbeat entry went with it: until the next beat (heartbeat_s away) claim
                # took this frontend for dead and cancelled what it admitted meanwhile (503
                # request_cancelled with the frontend alive). Beat first, as at the start.
                with map_redis_errors():
                    await fe.heartbeat.beat_since(self.keys, asked_at)
                continue
            except Throttled as exc:
                waited_ms = (time.monotonic() - started) * 1000
                budget_ms = self.class_cfg.admission_wait_ms
                # Slept only if the request may still run after it: past request_timeout_s it
                # would be admitted (and charged) only to time out at once.
                wakes = time.monotonic() + exc.retry_after_ms / 1000
                if 0 <= exc.retry_after_ms and waited_ms + exc.retry_after_ms <= budget_ms \
                        and wakes < self.safety_deadline:
                    fe.metrics.admission_retries.labels(*self.labels).inc()
                    # Sleep exactly until the bucket holds enough (+1 ms for rounding): no polling.
                    await asyncio.sleep((exc.retry_after_ms + 1) / 1000)
                    continue
                if exc.bucket == "class":  # a tenant over its own quota is not the system's miss
                    fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                        self.req.prompt_tokens, waited_ms)
                else:
                    fe.quota.refused(self.req.pool.name, self.tenant.name)
                raise
            except Overloaded as exc:
                # The class cannot start it within its max wait: an SLO miss the controller must
                # see -- unless only the client's own shorter wait refused it: then a bound on
                # its first token, judged against the class's TTFT target.
                own = 0 <= exc.est_wait_ms <= self.class_cfg.max_wait_ms \
                    and self.max_wait_ms < self.class_cfg.max_wait_ms
                fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                    self.req.prompt_tokens, (time.monotonic() - started) * 1000,
                                    ttft_at_least_ms=exc.est_wait_ms if own else None)
                raise
            except QueueFull as exc:
                exc.retry_after_ms = 1000 * fe.drain_estimate_s(self.req.pool.name, self.cls, exc.depth)
                fe.record_rejection(self.keys, self.cls, self.tenant.name, self.request_id,
                                    self.req.prompt_tokens, (time.monotonic() - started) * 1000)
                raise
            break
        now = time.monotonic()
        self.admitted_at = now
        fe.router.admitted(self.request_id, self.req.pool.name)
        fe.quota.admitted(self.req.pool.name, self.tenant.name)
        fe.metrics.admission.labels(*self.labels).observe(now - started)
        if adm.deadline_ms:
            remaining_s = (adm.deadline_ms - fe.heartbeat.redis_now_ms(self.req.pool.name)) / 1000
        else:  # a retried call found it admitted already: its deadline is about max wait away
            remaining_s = self.max_wait_ms / 1000
        self.local_deadline = now + max(remaining_s, 0.0) + DEADLINE_SLACK_S
        return adm

    async def _admit_once(self, payload: bytes) -> Admitted:
        fe, t = self.fe, self.tenant
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
        while True:
            now = time.monotonic()
            limit = min(self.safety_deadline, self.local_deadline) if self.deadline_active \
                else self.safety_deadline
            if now >= limit:
                if now >= self.safety_deadline:
                    raise ApiError(503, f"No answer within the {self.fe.settings.request_timeout_s:g} s "
                                      "request timeout", code="request_timeout", retry_after_s=1,
                                      should_retry=False, outcome="timeout")
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
            self.local_deadline = time.monotonic() + FINAL_GRACE_S
            return
        self.terminal = True
        raise ApiError(503, f"The request ended without an answer ({state})", code="request_lost",
                          retry_after_s=1, outcome="failed")

    async def expired_error(self) -> ApiError:
        fe = self.fe
        try:
            depth = int(await fe.client.hget(self.keys.queued, self.cls) or 0)
        except Exception:
            depth = 0
        wait_s = fe.drain_estimate_s(self.req.pool.name, self.cls, depth)
        return ApiError(503, f"The request waited past its max queue wait ({self.max_wait_ms} ms) "
                           f"without a worker taking it; {depth} requests are queued in class {self.cls}",
                           code="queue_timeout", retry_after_s=wait_s, outcome="expired")

    def reply_error(self, r: Reply) -> ApiError:
        if r.kind == "shutdown":  # not terminal: run() cancels it in Redis
            return ApiError(503, "This frontend is shutting down; the request was cancelled, retry it",
                               code="shutting_down", retry_after_s=1, outcome="unavailable")
        if r.code == REPLIES_LOST:  # (the router's, not Redis': the request may still run)
            return self.replies_lost_error()
        self.terminal = True
        if r.code == "expired":
            wait_s = self.fe.drain_estimate_s(self.req.pool.name, self.cls, 0)
            return ApiError(503, f"The request waited past its max queue wait: {r.message}",
                               code="queue_timeout", retry_after_s=wait_s, outcome="expired")
        if r.code == "lost":  # its record was gone (Redis lost data): nothing runs it any more
            return ApiError(503, "The service lost this request's state; retry it", code="request_lost",
                               retry_after_s=1, outcome="failed")
        if r.code == "cancelled":  # e.g. this frontend's heartbeat was late and it was taken for dead
            return ApiError(503, f"The request was cancelled: {r.message}", code="request_cancelled",
                               retry_after_s=1, outcome="cancelled")
        # Failed for what the request is (lua/complete.lua 'refused', claim's 'too_large'): a
        # retry fails the same way, so a 400 as the model server itself would answer (a 503
        # made the OpenAI SDK send it twice more, each admitted, charged and failed again).
        if r.code == "too_large":
            return ApiError(400, f"The request cannot be served: {r.message}", code="context_length_exceeded",
                               outcome="refused")
        if r.code == "refused":
            return ApiError(400, f"The request cannot be served: {r.message}", code="request_refused",
                               outcome="refused")
        # All max_attempts attempts ended with their worker dead or the model server broken
        # mid-answer (lua/release.lua, the janitor): a prompt that kills workers, say. An SDK's
        # resends (twice by default) would each be admitted, charged and tried as often again.
        exhausted = r.code == "exhausted"
        return ApiError(503, f"The worker failed the request: {r.message}", code="worker_failed",
                           retry_after_s=1, should_retry=False if exhausted else None, outcome="failed")

    def replies_lost_error(self) -> ApiError:
        """Reply entries of this request were lost unread (trimmed from a reply stream this
        frontend fell too far behind on): its answer cannot be whole. Not terminal: run()
        cancels it in Redis (its worker stops, its tenant is refunded the rest)."""
        self.fe.metrics.replies_lost.labels(self.req.pool.name).inc()
        return ApiError(503, "Part of this request's answer was lost before this frontend could relay it; "
                             "retry it", code=REPLIES_LOST, retry_after_s=1, outcome="failed")

    def accept(self, r: Reply) -> str:
        """The text of ``r`` not yet forwarded ('' for a replay from a resumed stream). An
        entry that starts past what was forwarded means the entries between were lost (push
        and complete check offsets, so only a reply stream trimmed unread does this): its
        text after a hole would be a wrong answer given as a whole one, so the request fails."""
        if r.offset > self.forwarded:
            log.error("%s: reply entries lost (an entry at token %d, %d forwarded); answered 503 %s",
                      self.request_id, r.offset, self.forwarded, REPLIES_LOST)
            raise self.replies_lost_error()
        self.deadline_active = False  # a worker has it: the queue deadline no longer applies
        text, forwarded = dedup(r, self.forwarded)
        if r.count and forwarded == self.forwarded:
            self.fe.metrics.replayed_replies.labels(self.req.pool.name).inc()
        self.forwarded = forwarded
        if self.first_token_at is None and (r.count or r.kind == "done"):
            self.first_token_at = time.monotonic()
            self.fe.metrics.queue_wait.labels(*self.labels).observe(self.first_token_at - self.admitted_at)
            ttft_s = self.first_token_at - self.received
            self.fe.metrics.ttft.labels(*self.labels).observe(ttft_s)
            target_ms = self.fe.slos[self.cls].ttft_target_ms(self.req.prompt_tokens)
            if target_ms is not None:  # judged as the controller judges, allowance and all
                met = "yes" if ttft_s * 1000.0 <= target_ms else "no"
                self.fe.metrics.ttft_target.labels(*self.labels, met).inc()
        return text

    def observe_done(self, r: Reply) -> None:
        self.terminal = True
        if self.first_token_at is not None and r.usage_out > 1:
            self.fe.metrics.tpot.labels(*self.labels).observe(
                (time.monotonic() - self.first_token_at) / (r.usage_out - 1))

    # --- answers ------------------------------------------------------------------------------
    async def collect(self) -> web.Response:
        return await self.send_json(await self.answer())

    async def answer(self) -> dict[str, Any]:
        """The whole answer (an unstreamed request's JSON body), once its last entry came."""
        return self.full_answer(*await self.whole_reply())

    async def whole_reply(self) -> tuple[str, Reply]:
        """The answer's packed text (limiter/reply_text.py) and its last entry, once it came."""
        parts: list[str] = []
        while True:
            r = await self.next_reply()
            if r.kind in ("err", "shutdown"):
                raise self.reply_error(r)
            parts.append(self.accept(r))
            if r.kind == "done":
                self.observe_done(r)
                return "".join(parts), r

    def full_answer(self, text: str, r: Reply) -> dict[str, Any]:
        """The whole answer of packed ``text`` ended by ``r``, in the request's endpoint's shape."""
        answer = unpack(text)
        if self.req.echo:  # (a completion's: its text begins with the prompt)
            answer = answer._replace(content=self.req.prompt + answer.content)
        return oa.full_response(self.req, self.public_id, self.created, answer.content, r.finish,
                                r.usage_in, r.usage_out,
                                (answer.field, answer.reasoning) if answer.reasoning else None,
                                oa.merge_tool_calls(answer.tool_calls), answer.logprobs)

    async def send_json(self, body: dict[str, Any], record_ids: str | None = None) -> web.Response:
        """Write an unstreamed answer (``record_ids``: its records' ids, several answers'
        joined by commas; default this one's). Written here, under the same bound as a
        stream's writes: returned, aiohttp wrote it with none, and a client that read nothing
        held the connection, the handler and the whole answer for as long as it kept its
        socket open."""
        resp = web.json_response(body, headers={REQUEST_ID_HEADER: record_ids or self.request_id,
                                                OPENAI_REQUEST_ID_HEADER: self.public_id},
                                 dumps=oa.compact_json)
        try:
            await self.bounded_write(resp.prepare(self.request))
            await self.bounded_write(resp.write_eof())
        except ConnectionError:  # the client left; its request is done in Redis
            self.request[LABELS].outcome = "cancelled"
        except ClientStalled:
            self.drop_stalled_client()
        return resp

    def drop_stalled_client(self) -> None:
        """Nothing more can reach a client that stopped reading in time: drop its connection
        (and what is buffered for it)."""
        log.info("%s: the client stopped reading; dropped after the %g s request timeout",
                 self.request_id, self.fe.settings.request_timeout_s)
        self.request[LABELS].outcome = "timeout"
        if self.request.transport is not None:
            self.request.transport.abort()

    async def bounded_write(self, aw: Awaitable[Any]) -> None:
        """One write to the client, bounded by the request's safety deadline (plus the grace):
        a client that stops reading but keeps its socket open held this handler, its reply
        queue and everything the worker sent for as long as it liked -- and once the worker is
        done its tenant's max_inflight no longer counts it."""
        try:
            async with asyncio.timeout_at(self.safety_deadline + WRITE_GRACE_S):
                await aw
        except TimeoutError:
            raise ClientStalled from None

    async def stream(self) -> web.StreamResponse:
        """The SSE answer. Each reply entry becomes one socket write (headers, the chat opener,
        text, finish, usage and ``[DONE]`` are joined where they fall together): a send on a
        loopback socket was a third of this process's CPU at full load, and the client sees
        the same events either way."""
        resp: web.StreamResponse | None = None
        try:
            while True:
                try:
                    r = await self.next_reply()
                    if r.kind in ("err", "shutdown"):
                        raise self.reply_error(r)
                    text = self.accept(r)
                except ApiError as exc:
                    if resp is None:
                        raise
                    return await self.end_with_error(resp, exc)
                out: list[bytes] = []
                if resp is None:
                    if not text and r.kind != "done":
                        # a token with no text yet (the first byte of a character): nothing the
                        # client could see, and a failure after it is still an honest 503
                        continue
                    resp = await self.open_sse()
                    out = self.sse_opener()
                out += self.sse_chunks(r, text)
                if r.kind == "done":
                    out += self.sse_end(r.usage_in, r.usage_out)
                    await self.bounded_write(resp.write_eof(b"".join(out)))
                    return resp
                if out:
                    await self.bounded_write(resp.write(b"".join(out)))
        except (ConnectionError, ClientStalled) as exc:
            # the finally clause in run() cancels the request if it is still running
            return self.ended_by_client(resp, exc)

    def ended_by_client(self, resp: web.StreamResponse | None,
                        exc: ConnectionError | ClientStalled) -> web.StreamResponse:
        """A stream its client ended: it closed the connection mid-stream (aiohttp's reset
        errors are ConnectionErrors), or stopped reading (dropped). Its request(s) are
        cancelled by the caller's cleanup."""
        if isinstance(exc, ClientStalled):
            self.drop_stalled_client()
        else:
            self.request[LABELS].outcome = "cancelled"
        return resp or web.Response(status=499)

    async def open_sse(self, record_ids: str | None = None) -> web.StreamResponse:
        """The stream's headers, which go out with its first body write: sent at the first
        token, not before, so that until then a queue timeout can still be an honest 503
        rather than an error inside a 200 stream. (``record_ids`` as for :meth:`send_json`.)"""
        s = _SseResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", REQUEST_ID_HEADER: record_ids or self.request_id,
            OPENAI_REQUEST_ID_HEADER: self.public_id})
        await self.bounded_write(s.prepare(self.request))
        return s

    async def end_with_error(self, resp: web.StreamResponse, exc: ApiError,
                             before: bytes = b"") -> web.StreamResponse:
        """Mid-stream: the status is sent; report in-band as OpenAI does (after ``before``,
        chunks that came ahead of the failure). The end goes with it, under the bound:
        returned unended, aiohttp's own write_eof waited without one on a client that read
        nothing (its socket full), for ever."""
        self.request[LABELS].outcome = exc.outcome
        await self.bounded_write(resp.write_eof(before + oa.sse(exc.body())))
        return resp

    def sse_opener(self, index: int = 0) -> list[bytes]:
        """A chat's first chunk (its role), as the choice ``index``."""
        if self.req.kind != "chat":
            return []
        return [oa.sse(oa.chunk(self.req, self.public_id, self.created, index=index, role=True,
                                usage_so_far=(self.req.prompt_tokens, 0)))]

    def sse_chunks(self, r: Reply, text: str, index: int = 0) -> list[bytes]:
        """The chunks of one reply entry (``text``: what :meth:`accept` returned for it), as the
        choice ``index``: its text, and the finish when it is the last."""
        req, rid, created = self.req, self.public_id, self.created  # rid: what the chunks' ids read
        out: list[bytes] = []
        if self.echo_pending and (text or r.kind == "done"):
            # the prompt, before the answer's first text (packed: a NUL in it is text)
            text, self.echo_pending = pack(req.prompt) + text, False
        if text:
            # the answer's text (every answer but the below: one piece), and a reasoning
            # model's thinking and its tool calls where the model server sent them apart,
            # a chunk each, in its order (limiter/reply_text.py)
            usage_so_far = (req.prompt_tokens, self.forwarded)
            for piece in unpack_in_order(text):
                thought = (piece.field, piece.reasoning) if piece.reasoning else None
                # the run's tokens' logprobs, on its last chunk (a completion's offsets
                # count the answer's characters streamed before them)
                probs = oa.logprobs_object(req, piece.logprobs, self.streamed_chars) if piece.logprobs \
                    else None
                self.streamed_chars += len(piece.content)
                if piece.tool_calls:
                    chunks = [{"reasoning": thought}] if thought else []
                    chunks += [{"tool_calls": calls} for calls in piece.tool_calls]
                    if piece.content:
                        chunks.append({"text": piece.content})
                    chunks[-1]["logprobs"] = probs
                    out.extend(oa.sse(oa.chunk(req, rid, created, index=index, usage_so_far=usage_so_far,
                                               **c)) for c in chunks)
                    continue
                # a delta of thinking alone has no content
                content = piece.content or (None if thought else "")
                out.append(oa.sse(oa.chunk(req, rid, created, index=index, text=content, reasoning=thought,
                                           usage_so_far=usage_so_far, logprobs=probs)))
        if r.kind == "done":
            self.observe_done(r)
            out.append(oa.sse(oa.chunk(req, rid, created, index=index, reason=r.finish,
                                       usage_so_far=(r.usage_in, r.usage_out))))
        return out

    def sse_end(self, usage_in: int, usage_out: int) -> list[bytes]:
        """The stream's last events once every answer ended: the usage (when asked for) and
        ``[DONE]``."""
        out = []
        if self.req.include_usage:
            out.append(oa.sse(oa.usage_chunk(self.req, self.public_id, self.created, usage_in, usage_out)))
        out.append(oa.sse("[DONE]"))
        return out
