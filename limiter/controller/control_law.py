"""The controller's law: from SLO compliance, use and capacity, the next per-class rates.

Pure and deterministic: ``decide(state, inputs, now_ms) -> Decision`` reads no clock and
no socket, so the role can log every decision with its inputs and a test can replay it.
docs/control-law.md states the law as equations and argues why it settles; in brief:

* Each class ``i`` has an *allowance* ``a_i`` (a share of capacity ``C``): its HTB ceiling
  is ``a_i C`` and its guaranteed rate is ``min(a_i, s_i) C`` (``s_i`` = default share); the
  top class's guarantee is what the others leave, so guarantees always sum to <= ``C``.
* A class with an SLO is judged on fresh evidence only: >= ``min_samples`` samples that
  finished at least ``settle_s`` after the last change. Below ``low`` (95 %) it *violates*,
  and it keeps violating until it is back at ``target`` (99 %) -- an episode ends at the
  target, not at the edge of the band. Otherwise 95-99 % holds (the dead band); >= 99 %,
  over the whole window too, is *comfortable*. At most one change per ``cooldown_s``.
* Violation of class k removes ``tighten_step`` (10 %) of the load of the classes below it,
  lowest class first, borrowing before guarantees, never below a class's rate floor
  (``min_shares``). When nothing below k can give, the law holds (``overloaded``): the rates
  are applied at claim time, so a cut to k's own ceiling would only make k's queued requests
  wait longer; what k asks beyond the pool is admission's to refuse (the wait estimate
  against the max wait).
* When every class at or above i is comfortable and i used its allowance, ``a_i`` grows by
  ``relax_step`` (5 %) toward its ceiling -- the top class's own cut is undone first, then
  lower guarantees, then borrowing. A cut remembers where the SLO broke: relaxing may
  go back at most one step / halfway toward that level, until capacity changes or the load
  of the class it protects moves (smoothed over ``load_smoothing_s``, and for half as long
  again: a second's measure of it is Poisson noise).
* Capacity moves the rates only when the plant really changed: at once when a worker joins
  or leaves (a step), otherwise when the estimate has stayed more than
  ``capacity_deadband`` (10 %) away, on the same side, for ``capacity_persist_s`` (two
  cooldowns) and no change is cooling down. A rescale counts as a change for the cooldown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from limiter.config import MAX_BURST_TOKENS
from limiter.errors import ConfigError, InvalidArgument
from limiter.keys import NAME_RE


@dataclass(frozen=True)
class ControlTunables:
    """The law's parameters an operator tunes: the ``[controller]`` keys of the same names
    (limiter/controller/settings.py inherits them). The defaults are the original problem's
    numbers; :meth:`ControlConfig.validate` checks them."""

    target: float = 0.99  # compliance that ends a violation episode, and "comfortable"
    low: float = 0.95  # below this a class violates (target..low is the dead band)
    relax_step: float = 0.05  # an allowance grows by this fraction per relax
    tighten_step: float = 0.10  # a violation removes this fraction of the lower classes' load
    cooldown_s: float = 5.0  # at most one change per cooldown
    settle_s: float = 2.5  # samples finishing this soon after a change are not evidence of it
    window: int = 1000  # SLO window size the role builds (samples)
    min_samples: int = 100  # fresh samples needed before a class's compliance is judged
    use_threshold: float = 0.9  # "used its allowance": served >= 90 % of a_i C
    capacity_deadband: float = 0.10  # capacity moves smaller than this are ignored
    reset_load_change: float = 0.25  # forget a remembered limit when its owner's use moves 25 %
    # ...its use smoothed over this long (an EWMA), the move lasting half as long again; 0 =
    # each tick's figure, at once (a second's claims are Poisson: +-22 % at 20 requests/s)
    load_smoothing_s: float = 60.0
    memory: bool = True  # a cut remembers where the SLO broke, and relaxing stops short of it
    min_change: float = 0.005  # relative allowance moves below this are not worth a write


@dataclass(frozen=True)
class ControlConfig(ControlTunables):
    """All the law's parameters: the tunables, and the per-class ones the role derives from
    ``[[classes]]`` and ``[controller]`` (defaults: the original problem's three classes).
    Shares are of capacity."""

    classes: tuple[str, ...] = ("P0", "P1", "P2")  # highest priority first
    shares: tuple[float, ...] = (0.60, 0.35, 0.05)  # default guarantees (sum <= 1)
    # Rate floors: the least share of capacity a cut leaves each class (50 % / 30 % / 30 % of
    # its share). Not the scheduler's starvation floor (ClassConfig.floor, served work).
    min_shares: tuple[float, ...] = (0.30, 0.105, 0.015)
    ceilings: tuple[float, ...] = (1.0, 1.0, 0.5)  # HTB ceilings, the fully relaxed state
    burst_s: float = 0.5  # seconds of rate per bucket, unless class_bursts says otherwise
    class_bursts: tuple[float, ...] = ()  # per class, seconds of rate (the classes' burst_s); () = burst_s
    capacity_persist_s: float = 10.0  # capacity moves beyond the dead band wait this long (no worker step)

    def validate(self, prefix: str = "controller") -> ControlConfig:
        """Raise :class:`ConfigError` naming the first bad field; return self when valid."""

        def bad(name: str, message: str) -> ConfigError:
            return ConfigError(f"{prefix}.{name}", f"{message}, got {getattr(self, name)!r}")

        n = len(self.classes)
        if n < 1 or len(set(self.classes)) != n or not all(NAME_RE.fullmatch(c) for c in self.classes):
            raise bad("classes", "must be distinct class names, highest priority first")
        for name in ("shares", "min_shares", "ceilings"):
            if len(getattr(self, name)) != n:
                raise bad(name, f"must have one value per class ({n})")
        if not all(0 < s <= 1 for s in self.shares) or sum(self.shares) > 1 + 1e-9:
            raise bad("shares", "must be in (0, 1] and sum to <= 1")
        if not all(0 < m <= s for m, s in zip(self.min_shares, self.shares, strict=True)):
            raise bad("min_shares", "must be in (0, share]")
        if not all(s <= c <= 1 for s, c in zip(self.shares, self.ceilings, strict=True)):
            raise bad("ceilings", "must be in [share, 1]")
        ranges = [
            ("low", 0 < self.low < self.target, "must be in (0, target)"),
            ("target", 0 < self.target <= 1, "must be in (0, 1]"),
            ("relax_step", 0 < self.relax_step <= 1, "must be in (0, 1]"),
            ("tighten_step", 0 < self.tighten_step < 1, "must be in (0, 1)"),
            # bounded: an infinite cooldown froze the rates after their first change, for good
            # (the last change's time is in the policy), and an infinite settle judged no
            # sample fresh; a window of millions held as many samples a class
            ("cooldown_s", 0 <= self.cooldown_s <= 3600, "must be in [0, 3600]"),
            ("settle_s", 0 <= self.settle_s <= self.cooldown_s, "must be in [0, cooldown_s]"),
            ("window", 1 <= self.window <= 100_000, "must be in [1, 100000]"),
            ("min_samples", 1 <= self.min_samples <= self.window, "must be in [1, window]"),
            ("burst_s", 0 < self.burst_s <= 3600, "must be in (0, 3600]"),
            ("class_bursts", not self.class_bursts or (len(self.class_bursts) == n and all(
                0 < b <= 3600 for b in self.class_bursts)),
             f"must be empty or one value in (0, 3600] per class ({n})"),
            ("use_threshold", 0 < self.use_threshold <= 1, "must be in (0, 1]"),
            ("capacity_deadband", 0 <= self.capacity_deadband < 1, "must be in [0, 1)"),
            ("capacity_persist_s", 0 <= self.capacity_persist_s <= 3600, "must be in [0, 3600]"),
            ("reset_load_change", 0 < self.reset_load_change < math.inf, "must be > 0 and finite"),
            ("load_smoothing_s", 0 <= self.load_smoothing_s <= 3600, "must be in [0, 3600]"),
            ("min_change", 0 <= self.min_change < self.relax_step, "must be in [0, relax_step)"),
        ]
        for name, ok, message in ranges:
            if not ok:
                raise bad(name, message)
        return self


@dataclass(frozen=True)
class ClassRates:
    """What the role writes for one class (weighted tokens/s and weighted tokens)."""

    rate: float
    burst: float
    ceil: float
    ceil_burst: float


@dataclass(frozen=True)
class ClassState:
    """What the law remembers about one class between ticks (the role keeps it in memory;
    a new leader starts from :meth:`ControlState.initial`, i.e. fully relaxed)."""

    name: str
    allowance: float  # a_i, share of capacity
    cap: float | None = None  # remembered relax limit (share), set by a cut
    cap_owner: str | None = None  # the class whose violation caused the cut
    cap_ref: float = 0.0  # that class's smoothed used share (its ``load``) when the cut was made
    recovering: bool = False  # fell below ``low`` and is not yet back at ``target``
    # The class's used share smoothed over ``load_smoothing_s`` (an exponentially weighted
    # mean, normalised by its weight so that its first ticks are a plain mean); None: no
    # tick yet. ``load_since_ms``: its first tick (how much history it has).
    load: float | None = None
    load_weight: float = 0.0
    load_since_ms: float = 0.0
    cap_ref_young: bool = False  # ``cap_ref`` follows the owner's load until it has a full period
    cap_moved_ms: float | None = None  # the owner's load has been past reset_load_change since
    cap_moved_up: bool = False  # ...above ``cap_ref`` (else below)


@dataclass(frozen=True)
class ControlState:
    """The law's whole state: rates are derived from it, never stored separately."""

    config: ControlConfig
    capacity: float
    classes: tuple[ClassState, ...]
    last_change_ms: float | None = None
    workers: int = 0  # live workers behind ``capacity`` when it was set (0: not from heartbeats)
    drift_since_ms: float | None = None  # the estimate left the dead band then (and stayed out)
    drift_up: bool = False  # ...on this side
    ticked_ms: float | None = None  # the last decision's time: how far each smoothed load moves

    @classmethod
    def initial(cls, config: ControlConfig, capacity: float) -> ControlState:
        """Start fully relaxed: every allowance at its ceiling (the operator's HTB policy)."""
        config.validate()
        _check_positive("capacity", capacity)
        states = tuple(ClassState(n, c) for n, c in zip(config.classes, config.ceilings, strict=True))
        return cls(config, float(capacity), states)

    def rates(self) -> dict[str, ClassRates]:
        return _rates(self.config, self.capacity, [c.allowance for c in self.classes])


@dataclass(frozen=True)
class ClassInputs:
    compliance: float | None  # compliance over the fresh samples; None = no SLO or no sample
    samples: int  # fresh samples (since the last change) behind ``compliance``
    # Weighted tokens/s the class consumes *now* (admitted or started work over the last
    # second or so). Cuts are sized from it, so it must not lag: a lagging value on a rising
    # load makes the first cut deeper than one step.
    used: float
    has_slo: bool = True  # False for a class without latency targets (P2): never judged
    # Compliance over the whole window (the last 1000 samples, what operators see); budget is
    # only given away when it, too, meets the target. None: judge on ``compliance`` alone.
    window_compliance: float | None = None


@dataclass(frozen=True)
class Inputs:
    """One tick's measurements, keyed by class name."""

    capacity: float  # measured, weighted tokens/s
    classes: Mapping[str, ClassInputs]
    workers: int = 0  # live workers behind ``capacity`` (0: not measured from heartbeats)


@dataclass(frozen=True)
class ClassDecision:
    """One class's outcome with the inputs that led to it, so the role can log the why."""

    name: str
    reason: str  # hold|relax|tighten_lower_for_<class>|overloaded|cooldown|capacity_change|
    #             floor|ceiling|capped|unused|waiting|priority|rebalance (docs/control-law.md)
    compliance: float | None
    window_compliance: float | None
    samples: int
    used: float
    allowance: float
    old: ClassRates
    new: ClassRates


@dataclass(frozen=True)
class Decision:
    """The result of :func:`decide`: new state, per-class outcomes, and whether to write."""

    now_ms: float
    changed: bool
    old_capacity: float
    capacity: float
    state: ControlState
    classes: tuple[ClassDecision, ...]

    @property
    def evidence_from_ms(self) -> float | None:
        """After a change, mark the SLO windows here: later samples are evidence of it.

        Requests admitted under the old rates are still running for a while after a change;
        their latencies say nothing about the new rates, so evidence starts ``settle_s`` later.
        """
        return self.now_ms + self.state.config.settle_s * 1000 if self.changed else None

    def policy_fields(self) -> dict[str, float]:
        """The field/value pairs for ``set_rates`` (policy hash fields). A burst is capped at
        the script's bound (1e15 tokens): a capacity measured far above the configured one,
        times a long burst_s, was refused on every tick."""
        out: dict[str, float] = {}
        for c in self.classes:
            out |= {f"{c.name}.rate": c.new.rate, f"{c.name}.burst": min(c.new.burst, MAX_BURST_TOKENS)}
            out |= {f"{c.name}.ceil": c.new.ceil,
                    f"{c.name}.ceil_burst": min(c.new.ceil_burst, MAX_BURST_TOKENS)}
        out["capacity"] = self.capacity
        return out

    def record(self) -> dict[str, object]:
        """A JSON-able account of the decision: inputs, reasons, old and new rates."""
        return {
            "now_ms": self.now_ms,
            "changed": self.changed,
            "capacity": {"old": self.old_capacity, "new": self.capacity},
            "classes": {
                c.name: {
                    "reason": c.reason,
                    "compliance": c.compliance,
                    "window_compliance": c.window_compliance,
                    "samples": c.samples,
                    "used": c.used,
                    "allowance": c.allowance,
                    "old": vars(c.old),
                    "new": vars(c.new),
                }
                for c in self.classes
            },
        }


# Reasons for a class whose own allowance moved (or whose whole policy was rescaled).
ACTIONS = ("relax", "capacity_change")


def _check_positive(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(name, f"{name}: must be a finite number > 0, got {value!r}")


def _rates(config: ControlConfig, capacity: float, allowances: list[float]) -> dict[str, ClassRates]:
    guarantees = [min(a, s) for a, s in zip(allowances, config.shares, strict=True)]
    guarantees[0] = max(0.0, min(allowances[0], 1.0 - sum(guarantees[1:])))
    bursts = config.class_bursts or (config.burst_s,) * len(config.classes)
    out = {}
    for name, g, a, b in zip(config.classes, guarantees, allowances, bursts, strict=True):
        rate, ceil = g * capacity, a * capacity
        out[name] = ClassRates(rate, rate * b, ceil, ceil * b)
    return out


# A class with few fresh samples is judged early only on strong evidence: when even the
# 99 % upper confidence bound of its compliance (Wilson score) is below ``low`` (95 %). At
# 20 samples that takes compliance below 0.82; at 50, below 0.87. A P0 of one request a
# second (a small pool) otherwise waited 100 s for a verdict while a flood broke it.
STRONG_Z = 2.576
STRONG_MIN_SAMPLES = 20


def compliance_upper_bound(compliance: float, samples: int, z: float = STRONG_Z) -> float:
    """Wilson score upper bound of a proportion observed as ``compliance`` over ``samples``."""
    n, p = float(samples), compliance
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre + spread) / (1 + z * z / n)


def _status(config: ControlConfig, inp: ClassInputs, recovering: bool) -> str:
    if not inp.has_slo or (inp.samples == 0 and inp.used == 0):
        return "quiet"  # no SLO, or no traffic at all: nothing to protect
    if inp.samples < config.min_samples or inp.compliance is None:
        if (inp.compliance is not None and inp.samples >= min(STRONG_MIN_SAMPLES, config.min_samples)
                and compliance_upper_bound(inp.compliance, inp.samples) < config.low):
            return "violating"  # few samples, but certainly below the band
        return "waiting"  # traffic, but not yet enough evidence since the last change
    if inp.compliance < config.low or (recovering and inp.compliance < config.target):
        return "violating"  # below 95 %, or still short of 99 % since it was
    whole = inp.compliance if inp.window_compliance is None else inp.window_compliance
    return "comfortable" if min(inp.compliance, whole) >= config.target else "band"


def _check_inputs(config: ControlConfig, inputs: Inputs) -> None:
    _check_positive("capacity", inputs.capacity)
    if isinstance(inputs.workers, bool) or not isinstance(inputs.workers, int) or inputs.workers < 0:
        raise InvalidArgument("workers", f"must be an integer >= 0, got {inputs.workers!r}")
    for name in config.classes:
        inp = inputs.classes.get(name)
        if inp is None:
            raise InvalidArgument(f"classes.{name}", "missing inputs")
        for field in ("compliance", "window_compliance"):
            value = getattr(inp, field)
            if value is not None and not 0 <= value <= 1:
                raise InvalidArgument(f"classes.{name}.{field}", "not in [0, 1]")
        if inp.samples < 0 or not math.isfinite(inp.used) or inp.used < 0:
            raise InvalidArgument(f"classes.{name}", "samples and used must be >= 0")


class _Plan:
    """Mutable scratch for one decision: new allowances, caps and reasons."""

    def __init__(self, state: ControlState, used: list[float], now_ms: float) -> None:
        self.config = state.config
        self.classes = list(state.classes)
        self.used = used  # shares of capacity, this tick's: cuts are sized from them (no lag)
        self.now_ms = now_ms
        self.reasons = ["hold"] * len(self.classes)
        self.moved: set[int] = set()

    def set(self, i: int, new: float, reason: str) -> None:
        self.classes[i] = replace(self.classes[i], allowance=new)
        self.reasons[i] = reason
        self.moved.add(i)

    def cut(self, i: int, new: float, reason: str, owner: int) -> None:
        """Lower ``a_i`` and remember: relax may return one step / halfway to the broken level."""
        level = min(self.classes[i].allowance, self.used[i])
        self.set(i, new, reason)
        if self.config.memory:
            cap = max(new, min(new * (1 + self.config.relax_step), (level + new) / 2))
            old = self.classes[i].cap
            cap = cap if old is None else min(cap, old)
            self.classes[i] = replace(self.classes[i], cap=cap, cap_owner=self.config.classes[owner],
                                      **_reference(self.config, self.classes[owner], self.now_ms))


def _tighten(plan: _Plan, k: int) -> None:
    """Class k violates: take tighten_step of the load below it, lowest first; else cut k."""
    cfg, cls, n = plan.config, plan.classes, len(plan.classes)
    lower = range(n - 1, k, -1)  # lowest priority first
    level = {i: min(cls[i].allowance, plan.used[i]) for i in lower}
    remaining = cfg.tighten_step * sum(level.values())
    cuts: dict[int, float] = {}
    for i in lower:  # borrowing first: it is best effort, lowest class first, as much as needed
        cuts[i] = min(remaining, max(0.0, level[i] - cfg.shares[i]))
        remaining -= cuts[i]
    for i in lower:  # then guarantees, lowest class first, each by at most tighten_step of its use
        room = min(level[i] - cuts[i] - cfg.min_shares[i], cfg.tighten_step * level[i])
        take = min(remaining, max(0.0, room))
        cuts[i] += take
        remaining -= take
    for i, take in cuts.items():
        new = level[i] - take
        if take > 0 and new < cls[i].allowance * (1 - cfg.min_change):
            plan.cut(i, new, f"tighten_lower_for_{cfg.classes[k]}", owner=k)
    for i in lower:  # classes this step did not cut: say why
        if i not in plan.moved and cls[i].allowance <= cfg.min_shares[i] * (1 + cfg.min_change):
            plan.reasons[i] = "floor"  # at its rate floor (the reason's name is in logs and docs)
        elif i not in plan.moved and level[i] <= cfg.min_shares[i]:
            plan.reasons[i] = "unused"  # too little load to be the interference
    if not any(i in plan.moved for i in lower):
        # Nothing below k can give. k's rates apply when workers claim: cutting k's own
        # ceiling would leave its queued requests waiting longer (and a GPU idle), never
        # shorter. Its demand beyond the pool is refused at admission (wait estimate).
        plan.reasons[k] = "overloaded"


def _relax(plan: _Plan, status: list[str]) -> None:
    """Everyone at and above i comfortable, i used its allowance: grow a_i, one tier at a time."""
    cfg = plan.config
    candidates: list[tuple[int, int, float]] = []
    for i, c in enumerate(plan.classes):
        above = status[: i + 1]
        if "band" in above:
            continue  # reason stays 'hold'
        limit = cfg.ceilings[i] if c.cap is None else min(cfg.ceilings[i], c.cap)
        new = min(limit, c.allowance * (1 + cfg.relax_step))
        if "waiting" in above:
            plan.reasons[i] = "waiting"
        elif new <= c.allowance * (1 + cfg.min_change):
            plan.reasons[i] = "ceiling" if limit == cfg.ceilings[i] else "capped"
        elif plan.used[i] < cfg.use_threshold * c.allowance:
            plan.reasons[i] = "unused"  # anti-windup: more budget would change nothing
        else:
            tier = 0 if i == 0 else (1 if c.allowance < cfg.shares[i] else 2)
            candidates.append((tier, i, new))
    if candidates:
        first = min(t for t, _, _ in candidates)
        for tier, i, new in candidates:
            if tier == first:
                plan.set(i, new, "relax")
            else:
                plan.reasons[i] = "priority"  # a higher tier is being restored first


def _track_load(state: ControlState, used: list[float], now_ms: float) -> ControlState:
    """Each class's ``load``: this tick's used share folded into an exponentially weighted
    mean over ``load_smoothing_s`` of time, whatever the tick. A clock that stepped back
    moves nothing."""
    tau_ms = state.config.load_smoothing_s * 1000
    dt = 0.0 if state.ticked_ms is None else max(0.0, now_ms - state.ticked_ms)
    keep = math.exp(-dt / tau_ms) if tau_ms > 0 else 0.0
    classes = []
    for c, u in zip(state.classes, used, strict=True):
        if c.load is None:
            classes.append(replace(c, load=u, load_weight=1.0, load_since_ms=now_ms))
        else:
            weight = keep * c.load_weight + 1.0
            classes.append(replace(c, load=c.load + (u - c.load) / weight, load_weight=weight))
    return replace(state, classes=tuple(classes), ticked_ms=now_ms)


def _reference(cfg: ControlConfig, owner: ClassState, now_ms: float) -> dict[str, object]:
    """A limit's reference: the owner's smoothed load now; still "young" (it keeps following
    the load) while that load has less than one ``load_smoothing_s`` of history -- a cut in a
    term's first seconds would otherwise be measured against a mean of two or three ticks."""
    young = now_ms - owner.load_since_ms < cfg.load_smoothing_s * 1000
    return {"cap_ref": owner.load or 0.0, "cap_ref_young": young, "cap_moved_ms": None}


def _forget_moved_limits(plan: _Plan) -> None:
    """Forget a remembered limit once its owner's smoothed load has been more than
    ``reset_load_change`` away from the limit's reference, on the same side, for half of
    ``load_smoothing_s`` (at once with no smoothing): its reason is gone."""
    cfg, now_ms = plan.config, plan.now_ms
    for i, c in enumerate(plan.classes):
        if c.cap is None or c.cap_owner is None:
            continue
        owner = plan.classes[cfg.classes.index(c.cap_owner)]
        if c.cap_ref_young:
            c = plan.classes[i] = replace(c, **_reference(cfg, owner, now_ms))
        ref, load = c.cap_ref, owner.load or 0.0
        if abs(load - ref) <= cfg.reset_load_change * max(ref, 1e-9):
            plan.classes[i] = replace(c, cap_moved_ms=None)
            continue
        up, since = load > ref, c.cap_moved_ms
        if since is None or c.cap_moved_up != up or since > now_ms:  # (a clock stepped back: afresh)
            since = now_ms
            c = plan.classes[i] = replace(c, cap_moved_ms=since, cap_moved_up=up)
        if now_ms - since >= cfg.load_smoothing_s * 500:
            plan.classes[i] = replace(c, cap=None, cap_owner=None, cap_ref=0.0, cap_moved_ms=None)


def _follow_capacity(state: ControlState, inputs: Inputs, now_ms: float,
                     cooling: bool) -> tuple[ControlState, bool]:
    """Whether to rescale to ``inputs.capacity`` now, and the state's drift bookkeeping.

    A worker joining or leaving is a real step: followed at once, cooldown or not (a pool that
    lost a worker must not stay overloaded for a cooldown). Any other move is followed only
    when it is large (beyond the dead band) and persistent (on the same side for
    ``capacity_persist_s``) and nothing is cooling down: the estimate's noise must not become
    rate noise that moves every client's 429 boundary."""
    cfg = state.config
    new, old = inputs.capacity, state.capacity
    if inputs.workers != state.workers:
        # A new term starts knowing no workers (0): its first count is not a worker joining.
        # Its first estimate is followed at once only beyond the dead band (what changed while
        # no leader watched); a failover used to rescale every rate on a few beats' noise.
        band = cfg.min_change if state.workers > 0 else cfg.capacity_deadband
        moved = abs(new - old) > band * old
        return replace(state, workers=inputs.workers, drift_since_ms=None), moved
    if abs(new - old) <= cfg.capacity_deadband * old:
        return replace(state, drift_since_ms=None), False
    up = new > old
    if state.drift_since_ms is not None and state.drift_since_ms > now_ms:
        state = replace(state, drift_since_ms=None)  # the clock stepped back: start the wait afresh
    if state.drift_since_ms is None or state.drift_up != up:
        return replace(state, drift_since_ms=now_ms, drift_up=up), cfg.capacity_persist_s == 0 and not cooling
    return state, now_ms - state.drift_since_ms >= cfg.capacity_persist_s * 1000 and not cooling


def decide(state: ControlState, inputs: Inputs, now_ms: float) -> Decision:
    """One controller tick: the new state and rates, with a reason per class."""
    cfg = state.config
    _check_inputs(cfg, inputs)
    old_rates = state.rates()
    ins = [inputs.classes[name] for name in cfg.classes]

    # A last change "in the future" means the clock stepped back (an NTP step, a failover to a
    # Redis whose clock is behind): not a reason to hold for the size of the step.
    since_ms = None if state.last_change_ms is None else now_ms - state.last_change_ms
    cooling = since_ms is not None and 0 <= since_ms < cfg.cooldown_s * 1000
    state, rescale = _follow_capacity(state, inputs, now_ms, cooling)
    if rescale:
        # Rescale every rate at once (a lost worker must not overload the rest); shares and
        # allowances are unchanged, remembered limits are void: the plant changed. A violation
        # episode goes on (it ends when the class is back above target, not on a rescale).
        # A smoothed load is the same work as a share of the new capacity.
        scale = state.capacity / inputs.capacity
        classes = tuple(
            ClassState(c.name, c.allowance, recovering=c.recovering, load_weight=c.load_weight,
                       load=None if c.load is None else min(1.0, c.load * scale),
                       load_since_ms=c.load_since_ms)
            for c in state.classes
        )
        new_state = ControlState(cfg, float(inputs.capacity), classes, now_ms, workers=inputs.workers,
                                 ticked_ms=state.ticked_ms)
        new_state = _track_load(new_state, [min(1.0, inp.used / inputs.capacity) for inp in ins], now_ms)
        reasons = ["capacity_change"] * len(ins)
        return _finish(new_state, ins, old_rates, reasons, now_ms, True, state.capacity)

    used = [min(1.0, inp.used / state.capacity) for inp in ins]
    state = _track_load(state, used, now_ms)
    plan = _Plan(state, used, now_ms)
    _forget_moved_limits(plan)

    status = [_status(cfg, inp, c.recovering) for inp, c in zip(ins, state.classes, strict=True)]
    violating = [k for k, s in enumerate(status) if s == "violating"]
    for k in violating:
        if not any(i in plan.moved for i in range(k, len(ins))):
            _tighten(plan, k)
    if not violating:
        _relax(plan, status)

    if plan.moved and cooling:
        for i in plan.moved:
            plan.classes[i] = state.classes[i]  # at most one change per cooldown
            plan.reasons[i] = "cooldown"
        plan.moved.clear()
    for i, (s, c) in enumerate(zip(status, plan.classes, strict=True)):  # episodes end at target
        plan.classes[i] = replace(c, recovering=c.recovering if s == "waiting" else s == "violating")
    last = now_ms if plan.moved else state.last_change_ms
    new_state = replace(state, classes=tuple(plan.classes), last_change_ms=last)
    return _finish(new_state, ins, old_rates, plan.reasons, now_ms, bool(plan.moved), state.capacity)


def _finish(
    new: ControlState,
    ins: list[ClassInputs],
    old_rates: dict[str, ClassRates],
    reasons: list[str],
    now_ms: float,
    changed: bool,
    old_capacity: float,
) -> Decision:
    new_rates = new.rates()
    out = []
    for c, inp, reason in zip(new.classes, ins, reasons, strict=True):
        if (
            reason not in ACTIONS
            and not reason.startswith("tighten_lower_for_")
            and new_rates[c.name] != old_rates[c.name]
        ):
            reason = "rebalance"  # its guarantee moved because another class's guarantee did
        out.append(
            ClassDecision(
                c.name,
                reason,
                inp.compliance,
                inp.window_compliance,
                inp.samples,
                inp.used,
                c.allowance,
                old_rates[c.name],
                new_rates[c.name],
            )
        )
    return Decision(now_ms, changed, old_capacity, new.capacity, new, tuple(out))
