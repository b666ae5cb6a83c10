"""The pure batch builder: what the GPU does in the next step (iteration-level batching).

Bottom of the worker's four loop modules: :mod:`worker.batch_scheduler` applies these
decisions to an engine one step at a time, and :mod:`worker.local_run` (in-process) and
:mod:`worker.claim_step_loop` (the Redis worker) drive that scheduler.

The original problem is that a 32K-token prompt's prefill runs as one ~2 s step and every
other request's decode waits behind it (TPOT jumps from ~25 ms to ~2000 ms). The cure,
where it happens, is continuous batching with *chunked prefill*: each engine step has a
token budget (default 512); decoding sequences spend it first, one token each, and the
rest goes to prompt slices in priority order. A long prompt is then spread over many
steps, and a decoding request's inter-token gap is bounded by one budget-sized step.

Everything here is a pure function of what it is given (it reads, never changes), so the
policy can be tested exhaustively without a model, a GPU or Redis. A running sequence is
anything :class:`Planned` describes: the tests pass frozen :class:`SeqState` values, the
scheduler its own sequences, read in place (making a value of each running sequence every
step was 15 % of a 128-sequence step's CPU).

* :func:`build_plan` - decodes first (class order), then prefill chunks by class rank,
  then (inside a class) the tenant holding the fewest of its slots, then arrival, until the
  budget or the KV capacity runs out. With
  ``chunked_prefill=False`` (the original "before") a prompt is only ever prefilled whole;
  one that exceeds the budget may still run as the step's first prefill, otherwise it
  could never run, and that whole-prompt step is exactly the stall the original problem describes.
* :func:`choose_admissions` - which waiting sequences to start given free batch slots and
  KV room, strictly in priority order (no skipping ahead: a stream of small low-class
  prompts must not starve a large high-class one); inside a class, the tenant holding the
  fewest of the class's slots first. A class holding fewer running sequences than its
  starvation floor's slots (:attr:`Limits.floor_slots`) goes before every other, up to them.
* :func:`prefill_through_behind` - the prompt tokens a step needs to prefill at once the
  prompts of tenants *behind* in their class (two or more of its slots fewer than another
  tenant): the scheduler sizes such a step to them, beyond the budget as far as the TPOT
  targets allow, and no larger.
* :func:`choose_preemption` - when the batch is full (sequences or KV) and a strictly
  higher class waits, or when the running set itself no longer fits in KV, the victim is
  the lowest-class running sequence that holds the least KV (the least to recompute),
  the most recently arrived among equals; when a tenant behind in its class waits at a
  batch full of that class (slots or KV), a sequence of the tenant holding the most of
  its slots. A floor class's sequences within its floor's slots are no victim of another
  class, and a waiting one of a class below them takes its room from every other class.

Preemption policy: a preempted sequence is *paused* and returns to the waiting set with its
original arrival order. When a batch slot is what is short and the KV cache has room, the
paused sequence **keeps its KV** (it is only left out of the steps): readmitted, it goes on
where it stopped, nothing recomputed. When KV is short, its KV is freed (and a waiting
sequence's kept KV is freed before any running sequence is paused for room); readmitted, it
re-prefills prompt + already generated tokens (recompute) and continues. That is exactly
the path a request resumed on another worker after a lease expiry takes, so there is one
resume mechanism, not two; and recomputing a prompt costs prefill FLOPs, which chunked
prefill already schedules fairly, instead of host memory and PCIe bandwidth for swapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from limiter.errors import InvalidArgument

Arrival = float | tuple[int, int]
"""When a sequence arrived, as an order (lower arrived earlier): a number (a counter or a
timestamp), or (timestamp, counter) where timestamps tie. The Redis worker's is (enqueue
ms, claim count): as one float, ``enq_ms + count * 1e-6``, the counter was below the float's
resolution at today's epoch ms (1.77e12: steps of 2.4e-4) and grew into a drift toward claim
order. The sequences of one scheduler all use one form."""


def _check_nonneg_int(field: str, value: object, *, positive: bool = False) -> None:
    low = 1 if positive else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgument(field, f"{field} must be an int >= {low}, got {value!r}")


class Planned(Protocol):
    """What the planner reads of one running sequence (see :class:`SeqState` for each
    field's meaning). It must not change while a planner function runs."""

    @property
    def request_id(self) -> str: ...
    @property
    def class_rank(self) -> int: ...
    @property
    def arrival(self) -> Arrival: ...
    @property
    def to_prefill(self) -> int: ...
    @property
    def decoding(self) -> bool: ...
    @property
    def kv_tokens(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def by_floor(self) -> bool: ...


@dataclass(frozen=True)
class SeqState:
    """One running sequence as the planner sees it, as a checked value (:class:`Planned`).

    ``to_prefill`` counts prompt tokens (including re-prefilled generated tokens of a
    resumed sequence) not yet in the KV cache; ``kv_tokens`` counts those that are. A
    decoding sequence has ``to_prefill == 0`` and feeds its last sampled token next step.
    ``arrival`` is a monotonic order (:data:`Arrival`): lower arrived earlier.
    """

    request_id: str
    class_rank: int
    arrival: Arrival
    to_prefill: int
    decoding: bool
    kv_tokens: int
    tenant: str = ""
    by_floor: bool = False  # claimed by its class's starvation floor (Limits.floor_slots)

    def __post_init__(self) -> None:
        # The scheduler makes one for every running sequence every step: the common case is
        # checked in one expression, the checks that name the bad field run when it fails.
        rank, to_prefill, kv = self.class_rank, self.to_prefill, self.kv_tokens
        if not (type(rank) is int and type(to_prefill) is int and type(kv) is int
                and rank >= 0 and to_prefill >= 0 and kv >= 0):
            _check_nonneg_int("class_rank", rank)
            _check_nonneg_int("to_prefill", to_prefill)
            _check_nonneg_int("kv_tokens", kv)
        if self.decoding == (to_prefill > 0):
            raise InvalidArgument("decoding", f"{self.request_id}: decoding iff nothing is left to prefill")

    @property
    def priority(self) -> tuple[int, Arrival]:
        """Sort key: lower class rank first, then earlier arrival."""
        return (self.class_rank, self.arrival)


@dataclass(frozen=True)
class Candidate:
    """A waiting sequence (claimed but not started, or paused by preemption).

    ``prompt_tokens`` is what it must (re)prefill when admitted; ``resident_kv`` the KV
    tokens it still holds (a pause that kept its cache), which count against capacity while
    it waits. A resident candidate that was decoding has nothing left to prefill."""

    request_id: str
    class_rank: int
    arrival: Arrival
    prompt_tokens: int
    resident_kv: int = 0
    tenant: str = ""
    by_floor: bool = False

    def __post_init__(self) -> None:
        _check_nonneg_int("class_rank", self.class_rank)
        _check_nonneg_int("resident_kv", self.resident_kv)
        _check_nonneg_int("prompt_tokens", self.prompt_tokens, positive=not self.resident_kv)

    @property
    def priority(self) -> tuple[int, Arrival]:
        return (self.class_rank, self.arrival)

    @property
    def need(self) -> int:
        """New KV tokens to admit it: what it prefills, plus its first (next) token."""
        return self.prompt_tokens + 1


@dataclass(frozen=True)
class Preemption:
    """Pause ``request_id`` (running), or free the KV a waiting one kept (``free_kv``)."""

    request_id: str
    free_kv: bool


@dataclass(frozen=True)
class Limits:
    """Per-step and per-batch limits of one engine.

    ``kv_capacity`` is in tokens (all layers of one token count once). ``floor_slots``: per
    class rank, the running sequences that class keeps against every other class's admissions
    and preemptions (its starvation floor's share of ``max_seqs``, :func:`floor_slots`); a
    rank past the end keeps none, and ``()`` is the strict class order.
    """

    token_budget: int = 512
    max_seqs: int = 64
    kv_capacity: int = 1 << 20
    chunked_prefill: bool = True
    floor_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_nonneg_int("token_budget", self.token_budget, positive=True)
        _check_nonneg_int("max_seqs", self.max_seqs, positive=True)
        _check_nonneg_int("kv_capacity", self.kv_capacity, positive=True)
        for q in self.floor_slots:
            _check_nonneg_int("floor_slots", q)
        if sum(self.floor_slots) > self.max_seqs:
            raise InvalidArgument("floor_slots", "the floors' slots add up to more than max_seqs")
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


def floor_slots(floors: Sequence[float], max_seqs: int) -> tuple[int, ...]:
    """Per class rank, the slots its starvation floor (a share, ``ClassConfig.floor``) keeps
    on a worker of ``max_seqs`` slots: ``floor(floor x max_seqs)``, rounded down so that a
    class never keeps more than its share (a 5 % floor on 16 slots keeps none, not one in
    16 = 6 %) and the floors' slots never add up to more than the batch (floors add up to 1
    at most). ``()`` when no class keeps a slot: the strict class order, exactly."""
    out = tuple(int(f * max_seqs + 1e-9) for f in floors)
    return out if any(out) else ()


def _floor_held(running: Iterable[Planned]) -> dict[int, int]:
    """class -> its running sequences that claim handed out by the class's floor."""
    out: dict[int, int] = {}
    for s in running:
        if s.by_floor:
            out[s.class_rank] = out.get(s.class_rank, 0) + 1
    return out


def _under_floor(running: Iterable[Planned], limits: Limits) -> set[int]:
    """The classes holding fewer running sequences claimed by their floor than their
    floor's slots."""
    q = limits.floor_slots
    if not q:
        return set()
    held = _floor_held(running)
    return {r for r, n in enumerate(q) if held.get(r, 0) < n}


def _exposed(running: Sequence[Planned], limits: Limits,
             share: dict[tuple[int, str], int]) -> list[Planned]:
    """The running sequences another class may take a slot or KV from: all of them, less
    each floor class's ``floor_slots`` sequences that claim handed out by its floor (those
    last in :func:`_richest_first` order, the ones that would be paused last: the most KV,
    the earliest). In ``running``'s order."""
    q = limits.floor_slots
    if not q:
        return list(running)
    kept: set[str] = set()
    for r, n in enumerate(q):
        if n:
            mine = sorted((s for s in running if s.class_rank == r and s.by_floor), key=_richest_first(share))
            kept.update(s.request_id for s in mine[:n])
    return [s for s in running if s.request_id not in kept]


def kv_demand(running: Sequence[Planned], waiting: Sequence[Candidate] = ()) -> int:
    """KV tokens needed through the next step: what ``running`` holds, the rest of its
    prompts and one more token per decoding sequence, plus what ``waiting`` sequences kept.
    Admission and preemption both use this one figure, so a sequence admitted now is not
    immediately preempted for KV."""
    return (sum(s.kv_tokens + s.to_prefill + (1 if s.decoding else 0) for s in running)
            + sum(c.resident_kv for c in waiting))


_CLASS_THEN_ARRIVAL = attrgetter("class_rank", "arrival")  # priority order, made in C


def build_plan(running: Sequence[Planned], limits: Limits) -> StepPlan:
    """Plan the next step for ``running`` (see the module docstring for the policy).

    Decodes come first, in priority order, one budget token each; if there are more
    decoders than budget tokens (or KV room), the lowest-priority ones skip this step.
    The remaining budget goes to prefill chunks, each as large as the budget, the KV room
    and the sequence's remaining prompt allow: by class, then the tenant holding the fewest
    of the class's slots, then arrival. In arrival order alone, a light tenant's prompt
    admitted next to a flood's waited for every flood prompt already prefilling on this
    worker (a few 2,000-token prompts are ~10 steps at a TPOT-sized budget), although the
    claim and the admission had put it first.
    """
    ids = [s.request_id for s in running]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("running", "a request id appears twice in the running set")
    ordered = sorted(running, key=_CLASS_THEN_ARRIVAL)
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
    prompts = [s for s in ordered if not s.decoding]
    if not prompts:  # most steps: every sequence decodes
        return StepPlan(tuple(decode), ())
    share = tenant_slots(running)
    for s in sorted(prompts, key=lambda s: (s.class_rank, share[(s.class_rank, s.tenant)], s.arrival)):
        if slots <= 0:
            break
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
    waiting: Sequence[Candidate], running: Sequence[Planned], limits: Limits
) -> tuple[str, ...]:
    """Which waiting sequences to start now, in the order to start them.

    A candidate needs a batch slot and KV room (beyond :func:`kv_demand` of the running
    set and the KV waiting sequences kept) for what it prefills plus its next token.
    Candidates are taken in priority order and the first one that does not fit stops
    admission: skipping ahead would let small low-class prompts starve a big high-class one.
    Decode growth beyond the next step is handled by :func:`choose_preemption`.
    """
    slots = limits.max_seqs - len(running)
    kv_free = limits.kv_capacity - kv_demand(running, waiting)
    chosen: list[str] = []
    share = tenant_slots(running)
    under = _under_floor(running, limits)
    held = _floor_held(running) if under else {}
    left = list(waiting)
    while left:
        c = min(left, key=lambda c: _head_key(c, share, under))
        need = c.need
        if slots <= 0 or need > kv_free:
            break
        chosen.append(c.request_id)
        left.remove(c)
        share[(c.class_rank, c.tenant)] = share.get((c.class_rank, c.tenant), 0) + 1
        if c.by_floor and c.class_rank in under:
            held[c.class_rank] = held.get(c.class_rank, 0) + 1
            if held[c.class_rank] >= limits.floor_slots[c.class_rank]:
                under.discard(c.class_rank)
        slots -= 1
        kv_free -= need
    return tuple(chosen)


class _SlotHolder(Protocol):
    @property
    def class_rank(self) -> int: ...
    @property
    def tenant(self) -> str: ...


def tenant_slots(running: Iterable[_SlotHolder], fair_only: bool = False) -> dict[tuple[int, str], int]:
    """(class, tenant) -> how many of the batch's slots that tenant holds in that class;
    ``fair_only``: without the classes that have no tenant fairness (tenant ``''``)."""
    out: dict[tuple[int, str], int] = {}
    for s in running:
        if s.tenant or not fair_only:
            out[(s.class_rank, s.tenant)] = out.get((s.class_rank, s.tenant), 0) + 1
    return out


def _behind(running: Sequence[Planned]) -> list[Planned]:
    """The prefilling sequences of tenants *behind* in their class: a tenant holding at least
    two fewer of the class's slots here than another tenant of that class (the gap at which
    :func:`choose_preemption` takes a slot from the richer tenant). Classes without tenant
    fairness (tenant ``''``) are never behind. The scheduler lets their prompts go into one
    step beyond the token budget, within the decoders' TPOT targets: in budget-sized slices,
    each slice's step also carried the rich tenant's decoders, and a light tenant's TTFT
    beside a flood was 1.6-2.4x its TTFT alone (docs/benchmarks.md)."""
    share = tenant_slots(running)
    most: dict[int, int] = {}
    for (rank, tenant), n in share.items():
        if tenant:
            most[rank] = max(most.get(rank, 0), n)
    return [s for s in running
            if s.tenant and not s.decoding and share[(s.class_rank, s.tenant)] + 2 <= most[s.class_rank]]


def prefill_through_behind(running: Sequence[Planned]) -> int:
    """Prompt tokens a step needs, beside the top class's prompts, to prefill at once every
    prompt of a tenant behind in its class below the top class: those prompts, and the
    prompts :func:`build_plan` puts before them (every class between the top one and the
    lowest such prompt's class). 0 when no such tenant is behind. The top class's prompts
    are the scheduler's to add (they go in at once anyway, up to ``top_prefill_tokens``).
    A step sized to this, not to the whole TPOT-sized budget, carries no prompt of the
    tenants ahead of the behind one: at a 2,048-token cap their slices filled such a step up
    to P1's 135 ms, and the light tenant's first token waited for them (TTFT p99 1.3-1.8x its
    figure alone against 1.0-1.1x at a 256 cap)."""
    behind = [s for s in _behind(running) if s.class_rank > 0]
    if not behind:
        return 0
    lowest = max(s.class_rank for s in behind)
    ids = {s.request_id for s in behind}
    above = sum(s.to_prefill for s in running
                if not s.decoding and 0 < s.class_rank < lowest and s.request_id not in ids)
    return above + sum(s.to_prefill for s in behind)


def _head_key(c: Candidate, share: dict[tuple[int, str], int],
              under: set[int]) -> tuple[bool, int, int, Arrival]:
    """:func:`_fair_priority` after the floors: a candidate claimed by its class's floor, of
    a class below its floor's slots (``under``, :func:`_under_floor`), goes before every
    other, whatever its class."""
    return (not (c.by_floor and c.class_rank in under), *_fair_priority(c, share))


def _fair_priority(c: Candidate, share: dict[tuple[int, str], int]) -> tuple[int, int, Arrival]:
    """Priority order with tenants sharing their class: class first, then the tenant holding
    the fewest of the class's slots in this batch, then arrival."""
    return (c.class_rank, share.get((c.class_rank, c.tenant), 0), c.arrival)


def _richest_first(share: dict[tuple[int, str], int]) -> Callable[[Planned], tuple[int, int, int, Arrival]]:
    """:func:`victim_key` with, after the class, the tenant holding the most of its slots
    (``share``: :func:`tenant_slots` of the running set; one value for a class without
    tenants, so there it is victim_key's order)."""
    return lambda s: (s.class_rank, share[(s.class_rank, s.tenant)], -s.kv_tokens, s.arrival)


def victim_key(s: Planned) -> tuple[int, int, Arrival]:
    """Who is paused first: the lowest class, then the least KV (the least to recompute if
    its cache must go), then the most recent arrival. ``max`` of this key is the victim."""
    return (s.class_rank, -s.kv_tokens, s.arrival)


def kept_key(c: Candidate) -> tuple[int, Arrival]:
    """Whose kept KV is freed first, of waiting sequences that kept theirs: the lowest class,
    then the most recent arrival. ``max`` of this key goes first."""
    return (c.class_rank, c.arrival)


def _free_kept(kept: Sequence[Candidate]) -> Preemption:
    """Free the kept KV of the first of ``kept`` (:func:`kept_key`)."""
    return Preemption(max(kept, key=kept_key).request_id, True)


def _kept_frees(s: Planned) -> int:
    """KV room pausing ``s`` makes while it keeps its cache: its unprefilled prompt and its
    next token are no longer needed."""
    return s.to_prefill + (1 if s.decoding else 0)


def _tenant_preemption(running: Sequence[Planned], head: Candidate, share: dict[tuple[int, str], int],
                       free: int, kept: Sequence[Candidate] = ()) -> Preemption | None:
    """Rule 3 of :func:`choose_preemption`: the sequence of a tenant rich in the head's class
    to pause for the head, or None. A tenant holding ``n`` of the class's slots may give up
    ``n - mine - 1`` (``mine``: the head's tenant's), in :func:`victim_key` order, so that
    it still holds as many as the head's tenant will; the richest tenant goes first.
    ``kept``: waiting sequences of the head's class (not the head) that kept their KV; where
    the running ones it may pause are not enough, their kept KV is freed first (the latest
    of them first), as a waiting sequence's kept KV is before a running one is paused for
    room. Left out of the count, a flood's sequence paused for one light tenant's slot held
    the KV a second light tenant needed, which waited for the flood's growth (76 steps)."""
    rank = head.class_rank
    mine = share.get((rank, head.tenant), 0)
    allowed: list[Planned] = []
    for (r, tenant), n in share.items():
        if r == rank and tenant and n >= mine + 2:
            theirs = sorted((s for s in running if s.class_rank == rank and s.tenant == tenant),
                            key=victim_key, reverse=True)
            allowed += theirs[:n - mine - 1]
    if not allowed:
        return None
    if head.need > (room := free + kv_demand(allowed)) + sum(c.resident_kv for c in kept):
        return None  # pausing all it may would still not make room: pause none
    if head.need > room:
        return _free_kept(kept)
    victim = max(allowed, key=_richest_first(share))
    return Preemption(victim.request_id, free_kv=head.need > free + _kept_frees(victim))


def choose_preemption(
    running: Sequence[Planned], waiting: Sequence[Candidate], limits: Limits
) -> Preemption | None:
    """What to pause (or whose kept KV to free) now, or ``None``. Call repeatedly until ``None``.

    Two triggers, checked in order:

    1. the running set and the KV waiting sequences kept cannot take the next decode tokens
       within ``kv_capacity``: free the kept KV of the lowest waiting sequence, else pause
       the running victim (:func:`victim_key`, after the lowest class, the tenant holding the
       most of its slots) and free its KV, because otherwise nobody can make progress;
    2. the highest-priority waiting candidate (class, then the tenant holding the fewest of
       its class's slots here, then arrival) cannot be admitted (no slot or no KV room), and
       pausing every strictly lower-class running sequence (and freeing what lower-class
       waiting ones, and those of its class behind it, kept) would make room for it: when KV
       is short, free a lower waiting sequence's kept KV first (its class's kept KV before
       that, where the lower classes' is not enough); otherwise pause the lowest running
       victim, keeping its KV when the candidate fits anyway (a slot was all that was missing);
    3. no lower class runs but a tenant holds at least two more of the head's class's slots
       than the head's tenant: pause one of that tenant's sequences (tenants of a class share
       its slots evenly; within a tenant, :func:`victim_key` order) -- its KV kept when a slot
       is all the head lacks; when KV is short, as many as the head needs, their KV freed,
       if the rule allows pausing enough, with the KV waiting sequences of the class kept
       (freed first where needed; :func:`_tenant_preemption`). Where the head lacks
       KV that the lower classes alone cannot give but they and rule 3 together can, the
       lower classes are paused first (their KV freed), then rule 3 applies. Without a rich
       tenant, a head that lacks only KV, with a slot free, gets the KV its class's waiting
       sequences kept (the latest first), if that is enough.

    Starvation floors (:attr:`Limits.floor_slots`; none: the above, exactly): of a floor
    class's running sequences, its floor's slots (the last in :func:`_richest_first` order)
    are no victim under rules 1 and 2 (rule 1 falls back to every running sequence when all
    are so kept); and a head of a class holding fewer running sequences than its floor's
    slots, which goes before every other class (:func:`choose_admissions`), is served by
    rule 2 with every other class counted as lower (their running sequences beyond their
    floors' slots, and their kept KV).

    With nothing running no step will free anything, so a head kept out by the KV that
    paused sequences hold gets it (the lowest of them first): otherwise the scheduler saw a
    request that fits the worker as one that never fits, and the worker failed all it held.
    """
    demand = kv_demand(running, waiting)
    residents = [c for c in waiting if c.resident_kv]
    if demand > limits.kv_capacity:
        kept = max(residents, key=kept_key, default=None)
        # the lowest class's tenant holding the most of its slots gives up KV first: the least
        # KV of anyone was a light tenant's just-admitted prompt, paused at the next decode
        # step and admitted again (rule 3) in turn, recomputed each time. A floor class's
        # sequences within its floor's slots go last (only when nobody else runs).
        share = tenant_slots(running)
        victim = max(_exposed(running, limits, share) or running, key=_richest_first(share), default=None)
        if kept is not None and (victim is None or kept.class_rank >= victim.class_rank):
            return Preemption(kept.request_id, True)
        return None if victim is None else Preemption(victim.request_id, True)
    if not waiting:
        return None
    if not running:
        head = min(waiting, key=lambda c: _head_key(c, {}, _under_floor((), limits)))
        kept = [c for c in residents if c is not head]
        if head.need > limits.kv_capacity - demand and kept:
            return _free_kept(kept)
        return None
    share = tenant_slots(running)
    under = _under_floor(running, limits)
    head = min(waiting, key=lambda c: _head_key(c, share, under))
    free = limits.kv_capacity - demand
    slot_short = len(running) >= limits.max_seqs
    if not slot_short and head.need <= free:
        return None  # admissible as is
    if head.by_floor and head.class_rank in under:
        # 0. the head's class holds fewer than its floor's slots: every other class is "lower"
        # for it, less the floor classes' sequences within their floors' slots
        lower = [s for s in _exposed(running, limits, share) if s.class_rank != head.class_rank]
        lower_kept = [c for c in residents if c.class_rank != head.class_rank]
    else:
        lower = [s for s in _exposed(running, limits, share) if s.class_rank > head.class_rank]
        lower_kept = [c for c in residents if c.class_rank > head.class_rank and c is not head]
    same_kept = [c for c in residents if c.class_rank == head.class_rank and c is not head]
    # The KV that sequences of the head's class behind it kept: none of them can start before
    # the head (admission goes in priority order), so it counts toward the head's room under
    # every rule, and goes first where the rest is not enough (freeing it makes no slot).
    same_kv = sum(c.resident_kv for c in same_kept)
    if not lower and (not lower_kept or head.need <= free):
        # 3. nothing of a lower class runs (or keeps KV the head needs), and the batch is full
        # of the head's class (or higher) -- its slots, or its KV: a tenant holding at least
        # two more of the class's slots than the head's gives them up, so a light tenant does
        # not wait for a flood's streams to finish (slots converge to even). Slots alone: one,
        # its KV kept. KV: as many as the head needs, their KV freed, if pausing those the rule
        # allows (a tenant keeps as many slots as the head's tenant will hold) makes room;
        # else none (a flood's long prompts holding the KV kept a light tenant waiting).
        p = _tenant_preemption(running, head, share, free, same_kept)
        if p is None and not slot_short and same_kept and head.need <= free + same_kv:
            return _free_kept(same_kept)  # no rich tenant: the class's kept KV alone
        return p
    freeable = kv_demand(lower) + sum(c.resident_kv for c in lower_kept)
    if head.need > free + freeable and \
            _tenant_preemption(running, head, share, free + freeable, same_kept) is None:
        # Pausing every lower-class sequence would still not make room, nor would rule 3 once
        # they are paused. Where it would, the lower classes go first (their KV freed), then
        # rule 3 applies: a small P2 stream beside a flood holding a class's KV kept a light
        # tenant of that class waiting for the flood's growth (67 steps, not one). Where the
        # KV the head's class kept makes up the rest, it goes first (it must go anyway, and
        # may spare a lower-class stream), then the lower classes as needed: counting only
        # theirs, a P1 waited for a running P1's end with slots empty (595 steps, not one).
        if head.need > free + freeable + same_kv or (slot_short and not lower):
            return None
        return _free_kept(same_kept)
    if head.need > free and lower_kept:
        return _free_kept(lower_kept)
    if not lower:
        return None
    # the lowest class's richest tenant first, as under rule 1: the least KV of anyone was a
    # light tenant's sequence, admitted again at once by rule 3 at the richer one's expense
    victim = max(lower, key=_richest_first(share))
    return Preemption(victim.request_id, free_kv=head.need > free + _kept_frees(victim))
