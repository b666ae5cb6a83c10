"""The pure batch builder: what the GPU does in the next step (iteration-level batching).

The seed's problem is that a 32K-token prompt's prefill runs as one ~2 s step and every
other request's decode waits behind it (TPOT jumps from ~25 ms to ~2000 ms). The cure,
where it happens, is continuous batching with *chunked prefill*: each engine step has a
token budget (default 512); decoding sequences spend it first, one token each, and the
rest goes to prompt slices in priority order. A long prompt is then spread over many
steps, and a decoding request's inter-token gap is bounded by one budget-sized step.

Everything here is a pure function of small frozen dataclasses, so the policy can be
tested exhaustively without a model, a GPU or Redis:

* :func:`build_plan` - decodes first (class order), then prefill chunks by
  (class rank, arrival) until the budget or the KV capacity runs out. With
  ``chunked_prefill=False`` (the seed's "before") a prompt is only ever prefilled whole;
  one that exceeds the budget may still run as the step's first prefill, otherwise it
  could never run, and that whole-prompt step is exactly the stall the seed describes.
* :func:`choose_admissions` - which waiting sequences to start given free batch slots and
  KV room, strictly in priority order (no skipping ahead: a stream of small low-class
  prompts must not starve a large high-class one).
* :func:`choose_preemption` - when the batch is full (sequences or KV) and a strictly
  higher class waits, or when the running set itself no longer fits in KV, the victim is
  the lowest-class, most-recently-arrived running sequence.

Preemption policy: a preempted sequence is *paused*, not swapped. Its KV cache is freed and
it returns to the waiting set with its original arrival order; when readmitted it
re-prefills prompt + already generated tokens (recompute) and continues. That is exactly
the path a request resumed on another worker after a lease expiry takes, so there is one
resume mechanism, not two; and recomputing a prompt costs prefill FLOPs, which chunked
prefill already schedules fairly, instead of host memory and PCIe bandwidth for swapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from limiter.errors import InvalidArgument


def _check_nonneg_int(field: str, value: object, *, positive: bool = False) -> None:
    low = 1 if positive else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgument(field, f"{field} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class SeqState:
    """One running sequence as the planner sees it.

    ``to_prefill`` counts prompt tokens (including re-prefilled generated tokens of a
    resumed sequence) not yet in the KV cache; ``kv_tokens`` counts those that are. A
    decoding sequence has ``to_prefill == 0`` and feeds its last sampled token next step.
    ``arrival`` is a monotonic order (a counter or a timestamp): lower arrived earlier.
    """

    request_id: str
    class_rank: int
    arrival: float
    to_prefill: int
    decoding: bool
    kv_tokens: int

    def __post_init__(self) -> None:
        _check_nonneg_int("class_rank", self.class_rank)
        _check_nonneg_int("to_prefill", self.to_prefill)
        _check_nonneg_int("kv_tokens", self.kv_tokens)
        if self.decoding == (self.to_prefill > 0):
            raise InvalidArgument("decoding", f"{self.request_id}: decoding iff nothing is left to prefill")

    @property
    def priority(self) -> tuple[int, float]:
        """Sort key: lower class rank first, then earlier arrival."""
        return (self.class_rank, self.arrival)


@dataclass(frozen=True)
class Candidate:
    """A waiting sequence (claimed but not started, or paused by preemption)."""

    request_id: str
    class_rank: int
    arrival: float
    prompt_tokens: int

    def __post_init__(self) -> None:
        _check_nonneg_int("class_rank", self.class_rank)
        _check_nonneg_int("prompt_tokens", self.prompt_tokens, positive=True)

    @property
    def priority(self) -> tuple[int, float]:
        return (self.class_rank, self.arrival)


@dataclass(frozen=True)
class Limits:
    """Per-step and per-batch limits of one engine.

    ``kv_capacity`` is in tokens (all layers of one token count once).
    """

    token_budget: int = 512
    max_seqs: int = 64
    kv_capacity: int = 1 << 20
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_nonneg_int("token_budget", self.token_budget, positive=True)
        _check_nonneg_int("max_seqs", self.max_seqs, positive=True)
        _check_nonneg_int("kv_capacity", self.kv_capacity, positive=True)
        if self.token_budget < self.max_seqs:
            # decodes are served first; a full batch of decoders must leave prefill a token,
            # or a prompt admitted next to them would never start
            raise InvalidArgument("token_budget", "token_budget must be >= max_seqs")


@dataclass(frozen=True)
class PrefillChunk:
    """Feed prompt tokens ``[start, start + length)`` of ``request_id`` into its KV cache."""

    request_id: str
    start: int
    length: int


@dataclass(frozen=True)
class StepPlan:
    """One engine step: ``decode`` ids each produce one token, then ``prefill`` chunks run."""

    decode: tuple[str, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def kv_demand(running: Sequence[SeqState]) -> int:
    """KV tokens ``running`` needs through its next step: what it holds, the rest of its
    prompts, and one more token per decoding sequence. Admission and preemption both use
    this one figure, so a sequence admitted now is not immediately preempted for KV."""
    return sum(s.kv_tokens + s.to_prefill + (1 if s.decoding else 0) for s in running)


def build_plan(running: Sequence[SeqState], limits: Limits) -> StepPlan:
    """Plan the next step for ``running`` (see the module docstring for the policy).

    Decodes come first, in priority order, one budget token each; if there are more
    decoders than budget tokens (or KV room), the lowest-priority ones skip this step.
    The remaining budget goes to prefill chunks in priority order, each as large as the
    budget, the KV room and the sequence's remaining prompt allow.
    """
    ids = [s.request_id for s in running]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("running", "a request id appears twice in the running set")
    ordered = sorted(running, key=lambda s: s.priority)
    budget = limits.token_budget
    kv_room = limits.kv_capacity - sum(s.kv_tokens for s in running)
    slots = limits.max_seqs

    decode: list[str] = []
    for s in ordered:
        if s.decoding and budget > 0 and kv_room > 0 and slots > 0:
            decode.append(s.request_id)
            budget -= 1
            kv_room -= 1
            slots -= 1

    prefill: list[PrefillChunk] = []
    for s in ordered:
        if s.decoding or slots <= 0:
            continue
        if limits.chunked_prefill:
            length = min(s.to_prefill, budget, kv_room)
            if length <= 0:
                break
        else:
            first = not prefill
            fits = s.to_prefill <= budget or first
            if not fits or s.to_prefill > kv_room:
                break  # strict priority: a lower-class prompt does not jump the queue
            length = s.to_prefill
        prefill.append(PrefillChunk(s.request_id, s.kv_tokens, length))
        budget -= length
        kv_room -= length
        slots -= 1
    return StepPlan(tuple(decode), tuple(prefill))


def choose_admissions(
    waiting: Sequence[Candidate], running: Sequence[SeqState], limits: Limits
) -> tuple[str, ...]:
    """Which waiting sequences to start now, in the order to start them.

    A candidate needs a batch slot and KV room (beyond :func:`kv_demand` of the running
    set) for its prompt plus its first generated token. Candidates are taken in priority
    order and the first one that does not fit stops admission: skipping ahead would let
    small low-class prompts starve a big high-class one. Decode growth beyond the next
    step is handled by :func:`choose_preemption`.
    """
    slots = limits.max_seqs - len(running)
    kv_free = limits.kv_capacity - kv_demand(running)
    chosen: list[str] = []
    for c in sorted(waiting, key=lambda c: c.priority):
        need = c.prompt_tokens + 1
        if slots <= 0 or need > kv_free:
            break
        chosen.append(c.request_id)
        slots -= 1
        kv_free -= need
    return tuple(chosen)


def choose_preemption(
    running: Sequence[SeqState], waiting: Sequence[Candidate], limits: Limits
) -> str | None:
    """The running sequence to pause now, or ``None``. Call repeatedly until ``None``.

    Two triggers, checked in order:

    1. the running set cannot take its next decode tokens within ``kv_capacity`` (decode
       growth filled the cache): pause the lowest-class, latest-arrived sequence, waiting
       or not, because otherwise nobody can make progress;
    2. the highest-priority waiting candidate cannot be admitted (no slot or no KV room),
       some running sequence has a strictly lower class, and pausing all such sequences
       would make room for it: pause the lowest-class, latest-arrived one.
    """
    if not running:
        return None

    def victim_key(s: SeqState) -> tuple[int, float]:
        return (s.class_rank, s.arrival)

    demand = kv_demand(running)
    if demand > limits.kv_capacity:
        return max(running, key=victim_key).request_id

    if not waiting:
        return None
    head = min(waiting, key=lambda c: c.priority)
    need = head.prompt_tokens + 1
    if len(running) < limits.max_seqs and demand + need <= limits.kv_capacity:
        return None  # admissible as is
    lower = [s for s in running if s.class_rank > head.class_rank]
    if not lower:
        return None
    if demand - kv_demand(lower) + need > limits.kv_capacity:
        return None  # pausing every lower-class sequence would still not make room
    return max(lower, key=victim_key).request_id
