"""One pool's controller: the lease loop, the sample loop and the tick, as three tasks.

* **lease** (every ``renew_s``): take or keep the pool's lease; a new fence starts a new
  :class:`~limiter.controller.term.Term`, a lost lease ends it (a standby just polls here).
* **samples** (leader only): replay our own pending entries, claim the dead leader's, then
  block on new ones; each sample feeds the SLO window, the capacity estimator and the usage
  meter, then is acknowledged (limiter/controller/consumer.py).
* **tick** (every ``tick_s``, leader only): Redis ``TIME`` and counters -> ``Inputs`` ->
  :func:`~limiter.controller.control_law.decide`; a change is written with the fenced ``set_rates`` with
  its decision record, and the windows are marked at ``evidence_from_ms``; compliance and
  capacity go to ``qos:{pool}:compliance`` every tick.

No failure ends a loop: Redis errors back off and retry, a refused (stale) write steps
down, a missing policy is re-created from the config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

from redis.exceptions import ResponseError

from limiter.backoff import Backoff
from limiter.config import MAX_CAPACITY_TOKENS_S, PoolConfig, QosConfig
from limiter.controller.consumer import Batch, SampleConsumer
from limiter.controller.control_law import ClassInputs, Decision, Inputs, decide
from limiter.controller.leader import LeaderLease
from limiter.controller.metrics import ControllerMetrics
from limiter.controller.observe import PoolState, live_workers, publish, read_heartbeats, record_metrics
from limiter.controller.settings import ControllerSettings
from limiter.controller.term import Term, new_term, policy_fields
from limiter.errors import ConfigError, PolicyMissing, StaleLeader
from limiter.keys import PoolKeys
from limiter.redis_conn import CONNECTION_ERRORS, REDIS_ERRORS, redis_now_ms, store_refused
from limiter.samples import Sample
from limiter.scripts import Scripts, policy_document
from limiter.tasks import raise_if_cancelled

log = logging.getLogger("qos.controller")
MAX_BACKOFF_S = 5.0
# No socket timeout on the client (XREADGROUP blocks), so every step has its own deadline: a
# connection that wedges must cost one step, not stop a loop while the lease is still renewed.
STEP_TIMEOUT_S = 5.0


async def within(aw: Awaitable[Any], timeout_s: float) -> Any:
    """``await aw``, raising TimeoutError after ``timeout_s``.

    Not ``asyncio.wait_for``: on Python 3.11 it returns the step's result when the loop's
    task is cancelled in the same turn as the step finishes -- the cancellation is lost, the
    loop runs on for ever and whoever stops it waits for ever (issue 14's 300 s hang).
    ``asyncio.timeout`` runs the step in the loop's own task and lets the cancel through."""
    async with asyncio.timeout(timeout_s):
        return await aw


# How far a sample's own time may run ahead of its stream entry's (a frontend stamps its
# rejections with its estimate of Redis's clock; the scripts stamp with Redis's own).
SAMPLE_AHEAD_SLACK_MS = 1000


def written_by(sample: Sample, entry_id: Any) -> Sample:
    """``sample``, its time no later than its stream entry's (Redis's clock when it was
    written, plus a slack): one stamped far ahead (a writer whose clock stepped, a failover to
    a Redis whose clock is behind) wiped the SLO windows and froze the capacity intervals."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    try:
        written_ms = int(raw.split("-", 1)[0])
    except ValueError:
        return sample
    if sample.ts_ms > written_ms + SAMPLE_AHEAD_SLACK_MS:
        return dataclasses.replace(sample, ts_ms=float(written_ms))
    return sample


class PoolController:
    def __init__(self, *, cfg: QosConfig, pool: PoolConfig, settings: ControllerSettings, client: Any,
                 scripts: Scripts, metrics: ControllerMetrics) -> None:
        self.cfg, self.pool, self.settings = cfg, pool, settings
        self.client, self.scripts, self.metrics = client, scripts, metrics
        self.keys = PoolKeys(pool.name)
        self.lease = LeaderLease(scripts, self.keys, settings.controller_id, settings.lease_s)
        self.consumer = SampleConsumer(client, self.keys, settings.controller_id, cfg.class_names(), metrics,
                                       settings.batch, settings.claim_idle_ms)
        self.term: Term | None = None
        self.redis_ok = True
        # the loops in an outage now: each says so once, when its own outage starts (a shared
        # flag, set again by the lease loop's renewals while a reshard held the tick's key
        # elsewhere, made the tick loop warn at every tick)
        self._failing: set[str] = set()
        self._leading = asyncio.Event()
        self._ticked = time.monotonic()  # the tick loop's last turn (the lease loop's watchdog)
        self._termless_since: float | None = None  # since when the lease is ours with no term
        metrics.leader.labels(pool.name).set(0)

    def loops(self) -> list[Any]:
        return [self.lease_loop(), self.sample_loop(), self.tick_loop()]

    # --- leadership ---------------------------------------------------------------------------
    async def lease_loop(self) -> None:
        while True:
            await self.renew_once()
            raise_if_cancelled()
            await asyncio.sleep(self.settings.renew_s)

    async def renew_once(self) -> None:
        try:
            if self.term is not None and time.monotonic() - self._ticked > self.stall_s:
                # A leader that renews its lease but no longer decides is worse than none: its
                # tick loop is stuck, or every tick fails (a term whose state went bad -- a new
                # term, here or on a standby, starts again from the policy).
                log.error("%s: no decision for %.1f s (the tick loop is stuck or every tick fails); "
                          "giving up leadership", self.pool.name, time.monotonic() - self._ticked)
                self.step_down("tick loop stalled")
                await within(self.scripts.release_leader(self.keys, self.lease.owner, self.lease.last_fence),
                             STEP_TIMEOUT_S)
                return
            if self._termless_since is not None and time.monotonic() - self._termless_since > self.stall_s:
                # The lease is ours but no term could begin (an error of its own each time, e.g.
                # an ACL refusing XGROUP CREATE): renewed for ever, it kept every standby out.
                log.error("%s: leading for %.1f s without a term (every start failed); giving up "
                          "leadership", self.pool.name, time.monotonic() - self._termless_since)
                self._termless_since = None
                self.step_down("no term could begin")
                await within(self.scripts.release_leader(self.keys, self.lease.owner, self.lease.last_fence),
                             STEP_TIMEOUT_S)
                return
            fence = await within(self.lease.renew(), max(0.5, self.settings.lease_s / 2))
            self._redis_fine("lease")
            if not fence:
                self.end_term(f"the lease is held by {self.lease.holder}")
            elif self.term is None or self.term.fence != fence or self.lease.taken:
                # (taken anew with the term's own fence: Redis lost its data and with it the
                # fence counter -- a new leadership all the same, its state read from Redis)
                self.end_term("a new term begins")
                await within(self.begin_term(fence), STEP_TIMEOUT_S)
        except REDIS_ERRORS as exc:
            self._redis_error("lease", exc)
            if self.term is not None and not self.lease.leading:
                self.end_term("the lease lapsed while Redis was unreachable")
        except ConfigError:
            raise  # the deployment is wrong (redis.cluster): the process ends, naming it
        except Exception:  # never let the lease loop die: the standby would never take over
            log.exception("%s: lease loop error", self.pool.name)
        if self.term is not None or not self.lease.leading:
            self._termless_since = None
        elif self._termless_since is None:
            self._termless_since = time.monotonic()

    async def begin_term(self, fence: int) -> None:
        # keep_rates: repairs a missing policy and syncs static fields; the rates stay as they are
        await self.scripts.init_pool(self.keys, policy_document(self.cfg, self.pool))
        policy = policy_fields(await self.client.hgetall(self.keys.policy))
        await self.consumer.ensure_group()
        now_ms = await redis_now_ms(self.client, self.keys)
        if self.lease.fence != fence or not self.lease.leading:
            return  # lost it while setting up
        self.term = new_term(fence, policy, self.cfg, self.pool, self.settings, now_ms)
        self._ticked = time.monotonic()
        self._leading.set()
        self.metrics.leader.labels(self.pool.name).set(1)
        log.info("%s: term %d begins (capacity %.0f, allowances %s)", self.pool.name, fence,
                 self.term.state.capacity, {c.name: round(c.allowance, 4) for c in self.term.state.classes})

    @property
    def stall_s(self) -> float:
        return max(3 * self.settings.lease_s, 10 * self.settings.tick_s, 2 * STEP_TIMEOUT_S)

    def end_term(self, why: str) -> None:
        if self.term is None:
            return
        log.info("%s: term %d ends: %s", self.pool.name, self.term.fence, why)
        self.term = None
        self._leading.clear()
        self.metrics.leader.labels(self.pool.name).set(0)
        self.metrics.forget_term(self.pool.name, self.cfg.class_names())

    def step_down(self, why: str) -> None:
        self.lease.step_down(why)
        self.end_term(why)

    # --- samples ------------------------------------------------------------------------------
    async def sample_loop(self) -> None:
        backoff = Backoff(f"{self.pool.name}: sample loop", first_s=0.1, max_s=MAX_BACKOFF_S)
        while True:
            raise_if_cancelled()  # (a redis-py call may have swallowed it: a busy stream never blocks)
            await self._leading.wait()
            term = self.term
            if term is None:
                await asyncio.sleep(0)
                continue
            try:
                await within(self.consume_once(term), self.settings.block_s + STEP_TIMEOUT_S)
                backoff.succeeded()
            except ResponseError as exc:
                # CLUSTERDOWN, TRYAGAIN; UNBLOCKED (a reshard MIGRATEd the stream, a failover
                # demoted the node), NOREPLICAS, READONLY: an outage, not a bad reply
                if isinstance(exc, CONNECTION_ERRORS) or store_refused(exc):
                    self._redis_error("samples", exc)
                    await backoff.failed()
                elif "NOGROUP" in str(exc):  # the stream or group was deleted (e.g. a Redis restart)
                    if not (await self._guard(self.consumer.ensure_group(), "samples") and self.redis_ok):
                        await backoff.failed()  # refused (out of memory, ...) or unreachable: no spin
                else:
                    log.error("%s: sample read failed: %s", self.pool.name, exc)
                    await backoff.failed()
            except REDIS_ERRORS as exc:
                self._redis_error("samples", exc)
                await backoff.failed()
            except ConfigError:
                raise
            except Exception:
                log.exception("%s: sample loop error", self.pool.name)
                await backoff.failed()

    async def consume_once(self, term: Term) -> None:
        """One step of the leader's sample loop: catch up once per term, then read new entries."""
        if term.unacked:
            await self.consumer.ack(sorted(term.unacked))
            term.unacked.clear()
        if not term.caught_up:
            await self.take(term, await self.consumer.replay_own())
            await self.take(term, await self.consumer.autoclaim())
            await self.consumer.prune_consumers()  # those autoclaim emptied, of processes long gone
            term.caught_up = True
            term.next_claim = time.monotonic() + self.settings.claim_idle_ms / 1000
        await self.take(term, await self.consumer.read_new(int(self.settings.block_s * 1000)))
        if time.monotonic() >= term.next_claim:
            await self.take(term, await self.consumer.autoclaim())
            term.next_claim = time.monotonic() + self.settings.claim_idle_ms / 1000

    async def take(self, term: Term, batch: Batch) -> None:
        """Feed a batch to the term's windows and acknowledge it -- unless the term ended
        meanwhile, or the lease lapsed and the term does not know it yet (a leader paused past
        its lease, whose blocked read was answered meanwhile): then the entries stay pending
        for the next leader to claim."""
        if self.term is not term or not self.lease.leading or not batch.ids:
            return
        fresh = [(s, i) for s, i in zip(batch.samples, batch.sample_ids, strict=True)
                 if i not in term.unacked]
        for sample, entry_id in fresh:
            self.feed(term, written_by(sample, entry_id))
        term.bad += batch.bad
        try:
            await self.consumer.ack(batch.ids)
        except BaseException:
            term.unacked.update(batch.ids)  # fed already: retried before the next read, never re-fed
            raise

    def feed(self, term: Term, sample: Sample) -> None:
        if sample.outcome == "rejected":
            # Turned away at admission (a frontend's sample). A miss of the class's SLO while
            # it used less than its guarantee: the system failed it. Over its guarantee,
            # rejection is how overload is meant to end, and counting it would have the law
            # cut the class for its own excess (more rejections, more cuts) -- except for the
            # top class, whose guarantee is what the others leave: the law gives it more by
            # cutting them (down to their rate floors, min_shares). No work either.
            if term.within_guarantee.get(sample.cls, True):
                term.monitor.add(sample)
        else:
            term.monitor.add(sample)
            term.estimator.observe_sample(sample)
            # Never claimed (expired in its queue, cancelled or refused there: no worker named)
            # is not in the claim rate `used` multiplies the mean by: it would dilute the mean.
            if sample.outcome != "expired" and sample.worker:
                term.usage.observe_work(sample.cls, term.estimator.work(sample))
        term.consumed += 1
        self.metrics.samples.labels(self.pool.name, sample.cls).inc()

    # --- the tick -----------------------------------------------------------------------------
    async def tick_loop(self) -> None:
        while True:
            started = time.monotonic()
            term = self.term
            # A tick that fails with an error of its own (not Redis's) does not count as a turn:
            # the lease loop's watchdog then ends the term (one garbage sample poisoned a
            # term's state for good: every tick raised, and the lease was renewed for ever).
            if term is None or await self._guard(within(self.tick(term), STEP_TIMEOUT_S), "tick"):
                self._ticked = time.monotonic()
            raise_if_cancelled()
            await asyncio.sleep(max(0.0, self.settings.tick_s - (time.monotonic() - started)))

    async def tick(self, term: Term) -> Decision | None:
        """One control decision for this pool; returns it (None when not leading)."""
        if self.term is not term:
            return None
        if not self.lease.leading:
            self.end_term("the lease lapsed")
            return None
        now_ms = await redis_now_ms(self.client, self.keys)
        if term.state.last_change_ms is not None and term.state.last_change_ms > now_ms:
            # Redis's clock stepped back past the last change: the windows, marked after it, took
            # no sample as fresh until the clock caught up (an hour for an hour's step), and the
            # samples they hold are stamped on the old clock. A new term starts afresh (at the
            # lease loop's next turn): empty windows, estimator and meter.
            log.warning("%s: Redis time %.0f is before the last rate change (%.0f): the clock stepped "
                        "back; starting a new term", self.pool.name, now_ms, term.state.last_change_ms)
            self.end_term("Redis's clock stepped back")
            return None
        classes = self.cfg.class_names()
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.stats)
            pipe.zrange(self.keys.workers, 0, -1, withscores=True)
            # the queues and the frontends, for the gauges alone (bounded: fields per class)
            pipe.hmget(self.keys.queued, [*classes, *(f"{c}.cost" for c in classes)])
            pipe.hmget(self.keys.inflight, classes)
            # (ZRANGE, not ZCOUNT: a command the documented ACL line grants already, so an
            # upgrade needs no new grant; the set holds one entry per frontend)
            pipe.zrange(self.keys.frontends, 0, -1, withscores=True)
            stats, workers, queued, leased, frontends = await pipe.execute()
        term.usage.observe_counters(now_ms, stats)
        live = live_workers(term, workers, now_ms, self.settings.capacity.worker_ttl_s * 1000)
        if self.settings.capacity.worker_field:
            await read_heartbeats(self.client, self.keys, term, live, now_ms, self.settings.capacity)
        fresh = now_ms - self.pool.frontend_ttl_ms
        live_frontends = sum(1 for _, stamp in frontends if stamp >= fresh)
        pool_state = PoolState.read(classes, queued, leased, len(live), live_frontends)
        estimate = term.estimator.estimate(now_ms)
        window = term.monitor.stats(now_ms)
        capacity = estimate.value
        if not (math.isfinite(capacity) and 0 < capacity <= MAX_CAPACITY_TOKENS_S):
            capacity = term.state.capacity
        inputs = Inputs(capacity, {name: ClassInputs(
            compliance=w.fresh_compliance, samples=w.fresh_count,
            used=term.usage.used(name, term.estimator.served_rate(name)),
            has_slo=w.has_target, window_compliance=w.compliance) for name, w in window.items()},
            workers=estimate.live_workers if estimate.source == "workers" else 0)
        rates = term.state.rates()
        top = term.state.config.classes[0]
        term.within_guarantee = {name: name == top or c.used < rates[name].rate
                                 for name, c in inputs.classes.items() if name in rates}
        decision = decide(term.state, inputs, now_ms)
        if decision.changed:
            record = decision.record() | {
                "pool": self.pool.name, "controller": self.settings.controller_id, "fence": term.fence,
                "capacity_source": estimate.source, "live_workers": estimate.live_workers,
                "capacity_confidence": round(estimate.confidence, 3), "capacity_estimate": estimate.value,
                "claimed_per_s": {c: term.usage.claimed_per_s(c) for c in term.usage.classes},
            }
            if self.term is not term or not self.lease.leading or self.lease.fence != term.fence:
                # The term ended while this tick read (Redis stalled past the lease, which the
                # lease loop then took again: a new term): its decision is the old term's, and
                # written with the old fence it was refused and ended the new term.
                return None
            try:
                version = await self.scripts.set_rates(self.keys, self.lease.owner, term.fence,
                                                       record, decision.policy_fields())
            except StaleLeader as exc:
                self.metrics.stale.labels(self.pool.name).inc()
                if self.term is term:  # not a term begun while the write was out: it is current
                    self.step_down(f"set_rates refused: {exc}")
                return None
            assert decision.evidence_from_ms is not None
            term.monitor.mark(decision.evidence_from_ms)
            self.metrics.writes.labels(self.pool.name).inc()
            log.info("%s: rates v%d: %s", self.pool.name, version, {
                c.name: f"{c.reason} rate={c.new.rate:.0f} ceil={c.new.ceil:.0f}" for c in decision.classes})
        term.state = decision.state
        term.last_decision = decision
        if self.term is term:  # (a term that ended meanwhile has had its figures dropped)
            record_metrics(self.metrics, self.pool.name, decision, window, estimate.value, inputs)
            pool_state.record(self.metrics, self.pool.name)
        await publish(self.scripts, self.keys, self.settings, now_ms, window, estimate)
        return decision

    # --- errors -------------------------------------------------------------------------------
    async def _guard(self, coro: Any, loop: str) -> bool:
        """Run one step; False when it failed with an error of its own (logged), True when it
        ran or Redis was the trouble (an outage or a lost policy: retried by the loop)."""
        try:
            await coro
            self._redis_fine(loop)
        except PolicyMissing:
            log.warning("%s: policy missing (Redis lost its data?); re-creating it from the config",
                        self.pool.name)
            await self._guard(self.scripts.init_pool(self.keys, policy_document(self.cfg, self.pool)), loop)
        except REDIS_ERRORS as exc:
            self._redis_error(loop, exc)
        except ResponseError as exc:
            if not store_refused(exc):  # NOREPLICAS on an XACK, say: the store's state, an outage
                log.exception("%s: %s error", self.pool.name, loop)
                return False
            self._redis_error(loop, exc)
        except ConfigError:
            raise
        except Exception:
            log.exception("%s: %s error", self.pool.name, loop)
            return False
        return True

    def _redis_error(self, loop: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(loop).inc()
        if loop not in self._failing:
            log.warning("%s: Redis unavailable in %s loop (%s); retrying", self.pool.name, loop, exc)
            self._failing.add(loop)
        self.redis_ok = False

    def _redis_fine(self, loop: str) -> None:
        """A step of ``loop`` reached Redis: an outage of that loop is over."""
        self.redis_ok = True
        if loop in self._failing:
            self._failing.discard(loop)
            log.info("%s: Redis reachable again in %s loop", self.pool.name, loop)
