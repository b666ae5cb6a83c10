"""The frontend process's runtime: one Redis client, the scripts, the per-pool reply
routers and the heartbeat, built once per app and shared by every request.

:class:`Frontend` starts the background loops (one reply reader per pool, the heartbeat
that also bootstraps the pools and sweeps expired work), answers readiness, cancels and
records rejections on behalf of handlers, and ends in-flight requests cleanly on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from limiter import token_count
from limiter.backoff import Backoff
from limiter.config import PoolConfig, QosConfig, TenantConfig
from limiter.errors import ConfigError, TenantBusy
from limiter.frontend import openai_api as oa
from limiter.frontend.auth import KeyRing
from limiter.frontend.errors import ApiError
from limiter.frontend.metrics import FrontendMetrics
from limiter.frontend.quota_check import QuotaCheck
from limiter.frontend.replies import REPLY_BLOCK_MS, Heartbeat, Reply, ReplyRouter, drain_estimate_s
from limiter.frontend.settings import FrontendSettings
from limiter.keys import SAMPLES_MAXLEN, PoolKeys
from limiter.redis_conn import REDIS_ERRORS, map_redis_errors, open_redis
from limiter.samples import build_sample, pack_sample
from limiter.scripts import Scripts, policy_document
from limiter.slo import ClassSLO

log = logging.getLogger("qos.frontend")

# A cancel that found nothing is sent again after these delays: it may have overtaken its admit.
CANCEL_AGAIN_S = (0.2, 1.0)
LOST_CHECK_BATCH = 500  # EXISTS per pipeline when looking for requests whose record Redis lost
# Every admitted request's record is looked up this often: a failover to a replica that lagged
# loses the last writes (a few requests' records) but not this frontend's heartbeat entry, so
# the check at a lost entry never ran (one EXISTS per request in flight, pipelined).
LOST_SWEEP_S = 10.0
# At start, once one pool is set up, how long the others' set-ups may go without one ending
# before the frontend serves without them (their heartbeat loops set them up). A Redis Cluster shard
# whose host does not answer held the start for the socket timeout, 600 s where an operator
# set `?socket_timeout=600`, with every other pool ready to serve.
START_OTHERS_S = 1.0
# Cancels an outage refused, kept to send again once Redis answers: at most this many kept,
# and sent at most this many per heartbeat (each one call of a bounded script).
UNSENT_CANCELS_MAX = 10_000
UNSENT_CANCELS_PER_BEAT = 256


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
        self._counting: dict[str, int] = {}  # tenant -> prompts being counted (count_prompt)
        self.slos = {c.name: ClassSLO.of(c) for c in cfg.classes}  # the TTFT target counter's
        # Each pool's prompts are counted in its own tokens (limiter/token_count.py).
        self.counters = {p.name: token_count.counter_for(p.tokenizer, p.tokenizer_url, cfg.worker,
                                                         p.model_name, timeout_s=settings.tokenize_timeout_s)
                         for p in cfg.pools}
        # the pools whose prompts the model server counts (a /tokenize call per request)
        upstream_counted = {name for name, c in self.counters.items()
                            if isinstance(c, token_count.UpstreamCounter)}
        # Nothing connects until the first command, so the clients exist for the runtime's
        # whole life (start() only starts the loops that use them).
        self.client: Any = open_redis(cfg.redis, max_connections=settings.redis_max_connections,
                                      pool_wait_s=5.0)
        self.scripts = Scripts(self.client)
        keys = list(self.pool_keys.values())
        self.reader_client: Any = open_redis(cfg.redis, max_connections=len(keys), pool_wait_s=5.0,
                                             blocking_s=REPLY_BLOCK_MS / 1000)
        self.router = ReplyRouter(self.client, keys, self.frontend_id, self.metrics,
                                  block_ms=REPLY_BLOCK_MS, reader=self.reader_client)
        self.heartbeat = Heartbeat(self.client, keys, self.frontend_id, list(self.classes),
                                   settings.heartbeat_s, trim_upto=lambda pool: self.router.last_ids[pool],
                                   outage_grace_ms={p.name: 2 * p.frontend_ttl_ms for p in cfg.pools},
                                   prune_after_ms={p.name: 4 * p.frontend_ttl_ms for p in cfg.pools},
                                   on_entry_lost=self._find_lost_requests)
        self.quota = QuotaCheck(self.client, self.pool_keys, upstream_counted, self.heartbeat.redis_now_ms)
        self.bootstrapped = False  # one pool set up at least (the heartbeat loop beats from then on)
        self.set_up: set[str] = set()  # the pools whose scripts, policy and first beat are done
        # A configuration error its start met once Redis answered (a Redis Cluster node named
        # without redis.cluster): /readyz gives it as the reason (it names no address)
        self.config_problem = ""
        # The same per pool, for a pool not set up (its set-up met it while another pool was
        # set up: a node of a cluster named without redis.cluster MOVEs only other nodes' keys)
        self.config_problems: dict[str, str] = {}
        # Pools whose last set-up by their heartbeat loop met a fault that is not an outage (a
        # script the server refuses, a policy it rejects), with what it was: /readyz says so,
        # the log says what (again when it changes)
        self.setup_failures: dict[str, str] = {}
        self.shutting_down = False
        # /readyz: the check under way per scope (None: every pool), which concurrent probes share
        self.ready_checks: dict[str | None, asyncio.Future[tuple[str, dict[str, str]]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        # request id -> (its pool's keys, tenant, reason, when to give up: time.monotonic())
        self.unsent_cancels: dict[str, tuple[PoolKeys, str, str, float]] = {}
        self._stop = asyncio.Event()
        self._end_streams: asyncio.Task[None] | None = None
        # Ready while one more missed beat would still leave us inside the shortest TTL after
        # which claim gives up on us (and at least half of it). It guards against a dead
        # heartbeat loop, not a slow one: at half the TTL, a loaded machine's late beat (TLS,
        # 0.25 s beats, a 1.5 s TTL) turned requests away with Redis answering fine.
        ttl_s = min(p.frontend_ttl_ms for p in cfg.pools) / 1000
        self._fresh_s = max(ttl_s / 2, ttl_s - settings.heartbeat_s)

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        for k in self.pool_keys.values():
            self._tasks.append(asyncio.create_task(self.router.run(k), name=f"replies-{k.pool}"))
        # One attempt now, so a healthy deployment is ready the moment it listens; if Redis
        # is not there yet, the heartbeat loop keeps trying and /readyz says 503 meanwhile.
        # Anything else (a policy Redis rejects, a script that does not load) is a real fault:
        # it propagates and the process does not start.
        with contextlib.suppress(*REDIS_ERRORS):
            await self._bootstrap()
        for k in self.pool_keys.values():
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(k), name=f"heartbeat-{k.pool}"))

    async def _bootstrap(self) -> None:
        """Set up every pool not set up yet (:meth:`_set_up`), the pools at the same time.
        Raises the first error met among the set-ups that ended. Once one pool is set up, a
        ``START_OTHERS_S`` in which no other set-up ends leaves those still under way to their
        heartbeat loops (a shard that does not answer), cancelled here."""
        pools = [p for p in self.cfg.pools if p.name not in self.set_up]
        tasks = [asyncio.ensure_future(self._set_up(p)) for p in pools]
        pending: set[asyncio.Future[None]] = set(tasks)
        try:
            while pending:
                # (every pool's set-up may wait as long as it takes while none is set up: the
                # frontend cannot serve anything before)
                wait_s = START_OTHERS_S if self.bootstrapped else None
                done, pending = await asyncio.wait(pending, timeout=wait_s,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    log.warning("frontend %s: %d pools not set up after %g s more; serving the others "
                                "meanwhile", self.frontend_id, len(pending), START_OTHERS_S)
                    break
        finally:
            for t in pending:
                t.cancel()
        results = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        if failed := [r for r in results if r is not None]:
            # A real fault first: one pool's outage must not hide another's (start() lets an
            # outage pass, and the process started with a pool that can never be set up)
            raise next((e for e in failed if not isinstance(e, REDIS_ERRORS)), failed[0])

    async def _set_up(self, pool: PoolConfig) -> None:
        """Set up one pool: the scripts loaded and the policy written on its server, its first
        beat (before anything is admitted: claim must see us alive). The frontend is ready
        once one pool is; each pool's heartbeat loop sets its pool up once its server answers
        (on a Redis Cluster, one shard down at the start kept every pool out of service)."""
        keys = self.pool_keys[pool.name]
        # (an outage is RedisUnavailable throughout: the beat calls Redis directly, and redis-py's
        # "cluster unreachable" is no connection error -- taken for a fault, it was said to be one)
        with map_redis_errors():
            await self.scripts.load_all(keys)
            await self.init_pool(pool)
            await self.heartbeat.beat_pool(keys)
        self.set_up.add(pool.name)
        self.setup_failures.pop(pool.name, None)
        if not self.bootstrapped:
            self.bootstrapped = True
            log.info("frontend %s ready (pools: %s)", self.frontend_id, ", ".join(self.pool_keys))
        elif len(self.pool_keys) > 1:
            log.info("frontend %s: pool %s set up", self.frontend_id, pool.name)

    async def _find_lost_requests(self, keys: PoolKeys) -> None:
        """Our heartbeat entry was gone: Redis may have lost what it held (a restart without
        persistence, a flush, a failover to a replica that never saw us). A queued request whose record
        went is told at its max wait (cancel finds nothing), but a running one heard nothing
        ever again: its worker's next push found no lease and dropped it, and its client
        waited ``request_timeout_s``. Each admitted request's record is looked up now; those
        gone are answered at once (503 ``request_lost``: a retry is admitted afresh)."""
        ids = self.router.admitted_in(keys.pool)
        log.warning("frontend %s: its heartbeat entry in pool %s was gone (Redis lost data?); "
                    "checking %d requests", self.frontend_id, keys.pool, len(ids))
        await self._answer_lost(keys, ids)

    async def _sweep_lost_requests(self, keys: PoolKeys) -> None:
        """Every LOST_SWEEP_S: the admitted requests whose record is gone with our heartbeat
        entry still there (a failover to a replica that had not got the last writes, a key
        deleted by hand) are answered as :meth:`_find_lost_requests` answers them; they waited
        for ``request_timeout_s`` (running) or their max wait (queued). Not while a pool's
        reply stream cannot be read, nor before its reader has caught up with what piled up
        meanwhile: a finished request's record may expire (record_ttl_s) before its final
        reply, still in the stream, is read."""
        if not self.router.caught_up.get(keys.pool):
            return
        if lost := await self._answer_lost(keys, self.router.admitted_in(keys.pool)):
            log.warning("frontend %s: %d requests of pool %s had no record in Redis (a failover to a "
                        "replica that lagged?); answered 503 request_lost", self.frontend_id, lost,
                        keys.pool)

    async def _answer_lost(self, keys: PoolKeys, ids: list[str]) -> int:
        """Answer those of ``ids`` whose record is gone; returns how many."""
        lost = 0
        for i in range(0, len(ids), LOST_CHECK_BATCH):
            chunk = ids[i:i + LOST_CHECK_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.exists(keys.request(rid))
            for rid, found in zip(chunk, await pipe.execute(), strict=True):
                # (once: ids listed before the EXISTS may have been answered since)
                if not found and self.router.answer_lost(rid, Reply(
                        "err", code="lost", message="the service lost the request's state")):
                    lost += 1
                    self.metrics.lost_requests.labels(keys.pool).inc()
        return lost

    async def init_pool(self, pool: PoolConfig) -> None:
        """Write the pool's static policy; keep_rates leaves the controller's rates alone."""
        await self.scripts.init_pool(self.pool_keys[pool.name], policy_document(self.cfg, pool))

    async def _heartbeat_loop(self, keys: PoolKeys) -> None:
        """One pool's heartbeat and chores, every ``heartbeat_s``, apart from the other pools':
        on a Redis Cluster a shard out of reach (refused, or a host that does not answer, each
        call then waiting out its socket timeout) stops or slows its own pools' beats only."""
        loop = asyncio.get_running_loop()
        next_reap = loop.time() + self.settings.reap_s
        next_sweep = loop.time() + LOST_SWEEP_S
        pool = self.cfg.pool(keys.pool)
        # Through an outage it keeps beating at its period (the back-off only logs: once when
        # the outage starts, once when a beat succeeds again).
        what = "heartbeat" if len(self.pool_keys) == 1 else f"heartbeat of pool {keys.pool}"
        period = self.settings.heartbeat_s
        backoff = Backoff(what, first_s=period, max_s=period, logger=log)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await self._stop.wait()
                return
            try:
                if keys.pool in self.set_up:
                    sweep = loop.time() >= next_sweep
                    if sweep:
                        next_sweep = loop.time() + LOST_SWEEP_S
                    # Frontends reap too, so requests are finished in time even while no
                    # worker or controller of a pool runs (each call is bounded).
                    reap = bool(self.settings.reap_s) and loop.time() >= next_reap
                    if reap:
                        next_reap = loop.time() + self.settings.reap_s
                    await self._beat(keys, sweep=sweep, reap=reap)
                else:
                    await self._set_up(pool)
            except asyncio.CancelledError:
                raise
            except ConfigError as exc:  # the deployment, not an outage: said once, and by /readyz
                if self.config_problems.get(keys.pool) != str(exc):
                    log.error("frontend %s cannot start pool %s: %s", self.frontend_id, keys.pool, exc)
                self.config_problem = self.config_problems[keys.pool] = str(exc)
                self.metrics.redis_errors.labels("heartbeat").inc()
            except Exception as exc:  # keep beating through outages; readiness reports it
                self.metrics.redis_errors.labels("heartbeat").inc()
                if keys.pool not in self.set_up:
                    # A set-up left to this loop at the start (START_OTHERS_S): a fault that
                    # would have stopped the process then is said (once while it is the same),
                    # and by /readyz; an outage since is the reason again
                    if isinstance(exc, REDIS_ERRORS):
                        self.setup_failures.pop(keys.pool, None)
                    elif self.setup_failures.get(keys.pool) != (fault := f"{type(exc).__name__}: {exc}"):
                        log.error("frontend %s cannot set up pool %s: %s", self.frontend_id, keys.pool, fault)
                        self.setup_failures[keys.pool] = fault
                backoff.next_delay(exc)
            else:
                backoff.succeeded()

    async def _beat(self, keys: PoolKeys, *, sweep: bool, reap: bool) -> None:
        """The pool's beat, then its chores (kept cancels, the lost-record sweep, the reap),
        each on its own: a kept cancel that kept failing skipped the others. Raises the first
        error met, once each was tried (the loop counts and logs it)."""
        await self.heartbeat.beat_pool(keys)
        chores: list[Callable[[], Awaitable[Any]]] = []
        if self.unsent_cancels:
            chores.append(functools.partial(self._send_unsent_cancels, keys))
        if sweep:
            chores.append(functools.partial(self._sweep_lost_requests, keys))
        if reap:
            chores.append(functools.partial(self.scripts.reap_all, keys, max_calls=4))
        failed: list[BaseException] = []
        for chore in chores:
            try:
                await chore()
            except Exception as exc:
                failed.append(exc)
        if failed:
            raise failed[0]

    async def stop(self) -> None:
        # Cancels started by handlers (client gone, shutdown) must reach Redis first.
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
        if self._end_streams:
            self._end_streams.cancel()
        # Flags, not Task.cancel(): redis-py can swallow a cancellation that lands in a
        # blocking read. The reply loops return within one XREAD block.
        self._stop.set()
        await self.router.stop()
        if self._tasks:
            block_s = self.router.block_ms / 1000
            _, pending = await asyncio.wait(self._tasks, timeout=block_s + 1.0)
            for t in pending:
                t.cancel()
        if self.bootstrapped:  # (a pool never set up never beat: nothing to leave, and its
            # server may be the one that does not answer)
            await self.heartbeat.leave([k for k in self.pool_keys.values() if k.pool in self.set_up])
        for counter in self.counters.values():
            await counter.close()
        for c in (self.client, self.reader_client):
            with contextlib.suppress(Exception):
                await c.aclose()

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
                if not any(self.router.healthy.values()):
                    lost_since = now if lost_since is None else lost_since
                    if now - lost_since >= 1.0:
                        break
                else:
                    lost_since = None
                await asyncio.sleep(min(0.1, max(end - now, 0.0)))
            self.router.broadcast(Reply("shutdown"))

        self._end_streams = asyncio.create_task(end_streams())

    # --- helpers used by the request path ----------------------------------------------------
    async def count_prompt(self, draft: oa.Draft, tenant: TenantConfig | None = None) -> int:
        """The prompt's tokens in its pool's tokenizer; 503 when the model server must count
        them and cannot, 400 when it refuses this prompt (nothing is admitted or charged).
        A count that costs work (the model server's, or a tokenizer file's on this process's
        CPU) is free until admission charges it: a tenant with a ``max_inflight`` counts at
        most that many prompts at once in this process (429 ``too_many_inflight`` past it),
        as it may have that many requests in flight."""
        counter = self.counters[draft.pool.name]
        if draft.prompt_ids:  # a token-id prompt: its tokens, exactly, at no cost
            # An id past the vocabulary the pool counts in is no token of its model: a 400 now,
            # not a request admitted, charged its prompt and queued for the model server to
            # refuse (vLLM: "Token id ... is out of vocabulary")
            if (most := counter.max_token_id()) is not None and (top := max(draft.prompt_ids)) > most:
                at = draft.prompt_ids.index(top)
                raise ApiError(400, f"'prompt' holds the token id {top} at {at}: this model's vocabulary "
                                    f"ends at {most}", code="invalid_value", param="prompt")
            return len(draft.prompt_ids)
        turn = self.count_turn(tenant) if counter.kind != token_count.BYTES else contextlib.nullcontext()
        try:
            with turn:
                upstream = draft.fields["upstream"]
                return await counter.count(draft.prompt, draft.messages, upstream.get("chat_template_kwargs"),
                                           upstream.get("tools") or ())
        except token_count.TokenizerRefused as exc:
            # The upstream's own words stay in the log: they may name its internals.
            log.info("pool %s: the upstream tokenizer refused a prompt: %s", draft.pool.name, exc)
            param = draft.prompt_param  # (the field as the client sent it)
            raise ApiError(400, f"The model server refused to count this request's prompt tokens "
                                f"(HTTP {exc.status}); check its {param}",
                           code="tokenizer_refused", param=param) from exc
        except token_count.TokenizerUnavailable as exc:
            log.warning("pool %s: the upstream tokenizer could not count a prompt: %s", draft.pool.name, exc)
            raise ApiError(503, "Service temporarily unavailable: the model server could not count the "
                              "prompt's tokens; retry shortly", code="tokenizer_unavailable", retry_after_s=1,
                              outcome="unavailable") from exc

    @contextlib.contextmanager
    def count_turn(self, tenant: TenantConfig | None) -> Iterator[None]:
        """One of ``tenant``'s ``max_inflight`` turns to tokenize (a prompt's count, or the
        tokenizer endpoints), held for the block; none is needed without a cap.
        :class:`TenantBusy` when all are taken."""
        if tenant is None or not tenant.max_inflight:
            yield
            return
        counting = self._counting.get(tenant.name, 0)
        if counting >= tenant.max_inflight:
            raise TenantBusy(tenant.name, counting)
        self._counting[tenant.name] = counting + 1
        try:
            yield
        finally:
            self._counting[tenant.name] -= 1
            if not self._counting[tenant.name]:
                del self._counting[tenant.name]

    def not_ready_because(self, pool: str | None = None) -> str:
        """Why this frontend cannot serve ``pool`` ('' when it can); with no pool, why it can
        serve none of its pools ('' when one can: the others' problems are the degraded
        pools of /readyz). A pool cannot be served while its heartbeat is stale or its reply
        reader does not read (its connections are its own and can fail while the command
        ones work: requests would be admitted whose answers nobody reads). Per pool, because
        on a Redis Cluster each pool lives on one shard: one shard out of reach took every
        pool out of service, and /readyz every frontend out of its load balancer."""
        if not self.bootstrapped:
            return self.config_problem or "not connected to Redis yet"
        problems = [why for p in ([pool] if pool is not None else self.pool_keys)
                    if (why := self.pool_problem(p))]
        if len(problems) < (1 if pool is not None else len(self.pool_keys)):
            return ""
        return "; ".join(problems)

    def pool_problem(self, pool: str) -> str:
        """Why ``pool`` cannot be served by this frontend now ('' when it can)."""
        if pool not in self.set_up:
            if problem := self.config_problems.get(pool):
                return f"pool {pool}: {problem}"
            if pool in self.setup_failures:  # (no exception text: /readyz needs no key)
                return f"pool {pool} is not set up yet: its set-up failed (the frontend's log says why)"
            return f"pool {pool} is not set up yet: its Redis server has not answered since the start"
        if not self.heartbeat.fresh(self._fresh_s, pool):
            return f"the heartbeat of pool {pool} is stale"
        if not self.router.healthy.get(pool):
            return f"the reply stream of pool {pool} cannot be read"
        return ""

    def ready(self) -> bool:
        return not self.not_ready_because()

    def cancel_soon(self, keys: PoolKeys, request_id: str, tenant: str, reason: str) -> None:
        """Cancel in a task of its own: the handler calling this is itself being cancelled."""
        task = asyncio.create_task(self._cancel(keys, request_id, tenant, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, keys: PoolKeys, request_id: str, tenant: str, reason: str) -> None:
        # A cancel sent while its admit was in flight goes on another connection and can reach
        # Redis first (an admit with a large prompt is still being read): it finds nothing, and
        # the admit then queues a request nobody waits for. So one that finds nothing is sent
        # again, a little later (not while stopping: claim cancels our requests once our
        # heartbeat stops).
        for delay_s in (0.0, *CANCEL_AGAIN_S):
            if delay_s:
                await asyncio.sleep(delay_s)
                if self.shutting_down:
                    return
            try:
                if await self.scripts.cancel(keys, request_id, tenant, reason) != "not_found":
                    return
            except REDIS_ERRORS as exc:
                self._keep_unsent_cancel(keys, request_id, tenant, reason, exc)
                return
            except Exception as exc:  # not an outage: sending it again would meet the same
                log.error("cancel %s (%s) failed: %s", request_id, reason, exc)
                return

    def _keep_unsent_cancel(self, keys: PoolKeys, request_id: str, tenant: str, reason: str,
                            exc: BaseException) -> None:
        """A cancel an outage refused is sent again once Redis answers (the heartbeat's next
        success), for up to ``request_timeout_s``: only logged, it left the request queued, and
        a worker claimed and generated it for nobody once Redis was back, holding a GPU slot
        up to its max_tokens (claim only cancels the requests of a frontend that stopped
        beating, and this one beats on)."""
        if len(self.unsent_cancels) >= UNSENT_CANCELS_MAX:
            log.warning("cancel %s (%s) failed: %s; %d cancels are already waiting for Redis, this one "
                        "is dropped", request_id, reason, exc, len(self.unsent_cancels))
            return
        log.warning("cancel %s (%s) failed: %s; sent again once Redis answers", request_id, reason, exc)
        give_up_at = time.monotonic() + self.settings.request_timeout_s
        self.unsent_cancels[request_id] = (keys, tenant, reason, give_up_at)
        self.metrics.unsent_cancels.set(len(self.unsent_cancels))

    async def _send_unsent_cancels(self, pool: PoolKeys) -> None:
        """Send ``pool``'s kept cancels (at most UNSENT_CANCELS_PER_BEAT, oldest first); an
        outage met on the way keeps the rest (and the one it met) for the next beat."""
        now = time.monotonic()
        try:
            mine = [rid for rid, kept in self.unsent_cancels.items() if kept[0] == pool]
            for request_id in mine[:UNSENT_CANCELS_PER_BEAT]:
                keys, tenant, reason, give_up_at = self.unsent_cancels[request_id]
                if now >= give_up_at:
                    del self.unsent_cancels[request_id]
                    log.warning("cancel %s (%s) given up: Redis refused it for %g s", request_id, reason,
                                self.settings.request_timeout_s)
                    continue
                try:
                    state = await self.scripts.cancel(keys, request_id, tenant, reason)
                except REDIS_ERRORS:
                    raise  # (the heartbeat loop counts the outage)
                except Exception as exc:
                    state = f"refused ({exc})"
                del self.unsent_cancels[request_id]
                log.info("cancel %s (%s), sent again after an outage: %s", request_id, reason, state)
        finally:
            self.metrics.unsent_cancels.set(len(self.unsent_cancels))

    def record_rejection(self, keys: PoolKeys, cls: str, tenant: str, request_id: str, input_tokens: int,
                         waited_ms: float, ttft_at_least_ms: float | None = None) -> None:
        """A request its class could not start in time (429) or a full queue (503) turned away
        is an SLO miss the controller must see: it gets no latency sample otherwise, and a class could miss
        its attainment on rejections while its window reads ~100 %. One sample, outcome
        ``rejected``, written in a task of its own so the client's answer does not wait."""
        sample = build_sample(pool=keys.pool, cls=cls, tenant=tenant, outcome="rejected",
                              request_id=request_id, worker="", input_tokens=input_tokens, output_tokens=0,
                              queue_wait_ms=0, e2e_ms=round(waited_ms),
                              ts_ms=int(self.heartbeat.redis_now_ms(keys.pool)),
                              ttft_at_least_ms=ttft_at_least_ms)
        task = asyncio.create_task(self._add_sample(keys, pack_sample(sample)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _add_sample(self, keys: PoolKeys, data: bytes) -> None:
        try:
            await self.client.xadd(keys.samples, {"d": data}, maxlen=SAMPLES_MAXLEN, approximate=True)
        except Exception as exc:  # a lost sample only blurs the controller's view a little
            log.warning("rejection sample for %s not written: %s", keys.pool, exc)

    def drain_estimate_s(self, pool: str, cls: str, depth: int) -> int:
        rate = self.heartbeat.service_rate(pool, cls)
        return drain_estimate_s(depth, rate, self.classes[cls].max_wait_ms / 1000)


FRONTEND = web.AppKey("frontend", Frontend)
