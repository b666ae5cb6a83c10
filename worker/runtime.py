"""The Redis side of a worker process, shared by both serving loops.

:class:`WorkerRuntime` owns what does not depend on how tokens are produced: the Redis
clients, claiming (pull-based: the caller says how much room it has), waiting for work
(``BLPOP`` on the pool's wake list on a connection of its own: an idle worker costs Redis
nothing), finishing a request with its latency sample, handing work back on drain, and
the background upkeep tasks:

* lease renewal every ``lease_ms / 3`` for every held (request, fence); ``lost`` ones
  are dropped silently (another worker owns them), ``stop`` ones cancelled;
* a heartbeat every ``heartbeat_s``: ``ZADD workers`` and the worker's stats hash (TTL);
* ``reap`` every ``reap_interval_s``, so dead workers' leases are requeued even when no
  one claims.

Failure policy: a Redis outage never kills the process. Loops log, count, back off and
retry; a pool whose policy vanished (Redis restarted empty) is re-initialised from the
config. Tokens not yet delivered stay buffered meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from limiter import lifecycle
from limiter.backoff import Backoff
from limiter.config import QosConfig
from limiter.errors import ConfigError, InvalidArgument, LeaseLost, PolicyMissing, QosError, RedisUnavailable
from limiter.heartbeats import prune_stale
from limiter.keys import PoolKeys
from limiter.metrics_server import start_metrics_server
from limiter.prompt import Payload, count_tokens
from limiter.redis_conn import map_redis_errors, open_redis, redis_now_ms
from limiter.samples import pack_sample
from limiter.scripts import PUSH_LIMIT, Claimed, Scripts, TokenBatch, policy_document
from limiter.tasks import raise_if_cancelled, stop_tasks
from worker.delivery import TOKEN_FIELDS, Delivery
from worker.metrics import WorkerMetrics
from worker.push_clock import PushClock
from worker.samples import build_sample
from worker.settings import WorkerSettings

log = logging.getLogger("qos.worker")
# With requests held but none to run, a loop looks again after this long (never spins).
IDLE_HELD_S = 0.05
# An empty claim's back-off doubles from claim_interval_ms up to this many of them (100 ms at
# the default 20 ms): long enough that a backlog nobody can take now is no hot loop, short
# enough that work admitted meanwhile is claimed promptly.
MAX_BACKOFF_INTERVALS = 5
# At the drain deadline a hand-back that met a passing outage (a connection reset just then) is
# tried again, after a back-off, for this long: given up at once, the request waited out a
# whole lease (10 s by default) and spent an attempt. What is still held after it requeues when
# its lease expires, as when Redis is down. docker-compose.yml's stop_grace_period leaves room
# for it beyond drain_timeout_s.
HAND_BACK_RETRY_S = 5.0
# What a push learnt about one request (push_batches): nothing (delivered, or an offset
# settled), its lease is lost, or Redis refused its tokens. Not whether its client cancelled:
# that is :meth:`WorkerRuntime.cancelled`'s.
PushNews = None | LeaseLost | InvalidArgument


def silence_limit_s(settings: WorkerSettings, lease_ms: int) -> float:
    """How long Redis may be out of reach of a draining worker before the drain is hopeless
    (:attr:`WorkerRuntime.drain_hopeless`): a lease, at least three heartbeat periods."""
    return max(lease_ms / 1000, 3 * settings.heartbeat_s)


def worker_lease_ms(settings: WorkerSettings, cfg: QosConfig) -> int:
    """The lease a worker takes: its own ``lease_ms``, else its pool's."""
    return settings.lease_ms or cfg.pool(settings.pool).lease_ms


def hand_back_limit_s(settings: WorkerSettings, cfg: QosConfig) -> float:
    """The longest a worker's hand-back may go on past its drain's deadline: a release is
    retried for ``HAND_BACK_RETRY_S``, a decided answer as long as a drain may wait for Redis
    (:func:`silence_limit_s`), whichever is longer. What stops a worker must allow it beyond
    ``drain_timeout_s`` (a SIGKILL sooner costs what giving up would: leases waited out)."""
    return max(HAND_BACK_RETRY_S, silence_limit_s(settings, worker_lease_ms(settings, cfg)))


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, cfg: QosConfig, *, engine: str, simulated: bool) -> None:
        self.settings = settings
        self.cfg = cfg
        self.pool_cfg = cfg.pool(settings.pool)
        self.keys = PoolKeys(settings.pool)
        self.worker_id = settings.worker_id
        self.lease_ms = worker_lease_ms(settings, cfg)
        self.engine = engine
        self.simulated = simulated
        self.metrics = WorkerMetrics(pool=settings.pool, worker=self.worker_id, engine=engine,
                                     simulated=simulated, device=settings.device)
        self.held: dict[str, Delivery] = {}
        # Unusable requests whose failure a claim is sending now (fail_unusable): held with their
        # final set meanwhile, they are no completion to retry (a look-ahead claim runs beside
        # the step loop, whose retry sent the same complete again and waited on it).
        self.failing_unusable: set[str] = set()
        # Each class's cost weights and push period, made once: the step loop asks for them
        # for every held request at every step (the class lookups were 5 % of a 128-sequence
        # step's CPU with a null engine).
        self._weights = {c.name: (c.weight, c.out_weight) for c in cfg.classes}
        self._push_periods = {c.name: settings.flush_ms if c.stream_flush_ms is None else c.stream_flush_ms
                              for c in cfg.classes}
        self.claim_left_backlog = False  # the last claim left requests queued (ClaimResult.backlog)
        self.draining = asyncio.Event()
        self.drain_deadline = float("inf")
        self.redis_ok = False
        self.beat_ok_at = time.monotonic()  # the last heartbeat that reached Redis
        self.started_ms = int(time.time() * 1000)
        self._clock_offset_ms = 0.0  # Redis clock minus local wall clock
        # Set by the serving loop: its live stats, and what to do with lost / stopped ids.
        self.stats: Callable[[], dict[str, Any]] = dict
        self.on_lost: Callable[[list[str]], None] = lambda ids: None
        self.on_stop: Callable[[list[str]], None] = lambda ids: None
        self._tasks: list[asyncio.Task[None]] = []
        self._outages: dict[str, Backoff] = {}  # guard(): one back-off (and one warning) per loop
        self._metrics_runner: Any = None
        self.client: Any = None
        self.blocking: Any = None
        self.scripts: Scripts

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect, make sure the pool exists, start upkeep and the metrics server."""
        # A step's pushes and completions go out concurrently: past 8 they wait for a free
        # connection (O(1) connections per worker) instead of failing with 'Too many connections'.
        self.client = open_redis(self.cfg.redis, max_connections=8, pool_wait_s=30.0)
        self.blocking = open_redis(self.cfg.redis, max_connections=2,  # BLPOP blocks its connection
                                   blocking_s=self.settings.idle_block_s)
        self.scripts = Scripts(self.client)
        # The port first: /healthz must answer (redis_ok false) while Redis is not there yet.
        if self.settings.metrics_port:
            try:
                s = self.settings
                self._metrics_runner = await start_metrics_server(
                    self.metrics.registry, self.health, s.metrics_host, s.metrics_port)
            except OSError as exc:
                where = f"{self.settings.metrics_host}:{self.settings.metrics_port}"
                raise ConfigError("worker.metrics_port", f"cannot listen on {where}: {exc}") from exc
        backoff = Backoff("Redis unavailable at start", first_s=0.2, max_s=5.0, logger=log)
        while True:
            try:
                await self.ensure_pool()
                backoff.succeeded()
                break
            except RedisUnavailable as exc:
                if self.draining.is_set():
                    raise
                await backoff.failed(exc)
        await self.guard("heartbeat", self.heartbeat(), backoff=0)
        s = self.settings
        self._tasks = [asyncio.create_task(self._every(period, name, fn)) for period, name, fn in (
            (self.lease_ms / 3000, "renew", self.renew), (s.heartbeat_s, "heartbeat", self.heartbeat),
            (s.reap_interval_s, "reap", self.reap))]

    async def close(self) -> None:
        await stop_tasks(self._tasks, f"worker {self.worker_id}")
        with contextlib.suppress(QosError, OSError, Exception):
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.workers, self.worker_id)
                pipe.delete(self.keys.worker(self.worker_id))
                await pipe.execute()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        for c in (self.client, self.blocking):
            with contextlib.suppress(Exception):
                await c.aclose()

    async def ensure_pool(self) -> None:
        """Initialise the pool's policy from the config (keep_rates: controller-owned rates
        survive) and sync the Redis clock estimate."""
        # The first request does not pay for NOSCRIPT round trips. On the pool's server alone
        # (and its clock below): on a cluster, another shard down kept the worker from starting.
        await self.scripts.load_all(self.keys)
        await self.scripts.init_pool(self.keys, policy_document(self.cfg, self.pool_cfg))
        self._clock_offset_ms = await self._redis(redis_now_ms(self.client, self.keys)) - time.time() * 1000
        self.redis_ok = True

    async def restore_pool(self) -> None:
        """A call met NOPOLICY (Redis restarted empty): write the pool's policy again, once;
        a failure to is left to the caller's next try."""
        log.warning("pool %s has no policy (Redis restarted empty?): re-initialising", self.keys.pool)
        with contextlib.suppress(RedisUnavailable, PolicyMissing):
            await self.ensure_pool()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        # SIGHUP (a closed terminal, or the parent `qos up` gone) drains like SIGTERM (unless
        # started under nohup: SIGHUP ignored stays ignored).
        hup = () if lifecycle.hangup_ignored() else (signal.SIGHUP,)
        for sig in (signal.SIGTERM, signal.SIGINT, *hup):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.begin_drain, sig.name)

    def begin_drain(self, why: str = "request") -> None:
        """First call: stop pulling, let running work finish within drain_timeout_s. A second
        call (a second SIGTERM) ends the drain now: what remains is handed back."""
        if self.draining.is_set():
            log.warning("%s again: handing back the remaining work now", why)
            self.drain_deadline = time.monotonic()
            return
        log.info("%s: draining (up to %.0f s), no new work is pulled", why, self.settings.drain_timeout_s)
        self.drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        self.draining.set()

    @property
    def drain_expired(self) -> bool:
        return time.monotonic() >= self.drain_deadline

    @property
    def drain_hopeless(self) -> bool:
        """Draining while Redis has been out of reach for a whole lease (no heartbeat got
        through; at least three heartbeat periods): nothing generated can
        be delivered, and the leases lapse on their own (the requests resume elsewhere once
        Redis is back). Waiting out drain_timeout_s would only keep the process around -- e.g.
        after `qos up` died and took its Redis along."""
        silent_s = silence_limit_s(self.settings, self.lease_ms)
        return self.draining.is_set() and time.monotonic() - self.beat_ok_at >= silent_s

    # --- helpers ------------------------------------------------------------------------------
    async def _redis(self, aw: Awaitable[Any]) -> Any:
        """Await a plain redis-py command, mapping connection failures to RedisUnavailable."""
        with map_redis_errors():
            return await aw

    def weights(self, cls: str) -> tuple[float, float]:
        """(input, output) cost weights of class ``cls``: capacity is reported in the same
        weighted tokens the rates and admission costs use."""
        return self._weights.get(cls, (1.0, 1.0))

    def push_due(self, d: Delivery, t: float, step_s: float = 0.0, clock: PushClock | None = None) -> bool:
        """Push ``d``'s pending tokens now (:meth:`Delivery.due`)? A streamed request's tokens
        at least every ``stream_flush_ms`` of its class (else the worker's ``flush_ms``) or at
        ``flush_tokens`` pending; an unstreamed one's only every ``unstreamed_flush_ms`` (at
        least the class's period), however many are pending. The first batch goes at once
        either way: it is what tells the frontend, and its metrics, that the request runs.

        ``clock``: the step loop's (told of the step's end first): from its second push on,
        ``d`` is also pushed at every push step of its period's clock, with every other
        request of that period, in one call (worker/push_clock.py)."""
        flush_ms, tokens = self._flush_rule(d)
        # the clock asked at every step, whatever the answer is used for: it keeps time only so
        fires = clock is not None and clock.fires(flush_ms, t, step_s)
        return d.due(t, flush_ms, tokens, step_s) or (fires and d.pushes > 0 and d.pending_tokens > 0)

    def push_due_at(self, d: Delivery) -> float | None:
        """When ``d``'s oldest pending token will have waited its period (:meth:`push_due`'s
        ``flush_ms``), monotonic seconds; None with no token pending. For a worker that
        pushes as its upstream's chunks come: without a chunk after them, the tokens pending
        waited for the next one however long the server paused."""
        if not d.pending_tokens or d.pending_since is None:
            return None
        return d.pending_since + self._flush_rule(d)[0] / 1e3

    def _flush_rule(self, d: Delivery) -> tuple[float, int | None]:
        """(flush_ms, flush_tokens) for ``d``: its class's period, else the worker's; an
        unstreamed request's at least ``unstreamed_flush_ms``, with no token bound."""
        s = self.settings
        flush_ms = self._push_periods.get(d.claimed.cls, s.flush_ms)
        if not d.payload.stream:
            return max(flush_ms, s.unstreamed_flush_ms), None
        return flush_ms, s.flush_tokens

    def redis_now_ms(self) -> int:
        return int(time.time() * 1000 + self._clock_offset_ms)

    async def guard(self, where: str, aw: Awaitable[Any], backoff: float = 0.5) -> Any:
        """Run one loop iteration: on a Redis outage back off, on a vanished pool
        re-initialise it. Returns None when the iteration failed.

        ``backoff`` is the first delay after a failure; it doubles with each failure in a
        row of the same loop (``where``) up to 4x (0: the loop paces itself), so the step
        loop resumes at most 2 s after Redis is back. An outage is
        logged once when it starts and once when that loop works again, not per attempt: a
        worker looping through a 30 s outage wrote a warning every 0.5 s."""
        outage = self._outages.get(where)
        try:
            result = await aw
            if where == "heartbeat":
                # The one loop whose every pass is a Redis round trip: another's may touch
                # nothing (a renewal with nothing held), and its success said "Redis ok" in the
                # middle of an outage (/healthz flapped true every renewal period).
                self.redis_ok = True
            if outage is not None:
                outage.succeeded()
            return result
        except PolicyMissing:  # Redis answered: whatever outage this loop was in is over
            self.redis_ok = True
            if outage is not None:
                outage.succeeded()
            await self.restore_pool()
        except RedisUnavailable as exc:
            self.redis_ok = False
            self.metrics.redis_errors.labels(where).inc()
            if outage is None:
                outage = self._outages[where] = Backoff(where, first_s=backoff, max_s=4 * backoff, logger=log)
            await outage.failed(exc)
        return None

    async def _every(self, period_s: float, name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.guard(name, fn(), backoff=0)
            except Exception:  # an upkeep bug must not silently stop renewing forever
                log.exception("%s failed", name)
            raise_if_cancelled()  # one a redis-py call swallowed (Python 3.11's wait_for)

    # --- claiming -----------------------------------------------------------------------------
    async def claim(self, max_requests: int, kv_room: int, above_class: str = "",
                    kv_total: int = 0, avoid_tenants: Sequence[str] = (),
                    avoid_from: str = "") -> list[Delivery]:
        """Pull up to ``max_requests`` requests that fit ``kv_room`` free KV tokens (0 = no
        limit), of classes ranked above ``above_class`` only when it is given, of tenants not
        in ``avoid_tenants`` (in class ``avoid_from`` and below). ``kv_total`` (the worker's
        whole KV room, 0 = unknown) lets claim fail what no worker can hold."""
        res = await self.scripts.claim(self.keys, self.worker_id, max_requests, kv_room, self.lease_ms,
                                       above_class, kv_total, avoid_tenants, avoid_from)
        t = time.monotonic()
        self._clock_offset_ms = res.now_ms - time.time() * 1000
        self.claim_left_backlog = res.backlog
        out, unusable = [], []
        for c in res.requests:
            self.metrics.claims.labels(c.cls).inc()
            d = self._delivery(c, res.now_ms, t)
            if isinstance(d, str):
                unusable.append((c, d))
            else:
                out.append(d)
        for c, why in unusable:
            try:
                await self.fail_unusable(c, res.now_ms, t, why)
            except RedisUnavailable:
                # Held with its final set: retried with the other finals. The requests claimed
                # with it still start (raising here left them held, never run, leases renewed).
                log.warning("%s: could not fail an unusable request (Redis unavailable); retrying later",
                            c.request_id)
        # Held only now, with nothing left to await before the caller has them: held while an
        # unusable one's failure waited on Redis, a new attempt of a request the loop still
        # ran an old sequence of took that sequence's tokens (and its old lease's news).
        for d in out:
            self.held[d.request_id] = d
        return out

    def _delivery(self, c: Claimed, now_ms: int, t: float) -> Delivery | str:
        try:
            payload = Payload.unpack(c.payload)
        except ValueError as exc:
            return f"unusable request payload: {exc}"
        try:
            rank = self.cfg.class_rank(c.cls)
        except ValueError:
            rank = len(self.cfg.classes)  # a class the config does not know: lowest priority
        return Delivery(c, payload, now_ms, t, count_tokens(payload.prompt), rank)

    async def fail_unusable(self, c: Claimed, now_ms: int, t: float, message: str) -> None:
        d = Delivery(c, Payload("completion", "", 1), now_ms, t, c.input_tokens, 0)
        self.held[c.request_id] = d
        self.failing_unusable.add(c.request_id)
        try:
            await self.finish(d, "failed", "error", message)
        finally:
            self.failing_unusable.discard(c.request_id)

    async def unless_draining(self, aw: Awaitable[Any]) -> asyncio.Future[Any] | None:
        """Await ``aw`` unless a drain begins first, which cancels it: its finished future
        (``result()`` gives its value, or raises its error), or None when the drain came first."""
        task = asyncio.ensure_future(aw)
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            done, _ = await asyncio.wait({task, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, drain):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, QosError):
                        await t
        return task if task in done else None

    async def wait_for_work(self) -> bool:
        """Block (no polling) until a wake marker arrives, ``idle_block_s`` passes, or a
        drain begins (an idle worker exits at once on SIGTERM). True if a marker came."""
        blpop = await self.unless_draining(self._redis(
            self.blocking.blpop([self.keys.wake], timeout=self.settings.idle_block_s)))
        return blpop is not None and blpop.result() is not None

    async def announce_work(self) -> None:
        """Put back a wake marker this worker took and will not act on. No trim: the list is
        one shorter than before the take, and the scripts that push markers keep it short
        (include/wake.lua)."""
        await self._redis(self.client.lpush(self.keys.wake, "1"))

    async def take_wake_marker(self) -> bool:
        """Non-blocking: was work announced since we last looked? (For a busy worker with
        room: an LPOP on an empty list is a cheap read, unlike a claim.)"""
        return await self._redis(self.client.lpop(self.keys.wake)) is not None

    async def cancelled(self, ids: list[str]) -> list[str]:
        """Which of ``ids`` their clients cancelled: one SMISMEMBER, cheap enough per step."""
        if not ids:
            return []
        flags = await self._redis(self.client.smismember(self.keys.cancels, ids))
        return [rid for rid, f in zip(ids, flags, strict=True) if int(f)]

    # --- finishing ----------------------------------------------------------------------------
    async def push(self, d: Delivery) -> None:
        """Push ``d``'s pending tokens. Raises LeaseLost."""
        before = d.pushes  # counted once landed: not a call that met an outage, nor no call at all
        try:
            await d.push(self.scripts, self.keys, self.worker_id, self.lease_ms)
        finally:
            self.metrics.pushes.inc(d.pushes - before)

    @staticmethod
    def batches(ds: list[Delivery]) -> list[tuple[Delivery, TokenBatch]]:
        """What :meth:`push_batches` sends for ``ds``: their tokens pending now. Taken when
        called, so tokens added before the push runs wait for the next one."""
        return [(d, b) for d in ds if (b := d.batch()) is not None]

    async def push_batches(self, todo: list[tuple[Delivery, TokenBatch]]) -> list[tuple[Delivery, PushNews]]:
        """Push ``todo`` (:meth:`batches`) with as few ``push_tokens`` calls as PUSH_LIMIT
        allows; per delivery pushed, None (delivered), the LeaseLost it met, or the
        InvalidArgument Redis refused its batch with (past the request's max_tokens; or a
        batch Redis cannot take): those tokens can never be delivered (:meth:`fail_refused`).
        Raises RedisUnavailable: the batches of that call and of the calls after it stay
        pending (in doubt, settled by the next push's offset check); the ones before are
        settled already, and their news comes again (a lost lease stays lost)."""
        out: list[tuple[Delivery, PushNews]] = []
        # Requests whose frontends read grouped entries and the others (of an older frontend,
        # during a rolling deploy) in calls of their own: the script takes one kind a call.
        for grouped in (True, False):
            part = [t for t in todo if t[0].payload.grouped_tokens is grouped]
            for i in range(0, len(part), PUSH_LIMIT):
                await self._push_batches(part[i:i + PUSH_LIMIT], out)
        return out

    async def _push_batches(self, todo: list[tuple[Delivery, TokenBatch]],
                            out: list[tuple[Delivery, PushNews]]) -> None:
        """One ``push_tokens`` call for ``todo``; its news appended to ``out``."""
        try:
            replies = await self.scripts.push_tokens_many(self.keys, self.worker_id, [b for _, b in todo],
                                                          self.lease_ms,
                                                          grouped=todo[0][0].payload.grouped_tokens)
        except InvalidArgument as exc:
            if exc.field not in TOKEN_FIELDS:
                raise
            # A batch the script cannot take refuses the whole call, nothing written. Which
            # one is known only by sending them one at a time: the others must still land.
            if len(todo) == 1:
                out.append((todo[0][0], exc))
                return
            for one in todo:
                await self._push_batches([one], out)
            return
        for (d, b), reply in zip(todo, replies, strict=True):
            before = d.pushes  # counted once landed (an outage's call is sent again)
            try:
                d.settle(b, reply)
                out.append((d, None))
            except (LeaseLost, InvalidArgument) as exc:
                out.append((d, exc))
            self.metrics.pushes.inc(d.pushes - before)

    async def finish(self, d: Delivery, outcome: str, finish_reason: str, message: str = "") -> None:
        """Complete ``d`` with its sample and forget it. Raises RedisUnavailable (``d`` stays
        held with ``d.final`` set: call again); LeaseLost only means someone else finished it
        (or a retried call already did), so it is dropped. A completion whose last tokens
        Redis refuses (past the request's max_tokens) fails the request (:meth:`fail_refused`)."""
        d.final = (outcome, finish_reason, message)
        sample = b""  # none with the plain failure of a completion Redis refused (_fail_unfinishable)
        if not d.plain_failure:
            sample = pack_sample(build_sample(d, pool=self.keys.pool, worker_id=self.worker_id,
                                              engine=self.engine, simulated=self.simulated, outcome=outcome))
        try:
            await d.complete(self.scripts, self.keys, self.worker_id, outcome=outcome,
                             finish_reason=finish_reason, message=message, sample=sample)
        except LeaseLost:
            if self.held.get(d.request_id) is d:  # not a newer attempt we were handed meanwhile
                self.drop(d.request_id, "lost")
            return
        except InvalidArgument as exc:
            # The one request's state, no reason to take the worker (and all it holds) down.
            if exc.field in TOKEN_FIELDS and (d.pending_tokens or d.pending_ids or d.pending_text):
                await self.fail_refused(d, exc)
            else:
                await self._fail_unfinishable(d, exc)
            return
        if self.held.get(d.request_id) is d:
            self.held.pop(d.request_id)
        if outcome == "cancelled":
            self.metrics.cancellations.inc()
        self.metrics.finished.labels(d.claimed.cls, outcome).inc()

    async def fail_refused(self, d: Delivery, exc: InvalidArgument) -> None:
        """Redis refused ``d``'s tokens (``exc``: past the max_tokens its record allows -- this
        worker counted more -- or a batch the script cannot take): they can never be
        delivered. Fail the request with what was delivered and say why; the worker and its
        other requests go on. Raises RedisUnavailable as :meth:`finish` (``d.final`` set)."""
        log.error("%s: Redis refused its tokens (%s); failing the request after %d delivered",
                  d.request_id, exc, d.offset)
        d.discard_pending()
        if exc.field == "text" and "logprobs" in d.payload.upstream:
            # what the request asked for is more than a batch carries (an echo's prompt's
            # logprobs, in one chunk): refused, so the client does not send it again (a 503 is
            # retried by the SDKs, each admitted, prefilled and failed the same way)
            await self.finish(d, "refused", "error", "its answer with the logprobs asked for is more than "
                              "one batch carries (16 MiB: an echo's prompt's logprobs come in one); ask "
                              "for fewer logprobs or send a shorter prompt")
            return
        await self.finish(d, "failed", "error", f"the worker's tokens for this request were refused: {exc}")

    async def _fail_unfinishable(self, d: Delivery, exc: InvalidArgument) -> None:
        """Redis refused ``d``'s completion for an argument that is not its tokens (its sample,
        reason or message, say): a bug of the worker's own, which the same call meets every
        time. Raised, it stopped the step worker with everything it held (a crash loop under a
        supervisor). The request fails with a plain completion instead -- no sample, a fixed
        outcome, reason and message, its tokens as they are -- and the error is logged; one
        refused too is dropped (its lease lapses; the janitor requeues it, or fails it after
        ``max_attempts``). Raises RedisUnavailable as :meth:`finish` (``d.final`` set)."""
        if d.plain_failure:
            log.error("%s: Redis refused even its plain failure (%s); dropped: its lease lapses and "
                      "the janitor ends it", d.request_id, exc)
            self.drop(d.request_id, "dropped", d)
            return
        log.error("%s: Redis refused its completion (%s) as %s: a bug of the worker's; failing the "
                  "request after %d delivered", d.request_id, exc, d.final, d.offset)
        d.plain_failure = True
        await self.finish(d, "failed", "error", "the worker could not complete it (an internal error; "
                          "details in its log)")

    def drop(self, request_id: str, why: str = "lost", attempt: Delivery | None = None) -> None:
        """Forget a held request; with ``attempt``, only while that attempt is the one held (an
        old attempt's news must not drop the new one this worker was handed meanwhile)."""
        if attempt is not None and self.held.get(request_id) is not attempt:
            return
        d = self.held.pop(request_id, None)
        if d is not None:
            self.metrics.finished.labels(d.claimed.cls, why).inc()
            what = "lease lost (another worker owns it)" if why == "lost" else why
            log.info("%s: %s, dropped", request_id, what)

    async def release(self, d: Delivery, spent: bool = False) -> None:
        """Hand ``d`` back to its queue after delivering what it has (drain; ``spent``: the
        model server broke on it, and the attempt counts against max_attempts)."""
        try:
            await self.push(d)
            state = await self.scripts.release(self.keys, request_id=d.request_id, worker_id=self.worker_id,
                                               fence=d.fence, spent=spent)
            log.info("%s: handed back (%s) after %d tokens", d.request_id, state, d.offset)
        except LeaseLost:
            pass
        except InvalidArgument as exc:
            if exc.field in TOKEN_FIELDS:  # its tokens refused (the push): failed, not handed back
                await self.fail_refused(d, exc)
                return
            # the release's own arguments refused: a bug of the worker's, which the same call
            # meets every time; raised, it stopped the draining worker with all it still held.
            # Dropped, the request waits out its lease and the janitor requeues it.
            log.error("%s: Redis refused its hand-back (%s): a bug of the worker's; dropped, its lease "
                      "lapses and the janitor requeues it", d.request_id, exc)
            self.drop(d.request_id, "dropped", d)
            return
        self.drop(d.request_id, "released", d)

    async def hand_back(self, ds: Sequence[Delivery], spent: bool = False) -> None:
        """Give up ``ds`` (the drain's deadline, a stream's loop ending, its model server
        down): each is released (:meth:`release`), or finished with its answer where one is
        decided (``d.final``: a completion that met an outage or was in flight; released, it
        would be requeued and answered again). Both engines' workers hand back through here.

        A call that meets an outage or a missing policy is tried again after a back-off: a
        release for up to ``HAND_BACK_RETRY_S`` (a connection reset just then left the
        request to wait out its lease and spend an attempt), then left to requeue when its
        lease expires; a decided answer as any completion, for up to
        :func:`hand_back_limit_s` (or, draining, until Redis has been out of reach that long:
        :attr:`drain_hopeless`; its lease lapses then anyway). Returns when none of ``ds`` is
        left to try; raises what is not an outage."""
        start = time.monotonic()
        limits = {False: start + HAND_BACK_RETRY_S,  # by whether the answer is decided
                  True: start + hand_back_limit_s(self.settings, self.cfg)}
        outage = Backoff(f"hand-back of {len(ds)} request(s)", first_s=0.2, max_s=1.0, logger=log)
        while True:
            now = time.monotonic()
            todo = [d for d in ds if self.held.get(d.request_id) is d and now < limits[d.final is not None]]
            if not todo:
                return
            calls = [self.finish(d, *d.final) if d.final is not None else self.release(d, spent)
                     for d in todo]
            failure: BaseException | None = None
            for r in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(r, RedisUnavailable | PolicyMissing):
                    failure = failure or r
                elif isinstance(r, BaseException):
                    raise r
            if failure is None:
                outage.succeeded()  # each landed, or was dropped (its lease lost, its tokens refused)
                return
            if isinstance(failure, PolicyMissing):
                await self.restore_pool()
            else:
                self.metrics.redis_errors.labels("release").inc()
            delay = outage.next_delay(failure)
            if self.drain_hopeless:
                return
            if time.monotonic() + delay >= max(limits[d.final is not None] for d in todo):
                return  # what is left requeues at its lease's end
            await asyncio.sleep(delay)

    # --- upkeep -------------------------------------------------------------------------------
    async def renew(self) -> None:
        held = [(rid, d.fence) for rid, d in self.held.items()]
        if not held:
            return
        res = await self.scripts.renew_leases(self.keys, self.worker_id, held, self.lease_ms)
        # News about the attempts asked about only: a request re-claimed by this worker while
        # the call was out (its lease had lapsed) is a new attempt, and a late "lost" about the
        # old one dropped it (nobody served it for a whole lease, and an attempt was spent).
        asked = dict(held)
        current = [rid for rid in res.lost + res.stop
                   if (d := self.held.get(rid)) is not None and d.fence == asked.get(rid)]
        if lost := [rid for rid in res.lost if rid in current]:
            self.on_lost(lost)
        if stop := [rid for rid in res.stop if rid in current]:
            self.on_stop(stop)

    async def heartbeat(self) -> None:
        stats = {"engine": self.engine, "simulated": int(self.simulated), "device": self.settings.device,
                 "pool": self.keys.pool, "pid": os.getpid(), "host": socket.gethostname(),
                 "started_ms": self.started_ms, "state": "draining" if self.draining.is_set() else "running",
                 "held": len(self.held), **self.stats()}
        now = self.redis_now_ms()
        key = self.keys.worker(self.worker_id)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            pipe.hset(key, mapping={k: str(v) for k, v in stats.items()})
            pipe.hset(key, "ts_ms", now)
            pipe.expire(key, self.settings.heartbeat_ttl_s)
            await self._redis(pipe.execute())
        self.beat_ok_at = time.monotonic()
        # Workers killed without leaving: gone from the heartbeat set once silent for twice
        # the stats hash's TTL (bounded per beat).
        silent_ms = 2000 * self.settings.heartbeat_ttl_s
        await self._redis(prune_stale(self.client, self.keys.workers, now - silent_ms,
                                      also_hdel=self.keys.worker_kv))

    async def reap(self) -> None:
        res = await self.scripts.reap_all(self.keys)
        if res.requeued or res.failed or res.cancelled or res.expired:
            log.info("reap: %s", res)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "worker": self.worker_id, "engine": self.engine, "simulated": self.simulated,
                "redis_ok": self.redis_ok, "draining": self.draining.is_set(), "held": len(self.held)}
