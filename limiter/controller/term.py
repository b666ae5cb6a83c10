"""A *term*: one leadership of one pool, and everything the controller learns during it.

A new leader does not inherit its predecessor's memory (windows, capacity EWMA, the law's
remembered limits): they died with that process. It does inherit what is in Redis, and
that is enough to continue without a jump:

* the law's allowances are read back from the policy hash: ``a_i = <class>.ceil / capacity``
  (every class's ceiling is ``a_i C``, docs/control-law.md), so a failover does not undo the
  cuts the old leader made -- starting "fully relaxed" would;
* ``updated_ms`` (set by ``set_rates``) is the last change: the cooldown still holds, and
  samples that finished before ``updated_ms + settle_s`` are not counted as fresh evidence;
* the capacity the policy was written with is the estimator's initial value, so the first
  tick does not see a capacity "change".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from limiter.config import PoolConfig, QosConfig
from limiter.controller.capacity import CapacityEstimator
from limiter.controller.control_law import ClassState, ControlState, Decision
from limiter.controller.settings import ControllerSettings
from limiter.controller.slo_window import SloMonitor
from limiter.controller.usage import UsageMeter


@dataclass
class Term:
    fence: int
    state: ControlState
    monitor: SloMonitor
    estimator: CapacityEstimator
    usage: UsageMeter
    caught_up: bool = False  # own pending entries replayed and the dead leader's claimed
    next_claim: float = 0.0  # monotonic time of the next periodic XAUTOCLAIM
    consumed: int = 0  # samples fed into the windows in this term
    bad: int = 0  # samples skipped as unusable
    unacked: set[bytes] = field(default_factory=set)  # fed, but the XACK failed: never feed twice
    workers: dict[str, float] = field(default_factory=dict)  # worker -> heartbeat ms last used
    # worker -> (its heartbeat's stamp, the Redis time this term first saw that stamp): a
    # stamp ahead of Redis's clock is read as written when first seen (observe.read_heartbeats)
    beats: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_decision: Decision | None = None
    # class -> it used less than its guaranteed rate at the last tick, or is the top class
    # (absent: not known yet): only then is a request turned away at admission counted as an
    # SLO miss (loop.feed)
    within_guarantee: dict[str, bool] = field(default_factory=dict)


def parse_float(value: object) -> float | None:
    try:
        v = float(value.decode() if isinstance(value, bytes) else str(value))
    except (TypeError, ValueError, AttributeError):
        return None
    return v if math.isfinite(v) else None


def policy_fields(raw: Mapping[object, object]) -> dict[str, object]:
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}


def new_term(fence: int, policy: Mapping[str, object], cfg: QosConfig, pool: PoolConfig,
             settings: ControllerSettings, now_ms: float | None = None) -> Term:
    """Build a term's state from the pool's policy hash (see the module docstring). A last
    change after ``now_ms`` (Redis's clock stepped back since) is taken as none: the law
    would hold, and the windows take nothing as fresh, for the size of the step."""
    control = settings.control_config(cfg)
    capacity = parse_float(policy.get("capacity"))
    if capacity is None or capacity <= 0:
        capacity = pool.capacity_tokens_s
    classes = []
    for name, min_share, ceiling in zip(control.classes, control.min_shares, control.ceilings, strict=True):
        ceil = parse_float(policy.get(f"{name}.ceil"))
        allowance = ceiling if ceil is None else min(ceiling, max(min_share, ceil / capacity))
        classes.append(ClassState(name, allowance))
    last = parse_float(policy.get("updated_ms"))
    if last is not None and now_ms is not None and last > now_ms:
        last = None
    state = ControlState(control, capacity, tuple(classes), last)
    monitor = SloMonitor(settings.slos(cfg), size=control.window, max_age_s=settings.window_max_age_s or None)
    if last is not None:
        monitor.mark(last + control.settle_s * 1000)
    estimator = settings.capacity_estimator(cfg, capacity)
    usage = UsageMeter(control.classes, settings.used_window_s, settings.cost_samples,
                       settings.used_min_claims, settings.used_max_window_s)
    return Term(fence, state, monitor, estimator, usage)
