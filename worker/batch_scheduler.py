"""The per-step state machine of continuous batching, shared by every step-based driver.

:class:`BatchScheduler` owns the sequences one engine serves and turns the pure policy of
:mod:`worker.batch_policy` into engine calls, one step at a time:

1. pause what :func:`~worker.batch_policy.choose_preemption` picks: back to the waiting set
   with its original arrival, keeping its KV when only a batch slot was short (readmitted,
   it goes on where it stopped), else with its KV freed (readmitted, it re-prefills prompt +
   generated tokens - the same path a request resumed on another worker takes),
2. start what :func:`~worker.batch_policy.choose_admissions` allows,
3. run one :func:`~worker.batch_policy.build_plan` step on the engine,
4. book the produced tokens: KV/prefill counters, decoding, finish detection (EOS,
   ``max_tokens``, the engine's context limit, stop strings on the decoded text).

Both the in-process :func:`worker.local_run.run_local` and the Redis worker
(:mod:`worker.claim_step_loop`) drive this class, so what the tests measure with
``run_local`` is the scheduling the production worker does. It knows nothing about Redis or clocks
beyond timing the engine call.

Text goes out through :class:`~worker.textstream.StopScanner`: an :class:`Emission` carries
only tokens whose text is complete in it (see that module for why resuming needs this).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from limiter.errors import InvalidArgument
from worker.batch_policy import (
    Arrival,
    Candidate,
    Limits,
    StepPlan,
    build_plan,
    choose_admissions,
    choose_preemption,
    prefill_through_behind,
)
from worker.engines.base import Engine, SamplingParams
from worker.step_budget import StepBudget
from worker.textstream import Release, StopScanner
from worker.tokenizer import IncrementalDecoder

ADMISSION_ROUNDS = 8  # more pause-and-admit rounds in one step, beyond the first (step())


@dataclass
class ScheduledSeq:
    """One request inside the scheduler (running or waiting)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    class_rank: int
    arrival: Arrival
    decoder: IncrementalDecoder
    scanner: StopScanner
    tenant: str = ""
    generated: list[int] = field(default_factory=list)  # every generated id, resumed ones included
    resumed_tokens: int = 0  # how many of ``generated`` came from an earlier attempt
    kv_tokens: int = 0
    to_prefill: int = 0
    running: bool = False
    resident: bool = False  # paused with its KV kept: the engine still holds the sequence
    preemptions: int = 0
    kv_high: int = 0  # the longest KV it ever reached: prefill below it is recomputation
    by_floor: bool = False  # claimed by its class's starvation floor: its slot is kept (batch_policy)

    @property
    def context(self) -> list[int]:
        return [*self.prompt_ids, *self.generated]

    @property
    def decoding(self) -> bool:
        """Nothing left to prefill: the planner's view of a running sequence
        (:class:`~worker.batch_policy.Planned`, which the scheduler's sequences are)."""
        return self.to_prefill == 0

    def candidate(self) -> Candidate:
        if self.resident:
            return Candidate(self.request_id, self.class_rank, self.arrival, self.to_prefill, self.kv_tokens,
                             self.tenant, self.by_floor)
        return Candidate(self.request_id, self.class_rank, self.arrival,
                         len(self.prompt_ids) + len(self.generated), tenant=self.tenant,
                         by_floor=self.by_floor)


class Emission(NamedTuple):
    """What one step releases for one request: token ids whose text is complete in ``text``
    (bar an unfinished UTF-8 character), and the finish reason when the request ended.
    Immutable as a frozen dataclass would be, but made at the cost of a tuple: a step makes
    one for every sequence, and a frozen dataclass's field-by-field init was a tenth of a
    128-sequence step's CPU."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # stop | length


@dataclass(frozen=True)
class StepResult:
    """One engine step. Times are ``time.perf_counter()`` readings around ``engine.step``."""

    plan: StepPlan
    start: float
    end: float
    produced: dict[str, int]  # the token each sequence produced this step (timing, counts)
    emissions: dict[str, Emission]  # what may be streamed; includes every finished request
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    fresh_prefill: dict[str, int] = field(default_factory=dict)  # prompt tokens prefilled for the first time
    # the step's token budget (worker/step_budget.py when adaptive; a step that prefills
    # nothing is not sized: limits.token_budget)
    token_budget: int = 0

    @property
    def duration_s(self) -> float:
        return self.end - self.start


def resume_finish_reason(generated: Sequence[int], max_tokens: int, eos_id: int | None) -> str | None:
    """A resumed request whose earlier attempt already reached its end (it died between its
    last push and its completion) must be completed, not run again."""
    if generated and eos_id is not None and generated[-1] == eos_id:
        return "stop"
    if len(generated) >= max_tokens:
        return "length"
    return None


class BatchScheduler:
    """Continuous batching with chunked prefill over one engine (module docstring)."""

    def __init__(self, engine: Engine, limits: Limits, budget: StepBudget | None = None,
                 top_prefill_tokens: int = 0) -> None:
        """``budget``: size each step from the decoders' TPOT targets and the measured step
        cost (``limits.token_budget`` is then the most a step may take); None = always
        ``limits.token_budget``. ``top_prefill_tokens``: a step may also prefill this many
        tokens of the top class's prompts, beyond that budget, and as many of the prompts of
        a tenant behind in its class while the decoders' TPOT targets allow (that needs
        ``budget``; 0 = no more for either)."""
        self.engine = engine
        # The plans are made against limits.kv_capacity: never more than the engine holds (a
        # plan past it was refused by the engine, InvalidArgument, on every step)
        if (held := engine.kv_capacity_tokens) < limits.kv_capacity:
            limits = replace(limits, kv_capacity=held)
        self.limits = limits
        self.budget = budget
        self.top_prefill_tokens = top_prefill_tokens
        self.max_seq_len: int | None = getattr(engine, "max_seq_len", None)
        self._seqs: dict[str, ScheduledSeq] = {}
        self.running_plan: StepPlan | None = None  # the step the engine runs now; None between steps
        # Ids removed while the engine stepped (a look-ahead claim runs beside the step): that
        # step's results are nobody's, also when the id is added again meanwhile (our lease had
        # lapsed and the claim handed the request back to us: a new sequence, a new attempt).
        self._removed_in_step: set[str] = set()
        self.preemptions = 0  # sequences paused so far
        self.recompute_tokens = 0  # KV tokens those pauses threw away (prefilled again on readmission)

    # --- membership ------------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq(self, request_id: str) -> ScheduledSeq | None:
        return self._seqs.get(request_id)

    @property
    def running(self) -> list[ScheduledSeq]:
        return [s for s in self._seqs.values() if s.running]

    @property
    def waiting(self) -> list[ScheduledSeq]:
        return [s for s in self._seqs.values() if not s.running]

    @property
    def kv_used(self) -> int:
        """KV tokens held now: running sequences', and paused ones' that kept theirs."""
        return sum(s.kv_tokens for s in self._seqs.values() if s.running or s.resident)

    def max_context(self) -> int:
        """The longest context (prompt + generated) a sequence can ever be admitted with."""
        room = min(self.limits.kv_capacity, self.engine.kv_capacity_tokens)
        if self.max_seq_len is not None:
            room = min(room, self.max_seq_len)
        return room - 1  # admission needs room for one generated token

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, class_rank: int,
            arrival: Arrival, generated: Iterable[int] = (), tenant: str = "",
            by_floor: bool = False) -> ScheduledSeq:
        """Queue a request. ``generated`` are tokens an earlier attempt already delivered:
        they are re-prefilled after the prompt and fed to a fresh decoder whose text is
        discarded (the client has it), so a half-emitted UTF-8 character continues.
        ``by_floor``: claim handed it out by its class's starvation floor (its class's
        ``Limits.floor_slots`` keep such requests' slots)."""
        if request_id in self._seqs:
            raise InvalidArgument("request_id", f"{request_id!r} is already scheduled")
        if not prompt_ids:
            raise InvalidArgument("prompt_ids", "prompt_ids must not be empty")
        gen = list(generated)
        decoder = self.engine.new_decoder()
        decoder.feed(gen)
        seq = ScheduledSeq(request_id, list(prompt_ids), params, class_rank, arrival, decoder,
                           StopScanner(params.stop), tenant, gen, len(gen), by_floor=by_floor)
        self._seqs[request_id] = seq
        return seq

    def remove(self, request_id: str) -> ScheduledSeq | None:
        """Drop a request (cancelled, lease lost, failed); frees its KV. None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and (seq.running or seq.resident):
            self.engine.remove(request_id)
        if seq is not None and self.running_plan is not None:
            self._removed_in_step.add(request_id)
        return seq

    def clear(self) -> list[ScheduledSeq]:
        """Drop everything (after an engine error the engine's state is suspect)."""
        out = list(self._seqs.values())
        for s in out:
            if s.running or s.resident:
                try:
                    self.engine.remove(s.request_id)
                except InvalidArgument:
                    pass
        self._seqs.clear()
        return out

    # --- one step ------------------------------------------------------------------------------
    def _pause(self) -> list[str]:
        paused = []
        while (p := choose_preemption(self.running, [s.candidate() for s in self.waiting],
                                      self.limits)) is not None:
            seq = self._seqs[p.request_id]
            if seq.running:
                self.preemptions += 1
                seq.preemptions += 1
                paused.append(p.request_id)
            seq.running = False
            if p.free_kv:  # its cache goes: readmitted, it re-prefills its whole context
                self.engine.remove(p.request_id)
                self.recompute_tokens += seq.kv_tokens
                seq.resident, seq.kv_tokens, seq.to_prefill = False, 0, 0
            else:  # only left out of the steps; the engine keeps its cache
                seq.resident = True
        return paused

    def _admit(self) -> tuple[list[str], bool]:
        """What was started, and whether anything still waits."""
        waiting = self.waiting
        if not waiting:  # most steps: nothing to choose from
            return [], False
        running = self.running
        admit = choose_admissions([s.candidate() for s in waiting], running, self.limits)
        if not admit and not running and self._seqs:
            head = min(waiting, key=lambda s: s.candidate().priority)
            raise InvalidArgument("requests", f"{head.request_id}: {len(head.context)} tokens can never "
                                  f"fit under {self.limits}")
        for rid in admit:
            seq = self._seqs[rid]
            if seq.resident:  # it kept its KV: go on where it stopped
                seq.running, seq.resident = True, False
                continue
            ctx = seq.context
            params = seq.params
            if seq.generated:
                # The engine counts max_tokens from the context it is given (Engine.add: the
                # torch engine sizes the sequence's KV by it): what is left of it. A whole
                # max_tokens more let a readmitted sequence's cache grow past its account.
                params = replace(params, max_tokens=max(1, params.max_tokens - len(seq.generated)))
            self.engine.add(rid, ctx, params)
            seq.running, seq.kv_tokens, seq.to_prefill = True, 0, len(ctx)
        return list(admit), len(admit) < len(waiting)

    async def step(self) -> StepResult:
        """Preempt, admit, run one planned engine step, book its tokens (module docstring).

        Raises :class:`InvalidArgument` when a waiting request can never fit; engine errors
        propagate (the caller decides what happens to the requests)."""
        paused = self._pause()
        admitted, left = self._admit()
        # choose_preemption makes room for the head of the waiting set only: with k P0
        # requests arriving together at a full batch, the next head is looked at once the
        # first is in, in this step, not one step later each (k steps of P2 decodes). Only
        # while a round started something and something still waits, and at most
        # ADMISSION_ROUNDS of them: each is O(sequences), and 256 P0s arriving at 256 P2s
        # made one step of 0.75 s; the rest start in the next steps.
        again = admitted
        for _ in range(ADMISSION_ROUNDS):
            if not (again and left):
                break
            paused += self._pause()
            again, left = self._admit()
            admitted += again
        running = self.running
        limits = self.limits
        tokens = limits.token_budget
        ranks = [s.class_rank for s in running if s.to_prefill == 0]
        # A step that prefills nothing is not sized: each decoder takes one token and a step's
        # budget is never below max_seqs (Limits), so the plan is the same at any budget, and
        # sizing it (the cost fit's least squares) was the largest single cost of a decode
        # step's CPU (docs/worker.md).
        sized = len(ranks) < len(running)
        if self.budget is not None and sized:
            tokens = self.budget.budget(ranks)
        if self.top_prefill_tokens and sized:
            # An interactive prompt is prefilled in a step or two, not in token-budget slices:
            # its TTFT is what its user waits for, while one longer step adds a fraction of a
            # millisecond to the mean TPOT of the streams decoding next to it.
            top = min(self.top_prefill_tokens, sum(s.to_prefill for s in running if s.class_rank == 0))
            tokens = max(tokens, len(ranks) + top)
            if self.budget is not None and (behind := prefill_through_behind(running)):
                # So is the prompt of a tenant behind in its class (batch_policy), but only as
                # far as the decoders' TPOT targets allow: the rich tenant's streams beside it
                # keep their SLO. build_plan prefills that tenant's prompt first in its class,
                # and the step takes no more than it needs: the rest of a TPOT-sized budget
                # went to the rich tenant's prompts, and the light tenant's token waited.
                # Never below the P0 prompt's share above: a P2 tenant behind in its class
                # took the P0's prompt down to the TPOT-sized step (2,000 tokens in 4 steps).
                allowed = self.budget.size(ranks, limits.token_budget + self.top_prefill_tokens)
                floor = len(ranks) + top if top else limits.max_seqs
                tokens = max(limits.max_seqs, floor, min(allowed, len(ranks) + top + behind))
        if tokens != limits.token_budget:
            limits = replace(limits, token_budget=tokens)
        plan = build_plan(running, limits)
        if plan.empty:  # admission and preemption keep KV demand within capacity
            raise RuntimeError(f"no progress possible under {self.limits} with {len(self.running)} running")
        start = time.perf_counter()
        self.running_plan = plan
        try:
            produced = await self.engine.step(plan)
        finally:
            self.running_plan = None
            gone = self._removed_in_step
            if gone:
                self._removed_in_step = set()
        end = time.perf_counter()
        if self.budget is not None:
            self.budget.observe(plan.prefill_tokens, len(plan.decode), (end - start) * 1000)

        # The sequences this step ran, less those removed meanwhile (a new sequence under a
        # removed one's id is not the one stepped: its KV and prefill were counted the old one's).
        seqs = {rid: s for rid, s in self._seqs.items() if rid not in gone} if gone else self._seqs
        for rid in plan.decode:
            if (seq := seqs.get(rid)) is not None:
                seq.kv_tokens += 1
                seq.kv_high = max(seq.kv_high, seq.kv_tokens)
        fresh: dict[str, int] = {}
        for chunk in plan.prefill:
            if (seq := seqs.get(chunk.request_id)) is not None:
                upto = chunk.start + chunk.length
                fresh[chunk.request_id] = max(0, upto - max(chunk.start, seq.kv_high))
                seq.kv_tokens += chunk.length
                seq.to_prefill -= chunk.length
                seq.kv_high = max(seq.kv_high, upto)
        emissions: dict[str, Emission] = {}
        room = self.max_context()
        for rid, token in produced.items():
            seq = seqs.get(rid)
            if seq is None:  # removed while the step ran
                continue
            seq.generated.append(token)
            piece = seq.decoder.feed_one(token)
            reason = self._finish_reason(seq, token, room)
            if reason is None and not seq.scanner.stops:  # most tokens: nothing held back or ended
                emissions[rid] = Emission(rid, (token,), piece)
                continue
            rel = seq.scanner.feed(token, piece)
            if rel.stopped:
                reason = "stop"
            elif reason is not None:
                tail = seq.scanner.finish(seq.decoder.flush())
                rel = Release(rel.token_ids + tail.token_ids, rel.text + tail.text, tail.stopped)
                reason = "stop" if tail.stopped else reason
            if reason is not None:
                self.remove(rid)
            if rel.token_ids or rel.text or reason is not None:
                emissions[rid] = Emission(rid, tuple(rel.token_ids), rel.text, reason)
        return StepResult(plan, start, end, dict(produced), emissions, tuple(admitted), tuple(paused), fresh,
                          limits.token_budget)

    def expected_step_ms(self) -> float | None:
        """How long the step the engine runs now takes, as the budget's cost fit predicts it
        (ms); None between steps, without an adaptive budget, or before the fit stands."""
        plan = self.running_plan
        if plan is None or self.budget is None:
            return None
        return self.budget.expected_ms(plan.prefill_tokens, len(plan.decode))

    def _finish_reason(self, seq: ScheduledSeq, token: int, room: int) -> str | None:
        """``room``: :meth:`max_context`, the same for every sequence of a step."""
        eos = self.engine.eos_id
        if eos is not None and token == eos:
            return "stop"
        if len(seq.generated) >= seq.params.max_tokens:
            return "length"
        if len(seq.prompt_ids) + len(seq.generated) > room:
            # the context is full: the model's (max_seq_len) or this worker's KV room, which
            # claim lets be smaller than prompt + max_tokens. Paused there, it could never be
            # admitted again, and the worker failed every request it held.
            return "length"
        return None
