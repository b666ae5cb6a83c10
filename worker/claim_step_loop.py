"""The Redis worker for step-based engines (torch, sim): claim -> step -> stream -> complete.

It drives :class:`~worker.batch_scheduler.BatchScheduler` (which applies
:mod:`worker.batch_policy`), the same scheduler :mod:`worker.local_run` drives in-process.

One iteration, between engine steps:

1. apply what the upkeep tasks learnt (leases lost -> drop silently; clients gone -> cancel);
2. pull: if the batch has room, ``claim`` as much as fits (free slots -> ``max_requests``,
   free KV tokens -> ``kv_room``); the claim script decides which class and tenant go first.
   When full, up to ``claim_ahead`` more are held so that newly arrived higher-class work
   reaches the GPU's scheduler, which pauses a lower-class sequence for it; once those are
   held, one more is claimed only of a class above every waiting one (``above_class``), so
   a P0 never waits behind a look-ahead slot taken by a P2. With nothing to do, block on
   ``BLPOP wake`` (~1 s timeout) instead of polling, and claim when it answers (not before
   it: queued work is always announced there). A full batch's look-ahead claim runs
   *beside* the next step (its round trips off the GPU's critical path; what it brings runs
   from the step after, as it would have once a slot freed or a lower class was paused);
3. one :class:`~worker.batch_scheduler.BatchScheduler` step (preempt, admit, chunked-prefill plan,
   engine step, EOS / max_tokens / stop-string detection);
4. send, concurrently, every completion of this step, one ``push_tokens`` call with every
   due request's tokens (``WorkerRuntime.push_due``: streamed requests every ``flush_ms``,
   unstreamed ones every ``unstreamed_flush_ms``), plus (at most every ``flush_ms``) one
   ``SMISMEMBER cancels`` over the held ids, so a cancelled request stops within
   ``flush_ms`` and a step or two (a push does not say it: lua/push_tokens.lua). These calls
   run while the *next* step computes (they are awaited before that step's own calls; a step
   that completes nothing does not wait for them, its pushes going with a later step's), so
   Redis round trips stay off the GPU's critical path.

An engine error fails the requests the engine held (it cannot be trusted with them: running,
or paused with their KV kept), hands back those it did not hold (a look-ahead request
waiting for a slot, a sequence paused with its KV freed: released, requeued as a drain
hands back), and the loop goes on. Redis outages back off and retry; nothing generated is
dropped meanwhile.
A request whose tokens Redis refuses (past the max_tokens its record allows) fails alone,
saying why; the others of the same ``push_tokens`` call are delivered. So does one whose
completion Redis refuses for another argument (a bug of the worker's own:
``WorkerRuntime._fail_unfinishable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any

from limiter.config import ClassConfig
from limiter.errors import InvalidArgument, LeaseLost, PolicyMissing, RedisUnavailable
from limiter.scripts import TokenBatch
from limiter.tasks import stop_tasks
from worker.batch_policy import Limits, floor_slots, tenant_slots
from worker.batch_scheduler import BatchScheduler, ScheduledSeq, StepResult, resume_finish_reason
from worker.busy_meter import FULL_SHARE, BusyMeter
from worker.delivery import Delivery
from worker.engines.base import Engine, SamplingParams, request_seed
from worker.push_clock import PushClock
from worker.runtime import IDLE_HELD_S, MAX_BACKOFF_INTERVALS, WorkerRuntime
from worker.saturated_capacity import SaturatedCapacity, StepLimits
from worker.settings import WorkerSettings
from worker.step_budget import BudgetConfig, StepBudget

log = logging.getLogger("qos.worker")

# A look-ahead claim beside a step starts this long before the step's expected end: room for
# its round trips (a wake-marker LPOP and a claim, ~1 ms on a quiet host) and the step's jitter.
LOOKAHEAD_LEAD_S = 0.005
# The longest a step waits for a look-ahead claim still in flight when the step before ended:
# a round trip on a busy host (up to ~10 ms on the 2-core bench machine), not a Redis outage.
LOOKAHEAD_WAIT_S = 0.020


def build_scheduler(engine: Engine, limits: Limits, settings: WorkerSettings,
                    classes: Sequence[ClassConfig]) -> BatchScheduler:
    """The scheduler a step worker runs: steps sized from ``classes``' TPOT targets when
    ``settings.adaptive_budget`` (and prefill is chunked), the top class's prompts beyond the
    budget up to ``settings.top_prefill_tokens``, each class keeping its starvation floor's
    share of the slots (``ClassConfig.floor``, the same classes, ranks and floors the pool
    policy carries to claim: docs/worker.md)."""
    limits = replace(limits, floor_slots=floor_slots([c.floor for c in classes], limits.max_seqs))
    budget = None
    if settings.adaptive_budget and limits.chunked_prefill:
        budget = StepBudget(BudgetConfig(tpot_ms=tuple(c.slo_tpot_ms for c in classes),
                                         min_budget=limits.max_seqs, max_budget=limits.token_budget,
                                         safety=settings.budget_safety))
    top = settings.top_prefill_tokens if limits.chunked_prefill else 0
    return BatchScheduler(engine, limits, budget, top)


class StepLoop:
    def __init__(self, rt: WorkerRuntime, engine: Engine, limits: Limits) -> None:
        self.rt = rt
        self.engine = engine
        self.limits = limits
        self.sched = build_scheduler(engine, limits, rt.settings, rt.cfg.classes)
        budget = self.sched.budget
        self.kv_capacity = min(limits.kv_capacity, engine.kv_capacity_tokens)
        # What claim is told this worker can ever hold (its kv_total): the KV, or the model's
        # context when shorter. Told the KV alone, a worker took prompts past its model's
        # context (a 16K model on a 64K KV in a pool of 32K contexts) and refused them (400),
        # where a bigger worker of the pool would have served them (a review).
        self.claim_total = self.sched.max_context() + 1
        # Leases lost, each with the attempt it is about: applied to that attempt only (a
        # notice naming the id alone dropped a newer attempt this worker had claimed meanwhile).
        self._lost: dict[str, Delivery] = {}
        self._stop: set[str] = set()
        # pushes Redis refused (past a request's max_tokens): those requests fail, alone
        self._refused: dict[str, tuple[Delivery, InvalidArgument]] = {}
        self._arrivals = 0
        # classes whose tenants share slots evenly (ClassConfig.fair); others run in arrival order
        self._fair = {c.name: c.fair for c in rt.cfg.classes}
        self._empty_claims = 0  # consecutive claims that found nothing despite a wake marker
        self._next_claim = 0.0  # monotonic time before which no claim is made (a back-off)
        # ... and before which a busy worker does not look at the wake list again (every
        # wake_check_ms). Its own timer: on the back-off's, an idle worker woken by a marker
        # slept the rest of a busy look's wake_check_ms before claiming.
        self._next_look = 0.0
        self._next_lookahead = 0.0  # ... and no look-ahead claim (after one that found nothing)
        # An idle worker claims without a wake marker only at start and after a wait on the
        # wake list (see _pull); one that has just gone idle waits first.
        self._idle_claim_due = True
        # heartbeat figures, over the interval since the last heartbeat
        self._gen_tokens = 0
        self._step_time = 0.0
        self._steps = 0
        # capacity_tokens_s of the heartbeat: computed for saturation from the fitted step cost
        # and the mix; the full steps' measured rate until that is known
        # per class rank, the step time the budget aims at while that class decodes
        targets = tuple(budget.target_ms([r]) for r in range(len(rt.cfg.classes))) if budget else ()
        self._capacity = SaturatedCapacity(StepLimits(limits.max_seqs, limits.token_budget, self.kv_capacity),
                                           targets)
        self._work_left = False  # the last step left sequences running (the next gap is overhead)
        # the loop's time between a step and the next while work was left (claims, cancel
        # checks, the last step's calls when they are still running): heartbeat step_gap_ms
        self._prev_step_end: float | None = None
        self._gap_time = 0.0
        self._gaps = 0
        self._busy = BusyMeter()
        self._work_done = 0.0  # weighted tokens of useful work since start (heartbeat work_done)
        # The last step's pushes, completions and cancel check, running while the next step
        # computes (Redis round trips off the step's critical path); awaited before the next
        # step's calls are made, so one request's calls never overlap.
        self._io: asyncio.Task[None] | None = None
        self._io_finishing: set[str] = set()  # ids whose completion is in self._io
        # ... and ids whose completion _start_all has in flight (_finish_unstarted): in the
        # look-ahead claim's task, beside the loop, when that task claimed them
        self._start_finishing: set[str] = set()
        # Held requests an engine error hands back (the engine did not hold them) until their
        # release lands: one that met an outage is released again at the next iteration.
        self._handing_back: dict[str, Delivery] = {}
        self._cancel_checked = 0.0  # monotonic time of the last SMISMEMBER cancels
        self._push_clock = PushClock()  # the push steps every held request keeps (push_due)
        self._claiming: asyncio.Task[None] | None = None  # a full batch's look-ahead claim, beside a step
        self._lookahead_asleep = False  # that claim has not started its Redis calls yet
        self._last_stats_t = time.monotonic()
        self._last_step_ms = 0.0
        rt.on_lost = self._note_lost
        rt.on_stop = self._stop.update
        rt.stats = self.stats
        self.last_batch_size = 0  # sequences in the last step, 0 once idle (a gauge: worker/main.py)

    # --- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until drained: after SIGTERM, hand back what never started, let running
        work finish until the drain deadline, then hand back the rest."""
        try:
            await self._serve()
        finally:
            # However the loop ends (a hopeless drain returns with the last step's calls just
            # started), no task of it outlives the worker, pending or with an unread error.
            await self._abandon_claim()
            await self._abandon_io()

    async def _serve(self) -> None:
        handed_back_waiting = False
        while True:
            if self.rt.draining.is_set():
                if self._claiming is not None:  # what it claims is handed back with the rest
                    await self.rt.guard("worker", self._settle_claim())
                if not handed_back_waiting:
                    handed_back_waiting = True
                    fresh = [s.request_id for s in self.sched.waiting if len(s.generated) == s.resumed_tokens]
                    await self.rt.guard("release", self._release(fresh))
                if not self.rt.held:
                    await self.rt.guard("worker", self._settle_io())  # a last cancel check
                    return
                if self._stranded():
                    await self.rt.guard("worker", self._settle_io())  # let finishing calls land first
                    if stranded := self._stranded():
                        # Held, yet neither running nor finishing: nothing would ever end them, and
                        # the drain would wait out drain_timeout_s for work nobody is doing.
                        log.warning("draining: handing back %d held request(s) that were not running: %s",
                                    len(stranded), ", ".join(stranded))
                        await self.rt.guard("release", self._release(stranded))
                if self.rt.drain_hopeless:
                    log.warning("draining with Redis out of reach for a whole lease: stopping now; "
                                "the %d requests held resume on another worker once their leases "
                                "expire", len(self.rt.held))
                    return
                if self.rt.drain_expired:
                    await self._hand_back_all()
                    return
            await self.rt.guard("worker", self._iteration())

    def _note_lost(self, ids: list[str]) -> None:
        """The lease renewal's lost ids (:meth:`WorkerRuntime.renew`: each about the attempt
        held when its reply came), noted with that attempt."""
        for rid in ids:
            if (d := self.rt.held.get(rid)) is not None:
                self._lost[rid] = d

    def _stranded(self) -> list[str]:
        """Held requests the scheduler does not run and no completion is pending for."""
        return [rid for rid, d in self.rt.held.items() if rid not in self.sched and d.final is None]

    async def _iteration(self) -> None:
        if self._io is not None and self._io.done():
            await self._settle_io()  # its outage, if any, backs the loop off (rt.guard)
        await self._apply_signals()
        await self._retry_finals()  # not the ones whose completion is in flight (self._io, _start_all)
        await self._retry_hand_backs()
        if not self.rt.draining.is_set():
            await self._claim_now_or_beside_the_step()
        if not len(self.sched):
            self.last_batch_size = 0  # nothing to step: the gauge would keep the last step's batch
            await self._settle_io()  # nothing to step: let the last calls land
            if self.rt.held:
                # Held work but nothing to step (completions to retry, or a request that is not
                # running): nothing above had to wait, so without this the loop spun without
                # ever yielding -- no heartbeat, no lease renewal, no signal handled (issue 14).
                await asyncio.sleep(IDLE_HELD_S)
            return
        try:
            res = await self.sched.step()
        except (RedisUnavailable, asyncio.CancelledError):
            raise
        except Exception:  # the engine's state is suspect: fail what it held
            log.exception("engine step failed")
            # The client reads that the engine failed, not the exception's text (the log has it).
            await self._after_engine_error("engine error in the worker (details in its log)")
            return
        await self._after_step(res)

    # --- pulling -------------------------------------------------------------------------------
    async def _claim_now_or_beside_the_step(self) -> None:
        """:meth:`_pull` now, or, for a batch that is full and running, as a task beside the
        next step. A look-ahead claim's requests can only run once a slot frees or a lower
        class is paused for them, at the next step either way; awaited before the step, its
        round trips (the wake-marker ``LPOP``, the claim) held the GPU idle: at 1.0x load a
        qos worker spent ~10 ms between ~33 ms steps (fifo's ~3 ms), most of it in those round
        trips. The task's claims start between two steps like any other (``_start_all``).

        No step starts while a look-ahead claim is pending, so what it claims runs in the very
        next step: a claim still in flight when its step ends is waited for (the rest of a
        round trip, at most ``LOOKAHEAD_WAIT_S``: a stalled Redis never stops the batch), and
        one still asleep (the step ended before its predicted end) is dropped for a claim
        made at once, waited for the same way. Left pending, as before, the next step ran without it and
        without a look-ahead of its own: what arrived during the step waited one or two steps
        more (a light tenant's TTFT beside a flood, 6 % of steps, docs/benchmarks.md)."""
        if self._claiming is not None:
            if self._lookahead_asleep and not self._claiming.done():
                await self._abandon_claim()  # asleep: no Redis call of it has started
                self._claiming = asyncio.create_task(self._pull(), name="look-ahead-claim")  # at once
            if not self._claiming.done():
                # The rest of its round trip, but never a stalled Redis: past LOOKAHEAD_WAIT_S
                # the step goes on without it, as a full batch must (its streams keep going).
                await asyncio.wait({self._claiming}, timeout=LOOKAHEAD_WAIT_S)
                if not self._claiming.done() and self.sched.running:
                    return
            await self._settle_claim()
        if self.sched.running and self._batch_full():
            self._lookahead_asleep = True  # until its sleep ends (it has not even started)
            self._claiming = asyncio.create_task(self._pull_late(), name="look-ahead-claim")
        else:
            await self._pull()

    async def _pull_late(self) -> None:
        """:meth:`_pull` near the end of the step it runs beside (that step's length as the
        cost fit predicts it, else the last step's, less ``LOOKAHEAD_LEAD_S``): it then sees
        what arrived during most of that step and, done before the step ends, its requests
        run in the very next step. Claimed at the step's start, a P0 arriving during the step
        waited one more step: P0 TTFT p50 70 -> 94 ms at 1.0x load (docs/benchmarks.md). Timed
        by the last step alone, a long prefill step after short decode steps was claimed for
        early in it, and what arrived in the rest of it waited a whole step more."""
        expected = self.sched.expected_step_ms()  # the task first runs once the step has started
        wait = (self._last_step_ms if expected is None else expected) / 1e3 - LOOKAHEAD_LEAD_S
        try:
            if wait > 0:
                await asyncio.sleep(wait)
        finally:
            self._lookahead_asleep = False
        await self._pull()

    async def _settle_claim(self) -> None:
        """Wait for the look-ahead claim; raises its outage, if any."""
        task, self._claiming = self._claiming, None
        if task is not None:
            await task

    async def _abandon_claim(self) -> None:
        """End a look-ahead claim still in flight when the loop ends (what it claimed and did
        not start requeues when its lease expires)."""
        task, self._claiming = self._claiming, None
        if task is None:
            return
        await stop_tasks([task], "the step loop's look-ahead claim", wait_s=1.0)
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None \
                and not isinstance(exc, RedisUnavailable):
            log.error("the look-ahead claim failed", exc_info=exc)

    def _room(self) -> tuple[int, int]:
        """(free batch slots, free KV tokens) once every held request is counted; no KV
        (and no pass over the held requests: a full batch asks every step) without a slot."""
        slots = self.rt.settings.max_seqs - len(self.rt.held)
        return slots, self.kv_capacity - self._reserved() if slots > 0 else 0

    def _batch_full(self) -> bool:
        slots, kv_free = self._room()
        return slots <= 0 or kv_free <= 0

    def _lookahead(self) -> tuple[int, int, str, list[str], str] | None:
        """The claim a worker with no room makes so that a higher class may preempt:
        (n, room, above_class, avoid_tenants, avoid_from), or None when it holds its share
        beyond a full batch already (bounded hoarding: ``claim_ahead``)."""
        s = self.rt.settings
        waiting = self.sched.waiting
        past = self._beyond_reservation()
        beyond = max(len(waiting), len(past))
        holders = self._holders(waiting, past)
        if beyond < s.claim_ahead:
            # Not for a tenant holding two or more slots of its class more than another
            # tenant of it here: its request would only wait for a slot to free, and a poorer
            # tenant's, which could take one of its slots now, would wait a step for this
            # worker's next look-ahead (VTC puts the flood first while a light tenant's burst
            # is served above its share).
            avoid, avoid_from = self._tenants_ahead()
            return 1, self.kv_capacity, "", avoid, avoid_from
        if s.claim_ahead > 0 and holders and (ahead := self._tenant_lookahead(holders)) is not None:
            # Every waiting request belongs to a tenant that holds two or more slots of its
            # class: a tenant holding none would wait for a slot to free (a flood's long
            # streams hold them all). Claim one request of any other tenant (or of a class
            # above): it takes a rich tenant's slot (worker/batch_policy.py). Once it waits here
            # this branch is closed until it runs (bounded hoarding).
            return 1, self.kv_capacity, *ahead
        if s.claim_ahead > 0 and holders and (best := min(w.class_rank for w in holders)) > 0:
            # The look-ahead slots hold lower-class work: a newly queued request of a class
            # above all of it would otherwise wait for a slot to free. Claim only such a
            # class, so each extra claim raises the best waiting class (bounded hoarding).
            above = self.rt.cfg.class_names()[best] if best < len(self.rt.cfg.classes) else ""
            return 1, self.kv_capacity, above, [], ""
        return None

    def _holders(self, waiting: list[ScheduledSeq] | None = None,
                 past: list[str] | None = None) -> list[ScheduledSeq]:
        """What holds the look-ahead slots: the waiting requests, and the running ones past the
        KV at their reservations, which the engine started at once (it admits on KV used).
        With only the waiting ones, a worker full by reservations whose look-ahead P2 had
        started claimed nothing more: a P0 queued behind P2 decodes until one finished (a
        review)."""
        waiting = self.sched.waiting if waiting is None else waiting
        past = self._beyond_reservation() if past is None else past
        return waiting + [q for rid in past if (q := self.sched.seq(rid)) is not None and q.running]

    def _beyond_reservation(self) -> list[str]:
        """Held requests past what the KV holds at their reservations (in the order they came):
        a look-ahead claim made while the reservations fill the KV but slots are free starts
        at once (the engine admits on KV used, not reserved), so the waiting list alone did
        not bound it, and a worker took a request a look until every slot was full, then
        preempted them in turn as their KV grew."""
        total, beyond = 0, []
        for rid, d in self.rt.held.items():
            total += self._reservation(d)
            if total > self.kv_capacity:
                beyond.append(rid)
        return beyond

    def _reserved(self) -> int:
        """KV tokens the held requests may come to need."""
        return sum(self._reservation(d) for d in self.rt.held.values())

    def _reservation(self, d: Delivery) -> int:
        """KV tokens a held request may come to need: its prompt and its most output."""
        return min(d.claimed.input_tokens + d.claimed.max_tokens, self.kv_capacity)

    async def _pull(self) -> None:
        """Claim what fits (see the module docstring). Claims are paced so that a queue
        whose head this worker cannot take (it needs more KV than the worker has) does not
        turn into a hot loop: ``claim`` re-announces a backlog it leaves behind, so after a
        second empty claim in a row the next one waits ``claim_interval_ms``, doubling up to
        ``MAX_BACKOFF_INTERVALS`` of them, until a claim returns work or the wake list goes
        quiet. While busy, a claim is made only when a wake marker says work was announced."""
        s = self.rt.settings
        held = len(self.rt.held)
        now = time.monotonic()
        # A busy worker's looks are paced: most steps of a fast engine come before the next is
        # due, and need nothing below (the room's pass over the held requests, the waiting list).
        if held and (now < self._next_claim or now < self._next_look):
            return
        slots, kv_free = self._room()
        if held and (slots <= 0 or kv_free <= 0) and now < self._next_lookahead:
            return  # full by slots or by KV: look ahead every claim_interval_ms, no more
        if slots > 0 and kv_free > 0:
            n, room, above, avoid, avoid_from = slots, kv_free, "", [], ""
        elif (ahead := self._lookahead()) is not None:
            n, room, above, avoid, avoid_from = ahead
        else:
            return
        if held:
            if not await self.rt.take_wake_marker():
                self._next_look = now + s.wake_check_ms / 1e3  # nothing announced: look again soon
                return
        elif not self._idle_claim_due:
            # Just gone idle. Whatever is queued now was announced on the wake list (admit, a
            # requeue and a claim that leaves work behind push a marker; a claim that empties
            # the queue clears them), so wait on it -- the BLPOP returns at once when a marker
            # is there -- instead of claiming: a claim that finds nothing costs the shard a
            # whole claim script (~150 us), and one came with every idle spell.
            await self._wait_for_work()
            return
        elif now < self._next_claim:
            await asyncio.sleep(self._next_claim - now)
        got = await self.rt.claim(n, room, above, self.claim_total, avoid, avoid_from)
        if not got and held and room < self.kv_capacity and self.rt.claim_left_backlog \
                and time.monotonic() >= self._next_lookahead and (ahead := self._lookahead()) is not None:
            # Work is queued and none of it fits the room left, a few tokens short of full or a
            # prompt's worth: look ahead as a full worker does (paced alike). A P0 that did not
            # fit closed its class for the claim and never reached a worker a few tokens short
            # of full (at exactly full, the look-ahead took it at once and preempted a P2).
            n, room, above, avoid, avoid_from = ahead
            got = await self.rt.claim(n, room, above, self.claim_total, avoid, avoid_from)
            if not got:
                self._next_lookahead = time.monotonic() + s.claim_interval_ms / 1e3
        if got:
            self._empty_claims, self._next_claim, self._next_lookahead = 0, 0.0, 0.0
            self._next_look = 0.0  # what arrived during the claim's round trip: looked for at once
            self._idle_claim_due = False
            await self._start_all(got)
            return
        if above or avoid:
            # A look-ahead for a higher class found none: expected (the markers were for lower
            # classes), and no reason to back off. A growing back-off here kept a full worker
            # from claiming a P0 for up to idle_block_s: P0 queue waits of 0.5 s at 1.0x load.
            # Only further look-ahead waits: a slot freeing meanwhile is claimed at once.
            self._next_lookahead = time.monotonic() + s.claim_interval_ms / 1e3
            return
        if not self.rt.claim_left_backlog:
            # Nothing is queued: the marker was stale (one claim took the work of several
            # markers). No back-off: the next marker means new work, and a back-off here made an
            # idle worker sleep up to 100 ms past a new request (TTFT p50 15 ms at 200 req/s).
            self._empty_claims, self._next_claim = 0, 0.0
        else:
            self._empty_claims += 1
        if self._empty_claims >= 2:  # a wake marker, work queued, yet nothing for us: back off
            # ...but never long: what is queued may be held by its class's ceiling (a P2 flood
            # at its limit), and a P0 admitted meanwhile must not wait out a long back-off (a
            # back-off growing to idle_block_s left P0 queued 0.4-2 s behind a P2 flood).
            backoff = s.claim_interval_ms / 1e3 * min(2 ** (self._empty_claims - 2), MAX_BACKOFF_INTERVALS)
            self._next_claim = time.monotonic() + min(s.idle_block_s, backoff)
        if not held:
            await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        """Block on the wake list (:meth:`WorkerRuntime.wait_for_work`). The next claim of
        an idle worker is due after it, marker or not: the marker it took was that claim's
        cue, and a wait that timed out is the safety net for a marker lost (a worker that
        took one and stopped before its claim). A back-off is slept out before the wait, not
        after it: a marker held through the sleep (claim announces work it leaves again) is
        one another idle worker never sees -- one with the KV for a request this one cannot
        take waited out this one's back-off, up to 100 ms, before it claimed."""
        if self._empty_claims >= 2 and (backoff := self._next_claim - time.monotonic()) > 0:
            await asyncio.sleep(backoff)
        self._idle_claim_due = True
        if not await self.rt.wait_for_work():
            self._empty_claims, self._next_claim = 0, 0.0  # quiet: nothing is queued for anyone

    async def _start_all(self, got: list[Delivery]) -> None:
        """Start every claimed request, even when one of them fails to: a failure used to skip
        the rest, which stayed held (their leases renewed for ever) but never ran -- their
        clients waited until request_timeout_s and a drain until drain_timeout_s."""
        # Every claimed request parts from an earlier attempt's state before any of them starts:
        # starting one may wait on Redis (a completion), and meanwhile the old sequence of a
        # request claimed back ran on with its tokens taken for the new attempt's.
        for d in got:
            self._part_from_earlier_attempt(d)
        outage: RedisUnavailable | None = None
        for d in got:
            try:
                await self._start(d)
            except RedisUnavailable as exc:  # its finish failed: d.final is set, retried later
                outage = outage or exc
            except Exception:
                log.exception("%s: could not start", d.request_id)
                try:
                    # The reason reaches the client: no exception text (it can name hosts
                    # and paths); the log above has it.
                    await self._finish_unstarted(d, "failed", "error",
                                                 "the worker could not start it (an internal error)")
                except RedisUnavailable as again:
                    outage = outage or again
        if outage is not None:
            raise outage

    def _tenants_ahead(self) -> tuple[list[str], str]:
        """Tenants holding at least two more of their class's slots here than another tenant
        of that class running here (the richest first, at most 16), and the highest such
        class (they are avoided there and below); ([], '') when there is none. A class with a
        single tenant here has none: its look-ahead is unchanged."""
        slots = tenant_slots(self.sched.running, fair_only=True)
        least: dict[int, int] = {}
        for (rank, _), n in slots.items():
            least[rank] = min(least.get(rank, n), n)
        ahead = {key: n for key, n in slots.items() if n >= least[key[0]] + 2}
        if not ahead:
            return [], ""
        most: dict[str, int] = {}
        for (_, t), n in ahead.items():
            most[t] = max(most.get(t, 0), n)
        tenants = sorted(most, key=lambda t: (-most[t], t))[:16]
        return tenants, self.rt.cfg.class_names()[min(r for r, _ in ahead)]

    def _tenant_lookahead(self, holders: list[ScheduledSeq] | None = None
                          ) -> tuple[str, list[str], str] | None:
        """For a full worker whose look-ahead ``holders`` (the waiting requests, and running ones
        past the KV at their reservations) all belong to *rich* tenants -- within one
        of the most slots any tenant of their class holds here, that being two or more: a
        tenant with fewer could take one of those slots (worker/batch_policy.py) -- the claim's
        ``above_class`` (every class down to the lowest such class), the tenants to avoid
        (the richest first, at most 16) and the highest class they are avoided in (the best
        waiting class: every class above it is claimed freely); else None."""
        slots = tenant_slots(self.sched.running, fair_only=True)
        top: dict[int, int] = {}
        for (rank, _), n in slots.items():
            top[rank] = max(top.get(rank, 0), n)
        holders = self._holders() if holders is None else holders
        if not holders:
            return None
        # Only tenants of the holders' classes and below: a class above every holder is
        # claimed freely (the above_class look-ahead), whoever holds its slots -- avoiding a
        # single-tenant P0 there kept P0 queued for seconds behind a P2 flood.
        best = min(w.class_rank for w in holders)
        rich = {key: n for key, n in slots.items()
                if key[0] >= best and top[key[0]] >= 2 and n >= top[key[0]] - 1}
        if not rich or any((w.class_rank, w.tenant) not in rich for w in holders):
            return None
        names = self.rt.cfg.class_names()
        lowest, highest = max(r for r, _ in rich), best
        most: dict[str, int] = {}
        for (_, t), n in rich.items():
            most[t] = max(most.get(t, 0), n)
        tenants = sorted(most, key=lambda t: (-most[t], t))[:16]
        return (names[lowest + 1] if lowest + 1 < len(names) else ""), tenants, names[highest]

    def _part_from_earlier_attempt(self, d: Delivery) -> None:
        """``d`` was just claimed: what the loop holds of an earlier attempt of its request is
        stale. Called before anything is awaited after the claim (:meth:`_start_all`)."""
        c = d.claimed
        # News gathered so far is of an earlier attempt, not of this one (running or not: one
        # whose completion had not landed is re-claimed too, after an outage past its lease).
        self._lost.pop(c.request_id, None)
        self._stop.discard(c.request_id)
        if c.request_id in self.sched:
            # Our own lease on an earlier attempt expired (Redis was out of reach longer than
            # the lease) and claim handed the request back to us: that sequence is stale, the
            # new attempt resumes from what Redis recorded as delivered.
            self.sched.remove(c.request_id)
            log.info("%s: re-claimed at attempt %d after our lease expired; restarting from token %d",
                     c.request_id, c.attempt, c.delivered)

    async def _start(self, d: Delivery) -> None:
        c, p = d.claimed, d.payload
        max_tokens = min(p.max_tokens, c.max_tokens)
        done = resume_finish_reason(c.generated, max_tokens, self.engine.eos_id)
        if done is not None:  # the last attempt died between its final push and complete
            await self._finish_unstarted(d, "ok", done)
            return
        if p.upstream:
            # Fields for a model server (the pool's upstream_fields): this engine does not do
            # what they ask, and serving the request without them answers another question.
            await self._finish_unstarted(d, "refused", "error", f"the fields {', '.join(sorted(p.upstream))} "
                                         f"are for a model server; this worker runs the {self.rt.engine} "
                                         "engine, which does not implement them")
            return
        if p.prompt_ids:  # another model's ids: this engine reads text
            await self._finish_unstarted(d, "refused", "error", "a token-id prompt is for a model server; "
                                         f"this worker runs the {self.rt.engine} engine, which takes text")
            return
        prompt = self.engine.encode(p.prompt)
        if (n := len(prompt) + len(c.generated)) > (room := self.sched.max_context()):
            # The prompt alone too long: refused, another try fails the same way (its client is
            # told so: a 400, not a 503). With tokens generated by an earlier attempt (on a
            # bigger worker) it is this resume that does not fit: a failure a retry may mend.
            outcome = "failed" if c.generated else "refused"
            await self._finish_unstarted(d, outcome, "error", f"prompt of {len(prompt)} tokens "
                                         f"(+{len(c.generated)} generated, {n} in all) exceeds this "
                                         f"worker's context of {room} tokens")
            return
        try:
            params = SamplingParams(temperature=p.temperature, seed=request_seed(p.seed, c.request_id),
                                    max_tokens=max_tokens, stop=p.stop,
                                    eos_min_len=SamplingParams.eos_rule(len(prompt), p.ignore_eos,
                                                                        p.min_tokens))
        except InvalidArgument as exc:
            await self._finish_unstarted(d, "refused", "error", f"bad sampling parameters: {exc}")
            return
        self._arrivals += 1
        self.sched.add(c.request_id, prompt, params, class_rank=d.class_rank,
                       arrival=(c.enq_ms, self._arrivals), generated=c.generated,
                       tenant=c.tenant if self._fair.get(c.cls, False) else "", by_floor=c.by_floor)
        self._capacity.started(len(prompt) + max_tokens)  # clipped to the room there
        if c.delivered:
            log.info("%s: resuming attempt %d at token %d", c.request_id, c.attempt, c.delivered)

    async def _finish_unstarted(self, d: Delivery, outcome: str, finish_reason: str,
                                message: str = "") -> None:
        """Complete a claimed request that is not started (refused, resumed at its end, could
        not start). Claimed by the look-ahead claim, it completes in that task, beside the
        loop: until the call returns, the loop's :meth:`_retry_finals` leaves it alone. It
        sent the same ``complete`` again (``d.final`` is set as the call goes out), and the
        one of the two that came second could read as a lost lease: logged "lease lost" and
        counted ``finished{outcome=lost}`` for a request that was answered (a review)."""
        self._start_finishing.add(d.request_id)
        try:
            await self.rt.finish(d, outcome, finish_reason, message)
        finally:
            self._start_finishing.discard(d.request_id)

    # --- after a step --------------------------------------------------------------------------
    async def _after_step(self, res: StepResult) -> None:
        m, s = self.rt.metrics, self.rt.settings
        m.step_seconds.observe(res.duration_s)
        self.last_batch_size = len(res.plan.decode) + len(res.plan.prefill)
        m.generated_tokens.inc(len(res.produced))
        if res.plan.prefill:  # most steps prefill nothing and pause nothing: no lock taken for 0
            m.prefill_tokens.inc(res.plan.prefill_tokens)
        if res.preempted:
            m.preemptions.inc(len(res.preempted))
        self._gen_tokens += len(res.produced)
        self._step_time += res.duration_s
        held = self.rt.held
        plan = res.plan
        # weighted tokens: prefill x weight + generated x out_weight
        output_work = fresh_work = 0.0
        for rid, n in res.fresh_prefill.items():  # useful work (recomputation is not)
            if (d := held.get(rid)) is not None:
                fresh_work += n * self.rt.weights(d.claimed.cls)[0]
        for rid in res.produced:
            if (d := held.get(rid)) is not None:
                output_work += self.rt.weights(d.claimed.cls)[1]
        self._work_done += fresh_work + output_work
        full = plan.num_tokens >= FULL_SHARE * res.token_budget or \
            len(plan.decode) + len(plan.prefill) >= FULL_SHARE * self.limits.max_seqs
        prefill_work = 0.0  # recomputation included: the full steps' rate counts it
        if full:
            for chunk in plan.prefill:
                if (d := held.get(chunk.request_id)) is not None:
                    prefill_work += chunk.length * self.rt.weights(d.claimed.cls)[0]
        self._busy.step(res.start, res.end, full=full, work=prefill_work + output_work)
        self._capacity.step(res.start, res.end, plan.prefill_tokens,
                            [d.class_rank for rid in plan.decode if (d := held.get(rid)) is not None],
                            busy_before=self._work_left, fresh_prefill_work=fresh_work,
                            outputs=len(res.produced), output_work=output_work)
        if self._work_left and self._prev_step_end is not None:
            self._gap_time += max(0.0, res.start - self._prev_step_end)
            self._gaps += 1
        self._prev_step_end = res.end
        self._work_left = bool(self.sched.running)
        self._steps += 1
        self._last_step_ms = res.duration_s * 1e3
        t = time.monotonic() - (time.perf_counter() - res.end)  # the step's end, monotonic clock
        self._push_clock.step_ended(t)
        for rid in res.produced:
            if rid in held:
                held[rid].note_tokens(1, t)
        finishing: list[tuple[Delivery, str]] = []
        for rid, em in res.emissions.items():
            d = held.get(rid)
            if d is None:
                continue
            d.add(em.token_ids, em.text, t)
            if em.finish_reason is not None:
                d.final = ("ok", em.finish_reason, "")  # should its call never land: _retry_finals
                finishing.append((d, em.finish_reason))
        ending = {d.request_id for d, _ in finishing}
        now, step = time.monotonic(), res.duration_s
        pushes = self._due(ending, now, step)  # asked every step: the push clock keeps time so
        io = self._io
        if io is not None:
            # The previous step's calls, awaited before this step's own, so one request's calls
            # never overlap. Still running, they are left beside the next step when this one
            # completes nothing; its pushes and cancel check go with a later step's (they would
            # have waited for that reply anyway): a null engine's steps are shorter than a
            # round trip, and every step after a push waited for its reply.
            running = not io.done()
            if running and not finishing:
                return
            await self._settle_io()
            if running:  # its replies moved the requests it pushed
                now = time.monotonic()
                pushes = self._due(ending, now, step)
        # Whether their clients cancelled: one SMISMEMBER over the held requests at most every
        # flush_ms (a step of a null-cost engine takes well under a millisecond: per step it was
        # most of the Redis commands per request). Pushes do not say it: reading the flag and
        # answering with a table cost every push ~6-7k instructions a request (~7 % of a push
        # of 8, lua/push_tokens.lua), one SMISMEMBER a flush ~0.9k a request.
        live: list[str] = []
        if now - self._cancel_checked >= s.flush_ms / 1e3:
            live = [rid for rid, d in held.items() if rid not in ending and d.final is None]
            self._cancel_checked = now
        self._io_finishing = ending
        # The pushes' batches are made now: they carry this step's tokens even when the next
        # step starts before this task first runs. The calls themselves are made by the task:
        # one cancelled before it ran (a hopeless drain) leaves no coroutine unawaited.
        batches = self.rt.batches(pushes)
        if finishing or batches or live:
            self._io = asyncio.create_task(self._send(finishing, batches, live), name="step-io")
        # else no task at all: most steps of a stream between its pushes have nothing to send,
        # and a task with its gather was a quarter of such a step's CPU at one sequence

    def _due(self, ending: set[str], now: float, step_s: float) -> list[Delivery]:
        """The held requests whose tokens are pushed now (``ending``: those completing now)."""
        return [d for rid, d in self.rt.held.items() if rid not in ending and d.final is None
                and self.rt.push_due(d, now, step_s, self._push_clock)]

    async def _abandon_io(self) -> None:
        """End the last step's calls without waiting on Redis: left running, they outlived the
        worker (pending at exit, or failing with nobody to read it). Redis being out of reach
        they may be stuck until the client's timeouts: cancelled (what they carried is
        settled by the offset checks of whoever resumes the requests), bounded by stop_tasks."""
        io, self._io = self._io, None
        if io is None:
            return
        await stop_tasks([io], "the step loop's last Redis calls", wait_s=1.0)
        if io.done() and not io.cancelled() and (exc := io.exception()) is not None \
                and not isinstance(exc, RedisUnavailable):
            log.error("the last step's Redis calls failed", exc_info=exc)

    async def _settle_io(self) -> None:
        """Wait for the last step's Redis calls; raises their outage, if any."""
        io, self._io = self._io, None
        if io is not None:
            await io

    async def _send(self, finishing: list[tuple[Delivery, str]],
                    pushes: list[tuple[Delivery, TokenBatch]], live: list[str]) -> None:
        """One step's completions (each request and its finish reason), its pushes (one
        ``push_tokens`` call for every batch) and the cancel check, concurrently; what they
        learn (cancelled, lease lost) is applied at the next iteration."""
        calls = {d.request_id: (d, self.rt.finish(d, "ok", reason)) for d, reason in finishing}
        every = [*(c for _, c in calls.values()), self.rt.push_batches(pushes), self.rt.cancelled(live)]
        if len(finishing) + bool(pushes) + bool(live) <= 1:
            # One call with a round trip (the others return at once): awaited in this task.
            # gather makes each call a task, which starts a loop turn later: behind a null
            # engine's step a push went out two steps after its tokens.
            results = await _one_by_one(every)
        else:
            results = await asyncio.gather(*every, return_exceptions=True)
        outage: BaseException | None = None
        news: list[tuple[Delivery, Any]] = [(d, r) for (d, _), r in
                                            zip(calls.values(), results, strict=False)]
        pushed, cancelled = results[-2], results[-1]
        if isinstance(pushed, BaseException):
            outage = pushed
        else:
            news += pushed
        for d, r in news:
            rid = d.request_id
            if self.rt.held.get(rid) is not d and isinstance(r, LeaseLost | InvalidArgument):
                continue  # re-claimed meanwhile (our lease had expired): news of the old attempt
            if isinstance(r, LeaseLost):
                self._lost[rid] = d
            elif isinstance(r, InvalidArgument):  # its tokens refused: it fails, not the call
                self._refused[rid] = (d, r)
            elif isinstance(r, BaseException):
                outage = r
        if isinstance(cancelled, BaseException):
            outage = cancelled
        else:
            self._stop.update(cancelled)
        if outage is not None:
            raise outage

    async def _apply_signals(self) -> None:
        """Drop lost requests; fail the ones whose tokens Redis refused; cancel the ones whose
        client went away (the step after the one whose calls found out)."""
        if not (self._lost or self._stop or self._refused):
            return
        await self._settle_io()  # a push for one of them may still be in flight
        lost: set[str] = set()
        for rid, d in self._lost.items():
            if self.rt.held.get(rid) is d:  # not a newer attempt (it parted from the old sequence)
                lost.add(rid)
                self.sched.remove(rid)
                self.rt.drop(rid, "lost", d)
        self._lost = {}
        refused, self._refused = self._refused, {}
        calls, failing = [], set()
        for rid, (d, exc) in refused.items():
            # Not when lost, re-claimed, or finishing already: its completion carries the same
            # tokens, and meets the same refusal (WorkerRuntime.finish fails it then).
            if rid not in lost and self.rt.held.get(rid) is d and d.final is None:
                self.sched.remove(rid)
                failing.add(rid)
                calls.append(self.rt.fail_refused(d, exc))
        stop, self._stop = self._stop - lost - failing, set()
        for rid in stop:
            seq = self.sched.seq(rid)
            self.sched.remove(rid)
            # Not one whose answer is decided (its completion met an outage, retried by
            # _retry_finals): the answer decided first wins, and a cancel here turned a whole
            # answer into a cancelled one.
            if (d := self.rt.held.get(rid)) is not None and d.final is None:
                if d.claimed.delivered == 0 and (seq is None or seq.kv_high == 0):
                    # never prefilled, by this attempt or one before it (a look-ahead waiting
                    # for a slot): the engine processed none of its prompt, which complete's
                    # usage_in says -- charged nothing, as a hand-back of it is, not its prompt
                    d.usage_in = 0
                d.final = ("cancelled", "cancelled", "")
                calls.append(self.rt.finish(d, "cancelled", "cancelled"))
        if calls:
            await self._gather(calls)

    async def _retry_finals(self) -> None:
        """Completions that failed on a Redis outage are retried until they land; not those
        still in flight (the last step's calls, or a completion :meth:`_start_all` or the
        claim itself, failing an unusable request, makes: in the look-ahead claim's task)."""
        busy = self._io_finishing if self._io is not None else set()
        starting, failing = self._start_finishing, self.rt.failing_unusable  # (no union made every step)
        calls = [self.rt.finish(d, *d.final) for rid, d in self.rt.held.items()
                 if d.final is not None and rid not in self.sched and rid not in busy and rid not in starting
                 and rid not in failing]
        if calls:
            await self._gather(calls)

    async def _gather(self, calls: list[Any]) -> None:
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    async def _after_engine_error(self, message: str) -> None:
        """An engine step raised: its state is suspect, so every sequence leaves the scheduler
        (and the engine). The requests the engine held -- running, or paused with their KV
        kept -- fail with ``message``; the ones it did not hold -- a look-ahead request
        waiting for a slot, a sequence paused with its KV freed -- are handed back (released
        and requeued, as a drain hands back what never started) and resume from what was
        delivered, here or on another worker. Before, every held request failed: one engine
        error ended requests the engine never had (a review)."""
        dropped = self.sched.clear()
        # The last step's calls first: a completion of theirs decides its request. An outage
        # they met is no reason to stop here (as in _release): their completions are retried
        # (d.final), their pushes settled by the offset checks.
        with contextlib.suppress(RedisUnavailable, PolicyMissing):
            await self._settle_io()
        failing = []
        for s in dropped:
            d = self.rt.held.get(s.request_id)
            if d is None or d.final is not None:
                continue  # gone, or finishing already (_retry_finals)
            if s.running or s.resident:
                failing.append(d)
            else:
                self._handing_back[s.request_id] = d
        if failing or self._handing_back:
            log.warning("engine error: failing %d request(s) the engine held, handing back %d it did not",
                        len(failing), len(self._handing_back))
        calls = [self.rt.finish(d, "failed", "error", message) for d in failing]
        await self._gather([*calls, self._retry_hand_backs()])

    async def _retry_hand_backs(self) -> None:
        """Release what an engine error hands back (:meth:`_after_engine_error`); a release
        that met an outage is tried again at the next iteration (until then the request is
        held, neither running nor finishing: nothing else would end it)."""
        if not self._handing_back:
            return
        held = self.rt.held
        # Not one released already, nor a new attempt under its id (a re-claim), nor one
        # finishing (its client's cancel: the completion decides it).
        todo = self._handing_back = {rid: d for rid, d in self._handing_back.items()
                                     if held.get(rid) is d and d.final is None and rid not in self.sched}
        await self._gather([self.rt.release(d) for d in list(todo.values())])
        self._handing_back = {rid: d for rid, d in todo.items() if held.get(rid) is d}

    async def _hand_back_all(self) -> None:
        """At the drain deadline, hand back everything held (:meth:`WorkerRuntime.hand_back`:
        a decided answer is finished, the rest released, through a passing outage)."""
        # As in _release: an outage (or NOPOLICY: Redis restarted empty) the step's calls met is
        # no reason not to hand back; their completions are retried below (d.final), hand_back
        # writes the pool again if it has to.
        with contextlib.suppress(RedisUnavailable, PolicyMissing):
            await self._settle_io()
        for rid in list(self.rt.held):
            self.sched.remove(rid)
        await self.rt.hand_back(list(self.rt.held.values()))

    async def _release(self, ids: list[str]) -> None:
        """Hand ``ids`` back (drain); ones already finishing are finished instead."""
        try:
            await self._settle_io()
        except (RedisUnavailable, PolicyMissing):
            # An outage (or NOPOLICY) the last step's calls met is no reason not to try now: their
            # pushes are settled by the offset checks, their completions are retried (d.final).
            pass
        calls = []
        for rid in ids:
            self.sched.remove(rid)
            if (d := self.rt.held.get(rid)) is not None:
                calls.append(self.rt.finish(d, *d.final) if d.final else self.rt.release(d))
        await self._gather(calls)

    # --- heartbeat -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Heartbeat figures since the last heartbeat. ``capacity_tokens_s`` is the weighted
        tokens per second this worker would serve saturated (worker/saturated_capacity.py), or,
        until its fit and mix are known, per busy second of its full steps
        (worker/busy_meter.py; 0 = no full step, no measurement): what the controller's
        capacity estimator sums over live workers. ``capacity_basis`` says which."""
        now = time.monotonic()
        dt = max(now - self._last_stats_t, 1e-9)
        tokens_s = self._gen_tokens / dt
        step_ms = self._step_time / self._steps * 1e3 if self._steps else self._last_step_ms
        gap_ms = self._gap_time / self._gaps * 1e3 if self._gaps else 0.0
        self._gap_time, self._gaps = 0.0, 0
        measured = self._busy.take()
        saturated = self._capacity.value()
        capacity = saturated or measured
        self._gen_tokens, self._step_time, self._steps, self._last_stats_t = 0, 0.0, 0, now
        running = self.sched.running
        kv_used = self.sched.kv_used
        return {"batch_size": len(running), "running": len(running), "waiting": len(self.sched.waiting),
                "tokens_s": round(tokens_s, 1), "capacity_tokens_s": round(capacity, 1),
                "capacity_basis": "saturated" if saturated else "full_steps",
                "full_steps_tokens_s": round(measured, 1),
                "step_ms": round(step_ms, 2), "step_gap_ms": round(gap_ms, 3),
                "kv_used": kv_used, "kv_capacity": self.kv_capacity,
                "kv_use": round(kv_used / self.kv_capacity, 4),
                "token_budget": self.sched.budget.last if self.sched.budget else self.limits.token_budget,
                "token_budget_max": self.limits.token_budget,
                "max_seqs": self.limits.max_seqs, "chunked_prefill": int(self.limits.chunked_prefill),
                "preemptions": self.sched.preemptions, "recompute_tokens": self.sched.recompute_tokens,
                "work_done": round(self._work_done, 1)}


async def _one_by_one(calls: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """``asyncio.gather(*calls, return_exceptions=True)`` in this task, one call after the
    other: for calls of which one at most waits on Redis. Those not reached when this task is
    cancelled are closed (never started, nothing to warn about)."""
    out: list[Any] = []
    try:
        for call in calls:
            try:
                out.append(await call)
            except Exception as exc:
                out.append(exc)
    finally:
        for call in calls[len(out):]:
            call.close()
    return out
