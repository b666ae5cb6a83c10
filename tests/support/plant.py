"""A simulated GPU pool driven by the real controller code, in simulated time (no sleeping).

Used by tests/test_plant_stability.py to show the control law settles. Per tick of ``dt_s``:

1. **Dispatch** (fluid HTB, the allocation lua/claim.lua's tiers make at claim time): class
   i gets ``min(o_i, rate_i)`` from its guarantee; what the policy's capacity has left goes
   in priority order, each class up to its ceiling: ``A_i = own_i + min(o_i - own_i,
   ceil_i - own_i, spare)``. What a class offers beyond ``A_i`` is lost (in the real system it
   queues and is refused or expires once it cannot start within its max wait; the fluid
   model keeps only the rates, which is what the law acts on).
2. **Service**: the pool serves its true capacity ``C`` per second in strict priority from
   per-class fluid backlogs (a backlog only builds when admitted load exceeds ``C``, e.g.
   right after capacity drops and before the controller notices).
3. **Latency**: the GPU's occupancy ``rho_i`` follows ``A_i / C`` with a first-order lag of
   ``lag_s`` (work already admitted keeps running after a cut); utilisation
   ``rho = min(sum rho_i, max_utilisation)``; class k's waiting time is its backlog wait plus
   an exponential with mean::

       m_k = wait_scale_ms * (sum_{j<=k} rho_j + sum_{j>k} beta_j * rho_j) / (1 - rho)

   -- the residual-work term of an M/G/1 priority queue (higher classes and the class itself
   count at their load; lower classes at ``beta`` times it, because their long prompts are
   what stalls a step: the 32K-prefill stall of the original problem), over ``1 - rho`` because with
   continuous batching every admitted token slows every step. TTFT = prefill time + wait;
   TPOT = base x (1 + rho). It is convex in load and steepest for lower-class load, which is
   all the law relies on. A class may mix prompt lengths (``PlantClass.long``): a share of
   its requests has a long prompt whose own prefill adds to its TTFT whatever the load.
4. **Samples**: one per completed request, as a raw dict, through the real
   :func:`limiter.samples.decode_sample` into a real :class:`SloMonitor` and
   :class:`CapacityEstimator`. Each worker sends a heartbeat every ``heartbeat_s`` with its
   share of the true capacity times a noise factor: uniform +-``heartbeat_noise``, or --
   with ``noise`` set -- consecutive runs drawn from a recorded series of a real worker's
   figures over their median (a block bootstrap keeps the real run's spread and its
   autocorrelation; ``tests/data/heartbeat_noise.json`` is one).
5. **Control**: every ``control_every_s`` the real
   :func:`limiter.controller.control_law.decide` runs on the monitor's fresh and
   whole-window compliance, the estimator's capacity and served rates (over the last
   0.5 s: ``used`` must be current); a change becomes the admission policy and marks the
   windows at ``Decision.evidence_from_ms``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from limiter.controller.capacity import CapacityConfig, CapacityEstimator
from limiter.controller.control_law import (
    ClassInputs,
    ClassRates,
    ControlConfig,
    ControlState,
    Decision,
    Inputs,
    decide,
)
from limiter.controller.slo_window import DEFAULT_SLOS, SloMonitor
from limiter.samples import decode_sample
from limiter.slo import ClassSLO


@dataclass(frozen=True)
class LongPrompts:
    """A share of a class's requests with a long prompt, whose own prefill takes ``prefill_ms``."""

    share: float
    input_tokens: int
    prefill_ms: float


@dataclass(frozen=True)
class PlantClass:
    name: str
    input_tokens: int
    output_tokens: int
    prefill_ms: float  # TTFT on an idle pool
    tpot_ms: float  # time per output token on an idle pool
    beta: float  # how much a unit of this class's load delays higher classes
    long: LongPrompts | None = None  # a mix of prompt lengths: this share of requests is long

    @property
    def cost(self) -> float:
        """A request's mean cost (weights 1: cost = tokens)."""
        long_share, long_tokens = (self.long.share, self.long.input_tokens) if self.long else (0.0, 0)
        prompt = (1.0 - long_share) * self.input_tokens + long_share * long_tokens
        return float(prompt + self.output_tokens)


DEFAULT_PLANT_CLASSES = (
    PlantClass("P0", 200, 100, 120.0, 20.0, 1.0),
    PlantClass("P1", 600, 200, 300.0, 30.0, 1.5),
    PlantClass("P2", 2500, 500, 1000.0, 40.0, 3.0),
)


@dataclass(frozen=True)
class PlantConfig:
    capacity: float = 100_000.0  # true capacity, weighted tokens/s (e.g. 8 GPUs)
    workers: int = 8
    dt_s: float = 0.1
    control_every_s: float = 0.5
    wait_scale_ms: float = 10.0
    max_utilisation: float = 0.98
    lag_s: float = 2.0  # admitted work reaches (and leaves) the GPU with this time constant
    heartbeat_noise: float = 0.01  # uniform +- this, unless ``noise`` is given
    heartbeat_s: float = 1.0
    noise: tuple[float, ...] = ()  # recorded heartbeat figures / their median (block bootstrap)
    noise_block: int = 10  # consecutive recorded values per draw
    capacity_window: int = 10  # the estimator's median window (CapacityConfig.window)
    classes: tuple[PlantClass, ...] = DEFAULT_PLANT_CLASSES
    slos: Mapping[str, ClassSLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    seed: int = 1


@dataclass(frozen=True)
class Trace:
    """Per tick: policy rates and ceilings, admitted load, window compliance; and decisions."""

    dt_s: float
    times: list[float]
    rates: dict[str, list[float]]
    ceils: dict[str, list[float]]
    admitted: dict[str, list[float]]
    compliance: dict[str, list[float | None]]
    decisions: list[Decision]  # the ones that changed something

    def series(self) -> dict[str, list[float]]:
        """Every controlled output, keyed 'P0.rate', 'P0.ceil', ...: what 'settles' refers to."""
        out = {f"{c}.rate": v for c, v in self.rates.items()}
        return out | {f"{c}.ceil": v for c, v in self.ceils.items()}


def admit(
    offered: Mapping[str, float], policy: Mapping[str, ClassRates], capacity: float
) -> dict[str, float]:
    """Fluid HTB dispatch: own guarantee first, then spare capacity up to ceil, by priority."""
    own = {c: min(offered[c], r.rate) for c, r in policy.items()}
    spare = max(0.0, capacity - sum(own.values()))
    out = {}
    for c, r in policy.items():  # dicts keep priority order
        borrow = max(0.0, min(offered[c] - own[c], r.ceil - own[c], spare))
        spare -= borrow
        out[c] = own[c] + borrow
    return out


def simulate(
    control: ControlConfig,
    offered: Callable[[float], Mapping[str, float]],
    duration_s: float,
    plant: PlantConfig | None = None,
    capacity_at: Callable[[float], float] | None = None,
    workers_at: Callable[[float], int] | None = None,
) -> Trace:
    """Run the loop for ``duration_s`` simulated seconds; ``offered(t)`` is tokens/s per class.

    ``capacity_at(t)``: the pool's true capacity (every worker slows down or speeds up);
    ``workers_at(t)``: how many workers are alive, each worth ``capacity / workers`` (a
    worker that dies leaves the heartbeats, one that starts joins them)."""
    plant = plant or PlantConfig()
    names = [c.name for c in plant.classes]
    rng = random.Random(plant.seed)
    monitor = SloMonitor({n: plant.slos.get(n, ClassSLO()) for n in names}, size=control.window)
    # "used" must be current: served work over the last half second (see ClassInputs.used).
    tunables = CapacityConfig(interval_s=0.5, rate_intervals=1, window=plant.capacity_window)
    estimator = CapacityEstimator(tunables, plant.capacity)
    state = ControlState.initial(control, plant.capacity)
    policy, backlog, carry = state.rates(), dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    busy = [0.0] * len(names)  # share of capacity each class occupies in the GPU (lagged)
    trace = Trace(
        dt_s=plant.dt_s,
        times=[],
        rates={n: [] for n in names},
        ceils={n: [] for n in names},
        admitted={n: [] for n in names},
        compliance={n: [] for n in names},
        decisions=[],
    )
    every = max(1, round(plant.control_every_s / plant.dt_s))
    beat = max(1, round(plant.heartbeat_s / plant.dt_s))
    noises = [_Noise(plant, random.Random(plant.seed * 1000 + w)) for w in range(4 * plant.workers)]
    for tick in range(round(duration_s / plant.dt_s)):
        t = (tick + 1) * plant.dt_s
        now_ms = t * 1000.0
        live = workers_at(t) if workers_at else plant.workers
        per_worker = (capacity_at(t) if capacity_at else plant.capacity) / plant.workers
        true_c = per_worker * live
        admitted = admit(offered(t), policy, state.capacity)
        # Work in the GPU follows admission with a first-order lag: requests already admitted
        # keep running after a cut, which is why the law waits (cooldown) between changes.
        gain = min(1.0, plant.dt_s / plant.lag_s) if plant.lag_s > 0 else 1.0
        for i, n in enumerate(names):
            busy[i] += gain * (admitted[n] / true_c - busy[i])
        rho = busy
        util = min(sum(rho), plant.max_utilisation)
        budget = true_c * plant.dt_s
        for k, pc in enumerate(plant.classes):
            backlog[pc.name] += admitted[pc.name] * plant.dt_s
            served = min(backlog[pc.name], budget)
            backlog[pc.name] -= served
            budget -= served
            ahead_ms = sum(backlog[n] for n in names[: k + 1]) / true_c * 1000.0
            lower = zip(plant.classes[k + 1 :], rho[k + 1 :], strict=True)
            load = sum(rho[: k + 1]) + sum(c.beta * r for c, r in lower)
            mean_wait = plant.wait_scale_ms * load / (1.0 - util)
            carry[pc.name] += served / pc.cost
            count, carry[pc.name] = divmod(carry[pc.name], 1.0)
            for _ in range(int(count)):
                wait = ahead_ms + rng.expovariate(1.0 / mean_wait) if mean_wait > 0 else ahead_ms
                _record(monitor, estimator, pc, wait, util, now_ms, rng)
        if tick % beat == beat - 1:
            estimator.set_alive({f"w{w}": now_ms for w in range(live)})
            for w in range(live):
                estimator.observe_worker(f"w{w}", per_worker * noises[w].next(), now_ms)
        if tick % every == every - 1:
            state = _control(state, monitor, estimator, names, now_ms, trace)
            policy = state.rates()
        trace.times.append(t)
        for n in names:
            trace.rates[n].append(policy[n].rate)
            trace.ceils[n].append(policy[n].ceil)
            trace.admitted[n].append(admitted[n])
            trace.compliance[n].append(monitor.windows[n].stats().compliance)
    return trace


class _Noise:
    """One worker's heartbeat noise factors: uniform, or blocks of a recorded series."""

    def __init__(self, plant: PlantConfig, rng: random.Random) -> None:
        self.plant, self.rng, self.block = plant, rng, []  # type: list[float]

    def next(self) -> float:
        series = self.plant.noise
        if not series:
            return 1.0 + self.plant.heartbeat_noise * self.rng.uniform(-1.0, 1.0)
        if not self.block:
            n = min(self.plant.noise_block, len(series))
            start = self.rng.randrange(len(series) - n + 1)
            self.block = list(series[start:start + n])
        return self.block.pop(0)


def _record(
    monitor: SloMonitor, estimator: CapacityEstimator, pc: PlantClass, wait: float, util: float,
    now_ms: float, rng: random.Random,
) -> None:
    tpot = pc.tpot_ms * (1.0 + util)
    input_tokens, prefill_ms = pc.input_tokens, pc.prefill_ms
    if pc.long is not None and rng.random() < pc.long.share:
        input_tokens, prefill_ms = pc.long.input_tokens, pc.long.prefill_ms
    ttft = prefill_ms + wait
    raw = {
        "class": pc.name,
        "outcome": "ok",
        "ts_ms": now_ms,
        "input_tokens": input_tokens,
        "output_tokens": pc.output_tokens,
        "queue_wait_ms": wait,
        "ttft_ms": ttft,
        "tpot_mean_ms": tpot,
        "tpot_max_ms": 2.0 * tpot,
        "e2e_ms": ttft + tpot * (pc.output_tokens - 1),
    }
    sample = decode_sample(raw)
    monitor.add(sample)
    estimator.observe_sample(sample)


def _control(
    state: ControlState,
    monitor: SloMonitor,
    estimator: CapacityEstimator,
    names: list[str],
    now_ms: float,
    trace: Trace,
) -> ControlState:
    stats = monitor.stats(now_ms)
    estimate = estimator.estimate(now_ms)
    inputs = Inputs(
        estimate.value,
        {
            n: ClassInputs(
                s.fresh_compliance, s.fresh_count, estimator.served_rate(n), s.has_target, s.compliance
            )
            for n, s in stats.items()
        },
        estimate.live_workers if estimate.source == "workers" else 0,
    )
    decision = decide(state, inputs, now_ms)
    if decision.evidence_from_ms is not None:
        monitor.mark(decision.evidence_from_ms)
        trace.decisions.append(decision)
    return decision.state


def step_load(
    before: Mapping[str, float], after: Mapping[str, float], at_s: float
) -> Callable[[float], dict[str, float]]:
    """Offered load that switches from ``before`` to ``after`` at ``at_s``."""
    return lambda t: dict(after if t >= at_s else before)


@dataclass(frozen=True)
class StepMetrics:
    """How the controlled outputs answered a step at ``step_s`` (definitions in the docstrings).

    * ``settling_s``: per output series, the time after the step from which it stays within
      +-``band`` (5 %) of its final value; the worst series.
    * ``overshoot``: per series, how far it went beyond its final value in the direction it
      moved (up or down from its pre-step value), as a fraction of the final value; a series
      that ends where it started counts any excursion. The worst series.
    * ``oscillation``: per series, (max - min) / mean over the last ``final_window_s``; worst.
    * ``recovery_s``: time after the step until the watched class's window compliance is back
      at >= target after first falling below it (0 if it never fell; None if it never came back).
    * ``final_min_compliance``: the watched class's lowest window compliance over the final window.
    * ``changes``: decisions that changed something after the step; ``last_change_s``: when
      the last of them came, after the step (0 if none).
    """

    settling_s: float
    overshoot: float
    oscillation: float
    recovery_s: float | None
    min_compliance: float
    final_min_compliance: float
    changes: int
    last_change_s: float
    worst: dict[str, str]


def step_metrics(
    trace: Trace,
    step_s: float,
    final_window_s: float = 30.0,
    band: float = 0.05,
    target: float = 0.99,
    watch: str = "P0",
) -> StepMetrics:
    times = trace.times
    after = [i for i, t in enumerate(times) if t >= step_s]
    before = max(after[0] - 1, 0)
    final = [i for i, t in enumerate(times) if t > times[-1] - final_window_s]
    settle: dict[str, float] = {}
    over: dict[str, float] = {}
    osc: dict[str, float] = {}
    for name, xs in trace.series().items():
        xf, x0 = xs[-1], xs[before]
        outside = [i for i in after if abs(xs[i] - xf) > band * abs(xf)]
        settle[name] = times[outside[-1] + 1] - step_s if outside else 0.0
        tail = [xs[i] for i in after]
        if xf < x0:
            excess = xf - min(tail)
        elif xf > x0:
            excess = max(tail) - xf
        else:
            excess = max(abs(x - xf) for x in tail)
        over[name] = max(0.0, excess) / abs(xf) if xf else 0.0
        window = [xs[i] for i in final]
        mean = sum(window) / len(window)
        osc[name] = (max(window) - min(window)) / mean if mean else 0.0
    comp = [(times[i], trace.compliance[watch][i]) for i in after]
    values = [c for _, c in comp if c is not None]
    dip = next((t for t, c in comp if c is not None and c < target), None)
    back = (
        None if dip is None else next((t for t, c in comp if t > dip and c is not None and c >= target), None)
    )
    recovery = 0.0 if dip is None else (None if back is None else back - step_s)
    moves = [d.now_ms / 1000.0 for d in trace.decisions if d.now_ms / 1000.0 >= step_s]
    final_comp = [c for i in final if (c := trace.compliance[watch][i]) is not None]
    worst = {
        "settling_s": max(settle, key=settle.__getitem__),
        "overshoot": max(over, key=over.__getitem__),
        "oscillation": max(osc, key=osc.__getitem__),
    }
    return StepMetrics(
        settling_s=max(settle.values()),
        overshoot=max(over.values()),
        oscillation=max(osc.values()),
        recovery_s=recovery,
        min_compliance=min(values) if values else 1.0,
        final_min_compliance=min(final_comp) if final_comp else 1.0,
        changes=len(moves),
        last_change_s=max(moves, default=step_s) - step_s,
        worst=worst,
    )
